use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::metrics::{EngineStats, E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS};

/// The page the hand-written writer rendered for [`fixture`] (before the
/// switch to `prometheus-client`), kept as the contract to compare with.
const HAND_WRITTEN: &str = include_str!("../testdata/metrics_hand_written.prom");

/// The snapshot `HAND_WRITTEN` was rendered from: every counter non-zero,
/// observations in first, middle and overflow buckets, a model name that
/// needs escaping.
fn fixture() -> (Snapshot, StaticInfo, u64) {
    let mut stats = EngineStats {
        prefix_cache_queries: 4096,
        prefix_cache_hits: 1024,
        prompt_tokens: 5000,
        generation_tokens: 777,
        prompt_tokens_computed: 3976,
        prefill_seconds: 3.75,
        finished_length: 7,
        finished_stop: 3,
        aborted: 2,
        preemptions: 1,
        steps: 900,
        ..EngineStats::default()
    };
    for v in [0.0005, 0.03, 0.25, 1.0, 3000.0] {
        stats.ttft.observe(v);
    }
    for v in [0.005, 0.02, 0.02, 0.5, 100.0] {
        stats.itl.observe(v);
    }
    for v in [0.1, 2.2, 10000.0] {
        stats.e2e.observe(v);
    }
    let snap = Snapshot {
        stats,
        running: 3,
        waiting: 2,
        kv_usage: 0.25,
        cached_blocks: 42,
        virtual_time: 12.5,
    };
    let info = StaticInfo {
        model: "org/model \"q\" \\ x".into(),
        block_size: 16,
        num_gpu_blocks: 1000,
        enable_prefix_caching: true,
        profile: "h100-8b".into(),
        time_scale: 1.5,
        scheduling_policy: "fcfs",
    };
    (snap, info, 5)
}

/// A sample's identity: name and labels (raw, still escaped), `le` as the
/// number it stands for, since the text of a float is not its identity.
type Key = (String, BTreeMap<String, String>);

/// The samples of a page, parsed the way a 0.0.4 scraper reads them.
fn samples(text: &str) -> BTreeMap<Key, f64> {
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (head, value) = line.rsplit_once(' ').expect(line);
        let (name, labels) = match head.split_once('{') {
            Some((n, rest)) => (n, labels(rest.strip_suffix('}').expect(line))),
            None => (head, BTreeMap::new()),
        };
        let value: f64 = value.parse().expect(line);
        let dup = out.insert((name.to_owned(), labels), value);
        assert!(dup.is_none(), "sample twice: {line}");
    }
    out
}

fn labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (k, v) = rest.split_once("=\"").expect(s);
        let mut end = 0;
        let b = v.as_bytes();
        while b[end] != b'"' {
            end += if b[end] == b'\\' { 2 } else { 1 };
        }
        let mut value = v[..end].to_owned();
        if k == "le" && value != "+Inf" {
            value = format!("{:?}", value.parse::<f64>().expect(s));
        }
        out.insert(k.to_owned(), value);
        rest = v[end + 1..].strip_prefix(',').unwrap_or(&v[end + 1..]);
    }
    out
}

/// `# TYPE` and `# HELP` lines by family name.
fn descriptors(text: &str, prefix: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix)?.split_once(' '))
        .map(|(n, rest)| (n.to_owned(), rest.to_owned()))
        .collect()
}

fn rendered() -> String {
    let (snap, info, failed) = fixture();
    render(&snap, &info, failed)
}

#[test]
fn same_samples_labels_and_values_as_the_hand_written_page() {
    let before = samples(HAND_WRITTEN);
    let after = samples(&rendered());
    let names = |m: &BTreeMap<Key, f64>| m.keys().cloned().collect::<BTreeSet<_>>();
    assert_eq!(names(&after), names(&before));
    assert_eq!(after, before);
    assert_eq!(before.len(), 90, "the fixture covers every series");
}

#[test]
fn same_families_types_and_help_as_the_hand_written_page() {
    let page = rendered();
    assert_eq!(
        descriptors(&page, "# TYPE "),
        descriptors(HAND_WRITTEN, "# TYPE ")
    );
    assert_eq!(
        descriptors(&page, "# HELP "),
        descriptors(HAND_WRITTEN, "# HELP ")
    );
}

#[test]
fn the_page_is_text_format_0_0_4() {
    let page = rendered();
    assert!(!page.contains("# EOF"), "an OpenMetrics terminator");
    assert!(!page.contains("# UNIT"), "an OpenMetrics unit line");
    assert!(page.ends_with('\n'));
    // Every sample belongs to the family its TYPE line names, by the
    // 0.0.4 rule: the same name, or a histogram's _bucket/_count/_sum.
    let types = descriptors(&page, "# TYPE ");
    for ((name, _), _) in samples(&page) {
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
            .unwrap_or(&name);
        assert!(types.contains_key(family), "{name} has no TYPE line");
    }
    for (name, t) in &types {
        if t == "counter" {
            assert!(name.ends_with("_total"), "{name}");
        }
    }
}

#[test]
fn histogram_buckets_are_vllms() {
    let page = rendered();
    for (name, bounds) in [
        ("vllm:time_to_first_token_seconds_bucket", TTFT_BUCKETS),
        ("vllm:inter_token_latency_seconds_bucket", ITL_BUCKETS),
        ("vllm:e2e_request_latency_seconds_bucket", E2E_BUCKETS),
    ] {
        let mut les: Vec<String> = samples(&page)
            .into_keys()
            .filter(|(n, _)| n == name)
            .map(|(_, l)| l["le"].clone())
            .collect();
        let mut want: Vec<String> = bounds.iter().map(|b| format!("{b:?}")).collect();
        want.push("+Inf".into());
        les.sort();
        want.sort();
        assert_eq!(les, want, "{name}");
    }
    // Written as Python's prometheus_client (vLLM) writes floats: its
    // repr, which Rust's `{:?}` agrees with for these bounds.
    for b in TTFT_BUCKETS.iter().chain(ITL_BUCKETS).chain(E2E_BUCKETS) {
        assert!(page.contains(&format!(",le=\"{b:?}\"}}")), "le {b:?}");
    }
    assert!(page.contains(r#",le="1.0"} 4"#), "{page}");
    assert!(page.contains(r#",le="0.001"} 1"#), "{page}");
}

#[test]
fn histogram_cumulates() {
    #[derive(Debug)]
    struct One(Histogram);
    impl Collector for One {
        fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
            histogram(&mut e, "x", "h", &self.0)
        }
    }
    let mut h = Histogram::new(&[1.0, 2.0]);
    h.observe(0.5);
    h.observe(1.5);
    h.observe(9.0);
    let s = page(vec![("a", "b".to_owned())], One(h));
    assert!(s.contains("x_bucket{a=\"b\",le=\"1.0\"} 1"), "{s}");
    assert!(s.contains("x_bucket{a=\"b\",le=\"2.0\"} 2"), "{s}");
    assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3"), "{s}");
    assert!(s.contains("x_count{a=\"b\"} 3"), "{s}");
}

#[test]
fn label_values_are_escaped() {
    let page = rendered();
    assert!(
        page.contains(r#"model_name="org/model \"q\" \\ x""#),
        "{page}"
    );
    let (snap, mut info, _) = fixture();
    info.profile = "a\nb".into();
    assert!(render(&snap, &info, 0).contains(r#"profile="a\nb""#));
}
