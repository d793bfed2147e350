"""Request edges through the real stack (Envoy + the wasm filter + the
indexer + vllm-sims): two different API keys in one request are refused
in the API's own error shape, never charged to either tenant; and the
numeric fields are read as vLLM reads them (pydantic's lax `int`: `1e2`,
`"100"` and `true` are integers, `"1e2"` is not), by the filter and the
engine alike, so a body vLLM accepts is served and one it refuses is a 400.
"""

from __future__ import annotations

import json
import uuid

from kvasir_harness import KEYS, MODEL, chat, request, sse_events
from conftest import Stack

M = MODEL.replace("/", "_")


def _stat(stack: Stack, tenant: str, rest: str) -> int:
    return stack.envoy.stat(f"wasmcustom.kvasir.tenant.{tenant}.model.{M}.{rest}")


def _unknown(stack: Stack, rest: str) -> int:
    return stack.envoy.stat(f"wasmcustom.kvasir.tenant.unknown.model.unknown.{rest}")


def test_two_different_keys_are_refused_in_each_apis_shape(stack: Stack):
    e = stack.envoy
    both = {"authorization": f"Bearer {KEYS['acme']}", "x-api-key": KEYS["beta"],
            "content-type": "application/json"}
    charged = {t: _stat(stack, t, "requests.route") for t in ("acme", "beta")}
    refused = _unknown(stack, "requests.unauthorized")
    status, h, b = request("POST", e.port, "/v1/chat/completions", json.dumps(chat()), both)
    assert status == 401, b
    assert h["content-type"] == "application/json"
    err = json.loads(b)["error"]
    assert (err["type"], err["code"]) == ("authentication_error", "conflicting_credentials"), b
    assert "x-api-key" in err["message"] and KEYS["acme"] not in err["message"] and KEYS["beta"] not in err["message"]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, _, b = request("POST", e.port, "/v1/messages", json.dumps(body), both)
    assert status == 401, b
    r = json.loads(b)
    assert r["type"] == "error" and r["error"]["type"] == "authentication_error", r
    assert "conflicting credentials" in r["error"]["message"], r
    # Before the body was read, on every path: GET /v1/models too.
    status, _, b = request("GET", e.port, "/v1/models", None, both)
    assert status == 401 and json.loads(b)["error"]["code"] == "conflicting_credentials", b
    # Neither tenant was charged; the refusals are counted as unauthorized.
    assert {t: _stat(stack, t, "requests.route") for t in ("acme", "beta")} == charged
    assert _unknown(stack, "requests.unauthorized") == refused + 3
    # The same key in both headers is one credential.
    same = {**both, "x-api-key": KEYS["acme"]}
    status, _, b = request("POST", e.port, "/v1/chat/completions", json.dumps(chat()), same)
    assert status == 200, b
    status, _, b = request("POST", e.port, "/v1/messages", json.dumps(body), same)
    assert status == 200, b
    assert _stat(stack, "acme", "requests.route") == charged["acme"] + 2


def _chat(stack: Stack, **fields) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"numbers {uuid.uuid4().hex}"}], **fields}
    status, _, b = stack.envoy.post("/v1/chat/completions", body)
    return status, json.loads(b)


def test_integers_are_read_as_vllm_reads_them(stack: Stack):
    # vLLM accepts these: the filter passes them and the engine generates
    # exactly that many tokens (the simulator's chat length is max_tokens).
    for value, tokens in ((1e2, 100), (100.0, 100), ("7", 7), (" 1_2 ", 12), ("5.000", 5), (True, 1)):
        status, r = _chat(stack, max_tokens=value)
        assert status == 200, (value, r)
        assert r["usage"]["completion_tokens"] == tokens, (value, r["usage"])
    status, r = _chat(stack, max_completion_tokens="3", max_tokens=50)
    assert status == 200 and r["usage"]["completion_tokens"] == 3, r
    # vLLM refuses these: the filter answers first, in OpenAI's shape.
    for value in ("1e2", "100.", "0x10", 1.5, "abc", [3]):
        status, r = _chat(stack, max_tokens=value)
        assert status == 400, (value, r)
        assert r["error"]["code"] == "invalid_type" and r["error"]["param"] == "max_tokens", (value, r)
    # A float past 2^63 too (pydantic: int_parsing_size); the raw text,
    # since Python's json would write 1e20 as 1e+20 anyway.
    status, _, b = stack.envoy.post("/v1/chat/completions", '{"model": "%s", "max_tokens": 1e20, "messages": '
                                    '[{"role": "user", "content": "x"}]}' % MODEL, raw=True)
    assert status == 400 and json.loads(b)["error"]["param"] == "max_tokens", b
    # A field only the engine reads (`n`) is refused by the engine, in
    # vLLM's validation shape.
    status, r = _chat(stack, max_tokens=2, n="1e2")
    assert status == 400 and r["error"]["param"] == "body.n", r
    assert "int_parsing" in r["error"]["message"], r


def test_token_ids_are_read_as_vllm_reads_them(stack: Stack):
    e = stack.envoy
    # Not all strings: every element is a lax token id.
    status, _, b = e.post("/v1/completions", {"model": MODEL, "prompt": [100, "101", True, 102.0, " 103 "],
                                              "max_tokens": "2"})
    assert status == 200, b
    r = json.loads(b)
    assert r["usage"]["prompt_tokens"] == 5 and r["usage"]["completion_tokens"] == 2, r
    # Streamed too, with lists of ids.
    status, _, b = e.post("/v1/completions", {"model": MODEL, "prompt": [["100", 101]], "max_tokens": True,
                                              "stream": True})
    assert status == 200, b
    assert [c for c in sse_events(b) if c.get("usage")][-1]["usage"]["prompt_tokens"] == 2
    # A list of strings only is text, as vLLM reads it (as a token id this
    # one would be past the vocabulary; as text it is a dozen digits).
    status, _, b = e.post("/v1/completions", {"model": MODEL, "prompt": ["100100100100"], "max_tokens": 1})
    assert status == 200 and json.loads(b)["usage"]["prompt_tokens"] > 1, b
    # What no member of vLLM's prompt union accepts.
    for prompt in (["a", 1], [[1], 2], [1.5], [-1], ["1e2", 3]):
        status, _, b = e.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert status == 400, (prompt, b)
        assert json.loads(b)["error"]["param"] == "prompt", (prompt, b)
