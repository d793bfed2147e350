//! The tokenizer.json pipeline, reproduced step by step as Hugging Face
//! `tokenizers` runs it for `encode(text, add_special_tokens=False)`:
//!
//! 1. split the raw text at added tokens (leftmost-longest); each match is
//!    one id, and the text between matches is encoded independently;
//! 2. NFC-normalize each segment (then split at any `normalized` added
//!    tokens, matched against their normalized form);
//! 3. split with the pre-tokenizer regex (here: a hand-written scanner);
//! 4. byte-level BPE over each piece.
//!
//! Anything in the file outside what is reproduced here is refused at load,
//! so a tokenizer either loads and is exact, or does not load.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::ops::ControlFlow;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;
use unicode_normalization_alignments::{is_nfc_quick, IsNormalized, UnicodeNormalization};

use crate::bpe::{Bpe, FxHashMap, Scratch};
use crate::cache::{SegmentCache, MIN_SEGMENT_BYTES};
use crate::pretok::{self, Classes, QWEN_PATTERN};
use crate::TokenizerError;

#[derive(Deserialize)]
struct TokenizerFile {
    #[serde(default)]
    added_tokens: Vec<AddedTokenFile>,
    #[serde(default)]
    normalizer: Option<Value>,
    #[serde(default)]
    pre_tokenizer: Option<Value>,
    #[serde(default)]
    truncation: Option<Value>,
    #[serde(default)]
    padding: Option<Value>,
    model: ModelFile,
}

#[derive(Deserialize)]
struct AddedTokenFile {
    // `id` is deliberately not read; see `Encoder::from_json`.
    content: String,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    normalized: bool,
    #[serde(default)]
    special: bool,
}

#[derive(Deserialize)]
struct ModelFile {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    vocab: FxHashMap<String, u32>,
    merges: Vec<MergeFile>,
    #[serde(default)]
    dropout: Option<f64>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    ignore_merges: bool,
}

/// Merges are `"a b"` in older files and `["a", "b"]` in newer ones.
#[derive(Deserialize)]
#[serde(untagged)]
enum MergeFile {
    Pair(String, String),
    Joined(String),
}

/// An added token as the encoder needs it.
pub(crate) struct AddedToken {
    pub(crate) id: u32,
    pub(crate) content: String,
    pub(crate) special: bool,
}

/// Leftmost-longest matching of a small set of literal strings. Added
/// tokens are few (26 for Qwen3) and share a first byte (`<`), so a table of
/// candidates by first byte beats a general automaton here.
struct Matcher {
    /// Candidates by first byte, longest first.
    by_first: Vec<Vec<(Box<[u8]>, u32)>>,
    first: [bool; 256],
    /// The distinct first bytes, when few enough to search for with
    /// `memchr` (one `<` for Qwen3): a long prompt is then scanned with
    /// memchr's vectorised search instead of a table lookup per byte
    /// (measured: bench/results/tokenizer_notes.md).
    firsts: Vec<u8>,
}

