//! Hand-written PII scanners.
//!
//! One pass over the prompt's bytes: at each token start (a byte whose left
//! neighbour is not part of a number or word) the numeric or alphabetic
//! recognisers run, each of which looks at most a few dozen bytes ahead and
//! bails at the first byte that does not fit. E-mail addresses are found
//! from their `@`. No regex engine, no allocation, so it stays small and
//! fast inside the wasm filter.
//!
//! The recognisers prefer missing an oddly written number to flagging
//! ordinary text: a PII hit can pin traffic to a pool, so false positives
//! on timestamps, ids, UUIDs or plain long numbers are the worse error.
//! Concretely:
//!
//! - **E-mail**: `local@domain.tld`, local part of `[A-Za-z0-9._%+-]` (not
//!   starting or ending with `.`), at least two domain labels, an
//!   alphabetic TLD of 2+ letters. `@decorator`, `user@localhost` are not.
//! - **Phone**: `+` followed by 8-15 digits in groups (spaces, `-`, `.`,
//!   one parenthesised group); North American `(415) 555-2671`,
//!   `415-555-2671`, `415.555.2671`, `415 555 2671`, optionally `1-` first
//!   (area code 2-9); national forms with a `0` trunk prefix in 2+ groups of
//!   2-8 digits, 9-11 digits in all (`020 7946 0958`, `06 12 34 56 78`).
//!   An unformatted run of digits without `+` is never a phone number.
//! - **Payment card**: 13-19 digits, compact or in groups of 3-6 split by one
//!   consistent space or `-`, with a known network prefix and length (Visa,
//!   Mastercard, Amex, Discover, JCB, Diners, UnionPay) and a valid Luhn sum.
//! - **IBAN**: two upper-case letters, two check digits, the BBAN, compact
//!   or in groups of four split by single spaces; the length must be the
//!   country's and the mod-97 remainder 1.
//! - **National id**: US SSN `123-45-6789` / `123 45 6789` (area 000, 666,
//!   900-999, group 00, serial 0000 and the well-known sample numbers
//!   excluded); Spanish DNI `12345678Z` and NIE `X1234567L` (mod-23 letter);
//!   Italian codice fiscale (16 characters, check character verified,
//!   omocodia letters accepted).

use std::ops::{ControlFlow, Range};

use crate::types::PiiKind;

/// A set of [`PiiKind`]s, as a bit set (cheap to copy into stats and
/// decisions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct PiiKinds(u8);

/// All kinds in declaration order, for iteration.
const ALL_KINDS: [PiiKind; 5] = [
    PiiKind::Email,
    PiiKind::Phone,
    PiiKind::PaymentCard,
    PiiKind::Iban,
    PiiKind::NationalId,
];

fn bit(kind: PiiKind) -> u8 {
    match kind {
        PiiKind::Email => 1,
        PiiKind::Phone => 2,
        PiiKind::PaymentCard => 4,
        PiiKind::Iban => 8,
        PiiKind::NationalId => 16,
    }
}

impl PiiKinds {
    /// The empty set.
    pub const NONE: PiiKinds = PiiKinds(0);

    /// Not a kind: the request could not be fully scanned (token ids, a
    /// body the filter cannot walk), which counts as PII. The set is then
    /// not empty although [`PiiKinds::iter`] may list no kind.
    pub const UNSCANNABLE: PiiKinds = PiiKinds(128);

    /// Every kind.
    pub fn all() -> PiiKinds {
        PiiKinds(31)
    }

    /// The set of the given kinds.
    pub fn of(kinds: &[PiiKind]) -> PiiKinds {
        let mut s = PiiKinds::NONE;
        for &k in kinds {
            s.insert(k);
        }
        s
    }

    /// Adds a kind.
    pub fn insert(&mut self, kind: PiiKind) {
        self.0 |= bit(kind);
    }

    /// Whether the set holds `kind`.
    pub fn contains(self, kind: PiiKind) -> bool {
        self.0 & bit(kind) != 0
    }

    /// Whether every kind of `other` is in the set.
    pub fn contains_all(self, other: PiiKinds) -> bool {
        self.0 & other.0 == other.0
    }

    /// Both sets together.
    pub fn union(self, other: PiiKinds) -> PiiKinds {
        PiiKinds(self.0 | other.0)
    }

