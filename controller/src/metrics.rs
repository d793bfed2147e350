//! The controller's Prometheus metrics, rendered as OpenMetrics text for
//! `/metrics` (see [`crate::http::metrics_router`]).
//!
//! All names carry the `kvasir_controller_` prefix:
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `reconciles_total` | counter | `result` = `ok` \| `error` |
//! | `reconcile_duration_seconds` | histogram | |
//! | `errors_total` | counter | `kind` |
//! | `last_successful_compile_timestamp_seconds` | gauge | `namespace`, `target` |
//! | `config_bytes` | gauge | `namespace`, `target` |
//! | `leader` | gauge (0/1) | |

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

/// Prefix of every metric name.
const PREFIX: &str = "kvasir_controller";

/// The error kinds the controller reports; each starts at 0 so that rate()
/// and alerts see the series before the first error.
const ERROR_KINDS: [&str; 6] = ["api", "conflict", "gateway", "invalid", "secret", "target"];

type OneLabel = [(&'static str, String); 1];
type TargetLabels = [(&'static str, String); 2];

/// The controller's metrics: a registry and handles to its families.
///
/// Cheap to share: wrap it in an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Family<OneLabel, Counter>,
    reconcile_duration: Histogram,
    errors: Family<OneLabel, Counter>,
    last_success: Family<TargetLabels, Gauge<f64, AtomicU64>>,
    config_bytes: Family<TargetLabels, Gauge>,
    leader: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every family registered; counters with a fixed label
    /// set start at 0, `leader` at 0.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix(PREFIX);

        let reconciles = Family::<OneLabel, Counter>::default();
        registry.register(
            "reconciles",
            "Namespace reconciles finished, by result (error: an API error)",
            reconciles.clone(),
        );
        for result in ["ok", "error"] {
            drop(reconciles.get_or_create(&result_label(result)));
        }

        // 5 ms .. ~41 s: a reconcile is a handful of API calls, and one that
        // takes tens of seconds is already worth seeing in its own bucket.
        let reconcile_duration = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        registry.register_with_unit(
            "reconcile_duration",
            "Duration of a namespace reconcile",
            Unit::Seconds,
            reconcile_duration.clone(),
        );

        let errors = Family::<OneLabel, Counter>::default();
        registry.register(
            "errors",
            "Errors, by kind: api, conflict, gateway (Envoy Gateway refuses or overrides a policy), invalid (a target that does not compile), secret, target (a targeted Gateway or HTTPRoute does not exist)",
            errors.clone(),
        );
        for kind in ERROR_KINDS {
            drop(errors.get_or_create(&kind_label(kind)));
        }

        let last_success = Family::<TargetLabels, Gauge<f64, AtomicU64>>::default();
        registry.register_with_unit(
            "last_successful_compile_timestamp",
            "Unix time at which the target's config was last applied",
            Unit::Seconds,
            last_success.clone(),
        );

        let config_bytes = Family::<TargetLabels, Gauge>::default();
        registry.register_with_unit(
            "config",
            "Size of the target's applied config",
            Unit::Bytes,
            config_bytes.clone(),
        );

        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease, else 0",
            leader.clone(),
        );

        Metrics {
            registry,
            reconciles,
            reconcile_duration,
            errors,
            last_success,
            config_bytes,
            leader,
        }
    }

    /// One namespace reconcile finished; `ok` is false when it hit an API
    /// error (an invalid resource is still a successful reconcile).
    pub fn reconciled(&self, ok: bool, seconds: f64) {
        let result = if ok { "ok" } else { "error" };
        self.reconciles.get_or_create(&result_label(result)).inc();
        // A clock step can make a measured duration negative or NaN; such a
        // value would poison the histogram's sum for good.
        if seconds.is_finite() && seconds >= 0.0 {
            self.reconcile_duration.observe(seconds);
        }
    }

    /// An error, by kind: `"api"`, `"conflict"`, `"gateway"` (Envoy Gateway
    /// refuses or overrides a policy), `"invalid"` (a target that does not
    /// compile), `"secret"`, `"target"` (a targeted Gateway or HTTPRoute
    /// does not exist).
    pub fn error(&self, kind: &str) {
        self.errors.get_or_create(&kind_label(kind)).inc();
    }

    /// A target's config was applied: its size in bytes and the unix time of
    /// this success.
    pub fn programmed(
        &self,
        namespace: &str,
        target: &str,
        config_bytes: usize,
        unix_seconds: f64,
    ) {
        let labels = target_labels(namespace, target);
        self.last_success.get_or_create(&labels).set(unix_seconds);
        // A config cannot approach i64::MAX bytes; saturate rather than wrap.
        let bytes = i64::try_from(config_bytes).unwrap_or(i64::MAX);
        self.config_bytes.get_or_create(&labels).set(bytes);
    }

    /// The target no longer exists: drop its series, so that neither a stale
    /// timestamp nor an old size outlives it.
    pub fn target_removed(&self, namespace: &str, target: &str) {
        let labels = target_labels(namespace, target);
        self.last_success.remove(&labels);
        self.config_bytes.remove(&labels);
    }

    /// Whether this replica leads (`leader` 1) or not (0).
    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// The OpenMetrics text of every metric, ending in `# EOF`.
    pub fn render(&self) -> String {
        let mut text = String::new();
        if let Err(err) = encode(&mut text, &self.registry) {
            // Writing to a String cannot fail, so this is an encoder bug; a
            // scrape with what was written beats a crashed controller.
            tracing::error!(error = %err, "encoding metrics");
        }
        text
    }
}

fn result_label(result: &str) -> OneLabel {
    [("result", result.to_owned())]
}

fn kind_label(kind: &str) -> OneLabel {
    [("kind", escape_label_value(kind))]
}

fn target_labels(namespace: &str, target: &str) -> TargetLabels {
    [
        ("namespace", escape_label_value(namespace)),
        ("target", escape_label_value(target)),
    ]
}

/// prometheus-client 0.24 writes label values verbatim, so a `"`, `\` or
/// newline in one would break the exposition; escape them as OpenMetrics
/// requires. Kubernetes names never contain them, so this is only a guard.
fn escape_label_value(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    // The sample names the tests read.
    const RECONCILES: &str = "kvasir_controller_reconciles_total";
    const DURATION_COUNT: &str = "kvasir_controller_reconcile_duration_seconds_count";
    const ERRORS: &str = "kvasir_controller_errors_total";
    const LAST_COMPILE: &str = "kvasir_controller_last_successful_compile_timestamp_seconds";
    const CONFIG_BYTES: &str = "kvasir_controller_config_bytes";
    const LEADER: &str = "kvasir_controller_leader";

    /// One sample line of the exposition: name, labels, value.
    #[derive(Debug, PartialEq)]
    struct Sample {
        name: String,
        labels: BTreeMap<String, String>,
        value: f64,
    }

    /// Parses the sample lines of OpenMetrics text (comments skipped),
    /// unescaping label values; panics on a malformed line, which is what a
    /// test wants.
    fn parse(text: &str) -> Vec<Sample> {
        let mut samples = Vec::new();
        for line in text.lines() {
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let (name, rest) = match line.find(['{', ' ']) {
                Some(i) => line.split_at(i),
                None => panic!("no value: {line:?}"),
            };
            let mut labels = BTreeMap::new();
            let value_text = if let Some(mut rest) = rest.strip_prefix('{') {
                loop {
                    if let Some(after) = rest.strip_prefix('}') {
                        rest = after;
                        break;
                    }
                    rest = rest.strip_prefix(',').unwrap_or(rest);
                    let eq = rest.find("=\"").expect("label without =\"");
                    let key = rest[..eq].to_owned();
                    let mut value = String::new();
                    let mut chars = rest[eq + 2..].char_indices();
                    let end = loop {
                        match chars.next().expect("unterminated label value") {
                            (i, '"') => break i,
                            (_, '\\') => match chars.next().expect("dangling escape").1 {
                                'n' => value.push('\n'),
                                c => value.push(c),
                            },
                            (_, c) => value.push(c),
                        }
                    };
                    labels.insert(key, value);
                    rest = &rest[eq + 2 + end + 1..];
                }
                rest
            } else {
                rest
            };
            let value = value_text.trim().split(' ').next().expect("empty value");
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v
                    .parse()
                    .unwrap_or_else(|_| panic!("bad value in {line:?}")),
            };
            samples.push(Sample {
                name: name.to_owned(),
                labels,
                value,
            });
        }
        samples
    }

    /// The value of the one sample with exactly this name and these labels.
    fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let found: Vec<f64> = parse(text)
            .into_iter()
            .filter(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
            .collect();
        assert!(found.len() <= 1, "{name} {labels:?} appears twice:\n{text}");
        found.first().copied()
    }

    #[test]
    fn fresh_metrics_start_at_zero() {
        let text = Metrics::new().render();
        assert!(text.ends_with("# EOF\n"), "{text}");
        for result in ["ok", "error"] {
            assert_eq!(
                value(&text, RECONCILES, &[("result", result)]),
                Some(0.0),
                "{text}"
            );
        }
        for kind in ERROR_KINDS {
            assert_eq!(value(&text, ERRORS, &[("kind", kind)]), Some(0.0), "{text}");
        }
        assert_eq!(value(&text, LEADER, &[]), Some(0.0));
        assert_eq!(value(&text, DURATION_COUNT, &[]), Some(0.0));
        // No target was programmed, so no per-target series exist yet.
        assert!(!parse(&text).iter().any(|s| s.labels.contains_key("target")));
    }

    #[test]
    fn render_has_every_metric_after_the_calls() {
        let m = Metrics::new();
        m.reconciled(true, 0.02);
        m.reconciled(true, 0.5);
        m.reconciled(false, 3.0);
        m.error("api");
        m.error("invalid");
        m.error("invalid");
        m.programmed("team-a", "pool-x", 1234, 1_767_225_600.25);
        m.set_leader(true);
        let text = m.render();

        assert_eq!(value(&text, RECONCILES, &[("result", "ok")]), Some(2.0));
        assert_eq!(value(&text, RECONCILES, &[("result", "error")]), Some(1.0));

        let duration = "kvasir_controller_reconcile_duration_seconds";
        assert_eq!(value(&text, &format!("{duration}_count"), &[]), Some(3.0));
        let sum = value(&text, &format!("{duration}_sum"), &[]).expect("sum");
        assert!((sum - 3.52).abs() < 1e-9, "sum {sum}");
        let bucket = format!("{duration}_bucket");
        assert_eq!(value(&text, &bucket, &[("le", "+Inf")]), Some(3.0));
        // Buckets are cumulative: 0.02 falls in le=0.04, 0.5 and 3 do not.
        assert_eq!(value(&text, &bucket, &[("le", "0.04")]), Some(1.0));

        assert_eq!(value(&text, ERRORS, &[("kind", "api")]), Some(1.0));
        assert_eq!(value(&text, ERRORS, &[("kind", "invalid")]), Some(2.0));
        assert_eq!(value(&text, ERRORS, &[("kind", "conflict")]), Some(0.0));

        let target = [("namespace", "team-a"), ("target", "pool-x")];
        assert_eq!(value(&text, LAST_COMPILE, &target), Some(1_767_225_600.25));
        assert_eq!(value(&text, CONFIG_BYTES, &target), Some(1234.0));
        assert_eq!(value(&text, LEADER, &[]), Some(1.0));

        m.set_leader(false);
        assert_eq!(value(&m.render(), LEADER, &[]), Some(0.0));
    }

    #[test]
    fn types_and_units_are_declared() {
        let text = Metrics::new().render();
        for line in [
            "# TYPE kvasir_controller_reconciles counter",
            "# TYPE kvasir_controller_reconcile_duration_seconds histogram",
            "# UNIT kvasir_controller_reconcile_duration_seconds seconds",
            "# TYPE kvasir_controller_errors counter",
            "# TYPE kvasir_controller_leader gauge",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }

    #[test]
    fn programmed_again_overwrites() {
        let m = Metrics::new();
        m.programmed("ns", "t", 100, 10.0);
        m.programmed("ns", "t", 200, 20.0);
        let text = m.render();
        let target = [("namespace", "ns"), ("target", "t")];
        assert_eq!(value(&text, CONFIG_BYTES, &target), Some(200.0));
        assert_eq!(value(&text, LAST_COMPILE, &target), Some(20.0));
    }

    #[test]
    fn target_removed_drops_its_series_only() {
        let m = Metrics::new();
        m.programmed("ns", "gone", 10, 1.0);
        m.programmed("ns", "kept", 20, 2.0);
        m.programmed("other", "gone", 30, 3.0);
        m.target_removed("ns", "gone");
        let text = m.render();

        let samples = parse(&text);
        let series: Vec<(&str, &str)> = samples
            .iter()
            .filter_map(|s| {
                Some((
                    s.labels.get("namespace")?.as_str(),
                    s.labels.get("target")?.as_str(),
                ))
            })
            .collect();
        assert!(!series.contains(&("ns", "gone")), "{text}");
        let kept = [("namespace", "ns"), ("target", "kept")];
        assert_eq!(value(&text, CONFIG_BYTES, &kept), Some(20.0));
        let other = [("namespace", "other"), ("target", "gone")];
        assert_eq!(value(&text, CONFIG_BYTES, &other), Some(30.0));
        assert_eq!(value(&text, LAST_COMPILE, &other), Some(3.0));

        // Removing what is not there is a no-op, not an error.
        m.target_removed("ns", "never");
        m.target_removed("ns", "gone");

        m.target_removed("ns", "kept");
        m.target_removed("other", "gone");
        // With its last series gone a family renders nothing at all.
        assert!(!m.render().contains("config_bytes{"), "{}", m.render());
    }

    #[test]
    fn odd_label_values_are_escaped() {
        let m = Metrics::new();
        m.error("a\"b\\c\nd");
        let text = m.render();
        assert_eq!(
            value(&text, ERRORS, &[("kind", "a\"b\\c\nd")]),
            Some(1.0),
            "{text}"
        );
        m.programmed("n\"s", "t\\", 5, 1.0);
        m.target_removed("n\"s", "t\\");
        assert!(!m.render().contains("config_bytes{"));
    }

    #[test]
    fn bad_durations_are_not_observed() {
        let m = Metrics::new();
        m.reconciled(true, f64::NAN);
        m.reconciled(true, -1.0);
        let text = m.render();
        assert_eq!(value(&text, RECONCILES, &[("result", "ok")]), Some(2.0));
        assert_eq!(value(&text, DURATION_COUNT, &[]), Some(0.0));
    }

    #[test]
    fn metrics_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Metrics>();
    }
}
