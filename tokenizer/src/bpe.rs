//! Byte-level BPE with merge ranks, giving the same ids as Hugging Face
//! `tokenizers`' `BPE` model (no dropout, no unknown token).
//!
//! HF merges, within a piece, the adjacent pair with the lowest merge rank,
//! the leftmost on ties, until no pair has a merge. Both paths here do the
//! same: a linear scan for short pieces (cheap, cache friendly) and a heap
//! for long ones (so a 100 KB run of one character is not quadratic).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::TokenizerError;

/// Pieces longer than this use the heap; the scan is quadratic.
const HEAP_THRESHOLD: usize = 128;

/// FxHash (rustc's hasher): keys here are small ids and short byte strings,
/// where SipHash's DoS resistance buys nothing and costs most of a lookup.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type FxBuild = BuildHasherDefault<FxHasher>;
pub(crate) type FxHashMap<K, V> = HashMap<K, V, FxBuild>;

/// GPT-2's reversible map from bytes to printable characters, in which
/// byte-level vocabularies are written.
pub(crate) fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if printable {
            u32::from(b)
        } else {
            extra += 1;
            255 + extra
        };
        table[b as usize] = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

fn char_to_byte() -> FxHashMap<char, u8> {
    byte_to_char()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

/// Decodes a byte-level token string (e.g. `"Ġthe"`) into raw bytes.
pub(crate) fn token_bytes(token: &str, map: &FxHashMap<char, u8>) -> Option<Vec<u8>> {
    token.chars().map(|c| map.get(&c).copied()).collect()
}

#[derive(Clone, Copy)]
struct Merge {
    rank: u32,
    new_id: u32,
}

#[inline]
fn pair_key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// The model part of the tokenizer: vocabulary and merges.
pub(crate) struct Bpe {
    /// Raw bytes of each token, by id (empty where the id is unused).
    id_bytes: Vec<Box<[u8]>>,
    /// Raw token bytes to id.
    ids: FxHashMap<Box<[u8]>, u32>,
    merges: FxHashMap<u64, Merge>,
    byte_ids: [u32; 256],
    /// Whether BPE over a token's own bytes yields that token: only then may
    /// a piece equal to it skip the merge loop. (Not true of every token in
    /// general, and HF does not assume it unless `ignore_merges` is set.)
    whole: Vec<bool>,
    pub(crate) char_to_byte: FxHashMap<char, u8>,
}

/// Reusable buffers, so encoding allocates nothing per piece.
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<u32>,
    ranks: Vec<u32>,
    nodes: Vec<Node>,
    heap: BinaryHeap<Reverse<(u32, u32, u32)>>,
}

#[derive(Clone, Copy)]
struct Node {
    id: u32,
    prev: u32,
    next: u32,
}

const NONE: u32 = u32::MAX;

impl Bpe {
    pub(crate) fn new(
        vocab: FxHashMap<String, u32>,
        merges: &[(String, String)],
        ignore_merges: bool,
    ) -> Result<Self, TokenizerError> {
        let char_to_byte = char_to_byte();
        let max_id = vocab.values().copied().max().unwrap_or(0) as usize;
        // Tables are indexed by id; a stray huge id must be an error, not a
        // multi-gigabyte allocation.
        if max_id > (vocab.len() * 2).max(1 << 20) {
            return Err(TokenizerError::Invalid(format!(
                "vocabulary ids are too sparse (max id {max_id} for {} tokens)",
                vocab.len()
            )));
        }
        let mut id_bytes: Vec<Box<[u8]>> = vec![Box::default(); max_id + 1];
        let mut ids = FxHashMap::with_capacity_and_hasher(vocab.len(), FxBuild::default());
        for (token, &id) in &vocab {
            let bytes = token_bytes(token, &char_to_byte).ok_or_else(|| {
                TokenizerError::Unsupported(format!(
                    "vocabulary token {token:?} is not byte-level encoded"
                ))
            })?;
            let bytes = bytes.into_boxed_slice();
            id_bytes[id as usize] = bytes.clone();
            ids.insert(bytes, id);
        }
        let mut byte_ids = [0u32; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = *ids.get(&[b as u8][..]).ok_or_else(|| {
                TokenizerError::Unsupported(format!("byte {b:#04x} has no token"))
            })?;
        }
        let lookup = |s: &str| {
            vocab.get(s).copied().ok_or_else(|| {
                TokenizerError::Invalid(format!("merge token {s:?} is not in the vocabulary"))
            })
        };
        let mut merge_map = FxHashMap::with_capacity_and_hasher(merges.len(), FxBuild::default());
        for (rank, (a, b)) in merges.iter().enumerate() {
            let new_id = lookup(&format!("{a}{b}"))?;
            let rank = u32::try_from(rank)
                .map_err(|_| TokenizerError::Invalid("too many merges".into()))?;
            // Later duplicates overwrite earlier ones, as in HF's map.
            merge_map.insert(pair_key(lookup(a)?, lookup(b)?), Merge { rank, new_id });
        }
        let mut bpe = Bpe {
            id_bytes,
            ids,
            merges: merge_map,
            byte_ids,
            whole: Vec::new(),
            char_to_byte,
        };
        let mut whole = vec![ignore_merges; max_id + 1];
        if !ignore_merges {
            let mut scratch = Scratch::default();
            let mut out = Vec::new();
            for (&id, bytes) in bpe.ids.iter().map(|(b, id)| (id, b)) {
                out.clear();
                bpe.merge_piece(bytes, &mut scratch, &mut out);
                whole[id as usize] = out.len() == 1 && out[0] == id;
            }
        }
        bpe.whole = whole;
        Ok(bpe)
    }

