//! The governance benchmarks' report: the figures of [`crate::governance`]
//! for the runs `scenarios.json` names, the targets checked, as
//! `report.md`, `summary.json` and `readme.md` (the README's table) in the
//! results directory.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use crate::bound::EngineModel;
use crate::compare::{ms, pct};
use crate::governance::{
    balance, budget_rows, goodput, noisy_rows, BalanceRow, BudgetRow, GoodputRow, NoisyRow,
    Scenarios,
};
use crate::record::{self, Record};
use crate::targets::TargetCheck;
use crate::RunMeta;

/// The noisy-neighbour target: others' p99 TTFT with the burst over
/// without, at most.
pub const NOISY_P99_RATIO: f64 = 1.25;
/// The budgets target: tokens served over what the budget allows, at most
/// this much more.
pub const BUDGET_OVERSHOOT: f64 = 0.05;
/// The saturation target: goodput over round-robin's, at least.
pub const GOODPUT_RATIO: f64 = 3.0;
/// The below-saturation target: mean TTFT over the yardstick, at most.
pub const BALANCE_RATIO: f64 = 1.3;

/// Everything the report says, as `summary.json` holds it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figures {
    /// Noisy neighbour, per configuration and tenant.
    pub noisy: Vec<NoisyRow>,
    /// Budgets, per tenant.
    pub budgets: Vec<BudgetRow>,
    /// Saturation, per run.
    pub saturation: Vec<GoodputRow>,
    /// Below saturation, per load and run.
    pub below: Vec<(f64, BalanceRow)>,
    /// The targets checked.
    pub targets: Vec<TargetCheck>,
    /// Per run: the orchestrator's facts (proxy and indexer counters).
    pub facts: BTreeMap<String, serde_json::Map<String, serde_json::Value>>,
    /// Per run: the engines' prefill use (over the second half of the
    /// arrival window).
    pub prefill_use: BTreeMap<String, f64>,
}

/// Reads run `name` (its `.json` and `.csv`) from `dir`.
pub fn read_run(dir: &Path, name: &str) -> anyhow::Result<(RunMeta, Vec<Record>)> {
    let meta_path = dir.join(format!("{name}.json"));
    let meta: RunMeta = serde_json::from_str(
        &std::fs::read_to_string(&meta_path)
            .with_context(|| format!("reading {}", meta_path.display()))?,
    )
    .with_context(|| format!("parsing {}", meta_path.display()))?;
    let csv = dir.join(format!("{name}.csv"));
    let recs = record::parse_csv(
        &std::fs::read_to_string(&csv).with_context(|| format!("reading {}", csv.display()))?,
    )
    .map_err(|e| anyhow::anyhow!("{}: {e}", csv.display()))?;
    Ok((meta, recs))
}

/// Computes every figure of the scenarios from the runs in `dir`.
pub fn figures(dir: &Path, s: &Scenarios, model: &EngineModel) -> anyhow::Result<Figures> {
    let mut f = Figures::default();
    let mut runs: BTreeMap<String, (RunMeta, Vec<Record>)> = BTreeMap::new();
    let mut get = |name: &str| -> anyhow::Result<(RunMeta, Vec<Record>)> {
        if !runs.contains_key(name) {
            runs.insert(name.to_string(), read_run(dir, name)?);
        }
        Ok(runs[name].clone())
    };
    if let Some(n) = &s.noisy {
        for p in &n.pairs {
            let (_, base) = get(&p.baseline)?;
            let (_, burst) = get(&p.burst)?;
            f.noisy.extend(noisy_rows(n, &p.label, &base, &burst));
        }
    }
    if let Some(b) = &s.budgets {
        f.budgets = budget_rows(b, &get(&b.run)?.1);
    }
    if let Some(sat) = &s.saturation {
        for l in &sat.runs {
            f.saturation
                .push(goodput(&l.label, &get(&l.run)?.1, sat.slo_ms));
        }
    }
    for below in &s.below {
        for l in &below.runs {
            let (meta, recs) = get(&l.run)?;
            f.below
                .push((below.load, balance(&l.label, &meta, &recs, model)));
        }
    }
    for (name, (meta, _)) in runs {
        f.prefill_use
            .insert(name.clone(), meta.engines.prefill_utilisation);
        f.facts.insert(name, meta.notes);
    }
    f.targets = check(s, &f);
    Ok(f)
}

