use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::*;
use crate::types::EndpointSpec;

fn cfg(grace_ms: u64) -> AffinityConfig {
    AffinityConfig {
        grace: Duration::from_millis(grace_ms),
        store_timeout: Duration::from_millis(30),
        ..AffinityConfig::default()
    }
}

fn endpoints(n: usize) -> Vec<Arc<Endpoint>> {
    (0..n)
        .map(|i| {
            let spec = EndpointSpec::loopback(i);
            Arc::new(Endpoint {
                id: spec.id(),
                spec,
                subscriber: None,
            })
        })
        .collect()
}

/// A shared store that never answers: every call must be cut by the
/// caller's bound.
#[derive(Debug)]
struct Hanging;

impl ResponseStore for Hanging {
    fn put<'a>(
        &'a self,
        _: &'a str,
        _: &'a Record,
        _: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(futures::future::pending())
    }
    fn get<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(futures::future::pending())
    }
    fn kind(&self) -> &'static str {
        "hanging"
    }
}

#[tokio::test]
async fn a_recorded_id_is_found_at_once() {
    let a = Affinity::new("p", cfg(1000), None);
    a.record("resp_1", "127.0.0.1:8001", "acme");
    let started = Instant::now();
    let e = a
        .resolve("resp_1", "acme", || Arc::new(endpoints(2)))
        .await
        .unwrap();
    assert_eq!(e.spec.address, "127.0.0.1:8001");
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!((a.metrics.hits.get(), a.metrics.waited.get()), (1, 0));
}

#[tokio::test]
async fn a_pick_waits_for_a_late_report_and_no_longer_than_the_grace() {
    let a = Arc::new(Affinity::new("p", cfg(1000), None));
    let late = Arc::clone(&a);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        late.record("resp_late", "127.0.0.1:8000", "acme");
    });
    let started = Instant::now();
    assert!(matches!(a.find("resp_late", "acme").await, Found::Held(_)));
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "woken by the record"
    );

    let a = Affinity::new("p", cfg(80), None);
    let started = Instant::now();
    assert_eq!(
        a.find("nobody", "acme").await,
        Found::Lost(Lost::NotRecorded)
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(80) && took < Duration::from_secs(1),
        "{took:?}"
    );
    assert_eq!(a.metrics.waited.get(), 1);
}

#[tokio::test]
async fn a_store_that_never_answers_costs_a_bounded_wait_and_is_counted() {
    let a = Affinity::new("p", cfg(100), Some(Arc::new(Hanging)));
    a.record("resp_local", "127.0.0.1:8000", "acme");
    let started = Instant::now();
    assert!(
        matches!(a.find("resp_local", "acme").await, Found::Held(_)),
        "local first"
    );
    assert_eq!(
        a.find("resp_else", "acme").await,
        Found::Lost(Lost::NotRecorded)
    );
    assert!(
        started.elapsed() < Duration::from_millis(600),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(a.metrics.store_get_fallbacks.get(), 1, "once per pick");
    let deadline = Instant::now() + Duration::from_secs(2);
    while a.metrics.store_put_fallbacks.get() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        a.metrics.store_put_fallbacks.get(),
        1,
        "the write-through timed out"
    );
}

#[tokio::test]
async fn an_endpoint_that_left_loses_its_records_even_when_back() {
    let a = Affinity::new("p", cfg(0), None);
    let eps = endpoints(2);
    a.record("resp_1", "127.0.0.1:8001", "acme");
    tokio::time::sleep(Duration::from_millis(2)).await;
    a.endpoint_left(eps[1].id);
    let r = a.resolve("resp_1", "acme", || Arc::new(eps.clone())).await;
    assert_eq!(r.map(|e| e.id), Err(Lost::EndpointGone));
    let r = a.resolve("resp_1", "acme", || Arc::new(endpoints(1))).await;
    assert_eq!(r.map(|e| e.id), Err(Lost::EndpointGone));
    tokio::time::sleep(Duration::from_millis(2)).await;
    a.record("resp_2", "127.0.0.1:8001", "acme");
    assert!(
        a.resolve("resp_2", "acme", || Arc::new(eps.clone()))
            .await
            .is_ok(),
        "recorded after it came back"
    );
    assert_eq!(a.metrics.unknown[Lost::EndpointGone as usize].get(), 2);
}

#[tokio::test]
async fn another_tenants_response_is_unknown_after_the_same_wait() {
    let a = Affinity::new("p", cfg(80), None);
    a.record("resp_a", "127.0.0.1:8000", "acme");
    let eps = endpoints(1);
    assert!(a
        .resolve("resp_a", "acme", || Arc::new(eps.clone()))
        .await
        .is_ok());
    let started = Instant::now();
    let r = a.resolve("resp_a", "beta", || Arc::new(eps.clone())).await;
    let took = started.elapsed();
    assert_eq!(r.map(|e| e.id), Err(Lost::OtherTenant));
    let started = Instant::now();
    let r = a
        .resolve("resp_none", "beta", || Arc::new(eps.clone()))
        .await;
    let unknown_took = started.elapsed();
    assert_eq!(r.map(|e| e.id), Err(Lost::NotRecorded));
    // Both wait the whole grace: the answer's timing does not tell them
    // apart.
    for t in [took, unknown_took] {
        assert!(t >= Duration::from_millis(80), "{t:?}");
        assert!(t < Duration::from_secs(2), "{t:?}");
    }
    // Another tenant's report cannot take the id over.
    a.record("resp_a", "127.0.0.1:8000", "beta");
    assert_eq!(a.metrics.owner_kept.get(), 1);
    assert!(a
        .resolve("resp_a", "acme", || Arc::new(eps.clone()))
        .await
        .is_ok());
    assert_eq!(a.metrics.unknown[Lost::OtherTenant as usize].get(), 1);
}

#[tokio::test]
async fn a_shared_record_keeps_its_owner_across_replicas() {
    let shared: Arc<dyn ResponseStore> = Arc::new(MemoryStore::new(16));
    let one = Affinity::new("p", cfg(200), Some(Arc::clone(&shared)));
    let two = Affinity::new("p", cfg(60), Some(Arc::clone(&shared)));
    one.record("resp_s", "127.0.0.1:8000", "acme");
    let eps = endpoints(1);
    let deadline = Instant::now() + Duration::from_secs(2);
    while !matches!(two.find("resp_s", "acme").await, Found::Held(_)) {
        assert!(Instant::now() < deadline, "the write-through lands");
    }
    let r = two
        .resolve("resp_s", "beta", || Arc::new(eps.clone()))
        .await;
    assert_eq!(r.map(|e| e.id), Err(Lost::OtherTenant));
    assert!(two
        .resolve("resp_s", "acme", || Arc::new(eps.clone()))
        .await
        .is_ok());
}
