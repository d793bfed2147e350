//! Lexical rules shared by validation (of a policy set) and the compiled
//! document's loader: names, header names and values, key hashes, model
//! names. Kept apart so both can use them without depending on each other.

/// Whether `s` is a DNS-1123 label: names become stats labels and segments
/// of dotted stat names, where dots or odd characters would break the
/// Prometheus tag extraction.
pub(crate) fn is_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Whether `s` is an HTTP header name (an RFC 9110 token, or a pseudo-header
/// like `:authority`).
pub(crate) fn is_header_name(s: &str) -> bool {
    let t = s.strip_prefix(':').unwrap_or(s);
    !t.is_empty()
        && t.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c))
}

/// Whether `s` can be sent as a header value (no CR, LF or NUL, which would
/// let a value smuggle extra headers).
pub(crate) fn is_header_value(s: &str) -> bool {
    !s.bytes().any(|c| c == b'\r' || c == b'\n' || c == 0)
}

/// Whether `s` is `sha256:` plus 64 lowercase hex digits.
pub(crate) fn is_key_hash(s: &str) -> bool {
    s.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    })
}

/// Model names: what `rewriteModel` and pool `models` may hold.
pub(crate) fn is_model_name(s: &str) -> bool {
    !s.is_empty()
        && !s
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '*' || c == '?')
}
