use super::*;

fn bulk(s: &str) -> Value {
    Value::BulkString(s.as_bytes().to_vec())
}

fn entry(id: &str, replica: &str, text: &str) -> Value {
    Value::Array(vec![
        bulk(id),
        Value::Array(vec![
            bulk(REPLICA_FIELD),
            bulk(replica),
            bulk(PLACED_FIELD),
            bulk(text),
        ]),
    ])
}

#[test]
fn entries_round_trip_and_bad_ones_are_refused() {
    let s = SharedPlacements {
        starts: vec![(EndpointId(0xab), 12), (EndpointId(1), 0)],
        ends: vec![u64::MAX, 7],
    };
    let text = encode(&s);
    assert_eq!(decode(&text), Some(s));
    assert_eq!(
        decode(&encode(&SharedPlacements::default())),
        Some(SharedPlacements::default())
    );
    for bad in [
        "",
        "q2 ;",
        "q1 ab:1",
        "q1 ab;",
        "q1 zz:1;",
        "q1 ab:-1;",
        "q1 ;12345678901234567",
        "q1 ;xyz",
    ] {
        assert_eq!(decode(bad), None, "{bad}");
    }
    let too_many = format!("q1 ;{}", vec!["1"; MAX_SHARED_ENDS + 1].join(","));
    assert_eq!(decode(&too_many), None);
}

#[test]
fn stream_ids_parse_order_and_step() {
    let a = StreamId::parse("1700000000000-3").unwrap();
    assert_eq!(a.next(), "1700000000000-4");
    assert!(a < StreamId::parse("1700000000001-0").unwrap());
    let max = StreamId {
        ms: 5,
        seq: u64::MAX,
    };
    assert_eq!(max.next(), "6-0");
    assert_eq!(StreamId::parse("12"), None);
    assert_eq!(
        server_ms(Value::Array(vec![bulk("1700000000"), bulk("250999")])),
        Some(1_700_000_000_250)
    );
    assert_eq!(server_ms(Value::Nil), None);
}

#[test]
fn a_read_gives_the_peers_placements_aged_and_moves_on() {
    let mut t = PlacedTable::default();
    assert_eq!(t.start(), "-");
    let reply = Value::Array(vec![
        entry("1000-0", "a", "q1 1:5;aa"),
        entry("1010-0", "me", "q1 2:0;bb"),
        entry("1020-0", "b", "garbage"),
        entry("1030-0", "b", "q1 3:0,1:20;"),
    ]);
    let got = t.merge("me", reply, Some(1040));
    assert_eq!(
        got.starts,
        vec![
            (EndpointId(1), 45.0),
            (EndpointId(3), 10.0),
            (EndpointId(1), 30.0)
        ]
    );
    assert_eq!(got.ends, vec![0xaa]);
    assert_eq!(got.refused, 1);
    assert_eq!(t.start(), "1030-1");
    // An entry read again (a reply overlapping the last) is not merged twice.
    let again = Value::Array(vec![
        entry("1030-0", "b", "q1 3:0;"),
        entry("1050-0", "a", "q1 ;cc"),
    ]);
    let got = t.merge("me", again, None);
    assert!(got.starts.is_empty());
    assert_eq!(got.ends, vec![0xcc]);
    // Not a list: refused, nothing moves.
    assert_eq!(t.merge("me", Value::Nil, None).refused, 1);
    assert_eq!(t.start(), "1050-1");
}
