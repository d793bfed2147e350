"""The cache-indexer as the endpoint picker of a gateway that handles
InferencePool itself: a real Envoy 1.40 calls the indexer's picker port
over ext_proc (full duplex, as the Inference Extension's gateways do), in
both pool cluster shapes those gateways generate (ORIGINAL_DST reading the
header, a static pool whose override_host reads the header and the
`envoy.lb` metadata). No wasm filter anywhere: the picker alone decides
the tenant, the budget and the engine, and hears what served."""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvasir_harness import (KEYS, MODEL, POLICY, SETTINGS, Processes, compile_plugin, free_port, sse_events,
                            start_sim, wait_sim, wait_until)
from kvasir_harness import request as http
from kvasir_harness.indexer import Indexer
from kvasir_harness.paths import INDEXER_BIN, TOKENIZER
from kvasir_harness.picker import start_picker_envoy

SERVED = "x-gateway-destination-endpoint-served"


def picker_policy() -> dict[str, Any]:
    p = copy.deepcopy(POLICY)
    for t in p["tenants"]:
        if t["name"] == "beta":
            t["budget"] = {"requestsPerMinute": 3}
    return p


class Gateway:
    def __init__(self, envoy, sims, indexer: Indexer, picker: str):
        self.envoy, self.sims, self.indexer, self.picker = envoy, sims, indexer, picker

    def post(self, path: str, body: Any, key: str = "acme", raw: bytes | None = None) -> tuple[int, dict, bytes]:
        h = {"content-type": "application/json"}
        if key:
            h["authorization"] = f"Bearer {KEYS.get(key, key)}"
        return http("POST", self.envoy.port, path, raw if raw is not None else json.dumps(body), h, timeout=60)

    def sim(self, address: str):
        return next(s for s in self.sims if s.address == address)


def start_indexer(logdir: Path, sims, settings: dict[str, Any]) -> tuple[Indexer, str]:
    picker_port = free_port()
    policy_file = logdir / "picker-policy.json"
    policy_file.write_text(compile_plugin(picker_policy(), settings))
    cfg = {
        "pools": [{"name": "main", "model": MODEL, "tokenizer": str(TOKENIZER),
                   "scrape": {"intervalMs": 100, "timeoutMs": 100},
                   "endpoints": [{"address": s.address} for s in sims]}],
        "pickers": [{"addr": f"127.0.0.1:{picker_port}", "pool": "main", "policyFile": str(policy_file)}],
    }
    path = logdir / "indexer.json"
    path.write_text(json.dumps(cfg))
    grpc_port, http_port = free_port(), free_port()
    argv = [str(INDEXER_BIN), "--config", str(path), "--grpc-addr", f"127.0.0.1:{grpc_port}",
            "--http-addr", f"127.0.0.1:{http_port}"]
    ix = Indexer(None, grpc_port, http_port, argv, logdir)
    return ix, f"127.0.0.1:{picker_port}"


@pytest.fixture(scope="module", params=["override_host", "original_dst"])
def gw(request, artifacts, tmp_path_factory) -> Iterator[Gateway]:
    shape = request.param
    logdir = tmp_path_factory.mktemp(f"picker-{shape}")
    # ORIGINAL_DST dials the one address in the header: one per answer.
    settings = {**SETTINGS, "maxEndpoints": 1 if shape == "original_dst" else 3}
    with Processes() as ps:
        sims = [ps.add(start_sim(logdir, f"sim{i}")) for i in range(3)]
        for s in sims:
            wait_sim(s)
        ix, picker = start_indexer(logdir, sims, settings)
        ix.start()
        ps.add(ix)
        e = ps.add(start_picker_envoy(logdir, picker, [s.address for s in sims], shape))
        wait_until("gateway envoy ready", lambda: http("GET", e.admin, "/ready", timeout=2)[0] == 200)
        yield Gateway(e, sims, ix, picker)


def long_system(tag: str) -> str:
    return f"[{tag}] " + " ".join(f"rule {i} of the {tag} handbook" for i in range(120))


