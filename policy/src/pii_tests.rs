use super::national_id::CF_ODD;
use super::*;

fn kinds(t: &str) -> Vec<PiiKind> {
    scan(t, PiiKinds::all()).iter().collect()
}

fn found(t: &str) -> Vec<(PiiKind, &str)> {
    find_all(t, PiiKinds::all())
        .into_iter()
        .map(|(k, r)| (k, &t[r]))
        .collect()
}

fn only(t: &str, k: PiiKind) -> Vec<&str> {
    find_all(t, PiiKinds::of(&[k]))
        .into_iter()
        .map(|(_, r)| &t[r])
        .collect()
}

#[test]
fn emails_inside_text() {
    assert_eq!(
        found("mail jane.doe+tag@example.co.uk, thanks."),
        vec![(PiiKind::Email, "jane.doe+tag@example.co.uk")]
    );
    assert_eq!(
        only("<a@b.io>(x_y@sub.example.org)", PiiKind::Email),
        vec!["a@b.io", "x_y@sub.example.org"]
    );
    assert_eq!(
        only("End: bob@corp.com.", PiiKind::Email),
        vec!["bob@corp.com"]
    );
}

#[test]
fn email_negatives() {
    for t in [
        "@property\ndef x(self): ...",
        "user@localhost",
        "npm i @scope/pkg",
        "a@b.c",
        "x@1.2.3.4",
        ".a@b.com",
        "a.@b.com",
        "a@-b.com",
        "@ home",
        "price: 5 @ $3",
    ] {
        assert!(only(t, PiiKind::Email).is_empty(), "{t}");
    }
}

#[test]
fn cards_luhn() {
    for t in [
        "4111111111111111",
        "4111 1111 1111 1111",
        "4111-1111-1111-1111",
        "5555555555554444",
        "2223003122003222",
        "378282246310005",
        "3782 822463 10005",
        "6011111111111117",
        "3530111333300000",
        "30569309025904",
        "6200000000000005",
        "4222222222222",
    ] {
        assert_eq!(
            only(&format!("card: {t}."), PiiKind::PaymentCard),
            vec![t],
            "{t}"
        );
    }
}

#[test]
fn card_negatives() {
    for t in [
        "4111111111111112",                // Luhn fails
        "4111 1111 1111 1112",             // Luhn fails
        "1234567812345670",                // Luhn ok, no network starts with 1
        "41111111111111110",               // 17 digits: not a Visa length
        "411111111111111100000",           // a longer number
        "4111-1111 1111-1111",             // mixed separators
        "4111111111111111.25",             // a decimal
        "0x4111111111111111",              // hex literal
        "id=a4111111111111111",            // inside a word
        "1718035200000",                   // ms timestamp
        "1718035200000000000",             // ns timestamp
        "4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1", // single digits
    ] {
        assert!(only(t, PiiKind::PaymentCard).is_empty(), "{t}");
    }
}

#[test]
fn card_followed_by_another_number() {
    assert_eq!(
        only("4111 1111 1111 1111 2027", PiiKind::PaymentCard),
        vec!["4111 1111 1111 1111"]
    );
}

#[test]
fn ibans() {
    for t in [
        "DE89 3704 0044 0532 0130 00",
        "DE89370400440532013000",
        "GB82WEST12345698765432",
        "GB82 WEST 1234 5698 7654 32",
        "FR1420041010050500013M02606",
        "NL91ABNA0417164300",
        "BE68539007547034",
        "NO9386011117947",
    ] {
        assert_eq!(
            only(&format!("IBAN {t}, ok"), PiiKind::Iban),
            vec![t],
            "{t}"
        );
    }
}

#[test]
fn iban_negatives() {
    for t in [
        "DE89 3704 0044 0532 0130 01", // check fails
        "DE89370400440532013001",
        "DE8937040044053201300",      // too short for DE
        "DE893704004405320130000",    // too long for DE
        "QQ89370400440532013000",     // no such country
        "DE89 37040044 0532 0130 00", // broken grouping
        "de89370400440532013000",     // lower case
    ] {
        assert!(only(t, PiiKind::Iban).is_empty(), "{t}");
    }
}

#[test]
fn ssn() {
    for t in ["123-45-6789", "123 45 6789", "772-12-3456"] {
        assert_eq!(only(&format!("SSN: {t}"), PiiKind::NationalId), vec![t]);
    }
    for t in [
        "000-12-3456",
        "666-12-3456",
        "900-12-3456",
        "987-65-4321",
        "123-00-4567",
        "123-45-0000",
        "078-05-1120",
        "219-09-9999",
        "123-45-67890",
        "1123-45-6789",
        "123-45 6789",
        "v123-45-6789",
        "2024-01-15",
    ] {
        assert!(only(t, PiiKind::NationalId).is_empty(), "{t}");
    }
}

