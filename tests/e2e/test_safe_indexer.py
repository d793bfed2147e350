"""The cache-indexer behind the real Envoy: only Envoy (holding
the token) may call it (4), and a restarting indexer neither loses requests
nor reads as a saturated pool while it warms up, and exits promptly on
SIGTERM with Envoy's Session streams open (6)."""

from __future__ import annotations

import copy
import json
import signal
import socket
import struct
import threading
import time
import uuid

import pytest

from kvasir_harness import (MODEL, POLICY, SETTINGS, Processes, chat, compile_plugin, indexer_for, request, secrets_for,
                            start_envoy, start_sim, wait_envoy, wait_sim, wait_until)
from conftest import Stack

SERVED = "x-gateway-destination-endpoint-served"


def grpc_status(port: int, method: str, message: bytes, token: str | None) -> str:
    """A unary gRPC call over h2c (the `h2` package, no gRPC stack); the
    grpc-status of the answer (trailers, or a trailers-only response)."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"),
               (":path", f"/kvasir.v1.Indexer/{method}"), ("content-type", "application/grpc"), ("te", "trailers")]
    if token is not None:
        headers.append(("authorization", f"Bearer {token}"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(conn.data_to_send())
        conn.send_headers(1, headers)
        conn.send_data(1, b"\x00" + struct.pack(">I", len(message)) + message, end_stream=True)
        s.sendall(conn.data_to_send())
        got: dict[str, str] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data = s.recv(65536)
            if not data:
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    got.update(dict(ev.headers))
                if isinstance(ev, h2.events.DataReceived):
                    conn.acknowledge_received_data(ev.flow_controlled_length, 1)
                if isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)) and "grpc-status" in got:
                    return got["grpc-status"]
            s.sendall(conn.data_to_send())
    raise AssertionError(f"no grpc-status in {got!r}")


def pool_state_request(pool: str) -> bytes:
    raw = pool.encode()
    return b"\x0a" + bytes([len(raw)]) + raw


def test_only_envoy_may_call_the_indexer(stack: Stack):
    stack.need_indexer()
    ix, e = stack.indexer, stack.envoy
    assert "--grpc-token-file" in ix.argv, "the e2e stack runs the indexer as deployed: with a token"
    ok = "wasmcustom.kvasir.pool.main.pick.ok"
    before = e.stat(ok)
    for i in range(3):
        status, _, b = e.post("/v1/chat/completions", chat(content=f"token {i} {uuid.uuid4().hex}"))
        assert status == 200, b
    assert e.stat(ok) - before == 3, "Envoy's picks carry the token"
    refused = ix.metric("kvasir_indexer_grpc_unauthenticated_total")
    msg = pool_state_request("main")
    assert grpc_status(ix.grpc_port, "PoolState", msg, None) == "16"
    assert grpc_status(ix.grpc_port, "PoolState", msg, "not-the-token") == "16"
    assert ix.metric("kvasir_indexer_grpc_unauthenticated_total") - refused == 2
    # The file's token is the one that works (and is the one Envoy holds).
    assert grpc_status(ix.grpc_port, "PoolState", msg, secrets_for(stack.logdir).token) == "0"


def test_a_restarting_indexer_loses_nothing_and_never_reads_as_saturated(artifacts, logdir):
    sub = logdir / "restart"
    sub.mkdir()
    policy = copy.deepcopy(POLICY)
    # The shipped burst rule: gold tenants go to the provider when the pool
    # is over 90% saturated. Idle engines must never trip it.
    policy["policies"].insert(0, {"name": "burst", "match": {"tenantClasses": ["gold"],
                                  "poolState": {"pool": "main", "saturationAbove": 0.9}},
                                  "action": {"provider": {"provider": "ext"}}})
    with Processes() as ps:
        sims = [ps.add(start_sim(sub, f"sim{i}")) for i in range(3)]
        provider = ps.add(start_sim(sub, "provider", model="provider-model"))
        for s in sims + [provider]:
            wait_sim(s)
        ix = indexer_for(sims, sub)
        ix.start()
        ps.add(ix)
        e = ps.add(start_envoy(sub, compile_plugin(policy, SETTINGS), [s.address for s in sims], ix.address,
                               provider.address))
        wait_envoy(e, [s.address for s in sims])
        wait_until("the indexer healthy in Envoy", lambda: e.healthy("kvasir_indexer", [ix.address]))

        results: list[tuple[int, str | None]] = []
        stop = threading.Event()

        def load() -> None:
            i = 0
            while not stop.is_set() and i < 2000:
                status, h, _ = e.post("/v1/chat/completions", chat(content=f"restart {i} {uuid.uuid4().hex}"))
                results.append((status, h.get(SERVED)))
                i += 1

        t = threading.Thread(target=load)
        t.start()
        try:
            # Under load, with Session streams open, before the signal.
            wait_until("requests through the picking indexer", lambda: len(results) >= 20, timeout=30)
            # SIGTERM with Envoy's Session streams open: it ends them and
            # exits on its own, well within the grace period's bound.
            t0 = time.monotonic()
            ix.proc.p.send_signal(signal.SIGTERM)
            code = ix.proc.p.wait(timeout=15)
            took = time.monotonic() - t0
            assert code == 0, ix.proc.log()[-2000:]
            assert took < 10, took
            # Requests go on while it is gone (they fail open).
            gone = len(results)
            wait_until("requests while the indexer is gone", lambda: len(results) >= gone + 10, timeout=30)
            ix.start()  # same ports; answers UNAVAILABLE until warm
            wait_until("the indexer healthy in Envoy again", lambda: e.healthy("kvasir_indexer", [ix.address]))
            back = len(results)
            wait_until("requests after the restart", lambda: len(results) >= back + 10, timeout=30)
        finally:
            stop.set()
            t.join(timeout=60)
        assert len(results) > 50, len(results)
        statuses = [s for s, _ in results]
        assert statuses.count(200) == len(results), [s for s in statuses if s != 200][:10]
        # Fail-open while it was gone, never the provider.
        served = {a for _, a in results}
        assert provider.address not in served, served
        assert served <= {s.address for s in sims}
        assert provider.metric("vllm:request_success_total") == 0
        # The indexer really was away under load: some requests failed open.
        assert e.stat("wasmcustom.kvasir.pool.main.failopen") > 0
        assert "shutting down" in ix.proc.log()
        # Warm again: picks resume.
        wait_until("the indexer healthy in Envoy again", lambda: e.healthy("kvasir_indexer", [ix.address]))
        ok = e.stat("wasmcustom.kvasir.pool.main.pick.ok")
        for i in range(3):
            status, _, b = e.post("/v1/chat/completions", chat(content=f"after {i} {uuid.uuid4().hex}"))
            assert status == 200, b
        assert e.stat("wasmcustom.kvasir.pool.main.pick.ok") - ok == 3


def test_a_pathological_prompt_is_picked_within_the_pick_timeout(stack: Stack):
    """A megabyte of one repeated character cost 230-290 ms of tokenizer CPU
    per pick, past the e2e pool's 200 ms pick timeout, so every such request
    (and the picks queued behind it) failed open. The indexer's per-pick
    tokenization budget answers it in about a millisecond."""
    stack.need_indexer()
    e = stack.envoy
    ok, fo = "wasmcustom.kvasir.pool.main.pick.ok", "wasmcustom.kvasir.pool.main.failopen"
    limited = stack.indexer.metric("kvasir_indexer_tokenize_limited_total")
    before_ok, before_fo = e.stat(ok), e.stat(fo)
    for ch in "ab":
        status, h, b = e.post("/v1/chat/completions", chat(content=ch * 1_000_000, max_tokens=1))
        # Routed to an engine, which refuses a prompt past its context
        # length (125k tokens against 40,960) as vLLM does.
        assert "x-kvasir-reply" not in h and h.get(SERVED) in stack.by_address(), (status, b[:300])
    assert (e.stat(ok) - before_ok, e.stat(fo) - before_fo) == (2, 0)
    assert stack.indexer.metric("kvasir_indexer_tokenize_limited_total") - limited >= 2
