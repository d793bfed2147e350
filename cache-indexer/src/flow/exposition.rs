//! Flow control's families, per pool (see [`crate::flow`]): whether it is
//! on, picks and tokens waiting (in all and per tenant with picks waiting,
//! so the tenant label is bounded by the queue), picks in transit, and the
//! counters of picks queued, released, shed (by cause) and cancelled. Written
//! for every pool, zeros when flow control is off, so the page's families do
//! not depend on the configuration. Per tenant seen (bounded,
//! [`crate::flow::metrics::MAX_TENANTS`]): the reserve's held and passed
//! picks, and the released picks' count and summed wait. The queue-wait histogram is written by
//! hand ([`render_wait`]), as the latency histograms are.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType::{Counter, Gauge};

use crate::exposition::family;
use crate::exposition::histograms::TextWriter;
use crate::flow::metrics::{ShedCause, TenantCounts, WaitHistogram, WAIT_BUCKETS};
use crate::flow::FlowMetrics;
use crate::pools::Pools;

/// A per-pool counter family: name, help, and its value.
type CounterFamily = (&'static str, &'static str, fn(&FlowMetrics) -> u64);
/// A per-pool and cause counter family (by [`ShedCause::position`]).
type CauseFamily = (&'static str, &'static str, fn(&FlowMetrics, usize) -> u64);
/// A per-pool gauge family.
type GaugeFamily = (&'static str, &'static str, fn(&crate::Pool) -> u64);
/// Per tenant with picks waiting: (tenant, picks, tokens).
type Waiting = Vec<(String, usize, u64)>;

/// Reads each pool's flow control at each scrape.
#[derive(Debug)]
pub(crate) struct FlowCollector(pub(crate) Arc<Pools>);

impl Collector for FlowCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let enc = &mut enc;
        self.gauges(enc)?;
        let counters: [CounterFamily; 5] = [
            (
                "kvasir_indexer_flow_queued_total",
                "Picks that waited in the pool's flow-control queue (the pool was saturated).",
                |m| m.queued.get(),
            ),
            (
                "kvasir_indexer_flow_queued_tokens_total",
                "Tokens (prompt plus output estimate) of the picks that waited.",
                |m| m.queued_tokens.get(),
            ),
            (
                "kvasir_indexer_flow_released_total",
                "Waiting picks released to be placed (an endpoint had room).",
                |m| m.released.get(),
            ),
            (
                "kvasir_indexer_flow_released_tokens_total",
                "Tokens of the released picks.",
                |m| m.released_tokens.get(),
            ),
            (
                "kvasir_indexer_flow_cancelled_total",
                "Waiting picks whose caller went away before they left the queue.",
                |m| m.cancelled.get(),
            ),
        ];
        for (name, help, value) in counters {
            let mut f = family(enc, name, Counter, help)?;
            for p in self.0.iter() {
                f.sample(&[("pool", &p.name)], value(&p.flow.metrics))?;
            }
        }
        let shed: [CauseFamily; 2] = [
            (
                "kvasir_indexer_flow_shed_total",
                "Picks shed (answered SHED, 429) by cause: pool_full, tenant_full, no_wait (the caller or the pool allows no wait), max_wait (waited its longest).",
                |m, i| m.shed[i].get(),
            ),
            (
                "kvasir_indexer_flow_shed_tokens_total",
                "Tokens of the picks shed, by cause.",
                |m, i| m.shed_tokens[i].get(),
            ),
        ];
        for (name, help, value) in shed {
            let mut f = family(enc, name, Counter, help)?;
            for p in self.0.iter() {
                for (i, c) in ShedCause::KNOWN.into_iter().enumerate() {
                    let labels = [("pool", p.name.as_str()), ("cause", c.as_label())];
                    f.sample(&labels, value(&p.flow.metrics, i))?;
                }
            }
        }
        self.tenants(enc)
    }
}

impl FlowCollector {
    /// The per-tenant counters: what the reserve did to a tenant's picks,
    /// and how long its released picks waited at the gateway (with the
    /// TTFT a client sees, the rest is the engine's queue and prefill).
    fn tenants(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let counts: Vec<(String, Vec<(String, TenantCounts)>)> = self
            .0
            .iter()
            .map(|p| (p.name.clone(), p.flow.metrics.tenant_counts()))
            .collect();
        let name = "kvasir_indexer_flow_reserve_total";
        let help = "Picks of a tenant over its weighted share of the work in flight, by outcome: held (waited only for the reserve: the pool had room by the threshold, none below the tenant's bound), passed (went, or were released, below the bound).";
        let mut f = family(enc, name, Counter, help)?;
        for (pool, ts) in &counts {
            for (tenant, c) in ts {
                for (outcome, n) in [("held", c.reserve_held), ("passed", c.reserve_passed)] {
                    let labels = [
                        ("pool", pool.as_str()),
                        ("tenant", tenant),
                        ("outcome", outcome),
                    ];
                    f.sample(&labels, n)?;
                }
            }
        }
        let name = "kvasir_indexer_flow_tenant_released_total";
        let help = "Queued picks released, per tenant.";
        let mut f = family(enc, name, Counter, help)?;
        for (pool, ts) in &counts {
            for (tenant, c) in ts {
                f.sample(&[("pool", pool), ("tenant", tenant)], c.released)?;
            }
        }
        let name = "kvasir_indexer_flow_tenant_queue_wait_seconds_total";
        let help = "Summed wait of the released picks in the flow-control queue, per tenant.";
        let mut f = family(enc, name, Counter, help)?;
        for (pool, ts) in &counts {
            for (tenant, c) in ts {
                let secs = c.wait_ns as f64 / 1e9;
                f.sample(&[("pool", pool), ("tenant", tenant)], secs)?;
            }
        }
        Ok(())
    }

