//! A results directory: each run as `<workload>-<load>-<mode>.csv` (its
//! records) beside `.json` (its [`RunMeta`]), the trace's pooled-cache
//! bound as `bound.json`, the orchestrator's setup facts as `setup.txt`,
//! and what the report makes of them (`report.md`, its SVG plots,
//! `summary.json`).

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::bound::{EngineModel, PooledBound};
use crate::compare::{mode_rank, Inputs, APPROX, KVASIR, REF_LOAD};
use crate::floor::{self, Unqueued};
use crate::plot::{self, LoadCurve};
use crate::record::{self, Outcome, Record};
use crate::report::render;
use crate::targets::check_targets;
use crate::RunMeta;

/// A run's file name without extension.
pub fn run_name(workload: &str, load: f64, mode: &str) -> String {
    format!("{workload}-{load:.2}-{mode}")
}

/// Writes a run's records and description into `dir` (made if missing).
pub fn write_run(dir: &Path, meta: &RunMeta, records: &[Record]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let name = run_name(&meta.workload, meta.load, &meta.mode);
    let mut csv = String::from(record::HEADER);
    csv.push('\n');
    for r in records {
        csv.push_str(&r.to_csv());
        csv.push('\n');
    }
    std::fs::write(dir.join(format!("{name}.csv")), csv)?;
    std::fs::write(
        dir.join(format!("{name}.json")),
        serde_json::to_string_pretty(meta)?,
    )?;
    Ok(())
}

/// Every run in `dir`, in file-name order: its description and its
/// records.
pub fn read_runs(dir: &Path) -> anyhow::Result<Vec<(RunMeta, Vec<Record>)>> {
    let mut out = Vec::new();
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        // A run is a JSON beside its CSV: the folder also holds the bound,
        // the summary and deployed_targets.py's targets, which are not runs.
        .filter(|p| p.extension().is_some_and(|e| e == "json") && p.with_extension("csv").is_file())
        .collect();
    names.sort();
    for p in names {
        let meta: RunMeta = serde_json::from_str(&std::fs::read_to_string(&p)?)
            .with_context(|| format!("parsing {}", p.display()))?;
        let csv = p.with_extension("csv");
        let recs = record::parse_csv(
            &std::fs::read_to_string(&csv).with_context(|| format!("reading {}", csv.display()))?,
        )
        .map_err(|e| anyhow::anyhow!("{}: {e}", csv.display()))?;
        out.push((meta, recs));
    }
    Ok(out)
}

/// Kvasir's runs (and its variants') priced with no queueing: at their own reuse, and for the
/// chat at the best reuse (from all runs of the same load, which replay
/// the same conversations); the approximate mode's at its own reuse, which
/// the p90 comparison sets against kvasir's. Each with its queueing
/// yardsticks, a trace run's balanced one also at the pooled cache's reuse
/// (`pooled`, one figure per trace request).
pub fn unqueued_ttfts(
    runs: &[(RunMeta, Vec<Record>)],
    block_tokens: u64,
    pooled: Option<&[u64]>,
    model: &EngineModel,
) -> Vec<Unqueued> {
    runs.iter()
        .filter(|(m, _)| is_kvasir(&m.mode) || m.mode == APPROX)
        .map(|(m, recs)| {
            let engines = m.engines.engines.max(1);
            if m.workload == "chat" && is_kvasir(&m.mode) {
                let same: Vec<&[Record]> = runs
                    .iter()
                    .filter(|(o, _)| o.workload == m.workload && (o.load - m.load).abs() < 1e-9)
                    .map(|(_, r)| r.as_slice())
                    .collect();
                floor::chat((&m.mode, m.load), recs, &same, block_tokens, engines, model)
            } else {
                // The pooled figures are by trace request; a record's id is
                // its request's place in the trace.
                let best: Option<Vec<u64>> = pooled
                    .filter(|_| m.workload == "trace")
                    .and_then(|p| recs.iter().map(|r| p.get(r.id).copied()).collect());
                floor::at_own_reuse(
                    (&m.workload, &m.mode, m.load),
                    recs,
                    engines,
                    best.as_deref(),
                    model,
                )
            }
        })
        .collect()
}

/// Whether `mode` is kvasir or one of its variants (`kvasir-NAME`, the
/// routing benchmark's `--variants`), which get kvasir's yardsticks too.
fn is_kvasir(mode: &str) -> bool {
    mode == KVASIR
        || mode
            .strip_prefix(KVASIR)
            .is_some_and(|v| v.starts_with('-'))
}

