#!/usr/bin/env python3
"""Turns bench/results/*.json into markdown tables and puts them in README.md
between `<!-- bench:NAME:start -->` and `<!-- bench:NAME:end -->`."""
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


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


def put(readme, name, body):
    pat = re.compile(rf"(<!-- bench:{name}:start -->\n).*?(<!-- bench:{name}:end -->)", re.S)
    if not pat.search(readme):
        return readme
    return pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), readme)


def main():
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text()
    sim = RESULTS / "sim.json"
    if sim.exists():
        table = sim_table(json.loads(sim.read_text()))
        (RESULTS / "sim.md").write_text(table + "\n")
        readme = put(readme, "sim", table)
    readme_path.write_text(readme)


if __name__ == "__main__":
    main()