impl Matcher {
    fn new<'a>(tokens: impl Iterator<Item = (&'a [u8], u32)>) -> Self {
        let mut m = Matcher {
            by_first: vec![Vec::new(); 256],
            first: [false; 256],
            firsts: Vec::new(),
        };
        for (bytes, id) in tokens {
            if let Some(&b) = bytes.first() {
                m.first[b as usize] = true;
                m.by_first[b as usize].push((bytes.into(), id));
            }
        }
        for list in &mut m.by_first {
            // Stable sort keeps file order among equal lengths.
            list.sort_by_key(|(b, _)| std::cmp::Reverse(b.len()));
        }
        m.firsts = (0..=255u8).filter(|&b| m.first[b as usize]).collect();
        m
    }

    /// The first position at or after `from` whose byte starts some token.
    #[inline]
    fn next_candidate(&self, bytes: &[u8], from: usize) -> Option<usize> {
        let hay = &bytes[from..];
        let found = match self.firsts[..] {
            [] => None,
            [a] => memchr::memchr(a, hay),
            [a, b] => memchr::memchr2(a, b, hay),
            [a, b, c] => memchr::memchr3(a, b, c, hay),
            _ => hay.iter().position(|&x| self.first[x as usize]),
        };
        found.map(|i| from + i)
    }

    fn is_empty(&self) -> bool {
        !self.first.iter().any(|&f| f)
    }

    /// Calls `f` for each stretch between matches and for each match, in
    /// order, with its byte offset in `text`; stops when `f` breaks.
    fn try_split<'t>(
        &self,
        text: &'t str,
        mut f: impl FnMut(Part<'t>, usize) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let bytes = text.as_bytes();
        let mut start = 0;
        let mut from = 0;
        while let Some(i) = self.next_candidate(bytes, from) {
            let rest = &bytes[i..];
            if let Some((len, id)) = self.by_first[bytes[i] as usize]
                .iter()
                .find(|(t, _)| rest.starts_with(t))
                .map(|(t, id)| (t.len(), *id))
            {
                // Tokens are whole UTF-8 strings and `i` is at a byte that
                // starts one, so both ends are char boundaries.
                if start < i {
                    f(Part::Text(&text[start..i]), start)?;
                }
                f(Part::Token(id), i)?;
                start = i + len;
                from = start;
            } else {
                from = i + 1;
            }
        }
        if start < bytes.len() {
            f(Part::Text(&text[start..]), start)?;
        }
        ControlFlow::Continue(())
    }
}

enum Part<'t> {
    Text(&'t str),
    Token(u32),
}

/// Normalized bytes a segment's head keeps past the budget's room: pieces
/// ending well before the cut are the whole segment's.
const NFC_MARGIN: usize = 4096;

/// Longer than any added token: one matched this close to a head's cut
/// might have been a longer one's start.
const MAX_ADDED_BYTES: usize = 256;

/// The caller's answer to "go on past these ids?".
pub(crate) type GoOn<'a> = &'a mut dyn FnMut(&[u32]) -> bool;

/// Bounds on the work of one encode: past them it stops before the next
/// piece, as if the caller had said no. The ids stay exact (a prefix of the
/// whole text's); only how far they reach is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeLimits {
    /// Most bytes of text run through the pre-tokenizer and BPE (text the
    /// segment cache holds costs nothing and is not counted).
    pub max_bytes: usize,
    /// Longest pre-tokenizer piece encoded. BPE over one piece is
    /// superlinear (a run of one character is a single piece), so a longer
    /// piece stops the encoding before it.
    pub max_piece_bytes: usize,
}

impl EncodeLimits {
    /// No bounds: the whole text is encoded.
    pub const NONE: EncodeLimits = EncodeLimits {
        max_bytes: usize::MAX,
        max_piece_bytes: usize::MAX,
    };
}

/// When [`Encoder::encode_prefix`] asks whether to go on: at the first
/// full block that holds uncached text, then 2, 4, 8... blocks further, so
/// a long prompt that does keep matching costs O(log n) checks.
pub(crate) struct Probe<'a> {
    block: usize,
    /// Token count of the next checkpoint; `None` until uncached text (and
    /// always for a probe that never asks).
    next: Option<usize>,
    step_blocks: usize,
    go_on: Option<GoOn<'a>>,
    limits: EncodeLimits,
    /// Bytes the limits have let through so far.
    spent: usize,
    /// Whether a limit stopped the encoding.
    pub(crate) limited: bool,
}

impl<'a> Probe<'a> {
    pub(crate) fn new(block: usize, go_on: GoOn<'a>) -> Self {
        Probe {
            block: block.max(1),
            next: None,
            step_blocks: 1,
            go_on: Some(go_on),
            limits: EncodeLimits::NONE,
            spent: 0,
            limited: false,
        }
    }

