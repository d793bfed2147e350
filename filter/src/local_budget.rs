//! A tenant's budget kept by the filter itself, for the requests it admits
//! when it cannot ask the indexer (the pick failed open: timed out, the
//! indexer unreachable, a prompt it cannot pick for). Without it a fail-open
//! would let a tenant past every limit for as long as the indexer is away.
//!
//! Each Envoy enforces its share of each limit: the tenant's limits divided
//! by the policy's `gatewayReplicas` (at least one request in flight), so
//! the Envoys of a deployment together stay within the budget while none of
//! them can reach the indexer. The state is one [`TenantBudget`] per tenant
//! in Envoy's process-wide shared data (every worker's VM reads and writes
//! it with compare-and-swap), on the wall clock. A request reserves its
//! prompt's estimate plus `max_tokens` (else the tenant's default output)
//! and is released with its usage at its end; a reservation whose end never
//! comes (a VM that died) expires after [`MAX_AGE_MS`]. What was admitted
//! here is also reported to the indexer (`ADMISSION_LOCAL`), which charges
//! it to the shared budget when it hears of it.

use kvasir_budget::{Limits, Refusal, Request, TenantBudget, Usage};
use kvasir_policy::BudgetConfig;

use crate::host::SharedData;
use crate::pick::budget_message;

/// Shared-data key of a tenant's local budget (then the tenant's name).
pub const KEY_PREFIX: &str = "kvasir.local_budget.";
/// A local reservation whose end was never seen is dropped after this
/// long, keeping its charge.
pub const MAX_AGE_MS: u64 = 10 * 60_000;
/// Compare-and-swap attempts before the admission gives up on the shared
/// state and admits without it (counted by the caller).
const MAX_TRIES: usize = 8;

/// A request admitted from the local budget: what ends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalAdmission {
    /// The tenant.
    pub tenant: String,
    /// The reservation's id in the tenant's local budget.
    pub id: u64,
    /// What it reserved, to release it with when the response carried no
    /// usage.
    pub request: Request,
}

/// What [`admit`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalVerdict {
    /// Admitted: end it with [`end`].
    Admitted(LocalAdmission),
    /// Refused: the refusal and the budget's headers.
    Refused(Refusal, kvasir_budget::RateLimitHeaders),
    /// The shared state could not be read or written: admitted without it.
    Unavailable,
}

/// The limits of a compiled budget, divided into this Envoy's share. They
/// are read from the budget a pick sends ([`budget_message`]) as the indexer
/// reads them, so a request admitted here is held to the limits the indexer
/// would hold it to.
pub fn share_of(b: &BudgetConfig, gateway_replicas: u32) -> Limits {
    Limits::from(&budget_message("", b, 0)).divided(gateway_replicas)
}

/// What a request asks of its budget: its prompt's estimate, nothing
/// expected cached, and `max_tokens` or the budget's default output.
pub fn request_of(b: &BudgetConfig, prompt_tokens: u64, max_tokens: u64) -> Request {
    Request {
        prompt_tokens,
        cached_tokens: 0,
        output_tokens: if max_tokens > 0 {
            max_tokens
        } else {
            u64::from(b.default_output_tokens)
        },
    }
}

fn key(tenant: &str) -> String {
    format!("{KEY_PREFIX}{tenant}")
}

/// Applies `op` to the tenant's budget in shared data, compare-and-swap;
/// `None` when the state could not be written.
fn update<T>(
    host: &mut dyn SharedData,
    tenant: &str,
    limits: Limits,
    mut op: impl FnMut(&mut TenantBudget) -> (T, bool),
) -> Option<T> {
    let key = key(tenant);
    for _ in 0..MAX_TRIES {
        let (bytes, cas) = host.get(&key);
        let mut b = bytes
            .and_then(|b| TenantBudget::from_bytes(&b, limits))
            .unwrap_or_else(|| TenantBudget::new(limits));
        let (out, write) = op(&mut b);
        if !write || host.set(&key, &b.to_bytes(), cas) {
            return Some(out);
        }
    }
    None
}

