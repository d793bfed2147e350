//! Token boundaries and digit helpers every recogniser shares: where a
//! candidate may start and end, so numbers inside words, ids, decimals or
//! times are never taken for PII.

pub(super) fn digit(b: &[u8], i: usize) -> bool {
    i < b.len() && b[i].is_ascii_digit()
}

pub(super) fn alnum(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Whether a candidate may start at `i`: the byte before is not part of a
/// word, a number (`1.`, `1,`), a path, an id (`-`, `/`), or an address.
pub(super) fn left_ok(b: &[u8], i: usize) -> bool {
    if i == 0 {
        return true;
    }
    let p = b[i - 1];
    if alnum(p) || matches!(p, b'-' | b'+' | b'@' | b'/' | b'\\' | b'#') {
        return false;
    }
    if matches!(p, b'.' | b',' | b':') && i >= 2 && b[i - 2].is_ascii_alphanumeric() {
        return false;
    }
    true
}

/// Whether a candidate may end at `e` (exclusive): the next byte does not
/// continue a word, number, decimal, list, time or id.
pub(super) fn right_ok(b: &[u8], e: usize) -> bool {
    if e >= b.len() {
        return true;
    }
    let n = b[e];
    if alnum(n) || n == b'@' {
        return false;
    }
    if matches!(n, b'-' | b'.' | b',' | b'/' | b'+' | b':')
        && e + 1 < b.len()
        && b[e + 1].is_ascii_alphanumeric()
    {
        return false;
    }
    true
}

/// Reads exactly `n` digits at `i`, returning their value's digits end.
pub(super) fn digits_exact(b: &[u8], i: usize, n: usize) -> Option<usize> {
    if i + n > b.len() || !b[i..i + n].iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(i + n)
}

pub(super) fn num(b: &[u8]) -> u32 {
    b.iter().fold(0, |a, &c| a * 10 + u32::from(c - b'0'))
}
