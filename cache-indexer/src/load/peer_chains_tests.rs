use super::*;
use crate::load::prefix::{block_chain, common_prefix};

/// The chain of `n` blocks of size 4 from `seed`, diverging from seed 0's
/// after `shared` blocks.
fn chain(n: usize, shared: usize, seed: u32) -> Vec<u64> {
    let tokens: Vec<u32> = (0..n * 4)
        .map(|i| {
            if i < shared * 4 {
                i as u32
            } else {
                i as u32 + 1_000_000 * (seed + 1)
            }
        })
        .collect();
    block_chain(&tokens, 4)
}

fn round_trip(s: &SampledChain) -> Option<SampledChain> {
    let mut text = String::new();
    s.encode_into(&mut text);
    SampledChain::decode(&text)
}

#[test]
fn chains_round_trip_and_stay_small() {
    for n in [1, 2, 16, 17, 100, 1024, 12_288] {
        let c = chain(n, n, 0);
        let s = SampledChain::of(&c).expect("non-empty");
        assert_eq!(round_trip(&s).as_ref(), Some(&s), "{n}");
        assert_eq!(s.len(), n);
        assert!(s.samples.len() <= MAX_SAMPLES as usize, "{n}");
        assert!(s.every >= SAMPLE_EVERY);
    }
    assert_eq!(SampledChain::of(&[]), None);
    assert_eq!(SampledChain::of(&[7]).unwrap().samples.len(), 0);
}

#[test]
fn matches_are_exact_at_the_last_block_and_conservative_otherwise() {
    let own = chain(1000, 1000, 0);
    let s = SampledChain::of(&own).unwrap();
    let every = s.every as usize;
    // The whole chain, or a longer prompt starting with it: exact.
    assert_eq!(s.matched(&own), 1000);
    let mut longer = own.clone();
    longer.extend(chain(1100, 1000, 1)[1000..].iter());
    assert_eq!(s.matched(&longer), 1000);
    // Any divergence point: never more than the true common prefix, and
    // at most `every - 1` blocks less.
    for shared in [0, 1, 2, 15, 16, 17, 100, 500, 998, 999] {
        for n in [shared + 1, shared + 50, 1200] {
            let other = chain(n.max(1), shared, 1);
            let truth = common_prefix(&own, &other);
            let got = s.matched(&other);
            assert!(got <= truth, "shared {shared} n {n}: {got} > {truth}");
            assert!(
                truth - got < every,
                "shared {shared} n {n}: {got} vs {truth}"
            );
        }
    }
    // A prefix of the chain (a shorter request): credited up to its last
    // sampled block.
    assert_eq!(s.matched(&own[..500]), 500 - (499 % every));
    assert_eq!(s.matched(&[]), 0);
}

#[test]
fn may_hold_checks_the_last_sample_within_the_request() {
    let own = chain(300, 300, 0);
    let s = SampledChain::of(&own).unwrap();
    for n in [1, 2, 16, 17, 200, 299, 300] {
        assert!(s.may_hold(&own[..n]), "{n}");
    }
    assert!(!s.may_hold(&chain(301, 300, 0)), "longer than the chain");
    assert!(
        !s.may_hold(&chain(300, 299, 1)),
        "differs at the last block"
    );
    assert!(!s.may_hold(&chain(40, 10, 1)), "differs at block 32");
    assert!(s.may_hold(&[]));
}

#[test]
fn anything_else_is_not_read() {
    let good = round_trip(&SampledChain::of(&chain(40, 40, 0)).unwrap()).unwrap();
    let mut text = String::new();
    good.encode_into(&mut text);
    let mut extra = text.clone();
    extra.push_str(".ab");
    let missing = text[..text.rfind('.').unwrap()].to_string();
    for bad in [
        String::new(),
        "0.16.ab".into(),
        "1.0.ab".into(),
        "1.16.".into(),
        "1.16.xyz".into(),
        "+1.16.ab".into(),
        "1.16.+ab".into(),
        "1.16.11111111111111111".into(),
        format!("{}.16.ab", MAX_CHAIN_BLOCKS + 1),
        // Too many samples for the length would be read unbounded.
        format!("100000.1.ab{}", ".1".repeat(99_999)),
        "99999999999.16.ab".into(),
        extra,
        missing,
    ] {
        assert_eq!(SampledChain::decode(&bad), None, "{bad:.60}");
    }
}
