//! IBANs: country length and mod-97 check.

use super::bounds::right_ok;

/// IBAN lengths by country (SWIFT IBAN registry).
const IBAN_LENGTHS: &[(&[u8; 2], usize)] = &[
    (b"AD", 24),
    (b"AE", 23),
    (b"AL", 28),
    (b"AT", 20),
    (b"AZ", 28),
    (b"BA", 20),
    (b"BE", 16),
    (b"BG", 22),
    (b"BH", 22),
    (b"BR", 29),
    (b"BY", 28),
    (b"CH", 21),
    (b"CR", 22),
    (b"CY", 28),
    (b"CZ", 24),
    (b"DE", 22),
    (b"DK", 18),
    (b"DO", 28),
    (b"EE", 20),
    (b"EG", 29),
    (b"ES", 24),
    (b"FI", 18),
    (b"FO", 18),
    (b"FR", 27),
    (b"GB", 22),
    (b"GE", 22),
    (b"GI", 23),
    (b"GL", 18),
    (b"GR", 27),
    (b"GT", 28),
    (b"HR", 21),
    (b"HU", 28),
    (b"IE", 22),
    (b"IL", 23),
    (b"IQ", 23),
    (b"IS", 26),
    (b"IT", 27),
    (b"JO", 30),
    (b"KW", 30),
    (b"KZ", 20),
    (b"LB", 28),
    (b"LC", 32),
    (b"LI", 21),
    (b"LT", 20),
    (b"LU", 20),
    (b"LV", 21),
    (b"MC", 27),
    (b"MD", 24),
    (b"ME", 22),
    (b"MK", 19),
    (b"MR", 27),
    (b"MT", 31),
    (b"MU", 30),
    (b"NL", 18),
    (b"NO", 15),
    (b"PK", 24),
    (b"PL", 28),
    (b"PS", 29),
    (b"PT", 25),
    (b"QA", 29),
    (b"RO", 24),
    (b"RS", 22),
    (b"SA", 24),
    (b"SC", 31),
    (b"SE", 24),
    (b"SI", 19),
    (b"SK", 24),
    (b"SM", 27),
    (b"ST", 25),
    (b"SV", 28),
    (b"TL", 23),
    (b"TN", 24),
    (b"TR", 26),
    (b"UA", 29),
    (b"VA", 22),
    (b"VG", 24),
    (b"XK", 20),
];

pub(super) fn iban_at(b: &[u8], i: usize) -> Option<usize> {
    if i + 4 > b.len()
        || !b[i].is_ascii_uppercase()
        || !b[i + 1].is_ascii_uppercase()
        || !b[i + 2].is_ascii_digit()
        || !b[i + 3].is_ascii_digit()
    {
        return None;
    }
    let country = [b[i], b[i + 1]];
    let len = IBAN_LENGTHS
        .binary_search_by(|(c, _)| c[..].cmp(&country[..]))
        .ok()
        .map(|k| IBAN_LENGTHS[k].1)?;
    let mut chars = [0u8; 34];
    let mut n = 0;
    let mut j = i;
    // Spaced (groups of four) or compact: decided by the byte after the
    // first group, then held to.
    let spaced = b.get(i + 4) == Some(&b' ');
    while n < len {
        if n > 0 && n % 4 == 0 && spaced {
            if b.get(j) != Some(&b' ') {
                return None;
            }
            j += 1;
        }
        let c = *b.get(j)?;
        if !(c.is_ascii_digit() || c.is_ascii_uppercase()) {
            return None;
        }
        chars[n] = c;
        n += 1;
        j += 1;
    }
    if !right_ok(b, j) {
        return None;
    }
    // mod 97 of the rearranged number (BBAN, country, check digits), with
    // letters as 10..35, folded digit by digit to stay in u32.
    let mut rem = 0u32;
    for &c in chars[4..len].iter().chain(&chars[..4]) {
        if c.is_ascii_digit() {
            rem = (rem * 10 + u32::from(c - b'0')) % 97;
        } else {
            rem = (rem * 100 + u32::from(c - b'A' + 10)) % 97;
        }
    }
    (rem == 1).then_some(j)
}
