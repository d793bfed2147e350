//! A dead engine leaves picks at once; a blip on a live engine's event
//! socket costs nothing. Real `vllm-sim` processes over real ZMQ
//! and HTTP, a real indexer scraping only once a second (the most the
//! config allows), so the ticks cannot explain what happens within 100 ms.
//!
//! * Killed with SIGKILL right after a scrape, the engine holding a
//!   conversation's prefix is no longer listed by a pick 100 ms later: its
//!   event socket disconnected, the indexer probed it, the connection was
//!   refused.
//! * A live engine whose event connection is cut (a TCP proxy between the
//!   indexer and the engine's PUB socket drops its connections) is probed
//!   too; it answers, so it stays healthy and keeps its prefix credit.

use crate::service_support;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvasir_cache_indexer::types::EndpointId;
use kvasir_cache_indexer::Pool;
use kvasir_proto::v1 as pb;
use parking_lot::Mutex;
use service_support::*;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A TCP proxy to a local port whose open connections can be cut.
struct Proxy {
    port: u16,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn({
            let conns = Arc::clone(&conns);
            async move {
                while let Ok((mut down, _)) = listener.accept().await {
                    let task = tokio::spawn(async move {
                        let Ok(mut up) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    });
                    conns.lock().push(task);
                }
            }
        });
        Proxy {
            port,
            conns,
            accept,
        }
    }

    /// Closes every open connection (new ones are still accepted).
    fn cut(&self) -> usize {
        let mut conns = self.conns.lock();
        let n = conns.iter().filter(|t| !t.is_finished()).count();
        for t in conns.drain(..) {
            t.abort();
        }
        n
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Two engines and an indexer scraping every second; with `proxied`, each
/// engine's events reach the indexer through a [`Proxy`].
struct Bench {
    sims: Vec<Sim>,
    proxies: Vec<Proxy>,
    ix: Running,
}

impl Bench {
    async fn start(proxied: bool) -> Bench {
        let sims = Sim::start_many(2).await;
        let mut cfg = config(&sims.iter().collect::<Vec<_>>());
        let mut proxies = Vec::new();
        if proxied {
            for (s, e) in sims.iter().zip(cfg.pools[0].endpoints.iter_mut()) {
                let p = Proxy::start(s.events).await;
                e.events = Some(format!("tcp://127.0.0.1:{}", p.port));
                proxies.push(p);
            }
        }
        cfg.pools[0].scrape.interval_ms = 1000;
        cfg.pools[0].scrape.timeout_ms = 200;
        cfg.pools[0].scrape.unhealthy_after = 3;
        let ix = start_indexer(&cfg).await;
        ix.wait_ready().await;
        Bench { sims, proxies, ix }
    }

    fn pool(&self) -> &Arc<Pool> {
        self.ix.indexer.pools.get(POOL).expect("pool")
    }

    fn position(&self, address: &str) -> usize {
        self.sims
            .iter()
            .position(|s| s.address() == address)
            .unwrap_or_else(|| panic!("no simulator at {address}"))
    }

    /// Serves a conversation's first turn where it is picked, reports it
    /// done and waits until its blocks are indexed; adds the answer and a
    /// next question to the conversation and returns the engine.
    async fn first_turn(&self, messages: &mut Vec<(&str, String)>) -> String {
        let pick = self.ix.pick(chat_pick("turn-1", messages)).await;
        let address = pick.endpoints[0].address.clone();
        let resp = self.sims[self.position(&address)].chat(messages, 8).await;
        self.ix
            .report(served_done("turn-1", &address, &resp, 8))
            .await;
        self.ix.wait_settled(&address).await;
        messages.push(("assistant", reply(&resp)));
        messages.push(("user", "And then?".into()));
        address
    }

    /// Waits (bounded) until the endpoint was scraped less than 50 ms ago,
    /// so its next tick is more than 900 ms away.
    async fn just_scraped(&self, address: &str) {
        wait_for("a fresh scrape", Duration::from_secs(3), || async {
            let age = self.ix.endpoint_state(address).await.last_scrape_age_ms;
            age > 0 && age < 50
        })
        .await;
    }

    fn refused_marks(&self, address: &str) -> u64 {
        let id = EndpointId::from_address(address);
        self.pool().load.views([id], Instant::now())[0].refused_marks
    }
}

fn conversation() -> Vec<(&'static str, String)> {
    vec![(
        "user",
        format!("Liveness conversation: {}", filler(77, 300)),
    )]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_leaves_picks_within_100_ms() {
    let mut b = Bench::start(false).await;
    let mut messages = conversation();
    let x = b.first_turn(&mut messages).await;
    let pick = b.ix.pick(chat_pick("turn-2a", &messages)).await;
    assert_eq!(pick.endpoints[0].address, x, "{pick:?}");
    assert!(pick.endpoints[0].predicted_cached_tokens > 0, "{pick:?}");

    b.just_scraped(&x).await;
    let xi = b.position(&x);
    let killed = Instant::now();
    b.sims[xi].kill();
    // Picks every 5 ms until the engine is no longer listed (bounded by
    // 2 s, so a failure says how late it was).
    let mut gone_after = None;
    for i in 0..400 {
        let pick =
            b.ix.pick(chat_pick(&format!("turn-2b{i}"), &messages))
                .await;
        if pick.endpoints.iter().all(|e| e.address != x) {
            gone_after = Some(killed.elapsed());
            break;
        }
        if killed.elapsed() >= Duration::from_secs(2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let probes = b.pool().liveness.probes();
    eprintln!("killed engine left out of picks {gone_after:?} after the kill ({probes} probes)");
    let gone_after = gone_after.expect("the killed engine listed 2 s after the kill");
    assert!(
        gone_after < Duration::from_millis(100),
        "the killed engine listed {gone_after:?} after the kill ({probes} probes)"
    );
    let s = b.ix.endpoint_state(&x).await;
    assert!(!s.healthy);
    assert_eq!(s.indexed_blocks, 0, "its blocks dropped: {s:?}");
    assert_eq!(b.refused_marks(&x), 1);
    assert!(b.pool().liveness.probes() >= 1);
    b.ix.indexer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blip_on_a_live_engines_event_socket_keeps_its_prefix() {
    let b = Bench::start(true).await;
    let mut messages = conversation();
    let x = b.first_turn(&mut messages).await;
    let blocks = b.ix.endpoint_state(&x).await.indexed_blocks;
    let xi = b.position(&x);

    // Scraped 100-200 ms ago: a fresh scrape now can only be the probe.
    b.just_scraped(&x).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let probes = b.pool().liveness.probes();
    let cut = b.proxies[xi].cut();
    assert!(cut >= 1, "no event connection to cut");
    wait_for("a liveness probe", Duration::from_secs(2), || async {
        b.pool().liveness.probes() > probes
    })
    .await;
    // The probe's answer is recorded as a scrape: wait for it (well before
    // the next tick).
    wait_for("the probe answered", Duration::from_millis(500), || async {
        b.ix.endpoint_state(&x).await.last_scrape_age_ms < 50
    })
    .await;
    let s = b.ix.endpoint_state(&x).await;
    assert!(s.healthy, "{s:?}");
    assert_eq!(s.indexed_blocks, blocks, "blocks kept: {s:?}");
    assert_eq!(b.refused_marks(&x), 0);

    let pick = b.ix.pick(chat_pick("turn-2", &messages)).await;
    assert_eq!(pick.endpoints[0].address, x, "{pick:?}");
    assert_eq!(pick.decision, pb::Decision::Prefix as i32, "{pick:?}");
    assert!(pick.endpoints[0].predicted_cached_tokens > 0, "{pick:?}");
    // The stream comes back through the proxy.
    wait_for("back in sync", Duration::from_secs(10), || async {
        b.ix.endpoint_state(&x).await.sync_state == pb::SyncState::InSync as i32
    })
    .await;
    b.ix.indexer.shutdown().await;
}
