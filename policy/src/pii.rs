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

mod bounds;
mod card;
mod email;
mod iban;
mod national_id;
mod phone;

use bounds::{alnum, left_ok};
use card::card_at;
use email::scan_emails;
use iban::iban_at;
use national_id::{codice_fiscale_at, dni_at, nie_at, ssn_at};
use phone::phone_at;

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

#[cfg(test)]
#[path = "pii_tests.rs"]
mod tests;
