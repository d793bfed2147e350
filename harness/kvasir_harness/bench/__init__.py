"""The benchmarks' drivers: they start the simulated cluster, call the
`kvasir-bench` subcommands and check the results. `bench/<name>.py` is
each one's command line (`.tools/venv/bin/python bench/routing.py --preset
short`); tests import the modules.

Modules:
    routing           the routing benchmark: five routing modes, single proxy or deployed-like
    sim_cluster       the simulated cluster each run starts (engines, Envoys, indexers)
    variants          the kvasir mode's variants: other pool settings, late binding
    deployed_records  what the deployed-like runs read from the trace and their records
    cpu_usage         CPU used per process group during a run
    deployed_targets  the deployed-shape targets and why each miss happened
    hit_gap           where a mode's cache hits fell short of the pooled-cache bound
    repeats           run-to-run spread
    shapes            two deployed shapes side by side
    governance        budgets and flow control under load
    filter_overhead   the latency the filter adds
    failopen          picks under held streams: fail-open counts and pick cost
    soak              long runs judged on errors and steady memory (soak_stats: the rule; soak_report)

The trace, the `kvasir-bench` binary and the results folder are
`kvasir_harness.paths.TRACE`, `BENCH_BIN` and `RESULTS`.
"""