def test_the_pick_is_honoured_and_what_served_is_reported(gw: Gateway):
    tag = uuid.uuid4().hex[:8]
    msgs = [{"role": "system", "content": long_system(tag)}, {"role": "user", "content": "first question"}]
    status, h, b = gw.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
    assert status == 200, b
    home = h[SERVED]
    assert home in {s.address for s in gw.sims}
    reports = gw.indexer.metric("kvasir_indexer_reports_total", matched="true")
    msgs += [{"role": "assistant", "content": json.loads(b)["choices"][0]["message"]["content"]},
             {"role": "user", "content": "second question"}]
    status, h, b = gw.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
    assert status == 200, b
    assert h[SERVED] == home, "the next turn goes where its prefix is"
    assert json.loads(b)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wait_until("the served endpoint reported", lambda: gw.indexer.metric(
        "kvasir_indexer_reports_total", matched="true") > reports, timeout=10)
    # Counted when the exchange ends, which may be after the client has
    # its answer.
    wait_until("both exchanges counted as forwarded", lambda: gw.indexer.metric(
        "kvasir_indexer_picker_requests_total", outcome="forwarded") >= 2, timeout=10)


def test_every_api_the_filter_routes(gw: Gateway):
    tag = uuid.uuid4().hex[:8]
    status, _, b = gw.post("/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": 3,
                                                    "messages": [{"role": "user", "content": f"{tag} hi"}]})
    assert status == 200 and sse_events(b), b
    status, _, b = gw.post("/v1/completions", {"model": MODEL, "prompt": f"{tag} once upon", "max_tokens": 3})
    assert status == 200 and json.loads(b)["choices"], b
    status, _, b = gw.post("/v1/messages", {"model": MODEL, "max_tokens": 3, "stream": True,
                                            "messages": [{"role": "user", "content": f"{tag} hello"}]})
    assert status == 200 and b"message_stop" in b, b
    # A Responses API chain stays on the engine that stores it.
    status, h, b = gw.post("/v1/responses", {"model": MODEL, "input": f"{tag} first", "max_output_tokens": 3})
    assert status == 200, b
    home, rid = h[SERVED], json.loads(b)["id"]
    for turn in range(3):
        status, h, b = gw.post("/v1/responses", {"model": MODEL, "input": f"{tag} turn {turn}",
                                                 "previous_response_id": rid, "max_output_tokens": 3})
        assert status == 200, b
        assert h[SERVED] == home
        rid = json.loads(b)["id"]
    # Another tenant gets what an unknown id gets.
    status, _, b = gw.post("/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": rid}, key="beta")
    assert status == 404, b


def test_a_large_body_streams_through(gw: Gateway):
    # Nearly the filter's 1 MiB limit, most of it a field vLLM reads and
    # the model does not see: the body crosses the picker in many chunks.
    body = {"model": MODEL, "max_tokens": 2, "user": "u" * 1_000_000,
            "messages": [{"role": "user", "content": f"large {uuid.uuid4().hex}"}]}
    status, h, b = gw.post("/v1/chat/completions", body)
    assert status == 200, b[:300]
    assert h[SERVED] in {s.address for s in gw.sims}


def test_the_budget_refuses_with_a_429_in_the_apis_shape(gw: Gateway):
    statuses = []
    for i in range(6):
        status, h, b = gw.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": f"beta {i}"}]},
                               key="beta")
        statuses.append(status)
        if status == 429:
            assert h["x-ratelimit-limit-requests"] == "3", h
            assert int(h["retry-after"]) >= 1, h
            assert json.loads(b)["error"]["code"] == "rate_limit_exceeded", b
    assert statuses.count(429) >= 3, statuses


def test_an_unknown_key_is_refused_before_any_pick(gw: Gateway):
    status, _, b = gw.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                           key="sk-nobody")
    assert status == 401, b
    assert json.loads(b)["error"]["code"] == "invalid_api_key"


