//! The markdown report: per-mode tables with ratios against round-robin,
//! and the target checks ([`crate::targets`]) as a table.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::compare::{
    find, mode_rank, ms, pct, ratio, Inputs, BASELINE, HIGH_LOAD, KVASIR, REF_LOAD,
};
use crate::floor::Unqueued;
use crate::targets::check_targets;
use crate::RunMeta;

fn workload_title(w: &str) -> &str {
    match w {
        "trace" => "Mooncake trace",
        "chat" => "Multi-turn, multi-tenant chat",
        _ => w,
    }
}

/// Renders the whole report.
pub fn render(inp: &Inputs) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# Routing benchmark\n");
    let _ = writeln!(o, "Produced by `{}`.\n", inp.command);
    for s in &inp.setup {
        let _ = writeln!(o, "- {s}");
    }
    if !inp.setup.is_empty() {
        o.push('\n');
    }
    let _ = writeln!(
        o,
        "Times are simulated (wall time / time scale). TTFT and e2e percentiles count a request \
         that never answered as infinitely slow (∞). ITL is each request's mean gap between tokens. \
         Goodput: completed requests with TTFT <= 2 s per simulated second. Ratios are against \
         round-robin at the same load.\n"
    );

    let mut by_w: BTreeMap<&str, Vec<&RunMeta>> = BTreeMap::new();
    for r in &inp.runs {
        by_w.entry(r.workload.as_str()).or_default().push(r);
    }
    for (w, mut rs) in by_w {
        rs.sort_by(|a, b| {
            a.load
                .total_cmp(&b.load)
                .then(mode_rank(&a.mode).cmp(&mode_rank(&b.mode)))
        });
        let _ = writeln!(o, "## {}\n", workload_title(w));
        if let Some(r) = rs.iter().find(|r| (r.load - REF_LOAD).abs() < 1e-9) {
            let unit = if w == "trace" {
                "x trace speed"
            } else {
                "conversations/s"
            };
            let _ = writeln!(o, "Load 1.0 = {:.3} {unit}.\n", r.rate);
        }
        if w == "trace" {
            if let Some(b) = &inp.bound {
                let _ = writeln!(
                    o,
                    "One pooled LRU cache of all engines' size ({} tokens) would hit {} of prompt tokens on the \
                     requests replayed (ignores concurrency: slightly optimistic).{}\n",
                    b.capacity_tokens,
                    pct(b.hit_rate),
                    b.unqueued_mean_ttft_ms
                        .map(|v| format!(
                            " With that cache and no queueing at all (every request alone on an idle engine, its \
                             uncached prompt prefilled in token-budget chunks) the mean TTFT would be {}: about the \
                             lowest mean TTFT a router gets on this cluster (not a strict floor: one LRU is not the \
                             best cache there is).",
                            ms(v)
                        ))
                        .unwrap_or_default()
                );
            }
        }
        let mut own: Vec<&Unqueued> = inp
            .unqueued
            .iter()
            .filter(|u| u.workload == w && u.mode == KVASIR)
            .collect();
        own.sort_by(|a, b| a.load.total_cmp(&b.load));
        if !own.is_empty() {
            let at: Vec<String> = own
                .iter()
                .map(|u| {
                    format!(
                        "{} / {} / {} at load {:.1}",
                        ms(u.own.mean),
                        ms(u.own.p50),
                        ms(u.own.p99),
                        u.load
                    )
                })
                .collect();
            let _ = writeln!(
                o,
                "Kvasir's requests priced with no queueing at all (each alone on an idle engine, with the prefix it \
                 actually reused): mean / median / p99 TTFT {}; the rest of its measured TTFT is queueing.",
                at.join(", ")
            );
            for u in &own {
                if let (Some(best), Some(hit)) = (u.best, u.best_hit_rate) {
                    let _ = writeln!(
                        o,
                        "Reusing all they could (a later turn its whole previous turn, a first turn its tenant's \
                         system prompt: a hit rate of {}), the same requests at load {:.1} would see mean / median / p99 \
                         {} / {} / {}: the floor of any router's TTFT on this workload.",
                        pct(hit),
                        u.load,
                        ms(best.mean),
                        ms(best.p50),
                        ms(best.p99)
                    );
                }
            }
            let queued: Vec<String> = own
                .iter()
                .filter_map(|u| {
                    let (q, b) = (u.queued_own.as_ref()?, u.balanced.as_ref()?);
                    let m = find(&inp.runs, w, KVASIR, u.load).map(|r| &r.summary.ttft)?;
                    Some(format!(
                        "at load {:.1}, on the engines kvasir chose {} / {} / {} (measured {} / {} / {}), perfectly \
                         balanced {} / {} / {}{}",
                        u.load,
                        ms(q.mean),
                        ms(q.p50),
                        ms(q.p99),
                        ms(m.mean),
                        ms(m.p50),
                        ms(m.p99),
                        ms(b.mean),
                        ms(b.p50),
                        ms(b.p99),
                        u.balanced_best
                            .map(|bb| format!(
                                " and at the {} reuse {} / {} / {}",
                                if w == "chat" { "best" } else { "pooled cache's" },
                                ms(bb.mean),
                                ms(bb.p50),
                                ms(bb.p99)
                            ))
                            .unwrap_or_default()
                    ))
                })
                .collect();
            if !queued.is_empty() {
                let _ = writeln!(
                    o,
                    "With queueing priced too (each request's prefill as above, in a first-come-first-served queue \
                     from its arrival, the same arrivals), mean / median / p99 TTFT {}. Perfect balance is one central \
                     queue in front of all engines (each request to the engine whose queue empties first); the gap \
                     between it and the engines kvasir chose is what keeping requests with their cached prefixes cost \
                     in queueing. A yardstick: real engines batch concurrent prefills into one step and interleave \
                     decode steps, which these queues do not, so it is only as good as it matches the measured figures.",
                    queued.join("; ")
                );
            }
            o.push('\n');
        }
        let _ = writeln!(
            o,
            "| load | mode | requests | failed | TTFT p50 | p90 | p99 | mean | ITL p50 | p90 | p99 | e2e p50 | p90 | p99 | req/s | hit rate | goodput req/s | prefill use | TTFT p50 / RR | TTFT p99 / RR | e2e p50 / RR |"
        );
        let _ = writeln!(o, "|{}", "---|".repeat(21));
        for r in &rs {
            let s = &r.summary;
            let base = find(&inp.runs, w, BASELINE, r.load).map(|b| &b.summary);
            let rt = |f: &dyn Fn(&crate::stats::Summary) -> f64| {
                base.map_or("-".into(), |b| pct(ratio(f(s), f(b))))
            };
            let _ = writeln!(
                o,
                "| {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {} | {:.2} | {} | {} | {} | {} |",
                r.load,
                r.mode,
                s.requests,
                s.failed + s.timeouts,
                ms(s.ttft.p50),
                ms(s.ttft.p90),
                ms(s.ttft.p99),
                ms(s.ttft.mean),
                ms(s.itl.p50),
                ms(s.itl.p90),
                ms(s.itl.p99),
                ms(s.e2e.p50),
                ms(s.e2e.p90),
                ms(s.e2e.p99),
                s.throughput_rps,
                pct(s.cache_hit_rate),
                s.goodput_rps,
                pct(r.engines.prefill_utilisation),
                rt(&|x| x.ttft.p50),
                rt(&|x| x.ttft.p99),
                rt(&|x| x.e2e.p50),
            );
        }
        o.push('\n');
        let notes: Vec<String> = rs
            .iter()
            .filter(|r| !r.notes.is_empty())
            .map(|r| {
                let kv: Vec<String> = r.notes.iter().map(|(k, v)| format!("{k} {v}")).collect();
                format!("- {:.1} {}: {}", r.load, r.mode, kv.join(", "))
            })
            .collect();
        if !notes.is_empty() {
            let _ = writeln!(o, "Per-run facts (proxy and engine counters, TTFT growth = last quarter's mean TTFT / first quarter's):\n");
            for (n, r) in notes.iter().zip(&rs) {
                let _ = writeln!(o, "{n}, ttft growth {:.2}", r.ttft_growth);
            }
            o.push('\n');
        }
    }

    let checks = check_targets(inp);
    let _ = writeln!(o, "## Targets\n");
    let _ = writeln!(
        o,
        "| target | measured | met | why (for a miss) |\n|---|---|---|---|"
    );
    for c in &checks {
        let met = match c.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "not run",
        };
        let why = if c.met == Some(false) {
            c.why.as_str()
        } else {
            ""
        };
        let _ = writeln!(o, "| {} | {} | {} | {} |", c.target, c.measured, met, why);
    }
    o.push('\n');
    let mut good: Vec<&RunMeta> = inp
        .runs
        .iter()
        .filter(|r| (r.load - HIGH_LOAD).abs() < 1e-9)
        .collect();
    good.sort_by(|a, b| {
        a.workload
            .cmp(&b.workload)
            .then(mode_rank(&a.mode).cmp(&mode_rank(&b.mode)))
    });
    if !good.is_empty() {
        let _ = writeln!(o, "Goodput at load 2.0 (requests with TTFT <= 2 s):\n");
        let _ = writeln!(
            o,
            "| workload | mode | goodput req/s | share of requests |\n|---|---|---|---|"
        );
        for r in good {
            let _ = writeln!(
                o,
                "| {} | {} | {:.2} | {} |",
                r.workload,
                r.mode,
                r.summary.goodput_rps,
                pct(r.summary.goodput_share)
            );
        }
        o.push('\n');
    }
    o
}

#[cfg(test)]
#[path = "report_tests.rs"]
mod tests;
