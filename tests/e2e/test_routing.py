"""Cache-aware routing through the real stack: Envoy + filter -> Pick on the
cache-indexer -> override-host LB -> the vllm-sim that holds the prefix.
Which endpoint served is read from `x-gateway-destination-endpoint-served`
(the filter adds it with `exposeServedEndpoint`) and cross-checked with the
sims' own metrics and `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from kvasir_harness import MODEL, POLICY, SETTINGS, chat, compile_plugin, request, start_envoy, wait_envoy, wait_until
from conftest import Stack

SERVED = "x-gateway-destination-endpoint-served"


def long_system(tag: str, words: int = 300) -> str:
    # Unique per conversation so earlier tests' caches do not interfere.
    return f"[{tag}] " + " ".join(f"rule{i % 37} of the {tag} house style" for i in range(words // 6))


def converse(stack: Stack, tag: str, turns: int, key: str = "acme") -> list[tuple[str, int, int]]:
    msgs = [{"role": "system", "content": long_system(tag)}]
    out = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"{tag} question {t}: what about item {t * 13}?"})
        status, h, b = stack.envoy.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 6}, key=key)
        assert status == 200, b
        r = json.loads(b)
        out.append((h[SERVED], r["usage"]["prompt_tokens"], r["usage"]["prompt_tokens_details"]["cached_tokens"]))
        msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return out


def test_multi_turn_chat_stays_on_the_endpoint_holding_its_prefix(stack: Stack):
    stack.need_indexer()
    ok_before = stack.envoy.stat("wasmcustom.kvasir.pool.main.pick.ok")
    for conv in range(3):
        turns = converse(stack, f"sticky-{conv}-{uuid.uuid4().hex[:6]}", 4)
        served = {ep for ep, _, _ in turns}
        assert len(served) == 1, turns
        assert served <= set(stack.by_address()), turns
        # Every later turn finds the earlier turns cached on that engine.
        for (_, _, cached), (_, prev_prompt, _) in zip(turns[1:], turns):
            assert cached >= prev_prompt - 16, turns
    assert stack.envoy.stat("wasmcustom.kvasir.pool.main.pick.ok") - ok_before >= 12


def test_a_shared_system_prompt_still_spreads_across_endpoints(stack: Stack):
    """A burst that shares one system prompt: longest-prefix alone would
    send all of it to the one engine holding the prompt; the indexer's load
    terms (in-flight picks, queued prefill) spread it, and the prompt is
    still reused where it is cached."""
    stack.need_indexer()
    system = long_system(f"shared-{uuid.uuid4().hex[:6]}", words=600)
    status, h, b = stack.envoy.post("/v1/chat/completions", chat(content="warm up", system=system), key="beta")
    assert status == 200, b
    # The zero-latency sims finish a request before the next is picked, so
    # nothing would ever be in flight: stall the engine holding the prompt
    # for the burst, as a busy engine would be, and let the load terms act.
    # The stall must outlast the burst's first picks and a scrape (100 ms)
    # that sees them waiting, also on a loaded CI machine: at 300 ms it
    # sometimes ended before the first picks and all 36 went to the holder.
    holder = stack.by_address()[h[SERVED]]
    status, _, b = request("POST", holder.port, "/sim/faults", json.dumps({"stall_ms": 2000}),
                           {"content-type": "application/json"})
    assert status == 200, b

    def one(i: int) -> tuple[str, int]:
        body = chat(content=f"user {i} asks something different: {uuid.uuid4().hex}", system=system, max_tokens=64)
        status, h, b = stack.envoy.post("/v1/chat/completions", body, key="beta")
        assert status == 200, b
        return h[SERVED], json.loads(b)["usage"]["prompt_tokens_details"]["cached_tokens"]

    with ThreadPoolExecutor(max_workers=12) as ex:
        results = list(ex.map(one, range(36)))
    served = Counter(ep for ep, _ in results)
    assert len(served) >= 2, served
    assert sum(cached > 0 for _, cached in results) >= 18, results


def test_a_client_cannot_steer_to_an_endpoint_or_cluster(stack: Stack):
    # Neither a non-member (the provider sim) nor a cluster name is honoured.
    headers = {"x-gateway-destination-endpoint": stack.provider.address, "x-kvasir-cluster": "provider_example"}
    for _ in range(4):
        status, h, b = stack.envoy.post("/v1/chat/completions", chat(content=uuid.uuid4().hex), headers=headers)
        assert status == 200, b
        assert json.loads(b)["model"] == MODEL
        assert h[SERVED] in stack.by_address()
    # Pass-through paths too: the route header would otherwise pick a cluster.
    status, _, b = request("GET", stack.envoy.port, "/v1/models", None,
                           {"authorization": "Bearer sk-e2e-acme", **headers})
    assert status == 200, b
    assert [m["id"] for m in json.loads(b)["data"]] == [MODEL]


def test_indexer_killed_mid_test_fails_open_then_picks_resume(stack: Stack):
    stack.need_indexer()
    e = stack.envoy
    fo = "wasmcustom.kvasir.pool.main.failopen"
    ok = "wasmcustom.kvasir.pool.main.pick.ok"
    tenant_fo = f"wasmcustom.kvasir.tenant.acme.model.{MODEL.replace('/', '_')}.failopen"
    before_fo, before_tenant = e.stat(fo), e.stat(tenant_fo)
    stack.indexer.stop()
    try:
        for i in range(8):
            status, h, b = e.post("/v1/chat/completions", chat(content=f"while the indexer is down {i}"))
            assert status == 200, b
            assert h["x-gateway-destination-endpoint-served"] in stack.by_address()
        assert e.stat(fo) - before_fo >= 8
        assert e.stat(tenant_fo) - before_tenant >= 8
    finally:
        stack.indexer.start()
    wait_until("indexer healthy again in envoy", lambda: e.healthy("kvasir_indexer", [stack.indexer.address]), timeout=30)
    before_ok = e.stat(ok)
    for i in range(4):
        status, _, b = e.post("/v1/chat/completions", chat(content=f"after the indexer is back {i}"))
        assert status == 200, b
    assert e.stat(ok) - before_ok >= 4
    # Picked requests are reported back to the indexer (fire and forget).
    wait_until("reports reach the indexer", lambda: stack.indexer.metric("kvasir_indexer_reports_total", matched="true") >= 4,
               timeout=10)


def test_fail_open_without_any_indexer_is_fast(stack: Stack):
    """Whether or not the indexer runs, a request never waits longer than
    the pick timeout for it (200 ms here) plus the engine."""
    t0 = time.monotonic()
    status, _, b = stack.envoy.post("/v1/chat/completions", chat(content="timing"))
    assert status == 200, b
    assert time.monotonic() - t0 < 2.0


def open_both_session_streams(stack: Stack) -> None:
    """A VM opens its stream on a timer after its first pick (and again
    500 ms after a stream ended, e.g. at an indexer restart): sends
    requests until both Envoy workers' streams are open."""

    def both_open() -> bool:
        stack.envoy.post("/v1/chat/completions", chat(content="opening the streams"))
        return stack.indexer.metric("kvasir_indexer_sessions_open") >= 2

    wait_until("both workers' session streams open", both_open, timeout=20)