    fn gauges(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let per_pool: [GaugeFamily; 3] = [
            (
                "kvasir_indexer_flow_control_enabled",
                "1 when the pool's flowControl is enabled (picks wait while it is saturated).",
                |p| u64::from(p.flow.enabled()),
            ),
            (
                "kvasir_indexer_flow_queue_length",
                "Picks waiting in the pool's flow-control queue now.",
                |p| p.flow.len() as u64,
            ),
            (
                "kvasir_indexer_flow_in_transit",
                "Picks let through or released and not placed yet (counted as load).",
                |p| p.flow.in_transit() as u64,
            ),
        ];
        for (name, help, value) in per_pool {
            let mut f = family(enc, name, Gauge, help)?;
            for p in self.0.iter() {
                f.sample(&[("pool", &p.name)], value(p))?;
            }
        }
        let tenants: Vec<(String, Waiting)> = self
            .0
            .iter()
            .map(|p| (p.name.clone(), p.flow.tenants()))
            .collect();
        let name = "kvasir_indexer_flow_queue_tenant_length";
        let help = "Picks waiting per tenant (only tenants with picks waiting).";
        let mut f = family(enc, name, Gauge, help)?;
        for (pool, ts) in &tenants {
            for (tenant, n, _) in ts {
                f.sample(&[("pool", pool), ("tenant", tenant)], *n as u64)?;
            }
        }
        let name = "kvasir_indexer_flow_queue_tenant_tokens";
        let help = "Tokens (prompt plus output estimate) waiting per tenant (only tenants with picks waiting).";
        let mut f = family(enc, name, Gauge, help)?;
        for (pool, ts) in &tenants {
            for (tenant, _, tokens) in ts {
                f.sample(&[("pool", pool), ("tenant", tenant)], *tokens)?;
            }
        }
        Ok(())
    }
}

/// Appends the queue-wait histogram of every pool.
pub(crate) fn render_wait(out: &mut String, pools: &Pools) {
    let name = "kvasir_indexer_flow_queue_wait_seconds";
    let mut w = TextWriter { out };
    w.header(
        name,
        "histogram",
        "How long released picks waited in the pool's flow-control queue.",
    );
    for p in pools.iter() {
        write_histogram(&mut w, &p.flow.metrics.wait, name, &p.name);
    }
}

