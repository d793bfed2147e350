//! `kvasir-bench tenants` and `kvasir-bench governance-report`: the
//! governance benchmarks' load generator and report, run by
//! `bench/governance.py`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use kvasir_bench::tenants::{self, Burst, TenantsConfig};
use kvasir_bench::{governance_report, run};

use super::{options, range_usize, write_run, Common, EngineArgs};

#[derive(Args)]
pub(crate) struct TenantsArgs {
    #[command(flatten)]
    common: Common,
    /// Workload label of the run's files (`<workload>-<load>-<mode>`).
    #[arg(long, default_value = "tenants")]
    workload: String,
    /// Tenants (named t00, t01, ...).
    #[arg(long, default_value_t = 4)]
    tenants: usize,
    /// Requests per simulated second of a tenant at share 1.
    #[arg(long)]
    rate: f64,
    /// Each tenant's rate over `--rate`, comma-separated (default all 1).
    #[arg(long, value_delimiter = ',')]
    shares: Vec<f64>,
    /// Simulated seconds of arrivals.
    #[arg(long, default_value_t = 60.0)]
    duration_s: f64,
    /// Tokens of the prefix each tenant's requests share (whole 512-token
    /// blocks).
    #[arg(long, default_value_t = 0)]
    prefix_tokens: usize,
    /// Tokens of each request's own part, MIN..MAX.
    #[arg(long, default_value = "1000..4000", value_parser = range_usize)]
    unique_tokens: (usize, usize),
    /// Completion tokens, MIN..MAX.
    #[arg(long, default_value = "50..150", value_parser = range_usize)]
    output_tokens: (usize, usize),
    /// Tenants (indices, comma-separated) whose requests leave `max_tokens`
    /// out.
    #[arg(long, value_delimiter = ',')]
    no_max_tokens: Vec<usize>,
    /// A burst, `TENANT:FACTOR:FROM..TO` (tenant index, rate multiple,
    /// simulated seconds), e.g. `0:3:20..40`.
    #[arg(long, value_parser = parse_burst)]
    burst: Option<Burst>,
    /// Seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

fn parse_burst(s: &str) -> Result<Burst, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [t, f, w] = parts[..] else {
        return Err(format!("expected TENANT:FACTOR:FROM..TO, got `{s}`"));
    };
    let (from, to) = w
        .split_once("..")
        .ok_or_else(|| format!("expected FROM..TO, got `{w}`"))?;
    let num = |x: &str| x.trim().parse::<f64>().map_err(|e| format!("`{x}`: {e}"));
    Ok(Burst {
        tenant: t.trim().parse().map_err(|e| format!("`{t}`: {e}"))?,
        factor: num(f)?,
        from_s: num(from)?,
        to_s: num(to)?,
    })
}

pub(crate) async fn tenants_cmd(a: TenantsArgs) -> anyhow::Result<()> {
    let (o0, o1) = a.output_tokens;
    let cfg = TenantsConfig {
        tenants: a.tenants,
        rate: a.rate,
        shares: a.shares,
        duration_s: a.duration_s,
        prefix_tokens: a.prefix_tokens,
        unique_tokens: a.unique_tokens,
        output_tokens: (
            u32::try_from(o0).context("--output-tokens")?,
            u32::try_from(o1).context("--output-tokens")?,
        ),
        no_max_tokens: a.no_max_tokens,
        burst: a.burst,
        seed: a.seed,
    };
    let plan = Arc::new(tenants::plan(&cfg)?);
    let opts = options(&a.common)?;
    let res = run::run_tenants(plan, &opts).await?;
    write_run(&a.common, &opts, &a.workload, a.rate, res)
}

#[derive(Args)]
pub(crate) struct GovernanceReportArgs {
    /// Results directory: `scenarios.json` and the runs it names.
    #[arg(long)]
    dir: PathBuf,
    #[command(flatten)]
    engine: EngineArgs,
}

pub(crate) fn governance_report_cmd(a: &GovernanceReportArgs) -> anyhow::Result<()> {
    let model = a
        .engine
        .model()?
        .context("--profile none: the yardstick needs a latency profile")?;
    let f = governance_report::write(&a.dir, &model)?;
    for t in &f.targets {
        eprintln!(
            "{}: {} ({})",
            t.target,
            t.measured,
            match t.met {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "not run",
            }
        );
    }
    eprintln!("wrote {}", a.dir.join("report.md").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_parse() {
        let b = parse_burst("0:3:20..40.5").unwrap();
        assert_eq!((b.tenant, b.factor, b.from_s, b.to_s), (0, 3.0, 20.0, 40.5));
        assert!(parse_burst("0:3").is_err());
        assert!(parse_burst("0:3:20-40").is_err());
        assert!(parse_burst("x:3:1..2").is_err());
    }
}
