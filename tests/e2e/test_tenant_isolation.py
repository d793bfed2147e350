"""Tenant isolation and budget integrity through the real stack, probed as
an attacker with a valid tenant key would: another tenant's stored
response is unknown to you; repeating a request id shares no reservation;
an indexer that stalls, for a second or half a minute, locks no tenant out
afterwards and lets none past its limits meanwhile; a client that walks
away from a stream is still charged for what it was sent, and the engine
stops generating.

Each test runs its own small stack (real Envoy 1.40 with the built filter,
a real cache-indexer, vllm-sims) where budgets are involved, since budget
state is what the shared stack's other tests must not see."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
import uuid
from typing import Any

import pytest

from kvasir_harness import KEYS, MODEL, request, wait_until
from conftest import Stack
from test_governance import chat, gov_stack, policy

M = MODEL.replace("/", "_")
AUTH = {k: {"authorization": f"Bearer {v}", "content-type": "application/json"} for k, v in KEYS.items()}


def unknown_body(rid: str) -> dict[str, Any]:
    return {"error": {"message": f"Response with id '{rid}' not found.", "type": "invalid_request_error",
                      "param": "response_id", "code": 404}}


def test_another_tenants_stored_response_is_an_unknown_id(stack: Stack):
    """acme stores a response whose instructions hold a secret; beta can
    neither read it, nor chain to it, nor cancel it: each gets the 404 an
    id nobody stored gets, and no engine sees beta's request."""
    stack.need_indexer()
    secret = f"the launch code is {uuid.uuid4().hex}"
    status, _, b = stack.envoy.post("/v1/responses", {"model": MODEL, "instructions": secret, "input": "hello",
                                                      "max_output_tokens": 4, "store": True})
    assert status == 200, b
    rid = json.loads(b)["id"]
    engine_requests = lambda: sum(s.metric("vllm:request_success_total") for s in stack.sims)
    before = engine_requests()
    probes = [
        ("GET", f"/v1/responses/{rid}", None),
        ("POST", f"/v1/responses/{rid}/cancel", None),
        ("POST", "/v1/responses", json.dumps({"model": MODEL, "input": "and now?", "previous_response_id": rid})),
    ]
    for method, path, body in probes:
        status, h, b = request(method, stack.envoy.port, path, body, AUTH["beta"])
        assert status == 404, (method, path, b)
        assert json.loads(b) == unknown_body(rid), (method, path, b)
        assert secret.encode() not in b
        assert "x-gateway-destination-endpoint-served" not in h, (method, path, h)
    assert engine_requests() == before, "no engine saw beta's requests"
    # The owner still reads it, from the engine that holds it.
    status, _, b = request("GET", stack.envoy.port, f"/v1/responses/{rid}", None, AUTH["acme"])
    assert status == 200, b
    assert json.loads(b)["instructions"] == secret
    lookups = stack.indexer.metric_by("kvasir_indexer_response_lookups_total", "result")
    assert lookups.get("other_tenant", 0) >= 3, lookups


def _slow_stream(port: int, key: str, headers: dict[str, str] | None = None, max_tokens: int = 40) -> int:
    """A streamed chat of tenant `key` read to its end; its status."""
    body = json.dumps(chat(f"slow {uuid.uuid4().hex}", stream=True, max_tokens=max_tokens))
    status, _, _ = request("POST", port, "/v1/chat/completions", body, {**AUTH[key], **(headers or {})}, timeout=60)
    return status


def _wave(port: int, key: str, n: int, headers: dict[str, str] | None = None) -> list[int]:
    """`n` slow streams of `key` sent at once; their statuses."""
    statuses: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(n)

    def one():
        start.wait(timeout=10)
        s = _slow_stream(port, key, headers)
        with lock:
            statuses.append(s)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert len(statuses) == n, statuses
    return statuses


def test_a_repeated_request_id_shares_no_reservation(artifacts, logdir):
    """beta may have 2 requests in flight. Ten slow streams sent at once
    with one fixed `x-request-id` are admitted 2, refused 8, exactly as
    with ten different ids: the budget is keyed by the gateway's own id."""
    pol = policy(budgets={"beta": {"maxConcurrent": 2}})
    with gov_stack(logdir, "reqid", pol, sims=2, profile="h100-8b", time_scale=1.0) as g:
        fixed = _wave(g.envoy.port, "beta", 10, {"x-request-id": "the-same-id"})
        assert sorted(fixed) == [200] * 2 + [429] * 8, fixed
        wait_until("reservations ended", lambda: g.indexers[0].metric("kvasir_indexer_budget_open_reservations") == 0,
                   timeout=10)
        distinct = _wave(g.envoy.port, "beta", 10)
        assert sorted(distinct) == [200] * 2 + [429] * 8, distinct


