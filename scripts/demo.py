#!/usr/bin/env python3
"""`make demo`: what Kvasir changes, on a local stack, in about a minute.

The same multi-tenant, multi-turn, streamed chat workload runs twice on
four fresh vllm-sims (the h100-8b latency model, real time), at a load
where requests queue in the engines:

1. through a plain Envoy route with round-robin balancing (the shipped
   bootstrap without the Kvasir filter: what a Kubernetes Service does);
2. through Envoy with the Kvasir filter and the cache-indexer
   (envoy/policy.json: tenants `acme`, gold, and `beta`, free, with a
   budget of 2 requests in flight; flow control on the pool).

Then the policies act on a busy pool: a free tenant is shed, a gold
tenant's request bursts to the external provider unless it carries
personal data (the PII guard keeps it inside), a model alias is rewritten,
and beta's budget answers 429s. At the end: the two runs side by side
(TTFT, end-to-end, cached prompt tokens, engines used) and the per-tenant
stats the filter exported to Envoy's /stats/prometheus.

    .tools/venv/bin/python scripts/demo.py            # what `make demo` runs
    .tools/venv/bin/python scripts/demo.py --quick    # a smaller workload (the test's)

Every process binds 127.0.0.1 only and is stopped on exit or Ctrl-C. The
process plumbing (free ports, bounded waits, the bootstrap renderer) is the
end-to-end tests' harness; tests/e2e/test_dashboards.py runs this stack and
workload under Prometheus.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path
from typing import Any, Callable

import kvasir_harness as h  # harness/kvasir_harness: processes, ports, bounded waits, the launchers
from kvasir_harness import prom

REPO = Path(__file__).resolve().parents[1]
POLICY_FILE = REPO / "envoy" / "policy.json"
DASHBOARD = REPO / "deploy" / "grafana" / "kvasir.json"
IMAGES = REPO / "docs" / "images"
PLAYGROUND_PORT = 8640  # playground/playground.py's default
KEYS = {"acme": "sk-acme-demo", "beta": "sk-beta-demo"}  # envoy/policy.json's key hashes
ENGINES = 4
PROFILE = "h100-8b"
TIME_SCALE = 1.0
# Engines batch at most this many sequences, and prefill at most this many
# tokens a step (vLLM's chunked prefill): concurrent long prompts queue for
# prefill steps, which is where round-robin's TTFT goes.
MAX_NUM_SEQS = 16
MAX_BATCHED_TOKENS = 2048
# The indexer counts an engine saturated at this many waiting requests.
SATURATED_WAITING = 3
# Flow control on the pool: while every engine is saturated, picks wait in
# the indexer (fair share by tenant weight) up to this long.
FLOW = {"enabled": True, "threshold": 1.0, "maxWaitMs": 4000}
REQUEST_DEADLINE_S = 60.0
# Envoy's worker threads: each runs its own copy of the filter, which
# learns the pool's saturation from its own PoolState polls, every
# POLL_MS (the shipped default is 1000; shorter here so that the policies
# see a busy pool a fraction of a second after it is busy).
ENVOY_WORKERS = 2
POLL_MS = 250
SETTINGS = {"exposeServedEndpoint": True, "bodyLimitBytes": 1048575, "poolStatePollMs": POLL_MS}


# ---------------------------------------------------------------------------
# The workload
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    conversations: dict[str, int]  # per tenant
    turns: int
    system_words: int  # the tenant's system prompt, shared by its conversations
    doc_words: int  # each conversation's own document, in its first message
    user_words: int  # each later question
    output_tokens: int
    think_s: float  # mean pause between a reply and the next turn
    spread_s: float  # conversations start over this long


FULL = Shape({"acme": 40, "beta": 2}, turns=5, system_words=1000, doc_words=4000, user_words=30, output_tokens=40,
             think_s=0.5, spread_s=3.0)
QUICK = Shape({"acme": 4, "beta": 2}, turns=3, system_words=600, doc_words=1500, user_words=20, output_tokens=24,
              think_s=0.3, spread_s=1.5)

WORDS = ("robot arm joint torque sensor calibration warranty service firmware gearbox encoder servo payload "
         "controller safety fence teach pendant cycle time spindle lubricant bearing alarm reset axis limit "
         "protein fold sample assay buffer enzyme kinetics binding site residue helix sheet loop solvent").split()
QUESTIONS = ["What does the document say about {w}?", "Which steps depend on the {w}?",
             "Summarise the part about the {w} in two sentences.", "What should I check first on the {w}?",
             "Is anything about the {w} risky?", "List three facts about the {w}."]
TENANT_INTRO = {
    "acme": "You are Acme Corp's support assistant. Acme sells industrial robots.",
    "beta": "You are Beta Labs' research assistant. Beta Labs studies protein folding.",
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Conversation:
    tenant: str
    index: int
    start_s: float
    system: str
    turns: list[str]
    thinks: list[float]


def conversations(shape: Shape, seed: int = 7) -> list[Conversation]:
    """The same conversations every run (seeded)."""
    rng = random.Random(seed)
    out = []
    for tenant, n in shape.conversations.items():
        system = TENANT_INTRO[tenant] + " " + words(random.Random(tenant), shape.system_words)
        for i in range(n):
            doc = f"[{tenant} case {i}] Read this document, then answer.\n" + words(rng, shape.doc_words)
            qs = [doc] + [rng.choice(QUESTIONS).format(w=rng.choice(WORDS)) + " " + words(rng, shape.user_words)
                          for _ in range(shape.turns - 1)]
            thinks = [rng.expovariate(1 / shape.think_s) for _ in range(shape.turns)]
            out.append(Conversation(tenant, i, rng.uniform(0, shape.spread_s), system, qs, thinks))
    return sorted(out, key=lambda c: c.start_s)


@dataclass
class Result:
    """One request as the client saw it."""

    tenant: str
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    served: str = ""
    model: str = ""
    text: str = ""
    retry_after_s: float | None = None
    error: str = ""
    headers: dict[str, str] = field(default_factory=dict)


def stream_chat(port: int, key: str, body: dict[str, Any], timeout: float = REQUEST_DEADLINE_S,
                tenant: str = "") -> Result:
    """POSTs a streamed chat completion through Envoy and reads its SSE
    stream: time to the first token, to the last byte, usage, who served."""
    t0 = time.monotonic()
    c = HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/chat/completions", body=json.dumps(body),
                  headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
        r = c.getresponse()
        hs = {k.lower(): v for k, v in r.getheaders()}
        res = Result(tenant, r.status, served=hs.get("x-gateway-destination-endpoint-served", ""), headers=hs)
        if r.status != 200:
            raw = r.read()
            try:
                err = json.loads(raw).get("error", {})
                res.error = f"{err.get('code') or err.get('type')}: {err.get('message')}"
            except (ValueError, AttributeError):
                res.error = raw[:200].decode(errors="replace")
            if "retry-after" in hs:
                res.retry_after_s = float(hs["retry-after"])
            return res
        buf, text = b"", []
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if not data or data == b"[DONE]":
                    continue
                ev = json.loads(data)
                res.model = ev.get("model", res.model)
                for ch in ev.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        if res.ttft_s is None:
                            res.ttft_s = time.monotonic() - t0
                        text.append(piece)
                u = ev.get("usage")
                if u:
                    res.prompt_tokens = u.get("prompt_tokens", 0)
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        res.e2e_s = time.monotonic() - t0
        res.text = "".join(text)
        return res
    except OSError as e:
        return Result(tenant, 0, error=str(e))
    finally:
        c.close()


def run_workload(port: int, convs: list[Conversation], shape: Shape, on_done: Callable[[], None] = lambda: None,
                 retries: int = 4) -> list[Result]:
    """Every conversation in its own thread, turn after turn with a pause
    between; a 429 is retried after its Retry-After (at most 3 s here,
    `retries` times), as a client does. Returns every attempt."""
    results: list[Result] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def converse(cv: Conversation) -> None:
        time.sleep(max(0.0, cv.start_s - (time.monotonic() - t0)))
        msgs = [{"role": "system", "content": cv.system}]
        for turn, question in enumerate(cv.turns):
            msgs.append({"role": "user", "content": question})
            body = {"model": h.MODEL, "messages": msgs, "max_tokens": shape.output_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            for attempt in range(retries + 1):
                r = stream_chat(port, KEYS[cv.tenant], body, tenant=cv.tenant)
                with lock:
                    results.append(r)
                if r.status != 429 or attempt == retries:
                    break
                time.sleep(min(r.retry_after_s or 1.0, 3.0))
            on_done()
            if r.status != 200:
                return  # the conversation ends with its failed turn
            msgs.append({"role": "assistant", "content": r.text})
            time.sleep(cv.thinks[turn])

    threads = [threading.Thread(target=converse, args=(cv,), daemon=True) for cv in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_DEADLINE_S * (shape.turns + 1))
    return results


def progress(done: int, total: int, width: int = 30) -> str:
    n = width * min(done, total) // max(total, 1)
    return f"[{'#' * n}{'.' * (width - n)}] {done}/{total}"


# ---------------------------------------------------------------------------
# The stacks
# ---------------------------------------------------------------------------


def demo_policy() -> dict[str, Any]:
    """envoy/policy.json with flow control on its pool (the filter then
    allows a pick `indexerTimeoutMs + maxWaitMs`)."""
    p = json.loads(POLICY_FILE.read_text())
    p["pools"][0]["flowControl"] = dict(FLOW)
    return p


@dataclass
class Stack:
    kind: str
    envoy: h.Envoy
    sims: list[h.Sim]
    provider: h.Sim
    indexer: h.Indexer | None
    logdir: Path

    @property
    def names(self) -> dict[str, str]:
        n = {s.address: f"vllm-{i}" for i, s in enumerate(self.sims)}
        n[self.provider.address] = "provider"
        return n


def indexer_config(sims: list[h.Sim], logdir: Path, name: str, budgets: dict[str, Any] | None = None) -> h.Indexer:
    """A cache-indexer from a config file: pool `main` over `sims` (each
    engine's KV-event sockets read from its /kv_event_sources), flow
    control as the policy's pool, and optionally `budgets` (e.g. a Redis
    store)."""
    pool = {"name": "main", "model": h.MODEL, "tokenizer": str(h.TOKENIZER),
            "scrape": {"intervalMs": 100, "timeoutMs": 100},
            "saturation": {"waiting": SATURATED_WAITING},
            "flowControl": dict(FLOW),
            "endpoints": [{"address": s.address} for s in sims]}
    cfg: dict[str, Any] = {"pools": [pool]}
    if budgets:
        cfg["budgets"] = budgets
    path = logdir / f"{name}.json"
    path.write_text(json.dumps(cfg, indent=1))
    grpc_port, http_port = h.free_port(), h.free_port()
    argv = [str(h.INDEXER_BIN), "--config", str(path), "--grpc-addr", f"127.0.0.1:{grpc_port}",
            "--http-addr", f"127.0.0.1:{http_port}", "--grpc-token-file", str(h.secrets_for(logdir).token_file)]
    return h.Indexer(None, grpc_port, http_port, argv, logdir)


def start_stack(kind: str, logdir: Path, procs: h.Processes, budgets: dict[str, Any] | None = None,
                engines: int = ENGINES) -> Stack:
    """Fresh engines (empty caches) and an Envoy in front of them:
    `round-robin` (no filter, Envoy's round-robin) or `kvasir` (the filter
    and an indexer)."""
    sims = [h.start_sim(logdir, f"{kind}-vllm-{i}", profile=PROFILE, time_scale=TIME_SCALE,
                        extra=["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]) for i in range(engines)]
    provider = h.start_sim(logdir, f"{kind}-provider", model="provider-model", profile=PROFILE, time_scale=TIME_SCALE)
    for s in sims + [provider]:
        procs.add(s)
    addrs = [s.address for s in sims]
    plugin = h.compile_plugin(demo_policy(), SETTINGS)
    indexer = None
    if kind == "kvasir":
        indexer = indexer_config(sims, logdir, "cache-indexer", budgets)
        envoy = h.start_envoy(logdir, plugin, addrs, indexer.address, provider.address, name=f"{kind}-envoy",
                              concurrency=ENVOY_WORKERS)
    else:
        # The same bootstrap without the filter: the pool cluster balanced
        # round-robin, the upstream reported in the same response header.
        envoy = h.start_envoy(logdir, plugin, addrs, "127.0.0.1:9", provider.address, name=f"{kind}-envoy",
                              without_filter=True, pool_lb="round_robin", concurrency=ENVOY_WORKERS)
    procs.add(envoy)
    for s in sims + [provider]:
        h.wait_sim(s)
    if indexer is not None:
        indexer.start()
        procs.add(indexer)
    h.wait_envoy(envoy, addrs)
    if indexer is not None:
        h.wait_until("indexer healthy in envoy", lambda: envoy.healthy("kvasir_indexer", [indexer.address]))
    return Stack(kind, envoy, sims, provider, indexer, logdir)


def run_comparison_side(kind: str, logdir: Path, procs: h.Processes, shape: Shape, convs: list[Conversation],
                        quiet: bool = False, budgets: dict[str, Any] | None = None) -> tuple[Stack, list[Result], float]:
    t0 = time.monotonic()
    st = start_stack(kind, logdir, procs, budgets=budgets)
    total = sum(len(c.turns) for c in convs)
    done = [0]
    lock = threading.Lock()

    tty = sys.stdout.isatty()

    def tick() -> None:
        with lock:
            done[0] += 1
            if tty and not quiet:
                print(f"\r  {kind:12} {progress(done[0], total)}", end="", flush=True)

    w0 = time.monotonic()
    res = run_workload(st.envoy.port, convs, shape, tick)
    wall = time.monotonic() - w0
    if not quiet:
        print(f"\r  {kind:12} {progress(done[0], total)}  {wall:.1f} s (stack up in {w0 - t0:.1f} s)", flush=True)
    return st, res, wall


# ---------------------------------------------------------------------------
# The policies on a busy pool
# ---------------------------------------------------------------------------


class Holder:
    """A long stream held open until `release()` (closing the connection
    cancels it upstream, as a client that goes away does)."""

    def __init__(self, port: int, key: str, body: dict[str, Any]):
        self.c = HTTPConnection("127.0.0.1", port, timeout=REQUEST_DEADLINE_S)
        self.status = 0
        self.t = threading.Thread(target=self._run, args=(key, body), daemon=True)
        self.t.start()

    def _run(self, key: str, body: dict[str, Any]) -> None:
        try:
            self.c.request("POST", "/v1/chat/completions", body=json.dumps(body),
                           headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
            r = self.c.getresponse()
            self.status = r.status
            while r.read1(65536):
                pass
        except Exception:  # noqa: BLE001 - released: the read ends however it ends
            pass

    def release(self) -> None:
        try:
            if self.c.sock is not None:
                self.c.sock.shutdown(2)
        except OSError:
            pass
        self.c.close()
        self.t.join(timeout=10)


def holders_needed(st: Stack) -> int:
    """Streams that fill every engine's batch and queue it past the
    indexer's saturation threshold."""
    return len(st.sims) * (MAX_NUM_SEQS + SATURATED_WAITING + 1)


