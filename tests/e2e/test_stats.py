"""Per-tenant, per-model stats in Envoy admin equal what was sent and what
the engines reported, with Prometheus labels from the bootstrap's
stats_tags."""

from __future__ import annotations

import json
import uuid

from kvasir_harness import MODEL, chat, sse_events, wait_until
from kvasir_harness.prom import value as prom_value
from conftest import Stack

M = MODEL.replace("/", "_")


def test_per_tenant_stats_equal_what_was_sent(stack: Stack):
    e = stack.envoy
    p = f"wasmcustom.kvasir.tenant.acme.model.{M}"
    names = ["requests.route", "prompt_tokens.cached", "prompt_tokens.uncached", "completion_tokens", "responses.2xx"]
    before = {n: e.stat(f"{p}.{n}") for n in names}
    sent = {"prompt": 0, "cached": 0, "completion": 0}
    system = f"stats system prompt {uuid.uuid4().hex} " * 20
    n = 6
    for i in range(n):
        stream = i % 2 == 1
        body = chat(content=f"stats question {i}", system=system, max_tokens=3 + i, stream=stream)
        status, _, b = e.post("/v1/chat/completions", body)
        assert status == 200, b
        usage = [ev["usage"] for ev in sse_events(b) if ev.get("usage")][-1] if stream else json.loads(b)["usage"]
        sent["prompt"] += usage["prompt_tokens"]
        sent["cached"] += usage["prompt_tokens_details"]["cached_tokens"]
        sent["completion"] += usage["completion_tokens"]
        assert usage["completion_tokens"] == 3 + i
    d = {k: e.stat(f"{p}.{k}") - v for k, v in before.items()}
    assert d["requests.route"] == n
    assert d["responses.2xx"] == n
    assert d["completion_tokens"] == sent["completion"] == sum(3 + i for i in range(n))
    assert d["prompt_tokens.cached"] == sent["cached"]
    assert d["prompt_tokens.cached"] + d["prompt_tokens.uncached"] == sent["prompt"]
    assert sent["cached"] > 0  # the shared system prompt was reused

    # The same numbers, as labelled Prometheus series.
    text = e.prometheus()
    labels = {"tenant": "acme", "model": M}
    assert prom_value(text, "kvasir_tenant_model_requests", decision="route", **labels) == e.stat(f"{p}.requests.route")
    assert prom_value(text, "kvasir_tenant_model_prompt_tokens", cache="cached", **labels) == e.stat(f"{p}.prompt_tokens.cached")
    assert prom_value(text, "kvasir_tenant_model_completion_tokens", **labels) == e.stat(f"{p}.completion_tokens")

    # Histograms appear after Envoy's stats flush (5 s by default).
    def flushed():
        t = e.prometheus()
        picks = not stack.has_indexer or prom_value(t, "kvasir_pool_pick_us_count", pool="main") >= n
        return picks and all(prom_value(t, f"kvasir_tenant_model_{h}_count", **labels) >= n for h in ("ttft_ms", "e2e_ms"))

    wait_until("TTFT and e2e histograms flushed", flushed, timeout=15, interval=0.5)


def test_refusals_are_counted_by_decision(stack: Stack):
    e = stack.envoy
    keys = {
        "invalid": "wasmcustom.kvasir.tenant.beta.model.unknown.requests.invalid",
        "reject": "wasmcustom.kvasir.tenant.beta.model.blocked-model.requests.reject",
        "unauthorized": "wasmcustom.kvasir.tenant.unknown.model.unknown.requests.unauthorized",
    }
    before = {k: e.stat(v) for k, v in keys.items()}
    assert e.post("/v1/chat/completions", "{nope", key="beta", raw=True)[0] == 400
    assert e.post("/v1/chat/completions", chat("blocked-model"), key="beta")[0] == 403
    assert e.post("/v1/chat/completions", chat(), key="sk-wrong")[0] == 401
    for k, v in keys.items():
        assert e.stat(v) - before[k] == 1, k
    text = e.prometheus()
    assert prom_value(text, "kvasir_tenant_model_requests", tenant="beta", model="blocked-model", decision="reject") >= 1
