"""The request body through the real Envoy and the wasm filter:
the PII guard sees every string that would leave, whatever the field (2),
and parsing and usage accounting are as strict as the engine (7)."""

from __future__ import annotations

import copy
import gzip
import json
import uuid

import pytest

from kvasir_harness import MODEL, POLICY, SETTINGS, Processes, chat, compile_plugin, start_envoy, wait_envoy
from conftest import Stack

SERVED = "x-gateway-destination-endpoint-served"
EMAIL = "jane.doe@example.com"
MARK = "@@PII@@"

# The e2e policy plus a PII guard for acme placed after the provider
# policy: clean `gpt-4o` traffic goes to the provider, PII traffic must
# stay in the pool (the guard skips every provider policy for it).
GUARDED = copy.deepcopy(POLICY)
GUARDED["policies"].append(
    {"name": "keep-pii", "piiGuard": True, "match": {"tenants": ["acme"]},
     "action": {"route": {"pool": "main", "rewriteModel": MODEL}}})


@pytest.fixture(scope="module")
def guarded(stack: Stack, logdir):
    sub = logdir / "safe-body"
    sub.mkdir(exist_ok=True)
    with Processes() as ps:
        pool = [s.address for s in stack.sims]
        e = ps.add(start_envoy(sub, compile_plugin(GUARDED, SETTINGS), pool, stack.indexer.address,
                               stack.provider.address, name="envoy-safe-body"))
        wait_envoy(e, pool)
        yield e