def saturate(st: Stack) -> list[Holder]:
    """Long streams until every engine has a queue: the pool is saturated
    in the indexer's view until they are released. They are acme's, on the
    model alias `gpt-4o-mini`, which policy gpt-alias routes to the pool
    whatever its state (burst-to-provider would send the later ones out)."""
    out = []
    for i in range(holders_needed(st)):
        body = {"model": "gpt-4o-mini", "max_tokens": 4000,
                "messages": [{"role": "user", "content": f"Write a very long report on arm calibration, part {i}."}]}
        out.append(Holder(st.envoy.port, KEYS["acme"], body))
    return out


def pool_saturation(st: Stack) -> float:
    return prom.total(st.envoy.prometheus(), "kvasir_pool_saturation_permille", pool="main") / 1000


def wait_filter_sees(st: Stack, what: str, busy: bool) -> None:
    """Until every worker's filter has seen the pool busy (or idle): the
    gauge is the last value any worker learned, so after it first shows
    the state, until enough polls have come back that each worker has
    made one since (2 per worker; they poll at the same period)."""
    polls = lambda: prom.total(st.envoy.prometheus(), "kvasir_pool_state_poll", pool="main", result="ok")  # noqa: E731
    seen = (lambda s: s >= 0.99) if busy else (lambda s: s < 0.5)
    h.wait_until(what, lambda: seen(pool_saturation(st)), timeout=30, interval=0.05)
    first = polls()
    h.wait_until(f"{what}: every worker polled since", lambda: polls() >= first + 2 * ENVOY_WORKERS
                 and seen(pool_saturation(st)), timeout=10 + 4 * ENVOY_WORKERS * POLL_MS / 1000, interval=0.05)