    /// Number of ids in the model's vocabulary (without added tokens).
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    pub(crate) fn id(&self, bytes: &[u8]) -> Option<u32> {
        self.ids.get(bytes).copied()
    }

    pub(crate) fn bytes(&self, id: u32) -> Option<&[u8]> {
        self.id_bytes
            .get(id as usize)
            .map(|b| &b[..])
            .filter(|b| !b.is_empty())
    }

    /// Appends the ids of one pre-tokenized piece.
    #[inline]
    pub(crate) fn encode_piece(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        if let Some(&id) = self.ids.get(piece) {
            if self.whole[id as usize] {
                out.push(id);
                return;
            }
        }
        self.merge_piece(piece, scratch, out);
    }

    fn merge_piece(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        match piece.len() {
            0 => {}
            1 => out.push(self.byte_ids[piece[0] as usize]),
            n if n <= HEAP_THRESHOLD => self.merge_scan(piece, scratch, out),
            _ => self.merge_heap(piece, scratch, out),
        }
    }

    #[inline]
    fn rank(&self, a: u32, b: u32) -> u32 {
        self.merges.get(&pair_key(a, b)).map_or(NONE, |m| m.rank)
    }

    /// tiktoken-style: keep the rank of every adjacent pair, merge the
    /// lowest (leftmost on ties), and refresh only its two neighbours.
    fn merge_scan(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let syms = &mut scratch.syms;
        let ranks = &mut scratch.ranks;
        syms.clear();
        syms.extend(piece.iter().map(|&b| self.byte_ids[b as usize]));
        ranks.clear();
        ranks.extend(syms.windows(2).map(|w| self.rank(w[0], w[1])));
        loop {
            let mut best = NONE;
            let mut at = 0;
            for (i, &r) in ranks.iter().enumerate() {
                if r < best {
                    best = r;
                    at = i;
                }
            }
            if best == NONE {
                break;
            }
            let new_id = match self.merges.get(&pair_key(syms[at], syms[at + 1])) {
                Some(m) => m.new_id,
                None => break,
            };
            syms[at] = new_id;
            syms.remove(at + 1);
            ranks.remove(at);
            if at + 1 < syms.len() {
                ranks[at] = self.rank(new_id, syms[at + 1]);
            }
            if at > 0 {
                ranks[at - 1] = self.rank(syms[at - 1], new_id);
            }
        }
        out.extend_from_slice(syms);
    }

