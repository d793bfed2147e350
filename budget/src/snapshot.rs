//! A [`TenantBudget`]'s state as bytes, for a budget kept where only bytes
//! can be: the Envoy filter's process-wide shared data, read and written
//! with compare-and-swap by every worker. The limits are not part of it:
//! they come with every use, as everywhere else.
//!
//! Layout (little endian): a version byte, `next_id` u64, four buckets of
//! (credit i128, last refill ms u64, primed u8), the number of open
//! reservations u32, then each as (id u64, since ms u64, held 4 x u64,
//! usage 3 x u64).

use std::collections::BTreeMap;

use crate::bucket::Bucket;
use crate::ledger::{Held, TenantBudget};
use crate::limits::{Cost, Limits, Usage};

const VERSION: u8 = 1;
const BUCKET_BYTES: usize = 16 + 8 + 1;
const OPEN_BYTES: usize = 8 * 9;

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

impl TenantBudget {
    /// The state as bytes (see the module docs).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(1 + 8 + 4 * BUCKET_BYTES + 4 + self.open.len() * OPEN_BYTES);
        b.push(VERSION);
        b.extend_from_slice(&self.next_id.to_le_bytes());
        for k in &self.buckets {
            b.extend_from_slice(&k.credit.to_le_bytes());
            b.extend_from_slice(&k.last_ms.to_le_bytes());
            b.push(u8::from(k.primed));
        }
        let n = u32::try_from(self.open.len()).unwrap_or(u32::MAX);
        b.extend_from_slice(&n.to_le_bytes());
        for (id, h) in self.open.iter().take(n as usize) {
            for v in [id, &h.since_ms].into_iter().chain(h.held.0.iter()).chain([
                &h.usage.prompt_tokens,
                &h.usage.cached_tokens,
                &h.usage.completion_tokens,
            ]) {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        b
    }

    /// A state [`TenantBudget::to_bytes`] wrote, under `limits`; `None`
    /// for anything else (the caller starts afresh).
    pub fn from_bytes(bytes: &[u8], limits: Limits) -> Option<TenantBudget> {
        let mut r = Reader(bytes);
        if r.take::<1>()? != [VERSION] {
            return None;
        }
        let next_id = r.u64()?;
        let mut buckets = [Bucket::default(); 4];
        for k in &mut buckets {
            k.credit = i128::from_le_bytes(r.take()?);
            k.last_ms = r.u64()?;
            k.primed = match r.take::<1>()? {
                [0] => false,
                [1] => true,
                _ => return None,
            };
        }
        let n = u32::from_le_bytes(r.take()?) as usize;
        if r.0.len() != n.checked_mul(OPEN_BYTES)? {
            return None;
        }
        let mut open = BTreeMap::new();
        for _ in 0..n {
            let id = r.u64()?;
            let since_ms = r.u64()?;
            let held = Cost([r.u64()?, r.u64()?, r.u64()?, r.u64()?]);
            let usage = Usage {
                prompt_tokens: r.u64()?,
                cached_tokens: r.u64()?,
                completion_tokens: r.u64()?,
            };
            open.insert(
                id,
                Held {
                    since_ms,
                    held,
                    usage,
                },
            );
        }
        Some(TenantBudget {
            limits,
            buckets,
            open,
            next_id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::Request;

    #[test]
    fn a_budget_round_trips_and_garbage_is_refused() {
        let limits = Limits {
            requests_per_minute: Some(10),
            total_tokens_per_minute: Some(5_000),
            max_concurrent: Some(3),
            ..Limits::default()
        };
        let mut b = TenantBudget::new(limits);
        let req = Request {
            prompt_tokens: 100,
            cached_tokens: 20,
            output_tokens: 50,
        };
        let r1 = b.reserve(5, &req).unwrap();
        let _r2 = b.reserve(6, &req).unwrap();
        b.settle(
            7,
            r1.id,
            &Usage {
                prompt_tokens: 100,
                cached_tokens: 20,
                completion_tokens: 80,
            },
        );
        let bytes = b.to_bytes();
        let back = TenantBudget::from_bytes(&bytes, limits).unwrap();
        assert_eq!(back, b);
        assert_eq!(back.in_flight(), 2);
        assert_eq!(
            TenantBudget::from_bytes(&TenantBudget::new(limits).to_bytes(), limits),
            Some(TenantBudget::new(limits))
        );
        for cut in 0..bytes.len() {
            assert_eq!(
                TenantBudget::from_bytes(&bytes[..cut], limits),
                None,
                "{cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(TenantBudget::from_bytes(&longer, limits), None);
        let mut wrong = bytes;
        wrong[0] = 9;
        assert_eq!(TenantBudget::from_bytes(&wrong, limits), None);
    }
}