def wait_stats_flushed(envoy: h.Envoy, timeout: float = 20) -> None:
    """Until Envoy's histograms hold every 2xx response its counters hold
    (counters are current; histograms are merged at each stats flush, 5 s
    by default)."""
    def flushed() -> bool:
        text = envoy.prometheus()
        return prom.total(text, "kvasir_tenant_model_e2e_ms_count") >= prom.total(
            text, "kvasir_tenant_model_responses", **{"class": "2xx"}) > 0

    h.wait_until("Envoy's stats flush (histograms)", flushed, timeout=timeout, interval=0.2)


def policies_at_work(st: Stack) -> list[tuple[str, str, str]]:
    """Each policy acting, with what the client saw: (what, outcome, why)."""
    names = st.names
    rows: list[tuple[str, str, str]] = []
    ask = lambda tenant, content, model=h.MODEL, max_tokens=8: stream_chat(  # noqa: E731
        st.envoy.port, KEYS[tenant], {"model": model, "stream": True, "max_tokens": max_tokens,
                                      "messages": [{"role": "user", "content": content}]}, tenant=tenant)

    def served(r: Result) -> str:
        if r.status != 200:
            ra = f", Retry-After {r.retry_after_s:.0f} s" if r.retry_after_s is not None else ""
            return f"HTTP {r.status}{ra}"
        return f"200 from {names.get(r.served, r.served or '?')}" + (f" as {r.model}" if r.model else "")

    # A model alias, on an idle pool.
    r = ask("acme", "Hello! Which model are you?", model="gpt-4o-mini")
    rows.append(("acme asks for model gpt-4o-mini", served(r), "policy gpt-alias rewrote the model"))

    holders = saturate(st)
    try:
        wait_filter_sees(st, "the pool saturated in the filter's view", busy=True)
        r = ask("beta", "Quick question about folding, please.")
        rows.append(("beta (free) while the pool is busy", served(r), f"policy shed-free-when-busy ({r.error})"))
        r = ask("acme", "Summarise our robot arm's warranty terms.")
        rows.append(("acme (gold) while the pool is busy", served(r), "policy burst-to-provider"))
        # The same with personal data: kept on our engines, where it waits
        # in the pool's queue (flow control) until the long streams end.
        pii: list[Result] = []
        t = threading.Thread(target=lambda: pii.append(ask(
            "acme", "Summarise the warranty for jane.doe@example.com, card 4111 1111 1111 1111.")), daemon=True)
        t.start()
        h.wait_until("the PII request queued in the indexer",
                     lambda: prom.total(st.indexer.metrics_text(), "kvasir_indexer_flow_queue_length") >= 1,
                     timeout=10, interval=0.05)
    finally:
        for x in holders:
            x.release()
    t.join(timeout=REQUEST_DEADLINE_S)
    r = pii[0] if pii else Result("acme", 0, error="no answer")
    rows.append(("acme, the same with an e-mail and a card number", served(r),
                 "PII guard keep-pii-inside: kept on our engines, queued until one had room"))
    wait_filter_sees(st, "the pool idle again in the filter's view", busy=False)

    # beta's budget: 2 requests in flight at most.
    out: dict[int, Result] = {}

    def burst(i: int) -> None:
        out[i] = ask("beta", f"[{i}] A long answer on enzyme kinetics, please.", max_tokens=200)

    ts = [threading.Thread(target=burst, args=(i,)) for i in range(5)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=REQUEST_DEADLINE_S)
    ok = sum(1 for r in out.values() if r.status == 200)
    limited = [r for r in out.values() if r.status == 429]
    # "rate_limit_exceeded: Rate limit reached for tenant `beta` on
    # concurrent requests: Please try again in 1s." -> its first sentence.
    why = limited[0].error.split(": ", 1)[-1].split(":")[0] if limited else "no 429"
    rows.append(("beta sends 5 streams at once (budget: 2 in flight)", f"{ok} x 200, {len(limited)} x 429",
                 f"budget: {why}"))
    return rows


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def kilo(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def side(results: list[Result], names: dict[str, str]) -> dict[str, str]:
    ok = [r for r in results if r.status == 200]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per: dict[str, int] = {}
    for r in ok:
        n = names.get(r.served, r.served or "?")
        per[n] = per.get(n, 0) + 1
    engines = [per.get(n, 0) for n in sorted(v for v in names.values() if v.startswith("vllm-"))]
    limited = sum(1 for r in results if r.status == 429)
    failed = sum(1 for r in results if r.status not in (200, 429))
    return {
        "requests served (200)": f"{len(ok)}",
        "TTFT p50": ms(pct(ttft, 0.5)),
        "TTFT p90": ms(pct(ttft, 0.9)),
        "TTFT p99": ms(pct(ttft, 0.99)),
        "end-to-end p50": ms(pct(e2e, 0.5)),
        "end-to-end p99": ms(pct(e2e, 0.99)),
        "prompt tokens cached": f"{100 * cached / prompt:.0f}% ({kilo(cached)} of {kilo(prompt)})" if prompt else "-",
        "engines used (requests each)": f"{sum(1 for x in engines if x)} ({' / '.join(map(str, engines))})",
        "answered 429 (then retried)": f"{limited}",
        "failed": f"{failed}",
    }


def table(rows: list[list[str]], head: list[str], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(head)))
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).rjust(w[i]) if i in right else str(c).ljust(w[i])  # noqa: E731
                              for i, c in enumerate(r)).rstrip()
    return "\n".join([fmt(head), "  ".join("-" * x for x in w)] + [fmt(r) for r in rows])