/// Admits `request` against `tenant`'s share of its budget at `now_ms`
/// (wall clock).
pub fn admit(
    host: &mut dyn SharedData,
    tenant: &str,
    limits: Limits,
    request: Request,
    now_ms: u64,
) -> LocalVerdict {
    let r = update(host, tenant, limits, |b| {
        b.expire(now_ms, MAX_AGE_MS);
        match b.reserve(now_ms, &request) {
            Ok(r) => (Ok(r.id), true),
            Err(e) => (
                Err((e, kvasir_budget::RateLimitHeaders::of(b, now_ms))),
                false,
            ),
        }
    });
    match r {
        Some(Ok(id)) => LocalVerdict::Admitted(LocalAdmission {
            tenant: tenant.to_string(),
            id,
            request,
        }),
        Some(Err((refusal, headers))) => LocalVerdict::Refused(refusal, headers),
        None => LocalVerdict::Unavailable,
    }
}

/// Ends a local admission with the request's usage (`None`: the prompt as
/// reserved, no completion); false when the state could not be written.
pub fn end(
    host: &mut dyn SharedData,
    a: &LocalAdmission,
    limits: Limits,
    usage: Option<Usage>,
    now_ms: u64,
) -> bool {
    let usage = usage.unwrap_or(Usage {
        prompt_tokens: a.request.prompt_tokens,
        cached_tokens: 0,
        completion_tokens: 0,
    });
    update(host, &a.tenant, limits, |b| {
        let done = b.release(now_ms, a.id, &usage).is_some();
        ((), done)
    })
    .is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemShared;

    fn limits() -> Limits {
        Limits {
            requests_per_minute: Some(100),
            max_concurrent: Some(4),
            ..Limits::default()
        }
    }

    #[test]
    fn the_share_divides_every_limit_and_keeps_one_slot() {
        let b = BudgetConfig {
            tokens_per_minute: Some(10_000),
            prompt_tokens_per_minute: None,
            completion_tokens_per_minute: None,
            requests_per_minute: Some(60),
            max_concurrent: Some(2),
            cached_token_weight_permille: 500,
            default_output_tokens: 256,
        };
        let l = share_of(&b, 4);
        assert_eq!(l.total_tokens_per_minute, Some(2_500));
        assert_eq!(l.requests_per_minute, Some(15));
        assert_eq!(l.max_concurrent, Some(1), "at least one request");
        assert_eq!(l.cached_token_weight.permille(), 500);
        assert_eq!(share_of(&b, 1).max_concurrent, Some(2));
        assert_eq!(request_of(&b, 10, 0).output_tokens, 256);
        assert_eq!(request_of(&b, 10, 7).output_tokens, 7);
    }

    #[test]
    fn concurrency_is_held_across_workers_until_the_end() {
        let mut host = MemShared::default();
        let mut other_worker = host.same_process();
        let req = Request {
            prompt_tokens: 10,
            cached_tokens: 0,
            output_tokens: 10,
        };
        let mut held = Vec::new();
        for i in 0..4 {
            let h: &mut dyn SharedData = if i % 2 == 0 {
                &mut host
            } else {
                &mut other_worker
            };
            match admit(h, "beta", limits(), req, 1_000) {
                LocalVerdict::Admitted(a) => held.push(a),
                v => panic!("{v:?}"),
            }
        }
        let v = admit(&mut other_worker, "beta", limits(), req, 1_000);
        assert!(
            matches!(
                v,
                LocalVerdict::Refused(Refusal::Concurrency { limit: 4 }, _)
            ),
            "{v:?}"
        );
        assert!(matches!(
            admit(&mut host, "acme", limits(), req, 1_000),
            LocalVerdict::Admitted(_)
        ));
        assert!(end(&mut host, &held[0], limits(), None, 1_100));
        assert!(matches!(
            admit(&mut other_worker, "beta", limits(), req, 1_200),
            LocalVerdict::Admitted(_)
        ));
    }

    #[test]
    fn a_lost_end_expires_and_a_broken_store_admits() {
        let mut host = MemShared::default();
        let one = Limits {
            max_concurrent: Some(1),
            ..Limits::default()
        };
        let req = Request::default();
        assert!(matches!(
            admit(&mut host, "t", one, req, 0),
            LocalVerdict::Admitted(_)
        ));
        assert!(matches!(
            admit(&mut host, "t", one, req, 1),
            LocalVerdict::Refused(..)
        ));
        assert!(matches!(
            admit(&mut host, "t", one, req, MAX_AGE_MS + 1),
            LocalVerdict::Admitted(_)
        ));
        host.fail_writes(true);
        assert_eq!(
            admit(&mut host, "u", one, req, 0),
            LocalVerdict::Unavailable
        );
    }
}