    /// Whether the request could not be fully scanned.
    pub fn is_unscannable(self) -> bool {
        self.0 & Self::UNSCANNABLE.0 != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The kinds in the set, in declaration order.
    pub fn iter(self) -> impl Iterator<Item = PiiKind> {
        ALL_KINDS.into_iter().filter(move |&k| self.contains(k))
    }

    /// The raw bits (for compact stats).
    pub fn bits(self) -> u8 {
        self.0
    }
}

/// Finds the PII kinds in `enabled` that occur in `text`. Stops as soon as
/// every enabled kind has been seen.
pub fn scan(text: &str, enabled: PiiKinds) -> PiiKinds {
    let mut found = PiiKinds::NONE;
    scan_with(text, enabled, &mut |kind, _| {
        found.insert(kind);
        if found.contains_all(enabled) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    found
}

/// Every PII occurrence of the `enabled` kinds, with its byte range (for
/// tests and `kvasirctl explain`; the filter uses [`scan`]).
pub fn find_all(text: &str, enabled: PiiKinds) -> Vec<(PiiKind, Range<usize>)> {
    let mut out = Vec::new();
    scan_with(text, enabled, &mut |kind, r| {
        out.push((kind, r));
        ControlFlow::Continue(())
    });
    out
}

/// Calls `f` for each occurrence, in text order by kind group (e-mails
/// first, then the rest in text order); `f` can stop the scan.
pub fn scan_with(
    text: &str,
    enabled: PiiKinds,
    f: &mut dyn FnMut(PiiKind, Range<usize>) -> ControlFlow<()>,
) {
    let b = text.as_bytes();
    if enabled.contains(PiiKind::Email) && scan_emails(b, f).is_break() {
        return;
    }
    let numeric = enabled.contains(PiiKind::Phone)
        || enabled.contains(PiiKind::PaymentCard)
        || enabled.contains(PiiKind::NationalId);
    let alpha = enabled.contains(PiiKind::Iban) || enabled.contains(PiiKind::NationalId);
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        // Every recogniser starts on a digit, `+`, `(` or an upper-case
        // letter: everything else (most of any prompt) is skipped with one
        // table lookup.
        if !START[usize::from(c)] {
            i += 1;
            continue;
        }
        if left_ok(b, i) {
            let hit = if numeric && (c.is_ascii_digit() || c == b'+' || c == b'(') {
                scan_numeric(b, i, enabled, f)
            } else if alpha && c.is_ascii_uppercase() {
                scan_alpha(b, i, enabled, f)
            } else {
                None
            };
            match hit {
                Some(Hit::Stop) => return,
                Some(Hit::At(e)) => {
                    i = e;
                    continue;
                }
                None => {}
            }
        }
        // No position inside a word or number can start a candidate (its
        // left neighbour is alphanumeric): skip to the run's end.
        i += 1;
        if alnum(c) {
            while i < b.len() && alnum(b[i]) {
                i += 1;
            }
        }
    }
}

/// Bytes a candidate can start with.
const START: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 256 {
        let b = c as u8;
        t[c] = b.is_ascii_digit() || b.is_ascii_uppercase() || b == b'+' || b == b'(';
        c += 1;
    }
    t
};

enum Hit {
    Stop,
    At(usize),
}

fn report(
    kind: PiiKind,
    r: Range<usize>,
    f: &mut dyn FnMut(PiiKind, Range<usize>) -> ControlFlow<()>,
) -> Hit {
    let end = r.end;
    match f(kind, r) {
        ControlFlow::Break(()) => Hit::Stop,
        ControlFlow::Continue(()) => Hit::At(end),
    }
}

fn scan_numeric(
    b: &[u8],
    i: usize,
    en: PiiKinds,
    f: &mut dyn FnMut(PiiKind, Range<usize>) -> ControlFlow<()>,
) -> Option<Hit> {
    // Most specific first: a card or SSN shape is never also a phone.
    if en.contains(PiiKind::PaymentCard) {
        if let Some(e) = card_at(b, i) {
            return Some(report(PiiKind::PaymentCard, i..e, f));
        }
    }
    if en.contains(PiiKind::NationalId) {
        if let Some(e) = ssn_at(b, i).or_else(|| dni_at(b, i)) {
            return Some(report(PiiKind::NationalId, i..e, f));
        }
    }
    if en.contains(PiiKind::Phone) {
        if let Some(e) = phone_at(b, i) {
            return Some(report(PiiKind::Phone, i..e, f));
        }
    }
    None
}

fn scan_alpha(
    b: &[u8],
    i: usize,
    en: PiiKinds,
    f: &mut dyn FnMut(PiiKind, Range<usize>) -> ControlFlow<()>,
) -> Option<Hit> {
    if en.contains(PiiKind::Iban) {
        if let Some(e) = iban_at(b, i) {
            return Some(report(PiiKind::Iban, i..e, f));
        }
    }
    if en.contains(PiiKind::NationalId) {
        if let Some(e) = nie_at(b, i).or_else(|| codice_fiscale_at(b, i)) {
            return Some(report(PiiKind::NationalId, i..e, f));
        }
    }
    None
}

// ---------------------------------------------------------------------------
// Boundaries

fn digit(b: &[u8], i: usize) -> bool {
    i < b.len() && b[i].is_ascii_digit()
}

fn alnum(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Whether a candidate may start at `i`: the byte before is not part of a
/// word, a number (`1.`, `1,`), a path, an id (`-`, `/`), or an address.
fn left_ok(b: &[u8], i: usize) -> bool {
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
fn right_ok(b: &[u8], e: usize) -> bool {
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
fn digits_exact(b: &[u8], i: usize, n: usize) -> Option<usize> {
    if i + n > b.len() || !b[i..i + n].iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(i + n)
}

fn num(b: &[u8]) -> u32 {
    b.iter().fold(0, |a, &c| a * 10 + u32::from(c - b'0'))
}

// ---------------------------------------------------------------------------
// E-mail

fn local_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'%' | b'+' | b'-')
}

fn scan_emails(
    b: &[u8],
    f: &mut dyn FnMut(PiiKind, Range<usize>) -> ControlFlow<()>,
) -> ControlFlow<()> {
    let mut k = 0;
    while let Some(off) = b[k..].iter().position(|&c| c == b'@') {
        let at = k + off;
        match email_around(b, at) {
            Some(r) => {
                k = r.end;
                f(PiiKind::Email, r)?;
            }
            None => k = at + 1,
        }
    }
    ControlFlow::Continue(())
}

fn email_around(b: &[u8], at: usize) -> Option<Range<usize>> {
    let mut s = at;
    while s > 0 && local_char(b[s - 1]) && at - s < 64 {
        s -= 1;
    }
    if s == at || b[s] == b'.' || b[at - 1] == b'.' {
        return None;
    }
    // Domain: labels of [A-Za-z0-9-], split by single dots.
    let mut j = at + 1;
    let mut labels = 0;
    let mut last_start;
    loop {
        last_start = j;
        while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'-') {
            j += 1;
        }
        let label = &b[last_start..j];
        if label.is_empty() || label[0] == b'-' || label[label.len() - 1] == b'-' {
            return None;
        }
        labels += 1;
        if j + 1 < b.len() && b[j] == b'.' && b[j + 1].is_ascii_alphanumeric() {
            j += 1;
            continue;
        }
        break;
    }
    let tld = &b[last_start..j];
    if labels < 2 || tld.len() < 2 || !tld.iter().all(u8::is_ascii_alphabetic) {
        return None;
    }
    Some(s..j)
}

// ---------------------------------------------------------------------------
// Payment cards

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

fn card_at(b: &[u8], i: usize) -> Option<usize> {
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

// ---------------------------------------------------------------------------
// US SSN, Spanish DNI/NIE, Italian codice fiscale

fn ssn_at(b: &[u8], i: usize) -> Option<usize> {
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

fn dni_at(b: &[u8], i: usize) -> Option<usize> {
    let e = digits_exact(b, i, 8)?;
    if digit(b, e) {
        return None;
    }
    dni_letter_at(b, e, num(&b[i..e]))
}

fn nie_at(b: &[u8], i: usize) -> Option<usize> {
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
const CF_ODD: [u8; 26] = [
    1, 0, 5, 7, 9, 13, 15, 17, 19, 21, 2, 4, 18, 20, 11, 3, 6, 8, 12, 14, 16, 10, 22, 25, 24, 23,
];
/// Letters that replace digits in omocodia codes (L=0 ... V=9).
const CF_OMOCODIA: &[u8; 10] = b"LMNPQRSTUV";
/// Month letters.
const CF_MONTHS: &[u8; 12] = b"ABCDEHLMPRST";

fn codice_fiscale_at(b: &[u8], i: usize) -> Option<usize> {
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

// ---------------------------------------------------------------------------
// IBAN

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

fn iban_at(b: &[u8], i: usize) -> Option<usize> {
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

// ---------------------------------------------------------------------------
// Phone numbers

fn phone_at(b: &[u8], i: usize) -> Option<usize> {
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

#[cfg(test)]
mod tests {
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
}
