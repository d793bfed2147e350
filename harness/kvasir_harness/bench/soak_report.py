"""bench/results/soak/report.md from the soaks' summary.json."""

from __future__ import annotations

from pathlib import Path

from . import soak_stats as S


def _streams(r: dict) -> list[str]:
    c = r["config"]
    act = r["envoy_active_requests_after_warmup"]
    lines = [
        "## Held streams through Envoy with the filter",
        "",
        f"{r['what']}; started {r['started']}. {c['sims']} vllm-sims (profile `{c['sim_profile']}`, time scale "
        f"{c['time_scale']}, `--max-num-seqs {c['max_num_seqs']}`), one cache-indexer with Redis for "
        f"{c['redis']}, Envoy with {c['envoy_workers']} workers; prompts of {c['prompt_words']} words, "
        f"{c['max_tokens']} completion tokens each.",
        "",
        f"- **{'PASS' if r['pass'] else 'FAIL'}**: {r['requests']} requests, {r['ok']} answered 200 and read to "
        f"their end, **{r['errors']} errors** ({r['failed']} without an answer: {r['failures'] or 'none'}; "
        f"by status {r['by_status']}), {r['failopen']} picks failed open.",
        f"- Streams held: Envoy's active requests after the warm-up min {act['min']:.0f} / "
        + (f"5th percentile {act['p05']:.0f} / " if "p05" in act else "") + "median "
        f"{act['median']:.0f} / max {act['max']:.0f} (the load generator's peak: {r['peak_open']}); "
        f"{r['requests_per_s']} requests/s, mean {r['mean_ok_s']} s, p99 {r['p99_ok_s']} s each.",
        f"- Budgeted picks through Redis: {r['budget_picks']}; Redis at the end: {r['redis']['used_memory_mib']} MiB "
        f"used, keys `{r['redis']['keys']}`"
        + (": " + ", ".join(f"`{k}` ({v['type']}, {v['entries']} entries, {v['bytes']} B)"
                            for k, v in r["redis"]["by_key"].items()) if r["redis"].get("by_key") else "") + ".",
        f"- Machine busy {r['machine_busy_share']:.0%} of its {r['machine']['cpus']} cores over the run "
        f"(load average at start {r['machine']['loadavg_at_start']}).",
        "",
        *S.memory_table(r["rss"]),
        "",
    ]
    rm = r.get("redis_used_memory", {})
    if rm.get("samples"):
        lines += [f"Redis's own `used_memory`: {rm['start_mib']} → {rm['end_mib']} MiB, slope "
                  f"{rm['slope_mib_per_10min']:+} MiB/10 min, {'steady' if rm['steady'] else 'NOT steady'}.", ""]
    for k, h in r.get("envoy_heap", {}).items():
        if h.get("samples"):
            lines += [f"Envoy's heap (admin `/memory`, `{'heap_size' if k == 'size' else k}`): {h['start_mib']} → "
                      f"{h['end_mib']} MiB, slope {h['slope_mib_per_10min']:+} MiB/10 min, "
                      f"{'steady' if h['steady'] else 'NOT steady'}.", ""]
    leak = {k: v.get("leak_bound_bytes_per_request") for k, v in r["rss"].items() if k in ("envoy", "indexer", "redis")}
    lines += [f"At this run's request count the slope limit lets through at most {leak} bytes per request.", ""]
    return lines


def _indexer(r: dict) -> list[str]:
    c = r["config"]
    lat = r["pick_latency_us"]
    lines = [
        "## The indexer alone: KV events plus picks",
        "",
        f"{r['what']}; started {r['started']}. {c['engines']} fake engines publish vLLM's KV events "
        f"(map layout, uint64 hashes) over ZMQ: `BlockStored` of {c['blocks_per_event']} blocks in chains, and "
        f"once an engine holds {c['capacity_blocks_per_engine']} blocks one `BlockRemoved` of its oldest chain "
        "per chain stored. Picks are two-message chats over gRPC (with the indexer's token), each answered one "
        "followed by its `DONE` report.",
        "",
        f"- **{'PASS' if r['pass'] else 'FAIL'}**; target rates "
        f"{'reached' if r['reached_target_rates'] else 'NOT reached on this machine'}: "
        f"{r['events_per_s']:.0f} events/s (target {c['target_events_per_s']:.0f}), "
        f"{r['picks_per_s']:.0f} picks/s (target {c['target_picks_per_s']:.0f}).",
        f"- Events: {r['events_sent']} sent, {r['events_applied_by_indexer']} applied by the indexer, "
        f"{r['events_skipped_by_indexer']} skipped; {r['blocks_stored']} blocks stored.",
        f"- Picks: {r['picks_ok']} answered, {r['picks_err']} errors {r['errors'] or ''}, {r['picks_dropped']} not "
        f"sent (the load's in-flight cap), {r['reports_err']} report errors; decisions {r['pick_decisions']}.",
        f"- Pick latency over gRPC (client side): p50 {lat['p50_us']} µs, p90 {lat['p90_us']} µs, p99 "
        f"{lat['p99_us']} µs, max {lat['max_us']} µs.",
        f"- Machine busy {r['machine_busy_share']:.0%} of its {r['machine']['cpus']} cores (the load generator "
        "shares them with the indexer).",
        "",
        *S.memory_table(r["rss"]),
        "",
        "Pick latency and rates per window (every sixth shown):",
        "",
        "| t s | events/s | picks/s | p50 µs | p99 µs | max µs | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    windows = r["pick_latency_by_window"]
    for w in windows[::6] + ([windows[-1]] if windows and (len(windows) - 1) % 6 else []):
        lines.append(f"| {w['t_s']} | {w['events_per_s']:.0f} | {w['picks_per_s']:.0f} | {w['p50_us']} | "
                     f"{w['p99_us']} | {w['max_us']} | {w['errors']} |")
    lines.append("")
    return lines


def write_report(summary: dict, path: Path) -> None:
    lines = [
        "# Soaks",
        "",
        "Written by `bench/soak.py` (`make bench` runs it with `SOAK_SECONDS`, default 600). "
        "Figures from summary.json in this folder.",
        "",
        f"**Steady**: {summary.get('steady_rule', S.RULE)}.",
        "",
    ]
    if "streams" in summary:
        lines += _streams(summary["streams"])
    if "indexer" in summary:
        lines += _indexer(summary["indexer"])
    path.write_text("\n".join(lines))