    /// The same probe, also bounded by `limits`.
    pub(crate) fn with_limits(mut self, limits: EncodeLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Bytes the budget has left.
    fn room(&self) -> usize {
        self.limits.max_bytes.saturating_sub(self.spent)
    }

    /// Whether a piece of `len` bytes may be encoded; charges it if so.
    /// `cut`: the piece reaches past a truncated text's exact part.
    fn admit(&mut self, len: usize, cut: bool) -> bool {
        let spent = self.spent.saturating_add(len);
        if cut || len > self.limits.max_piece_bytes || spent > self.limits.max_bytes {
            self.limited = true;
            return false;
        }
        self.spent = spent;
        true
    }

    /// A probe that never asks: the whole text is encoded.
    fn never() -> Probe<'static> {
        Probe {
            block: 1,
            next: None,
            step_blocks: 1,
            go_on: None,
            limits: EncodeLimits::NONE,
            spent: 0,
            limited: false,
        }
    }

    /// Uncached text starts at token `len`: the first checkpoint is the end
    /// of the block it falls in (kept if one is already set).
    fn arm(&mut self, len: usize) {
        if self.next.is_none() && self.go_on.is_some() {
            self.next = Some((len / self.block + 1) * self.block);
        }
    }

    fn check(&mut self, out: &[u32]) -> ControlFlow<()> {
        while let Some(next) = self.next.filter(|&n| out.len() >= n) {
            let Some(go_on) = self.go_on.as_mut() else {
                break;
            };
            if !go_on(&out[..next]) {
                return ControlFlow::Break(());
            }
            self.step_blocks = self.step_blocks.saturating_mul(2);
            self.next = Some(next + self.step_blocks * self.block);
        }
        ControlFlow::Continue(())
    }
}

/// The fast, exact encoder.
pub(crate) struct Encoder {
    bpe: Bpe,
    classes: &'static Classes,
    nfc: bool,
    raw_added: Matcher,
    normalized_added: Matcher,
    pub(crate) added: Vec<AddedToken>,
    added_by_id: HashMap<u32, usize>,
    cache: Option<Arc<SegmentCache>>,
}

fn is_nfc(v: &Value) -> Result<bool, TokenizerError> {
    match v.get("type").and_then(Value::as_str) {
        Some("NFC") => Ok(true),
        Some("Sequence") => {
            let parts = v
                .get("normalizers")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    TokenizerError::Invalid("normalizer Sequence without list".into())
                })?;
            match parts.as_slice() {
                [] => Ok(false),
                [one] => is_nfc(one),
                _ => Err(TokenizerError::Unsupported(format!("normalizer {v}"))),
            }
        }
        _ => Err(TokenizerError::Unsupported(format!("normalizer {v}"))),
    }
}

/// Accepts exactly the Qwen2/Qwen3 pre-tokenizer: the split regex
/// (Isolated) followed by ByteLevel without its own regex.
fn check_pre_tokenizer(v: Option<&Value>) -> Result<(), TokenizerError> {
    let unsupported = || {
        TokenizerError::Unsupported(format!(
            "pre_tokenizer {} (only Qwen's Split regex + ByteLevel is reproduced)",
            v.map_or_else(|| "null".to_string(), Value::to_string)
        ))
    };
    let v = v.ok_or_else(unsupported)?;
    let parts = match v.get("type").and_then(Value::as_str) {
        Some("Sequence") => v
            .get("pretokenizers")
            .and_then(Value::as_array)
            .ok_or_else(unsupported)?,
        _ => return Err(unsupported()),
    };
    let [split, byte_level] = parts.as_slice() else {
        return Err(unsupported());
    };
    let ok_split = split.get("type").and_then(Value::as_str) == Some("Split")
        && split.pointer("/pattern/Regex").and_then(Value::as_str) == Some(QWEN_PATTERN)
        && split.get("behavior").and_then(Value::as_str) == Some("Isolated")
        && split.get("invert").and_then(Value::as_bool) == Some(false);
    let ok_byte_level = byte_level.get("type").and_then(Value::as_str) == Some("ByteLevel")
        && byte_level.get("add_prefix_space").and_then(Value::as_bool) == Some(false)
        && byte_level.get("use_regex").and_then(Value::as_bool) == Some(false);
    if ok_split && ok_byte_level {
        Ok(())
    } else {
        Err(unsupported())
    }
}

/// The vocabulary id of a token written in byte-level form.
fn model_id(bpe: &Bpe, token: &str) -> Option<u32> {
    bpe.id(&crate::bpe::token_bytes(token, &bpe.char_to_byte)?)
}

