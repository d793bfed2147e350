//! Integers as vLLM reads them. vLLM validates a body with pydantic v2 in
//! lax mode after `json.loads`, and a lax `int` accepts more than JSON
//! integers: a float with no fractional part whose magnitude is below
//! 2^63 (`1e2`, `100.0`; `1e20` is refused), a boolean (`true` is 1), and
//! a string holding an integer (see [`int_str`]). The filter reads the
//! integers it uses (output limits, token ids) the same way, so that a body
//! vLLM accepts is never refused here and the number the filter budgets
//! with is the number the engine uses.
//!
//! The filter only uses non-negative integers: a negative one (which vLLM's
//! parser accepts and its request checks then refuse: `max_tokens must be
//! at least 1`) is refused here, as is one past `u64` (past any context
//! length, which vLLM refuses too).

/// 2^63 as f64 (exact): pydantic refuses a float whose magnitude reaches it
/// (`int_parsing_size`).
const TWO_POW_63: f64 = 9_223_372_036_854_775_808.0;

/// A lax integer as the filter can use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaxInt {
    /// A non-negative integer that fits `u64`.
    Value(u64),
    /// A negative integer (pydantic accepts it; the filter refuses it).
    Negative,
    /// An integer past `u64` (a Python int: pydantic accepts it; vLLM
    /// refuses it against the context length, and so does the filter).
    TooLarge,
}

/// Why a JSON value is not a lax integer at all (pydantic's error type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotInt {
    /// A float with a fractional part (`int_from_float`).
    Fraction,
    /// A float whose magnitude is 2^63 or more (`int_parsing_size`).
    FloatTooLarge,
    /// A string that is no integer (`int_parsing`).
    BadString,
}

/// A float as pydantic's lax `int` reads it.
pub(crate) fn int_f64(v: f64) -> Result<LaxInt, NotInt> {
    if v.fract() != 0.0 {
        return Err(NotInt::Fraction);
    }
    if v.abs() >= TWO_POW_63 {
        return Err(NotInt::FloatTooLarge);
    }
    // Exact: |v| < 2^63 and integral. `-0.0` is 0.
    if v < 0.0 {
        Ok(LaxInt::Negative)
    } else {
        Ok(LaxInt::Value(v as u64))
    }
}

/// A string as pydantic's lax `int` reads it (pydantic-core's `str` to
/// `int`): Unicode whitespace trimmed (Rust's `str::trim`, so not the
/// ASCII separators `\x1c`-`\x1f` that Python's `str.strip` also drops),
/// an optional `+` or `-`, ASCII digits with single underscores between
/// digits, then optionally `.` and one or more zeros (`"100.000"`).
/// Refused: `"1e2"`, `"100."`, `".0"`, `"0x10"`, `"100.5"`, `"_1"`,
/// `"1__0"`, `"1_"`, `"1.0_0"`, `""`, non-ASCII digits.
pub(crate) fn int_str(s: &str) -> Result<LaxInt, NotInt> {
    let s = s.trim();
    let (negative, rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let digits = match rest.split_once('.') {
        Some((d, zeros)) if !zeros.is_empty() && zeros.bytes().all(|c| c == b'0') => d,
        Some(_) => return Err(NotInt::BadString),
        None => rest,
    };
    let b = digits.as_bytes();
    let well_formed = b.first().is_some_and(u8::is_ascii_digit)
        && b.last().is_some_and(u8::is_ascii_digit)
        && b.iter().all(|c| c.is_ascii_digit() || *c == b'_')
        && !digits.contains("__");
    if !well_formed {
        return Err(NotInt::BadString);
    }
    let mut value: u64 = 0;
    let mut too_large = false;
    for c in b.iter().filter(|c| c.is_ascii_digit()) {
        match value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(c - b'0')))
        {
            Some(v) => value = v,
            None => too_large = true,
        }
    }
    Ok(match (negative, too_large, value) {
        // `-0` is 0; any other negative integer is refused, however large.
        (true, false, 0) => LaxInt::Value(0),
        (true, ..) => LaxInt::Negative,
        (false, true, _) => LaxInt::TooLarge,
        (false, false, v) => LaxInt::Value(v),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_follow_pydantics_grammar() {
        for (s, want) in [
            ("100", 100),
            (" 7\n", 7),
            ("1_000", 1000),
            ("100.000", 100),
            ("+5", 5),
            ("007", 7),
            ("0.0", 0),
            ("-0", 0),
            ("-0.0", 0),
            ("1_000.00", 1000),
            ("\u{a0}7\u{3000}", 7),
            ("\u{b}7\u{c}", 7),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(int_str(s), Ok(LaxInt::Value(want)), "{s:?}");
        }
        for s in [
            "1e2",
            "100.",
            ".0",
            "0x10",
            "100.5",
            "_1",
            "1_",
            "1__0",
            "1.0_0",
            "",
            " ",
            "+ 5",
            "++1",
            "+-1",
            "1.0e0",
            "-.0",
            "0.",
            "\u{1c}7",
            "\u{200b}7",
            "\u{feff}7",
            "１２",
            "٣",
            "1\0",
        ] {
            assert_eq!(int_str(s), Err(NotInt::BadString), "{s:?}");
        }
        assert_eq!(int_str("18446744073709551616"), Ok(LaxInt::TooLarge));
        assert_eq!(int_str("99999999999999999999.000"), Ok(LaxInt::TooLarge));
        assert_eq!(int_str("-5"), Ok(LaxInt::Negative));
        assert_eq!(int_str("-99999999999999999999"), Ok(LaxInt::Negative));
    }

    #[test]
    fn floats_below_two_to_the_63_without_a_fraction() {
        assert_eq!(int_f64(1e2), Ok(LaxInt::Value(100)));
        assert_eq!(int_f64(-0.0), Ok(LaxInt::Value(0)));
        assert_eq!(
            int_f64(9.2e18),
            Ok(LaxInt::Value(9_200_000_000_000_000_000))
        );
        assert_eq!(int_f64(-3.0), Ok(LaxInt::Negative));
        assert_eq!(int_f64(TWO_POW_63), Err(NotInt::FloatTooLarge));
        assert_eq!(int_f64(-TWO_POW_63), Err(NotInt::FloatTooLarge));
        assert_eq!(int_f64(1e20), Err(NotInt::FloatTooLarge));
        assert_eq!(int_f64(0.5), Err(NotInt::Fraction));
        assert_eq!(int_f64(1e-300), Err(NotInt::Fraction));
    }
}