def test_picks_and_reports_ride_a_session_stream(stack: Stack):
    """After a VM's first pick (a unary call, while it opens its stream),
    picks and reports go as messages on one `Session` stream per VM."""
    stack.need_indexer()
    ix = stack.indexer
    picks = "kvasir_indexer_session_calls_total"

    open_both_session_streams(stack)
    before_picks, before_reports = ix.metric(picks, call="pick"), ix.metric(picks, call="report")
    for i in range(12):
        status, _, b = stack.envoy.post("/v1/chat/completions", chat(content=f"session {i}"))
        assert status == 200, b
    assert ix.metric(picks, call="pick") - before_picks >= 12, "every pick rides a stream once it is open"
    wait_until("done reports ride the stream", lambda: ix.metric(picks, call="report") - before_reports >= 12, timeout=10)
    assert ix.metric("kvasir_indexer_sessions_open") <= 3  # 2 workers + the main thread's VM at most


def test_a_stalled_indexer_times_out_picks_and_gives_the_stream_up(stack: Stack):
    """A stopped indexer keeps its TCP connection: the stream looks open
    but answers nothing. Each pick fails open at its own deadline (the
    filter times session picks itself), and after a run of timeouts the
    stream is given up for unary calls, whose Envoy timeout applies."""
    stack.need_indexer()
    e = stack.envoy
    open_both_session_streams(stack)
    fo = "wasmcustom.kvasir.pool.main.failopen"
    before_fo, before_stalled = e.stat(fo), e.stat("wasmcustom.kvasir.session.stalled")
    pid = stack.indexer.proc.p.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        # 2 workers: one of them gets at least 10 of these 20.
        for i in range(20):
            t0 = time.monotonic()
            status, _, b = e.post("/v1/chat/completions", chat(content=f"while the indexer is stopped {i}"))
            assert status == 200, b
            assert time.monotonic() - t0 < 1.5, "a pick waits at most its timeout (200 ms here)"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert e.stat(fo) - before_fo >= 20
    assert e.stat("wasmcustom.kvasir.session.stalled") - before_stalled >= 1
    # Picks come back once the indexer runs again.
    ok = "wasmcustom.kvasir.pool.main.pick.ok"

    def picks_again() -> bool:
        before = e.stat(ok)
        e.post("/v1/chat/completions", chat(content="after the stall"))
        return e.stat(ok) > before

    wait_until("picks resume after the stall", picks_again, timeout=20)


def test_with_the_session_off_picks_are_unary_calls(stack: Stack):
    """`indexerSession: false`: every pick and report is its own gRPC call
    (an Envoy beside the main one, on the same sims and indexer)."""
    stack.need_indexer()
    pool = [s.address for s in stack.sims]
    plugin = compile_plugin(POLICY, {**SETTINGS, "indexerSession": False})
    e = start_envoy(stack.logdir, plugin, pool, stack.indexer.address, stack.provider.address, name="envoy-unary")
    try:
        wait_envoy(e, pool)
        wait_until("indexer healthy in the unary envoy", lambda: e.healthy("kvasir_indexer", [stack.indexer.address]))
        ix = stack.indexer
        calls = "kvasir_indexer_session_calls_total"
        before_stream, before_reports = ix.metric(calls, call="pick"), ix.metric("kvasir_indexer_reports_total", matched="true")
        for i in range(6):
            status, _, b = e.post("/v1/chat/completions", chat(content=f"unary {i}"))
            assert status == 200, b
        assert e.stat("wasmcustom.kvasir.pool.main.pick.ok") >= 6
        wait_until("unary reports reach the indexer",
                   lambda: ix.metric("kvasir_indexer_reports_total", matched="true") - before_reports >= 6, timeout=10)
        assert ix.metric(calls, call="pick") == before_stream, "no pick went on a stream"
        assert e.stat("wasmcustom.kvasir.session.opened") == 0
    finally:
        e.proc.stop()