impl Encoder {
    pub(crate) fn from_json(json: &str) -> Result<Self, TokenizerError> {
        let file: TokenizerFile =
            serde_json::from_str(json).map_err(|source| TokenizerError::Json {
                what: "tokenizer.json",
                source,
            })?;
        let m = &file.model;
        if m.kind.as_deref().is_some_and(|k| k != "BPE") {
            return Err(TokenizerError::Unsupported(format!(
                "model type {:?}",
                m.kind
            )));
        }
        if m.dropout.is_some_and(|d| d > 0.0)
            || m.byte_fallback
            || m.continuing_subword_prefix
                .as_deref()
                .is_some_and(|s| !s.is_empty())
            || m.end_of_word_suffix
                .as_deref()
                .is_some_and(|s| !s.is_empty())
        {
            return Err(TokenizerError::Unsupported(
                "BPE with dropout, byte_fallback or subword affixes".into(),
            ));
        }
        let nfc = match &file.normalizer {
            None | Some(Value::Null) => false,
            Some(v) => is_nfc(v)?,
        };
        check_pre_tokenizer(file.pre_tokenizer.as_ref())?;
        // HF applies these inside `encode`; vLLM's files leave them null.
        for (name, v) in [("truncation", &file.truncation), ("padding", &file.padding)] {
            if v.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(TokenizerError::Unsupported(format!("{name} {v:?}")));
            }
        }

