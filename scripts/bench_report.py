#!/usr/bin/env python3
"""Turns bench/results/*.json into markdown tables and puts them in
docs/benchmarks.md between `<!-- bench:NAME:start -->` and
`<!-- bench:NAME:end -->`."""
import json
import re

from kvasir_harness.bench.deployed_targets import met_word
from kvasir_harness.paths import REPO as ROOT, RESULTS
# The page the tables go to, and the way from it to the repository root
# (the tables link to the results' reports).
PAGE = ROOT / "docs" / "benchmarks.md"
TO_ROOT = "../"


def sim_table(r):
    rows = [
        "| scenario | prompt tokens | stream | requests/s | sim CPU per request | sim cores used | p50 / p99 latency |",
        "| --- | ---: | :---: | ---: | ---: | ---: | ---: |",
    ]
    names = {
        "chat_16_system_prompts": "chat, 16 shared system prompts + fresh user turn",
        "chat_16_system_prompts_stream": "same, streamed (SSE, include_usage)",
        "chat_all_unique": "chat, every prompt fresh",
    }
    for key, s in r["scenarios"].items():
        x = s["result"]
        rows.append(
            f"| {names.get(key, key)} | {s['prompt_tokens']} | {'yes' if s['stream'] else 'no'} "
            f"| **{x['requests_per_s']:.0f}** | {x['sim_cpu_us_per_request']:.0f} us | {x['sim_cpu_cores_used']:.2f} "
            f"| {x['latency_ms']['p50']:.1f} / {x['latency_ms']['p99']:.1f} ms |"
        )
    m = r["memory_25k_blocks"]
    rows.append("")
    rows.append(
        f"Memory with {m['cached_blocks']:.0f} cached blocks: RSS {m['rss_full_cache_mib']:.1f} MiB "
        f"(idle {m['rss_idle_mib']:.1f} MiB, {m['bytes_per_cached_block']:.0f} bytes per cached block). "
        f"Profile {r['profile']}, time scale {r['time_scale']}, {r['concurrency']} client connections, "
        f"{r['max_tokens']} completion tokens per request, {r['machine']}."
    )
    return "\n".join(rows)