    /// HF's own algorithm: a min-heap of (rank, position) over a linked list,
    /// skipping entries made stale by earlier merges.
    fn merge_heap(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let nodes = &mut scratch.nodes;
        let heap = &mut scratch.heap;
        nodes.clear();
        heap.clear();
        let n = piece.len() as u32;
        nodes.extend(piece.iter().enumerate().map(|(i, &b)| Node {
            id: self.byte_ids[b as usize],
            prev: if i == 0 { NONE } else { i as u32 - 1 },
            next: if i as u32 + 1 == n {
                NONE
            } else {
                i as u32 + 1
            },
        }));
        for i in 0..nodes.len().saturating_sub(1) {
            if let Some(m) = self.merges.get(&pair_key(nodes[i].id, nodes[i + 1].id)) {
                heap.push(Reverse((m.rank, i as u32, m.new_id)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = heap.pop() {
            let left = nodes[pos as usize];
            // A merged-away node has id NONE; a stale entry's pair no longer
            // produces `new_id` (same result id implies same pair here).
            if left.id == NONE || left.next == NONE {
                continue;
            }
            let right_pos = left.next;
            let right = nodes[right_pos as usize];
            match self.merges.get(&pair_key(left.id, right.id)) {
                Some(m) if m.new_id == new_id => {}
                _ => continue,
            }
            nodes[pos as usize].id = new_id;
            nodes[pos as usize].next = right.next;
            nodes[right_pos as usize].id = NONE;
            if right.next != NONE {
                nodes[right.next as usize].prev = pos;
                let after = nodes[right.next as usize].id;
                if let Some(m) = self.merges.get(&pair_key(new_id, after)) {
                    heap.push(Reverse((m.rank, pos, m.new_id)));
                }
            }
            if left.prev != NONE {
                let before = nodes[left.prev as usize].id;
                if let Some(m) = self.merges.get(&pair_key(before, new_id)) {
                    heap.push(Reverse((m.rank, left.prev, m.new_id)));
                }
            }
        }
        let mut i = 0u32;
        while i != NONE {
            let node = nodes[i as usize];
            out.push(node.id);
            i = node.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary where the scan and the heap must agree with a
    /// hand-derived answer, including a tie between equal-rank pairs.
    fn toy() -> Bpe {
        let b2c = byte_to_char();
        let mut vocab: FxHashMap<String, u32> = (0..=255u8)
            .map(|b| (b2c[b as usize].to_string(), u32::from(b)))
            .collect();
        for (i, t) in ["aa", "ab", "aab", "aaaa"].iter().enumerate() {
            vocab.insert((*t).to_string(), 256 + i as u32);
        }
        let merges: Vec<(String, String)> = [("a", "a"), ("a", "b"), ("aa", "b"), ("aa", "aa")]
            .iter()
            .map(|(a, b)| ((*a).to_string(), (*b).to_string()))
            .collect();
        Bpe::new(vocab, &merges, false).expect("toy vocab")
    }

    fn both(bpe: &Bpe, piece: &[u8]) -> (Vec<u32>, Vec<u32>) {
        let mut s = Scratch::default();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        bpe.merge_scan(piece, &mut s, &mut a);
        bpe.merge_heap(piece, &mut s, &mut b);
        (a, b)
    }

    #[test]
    fn scan_and_heap_agree_on_ties() {
        let bpe = toy();
        // "aaab": (a,a) at 0 and 1 tie; leftmost wins -> aa,a,b -> aa,ab.
        let (a, b) = both(&bpe, b"aaab");
        assert_eq!(a, vec![256, 257]);
        assert_eq!(a, b);
        let (a, b) = both(&bpe, b"aaaaa");
        assert_eq!(a, vec![259, u32::from(b'a')]);
        assert_eq!(a, b);
    }

    #[test]
    fn scan_and_heap_agree_on_pseudo_random_pieces() {
        let bpe = toy();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for len in 1..300 {
            let piece: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x.is_multiple_of(5) {
                        b'b'
                    } else {
                        b'a'
                    }
                })
                .collect();
            let (a, b) = both(&bpe, &piece);
            assert_eq!(a, b, "piece {:?}", String::from_utf8_lossy(&piece));
        }
    }

    #[test]
    fn unreachable_token_is_not_taken_whole() {
        // "abc" is in the vocabulary (via b+c, then a+bc), but (a,b) has the
        // lowest rank, so BPE over "abc" ends as ab,c: a piece equal to
        // "abc" must not take the whole-token shortcut.
        let b2c = byte_to_char();
        let mut vocab: FxHashMap<String, u32> = (0..=255u8)
            .map(|b| (b2c[b as usize].to_string(), u32::from(b)))
            .collect();
        vocab.insert("ab".into(), 256);
        vocab.insert("bc".into(), 257);
        vocab.insert("abc".into(), 258);
        let merges: Vec<(String, String)> = [("a", "b"), ("b", "c"), ("a", "bc")]
            .iter()
            .map(|(a, b)| ((*a).to_string(), (*b).to_string()))
            .collect();
        let bpe = Bpe::new(vocab, &merges, false).expect("vocab");
        let mut out = Vec::new();
        bpe.encode_piece(b"abc", &mut Scratch::default(), &mut out);
        assert_eq!(out, vec![256, u32::from(b'c')]);
    }
}
