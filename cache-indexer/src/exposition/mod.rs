//! `/metrics`: the Prometheus text page, encoded by `prometheus-client`
//! from the counters ([`crate::metrics`]), the pools' state
//! ([`crate::pools::Pools`]) and the gRPC lifecycle, read at scrape time.
//!
//! Kept byte-compatible with the page's consumers (format 0.0.4, served
//! as `text/plain; version=0.0.4`): every family's `# TYPE` names its
//! samples exactly as they are written, counters included (`x_total`
//! typed `counter`), rather than OpenMetrics' `x` + `_total`; no `# EOF`.
//! So counters are declared [`MetricType::Counter`] under their whole name
//! and their samples written as plain samples. The two latency histograms
//! stay on a small hand path ([`histograms`]): the library writes `le`
//! first and its bounds as `1e-5` / `1.0`, which would change the `le`
//! label values series and dashboards know (`0.00001`, `1`).

pub(crate) mod histograms;
mod lifecycle;
mod pools;

use std::fmt::{self, Write as _};
use std::sync::Arc;

use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeLabelValue, LabelSetEncoder,
    LabelValueEncoder, MetricEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::budgets::exposition::BudgetsCollector;
use crate::budgets::redis::exposition::BudgetStoreCollector;
use crate::flow::exposition as flow;
use crate::lifecycle::Lifecycle;
use crate::pools::Pools;
use crate::responses::exposition::ResponsesCollector;
use crate::shared_load::exposition::SharedLoadCollector;

/// The `/metrics` page of one indexer.
#[derive(Debug)]
pub struct Exposition {
    registry: Registry,
    pools: Arc<Pools>,
}

impl Exposition {
    /// The page over `pools` and the gRPC lifecycle `life`.
    pub fn new(pools: Arc<Pools>, life: Arc<Lifecycle>) -> Self {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(pools::PoolsCollector(Arc::clone(&pools))));
        registry.register_collector(Box::new(lifecycle::LifecycleCollector {
            pools: Arc::clone(&pools),
            life,
        }));
        registry.register_collector(Box::new(ResponsesCollector(Arc::clone(&pools))));
        registry.register_collector(Box::new(BudgetsCollector(Arc::clone(&pools))));
        registry.register_collector(Box::new(BudgetStoreCollector(Arc::clone(&pools))));
        registry.register_collector(Box::new(flow::FlowCollector(Arc::clone(&pools))));
        registry.register_collector(Box::new(SharedLoadCollector(Arc::clone(&pools))));
        Exposition { registry, pools }
    }

    /// The page, as of now.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String does not fail; an error would be a
        // collector's bug, and a partial page is still worth serving.
        if let Err(e) = prometheus_client::encoding::text::encode_registry(&mut out, &self.registry)
        {
            tracing::warn!(error = %e, "/metrics: encoding stopped early");
        }
        histograms::render(&mut out, &self.pools);
        flow::render_wait(&mut out, &self.pools);
        out
    }
}

/// One family's samples, after its `# HELP` and `# TYPE` lines.
pub(crate) struct Family<'e>(MetricEncoder<'e>);

/// Starts a family: `kind` is `Counter` or `Gauge`, `name` the samples'
/// whole name (a counter's with its `_total`).
pub(crate) fn family<'e>(
    enc: &'e mut DescriptorEncoder<'_>,
    name: &'e str,
    kind: MetricType,
    help: &str,
) -> Result<Family<'e>, fmt::Error> {
    Ok(Family(enc.encode_descriptor(name, help, None, kind)?))
}

impl Family<'_> {
    /// One sample line, labels in the given order.
    pub(crate) fn sample(
        &mut self,
        labels: &[(&str, &str)],
        value: impl EncodeGaugeValue,
    ) -> fmt::Result {
        if labels.is_empty() {
            // `encode_family` with no labels would write `name{} v`.
            return self.0.encode_gauge(&value);
        }
        self.0.encode_family(&Labels(labels))?.encode_gauge(&value)
    }
}

/// Labels whose values are escaped as the text format wants (the library
/// writes label values as given).
struct Labels<'a>(&'a [(&'a str, &'a str)]);

impl EncodeLabelSet for Labels<'_> {
    fn encode(&self, encoder: &mut LabelSetEncoder<'_>) -> fmt::Result {
        let escaped: Vec<(&str, Escaped<'_>)> =
            self.0.iter().map(|(k, v)| (*k, Escaped(v))).collect();
        escaped.as_slice().encode(encoder)
    }
}

struct Escaped<'a>(&'a str);

impl EncodeLabelValue for Escaped<'_> {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(i) = rest.find(['\\', '"', '\n']) {
            encoder.write_str(&rest[..i])?;
            encoder.write_str(match rest.as_bytes()[i] {
                b'\\' => "\\\\",
                b'"' => "\\\"",
                _ => "\\n",
            })?;
            rest = &rest[i + 1..];
        }
        encoder.write_str(rest)
    }
}

/// 1 for true, 0 for false.
fn flag(b: bool) -> u32 {
    u32::from(b)
}

#[cfg(test)]
mod tests;
