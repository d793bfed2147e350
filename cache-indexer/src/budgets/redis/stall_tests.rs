//! The Redis store against a real `redis-server` (a free loopback port, no
//! persistence, killed at the end) that is stalled (SIGSTOP) while reserves
//! are in flight: they time out and are decided locally, Redis runs them
//! when it resumes, and the first call after that undoes them, so the
//! tenant's slots are free again. And the script's `abandon` on its own:
//! in either order with its reserve, and never freeing another attempt's
//! reservation. Fails, naming the package, where `redis-server` is not
//! installed (`make setup` installs it).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvasir_budget::{Limits, Request};

use super::script::{BudgetStore, Op};
use super::*;

/// A `redis-server` on a free 127.0.0.1 port; killed (and resumed first,
/// should a test stop midway) on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    async fn start() -> Server {
        let mut why = Vec::new();
        for _ in 0..3 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let child = Command::new("redis-server")
                .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect(
                    "redis-server is not installed: `make setup` installs Debian's redis-server",
                );
            let mut s = Server { child, port };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if s.child.try_wait().ok().flatten().is_some() {
                    break;
                }
                if s.query::<String>(&["PING"]).await.as_deref() == Some("PONG") {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            why.push(format!("port {port}: no PONG"));
        }
        panic!("redis-server would not start: {why:?}");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig}");
    }

    /// One command on a connection of its own (bounded); `None` on failure.
    async fn query<T: redis::FromRedisValue>(&self, args: &[&str]) -> Option<T> {
        let client = redis::Client::open(self.url()).ok()?;
        let fut = async {
            let mut c = client.get_multiplexed_async_connection().await.ok()?;
            redis::cmd(args[0])
                .arg(&args[1..])
                .query_async::<T>(&mut c)
                .await
                .ok()
        };
        tokio::time::timeout(Duration::from_secs(2), fut)
            .await
            .ok()
            .flatten()
    }

    async fn open_reservations(&self, key: &str) -> Option<i64> {
        self.query(&["HLEN", &format!("t:budget:{key}:open")]).await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for `cond` up to `within`.
async fn until<F: std::future::Future<Output = bool>>(
    within: Duration,
    mut cond: impl FnMut() -> F,
) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

fn concurrent(n: u32) -> Limits {
    Limits {
        max_concurrent: Some(n),
        ..Limits::default()
    }
}

fn ask(id: &str) -> Ask {
    Ask {
        key: "beta".into(),
        request_id: id.into(),
        limits: concurrent(2),
        default_output_tokens: 16,
        max_tokens: Some(16),
        prompt_tokens: 10,
        cached_tokens: 0,
        max_age_ms: 300_000,
    }
}

fn end(id: &str) -> Report {
    Report {
        key: Some("beta".into()),
        request_id: id.into(),
        op: ReportOp::Cancel,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserves_that_timed_out_in_a_stall_are_undone_when_redis_resumes() {
    let redis = Server::start().await;
    let b = RedisBudgets::new(&RedisSettings {
        url: redis.url(),
        timeout: Duration::from_millis(100),
        retry_after: Duration::from_millis(300),
        key_prefix: "t:".into(),
        on_store_down: OnStoreDown::Local,
        replicas: Some(1),
    })
    .unwrap();
    let m = BudgetMetrics::default();
    // Connected, the script loaded: a reservation in Redis, ended.
    assert!(matches!(
        b.reserve(0, &ask("warm"), &m).await,
        Reserved::Admitted { .. }
    ));
    assert_eq!(b.report(0, &end("warm")).await.key.as_deref(), Some("beta"));
    assert_eq!(redis.open_reservations("beta").await, Some(0));

    // Redis stopped with two picks' reserves written to its socket: both
    // time out and are admitted by the local budget; they end while Redis
    // is still stopped (their ends settle locally).
    redis.signal("-STOP");
    let (s1, s2) = (ask("s1"), ask("s2"));
    let (x, y) = tokio::join!(b.reserve(1, &s1, &m), b.reserve(1, &s2, &m));
    assert!(matches!(x, Reserved::Admitted { .. }), "{x:?}");
    assert!(matches!(y, Reserved::Admitted { .. }), "{y:?}");
    // (The connection's own response timeout may answer first: "failed".)
    let st = b.stats();
    let gave_up = st.errors_of("reserve", "timeout") + st.errors_of("reserve", "failed");
    assert_eq!(gave_up, 2);
    assert_eq!(b.store().abandoned().len(), 2);
    for id in ["s1", "s2"] {
        b.report(2, &end(id)).await;
    }
    assert_eq!(b.stats().local_reports.get(), 2);

    // Resumed: Redis runs the two reserves it had read, which take both of
    // the tenant's slots (what locked it out until their max age)...
    redis.signal("-CONT");
    let ran = until(Duration::from_secs(5), || async {
        redis.open_reservations("beta").await == Some(2)
    })
    .await;
    assert!(
        ran,
        "the stalled reserves ran: {:?}",
        redis.open_reservations("beta").await
    );
    // ...and the first pick once the retry delay is over undoes them in
    // front of its own reserve: admitted, by Redis.
    assert!(
        until(Duration::from_secs(5), || async { !b.store().resting() }).await,
        "the retry delay ends"
    );
    let r = b.reserve(3, &ask("after"), &m).await;
    assert!(matches!(r, Reserved::Admitted { .. }), "{r:?}");
    assert_eq!(redis.open_reservations("beta").await, Some(1));
    let a = b.store().abandoned();
    assert_eq!(
        (a.given_up.get(), a.answered.get(), a.dropped.get(), a.len()),
        (2, 2, 0, 0)
    );
    assert_eq!(b.stats().down_picks[1].get(), 0);
    // A second pick takes the other slot; a third is refused by Redis
    // (the concurrency limit, not the store).
    assert!(matches!(
        b.reserve(3, &ask("after2"), &m).await,
        Reserved::Admitted { .. }
    ));
    assert!(matches!(
        b.reserve(3, &ask("after3"), &m).await,
        Reserved::Limited { .. }
    ));
}

/// One script call through the store (its own pipeline), the reply.
async fn run(s: &BudgetStore, op: &Op<'_>, limits: Option<&Limits>) -> Vec<i64> {
    let mut r = s.eval(&[s.args("k", limits, op, None)]).await.unwrap();
    redis::from_redis_value::<Vec<i64>>(r.remove(0)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandon_works_in_either_order_and_never_frees_another_attempts_slot() {
    let redis = Server::start().await;
    let s = BudgetStore::new(
        &redis.url(),
        Duration::from_secs(2),
        Duration::from_millis(300),
        "t:",
    )
    .unwrap();
    let l = concurrent(1);
    let req = Request {
        prompt_tokens: 10,
        cached_tokens: 0,
        output_tokens: 5,
    };
    let reserve = |id, token| Op::Reserve {
        id,
        req: &req,
        max_age_ms: Some(300_000),
        token,
    };
    // The abandon first (the reserve still on its way): the token is
    // remembered, and the reserve, when it runs, opens nothing.
    assert_eq!(
        run(
            &s,
            &Op::Abandon {
                id: "r",
                token: "A"
            },
            None
        )
        .await,
        [0]
    );
    assert_eq!(run(&s, &reserve("r", "A"), Some(&l)).await[0], 5);
    assert_eq!(redis.open_reservations("k").await, Some(0));
    // The same request picked again (another attempt) is admitted, and a
    // repeated abandon of the first leaves it alone.
    assert_eq!(run(&s, &reserve("r", "B"), Some(&l)).await[0], 0);
    assert_eq!(
        run(
            &s,
            &Op::Abandon {
                id: "r",
                token: "A"
            },
            None
        )
        .await,
        [0]
    );
    assert_eq!(redis.open_reservations("k").await, Some(1));
    // Its own abandon cancels it (slot and held cost back); again, nothing.
    assert_eq!(
        run(
            &s,
            &Op::Abandon {
                id: "r",
                token: "B"
            },
            None
        )
        .await,
        [1]
    );
    assert_eq!(redis.open_reservations("k").await, Some(0));
    assert_eq!(
        run(
            &s,
            &Op::Abandon {
                id: "r",
                token: "B"
            },
            None
        )
        .await,
        [0]
    );
    assert_eq!(run(&s, &reserve("q", "C"), Some(&l)).await[0], 0);
    // A settle keeps the attempt's token with the reservation.
    let u = kvasir_budget::Usage {
        prompt_tokens: 10,
        cached_tokens: 0,
        completion_tokens: 9,
    };
    assert_eq!(
        run(&s, &Op::Settle { id: "q", usage: &u }, None).await[0],
        1
    );
    assert_eq!(
        run(
            &s,
            &Op::Abandon {
                id: "q",
                token: "C"
            },
            None
        )
        .await,
        [1]
    );
    // A reserve without a token (a caller from before tokens) is never
    // matched by an abandon.
    assert_eq!(run(&s, &reserve("p", ""), Some(&l)).await[0], 0);
    assert_eq!(
        run(
            &s,
            &Op::Abandon {
                id: "p",
                token: "D"
            },
            None
        )
        .await,
        [0]
    );
    assert_eq!(redis.open_reservations("k").await, Some(1));
    // The remembered tokens expire with their key.
    let ttl: i64 = redis.query(&["PTTL", "t:budget:k:gone"]).await.unwrap();
    assert!((1..=300_000).contains(&ttl), "{ttl}");
}
