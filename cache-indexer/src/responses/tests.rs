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
    a.record("resp_1", "127.0.0.1:8001");
    let started = Instant::now();
    let e = a
        .resolve("resp_1", || Arc::new(endpoints(2)))
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
        late.record("resp_late", "127.0.0.1:8000");
    });
    let started = Instant::now();
    assert!(matches!(a.find("resp_late").await, Found::Held(_)));
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "woken by the record"
    );

    let a = Affinity::new("p", cfg(80), None);
    let started = Instant::now();
    assert_eq!(a.find("nobody").await, Found::Lost(Lost::NotRecorded));
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
    a.record("resp_local", "127.0.0.1:8000");
    let started = Instant::now();
    assert!(
        matches!(a.find("resp_local").await, Found::Held(_)),
        "local first"
    );
    assert_eq!(a.find("resp_else").await, Found::Lost(Lost::NotRecorded));
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
    a.record("resp_1", "127.0.0.1:8001");
    tokio::time::sleep(Duration::from_millis(2)).await;
    a.endpoint_left(eps[1].id);
    let r = a.resolve("resp_1", || Arc::new(eps.clone())).await;
    assert_eq!(r.map(|e| e.id), Err(Lost::EndpointGone));
    let r = a.resolve("resp_1", || Arc::new(endpoints(1))).await;
    assert_eq!(r.map(|e| e.id), Err(Lost::EndpointGone));
    tokio::time::sleep(Duration::from_millis(2)).await;
    a.record("resp_2", "127.0.0.1:8001");
    assert!(
        a.resolve("resp_2", || Arc::new(eps.clone())).await.is_ok(),
        "recorded after it came back"
    );
    assert_eq!(a.metrics.unknown[Lost::EndpointGone as usize].get(), 2);
}