fn x(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.2}x")
    } else {
        "-".into()
    }
}

fn check_noisy(s: &Scenarios, f: &Figures, out: &mut Vec<TargetCheck>) {
    let Some(n) = &s.noisy else { return };
    let others = |cfg: &str| -> Vec<&NoisyRow> {
        f.noisy
            .iter()
            .filter(|r| r.config == cfg && r.tenant != n.burst_tenant)
            .collect()
    };
    let worst = |rows: &[&NoisyRow]| {
        rows.iter()
            .copied()
            .max_by(|a, b| a.p99_ratio().total_cmp(&b.p99_ratio()))
            .cloned()
    };
    let mine = others(&n.subject);
    let Some(w) = worst(&mine) else { return };
    let met = mine.iter().all(|r| r.p99_ratio() <= NOISY_P99_RATIO);
    let mut why = String::new();
    if !met {
        let a = f
            .noisy
            .iter()
            .find(|r| r.config == n.subject && r.tenant == n.burst_tenant);
        if let Some(a) = a {
            let _ = write!(
                why,
                "{} sent {} requests in the burst window ({} without the burst), {} refused; ",
                a.tenant, a.sent.1, a.sent.0, a.refused
            );
        }
        let shed: usize = mine.iter().map(|r| r.refused).sum();
        let _ = write!(why, "the other tenants had {shed} refused");
        if let Some(a) = a {
            why.push_str(&work_conserved(n, f, a, &mine));
        }
        for p in n.pairs.iter().filter(|p| p.label != n.subject) {
            if let Some(o) = worst(&others(&p.label)) {
                let _ = write!(
                    why,
                    "; {}: worst p99 {} ({})",
                    p.label,
                    x(o.p99_ratio()),
                    o.tenant
                );
            }
        }
    }
    out.push(TargetCheck {
        target: format!(
            "noisy neighbour ({} at {}x its share): with {}, every other tenant's p99 TTFT <= {NOISY_P99_RATIO}x \
             its no-burst figure",
            n.burst_tenant, n.factor, n.subject
        ),
        measured: format!(
            "worst {}: {} ({} vs {})",
            w.tenant,
            x(w.p99_ratio()),
            ms(w.burst.p99),
            ms(w.base.p99)
        ),
        met: Some(met),
        why,
    });
}

/// What the bursting tenant `a` was given while the others were served
/// (`others`, the subject's rows): its share of the window's requests
/// served and the engines' prefill use with and without the burst. A share
/// past an equal one with the use risen is flow control's fair share being
/// work-conserving: the others, not backlogged, wait longer at the higher
/// use.
fn work_conserved(
    n: &crate::governance::NoisySpec,
    f: &Figures,
    a: &NoisyRow,
    others: &[&NoisyRow],
) -> String {
    let served = |r: &NoisyRow| r.sent.1.saturating_sub(r.refused);
    let total = served(a) + others.iter().map(|r| served(r)).sum::<usize>();
    if total == 0 {
        return String::new();
    }
    let tenants = others.len() + 1;
    let mut s = format!(
        "; {} was served {} of the {} requests of the window served ({}; an equal share is {})",
        a.tenant,
        served(a),
        total,
        pct(served(a) as f64 / total as f64),
        pct(1.0 / tenants as f64)
    );
    let pair = n.pairs.iter().find(|p| p.label == n.subject);
    let uses = pair.and_then(|p| {
        Some((
            f.prefill_use.get(&p.burst)?,
            f.prefill_use.get(&p.baseline)?,
        ))
    });
    if let Some((with, without)) = uses {
        let _ = write!(
            s,
            "; the engines' prefill use was {} with the burst against {} without it",
            pct(*with),
            pct(*without)
        );
        if *with > *without && served(a) * tenants > total {
            s.push_str(
                " (the fair share is work-conserving: what the others, not backlogged, leave goes to the \
                 bursting tenant, and the others wait longer at the higher use)",
            );
        }
    }
    s
}

