//! Mooncake-format traces: parsing, and turning `hash_ids` into token ids.
//!
//! A line is `{"timestamp": ms, "input_length": n, "output_length": m,
//! "hash_ids": [..]}`; each id names one block of `block_tokens` prompt
//! tokens (512 in Mooncake's traces) and ids are prefix-chained, so equal
//! leading ids mean an equal prompt prefix. Replaying through a real engine
//! needs real tokens: each id expands into a deterministic run of token ids,
//! so equal ids give byte-identical prefixes and different ids practically
//! never collide.

use serde::Deserialize;

/// Tokens per hash id in Mooncake's published traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// Lowest token id used for synthetic content: stays clear of the special
/// and control tokens at the start of a vocabulary.
const TOKEN_LO: u32 = 1_000;
/// One past the highest token id used: inside Qwen3's 151,643 regular tokens.
const TOKEN_HI: u32 = 150_000;

/// One request of a Mooncake trace.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceRequest {
    /// Arrival time, milliseconds from the trace's start.
    pub timestamp: f64,
    /// Prompt length, tokens.
    pub input_length: usize,
    /// Completion length, tokens.
    pub output_length: usize,
    /// Prefix-chained block ids.
    pub hash_ids: Vec<u64>,
}

/// A trace that cannot be used, with the line it failed on.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// A line is not a trace record.
    #[error("line {line}: {message}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The trace has no requests.
    #[error("the trace has no requests")]
    Empty,
}

/// Parses a JSON-lines trace (blank lines are skipped). Arrival times must
/// not go backwards and every request needs a prompt and a completion.
pub fn parse(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out: Vec<TraceRequest> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let r: TraceRequest = serde_json::from_str(raw).map_err(|e| TraceError::Line {
            line,
            message: e.to_string(),
        })?;
        let bad = |message: String| TraceError::Line { line, message };
        if !(r.timestamp.is_finite() && r.timestamp >= 0.0) {
            return Err(bad(format!("timestamp must be >= 0, got {}", r.timestamp)));
        }
        if let Some(prev) = out.last() {
            if r.timestamp < prev.timestamp {
                return Err(bad(format!(
                    "timestamp {} is before the previous line's {}",
                    r.timestamp, prev.timestamp
                )));
            }
        }
        if r.input_length == 0 {
            return Err(bad("input_length must be > 0".into()));
        }
        if r.output_length == 0 {
            return Err(bad("output_length must be > 0".into()));
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
}

/// SplitMix64: a tiny, well-mixed, seedable step (deterministic across
/// platforms, unlike the standard library's hashers).
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Token `i` of the content of hash id `id`.
fn token(id: u64, i: usize) -> u32 {
    let h = splitmix(id.wrapping_mul(0x1_0000_0001).wrapping_add(i as u64) ^ 0x6b76_6173);
    TOKEN_LO + (h % u64::from(TOKEN_HI - TOKEN_LO)) as u32
}

/// The prompt's token ids: each hash id's `block_tokens` tokens in order,
/// cut at `input_length` (the last block is usually partial). A prompt
/// longer than its ids cover is padded with tokens unique to `request`, so
/// the padding never looks like a shared prefix.
pub fn prompt_tokens(r: &TraceRequest, block_tokens: usize, request: u64) -> Vec<u32> {
    let mut out = Vec::with_capacity(r.input_length);
    'ids: for &id in &r.hash_ids {
        for i in 0..block_tokens {
            if out.len() == r.input_length {
                break 'ids;
            }
            out.push(token(id, i));
        }
    }
    let mut k = 0usize;
    while out.len() < r.input_length {
        // Far outside the id space a trace uses.
        out.push(token(u64::MAX - request, k));
        k += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ts: f64, len: usize, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: ts,
            input_length: len,
            output_length: 3,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn parses_the_shared_format_and_names_bad_lines() {
        let t = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 6, \"hash_ids\": [0, 1]}\n\n\
                 {\"timestamp\": 40, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n";
        let v = parse(t).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].timestamp, 40.0);
        let e = parse("{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}\n{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}").unwrap_err();
        assert!(
            e.to_string().starts_with("line 2: timestamp 1 is before"),
            "{e}"
        );
        let e = parse("{\"timestamp\": 0}").unwrap_err();
        assert!(e.to_string().starts_with("line 1: missing field"), "{e}");
        let e = parse(
            "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}",
        )
        .unwrap_err();
        assert!(e.to_string().contains("input_length must be > 0"));
        assert!(matches!(parse("\n\n"), Err(TraceError::Empty)));
    }

    #[test]
    fn equal_ids_give_equal_prefixes_and_different_ids_differ() {
        let a = prompt_tokens(&req(0.0, 1200, &[7, 8, 9]), 512, 0);
        let b = prompt_tokens(&req(0.0, 700, &[7, 8]), 512, 1);
        let c = prompt_tokens(&req(0.0, 700, &[7, 5]), 512, 2);
        assert_eq!(a.len(), 1200);
        assert_eq!(b.len(), 700);
        assert_eq!(a[..700], b[..]);
        assert_eq!(a[..512], c[..512]);
        let same = a[512..700]
            .iter()
            .zip(&c[512..])
            .filter(|(x, y)| x == y)
            .count();
        assert!(same < 3, "{same} equal tokens in different blocks");
        assert!(a.iter().all(|&t| (TOKEN_LO..TOKEN_HI).contains(&t)));
    }

    #[test]
    fn short_id_lists_are_padded_with_request_unique_tokens() {
        let a = prompt_tokens(&req(0.0, 600, &[1]), 512, 10);
        let b = prompt_tokens(&req(0.0, 600, &[1]), 512, 11);
        assert_eq!(a.len(), 600);
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..], b[512..]);
    }
}