        let merges: Vec<(String, String)> = m
            .merges
            .iter()
            .map(|mf| match mf {
                MergeFile::Pair(a, b) => Ok((a.clone(), b.clone())),
                MergeFile::Joined(s) => s
                    .split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| TokenizerError::Invalid(format!("merge {s:?}"))),
            })
            .collect::<Result<_, _>>()?;
        // `unk_token` is irrelevant: every byte has a token, so BPE never
        // meets an unknown symbol.
        let ignore_merges = m.ignore_merges;
        let bpe = Bpe::new(file.model.vocab, &merges, ignore_merges)?;

        // HF ignores the file's `id`s (it only logs a mismatch): an added
        // token takes its vocabulary id when its content is a vocabulary
        // token, else the next id counting from the vocabulary's size. Qwen's
        // listed ids agree, but the ids that count are the ones HF assigns.
        let mut next_id = u32::try_from(bpe.len())
            .map_err(|_| TokenizerError::Invalid("vocabulary too large".into()))?;
        let mut by_content: HashMap<String, u32> = HashMap::new();
        let mut by_id: BTreeMap<u32, (AddedToken, bool)> = BTreeMap::new();
        for t in file.added_tokens {
            if t.content.is_empty() {
                continue;
            }
            if t.lstrip || t.rstrip || t.single_word {
                return Err(TokenizerError::Unsupported(format!(
                    "added token {:?} with lstrip/rstrip/single_word",
                    t.content
                )));
            }
            let id = match by_content.get(&t.content) {
                Some(&id) => id,
                None => match model_id(&bpe, &t.content) {
                    Some(id) => id,
                    None => {
                        let id = next_id;
                        next_id = next_id.saturating_add(1);
                        id
                    }
                },
            };
            by_content.insert(t.content.clone(), id);
            let token = AddedToken {
                id,
                content: t.content,
                special: t.special,
            };
            by_id.insert(id, (token, t.normalized));
        }
        let added: Vec<(AddedToken, bool)> = by_id.into_values().collect();
        let added_by_id = added
            .iter()
            .enumerate()
            .map(|(i, (t, _))| (t.id, i))
            .collect();
        let normalize_token = |s: &str| -> String {
            if nfc {
                s.nfc().map(|(c, _)| c).collect()
            } else {
                s.to_string()
            }
        };
        let raw_added = Matcher::new(
            added
                .iter()
                .filter(|(_, n)| !n)
                .map(|(t, _)| (t.content.as_bytes(), t.id)),
        );
        let normalized: Vec<(String, u32)> = added
            .iter()
            .filter(|(_, n)| *n)
            .map(|(t, _)| (normalize_token(&t.content), t.id))
            .collect();
        let normalized_added = Matcher::new(normalized.iter().map(|(s, id)| (s.as_bytes(), *id)));

        Ok(Encoder {
            bpe,
            classes: Classes::get()?,
            nfc,
            raw_added,
            normalized_added,
            added: added.into_iter().map(|(t, _)| t).collect(),
            added_by_id,
            cache: None,
        })
    }

    pub(crate) fn set_cache(&mut self, budget_bytes: usize) {
        self.cache = (budget_bytes > 0).then(|| Arc::new(SegmentCache::new(budget_bytes)));
    }

    pub(crate) fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_prefix(text, &mut Probe::never()).0
    }

    /// [`Encoder::encode`] that may stop early: see
    /// [`crate::ChatTokenizer::encode_prefix`]. Returns the ids (a prefix of
    /// `encode(text)`'s) and, when it stopped, the byte offset in `text`
    /// that was encoded up to (approximate inside NFC-normalized text).
    pub(crate) fn encode_prefix(
        &self,
        text: &str,
        probe: &mut Probe<'_>,
    ) -> (Vec<u32>, Option<usize>) {
        // About 4 bytes a token for English; reserving avoids regrowth.
        let mut out = Vec::with_capacity(text.len() / 4 + 8);
        let mut scratch = Scratch::default();
        let mut stopped = None;
        let _ = self.raw_added.try_split(text, |part, at| match part {
            Part::Token(id) => {
                out.push(id);
                ControlFlow::Continue(())
            }
            Part::Text(seg) => {
                let cached = self
                    .cache
                    .as_deref()
                    .filter(|_| seg.len() >= MIN_SEGMENT_BYTES)
                    .and_then(|c| c.get(seg));
                if let Some(ids) = cached {
                    out.extend_from_slice(&ids);
                    return ControlFlow::Continue(());
                }
                let start = out.len();
                match self.encode_segment(seg, &mut scratch, &mut out, probe) {
                    ControlFlow::Continue(()) => {
                        if let Some(c) = self
                            .cache
                            .as_deref()
                            .filter(|_| seg.len() >= MIN_SEGMENT_BYTES)
                        {
                            c.insert(seg, &out[start..]);
                        }
                        ControlFlow::Continue(())
                    }
                    ControlFlow::Break(done) => {
                        stopped = Some(at + done);
                        ControlFlow::Break(())
                    }
                }
            }
        });
        (out, stopped)
    }

    /// Encodes an uncached segment piece by piece, asking `probe` at its
    /// checkpoints; breaks with the bytes of `seg` encoded when told to
    /// stop.
    fn encode_segment(
        &self,
        seg: &str,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
        probe: &mut Probe<'_>,
    ) -> ControlFlow<usize> {
        probe.arm(out.len());
        let (normalized, exact_to) = self.normalize(seg, probe.room());
        // Offsets in the normalized text, scaled back to `seg` (exact when
        // nothing was normalized; about right in a head).
        let scale = |n: usize| match exact_to {
            Some(_) => n.min(seg.len()),
            None => n * seg.len() / normalized.len().max(1),
        };
        let cut = exact_to.unwrap_or(usize::MAX);
        // A truncated head is never encoded to its end (the budget stops
        // first); if it were, it must still not pass for the whole.
        let whole = |r: ControlFlow<usize>| match (r, exact_to) {
            (ControlFlow::Continue(()), Some(e)) => ControlFlow::Break(scale(e)),
            (ControlFlow::Break(n), _) => ControlFlow::Break(scale(n)),
            (r, None) => r,
        };
        if self.normalized_added.is_empty() {
            return whole(self.encode_pieces(&normalized, cut, scratch, out, probe));
        }
        let mut stopped = None;
        let _ = self
            .normalized_added
            .try_split(&normalized, |part, at| match part {
                // (Near a head's cut a longer token might have matched.)
                Part::Token(_) if at.saturating_add(MAX_ADDED_BYTES) > cut => {
                    probe.limited = true;
                    stopped = Some(at);
                    ControlFlow::Break(())
                }
                Part::Token(id) => {
                    out.push(id);
                    match probe.check(out) {
                        ControlFlow::Break(()) => {
                            stopped = Some(at);
                            ControlFlow::Break(())
                        }
                        c => c,
                    }
                }
                Part::Text(s) => {
                    match self.encode_pieces(s, cut.saturating_sub(at), scratch, out, probe) {
                        ControlFlow::Break(n) => {
                            stopped = Some(at + n);
                            ControlFlow::Break(())
                        }
                        ControlFlow::Continue(()) => ControlFlow::Continue(()),
                    }
                }
            });
        whole(stopped.map_or(ControlFlow::Continue(()), ControlFlow::Break))
    }

    /// Pre-tokenizes and BPE-encodes normalized text holding no added
    /// token, asking `probe` after each piece (and its limits before each,
    /// refusing pieces that end past `cut`); breaks with the bytes of
    /// `text` encoded when told to stop.
    fn encode_pieces(
        &self,
        text: &str,
        cut: usize,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
        probe: &mut Probe<'_>,
    ) -> ControlFlow<usize> {
        // Pieces cover the text in order, so their lengths give offsets.
        let mut at = 0;
        let mut refused = None;
        let r = pretok::try_for_each_piece(self.classes, text, |piece| {
            if !probe.admit(piece.len(), at + piece.len() > cut) {
                refused = Some(at);
                return ControlFlow::Break(());
            }
            at += piece.len();
            self.bpe.encode_piece(piece.as_bytes(), scratch, out);
            probe.check(out)
        });
        match (r, refused) {
            // A refused piece was not encoded: the stop is at its start.
            (ControlFlow::Break(_), Some(start)) => ControlFlow::Break(start),
            (r, _) => r,
        }
    }

    /// The segment NFC-normalized when the tokenizer says so (borrowed when
    /// that changes nothing, the usual case). With only `room` bytes of
    /// budget left, a long one is normalized only as far as
    /// `room + NFC_MARGIN` bytes (normalizing is linear but not cheap):
    /// then also the offset up to which the head's pieces are the whole
    /// segment's (before its trailing whitespace run, whose pieces depend
    /// on where the run ends, and a few bytes short of the cut, for the
    /// contractions' lookahead).
    fn normalize<'a>(&self, seg: &'a str, room: usize) -> (Cow<'a, str>, Option<usize>) {
        let needs_nfc =
            self.nfc && !seg.is_ascii() && is_nfc_quick(seg.chars()) != IsNormalized::Yes;
        if !needs_nfc {
            return (Cow::Borrowed(seg), None);
        }
        let cap = room.saturating_add(NFC_MARGIN);
        let mut head = String::with_capacity(seg.len().min(cap).saturating_add(4));
        // The streamed output's prefix is the whole normalization's prefix.
        for (c, _) in seg.nfc() {
            if head.len() >= cap {
                let tail = pretok::trailing_space_start(self.classes, &head);
                let exact_to = tail.min(head.len() - 4);
                return (Cow::Owned(head), Some(exact_to));
            }
            head.push(c);
        }
        (Cow::Owned(head), None)
    }

    pub(crate) fn vocab_size(&self) -> usize {
        let extra = self
            .added
            .iter()
            .filter(|t| self.bpe.bytes(t.id).is_none())
            .count();
        self.bpe.len() + extra
    }

    pub(crate) fn added_token(&self, id: u32) -> Option<&AddedToken> {
        self.added_by_id.get(&id).map(|&i| &self.added[i])
    }

    pub(crate) fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(t) = self.added.iter().find(|t| t.content == token) {
            return Some(t.id);
        }
        model_id(&self.bpe, token)
    }

    pub(crate) fn id_to_token(&self, id: u32) -> Option<String> {
        if let Some(t) = self.added_token(id) {
            return Some(t.content.clone());
        }
        let b2c = crate::bpe::byte_to_char();
        self.bpe
            .bytes(id)
            .map(|b| b.iter().map(|&x| b2c[x as usize]).collect())
    }

    pub(crate) fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if let Some(t) = self.added_token(id) {
                bytes.extend_from_slice(t.content.as_bytes());
            } else if let Some(b) = self.bpe.bytes(id) {
                bytes.extend_from_slice(b);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
