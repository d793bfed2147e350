//! The latency histograms' families, written by hand (see the module
//! above for why): `le` after the other labels, bounds as Rust prints
//! them (`0.00001`, `1`), buckets cumulative, then `_sum` and `_count`.

use std::fmt::Write as _;

use crate::metrics::{Histogram, LATENCY_BUCKETS};
use crate::pools::Pools;
use crate::tokenize::TokenizeMode;

/// Appends the tokenize and pick latency histograms of every pool.
pub(super) fn render(out: &mut String, pools: &Pools) {
    let mut w = TextWriter { out };
    w.header(
        "kvasir_indexer_tokenize_duration_seconds",
        "histogram",
        "Time to turn a request into token ids, by how it was done.",
    );
    for p in pools.iter() {
        for (i, mode) in TokenizeMode::KNOWN.into_iter().enumerate() {
            let h = &p.metrics.tokenize_latency[i];
            if h.count() > 0 || mode == p.tokenizer.mode() {
                w.histogram(
                    h,
                    "kvasir_indexer_tokenize_duration_seconds",
                    &[("pool", &p.name), ("mode", mode.as_label())],
                );
            }
        }
    }
    w.header(
        "kvasir_indexer_pick_duration_seconds",
        "histogram",
        "Pick latency inside the indexer (tokenize, match, score).",
    );
    for p in pools.iter() {
        w.histogram(
            &p.metrics.pick_latency,
            "kvasir_indexer_pick_duration_seconds",
            &[("pool", &p.name)],
        );
    }
}

/// Text format 0.0.4 lines.
pub(crate) struct TextWriter<'a> {
    pub(crate) out: &'a mut String,
}

impl TextWriter<'_> {
    /// `# HELP` and `# TYPE` lines; once per family, before its samples.
    pub(crate) fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// The `_bucket`, `_sum` and `_count` samples of `h`.
    pub(crate) fn histogram(&mut self, h: &Histogram, name: &str, labels: &[(&str, &str)]) {
        let mut cumulative = 0;
        for (bound, n) in LATENCY_BUCKETS.iter().zip(h.buckets()) {
            cumulative += n;
            let le = format!("{bound}");
            let mut l = labels.to_vec();
            l.push(("le", &le));
            self.sample(&format!("{name}_bucket"), &l, cumulative as f64);
        }
        let count = h.count();
        let mut l = labels.to_vec();
        l.push(("le", "+Inf"));
        self.sample(&format!("{name}_bucket"), &l, count as f64);
        self.sample(&format!("{name}_sum"), labels, h.sum_seconds());
        self.sample(&format!("{name}_count"), labels, count as f64);
    }

    /// One sample line.
    pub(crate) fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                self.out.push_str(k);
                self.out.push_str("=\"");
                escape_into(self.out, v);
                self.out.push('"');
            }
            self.out.push('}');
        }
        self.out.push(' ');
        if value.is_nan() {
            self.out.push_str("NaN");
        } else if value.is_infinite() {
            self.out.push_str(if value > 0.0 { "+Inf" } else { "-Inf" });
        } else {
            let _ = write!(self.out, "{value}");
        }
        self.out.push('\n');
    }
}

fn escape_into(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}