fn check_budgets(f: &Figures, out: &mut Vec<TargetCheck>) {
    let over: Vec<&BudgetRow> = f.budgets.iter().filter(|r| r.tenant.demand > 1.0).collect();
    if let Some(w) = over.iter().max_by(|a, b| {
        a.steady_ratio()
            .max(a.whole_ratio())
            .total_cmp(&b.steady_ratio().max(b.whole_ratio()))
    }) {
        let worst = w.steady_ratio().max(w.whole_ratio());
        out.push(TargetCheck {
            target: format!(
                "budgets: tokens served per minute <= budget + {:.0}% (counting the first window, and from the first 429 on)",
                BUDGET_OVERSHOOT * 100.0
            ),
            measured: format!(
                "worst {}: {} counting the first window, {} from its first 429 on",
                w.tenant.name,
                pct(w.whole_ratio()),
                pct(w.steady_ratio())
            ),
            met: Some(worst <= 1.0 + BUDGET_OVERSHOOT),
            why: if worst <= 1.0 + BUDGET_OVERSHOOT {
                String::new()
            } else {
                over.iter()
                    .map(|r| {
                        format!(
                            "{}: {} / {} (max_tokens {}), {} of {} answered 429",
                            r.tenant.name,
                            pct(r.steady_ratio()),
                            pct(r.whole_ratio()),
                            if r.tenant.max_tokens { "sent" } else { "left out" },
                            r.limited,
                            r.sent
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            },
        });
    }
    let under: Vec<&BudgetRow> = f.budgets.iter().filter(|r| r.tenant.demand < 1.0).collect();
    if !under.is_empty() {
        let limited: usize = under.iter().map(|r| r.limited).sum();
        out.push(TargetCheck {
            target: "budgets: no tenant under its budget is limited".into(),
            measured: under
                .iter()
                .map(|r| {
                    format!(
                        "{}: {} of {} answered 429",
                        r.tenant.name, r.limited, r.sent
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
            met: Some(limited == 0),
            why: String::new(),
        });
    }
}

fn check_saturation(s: &Scenarios, f: &Figures, out: &mut Vec<TargetCheck>) {
    let Some(sat) = &s.saturation else { return };
    let find = |l: &str| f.saturation.iter().find(|r| r.label == l);
    let (Some(subj), Some(base)) = (find(&sat.subject), find(&sat.baseline)) else {
        return;
    };
    let r = subj.good as f64 / base.good as f64;
    out.push(TargetCheck {
        target: format!(
            "saturation (trace load {}): SLO goodput (TTFT <= {}) of {} >= {GOODPUT_RATIO}x {}'s",
            sat.load,
            ms(sat.slo_ms),
            sat.subject,
            sat.baseline
        ),
        measured: format!(
            "{} vs {} requests within the SLO: {}",
            subj.good,
            base.good,
            x(r)
        ),
        met: Some(r >= GOODPUT_RATIO),
        why: if r >= GOODPUT_RATIO {
            String::new()
        } else {
            format!(
                "{} refused {} of {} and served {} (TTFT p50 {}); {} served {} (TTFT p50 {})",
                sat.subject,
                subj.refused,
                subj.sent,
                subj.ok,
                ms(subj.ttft.p50),
                sat.baseline,
                base.ok,
                ms(base.ttft.p50)
            )
        },
    });
}

fn check_below(s: &Scenarios, f: &Figures, out: &mut Vec<TargetCheck>) {
    for b in &s.below {
        let Some((_, r)) = f
            .below
            .iter()
            .find(|(l, r)| (*l - b.load).abs() < 1e-9 && r.label == b.subject)
        else {
            continue;
        };
        let others: Vec<String> = f
            .below
            .iter()
            .filter(|(l, o)| (*l - b.load).abs() < 1e-9 && o.label != b.subject)
            .map(|(_, o)| format!("{} {}", o.label, x(o.ratio())))
            .collect();
        out.push(TargetCheck {
            target: format!(
                "below saturation (trace load {}): {}'s mean TTFT <= {BALANCE_RATIO}x perfect balance at its own reuse",
                b.load, b.subject
            ),
            measured: format!(
                "{} vs {}: {}{}",
                ms(r.mean_ms),
                ms(r.balanced_ms),
                x(r.ratio()),
                if others.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", others.join(", "))
                }
            ),
            met: Some(r.ratio() <= BALANCE_RATIO),
            why: if r.unanswered > 0 {
                format!("{} of {} requests unanswered (not in the mean)", r.unanswered, r.sent)
            } else {
                String::new()
            },
        });
    }
}

/// The targets checked against the figures.
pub fn check(s: &Scenarios, f: &Figures) -> Vec<TargetCheck> {
    let mut out = Vec::new();
    check_noisy(s, f, &mut out);
    check_budgets(f, &mut out);
    check_saturation(s, f, &mut out);
    check_below(s, f, &mut out);
    out
}

fn met(m: Option<bool>) -> &'static str {
    match m {
        Some(true) => "yes",
        Some(false) => "**no**",
        None => "-",
    }
}

/// The targets as a markdown table.
pub fn targets_table(t: &[TargetCheck]) -> String {
    let mut o =
        String::from("| target | measured | met | why (for a miss) |\n| --- | --- | --- | --- |\n");
    for c in t {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} |",
            c.target,
            c.measured,
            met(c.met),
            c.why
        );
    }
    o
}

fn noisy_section(s: &Scenarios, f: &Figures, o: &mut String) {
    let Some(n) = &s.noisy else { return };
    let _ = writeln!(
        o,
        "## Noisy neighbour\n\n{} sends {}x its rate from {:.0} s to {:.0} s; each tenant's TTFT of the requests \
         it sent in that window, with the burst and without it (the same requests less the burst's extra ones).\n",
        n.burst_tenant, n.factor, n.from_s, n.to_s
    );
    o.push_str(
        "| configuration | tenant | sent (no burst / burst) | TTFT p50 no burst / burst | p99 no burst / burst | p50 ratio | p99 ratio | refused |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in &f.noisy {
        let _ = writeln!(
            o,
            "| {} | {}{} | {} / {} | {} / {} | {} / {} | {} | {} | {} |",
            r.config,
            r.tenant,
            if r.tenant == n.burst_tenant {
                " (bursts)"
            } else {
                ""
            },
            r.sent.0,
            r.sent.1,
            ms(r.base.p50),
            ms(r.burst.p50),
            ms(r.base.p99),
            ms(r.burst.p99),
            x(r.p50_ratio()),
            x(r.p99_ratio()),
            r.refused
        );
    }
    o.push('\n');
}

fn budgets_section(s: &Scenarios, f: &Figures, o: &mut String) {
    let Some(b) = &s.budgets else { return };
    let _ = writeln!(
        o,
        "## Budgets\n\n{:.0} s of arrivals in real time (time scale 1, so the budgets' one-minute window is {:.0} s \
         of the records). Tokens are prompt (cached at weight 1) plus completion tokens of served requests, by \
         send time. Counting the first window: served over `limit x (1 + {:.0} s / 60 s)` (the bucket starts \
         full); after it: requests sent from the tenant's first 429 on (its bucket was empty then) over the \
         refill of that span.\n",
        b.duration_s, b.window_s, b.duration_s
    );
    o.push_str(
        "| tenant | budget tokens/min | demand | max_tokens | sent | served | 429 | served / allowed (whole run) | first 429 | after it |\n\
         | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in &f.budgets {
        let t = &r.tenant;
        let _ = writeln!(
            o,
            "| {} | {} | {}x | {} | {} | {} | {} | {} ({} of {:.0}) | {} | {} ({} of {}) |",
            t.name,
            t.tokens_per_minute,
            t.demand,
            if t.max_tokens {
                "sent"
            } else {
                "left out (chat API)"
            },
            r.sent,
            r.ok,
            r.limited,
            pct(r.whole_ratio()),
            r.served_tokens,
            r.allowed_tokens,
            if r.dry_at_s.is_finite() {
                format!("{:.0} s", r.dry_at_s)
            } else {
                "-".into()
            },
            pct(r.steady_ratio()),
            r.steady_tokens,
            if r.steady_allowed.is_finite() {
                format!("{:.0}", r.steady_allowed)
            } else {
                "-".into()
            }
        );
    }
    o.push('\n');
}

fn saturation_section(s: &Scenarios, f: &Figures, o: &mut String) {
    let Some(sat) = &s.saturation else { return };
    let _ = writeln!(
        o,
        "## Saturation\n\nThe trace at load {}: requests served with TTFT <= {} (SLO goodput), per second of the \
         arrival window.\n",
        sat.load,
        ms(sat.slo_ms)
    );
    o.push_str(
        "| run | sent | served | within SLO | goodput req/s | refused | TTFT p50 / p90 / p99 |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in &f.saturation {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {:.2} | {} | {} / {} / {} |",
            r.label,
            r.sent,
            r.ok,
            r.good,
            r.good_per_s,
            r.refused,
            ms(r.ttft.p50),
            ms(r.ttft.p90),
            ms(r.ttft.p99)
        );
    }
    o.push('\n');
}

fn below_section(f: &Figures, o: &mut String) {
    if f.below.is_empty() {
        return;
    }
    o.push_str(
        "## Below saturation\n\nMean TTFT of the answered requests against the routing report's perfect-balance \
         yardstick: the same arrivals in one central FCFS prefill queue in front of all engines (least work \
         left), each request priced at the prefix the run itself reused.\n\n\
         | load | run | mean TTFT | perfect balance | ratio | hit rate | unanswered |\n\
         | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (l, r) in &f.below {
        let _ = writeln!(
            o,
            "| {l:.1} | {} | {} | {} | {} | {} | {} |",
            r.label,
            ms(r.mean_ms),
            ms(r.balanced_ms),
            x(r.ratio()),
            pct(r.hit_rate),
            r.unanswered
        );
    }
    o.push('\n');
}

/// The whole report.
pub fn render(s: &Scenarios, f: &Figures) -> String {
    let mut o = format!(
        "# Governance benchmarks\n\nProduced by `{}`.\n\n",
        s.command
    );
    for l in &s.setup {
        let _ = writeln!(o, "- {l}");
    }
    o.push_str(
        "\nTimes are simulated (wall time / time scale). A request refused (429 / 503) or never answered \
         counts as infinitely slow (∞) in percentiles.\n\n## Targets\n\n",
    );
    o.push_str(&targets_table(&f.targets));
    o.push('\n');
    noisy_section(s, f, &mut o);
    budgets_section(s, f, &mut o);
    saturation_section(s, f, &mut o);
    below_section(f, &mut o);
    o.push_str("## Per-run facts (proxy and indexer counters)\n\n");
    for (name, notes) in &f.facts {
        let v: Vec<String> = notes.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(o, "- `{name}`: {}", v.join(", "));
    }
    o
}

/// Writes `report.md`, `summary.json` and `readme.md` for the runs in
/// `dir` as its `scenarios.json` describes them.
pub fn write(dir: &Path, model: &EngineModel) -> anyhow::Result<Figures> {
    let path = dir.join("scenarios.json");
    let s: Scenarios = serde_json::from_str(
        &std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("parsing {}", path.display()))?;
    let f = figures(dir, &s, model)?;
    std::fs::write(dir.join("report.md"), render(&s, &f))?;
    std::fs::write(dir.join("summary.json"), serde_json::to_string_pretty(&f)?)?;
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("governance");
    let readme = format!(
        "{}\nProduced by `{}`; per-tenant tables, per-run facts: [bench/results/{name}/report.md](bench/results/{name}/report.md).\n",
        targets_table(&f.targets),
        s.command
    );
    std::fs::write(dir.join("readme.md"), readme)?;
    Ok(f)
}