/// Writes the report of the runs in `dir` there: `report.md` with its
/// plots, and `summary.json`. With an engine `model` (and the engines' KV
/// block size) the runs are also priced with no queueing ([`floor`]).
/// `command` is what produced the results, quoted in the report.
pub fn write_report(
    dir: &Path,
    command: &str,
    model: Option<&EngineModel>,
    engine_block: u64,
) -> anyhow::Result<()> {
    let runs = read_runs(dir)?;
    anyhow::ensure!(!runs.is_empty(), "no runs in {}", dir.display());
    let bound_path = dir.join("bound.json");
    let bound: Option<PooledBound> = if bound_path.exists() {
        Some(serde_json::from_str(&std::fs::read_to_string(
            &bound_path,
        )?)?)
    } else {
        None
    };
    let setup = std::fs::read_to_string(dir.join("setup.txt"))
        .map(|s| {
            s.lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let unqueued = match model {
        Some(model) => {
            let pooled = bound
                .as_ref()
                .map(|b| b.per_request_cached.as_slice())
                .filter(|p| !p.is_empty());
            unqueued_ttfts(&runs, engine_block, pooled, model)
        }
        None => Vec::new(),
    };
    let inp = Inputs {
        runs: runs.iter().map(|(m, _)| m.clone()).collect(),
        bound,
        unqueued,
        command: command.to_string(),
        setup,
    };
    let mut md = render(&inp);
    let mut workloads: Vec<String> = inp.runs.iter().map(|r| r.workload.clone()).collect();
    workloads.sort();
    workloads.dedup();
    md.push_str("## Plots\n\n");
    for w in &workloads {
        let mut series: Vec<(String, Vec<f64>)> = runs
            .iter()
            .filter(|(m, _)| &m.workload == w && (m.load - REF_LOAD).abs() < 1e-9)
            .map(|(m, recs)| {
                let mut v: Vec<f64> = recs
                    .iter()
                    .map(|r| {
                        if r.outcome == Outcome::Ok && r.ttft_ms.is_finite() {
                            r.ttft_ms
                        } else {
                            f64::INFINITY
                        }
                    })
                    .collect();
                v.sort_by(f64::total_cmp);
                (m.mode.clone(), v)
            })
            .collect();
        series.sort_by_key(|(m, _)| mode_rank(m));
        if !series.is_empty() {
            let f = format!("{w}-ttft-cdf.svg");
            plot::ttft_cdf(
                &dir.join(&f),
                &format!("{w}: TTFT CDF at load 1.0"),
                &series,
            )
            .map_err(|e| anyhow::anyhow!("plot {f}: {e}"))?;
            md.push_str(&format!("![{w} TTFT CDF]({f})\n\n"));
        }
        let mut modes: Vec<String> = runs
            .iter()
            .filter(|(m, _)| &m.workload == w)
            .map(|(m, _)| m.mode.clone())
            .collect();
        modes.sort_by_key(|m| mode_rank(m));
        modes.dedup();
        let curves: Vec<LoadCurve> = modes
            .iter()
            .map(|mode| {
                let mut points: Vec<(f64, f64, f64)> = runs
                    .iter()
                    .filter(|(m, _)| &m.workload == w && &m.mode == mode)
                    .map(|(m, _)| (m.load, m.summary.ttft.p50, m.summary.ttft.p99))
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                LoadCurve {
                    mode: mode.clone(),
                    points,
                }
            })
            .collect();
        let f = format!("{w}-ttft-vs-load.svg");
        plot::ttft_vs_load(&dir.join(&f), &format!("{w}: TTFT against load"), &curves)
            .map_err(|e| anyhow::anyhow!("plot {f}: {e}"))?;
        md.push_str(&format!("![{w} TTFT against load]({f})\n\n"));
    }
    md.push_str("Raw per-request data: the `*.csv` files beside this report (one per workload, load and mode).\n");
    std::fs::write(dir.join("report.md"), &md)?;
    let summary = serde_json::json!({
        "command": command,
        "runs": inp.runs,
        "bound": inp.bound,
        "unqueued": inp.unqueued,
        "targets": check_targets(&inp),
    });
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats;

    fn run(mode: &str, ttft_ms: f64) -> (RunMeta, Vec<Record>) {
        let records: Vec<Record> = (0..4)
            .map(|i| Record {
                ttft_ms,
                itl_ms: 5.0,
                e2e_ms: ttft_ms * 2.0,
                prompt_tokens: 100,
                cached_tokens: 50,
                status: 200,
                outcome: Outcome::Ok,
                ..Record::unanswered(i, "trace".into(), None, 0, i as f64)
            })
            .collect();
        let meta = RunMeta {
            workload: "trace".into(),
            mode: mode.into(),
            load: REF_LOAD,
            rate: 1.0,
            time_scale: 0.25,
            wall_s: 1.0,
            engines: Default::default(),
            summary: stats::summarize(&records),
            ttft_growth: 1.0,
            notes: Default::default(),
        };
        (meta, records)
    }

    #[test]
    fn runs_written_are_read_back_and_reported() {
        let dir = std::env::temp_dir().join(format!("kvasir-bench-results-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (meta, records) in [run(KVASIR, 40.0), run(crate::compare::BASELINE, 100.0)] {
            write_run(&dir, &meta, &records).unwrap();
        }
        assert!(dir.join("trace-1.00-kvasir.csv").exists());
        let back = read_runs(&dir).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].0.mode, KVASIR, "file-name order");
        assert_eq!(back[0].1, run(KVASIR, 40.0).1);

        write_report(&dir, "kvasir-bench report --dir D", None, 16).unwrap();
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(
            md.contains("Produced by `kvasir-bench report --dir D`."),
            "{md}"
        );
        assert!(md.contains("![trace TTFT CDF](trace-ttft-cdf.svg)"), "{md}");
        assert!(dir.join("trace-ttft-vs-load.svg").exists());
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap())
                .unwrap();
        assert_eq!(summary["runs"].as_array().map(Vec::len), Some(2));
        // The report's own outputs are not runs, nor is what
        // deployed_targets.py writes beside them (a report is rewritten
        // after it).
        std::fs::write(dir.join("targets-deployed.json"), r#"{"rows": []}"#).unwrap();
        assert_eq!(read_runs(&dir).unwrap().len(), 2);
        write_report(&dir, "kvasir-bench report --dir D", None, 16).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn kvasirs_variants_get_its_yardsticks_and_other_modes_do_not() {
        assert!(is_kvasir("kvasir"));
        assert!(is_kvasir("kvasir-lb"));
        assert!(!is_kvasir("kvasirx"));
        assert!(!is_kvasir("approx-prefix"));
    }
}
