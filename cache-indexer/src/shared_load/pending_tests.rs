use super::*;
use crate::load::block_chain;

fn chain(seed: u32, blocks: usize) -> Arc<[u64]> {
    let tokens: Vec<u32> = (0..blocks as u32 * 16)
        .map(|i| i.wrapping_add(seed.wrapping_mul(7_000_000)))
        .collect();
    block_chain(&tokens, 16).into()
}

fn sampled(entry: &[(EndpointId, Vec<SampledChain>)]) -> Vec<(u64, Vec<usize>)> {
    entry
        .iter()
        .map(|(id, c)| (id.0, c.iter().map(SampledChain::len).collect()))
        .collect()
}

#[test]
fn entries_round_trip() {
    let own: OwnPending = vec![
        (EndpointId(1), vec![chain(1, 12_288), chain(2, 1)]),
        (EndpointId(u64::MAX), vec![chain(3, 40)]),
    ];
    let text = encode(&own);
    let back = decode(&text).expect("decodes");
    assert_eq!(
        sampled(&back),
        vec![(1, vec![12_288, 1]), (u64::MAX, vec![40])]
    );
    // Sampled as SampledChain::of does.
    assert_eq!(back[0].1[0], SampledChain::of(&own[0].1[0]).unwrap());
    assert_eq!(encode(&vec![]), "p1 ");
    assert_eq!(decode("p1 "), Some(vec![]));
    // A longest-prompt chain stays small.
    let one = encode(&vec![(EndpointId(1), vec![chain(1, 12_288)])]);
    assert!(one.len() < 1_300, "{}", one.len());
}

#[test]
fn a_writer_stays_under_the_bound_and_keeps_the_newest() {
    let base: Vec<Arc<[u64]>> = (0..64).map(|i| chain(i, 5_000)).collect();
    let own: OwnPending = (0..64).map(|e| (EndpointId(e), base.clone())).collect();
    let text = encode(&own);
    assert!(text.len() <= MAX_PENDING_ENTRY_BYTES, "{}", text.len());
    let back = decode(&text).expect("a writer's entry is never refused");
    assert!(!back.is_empty());
    assert_eq!(back[0].1[0], SampledChain::of(&own[0].1[0]).unwrap());
    // Past the per-endpoint bound the oldest are left out.
    let many = vec![(EndpointId(1), (0..70).map(|i| chain(i, 2)).collect())];
    let back = decode(&encode(&many)).unwrap();
    assert_eq!(back[0].1.len(), MAX_PENDING_PREFIXES);
}

#[test]
fn anything_else_is_not_read() {
    let good = encode(&vec![(EndpointId(1), vec![chain(1, 40)])]);
    let chain_text = good.split_once('=').unwrap().1.to_string();
    let too_many = format!("p1 1={}", vec![chain_text.as_str(); 65].join("/"));
    for bad in [
        String::new(),
        "p1".into(),
        "p2 ".into(),
        "v1 1 ".into(),
        "p1 1=".into(),
        "p1 =1.16.ab".into(),
        "p1 zz=1.16.ab".into(),
        "p1 1=1.16.ab,".into(),
        "p1 1=1.16.ab/".into(),
        "p1 11111111111111111=1.16.ab".into(),
        format!("p1 1={chain_text},2"),
        too_many,
        format!(
            "{good}{}",
            ",2=1.16.ab".repeat(MAX_PENDING_ENTRY_BYTES / 10)
        ),
    ] {
        assert_eq!(decode(&bad), None, "{bad:.60}");
    }
}

#[test]
fn only_live_replicas_are_read_and_bad_entries_are_counted() {
    let a = encode(&vec![(EndpointId(1), vec![chain(1, 40)])]);
    let b = encode(&vec![
        (EndpointId(1), vec![chain(2, 20)]),
        (EndpointId(2), vec![chain(3, 5)]),
    ]);
    let fields = vec![
        ("a".to_string(), a),
        ("b".to_string(), b),
        (
            "dead".to_string(),
            encode(&vec![(EndpointId(3), vec![chain(4, 5)])]),
        ),
        ("c".to_string(), "garbage".to_string()),
    ];
    let live = ["a", "b", "c"].map(String::from).to_vec();
    let m = merge(&live, fields);
    assert_eq!(m.refused, 1);
    assert_eq!(m.chains[&EndpointId(1)].len(), 2);
    assert_eq!(m.chains[&EndpointId(2)].len(), 1);
    assert!(
        !m.chains.contains_key(&EndpointId(3)),
        "a dead replica's chains"
    );
}

#[test]
fn fingerprints_change_with_a_completed_chain() {
    let short: OwnPending = vec![(EndpointId(1), vec![chain(1, 4)])];
    let long: OwnPending = vec![(EndpointId(1), vec![chain(1, 40)])];
    assert_eq!(fingerprint(&short), fingerprint(&short.clone()));
    assert_ne!(fingerprint(&short), fingerprint(&long));
    assert!(fingerprint(&vec![]).is_empty());
}