def indexer_table(ingest, pick):
    rows = ["| ingestion (125-block BlockStored batches, vLLM map layout) | store only | store + evict |",
            "| --- | ---: | ---: |"]
    ph = {p["phase"]: p for p in ingest["ingest"]}
    a, b = ph["store_only"], ph["store_and_evict"]
    for label, key in [("decode only, blocks/s", "decode_only_blocks_per_s"),
                       ("decode + apply until visible, blocks/s (wall)", "decode_apply_visible_blocks_per_s"),
                       ("blocks per CPU-second, whole process", "blocks_per_cpu_second")]:
        rows.append(f"| {label} | {a[key] / 1e6:.2f} M | {b[key] / 1e6:.2f} M |")
    m = ingest["memory"]
    rows += ["", f"Memory: {m['bytes_per_block']:.0f} bytes per indexed block ({m['endpoints']} endpoints, "
             f"{m['blocks']} blocks, RSS delta {m['rss_delta_mb']:.1f} MB).", ""]
    rows += ["| Pick | endpoints x blocks | prompt tokens | in process p50 / p99 | gRPC loopback p50 / p99 | picked the history's endpoint |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for c in pick["pick"]:
        if "case" not in c:
            continue
        ip, g = c["in_process"], c["grpc_loopback"]
        rows.append(f"| {c['case']} | {c['endpoints']} x {c['blocks_per_endpoint']} | {c['prompt_tokens']} "
                    f"| {ip['p50_us'] / 1e3:.2f} / {ip['p99_us'] / 1e3:.2f} ms | {g['p50_us'] / 1e3:.2f} / {g['p99_us'] / 1e3:.2f} ms "
                    f"| {c['picked_home_fraction'] * 100:.0f}% |")
    tok = pick.get("tokenization", {})
    cold = []
    for case, t in tok.items():
        ce = t.get("cold_encode_chat") if isinstance(t, dict) else None
        if isinstance(ce, dict) and "mean_us" in ce:
            cold.append(f"{case}: {ce['mean_us'] / 1e3:.1f} ms")
    if cold:
        rows += ["", "Cold tokenization (fresh tokenizer, no segment cache), reported apart from Pick: " + "; ".join(cold) + "."]
    worst = pick.get("worst_case_1mb")
    if worst:
        cols = [("events_no_budget", "events, no budget"), ("events_default_budget", "events, default"),
                ("picks_no_budget", "picks, no budget"), ("picks_default_budget", "picks, default")]
        rows += ["", "| 1 MB message, Pick p50 / max | " + " | ".join(c for _, c in cols) + " |",
                 "| --- |" + " ---: |" * len(cols)]
        for case in worst[cols[0][0]]:
            cells = [f"{worst[k][case]['p50_ms']:.1f} / {worst[k][case]['max_ms']:.1f} ms" for k, _ in cols]
            rows.append(f"| {case} | " + " | ".join(cells) + " |")
    rows += ["", "Targets: ingestion >= 1 M blocks/s on one core; Pick p50 <= 0.5 ms at 4k tokens, "
             "<= 2 ms for a 32k-token chat whose earlier turns were seen."]
    return "\n".join(rows)


def filter_table(r):
    rows = ["| rate | without filter p50 / p99 | with filter + pick p50 / p99 | added p50 / p99 (median of rounds) | rounds' added p50 | pick round trip p50 (indexer's own pick, mean) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x in r["rates"]:
        w, wo = x["with_filter"], x["without_filter"]
        lo, hi = x.get("added_p50_range_ms", [x["added_p50_ms"]] * 2)
        wh = x.get("where", {})
        rt = wh.get("pick_round_trip_p50_ms")
        ip = wh.get("indexer_pick_mean_ms")
        where = f"{rt:.2f} ms ({ip:.2f} ms)" if rt is not None and ip is not None else "-"
        rows.append(f"| {x['rate_rps']:.0f} rps | {wo['p50_ms']:.2f} / {wo['p99_ms']:.2f} ms | {w['p50_ms']:.2f} / {w['p99_ms']:.2f} ms "
                    f"| **{x['added_p50_ms']:.2f} / {x['added_p99_ms']:.2f} ms** | {lo:.2f} to {hi:.2f} ms | {where} |")
    rss = r["envoy_rss_mib"]
    rows += ["", f"{r['prompt_tokens']}-token chat bodies ({r['body_bytes']} bytes). Targets: p50 <= 0.5 ms, p99 <= 2 ms added. "
             f"wasm module {r['wasm_bytes'] / 1024:.0f} KiB; Envoy RSS {rss['without_filter']:.0f} MiB without the filter, "
             f"{rss['with_filter']:.0f} MiB with it (about {r['filter_rss_per_vm_mib']:.0f} MiB per VM: one worker plus the main thread). "
             + r["notes"]]
    return "\n".join(rows)


def num(v):
    """The report's JSON writes infinities as "inf" and NaN as null."""
    if v is None:
        return float("nan")
    if isinstance(v, str):
        return float(v)
    return v


def fmt_ms(v):
    v = num(v)
    if v != v:
        return "-"
    if v == float("inf"):
        return "∞"
    return f"{v / 1000:.2f} s" if v >= 10000 else f"{v:.0f} ms"


def routing_table(r, subdir="routing"):
    """Load 1.0 (and 2.0) of each workload, every mode, and the targets."""
    runs = r["runs"]
    base = {(x["workload"], x["load"]): x for x in runs if x["mode"] == "round-robin"}
    order = {"round-robin": 0, "least-request": 1, "approx-prefix": 2, "kvasir": 3}
    rows = [
        "| workload | load | mode | TTFT p50 / p90 / p99 | e2e p50 | hit rate | goodput req/s | RR prefill use | TTFT p50 / RR | TTFT p99 / RR |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in sorted(runs, key=lambda x: (x["workload"], x["load"], order.get(x["mode"], 9))):
        s = x["summary"]
        b = base.get((x["workload"], x["load"]))
        def ratio(k, q):
            if not b:
                return "-"
            a, c = num(s[k][q]), num(b["summary"][k][q])
            if a != a or c != c or c == 0 or c == float("inf"):
                return "-"
            return f"{100 * a / c:.0f}%"
        util = num(b["engines"]["prefill_utilisation"]) if b else float("nan")
        rows.append(
            f"| {x['workload']} | {x['load']:.1f} | {x['mode']} | {fmt_ms(s['ttft']['p50'])} / {fmt_ms(s['ttft']['p90'])} / "
            f"{fmt_ms(s['ttft']['p99'])} | {fmt_ms(s['e2e']['p50'])} | {100 * num(s['cache_hit_rate']):.1f}% | "
            f"{num(s['goodput_rps']):.2f} | {100 * util:.0f}% | {ratio('ttft', 'p50')} | {ratio('ttft', 'p99')} |"
        )
    rows += ["", "| target | measured | met | why (for a miss) |", "| --- | --- | --- | --- |"]
    for t in r["targets"]:
        why = t.get("why", "") if t["met"] is False else ""
        rows.append(f"| {t['target']} | {t['measured']} | {met_word(t['met'])} | {why} |")
    # The deployed targets of a deployed-like run (bench/deployed_targets.py).
    deployed = RESULTS / subdir / "targets-deployed.json"
    if deployed.exists():
        rows += ["", "| deployed target (one run) | measured | met | why (for a miss) |", "| --- | --- | --- | --- |"]
        for t in json.loads(deployed.read_text()):
            why = t.get("why", "") if t["met"] is False else ""
            rows.append(f"| {t['target']} | {t['measured']} | {met_word(t['met'])} | {why} |")
    rows += ["", f"Produced by `{r['command']}`; the full report with ITL, throughput, per-run facts and plots is "
             f"[bench/results/{subdir}/report.md]({TO_ROOT}bench/results/{subdir}/report.md)."]
    return "\n".join(rows)


def put(page, name, body):
    pat = re.compile(rf"(<!-- bench:{name}:start -->\n).*?(<!-- bench:{name}:end -->)", re.S)
    if not pat.search(page):
        return page
    return pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), page)


def main():
    page_path = PAGE
    page = page_path.read_text()
    sim = RESULTS / "sim.json"
    if sim.exists():
        table = sim_table(json.loads(sim.read_text()))
        (RESULTS / "sim.md").write_text(table + "\n")
        page = put(page, "sim", table)
    ing, pk = RESULTS / "indexer_ingest.json", RESULTS / "indexer_pick.json"
    if ing.exists() and pk.exists():
        table = indexer_table(json.loads(ing.read_text()), json.loads(pk.read_text()))
        (RESULTS / "indexer.md").write_text(table + "\n")
        page = put(page, "indexer", table)
    flt = RESULTS / "filter.json"
    if flt.exists():
        table = filter_table(json.loads(flt.read_text()))
        (RESULTS / "filter.md").write_text(table + "\n")
        page = put(page, "filter", table)
    # The single-proxy runs and the deployed-like ones, each
    # preset; a page without a run's markers is left as it is. The report
    # writes Infinity for requests that never answered.
    for run in ("routing", "routing-short", "routing-deployed", "routing-deployed-short"):
        summary = RESULTS / run / "summary.json"
        if summary.exists():
            page = put(page, run, routing_table(json.loads(summary.read_text()), run))
    page_path.write_text(page)


if __name__ == "__main__":
    main()
