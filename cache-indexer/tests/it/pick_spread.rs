//! Cold prefixes spread: `make demo`'s conversations, picked
//! against real `vllm-sim` processes over real ZMQ and HTTP. Two tenants,
//! each with a long system prompt its conversations share, three
//! conversations each, turns sent one at a time to three idle engines:
//! each engine starts two conversations, and every later turn goes where
//! its conversation started.

use crate::service_support;
use std::collections::HashMap;
use std::time::Duration;

use kvasir_proto::v1 as pb;
use service_support::*;

const TENANTS: [&str; 2] = [
    "You are Acme Corp's support assistant. Acme sells industrial robots.",
    "You are Beta Labs' research assistant. Beta Labs studies protein folding.",
];
const CONVERSATIONS_PER_TENANT: usize = 3;
const TURNS: usize = 4;

/// A conversation: its tenant's system prompt, then its turns.
struct Conversation {
    messages: Vec<(&'static str, String)>,
}

impl Conversation {
    fn new(tenant: usize) -> Conversation {
        // About 1,500 tokens, as the demo's.
        let system = format!("{} {}", TENANTS[tenant], filler(tenant as u64 + 1, 1200));
        Conversation {
            messages: vec![("system", system)],
        }
    }
}

/// Waits until the indexer's last scrapes show every engine idle, so the
/// next pick is decided by prefixes and placements alone, as when a user
/// types the next turn.
async fn wait_idle(ix: &Running) {
    wait_for("every engine idle", Duration::from_secs(10), || async {
        ix.state()
            .await
            .endpoints
            .iter()
            .all(|e| e.running == 0 && e.waiting == 0 && e.in_flight == 0)
    })
    .await;
}

/// Picks a turn, serves it where it was picked, reports it done and waits
/// until the engine's events are indexed; returns the endpoint and the
/// pick.
async fn send_turn(
    ix: &Running,
    sims: &HashMap<String, &Sim>,
    conv: &mut Conversation,
    request_id: &str,
    question: String,
) -> (String, pb::PickResponse) {
    conv.messages.push(("user", question));
    let pick = ix.pick(chat_pick(request_id, &conv.messages)).await;
    let address = pick.endpoints[0].address.clone();
    let sim = sims[&address];
    let resp = sim.chat(&conv.messages, 24).await;
    ix.report(served_done(request_id, &address, &resp, 24))
        .await;
    conv.messages.push(("assistant", reply(&resp)));
    ix.wait_settled(&address).await;
    wait_idle(ix).await;
    (address, pick)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_conversations_spread_two_per_engine_and_stay() {
    let sims = Sim::start_many(3).await;
    let ix = start_indexer(&config(&sims.iter().collect::<Vec<_>>())).await;
    ix.wait_ready().await;
    let by_addr: HashMap<String, &Sim> = sims.iter().map(|s| (s.address(), s)).collect();

    let mut convs: Vec<Conversation> = (0..TENANTS.len())
        .flat_map(|t| (0..CONVERSATIONS_PER_TENANT).map(move |_| Conversation::new(t)))
        .collect();
    let mut homes: Vec<String> = Vec::new();
    for turn in 0..TURNS {
        for (i, conv) in convs.iter_mut().enumerate() {
            let question = format!(
                "[conversation {i}] question {turn}: {}",
                filler(100 + i as u64 * 10 + turn as u64, 12)
            );
            let (address, pick) =
                send_turn(&ix, &by_addr, conv, &format!("c{i}-t{turn}"), question).await;
            if turn == 0 {
                homes.push(address);
                continue;
            }
            assert_eq!(
                address, homes[i],
                "conversation {i} turn {turn} stays where it started: {pick:?}"
            );
            assert_eq!(pick.reason, "prefix", "{pick:?}");
        }
        if turn == 0 {
            let mut per: HashMap<&str, usize> = HashMap::new();
            for h in &homes {
                *per.entry(h.as_str()).or_default() += 1;
            }
            eprintln!("conversations started per engine: {per:?}");
            assert_eq!(per.len(), 3, "every engine starts some: {per:?}");
            assert!(per.values().all(|&n| n == 2), "two per engine: {per:?}");
        }
    }
    ix.indexer.shutdown().await;
}
