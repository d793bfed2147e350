//! The msgpack side of the decoder: a byte cursor over one payload that
//! reads msgpack's markers (lengths, strings, bins, integers, floats) and
//! skips values it is not asked for, each failure a [`Raw`] error at its
//! byte. It knows nothing of vLLM's events ([`super::event`] does).

use super::DecodeError;

/// Deepest nesting accepted while skipping unknown values (real payloads
/// nest at most ~5 deep); bounds recursion on hostile input.
const MAX_SKIP_DEPTH: usize = 32;

/// A failure before its structural path is known (paths are only built on
/// the error path, so the hot path formats nothing).
pub(super) struct Raw {
    pub(super) offset: usize,
    pub(super) reason: String,
}

impl Raw {
    pub(super) fn at(self, path: impl FnOnce() -> String) -> DecodeError {
        DecodeError {
            offset: self.offset,
            path: path(),
            reason: self.reason,
        }
    }
}

pub(super) type R<T> = Result<T, Raw>;

/// An integer as msgpack carries it.
#[derive(Clone, Copy)]
pub(super) enum Int {
    U(u64),
    I(i64),
}

/// A byte cursor over one payload.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

/// Names the msgpack type of a marker byte, for error messages.
pub(super) fn type_name(m: u8) -> &'static str {
    match m {
        0x00..=0x7f | 0xcc..=0xcf => "uint",
        0xe0..=0xff | 0xd0..=0xd3 => "int",
        0x80..=0x8f | 0xde | 0xdf => "map",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0xa0..=0xbf | 0xd9..=0xdb => "str",
        0xc0 => "nil",
        0xc1 => "reserved byte 0xc1",
        0xc2 | 0xc3 => "bool",
        0xc4..=0xc6 => "bin",
        0xc7..=0xc9 | 0xd4..=0xd8 => "ext",
        0xca | 0xcb => "float",
    }
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(super) fn err<T>(&self, reason: impl Into<String>) -> R<T> {
        Err(Raw {
            offset: self.pos,
            reason: reason.into(),
        })
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    pub(super) fn peek(&self) -> R<u8> {
        match self.buf.get(self.pos) {
            Some(b) => Ok(*b),
            None => self.err("unexpected end of payload"),
        }
    }

    #[inline]
    pub(super) fn take(&mut self, n: usize) -> R<&'a [u8]> {
        if self.remaining() < n {
            return self.err(format!(
                "truncated: needs {n} more bytes, {} left",
                self.remaining()
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    pub(super) fn byte(&mut self) -> R<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    pub(super) fn be<const N: usize>(&mut self) -> R<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(super) fn unexpected<T>(&self, m: u8, want: &str) -> R<T> {
        self.err(format!("expected {want}, found {}", type_name(m)))
    }

    /// A length that claims more elements than bytes remain cannot be real
    /// (each element takes at least one byte): reject before allocating.
    pub(super) fn check_len(&self, len: usize, min_elem_bytes: usize) -> R<usize> {
        if len.saturating_mul(min_elem_bytes) > self.remaining() {
            return self.err(format!(
                "length {len} exceeds the {} bytes left",
                self.remaining()
            ));
        }
        Ok(len)
    }

    /// Whether the next value is nil (does not consume).
    #[inline]
    pub(super) fn at_nil(&self) -> bool {
        self.buf.get(self.pos) == Some(&0xc0)
    }

    #[inline]
    pub(super) fn array_len(&mut self) -> R<usize> {
        let m = self.peek()?;
        let len = match m {
            0x90..=0x9f => {
                self.pos += 1;
                (m & 0x0f) as usize
            }
            0xdc => {
                self.pos += 1;
                u16::from_be_bytes(self.be()?) as usize
            }
            0xdd => {
                self.pos += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.unexpected(m, "array"),
        };
        self.check_len(len, 1)
    }

    pub(super) fn map_len(&mut self) -> R<usize> {
        let m = self.peek()?;
        let len = match m {
            0x80..=0x8f => {
                self.pos += 1;
                (m & 0x0f) as usize
            }
            0xde => {
                self.pos += 1;
                u16::from_be_bytes(self.be()?) as usize
            }
            0xdf => {
                self.pos += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.unexpected(m, "map"),
        };
        self.check_len(len, 2)
    }

    pub(super) fn str(&mut self) -> R<&'a str> {
        let m = self.peek()?;
        let len = match m {
            0xa0..=0xbf => {
                self.pos += 1;
                (m & 0x1f) as usize
            }
            0xd9 => {
                self.pos += 1;
                self.byte()? as usize
            }
            0xda => {
                self.pos += 1;
                u16::from_be_bytes(self.be()?) as usize
            }
            0xdb => {
                self.pos += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.unexpected(m, "str"),
        };
        let start = self.pos;
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes).map_err(|e| Raw {
            offset: start + e.valid_up_to(),
            reason: "str is not valid UTF-8".into(),
        })
    }

    pub(super) fn opt_str(&mut self) -> R<Option<&'a str>> {
        if self.at_nil() {
            self.pos += 1;
            return Ok(None);
        }
        self.str().map(Some)
    }

    pub(super) fn bin(&mut self) -> R<&'a [u8]> {
        let m = self.peek()?;
        let len = match m {
            0xc4 => {
                self.pos += 1;
                self.byte()? as usize
            }
            0xc5 => {
                self.pos += 1;
                u16::from_be_bytes(self.be()?) as usize
            }
            0xc6 => {
                self.pos += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.unexpected(m, "bin"),
        };
        self.take(len)
    }

    #[inline]
    pub(super) fn int(&mut self) -> R<Int> {
        let m = self.peek()?;
        let v = match m {
            0x00..=0x7f => {
                self.pos += 1;
                Int::U(m as u64)
            }
            0xe0..=0xff => {
                self.pos += 1;
                Int::I(m as i8 as i64)
            }
            0xcc => {
                self.pos += 1;
                Int::U(self.byte()? as u64)
            }
            0xcd => {
                self.pos += 1;
                Int::U(u16::from_be_bytes(self.be()?) as u64)
            }
            0xce => {
                self.pos += 1;
                Int::U(u32::from_be_bytes(self.be()?) as u64)
            }
            0xcf => {
                self.pos += 1;
                Int::U(u64::from_be_bytes(self.be()?))
            }
            0xd0 => {
                self.pos += 1;
                Int::I(self.byte()? as i8 as i64)
            }
            0xd1 => {
                self.pos += 1;
                Int::I(i16::from_be_bytes(self.be()?) as i64)
            }
            0xd2 => {
                self.pos += 1;
                Int::I(i32::from_be_bytes(self.be()?) as i64)
            }
            0xd3 => {
                self.pos += 1;
                Int::I(i64::from_be_bytes(self.be()?))
            }
            _ => return self.unexpected(m, "int"),
        };
        Ok(v)
    }

    /// A non-negative integer that fits `u32` (token ids, sizes, indices).
    #[inline]
    pub(super) fn u32(&mut self) -> R<u32> {
        // Fast path: token ids below 128 are one byte.
        if let Some(&b) = self.buf.get(self.pos) {
            if b < 0x80 {
                self.pos += 1;
                return Ok(b as u32);
            }
        }
        let start = self.pos;
        let v = match self.int()? {
            Int::U(v) => u32::try_from(v).ok(),
            Int::I(v) => u32::try_from(v).ok(),
        };
        v.ok_or_else(|| Raw {
            offset: start,
            reason: "integer out of range for u32".into(),
        })
    }

    pub(super) fn opt_u32(&mut self) -> R<Option<u32>> {
        if self.at_nil() {
            self.pos += 1;
            return Ok(None);
        }
        self.u32().map(Some)
    }

    pub(super) fn f64(&mut self) -> R<f64> {
        let m = self.peek()?;
        match m {
            0xcb => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            0xca => {
                self.pos += 1;
                Ok(f32::from_be_bytes(self.be()?) as f64)
            }
            // An integral timestamp is still a timestamp.
            0x00..=0x7f | 0xcc..=0xcf | 0xd0..=0xd3 | 0xe0..=0xff => Ok(match self.int()? {
                Int::U(v) => v as f64,
                Int::I(v) => v as f64,
            }),
            _ => self.unexpected(m, "float"),
        }
    }

    /// Skips one value of any type (unknown fields), bounded in depth.
    pub(super) fn skip(&mut self, depth: usize) -> R<()> {
        if depth > MAX_SKIP_DEPTH {
            return self.err("nesting too deep");
        }
        let m = self.byte()?;
        let skip_n = |r: &mut Self, n: usize| r.take(n).map(|_| ());
        match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => Ok(()),
            0xc1 => {
                self.pos -= 1;
                self.err("reserved byte 0xc1")
            }
            0x80..=0x8f => self.skip_items((m & 0x0f) as usize * 2, depth),
            0x90..=0x9f => self.skip_items((m & 0x0f) as usize, depth),
            0xa0..=0xbf => skip_n(self, (m & 0x1f) as usize),
            0xc4 | 0xd9 => {
                let n = self.byte()? as usize;
                skip_n(self, n)
            }
            0xc5 | 0xda => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                skip_n(self, n)
            }
            0xc6 | 0xdb => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                skip_n(self, n)
            }
            0xc7 => {
                let n = self.byte()? as usize;
                skip_n(self, n + 1)
            }
            0xc8 => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                skip_n(self, n + 1)
            }
            0xc9 => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                skip_n(self, n.saturating_add(1))
            }
            0xca => skip_n(self, 4),
            0xcb => skip_n(self, 8),
            0xcc | 0xd0 => skip_n(self, 1),
            0xcd | 0xd1 => skip_n(self, 2),
            0xce | 0xd2 => skip_n(self, 4),
            0xcf | 0xd3 => skip_n(self, 8),
            0xd4 => skip_n(self, 2),
            0xd5 => skip_n(self, 3),
            0xd6 => skip_n(self, 5),
            0xd7 => skip_n(self, 9),
            0xd8 => skip_n(self, 17),
            0xdc => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                self.skip_items(n, depth)
            }
            0xdd => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                self.skip_items(n, depth)
            }
            0xde => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                self.skip_items(n * 2, depth)
            }
            0xdf => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                self.skip_items(n.saturating_mul(2), depth)
            }
        }
    }

    pub(super) fn skip_items(&mut self, n: usize, depth: usize) -> R<()> {
        self.check_len(n, 1)?;
        for _ in 0..n {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}
