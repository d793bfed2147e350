//! Payment card numbers: network prefix, length and Luhn sum.

use super::bounds::{digit, right_ok};

fn luhn(d: &[u8]) -> bool {
    let mut sum = 0u32;
    for (k, &x) in d.iter().rev().enumerate() {
        let mut v = u32::from(x);
        if k % 2 == 1 {
            v *= 2;
            if v > 9 {
                v -= 9;
            }
        }
        sum += v;
    }
    sum.is_multiple_of(10)
}

/// Whether the digits carry a known network prefix with a length that
/// network issues.
fn card_network_ok(d: &[u8]) -> bool {
    let n = d.len();
    let p = |k: usize| d[..k].iter().fold(0u32, |a, &x| a * 10 + u32::from(x));
    match d[0] {
        4 => matches!(n, 13 | 16 | 19),
        5 => (51..=55).contains(&p(2)) && n == 16,
        2 => (2221..=2720).contains(&p(4)) && n == 16,
        3 => match p(2) {
            34 | 37 => n == 15,
            35 => (3528..=3589).contains(&p(4)) && (16..=19).contains(&n),
            30 => (300..=305).contains(&p(3)) && (14..=19).contains(&n),
            36 | 38 | 39 => (14..=19).contains(&n),
            _ => false,
        },
        6 => {
            (p(4) == 6011 || (644..=649).contains(&p(3)) || p(2) == 65 || p(2) == 62)
                && (16..=19).contains(&n)
        }
        _ => false,
    }
}

pub(super) fn card_at(b: &[u8], i: usize) -> Option<usize> {
    if !digit(b, i) {
        return None;
    }
    let mut d = [0u8; 19];
    let mut n = 0;
    let mut j = i;
    let mut sep: Option<u8> = None;
    let mut group = 0;
    // Candidate ends at group boundaries (a card followed by another number).
    let mut best = None;
    loop {
        if digit(b, j) {
            if n == 19 {
                break;
            }
            d[n] = b[j] - b'0';
            n += 1;
            group += 1;
            j += 1;
            continue;
        }
        let grouped_ok = sep.is_none() || (3..=6).contains(&group);
        if grouped_ok && (13..=19).contains(&n) && right_ok(b, j) {
            let d = &d[..n];
            if card_network_ok(d) && luhn(d) {
                best = Some(j);
            }
        }
        let next_sep = j < b.len() && matches!(b[j], b' ' | b'-') && digit(b, j + 1);
        if !next_sep || !(3..=6).contains(&group) || sep.is_some_and(|s| s != b[j]) {
            break;
        }
        sep = Some(b[j]);
        group = 0;
        j += 1;
    }
    if n == 19 && digit(b, j) && sep.is_none() {
        // 20+ digits in one run: a plain long number, not a card.
        return None;
    }
    best
}
