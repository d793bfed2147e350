"""Multi-tenant governance end to end: token budgets reserved at
the pick and enforced by the cache-indexer, answered by the filter as 429s
in each API's own shape with OpenAI's `x-ratelimit-*` headers; flow control
holding picks in the indexer while the pool is saturated, releasing them
when an engine frees room (late binding) and shedding when the queue is
full; one budget enforced by two indexer replicas through Redis.

Each test runs its own small stack (real Envoy 1.40 with the built filter,
real cache-indexers, vllm-sims, redis-server), since budgets and queues are
state the shared stack's other tests must not see."""

from __future__ import annotations

import copy
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kvasir_harness import (KEYS, MODEL, POLICY, SETTINGS, TOKENIZER, Envoy, Indexer, Processes, compile_plugin,
                            free_port, secrets_for, start_envoy, start_redis, start_sim, wait_envoy, wait_sim,
                            wait_until)
from kvasir_harness.paths import INDEXER_BIN
from kvasir_harness.prom import total as prom_value
from kvasir_harness.sim import Sim

M = MODEL.replace("/", "_")


def policy(budgets: dict[str, dict[str, Any]] | None = None, flow: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stack's policy set with budgets on its tenants (`acme`, `beta`)
    and flow control on its pool."""
    p = copy.deepcopy(POLICY)
    for t in p["tenants"]:
        if budgets and t["name"] in budgets:
            t["budget"] = budgets[t["name"]]
    if flow is not None:
        p["pools"][0]["flowControl"] = flow
    return p


def indexer_with(sims: list[Sim], logdir: Path, name: str, pool: dict[str, Any] | None = None,
                 top: dict[str, Any] | None = None) -> Indexer:
    """A cache-indexer from a config file: pool `main` over `sims` (their
    KV-event sockets read from the engines), `pool`'s extra keys
    (flowControl, saturation) and `top`'s (budgets)."""
    main = {"name": "main", "model": MODEL, "tokenizer": str(TOKENIZER),
            "scrape": {"intervalMs": 100, "timeoutMs": 100},
            "endpoints": [{"address": s.address} for s in sims], **(pool or {})}
    cfg = {"pools": [main], **(top or {})}
    path = logdir / f"{name}.json"
    path.write_text(json.dumps(cfg))
    grpc_port, http_port = free_port(), free_port()
    argv = [str(INDEXER_BIN), "--config", str(path), "--grpc-addr", f"127.0.0.1:{grpc_port}",
            "--http-addr", f"127.0.0.1:{http_port}", "--grpc-token-file", str(secrets_for(logdir).token_file)]
    return Indexer(None, grpc_port, http_port, argv, logdir)


@dataclass
class Gov:
    envoys: list[Envoy]
    indexers: list[Indexer]
    sims: list[Sim]

    @property
    def envoy(self) -> Envoy:
        return self.envoys[0]


@contextmanager
def gov_stack(logdir: Path, name: str, pol: dict[str, Any], sims: int = 2, sim_extra: list[str] | None = None,
              profile: str = "zero", time_scale: float = 0, pool: dict[str, Any] | None = None,
              top: dict[str, Any] | None = None, replicas: int = 1) -> Iterator[Gov]:
    """`sims` engines, `replicas` indexers, and one Envoy per replica, each
    Envoy calling its own replica (so that a test decides which replica a
    request reaches)."""
    with Processes() as ps:
        engines = [start_sim(logdir, f"{name}-sim{i}", profile=profile, time_scale=time_scale, extra=sim_extra)
                   for i in range(sims)]
        for s in engines:
            ps.add(s.proc)
        idx = [indexer_with(engines, logdir, f"{name}-indexer{i}", pool, top) for i in range(replicas)]
        plugin = compile_plugin(pol, SETTINGS)
        addrs = [s.address for s in engines]
        envoys = [start_envoy(logdir, plugin, addrs, ix.address, engines[0].address, name=f"{name}-envoy{i}")
                  for i, ix in enumerate(idx)]
        for e in envoys:
            ps.add(e.proc)
        for s in engines:
            wait_sim(s)
        try:
            for ix in idx:
                ix.start()
            for e, ix in zip(envoys, idx):
                wait_envoy(e, addrs)
                wait_until("indexer healthy in envoy", lambda e=e, ix=ix: e.healthy("kvasir_indexer", [ix.address]))
            yield Gov(envoys, idx, engines)
        finally:
            for ix in idx:
                ix.stop()


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def ratelimit_headers(h: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in h.items() if k.startswith("x-ratelimit-")}


# ---------------------------------------------------------------------------
# Budgets
# ---------------------------------------------------------------------------


def test_a_tenant_over_its_budget_gets_429_with_headers_while_another_is_served(artifacts, logdir):
    """acme may make 2 requests a minute: both are served with the
    x-ratelimit headers counting down, the third gets OpenAI's 429 with
    Retry-After (about half a minute: one request's refill) and the same
    headers, its Anthropic request Anthropic's 429; beta, unbudgeted, is
    served all along without the headers."""
    pol = policy({"acme": {"requestsPerMinute": 2}})
    with gov_stack(logdir, "budget", pol) as g:
        remaining = []
        for i in range(2):
            status, h, b = g.envoy.post("/v1/chat/completions", chat(f"hello {i}", max_tokens=4))
            assert status == 200, b
            rl = ratelimit_headers(h)
            assert rl["x-ratelimit-limit-requests"] == "2", rl
            remaining.append(int(rl["x-ratelimit-remaining-requests"]))
        assert remaining == [1, 0], remaining

        status, h, b = g.envoy.post("/v1/chat/completions", chat("one too many", max_tokens=4))
        assert status == 429, b
        err = json.loads(b)["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests", err
        assert "acme" in err["message"], err
        retry = int(h["retry-after"])
        assert 1 <= retry <= 31, h
        rl = ratelimit_headers(h)
        assert rl["x-ratelimit-limit-requests"] == "2" and rl["x-ratelimit-remaining-requests"] == "0", rl
        assert rl["x-ratelimit-reset-requests"].endswith("s"), rl

        status, h, b = g.envoy.post("/v1/messages", {"model": MODEL, "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert status == 429, b
        body = json.loads(b)
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
        assert "retry-after" in h

        for i in range(3):
            status, h, b = g.envoy.post("/v1/chat/completions", chat(f"beta {i}", max_tokens=4), key="beta")
            assert status == 200, b
            assert ratelimit_headers(h) == {}, h

        ix = g.indexers[0]
        assert ix.metric("kvasir_indexer_budget_requests_total", tenant="acme", decision="limited") == 2
        assert ix.metric("kvasir_indexer_budget_requests_total", tenant="acme", decision="admitted") == 2
        assert g.envoy.stat(f"wasmcustom.kvasir.tenant.acme.model.{M}.rate_limited.requests") == 2


def test_a_token_budget_reserves_max_tokens_and_gives_back_what_was_not_used(artifacts, logdir):
    """acme has 3,000 tokens a minute. A request reserving 2,000 output
    tokens that uses 8 gives the rest back when it ends, so a second one
    fits; while a streamed one holds its reservation, another that does
    not fit is refused on tokens, with Retry-After."""
    pol = policy({"acme": {"tokensPerMinute": 3000}})
    with gov_stack(logdir, "tokens", pol, sims=1, profile="h100-8b", time_scale=1) as g:
        for i in range(3):
            status, h, b = g.envoy.post("/v1/chat/completions", chat(f"short {i}", max_tokens=2000),
                                        headers={"x-sim-output-tokens": "8"})
            assert status == 200, b
            assert json.loads(b)["usage"]["completion_tokens"] == 8
            left = int(ratelimit_headers(h)["x-ratelimit-remaining-tokens"])
            # Reserved: prompt + 2,000; settled to prompt + 8 at the end.
            assert left < 3000 - 2000 + 100 or i == 0, (i, left)

        # A long stream holds its 2,000-token reservation while it runs.
        out: dict[str, Any] = {}

        def long_stream() -> None:
            out["r"] = g.envoy.post("/v1/chat/completions", chat("long", max_tokens=2000, stream=True),
                                    headers={"x-sim-output-tokens": "300"})

        t = threading.Thread(target=long_stream)
        t.start()
        try:
            wait_until("the long stream is admitted",
                       lambda: g.indexers[0].metric("kvasir_indexer_budget_requests_total", tenant="acme",
                                                    decision="admitted") >= 4, timeout=10)
            status, h, b = g.envoy.post("/v1/chat/completions", chat("does not fit", max_tokens=2000))
            assert status == 429, b
            err = json.loads(b)["error"]
            assert err["type"] == "tokens" and err["code"] == "rate_limit_exceeded", err
            assert int(h["retry-after"]) >= 1
        finally:
            t.join(timeout=60)
        status, _, b = out["r"]
        assert status == 200, b


def test_two_indexer_replicas_with_redis_enforce_one_budget(artifacts, logdir):
    """Two Envoys, each calling its own indexer replica; both replicas keep
    budgets in one Redis. acme's 4 requests a minute are 4 across both,
    whichever replica a request reaches; beta is not limited."""
    with Processes() as ps:
        redis = start_redis(logdir, "gov-redis")
        ps.add(redis.proc)
        pol = policy({"acme": {"requestsPerMinute": 4}})
        top = {"budgets": {"store": "redis", "redisUrl": redis.url}}
        with gov_stack(logdir, "replicas", pol, top=top, replicas=2) as g:
            results = []
            for i in range(10):
                status, _, b = g.envoys[i % 2].post("/v1/chat/completions", chat(f"r{i}", max_tokens=4))
                assert status in (200, 429), b
                results.append(status)
            assert results.count(200) == 4, results
            admitted = [ix.metric("kvasir_indexer_budget_requests_total", tenant="acme", decision="admitted")
                        for ix in g.indexers]
            assert sum(admitted) == 4 and all(a >= 1 for a in admitted), admitted
            for i in range(4):
                status, _, b = g.envoys[i % 2].post("/v1/chat/completions", chat(f"b{i}", max_tokens=4), key="beta")
                assert status == 200, b


# ---------------------------------------------------------------------------
# Flow control
# ---------------------------------------------------------------------------


FLOW = {"enabled": True, "threshold": 1.0, "maxQueued": 1, "maxQueuedPerTenant": 1, "maxWaitMs": 20000}


def test_a_queued_request_is_released_and_served_and_a_full_queue_sheds(artifacts, logdir):
    """One engine that runs one sequence at a time and counts as saturated
    with one request waiting. Two long streams fill it (one running, one
    waiting); the next request waits in the indexer's queue, not the
    engine's; the one after finds the queue (one place) full and is shed
    with a 429; once the streams end, the queued request is released and
    served, its wait counted."""
    pol = policy(flow=FLOW)
    pool = {"flowControl": FLOW, "saturation": {"waiting": 1}}
    with gov_stack(logdir, "flow", pol, sims=1, sim_extra=["--max-num-seqs", "1"], profile="h100-8b",
                   time_scale=1, pool=pool) as g:
        ix = g.indexers[0]
        done: dict[str, Any] = {}

        def send(tag: str, tokens: int, key: str = "acme") -> None:
            done[tag] = g.envoy.post("/v1/chat/completions", chat(f"{tag} please", max_tokens=tokens),
                                     key=key, headers={"x-sim-output-tokens": str(tokens)})

        long = [threading.Thread(target=send, args=(f"long{i}", 250)) for i in range(2)]
        for t in long:
            t.start()
            time.sleep(0.3)
        queued = threading.Thread(target=send, args=("queued", 4, "beta"))
        try:
            wait_until("the engine is saturated",
                       lambda: g.sims[0].metric("vllm:num_requests_waiting") >= 1, timeout=10)
            queued.start()
            wait_until("a pick waits in the indexer",
                       lambda: ix.metric("kvasir_indexer_flow_queue_length") >= 1, timeout=10)
            t0 = time.monotonic()
            status, h, b = g.envoy.post("/v1/chat/completions", chat("shed me", max_tokens=4))
            assert status == 429, b
            err = json.loads(b)["error"]
            assert err["code"] == "shed", err
            assert time.monotonic() - t0 < 5
        finally:
            for t in long:
                t.join(timeout=60)
            queued.join(timeout=60)
        for tag in ("long0", "long1", "queued"):
            status, _, b = done[tag]
            assert status == 200, (tag, b)
        assert ix.metric("kvasir_indexer_flow_released_total") >= 1
        assert ix.metric("kvasir_indexer_flow_shed_total", cause="pool_full") + \
            ix.metric("kvasir_indexer_flow_shed_total", cause="tenant_full") >= 1
        # The queued request waited for the long streams: about one
        # stream's length (250 tokens at the h100-8b profile's pace), in
        # the indexer's histogram and in the filter's per-tenant one.
        waited = ix.metric("kvasir_indexer_flow_queue_wait_seconds_sum", pool="main")
        assert ix.metric("kvasir_indexer_flow_queue_wait_seconds_count", pool="main") >= 1
        assert waited >= 0.5, waited
        # (Envoy's histograms reach its Prometheus text at its stats flush.)
        wait_until("the filter's queue-wait histogram", lambda: prom_value(
            g.envoy.prometheus(), "kvasir_tenant_model_queue_wait_ms_count", tenant="beta") == 1, timeout=20)
        text = g.envoy.prometheus()
        assert prom_value(text, "kvasir_tenant_model_queue_wait_ms_sum", tenant="beta") >= 500, text
        assert prom_value(text, "kvasir_tenant_model_queue_wait_ms_count", tenant="acme") == 0


def test_engine_priority_puts_the_tenant_over_its_share_behind_the_others_in_the_engine(artifacts, logdir):
    """The pool's `enginePriority` with one engine at vLLM's
    `--scheduling-policy priority` running one sequence at a time (flow
    control never holds a pick: the engine is never saturated by its
    rule). acme's long stream runs, beta's short request waits in the
    engine; then acme (over its share of the work in flight) sends a
    request asking for priority -100 in its body and header, and beta one
    whose body priority is not even a number. The filter replaces both
    with the pick's engine priority in the pick's callback (the body was
    buffered then), so the engine accepts beta's and serves it before
    acme's, which first come first served would not."""
    flow = {"enabled": True, "threshold": 1.0, "reserve": 0.0, "enginePriority": True, "maxWaitMs": 20000}
    pol = policy(flow={k: v for k, v in flow.items() if k != "enginePriority"})
    pool = {"flowControl": flow, "saturation": {"waiting": 64}}
    with gov_stack(logdir, "prio", pol, sims=1, profile="h100-8b", time_scale=1, pool=pool,
                   sim_extra=["--max-num-seqs", "1", "--scheduling-policy", "priority"]) as g:
        done: dict[str, tuple[float, int, bytes]] = {}

        def send(tag: str, key: str, tokens: int, **extra: Any) -> None:
            headers = {"x-sim-output-tokens": str(tokens), **extra.pop("headers", {})}
            status, _, b = g.envoy.post("/v1/chat/completions", chat(f"{tag} please", max_tokens=tokens, **extra),
                                        key=key, headers=headers)
            done[tag] = (time.monotonic(), status, b)

        threads = []

        def start(tag: str, key: str, tokens: int, **extra: Any) -> None:
            t = threading.Thread(target=send, args=(tag, key, tokens), kwargs=extra)
            t.start()
            threads.append(t)

        try:
            start("long", "acme", 600)
            wait_until("the long stream runs", lambda: g.sims[0].metric("vllm:num_requests_running") >= 1, timeout=10)
            start("beta-first", "beta", 4)
            wait_until("beta waits in the engine",
                       lambda: g.sims[0].metric("vllm:num_requests_waiting") >= 1, timeout=10)
            start("acme-jump", "acme", 4, priority=-100, headers={"x-vllm-priority": "-100"})
            wait_until("acme's waits too", lambda: g.sims[0].metric("vllm:num_requests_waiting") >= 2, timeout=10)
            start("beta-second", "beta", 4, priority="high")
        finally:
            for t in threads:
                t.join(timeout=60)
        for tag in ("long", "beta-first", "acme-jump", "beta-second"):
            assert done[tag][1] == 200, (tag, done[tag][2])
        assert done["beta-second"][0] < done["acme-jump"][0], {k: v[0] for k, v in done.items()}
        assert g.envoy.stat("wasmcustom.kvasir.pool.main.engine_priority") == 4
