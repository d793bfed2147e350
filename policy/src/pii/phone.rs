//! Phone numbers: international, North American and national trunk forms.

use super::bounds::{digit, digits_exact, right_ok};

pub(super) fn phone_at(b: &[u8], i: usize) -> Option<usize> {
    match b[i] {
        b'+' => phone_international(b, i),
        b'0' => phone_trunk(b, i),
        _ => phone_nanp(b, i),
    }
}

/// `+CC ...`: 8-15 digits, groups split by single separators, at most one
/// parenthesised group of 1-4 digits.
fn phone_international(b: &[u8], i: usize) -> Option<usize> {
    if !digit(b, i + 1) || b[i + 1] == b'0' {
        return None;
    }
    let mut j = i + 1;
    let mut n = 0;
    let mut end = j;
    let mut parens = 0;
    loop {
        match b.get(j) {
            Some(c) if c.is_ascii_digit() => {
                n += 1;
                j += 1;
                end = j;
                if n > 15 {
                    return None;
                }
            }
            Some(b'(') if parens == 0 => {
                let close = (j + 1..(j + 6).min(b.len())).find(|&k| b[k] == b')')?;
                if close == j + 1 || !b[j + 1..close].iter().all(u8::is_ascii_digit) {
                    return None;
                }
                n += close - j - 1;
                parens += 1;
                j = close + 1;
                end = j;
                // Optional separator after `)`.
                if matches!(b.get(j), Some(b' ' | b'-' | b'.')) && digit(b, j + 1) {
                    j += 1;
                }
            }
            Some(b' ' | b'-' | b'.') if digit(b, j + 1) || b.get(j + 1) == Some(&b'(') => {
                j += 1;
            }
            _ => break,
        }
    }
    ((8..=15).contains(&n) && right_ok(b, end)).then_some(end)
}

/// North American `[1-](415) 555-2671`, `415-555-2671`, `415.555.2671`,
/// `415 555 2671`.
fn phone_nanp(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i;
    // Optional country code `1` plus separator.
    if b[j] == b'1' && matches!(b.get(j + 1), Some(b' ' | b'-' | b'.')) {
        j += 2;
    }
    let sep1;
    if b.get(j) == Some(&b'(') {
        let a = digits_exact(b, j + 1, 3)?;
        if b.get(a) != Some(&b')') || b[j + 1] < b'2' {
            return None;
        }
        j = a + 1;
        sep1 = b
            .get(j)
            .copied()
            .filter(|c| matches!(c, b' ' | b'-' | b'.'));
        if sep1.is_some() {
            j += 1;
        }
    } else {
        let a = digits_exact(b, j, 3)?;
        if b[j] < b'2' {
            return None;
        }
        let s = *b.get(a)?;
        if !matches!(s, b' ' | b'-' | b'.') {
            return None;
        }
        sep1 = Some(s);
        j = a + 1;
    }
    let x = digits_exact(b, j, 3)?;
    let s2 = *b.get(x)?;
    if !matches!(s2, b' ' | b'-' | b'.') {
        return None;
    }
    // Without parentheses the two separators must agree (`415-555-2671`).
    if b[i..j].last() != Some(&b')') && !b[i..j].contains(&b'(') && sep1 != Some(s2) {
        return None;
    }
    let e = digits_exact(b, x + 1, 4)?;
    right_ok(b, e).then_some(e)
}

/// National form with a `0` trunk prefix: 2+ groups of 2-8 digits split by
/// one consistent separator, 9-11 digits.
fn phone_trunk(b: &[u8], i: usize) -> Option<usize> {
    if !digit(b, i + 1) || b[i + 1] == b'0' {
        return None;
    }
    let mut j = i;
    let mut n = 0;
    let mut groups = 0;
    let mut sep = None;
    loop {
        let s = j;
        while digit(b, j) {
            j += 1;
        }
        let g = j - s;
        if !(2..=8).contains(&g) {
            return None;
        }
        n += g;
        groups += 1;
        match b.get(j) {
            Some(&c @ (b' ' | b'-' | b'.')) if digit(b, j + 1) && sep.is_none_or(|s| s == c) => {
                sep = Some(c);
                j += 1;
            }
            _ => break,
        }
        if n > 11 {
            return None;
        }
    }
    (groups >= 2 && (9..=11).contains(&n) && right_ok(b, j)).then_some(j)
}
