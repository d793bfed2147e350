use super::*;

const TTL: Duration = Duration::from_millis(1000);

fn load(in_flight: u32, queued: u64) -> PeerLoad {
    PeerLoad {
        in_flight,
        queued_prefill_tokens: queued,
    }
}

fn field(replica: &str, seq: u64, loads: &[(u64, PeerLoad)]) -> (String, String) {
    let loads: Vec<_> = loads.iter().map(|(i, l)| (EndpointId(*i), *l)).collect();
    (replica.to_string(), encode(seq, &loads))
}

#[test]
fn entries_round_trip() {
    for loads in [
        vec![],
        vec![(EndpointId(0), load(1, 0))],
        vec![
            (EndpointId(u64::MAX), load(u32::MAX, u64::MAX)),
            (EndpointId(0xabc), load(3, 4096)),
        ],
    ] {
        let text = encode(42, &loads);
        assert_eq!(decode(&text), Some(Entry { seq: 42, loads }), "{text}");
    }
    assert_eq!(encode(7, &[]), "v1 7 ");
}

#[test]
fn anything_else_is_not_read() {
    for text in [
        "",
        "v1",
        "v1 7",
        "v2 7 ",
        "v1 x ",
        "v1 7 zz:1:2",
        "v1 7 a:1",
        "v1 7 a:1:2:3",
        "v1 7 a:-1:2",
        "v1 7 a:1:2,",
        "v1 7 a:99999999999:2",
    ] {
        assert_eq!(decode(text), None, "{text:?}");
    }
    let many: Vec<_> = (0..=MAX_ENTRY_ENDPOINTS as u64)
        .map(|i| (EndpointId(i), load(1, 1)))
        .collect();
    assert_eq!(decode(&encode(1, &many)), None);
    assert!(decode(&encode(1, &many[..MAX_ENTRY_ENDPOINTS])).is_some());
}

#[test]
fn other_replicas_are_summed_and_own_is_skipped() {
    let mut t = PeerTable::default();
    let now = Instant::now();
    let m = t.merge(
        "me",
        vec![
            field("me", 1, &[(1, load(50, 5000))]),
            field("a", 1, &[(1, load(2, 100)), (2, load(1, 10))]),
            field("b", 9, &[(1, load(1, 20))]),
            ("c".into(), "garbage".into()),
        ],
        now,
        TTL,
    );
    assert_eq!(m.live, 2);
    assert_eq!(m.malformed, 1);
    assert_eq!(m.loads[&EndpointId(1)], load(3, 120));
    assert_eq!(m.loads[&EndpointId(2)], load(1, 10));
    assert_eq!(m.loads.len(), 2);
    assert!(m.forget.is_empty());
}

#[test]
fn a_replica_whose_number_stops_is_dead_after_the_ttl() {
    let mut t = PeerTable::default();
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let read = |t: &mut PeerTable, ms, seq_a, seq_b| {
        let fields = vec![
            field("a", seq_a, &[(1, load(1, 10))]),
            field("b", seq_b, &[(1, load(2, 20))]),
        ];
        t.merge("me", fields, at(ms), TTL)
    };
    assert_eq!(read(&mut t, 0, 1, 1).live, 2);
    // `a` keeps publishing, `b` stopped at 1.
    let m = read(&mut t, 999, 2, 1);
    assert_eq!((m.live, m.loads[&EndpointId(1)]), (2, load(3, 30)));
    let m = read(&mut t, 1000, 3, 1);
    assert_eq!((m.live, m.loads[&EndpointId(1)]), (1, load(1, 10)));
    // `b` is back (a restart, a partition healed): live again at once.
    let m = read(&mut t, 1500, 4, 2);
    assert_eq!(m.live, 2);
    // Quiet for the forget bound: deleted from the hash.
    let m = read(&mut t, 1500 + 10_000, 5, 2);
    assert_eq!((m.live, m.forget.clone()), (1, vec!["b".to_string()]));
}

#[test]
fn the_table_forgets_fields_gone_from_the_hash_and_reads_boundedly() {
    let mut t = PeerTable::default();
    let now = Instant::now();
    t.merge("me", vec![field("a", 1, &[]), field("b", 1, &[])], now, TTL);
    assert_eq!(t.remembered(), 2);
    let m = t.merge("me", vec![field("b", 1, &[])], now, TTL);
    assert_eq!((t.remembered(), m.live), (1, 1));
    let many: Vec<_> = (0..MAX_PEERS + 10)
        .map(|i| field(&format!("r{i:04}"), 1, &[(1, load(1, 1))]))
        .collect();
    let m = t.merge("me", many, now, TTL);
    assert_eq!(m.live, MAX_PEERS);
    assert_eq!(
        m.loads[&EndpointId(1)],
        load(MAX_PEERS as u32, MAX_PEERS as u64)
    );
}

#[test]
fn replicas_with_no_load_add_nothing_but_count_as_live() {
    let mut t = PeerTable::default();
    let m = t.merge(
        "me",
        vec![field("a", 1, &[(1, load(0, 0))])],
        Instant::now(),
        TTL,
    );
    assert_eq!((m.live, m.loads.len()), (1, 0));
}