def test_retries_walk_the_pick_list(gw: Gateway):
    if '"ORIGINAL_DST"' in gw.envoy.config_path.read_text():
        pytest.skip("ORIGINAL_DST dials the one address it is given: no list to walk")
    bad = gw.sims[0]
    status, _, b = http("POST", bad.port, "/sim/faults", json.dumps({"fail_rate": 1.0}))
    assert status == 200, b
    try:
        codes = []
        for i in range(20):
            status, _, _ = gw.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": f"retry {i} {uuid.uuid4().hex}"}]})
            codes.append(status)
        assert codes == [200] * 20, codes
    finally:
        http("POST", bad.port, "/sim/faults", json.dumps({"fail_rate": 0.0}))


def test_the_subset_hint_bounds_the_pick(gw: Gateway, tmp_path):
    only = gw.sims[1].address
    shape = "original_dst" if '"ORIGINAL_DST"' in gw.envoy.config_path.read_text() else "override_host"
    with Processes() as ps:
        e = ps.add(start_picker_envoy(tmp_path, gw.picker, [s.address for s in gw.sims], shape,
                                      name="subset", subset=[only]))
        empty = ps.add(start_picker_envoy(tmp_path, gw.picker, [s.address for s in gw.sims], shape,
                                          name="empty", subset=[]))
        for x in (e, empty):
            wait_until("envoy ready", lambda x=x: http("GET", x.admin, "/ready", timeout=2)[0] == 200)
        h = {"content-type": "application/json", "authorization": f"Bearer {KEYS['acme']}"}
        for i in range(6):
            body = json.dumps({"model": MODEL, "max_tokens": 1,
                               "messages": [{"role": "user", "content": f"subset {i} {uuid.uuid4().hex}"}]})
            status, rh, b = http("POST", e.port, "/v1/chat/completions", body, h)
            assert status == 200, b
            assert rh[SERVED] == only
        status, _, b = http("POST", empty.port, "/v1/chat/completions", body, h)
        assert status == 503, b


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_the_picker_down_fails_as_the_gateway_is_configured(artifacts, tmp_path, mode):
    """With the picker gone, an Envoy set to fail open serves the request
    by its own balancing and one set to fail closed refuses it. Envoy 1.40
    fails open only in BUFFERED body mode: in FULL_DUPLEX_STREAMED it
    mostly answers 500 whatever `failure_mode_allow` says, and on a loaded
    machine served the odd request: fail-open is not to be relied on
    there, and fail-closed always refuses."""
    with Processes() as ps:
        sims = [ps.add(start_sim(tmp_path, f"sim{i}")) for i in range(2)]
        for s in sims:
            wait_sim(s)
        ix, picker = start_indexer(tmp_path, sims, SETTINGS)
        ix.start()
        addrs = [s.address for s in sims]
        response_mode = "STREAMED" if mode == "BUFFERED" else mode
        open_ = ps.add(start_picker_envoy(tmp_path, picker, addrs, "override_host", name="open", fail_open=True,
                                          request_mode=mode, response_mode=response_mode))
        closed = ps.add(start_picker_envoy(tmp_path, picker, addrs, "override_host", name="closed",
                                           request_mode=mode, response_mode=response_mode))
        for x in (open_, closed):
            wait_until("envoy ready", lambda x=x: http("GET", x.admin, "/ready", timeout=2)[0] == 200)
        h = {"content-type": "application/json", "authorization": f"Bearer {KEYS['acme']}"}
        body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        for x in (open_, closed):
            assert http("POST", x.port, "/v1/chat/completions", body, h)[0] == 200
        ix.stop()
        status, _, _ = http("POST", open_.port, "/v1/chat/completions", body, h)
        if mode == "BUFFERED":
            assert status == 200, "fail open: the gateway's own balancing serves it"
        else:
            assert status in (200, 500), "full duplex: refused or served, never anything else"
        status, _, _ = http("POST", closed.port, "/v1/chat/completions", body, h)
        assert status == 500, "fail closed: refused"