@pytest.mark.parametrize("stall_s", [1, 5, 30])
def test_an_indexer_stall_keeps_the_limits_and_locks_no_one_out(artifacts, logdir, stall_s):
    """The indexer is stopped (SIGSTOP) while beta (2 in flight) sends
    eight slow streams at once: the picks time out and fail open, and the
    filter admits beta against its own share of the budget: 2 served, 6
    refused with 429. When the indexer resumes, the picks it then
    processes hold nothing (their requests said they were admitted
    without them), its open reservations go back to 0 within a second or
    two, and a lone beta request is served."""
    pol = policy(budgets={"beta": {"maxConcurrent": 2}})
    with gov_stack(logdir, f"stall{stall_s}", pol, sims=2, profile="h100-8b", time_scale=1.0) as g:
        ix, e = g.indexers[0], g.envoy
        assert _slow_stream(e.port, "beta") == 200, "the stack works"
        pid = ix.proc.p.pid
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            statuses = _wave(e.port, "beta", 8)
            left = stall_s - (time.monotonic() - stopped)
            if left > 0:
                time.sleep(left)  # the stall's length is the subject
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        assert sorted(statuses) == [200] * 2 + [429] * 6, statuses
        prefix = f"wasmcustom.kvasir.tenant.beta.model.{M}"
        assert e.stat(f"{prefix}.local_budget.admitted") == 2
        assert e.stat(f"{prefix}.local_budget.limited.concurrent") == 6
        wait_until("no reservation left open",
                   lambda: ix.metric("kvasir_indexer_budget_open_reservations") == 0, timeout=10)
        recovered = time.monotonic() - resumed
        assert recovered < 5, recovered
        for _ in range(2):
            assert _slow_stream(e.port, "beta") == 200, "no lockout"


def _read_events_then_leave(port: int, n: int) -> int:
    """Opens a streamed chat of acme, reads until `n` content events
    arrived, and closes the connection; how many it read."""
    body = json.dumps(chat(f"tell a long story {uuid.uuid4().hex}", stream=True, max_tokens=4000))
    c = socket.create_connection(("127.0.0.1", port), timeout=20)
    try:
        c.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEYS['acme']}\r\n"
                   f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n{body}").encode())
        seen, buf = 0, b""
        deadline = time.monotonic() + 30
        while seen < n and time.monotonic() < deadline:
            chunk = c.recv(65536)
            if not chunk:
                break
            buf += chunk
            # Content deltas; the first chunk's empty one only names the role.
            seen = len(re.findall(rb'"content":"[^"]', buf))
        return seen
    finally:
        c.close()


def test_an_abandoned_stream_is_charged_and_the_engine_stops(artifacts, logdir):
    """A client reads 200 streamed tokens of a 4,000-token answer and goes
    away. The engine is told (Envoy resets the upstream stream) and stops;
    the tenant is charged the tokens it was sent, in its stats and in its
    budget, not zero."""
    pol = policy(budgets={"acme": {"tokensPerMinute": 1_000_000}})
    with gov_stack(logdir, "abandon", pol, sims=1, profile="h100-8b", time_scale=1.0) as g:
        e, ix, sim = g.envoy, g.indexers[0], g.sims[0]
        prefix = f"wasmcustom.kvasir.tenant.acme.model.{M}"
        read = _read_events_then_leave(e.port, 200)
        assert read >= 200, read
        wait_until("the engine aborted it", lambda: sim.metric("vllm:request_success_total", finished_reason="abort") == 1,
                   timeout=10)
        assert sim.metric("vllm:num_requests_running") == 0
        wait_until("the cancelled response accounted", lambda: e.stat(f"{prefix}.responses.cancelled") == 1, timeout=10)
        charged = e.stat(f"{prefix}.completion_tokens")
        assert 200 <= charged < 4000, charged
        wait_until("its reservation settled", lambda: ix.metric("kvasir_indexer_budget_open_reservations") == 0,
                   timeout=10)
        # Prompt plus completion: at least the 200 tokens sent.
        settled = ix.metric("kvasir_indexer_budget_tokens_settled_total", tenant="acme")
        assert settled >= 200, settled
