#!/usr/bin/env python3
"""`make demo`: the local Kvasir stack, end to end.

Starts three vllm-sims (the h100-8b latency model, 10x faster than real
time), one cache-indexer fed by their KV events, and a real Envoy 1.40 with
the Kvasir wasm filter and envoy/policy.json (tenants `acme` and `beta` by
API key). Then it sends a multi-tenant, multi-turn chat workload through
Envoy, prints which engine served each turn and how many prompt tokens it
found cached, then a streamed Anthropic Messages conversation and a
streamed Responses API conversation chained by `previous_response_id` (each
follow-up served by the engine that stored the previous response), then
tenant beta's budget at work (a burst past its two requests in flight is
answered 429 with Retry-After and OpenAI's x-ratelimit-* headers while
acme is served), and finally the per-tenant stats read from Envoy's admin
/stats/prometheus.
Every process is stopped on exit or Ctrl-C.

The process plumbing (free ports, bounded waits, the bootstrap renderer) is
the end-to-end test harness's, so the demo runs exactly what the tests run.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import kvasir_harness as h  # harness/kvasir_harness: processes, ports, bounded waits, the launchers

REPO = Path(__file__).resolve().parents[1]

TENANTS = {
    "acme": "You are Acme Corp's support assistant. Acme sells industrial robots. ",
    "beta": "You are Beta Labs' research assistant. Beta Labs studies protein folding. ",
}
QUESTIONS = [
    "How do I reset the controller?",
    "And after the reset, what should I check first?",
    "Which logs matter most when it fails again?",
    "Summarise the steps in three bullet points.",
]
TIME_SCALE = 0.1



def system_prompt(tenant: str) -> str:
    # A long shared system prompt per tenant (~1,500 tokens): the prefix every
    # conversation of that tenant shares.
    rng = random.Random(tenant)
    words = "policy safety manual robot arm joint torque sensor calibration warranty service".split()
    return TENANTS[tenant] + " ".join(rng.choice(words) for _ in range(1500))


def progress(done: int, total: int, width: int = 30) -> str:
    n = width * done // total
    return f"[{'#' * n}{'.' * (width - n)}] {done}/{total}"


def stream_events(envoy, path: str, body: dict, tenant: str) -> tuple[str, list]:
    """POSTs a streamed request; (engine that served, its named SSE events)."""
    status, headers, raw = envoy.post(path, body, key=f"sk-{tenant}-demo")
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status}: {raw[:300]!r}")
    return headers.get("x-gateway-destination-endpoint-served", "?"), h.sse_named_events(raw)


def anthropic_conversation(envoy, names: dict[str, str]) -> None:
    """Three streamed turns of Anthropic Messages (`POST /v1/messages`):
    vLLM reports the prompt tokens read from its prefix cache as
    `cache_read_input_tokens`."""
    print("\nAnthropic Messages, streamed (POST /v1/messages), tenant acme:")
    print(f"{'turn':4} {'served by':10} {'cache read / prompt tokens':>27}")
    system = system_prompt("acme") + " Answer as Acme's assistant on the Messages API."
    msgs: list[dict] = []
    for turn, q in enumerate(QUESTIONS[:3]):
        msgs.append({"role": "user", "content": f"[messages] {q}"})
        body = {"model": h.MODEL, "system": system, "messages": msgs, "max_tokens": 24, "stream": True}
        served, events = stream_events(envoy, "/v1/messages", body, "acme")
        usage = [d["usage"] for n, d in events if n == "message_delta"][-1]
        read = usage.get("cache_read_input_tokens", 0)
        prompt = usage["input_tokens"] + read + usage.get("cache_creation_input_tokens", 0)
        text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
        print(f"{turn + 1:4} {names.get(served, served):10} {read:>13} / {prompt:<11}")
        msgs.append({"role": "assistant", "content": text})


def responses_conversation(envoy, names: dict[str, str]) -> None:
    """Three streamed turns of the Responses API chained by
    `previous_response_id`: the engine keeps the stored response in its own
    memory, so each follow-up must reach the engine that produced the
    previous one (the indexer learned the id from the filter's report)."""
    print("\nResponses API, streamed, chained by previous_response_id (POST /v1/responses), tenant beta:")
    print(f"{'turn':4} {'response id':40} {'served by':10} {'cached / input tokens':>22}")
    instructions = system_prompt("beta") + " Answer as Beta's assistant on the Responses API."
    previous = None
    for turn, q in enumerate(QUESTIONS[:3]):
        body = {"model": h.MODEL, "instructions": instructions, "input": f"[responses] {q}",
                "max_output_tokens": 24, "stream": True}
        if previous:
            body["previous_response_id"] = previous
        served, events = stream_events(envoy, "/v1/responses", body, "beta")
        done = events[-1][1]["response"]
        u = done["usage"]
        print(f"{turn + 1:4} {done['id']:40} {names.get(served, served):10} "
              f"{u['input_tokens_details']['cached_tokens']:>8} / {u['input_tokens']:<11}")
        previous = done["id"]


def budget_burst(envoy, names: dict[str, str]) -> None:
    """beta's budget (envoy/policy.json: 600 requests a minute, 2 in flight)
    against a burst of 5 long streams sent at once, with one acme request
    alongside: beta's third to fifth are refused at the pick, in OpenAI's
    shape, while its first two and acme's run."""
    print("\nbudgets: tenant beta (at most 2 requests in flight) sends 5 long streams at once, acme 1:")
    results: dict[str, tuple] = {}

    def send(tag: str, tenant: str) -> None:
        body = {"model": h.MODEL, "stream": True, "max_tokens": 400,
                "messages": [{"role": "user", "content": f"[{tag}] Write a long report on arm calibration."}]}
        results[tag] = envoy.post("/v1/chat/completions", body, key=f"sk-{tenant}-demo")

    threads = [threading.Thread(target=send, args=(f"beta-{i}", "beta")) for i in range(5)]
    threads.append(threading.Thread(target=send, args=("acme-0", "acme")))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for tag in sorted(results):
        status, headers, raw = results[tag]
        rl = {k[len("x-ratelimit-"):]: v for k, v in headers.items() if k.startswith("x-ratelimit-")}
        if status == 200:
            served = headers.get("x-gateway-destination-endpoint-served", "?")
            print(f"  {tag:7} 200 served by {names.get(served, served):8} {rl or ''}")
        else:
            err = json.loads(raw).get("error", {})
            print(f"  {tag:7} {status} retry-after {headers.get('retry-after')}s  {err.get('code')}: {err.get('message')}")


def main() -> int:
    for p in (h.WASM, h.COMPILE, h.SIM_BIN, h.INDEXER_BIN, h.ENVOY_BIN):
        if not p.exists():
            print(f"missing {p}: run `make build`", file=sys.stderr)
            return 1
    logdir = Path(tempfile.mkdtemp(prefix="kvasir-demo-"))
    procs = h.Processes()

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        sims = [h.start_sim(logdir, f"vllm-{i}", profile="h100-8b", time_scale=TIME_SCALE) for i in range(3)]
        provider = h.start_sim(logdir, "provider", model="provider-model", profile="h100-8b", time_scale=TIME_SCALE)
        for x in sims + [provider]:
            procs.add(x)
        # Only the engines' HTTP addresses: the indexer reads where each one
        # publishes its KV events from its GET /kv_event_sources.
        indexer = procs.add(h.indexer_for(sims, logdir, events_from_engine=True))
        grpc_port, http_port = indexer.grpc_port, indexer.http_port
        policy = json.loads((REPO / "envoy" / "policy.json").read_text())
        plugin = h.compile_plugin(policy, {"exposeServedEndpoint": True, "bodyLimitBytes": 1048575})
        envoy = h.start_envoy(logdir, plugin, [s.address for s in sims], indexer.address, provider.address)
        procs.add(envoy)
        for s in sims + [provider]:
            h.wait_sim(s)
        indexer.start()
        h.wait_envoy(envoy, [s.address for s in sims])
        h.wait_until("indexer healthy in envoy", lambda: envoy.healthy("kvasir_indexer", [indexer.address]))
        names = {s.address: f"vllm-{i}" for i, s in enumerate(sims)}
        print(f"stack up: envoy http://127.0.0.1:{envoy.port} (admin :{envoy.admin}), "
              f"cache-indexer grpc :{grpc_port} http :{http_port}, "
              + ", ".join(f"{names[s.address]} :{s.port}" for s in sims)
              + f"  (logs: {logdir})\n")

        # 2 tenants x 3 conversations x 4 turns, turns of different
        # conversations interleaved as real traffic is.
        convs = [(t, c) for t in TENANTS for c in range(3)]
        history = {k: [{"role": "system", "content": system_prompt(k[0])}] for k in convs}
        total = len(convs) * len(QUESTIONS)
        done = 0
        sent = {t: 0 for t in TENANTS}
        print(f"{'tenant':6} {'conv':4} {'turn':4} {'served by':10} {'cached / prompt tokens':>24} {'latency':>8}")
        for turn, q in enumerate(QUESTIONS):
            for tenant, c in convs:
                msgs = history[(tenant, c)] + [{"role": "user", "content": f"[conversation {c}] {q}"}]
                body = {"model": h.MODEL, "messages": msgs, "max_tokens": 24}
                t0 = time.time()
                status, headers, raw = envoy.post("/v1/chat/completions", body, key=f"sk-{tenant}-demo")
                dt = time.time() - t0
                done += 1
                if status != 200:
                    print(f"{tenant:6} {c:4} {turn + 1:4} HTTP {status}: {raw[:200]!r}")
                    continue
                sent[tenant] += 1
                r = json.loads(raw)
                u = r["usage"]
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                served = headers.get("x-gateway-destination-endpoint-served", "?")
                print(f"{tenant:6} {c:4} {turn + 1:4} {names.get(served, served):10} "
                      f"{cached:>11} / {u['prompt_tokens']:<11} {dt * 1000:6.0f} ms   {progress(done, total)}")
                history[(tenant, c)] = msgs + [{"role": "assistant", "content": r["choices"][0]["message"]["content"]}]

        anthropic_conversation(envoy, names)
        responses_conversation(envoy, names)
        budget_burst(envoy, names)

        time.sleep(5.5)  # Envoy flushes histograms every 5 s
        print("\nper-tenant stats from Envoy admin /stats/prometheus:")
        for line in envoy.prometheus().splitlines():
            if line.startswith("#") or "tenant=" not in line:
                continue
            if "_bucket" in line:
                continue
            print("  " + line)
        print(f"\nchat requests sent: {sent}, plus 3 Messages turns (acme), 3 Responses turns (beta) and the burst; indexer picks: "
              f"{indexer.metric('kvasir_indexer_picks_total'):.0f}; "
              "the filter's own numbers are above, per tenant and model.")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the stack")
        return 130
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main())
