//! National ids: US SSN, Spanish DNI/NIE, Italian codice fiscale.

use super::bounds::{digit, digits_exact, num, right_ok};

pub(super) fn ssn_at(b: &[u8], i: usize) -> Option<usize> {
    let a = digits_exact(b, i, 3)?;
    let sep = *b.get(a)?;
    if !matches!(sep, b'-' | b' ') {
        return None;
    }
    let g = digits_exact(b, a + 1, 2)?;
    if b.get(g) != Some(&sep) {
        return None;
    }
    let e = digits_exact(b, g + 1, 4)?;
    if !right_ok(b, e) {
        return None;
    }
    let (area, group, serial) = (num(&b[i..a]), num(&b[a + 1..g]), num(&b[g + 1..e]));
    if area == 0 || area == 666 || area >= 900 || group == 0 || serial == 0 {
        return None;
    }
    // Published sample numbers (the Woolworth wallet card, the SSA ad).
    if (area, group, serial) == (78, 5, 1120) || (area, group, serial) == (219, 9, 9999) {
        return None;
    }
    Some(e)
}

const DNI_LETTERS: &[u8; 23] = b"TRWAGMYFPDXBNJZSQVHLCKE";

fn dni_letter_at(b: &[u8], j: usize, value: u32) -> Option<usize> {
    let j = if b.get(j) == Some(&b'-') { j + 1 } else { j };
    let l = b.get(j)?.to_ascii_uppercase();
    if l != DNI_LETTERS[(value % 23) as usize] || !right_ok(b, j + 1) {
        return None;
    }
    Some(j + 1)
}

pub(super) fn dni_at(b: &[u8], i: usize) -> Option<usize> {
    let e = digits_exact(b, i, 8)?;
    if digit(b, e) {
        return None;
    }
    dni_letter_at(b, e, num(&b[i..e]))
}

pub(super) fn nie_at(b: &[u8], i: usize) -> Option<usize> {
    let prefix = match b[i] {
        b'X' => 0,
        b'Y' => 1,
        b'Z' => 2,
        _ => return None,
    };
    let e = digits_exact(b, i + 1, 7)?;
    if digit(b, e) {
        return None;
    }
    dni_letter_at(b, e, prefix * 10_000_000 + num(&b[i + 1..e]))
}

/// Codice fiscale character values at odd (1st, 3rd, ...) positions.
pub(super) const CF_ODD: [u8; 26] = [
    1, 0, 5, 7, 9, 13, 15, 17, 19, 21, 2, 4, 18, 20, 11, 3, 6, 8, 12, 14, 16, 10, 22, 25, 24, 23,
];
/// Letters that replace digits in omocodia codes (L=0 ... V=9).
const CF_OMOCODIA: &[u8; 10] = b"LMNPQRSTUV";
/// Month letters.
const CF_MONTHS: &[u8; 12] = b"ABCDEHLMPRST";

pub(super) fn codice_fiscale_at(b: &[u8], i: usize) -> Option<usize> {
    if i + 16 > b.len() || !right_ok(b, i + 16) {
        return None;
    }
    let s = &b[i..i + 16];
    // Layout: 6 letters, 2 digits, month letter, 2 digits, letter, 3 digits,
    // check letter. Digit positions may hold omocodia letters.
    for (k, &c) in s.iter().enumerate() {
        let ok = match k {
            0..=5 | 11 | 15 => c.is_ascii_uppercase(),
            8 => CF_MONTHS.contains(&c),
            _ => c.is_ascii_digit() || CF_OMOCODIA.contains(&c),
        };
        if !ok {
            return None;
        }
    }
    let mut sum = 0u32;
    for (k, &c) in s[..15].iter().enumerate() {
        let v = if c.is_ascii_digit() {
            c - b'0'
        } else {
            c - b'A'
        };
        sum += u32::from(if k % 2 == 0 {
            // Digits and letters share the odd table: '0' like 'A', ...
            CF_ODD[usize::from(v)]
        } else {
            v
        });
    }
    (s[15] == b'A' + (sum % 26) as u8).then_some(i + 16)
}