def comparison(rr: list[Result], rr_names: dict[str, str], kv: list[Result], kv_names: dict[str, str]) -> str:
    a, b = side(rr, rr_names), side(kv, kv_names)
    return table([[k, a[k], b[k]] for k in a], ["same workload", "round-robin", "Kvasir"])


def hist_quantile(samples: list[prom.Sample], q: float) -> float | None:
    """A quantile from Prometheus histogram buckets (cumulative `le`
    counts), linearly interpolated inside the bucket as PromQL's
    histogram_quantile does."""
    per_le: dict[float, float] = {}
    for s in samples:  # summed over the other labels (models)
        le = float(s.labels["le"])
        per_le[le] = per_le.get(le, 0.0) + s.value
    b = sorted(per_le.items())
    if not b or b[-1][1] == 0:
        return None
    rank = q * b[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in b:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0)
        prev_le, prev_c = le, c
    return prev_le


def tenant_stats(text: str) -> str:
    """The filter's per-tenant stats (Envoy's /stats/prometheus), as a
    table: requests by what the filter did, 429s, tokens, latencies."""
    samples = [s for f in prom.parse(text) for s in f.samples if s.labels.get("tenant") not in (None, "unknown")]
    tenants = sorted({s.labels["tenant"] for s in samples})

    def tot(name: str, tenant: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and s.labels["tenant"] == tenant
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    def hq(name: str, tenant: str, q: float) -> str:
        v = hist_quantile([s for s in samples if s.name == f"{name}_bucket" and s.labels["tenant"] == tenant], q)
        return "-" if v is None else (f"{v:.0f} ms" if v < 1000 else f"{v / 1000:.2f} s")

    rows = []
    for t in tenants:
        dec = lambda d: tot("kvasir_tenant_model_requests", t, decision=d)  # noqa: E731
        cached = tot("kvasir_tenant_model_prompt_tokens", t, cache="cached")
        uncached = tot("kvasir_tenant_model_prompt_tokens", t, cache="uncached")
        waits = tot("kvasir_tenant_model_queue_wait_ms_count", t)
        rows.append([
            t,
            f"{dec('route'):.0f}", f"{dec('provider'):.0f}", f"{dec('shed') + tot('kvasir_tenant_model_shed', t):.0f}",
            f"{tot('kvasir_tenant_model_rate_limited', t):.0f}",
            f"{kilo(cached)} / {kilo(uncached)}",
            kilo(tot("kvasir_tenant_model_completion_tokens", t)),
            hq("kvasir_tenant_model_ttft_ms", t, 0.5), hq("kvasir_tenant_model_ttft_ms", t, 0.99),
            hq("kvasir_tenant_model_e2e_ms", t, 0.5),
            f"{waits:.0f}", f"{tot('kvasir_tenant_model_failopen', t):.0f}",
        ])
    head = ["tenant", "routed", "to provider", "shed", "rate-limited", "prompt tok cached / uncached",
            "completion tok", "TTFT p50", "TTFT p99", "e2e p50", "queued", "fail-open"]
    return table(rows, head)


# ---------------------------------------------------------------------------


def check_built() -> bool:
    ok = True
    for p in (h.WASM, h.COMPILE, h.SIM_BIN, h.INDEXER_BIN, h.ENVOY_BIN):
        if not p.exists():
            print(f"missing {p}: run `make build`", file=sys.stderr)
            ok = False
    return ok


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller workload (what tests/e2e/test_demo.py runs)")
    a = ap.parse_args(argv)
    if not check_built():
        return 1
    shape = QUICK if a.quick else FULL
    convs = conversations(shape)
    logdir = Path(tempfile.mkdtemp(prefix="kvasir-demo-"))
    t_start = time.monotonic()

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        n_req = sum(len(c.turns) for c in convs)
        print(f"Kvasir demo: {len(convs)} streamed conversations ("
              + ", ".join(f"{n} of tenant {t}" for t, n in shape.conversations.items())
              + f"), {shape.turns} turns each, {n_req} requests; each starts with a ~{shape.system_words + shape.doc_words}"
              f"-word prompt (the tenant's system prompt and the conversation's document) and grows turn by turn.\n"
              f"{ENGINES} vllm-sims ({PROFILE} latency model, real time, at most {MAX_NUM_SEQS} sequences batched "
              f"each), fresh for each run. Logs: {logdir}\n")
        print("1. the workload through a plain Envoy route, round-robin, then through Kvasir:")
        with h.Processes() as procs:
            rr_stack, rr, _ = run_comparison_side("round-robin", logdir, procs, shape, convs)
            rr_names = rr_stack.names
        with h.Processes() as procs:
            kv_stack, kv, _ = run_comparison_side("kvasir", logdir, procs, shape, convs)
            print(f"\n   Kvasir stack: Envoy http://127.0.0.1:{kv_stack.envoy.port} (admin "
                  f"http://127.0.0.1:{kv_stack.envoy.admin}/stats/prometheus), cache-indexer "
                  f"http://127.0.0.1:{kv_stack.indexer.http_port}/metrics")
            print("\n2. the policies on the same stack (envoy/policy.json):")
            rows = policies_at_work(kv_stack)
            print(table([list(r) for r in rows], ["request", "answer", "why"], right=set()))

            wait_stats_flushed(kv_stack.envoy)
            print("\n3. per tenant, from the filter's stats (Envoy admin /stats/prometheus; latencies from its "
                  "histograms, prompt and completion tokens as the engines reported them):")
            print(tenant_stats(kv_stack.envoy.prometheus()))
            print(f"   (acme's routed requests include the {holders_needed(kv_stack)} long streams that kept the "
                  "pool busy in 2, cancelled there: they count in no latency)")
            kv_names = kv_stack.names

        print("\n4. the two runs side by side (client-side: time to the first token, to the last byte; "
              "cached tokens from each response's usage):")
        print(comparison(rr, rr_names, kv, kv_names))
        print(f"\nDone in {time.monotonic() - t_start:.0f} s. Next:\n"
              f"  playground  http://127.0.0.1:{PLAYGROUND_PORT}/ after `make playground`: these policies in your "
              "browser (validate, compile, explain)\n"
              f"  dashboard   {DASHBOARD.relative_to(REPO)}: import it into Grafana; deploy/prometheus/ scrapes "
              "Envoy, the indexer and the controller and has the alerts;\n"
              f"              its panels on a run like this one: {IMAGES.relative_to(REPO)}/dashboard-*.png "
              "(`make dashboards`; docs/operations.md#dashboards-and-alerts)")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the stack")
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