fn write_histogram(w: &mut TextWriter<'_>, h: &WaitHistogram, name: &str, pool: &str) {
    let bucket = format!("{name}_bucket");
    let mut cumulative = 0;
    for (bound, n) in WAIT_BUCKETS.iter().zip(h.buckets()) {
        cumulative += n;
        let le = format!("{bound}");
        w.sample(&bucket, &[("pool", pool), ("le", &le)], cumulative as f64);
    }
    let count = h.count();
    w.sample(&bucket, &[("pool", pool), ("le", "+Inf")], count as f64);
    w.sample(&format!("{name}_sum"), &[("pool", pool)], h.sum_seconds());
    w.sample(&format!("{name}_count"), &[("pool", pool)], count as f64);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use kvasir_flowcontrol::FlowControlConfig;

    use crate::flow::{Arrival, Ask};
    use crate::load::{EngineLoad, LoadConfig, LoadTracker, LoadView};
    use crate::pool::Pool;
    use crate::pools::Pools;
    use crate::scoring::Weights;
    use crate::tokenize::RequestTokenizer;
    use crate::types::EndpointId;

    #[test]
    fn flow_families_are_written_per_pool_and_waiting_tenant() {
        let pool = flow_pool(FlowControlConfig {
            enabled: true,
            ..FlowControlConfig::default()
        });
        let full = [(
            EndpointId(1),
            LoadView {
                engine: EngineLoad {
                    running: 1,
                    waiting: 5,
                    kv_usage: 0.1,
                },
                healthy: true,
                ..Default::default()
            },
        )];
        let ask = Ask {
            request_id: "r1".into(),
            tenant: "acme \"a\"".into(),
            priority: 0,
            weight: 1,
            tokens: 1234,
            max_wait: Duration::from_secs(5),
            price: Default::default(),
        };
        let th = pool.load.config().saturation.clone();
        let _waiting = pool.flow.arrive(&full, &th, ask, Instant::now());
        pool.flow.metrics.wait.observe(Duration::from_millis(30));
        let pools = Arc::new(Pools::new(vec![Arc::new(pool)]));
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(super::FlowCollector(Arc::clone(&pools))));
        let mut text = String::new();
        prometheus_client::encoding::text::encode_registry(&mut text, &registry).unwrap();
        super::render_wait(&mut text, &pools);
        for want in [
            "kvasir_indexer_flow_control_enabled{pool=\"p\"} 1\n",
            "kvasir_indexer_flow_queue_length{pool=\"p\"} 1\n",
            "kvasir_indexer_flow_queue_tenant_length{pool=\"p\",tenant=\"acme \\\"a\\\"\"} 1\n",
            "kvasir_indexer_flow_queue_tenant_tokens{pool=\"p\",tenant=\"acme \\\"a\\\"\"} 1234\n",
            "kvasir_indexer_flow_queued_total{pool=\"p\"} 1\n",
            "kvasir_indexer_flow_queued_tokens_total{pool=\"p\"} 1234\n",
            "kvasir_indexer_flow_shed_total{pool=\"p\",cause=\"max_wait\"} 0\n",
            "# TYPE kvasir_indexer_flow_queue_wait_seconds histogram\n",
            "kvasir_indexer_flow_queue_wait_seconds_bucket{pool=\"p\",le=\"0.025\"} 0\n",
            "kvasir_indexer_flow_queue_wait_seconds_bucket{pool=\"p\",le=\"0.05\"} 1\n",
            "kvasir_indexer_flow_queue_wait_seconds_count{pool=\"p\"} 1\n",
        ] {
            assert!(text.contains(want), "{want} in\n{text}");
        }
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            crate::load::parse_sample(line).unwrap();
        }
    }

    /// Pool "p" with `flow` as its flow control.
    fn flow_pool(flow: FlowControlConfig) -> Pool {
        Pool::new(
            "p",
            "m",
            4,
            RequestTokenizer::Approx,
            LoadTracker::new(LoadConfig::default()),
            Weights::default(),
        )
        .with_flow_control(flow)
    }

    /// An endpoint with `waiting` of the 5 that saturate it queued.
    fn ep(id: u64, waiting: u32, done: u32) -> (EndpointId, LoadView) {
        let view = LoadView {
            engine: EngineLoad {
                running: 4,
                waiting,
                kv_usage: 0.2,
            },
            healthy: true,
            done_since_scrape: done,
            ..Default::default()
        };
        (EndpointId(id), view)
    }

    fn ask(tenant: &str, tokens: u64) -> Ask {
        Ask {
            request_id: format!("{tenant}-{tokens}"),
            tenant: tenant.into(),
            priority: 0,
            weight: 1,
            tokens,
            max_wait: Duration::from_secs(5),
            price: Default::default(),
        }
    }

    #[test]
    fn the_reserve_and_waits_are_written_per_tenant() {
        let pool = flow_pool(FlowControlConfig {
            enabled: true,
            reserve: 0.5,
            ..FlowControlConfig::default()
        });
        let th = pool.load.config().saturation.clone();
        let flow = &pool.flow;
        // b and a start work in flight elsewhere; a holds the most.
        for (t, n) in [("b", 100), ("a", 1000)] {
            let Arrival::Go(p) = flow.arrive(&[ep(1, 0, 0)], &th, ask(t, n), Instant::now()) else {
                panic!("room")
            };
            flow.placed(p, Some(EndpointId(9)));
        }
        // Saturation 0.6: room by the threshold, none by a's bound (0.5).
        let now = Instant::now();
        let Arrival::Queued { rx: _a, .. } = flow.arrive(&[ep(1, 3, 0)], &th, ask("a", 7), now)
        else {
            panic!("a waits for the reserve")
        };
        // Two done: 0.2, a's pick goes after 250 ms.
        flow.release(&[ep(1, 3, 2)], &th, now + Duration::from_millis(250));
        let pools = Arc::new(Pools::new(vec![Arc::new(pool)]));
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(super::FlowCollector(Arc::clone(&pools))));
        let mut text = String::new();
        prometheus_client::encoding::text::encode_registry(&mut text, &registry).unwrap();
        for want in [
            "kvasir_indexer_flow_reserve_total{pool=\"p\",tenant=\"a\",outcome=\"held\"} 1\n",
            "kvasir_indexer_flow_reserve_total{pool=\"p\",tenant=\"a\",outcome=\"passed\"} 1\n",
            "kvasir_indexer_flow_tenant_released_total{pool=\"p\",tenant=\"a\"} 1\n",
            "kvasir_indexer_flow_tenant_queue_wait_seconds_total{pool=\"p\",tenant=\"a\"} 0.25\n",
        ] {
            assert!(text.contains(want), "{want} in\n{text}");
        }
        assert!(
            !text.contains("tenant=\"b\""),
            "b was never over its share:\n{text}"
        );
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            crate::load::parse_sample(line).unwrap();
        }
    }
}
