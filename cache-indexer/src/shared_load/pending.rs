//! The pure half of sharing picks still in prefill: how a replica's
//! pending chains are written into its field of the pool's second hash
//! (`<keyPrefix><pool>:pending`), and how the fields read back become the
//! other live replicas' chains per endpoint.
//!
//! Liveness is the load entry's ([`super::merge`]): a replica's pending
//! field is read only while its load field is live, so both stop counting
//! together and are deleted together.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use super::merge::MAX_ENTRY_ENDPOINTS;
use crate::load::{PeerPending, SampledChain, MAX_PENDING_PREFIXES};
use crate::types::EndpointId;

/// Version tag of the entry format; an entry without it is not read.
const FORMAT: &str = "p1";
/// Longest entry written or read: a reader refuses longer ones unread, a
/// writer leaves out the oldest chains that would not fit.
pub const MAX_PENDING_ENTRY_BYTES: usize = 256 * 1024;

/// One replica's chains in prefill per endpoint, newest first (as
/// [`crate::load::LoadTracker::own_pending`] gives them).
pub type OwnPending = Vec<(EndpointId, Vec<Arc<[u64]>>)>;

/// What identifies an [`OwnPending`] without sampling it: endpoint, length
/// and last hash of each chain. A chain completed later (longer) or a pick
/// that left prefill changes it; equal ones need not be written again.
pub type Fingerprint = Vec<(u64, usize, u64)>;

/// The fingerprint of `own`.
pub fn fingerprint(own: &OwnPending) -> Fingerprint {
    own.iter()
        .flat_map(|(id, chains)| {
            chains
                .iter()
                .map(move |c| (id.0, c.len(), c.last().copied().unwrap_or(0)))
        })
        .collect()
}

/// The entry's text: `p1 <id>=<chain>/<chain>...,<id>=...`, each chain as
/// [`SampledChain::encode_into`] writes it. At most
/// [`MAX_PENDING_PREFIXES`] chains per endpoint; past
/// [`MAX_PENDING_ENTRY_BYTES`] the rest of the chains are left out, so a
/// reader never refuses a whole entry this writes.
pub fn encode(own: &OwnPending) -> String {
    let mut s = String::from(FORMAT);
    s.push(' ');
    let mut first = true;
    let mut item = String::new();
    let mut chain = String::new();
    'endpoints: for (id, chains) in own {
        item.clear();
        let _ = write!(item, "{}{id}=", if first { "" } else { "," });
        let mut any = false;
        for c in chains.iter().take(MAX_PENDING_PREFIXES) {
            let Some(sampled) = SampledChain::of(c) else {
                continue;
            };
            chain.clear();
            if any {
                chain.push('/');
            }
            sampled.encode_into(&mut chain);
            if s.len() + item.len() + chain.len() > MAX_PENDING_ENTRY_BYTES {
                if any {
                    s.push_str(&item);
                }
                break 'endpoints;
            }
            item.push_str(&chain);
            any = true;
        }
        if any {
            s.push_str(&item);
            first = false;
        }
    }
    s
}

/// An entry read back; `None` for anything [`encode`] does not write,
/// an entry past [`MAX_PENDING_ENTRY_BYTES`] included (left unread).
pub fn decode(text: &str) -> Option<Vec<(EndpointId, Vec<SampledChain>)>> {
    if text.len() > MAX_PENDING_ENTRY_BYTES {
        return None;
    }
    let body = text.strip_prefix(FORMAT)?.strip_prefix(' ')?;
    let mut out = Vec::new();
    if body.is_empty() {
        return Some(out);
    }
    for item in body.split(',') {
        if out.len() == MAX_ENTRY_ENDPOINTS {
            return None;
        }
        out.push(decode_item(item)?);
    }
    Some(out)
}

fn decode_item(item: &str) -> Option<(EndpointId, Vec<SampledChain>)> {
    let (id, chains) = item.split_once('=')?;
    if id.is_empty() || id.len() > 16 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let id = EndpointId(u64::from_str_radix(id, 16).ok()?);
    let mut out = Vec::new();
    for c in chains.split('/') {
        if out.len() == MAX_PENDING_PREFIXES {
            return None;
        }
        out.push(SampledChain::decode(c)?);
    }
    Some((id, out))
}

/// The chains of the replicas in `live` (the load entries' verdict, sorted)
/// out of one read of the pending hash; other fields are not even decoded. An
/// entry that does not decode is refused whole and counted.
pub fn merge(live: &[String], fields: Vec<(String, String)>) -> PeerPending {
    let mut out = PeerPending::default();
    let mut chains: HashMap<EndpointId, Vec<SampledChain>> = HashMap::new();
    for (field, text) in fields {
        if live.binary_search(&field).is_err() {
            continue;
        }
        let Some(entry) = decode(&text) else {
            out.refused += 1;
            continue;
        };
        for (id, c) in entry {
            chains.entry(id).or_default().extend(c);
        }
    }
    out.chains = chains;
    out
}

#[cfg(test)]
#[path = "pending_tests.rs"]
mod tests;