#[test]
fn spanish_and_italian_ids() {
    for t in [
        "12345678Z",
        "12345678-Z",
        "X1234567L",
        "RSSMRA85T10A562S",
        "MRTMTT25D09F205Z",
    ] {
        assert_eq!(
            only(&format!("id {t}."), PiiKind::NationalId),
            vec![t],
            "{t}"
        );
    }
    for t in [
        "12345678A",        // wrong DNI letter
        "X1234567A",        // wrong NIE letter
        "RSSMRA85T10A562T", // wrong CF check
        "RSSMRA85Z10A562S", // Z is not a month letter
        "123456789Z",       // 9 digits
        "ABCDEFGHIJKLMNOP", // not the layout
    ] {
        assert!(only(t, PiiKind::NationalId).is_empty(), "{t}");
    }
    // Omocodia: digits replaced by letters, check recomputed.
    let mut s = *b"RSSMRA85T10A56NS";
    let v: u32 = s[..15]
        .iter()
        .enumerate()
        .map(|(k, &c)| {
            let v = if c.is_ascii_digit() {
                c - b'0'
            } else {
                c - b'A'
            };
            u32::from(if k % 2 == 0 {
                CF_ODD[usize::from(v)]
            } else {
                v
            })
        })
        .sum();
    s[15] = b'A' + (v % 26) as u8;
    let s = std::str::from_utf8(&s).unwrap();
    assert_eq!(only(s, PiiKind::NationalId), vec![s]);
}

#[test]
fn phones_in_several_formats() {
    for t in [
        "+1 (415) 555-2671",
        "+1 415 555 2671",
        "+14155552671",
        "+44 20 7946 0958",
        "+33 1 23 45 67 89",
        "+49 170 1234567",
        "+49-30-1234567",
        "(415) 555-2671",
        "(415)555-2671",
        "415-555-2671",
        "415.555.2671",
        "415 555 2671",
        "1-800-555-0199",
        "020 7946 0958",
        "06 12 34 56 78",
        "030 12345678",
    ] {
        assert_eq!(
            only(&format!("call {t} now"), PiiKind::Phone),
            vec![t],
            "{t}"
        );
    }
}

#[test]
fn phone_negatives() {
    for t in [
        "4155552671",          // unformatted: too ambiguous
        "2024-01-15",          // date
        "2024-01-15 10:30:00", // timestamp
        "01.02.2024",          // European date
        "192.168.10.254",      // IP address
        "v1.2.3",              // version
        "415-555.2671",        // mixed separators
        "115-555-2671",        // area code starts with 1
        "+0 123 456 789",      // no country code 0
        "+1 234",              // too short
        "x+14155552671",       // inside a word
        "0.25 0.5 0.75",       // decimals
        "3 + 4 = 7",           // arithmetic
    ] {
        assert!(only(t, PiiKind::Phone).is_empty(), "{t}");
    }
}

#[test]
fn no_false_positives_on_ordinary_text() {
    for t in [
        "The build took 1718035200 seconds since epoch; ts=1718035200123.",
        "uuid 550e8400-e29b-41d4-a716-446655440000 and 123e4567-e89b-12d3-a456-426614174000",
        "Order #12345678901234567890 shipped.",
        "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "2024-06-10T16:40:00.123Z, 2024-06-10 16:40:00, 10/06/2024",
        "let x = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];",
        "Version 10.0.19045.3930 of Windows, port 127.0.0.1:8080",
        "Pi is 3.14159265358979323846",
        "commit 1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b",
        "ISBN 978-3-16-148410-0",
        "Use @Override and @dataclass in code.",
        "AKIAIOSFODNN7EXAMPLE is not an IBAN",
        "Call me maybe; the total is 12,345,678.90 EUR",
    ] {
        assert!(kinds(t).is_empty(), "{t}: {:?}", found(t));
    }
}

#[test]
fn mixed_text_finds_every_kind() {
    let t = "Hi, I'm jane@example.com, +44 20 7946 0958, card 4111 1111 1111 1111, \
             IBAN DE89370400440532013000, SSN 123-45-6789.";
    assert_eq!(
        kinds(t),
        vec![
            PiiKind::Email,
            PiiKind::Phone,
            PiiKind::PaymentCard,
            PiiKind::Iban,
            PiiKind::NationalId
        ]
    );
}

#[test]
fn disabled_kinds_are_not_scanned() {
    let t = "jane@example.com 4111111111111111";
    assert_eq!(
        scan(t, PiiKinds::of(&[PiiKind::PaymentCard]))
            .iter()
            .collect::<Vec<_>>(),
        vec![PiiKind::PaymentCard]
    );
    assert!(scan(t, PiiKinds::NONE).is_empty());
}

#[test]
fn unicode_text_is_fine() {
    assert_eq!(
        kinds("Écrivez à renée@exemple.fr — merci"),
        vec![PiiKind::Email]
    );
    assert!(kinds("日本語のテキスト 12345").is_empty());
    assert_eq!(kinds("電話：+81 3-1234-5678。"), vec![PiiKind::Phone]);
}