# Each field that could leak personal data, as (path, body with MARK where the PII goes).
LEAKED = {
    "tool-call arguments": ("/v1/chat/completions", {
        "model": "gpt-4o", "max_tokens": 4, "messages": [
            {"role": "user", "content": "look someone up"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "lookup", "arguments": json.dumps({"who": MARK})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "found"}]}),
    "message name": ("/v1/chat/completions", {
        "model": "gpt-4o", "max_tokens": 4, "messages": [{"role": "user", "name": MARK, "content": "hi"}]}),
    "tool description": ("/v1/chat/completions", {
        "model": "gpt-4o", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": f"mails {MARK}",
                                                    "parameters": {"type": "object", "properties": {}}}}]}),
    "top-level user": ("/v1/chat/completions", {
        "model": "gpt-4o", "max_tokens": 4, "user": MARK, "messages": [{"role": "user", "content": "hi"}]}),
    "input_text part": ("/v1/chat/completions", {
        "model": "gpt-4o", "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "input_text", "text": f"write to {MARK}"}]}]}),
    "anthropic tool_use input": ("/v1/messages", {
        "model": "gpt-4o", "max_tokens": 4, "messages": [
            {"role": "user", "content": "look someone up"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup",
                                               "input": {"who": {"email": MARK}}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "found"}]}]}),
    "anthropic tool_result": ("/v1/messages", {
        "model": "gpt-4o", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": f"it is {MARK}"}]}]}]}),
}


def _send(e, path: str, body: dict, pii: str) -> tuple[int, dict[str, str], bytes]:
    text = json.dumps(body).replace(MARK, pii)
    # A fresh prompt each time, so nothing is served from a cache of an
    # earlier answer and each request is its own.
    text = text.replace('"hi"', json.dumps(f"hi {uuid.uuid4().hex}"))
    return e.post(path, text, raw=True)


@pytest.mark.parametrize("field", list(LEAKED))
def test_pii_in_a_field_that_leaked_stays_inside(stack: Stack, guarded, field: str):
    path, body = LEAKED[field]
    pool = stack.by_address()
    # The clean twin goes to the provider: the policy does apply.
    status, h, b = _send(guarded, path, body, "nobody in particular")
    assert h.get(SERVED) == stack.provider.address, (status, h, b)
    assert "x-kvasir-reply" not in h, b
    # With an e-mail address in the field, it is served inside.
    status, h, b = _send(guarded, path, body, EMAIL)
    assert h.get(SERVED) in pool, (status, h, b)
    assert "x-kvasir-reply" not in h, b
    # The simulator serves only OpenAI chat with text parts (it answers the
    # rest with a 400 or 404 of its own); where it serves, it served MODEL.
    if path == "/v1/chat/completions" and field != "input_text part":
        assert status == 200, b
        assert json.loads(b)["model"] == MODEL
    # Escaped in the JSON text: still seen.
    text = json.dumps(body).replace(MARK, EMAIL.replace("@", "\\u0040"))
    status, h, b = guarded.post(path, text, raw=True)
    assert h.get(SERVED) in pool, (status, h, b)


def test_a_token_id_prompt_cannot_be_scanned_and_stays_inside(stack: Stack, guarded):
    status, h, b = guarded.post("/v1/completions", {"model": "gpt-4o", "max_tokens": 2, "prompt": [9707, 1879]})
    assert h.get(SERVED) in stack.by_address(), (status, h, b)
    status, h, b = guarded.post("/v1/completions", {"model": "gpt-4o", "max_tokens": 2,
                                                    "prompt": f"hi {uuid.uuid4().hex}"})
    assert h.get(SERVED) == stack.provider.address, (status, h, b)


def _openai_error(status: int, h: dict[str, str], b: bytes, want_status: int) -> dict:
    assert status == want_status, b
    assert h.get("x-kvasir-reply") == "filter", h
    e = json.loads(b)["error"]
    assert set(e) == {"message", "type", "param", "code"}
    return e


@pytest.mark.parametrize("so", ["[]", "[false]", "false", '"yes"'])
def test_stream_options_that_are_not_objects_are_400(stack: Stack, so: str):
    body = ('{"model": "%s", "stream": true, "stream_options": %s, "max_tokens": 2,'
            ' "messages": [{"role": "user", "content": "hi"}]}' % (MODEL, so))
    e = _openai_error(*stack.envoy.post("/v1/chat/completions", body, raw=True), 400)
    assert (e["code"], e["param"]) == ("invalid_type", "stream_options"), e


def test_usage_is_counted_when_the_client_says_include_usage_false(stack: Stack):
    # The default action's includeUsage: a client cannot opt out of being counted.
    key = f"wasmcustom.kvasir.tenant.beta.model.{MODEL.replace('/', '_')}.completion_tokens"
    before = stack.envoy.stat(key)
    status, _, b = stack.envoy.post("/v1/chat/completions",
                                    chat(stream=True, max_tokens=3, content=uuid.uuid4().hex,
                                         stream_options={"include_usage": False}), key="beta")
    assert status == 200, b
    assert stack.envoy.stat(key) - before == 3


def test_messages_that_are_lists_are_400(stack: Stack):
    e = _openai_error(*stack.envoy.post("/v1/chat/completions",
                                        {"model": MODEL, "messages": [["user", "hi"]]}), 400)
    assert (e["code"], e["param"]) == ("invalid_type", "messages"), e
    status, h, b = stack.envoy.post("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [["user", "hi"]]})
    assert status == 400 and h.get("x-kvasir-reply") == "filter", b
    assert json.loads(b)["type"] == "error"


def test_invalid_utf8_anywhere_is_400(stack: Stack):
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "user": "\xff\xfe"}' % MODEL.encode()
    e = _openai_error(*stack.envoy.post("/v1/chat/completions", body, raw=True), 400)
    assert e["code"] == "invalid_json" and "UTF-8" in e["message"], e


def test_integral_floats_are_integers_as_vllm_reads_them(stack: Stack):
    route = f"wasmcustom.kvasir.tenant.acme.model.{MODEL.replace('/', '_')}.requests.route"
    before = stack.envoy.stat(route)
    body = ('{"model": "%s", "max_tokens": 1e1, "messages": [{"role": "user", "content": "hi %s"}]}'
            % (MODEL, uuid.uuid4().hex))
    status, h, b = stack.envoy.post("/v1/chat/completions", body, raw=True)
    # The filter routed it (the simulator itself reads max_tokens as a plain
    # integer, unlike vLLM, so its own answer may be a 400 of its own).
    assert "x-kvasir-reply" not in h, b
    assert h.get(SERVED) in stack.by_address(), (status, h, b)
    assert stack.envoy.stat(route) - before == 1
    body = '{"model": "%s", "max_tokens": 1.5, "messages": [{"role": "user", "content": "hi"}]}' % MODEL
    e = _openai_error(*stack.envoy.post("/v1/chat/completions", body, raw=True), 400)
    assert e["param"] == "max_tokens", e


def test_a_compressed_body_is_415_not_invalid_json(stack: Stack):
    raw = gzip.compress(json.dumps(chat(content="hi")).encode())
    e = _openai_error(*stack.envoy.post("/v1/chat/completions", raw, raw=True,
                                        headers={"content-encoding": "gzip"}), 415)
    assert e["code"] == "unsupported_content_encoding", e
    status, h, b = stack.envoy.post("/v1/messages", raw, raw=True, headers={"content-encoding": "gzip"})
    assert status == 415 and h.get("x-kvasir-reply") == "filter", b
    assert json.loads(b) == {"type": "error", "error": {"type": "invalid_request_error",
                                                        "message": json.loads(b)["error"]["message"]}}
    # identity is no encoding at all.
    status, h, b = stack.envoy.post("/v1/chat/completions", chat(content=uuid.uuid4().hex),
                                    headers={"content-encoding": "identity"})
    assert status == 200, b
