use super::*;
use crate::shared_load::merge;

fn e(i: u64) -> EndpointId {
    EndpointId(i)
}

fn entry(totals: &[(u64, u64, u64)]) -> String {
    let t: Vec<_> = totals.iter().map(|(i, p, d)| (e(*i), *p, *d)).collect();
    encode(&t)
}

fn live(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn moves(placed: u32, done: u32) -> Moves {
    Moves { placed, done }
}

#[test]
fn entries_round_trip() {
    assert_eq!(encode(&[]), "f1 ");
    assert_eq!(decode("f1 "), Some(HashMap::new()));
    let t = [(e(u64::MAX), u64::MAX, 3), (e(0xabc), 7, 7)];
    let text = encode(&t);
    assert_eq!(
        text,
        format!("f1 {}:{}:3,{}:7:7", e(u64::MAX), u64::MAX, e(0xabc))
    );
    let back = decode(&text).expect("reads back");
    assert_eq!(back.len(), 2);
    assert_eq!(back[&e(0xabc)], Totals { placed: 7, done: 7 });
    assert_eq!(back[&e(u64::MAX)].placed, u64::MAX);
}

#[test]
fn garbage_and_other_formats_are_refused_and_later_fields_skipped() {
    for text in [
        "",
        "f1",
        "f2 ",
        "v1 7 ",
        "f1 zz:1:2",
        "f1 a:1",
        "f1 a:-1:2",
        "f1 a:1:2,",
        "f1  a:1:2",
    ] {
        assert_eq!(decode(text), None, "{text:?}");
    }
    // A later version's extra fields per item are skipped.
    let t = decode("f1 a:5:2:99:x,b:1:0").expect("extra fields skipped");
    assert_eq!(t[&e(0xa)], Totals { placed: 5, done: 2 });
    assert_eq!(t[&e(0xb)], Totals { placed: 1, done: 0 });
    let many: Vec<_> = (0..=MAX_ENTRY_ENDPOINTS as u64)
        .map(|i| (e(i), 1, 0))
        .collect();
    assert_eq!(decode(&encode(&many)), None);
    assert!(decode(&encode(&many[..MAX_ENTRY_ENDPOINTS])).is_some());
}

#[test]
fn the_load_entry_is_untouched_so_both_versions_read_each_other() {
    // A replica of the previous version reads only the load hash, whose
    // entry this one writes as before: it parses.
    let load = crate::load::PeerLoad {
        in_flight: 2,
        queued_prefill_tokens: 100,
    };
    let text = merge::encode(9, &[(e(1), load)]);
    assert_eq!(
        merge::decode(&text).expect("old reader").loads,
        vec![(e(1), load)]
    );
    // A flow entry in the load hash would be refused by that reader (it is
    // kept in a hash of its own for that reason).
    assert_eq!(merge::decode(&entry(&[(1, 1, 0)])), None);
    // This one reading a replica that writes no flow entry: no moves.
    let mut t = MovesTable::default();
    let m = t.merge(&live(&["old"]), vec![]);
    assert!(m.moves.is_empty());
    let m = t.merge(&live(&["old"]), vec![]);
    assert_eq!((m.moves.len(), m.refused), (0, 0));
}

#[test]
fn increments_of_live_replicas_are_summed_per_endpoint() {
    let mut t = MovesTable::default();
    let f = |name: &str, totals: &[(u64, u64, u64)]| (name.to_string(), entry(totals));
    // First sight: the totals are a base, not moves.
    let m = t.merge(
        &live(&["a", "b"]),
        vec![f("a", &[(1, 10, 8)]), f("b", &[(1, 3, 3)])],
    );
    assert!(m.moves.is_empty());
    let m = t.merge(
        &live(&["a", "b"]),
        vec![
            f("a", &[(1, 12, 9), (2, 1, 0)]),
            f("b", &[(1, 4, 3)]),
            f("dead", &[(1, 100, 0)]),
        ],
    );
    assert_eq!(m.moves[&e(1)], moves(3, 1));
    assert_eq!(m.moves[&e(2)], moves(1, 0));
    assert_eq!(m.moves.len(), 2);
    // Nothing new: nothing moves.
    let m = t.merge(
        &live(&["a", "b"]),
        vec![f("a", &[(1, 12, 9), (2, 1, 0)]), f("b", &[(1, 4, 3)])],
    );
    assert!(m.moves.is_empty());
    // A total that went down (a restart under the same id) counts from 0.
    let m = t.merge(
        &live(&["a", "b"]),
        vec![f("a", &[(1, 2, 1)]), f("b", &[(1, 4, 3)])],
    );
    assert_eq!(m.moves[&e(1)], moves(2, 1));
}

#[test]
fn a_replica_not_live_is_forgotten_and_based_again_when_back() {
    let mut t = MovesTable::default();
    let a = |totals: &[(u64, u64, u64)]| vec![("a".to_string(), entry(totals))];
    t.merge(&live(&["a"]), a(&[(1, 1, 0)]));
    // Dead for a while: its field may still be there, it is not read.
    let m = t.merge(&live(&[]), a(&[(1, 5, 0)]));
    assert!(m.moves.is_empty());
    assert_eq!(t.remembered(), 0);
    // Back: its totals are a base again (what it placed while it was not
    // live is not counted as new).
    assert!(t.merge(&live(&["a"]), a(&[(1, 9, 2)])).moves.is_empty());
    assert_eq!(
        t.merge(&live(&["a"]), a(&[(1, 10, 2)])).moves[&e(1)],
        moves(1, 0)
    );
}

#[test]
fn a_live_replica_without_an_entry_is_based_on_its_first_one() {
    let mut t = MovesTable::default();
    assert!(t.merge(&live(&["a"]), vec![]).moves.is_empty());
    assert_eq!(t.remembered(), 0);
    let m = t.merge(&live(&["a"]), vec![("a".into(), entry(&[(1, 5, 0)]))]);
    assert!(m.moves.is_empty(), "old totals are a base: {m:?}");
    let m = t.merge(&live(&["a"]), vec![("a".into(), entry(&[(1, 6, 0)]))]);
    assert_eq!(m.moves[&e(1)], moves(1, 0));
    // Unreadable entries are counted and add nothing...
    let m = t.merge(&live(&["a"]), vec![("a".into(), "garbage".into())]);
    assert_eq!((m.moves.len(), m.refused), (0, 1));
    // ... and keep the base they would have replaced.
    let m = t.merge(&live(&["a"]), vec![("a".into(), entry(&[(1, 7, 1)]))]);
    assert_eq!(m.moves[&e(1)], moves(1, 1));
}
