"""A corpus of hostile and malformed requests through real Envoy: every one
gets the right reply in the API's own shape, and the wasm VM never fails or
reloads (a panic in the filter would kill the VM)."""

from __future__ import annotations

import json
import random
import socket

import pytest

from kvasir_harness import MODEL, request, wait_until, wasm_failures
from conftest import Stack

OK_MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = "/v1/messages"


def j(o) -> bytes:
    return json.dumps(o).encode()


def nested(depth: int, inside: str = "messages") -> bytes:
    return ('{"model":"%s","%s":' % (MODEL, inside) + "[" * depth + "]" * depth + "}").encode()


rng = random.Random(1234)
GARBAGE = [bytes(rng.randrange(256) for _ in range(n)) for n in (1, 7, 64, 4096)]

# (id, path, body, extra headers, expected status, expected code or None)
CORPUS: list[tuple[str, str, bytes, dict[str, str], int, str | None]] = [
    ("truncated-object", CHAT, b"{", {}, 400, "invalid_json"),
    ("truncated-value", CHAT, b'{"model":', {}, 400, "invalid_json"),
    ("trailing-garbage", CHAT, j({"model": MODEL, "messages": OK_MSGS}) + b"}}", {}, 400, "invalid_json"),
    ("nul-in-literal", CHAT, b"nul\x00l", {}, 400, "invalid_json"),
    ("empty-body", CHAT, b"", {}, 400, "invalid_json"),
    ("whitespace-body", CHAT, b"  \r\n\t ", {}, 400, "invalid_json"),
    ("json-null", CHAT, b"null", {}, 400, "invalid_type"),
    ("json-array", CHAT, b"[]", {}, 400, "invalid_type"),
    ("json-string", CHAT, b'"hello"', {}, 400, "invalid_type"),
    ("json-number", CHAT, b"12", {}, 400, "invalid_type"),
    ("invalid-utf8-string", CHAT, b'{"model":"\xff\xfe","messages":[]}', {}, 400, "invalid_json"),
    ("lone-surrogate", CHAT, b'{"model":"\\ud800","messages":[{"role":"user","content":"x"}]}', {}, 400, "invalid_json"),
    ("missing-model", CHAT, j({"messages": OK_MSGS}), {}, 400, "missing_model"),
    ("empty-model", CHAT, j({"model": "  ", "messages": OK_MSGS}), {}, 400, "missing_model"),
    ("missing-messages", CHAT, j({"model": MODEL}), {}, 400, "missing_messages"),
    ("empty-messages", CHAT, j({"model": MODEL, "messages": []}), {}, 400, "missing_messages"),
    ("model-number", CHAT, j({"model": 5, "messages": OK_MSGS}), {}, 400, "invalid_type"),
    ("model-object", CHAT, j({"model": {"a": 1}, "messages": OK_MSGS}), {}, 400, "invalid_type"),
    ("messages-string", CHAT, j({"model": MODEL, "messages": "hi"}), {}, 400, "invalid_type"),
    ("message-number", CHAT, j({"model": MODEL, "messages": [1]}), {}, 400, "invalid_type"),
    ("message-no-role", CHAT, j({"model": MODEL, "messages": [{"content": "x"}]}), {}, 400, "invalid_type"),
    ("content-number", CHAT, j({"model": MODEL, "messages": [{"role": "user", "content": 5}]}), {}, 400, "invalid_type"),
    ("part-text-number", CHAT, j({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}), {}, 400, "invalid_type"),
    ("stream-string", CHAT, j({"model": MODEL, "messages": OK_MSGS, "stream": "yes"}), {}, 400, "invalid_type"),
    ("max-tokens-negative", CHAT, j({"model": MODEL, "messages": OK_MSGS, "max_tokens": -1}), {}, 400, "invalid_type"),
    ("stream-options-array", CHAT, j({"model": MODEL, "messages": OK_MSGS, "stream_options": [1]}), {}, 400, "invalid_type"),
    ("duplicate-model", CHAT, b'{"model":"%s","model":"other","messages":[{"role":"user","content":"x"}]}' % MODEL.encode(), {}, 400, "invalid_type"),
    ("deep-nesting-read-field", CHAT, nested(50_000), {}, 400, "invalid_type"),
    ("prompt-object", COMP, j({"model": MODEL, "prompt": {}}), {}, 400, "invalid_type"),
    ("prompt-mixed", COMP, j({"model": MODEL, "prompt": [1, "a"]}), {}, 400, "invalid_type"),
    ("prompt-id-too-big", COMP, j({"model": MODEL, "prompt": [2**40]}), {}, 400, "invalid_type"),
    ("prompt-missing", COMP, j({"model": MODEL}), {}, 400, "missing_prompt"),
    ("form-encoded", CHAT, b"model=x&messages=y", {"content-type": "application/x-www-form-urlencoded"}, 400, "invalid_json"),
    ("too-large", CHAT, b'{"model":"%s","messages":[{"role":"user","content":"' % MODEL.encode() + b"x" * 1_200_000 + b'"}]}', {}, 413, "body_too_large"),
    ("too-large-garbage", CHAT, b"\x00" * 1_500_000, {}, 413, "body_too_large"),
] + [(f"garbage-{len(g)}", CHAT, g, {}, 400, None) for g in GARBAGE]

# Valid requests in odd clothing: they must still work.
ACCEPTED: list[tuple[str, str, bytes, dict[str, str], int]] = [
    ("text-plain-content-type", CHAT, j({"model": MODEL, "messages": OK_MSGS, "max_tokens": 2}), {"content-type": "text/plain"}, 200),
    ("no-content-type", CHAT, j({"model": MODEL, "messages": OK_MSGS, "max_tokens": 2}), {"content-type": ""}, 200),
    ("deep-nesting-skipped-field", CHAT, b'{"model":"%s","max_tokens":2,"messages":[{"role":"user","content":"x"}],"metadata":{"x":%s}}'
     % (MODEL.encode(), b"[" * 2000 + b"]" * 2000), {}, 200),
    ("content-parts-and-nulls", CHAT, j({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": None},
        # (the simulator refuses image parts, so text parts only here)
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}), {}, 200),
    ("escaped-unicode", CHAT, b'{"model":"Qwen\\/Qwen3-8B","max_tokens":2,"messages":[{"role":"user","content":"\\u00e9\\ud83d\\ude00"}]}', {}, 200),
    ("unknown-model-passes-to-engine", CHAT, j({"model": "\u6a21\u578b", "messages": OK_MSGS}), {}, 404),
    ("token-id-prompt", COMP, j({"model": MODEL, "prompt": [151644, 872, 198], "max_tokens": 2}), {}, 200),
    ("non-utf8-header", CHAT, j({"model": MODEL, "messages": OK_MSGS, "max_tokens": 2}), {"x-note": "caf\xe9"}, 200),
]


def check_shape(path: str, body: bytes, code: str | None) -> None:
    b = json.loads(body)
    if path == MSGS:
        assert b["type"] == "error" and set(b["error"]) == {"type", "message"}, b
    else:
        assert set(b["error"]) == {"message", "type", "param", "code"}, b
        if code:
            assert b["error"]["code"] == code, b


@pytest.fixture(scope="module")
def vm_before(stack: Stack):
    st = stack.envoy.stats()
    created = {k: v for k, v in st.items() if k.startswith("wasm.") and k.endswith(".created")}
    yield created
    after = {k: v for k, v in stack.envoy.stats().items() if k.startswith("wasm.") and k.endswith(".created")}
    assert after == created, "a wasm VM was created during the fuzz run (reload?)"
    assert wasm_failures(stack.envoy) == {"counters": {}, "log": []}


@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_refused_with_the_right_reply(stack: Stack, vm_before, case):
    _, path, body, headers, status, code = case
    h = {"authorization": "Bearer sk-e2e-acme", "content-type": "application/json", **headers}
    got, rh, rb = request("POST", stack.envoy.port, path, body, h)
    assert got == status, rb[:300]
    assert rh["content-type"] == "application/json"
    check_shape(path, rb, code)


@pytest.mark.parametrize("case", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_odd_but_valid_requests_still_work(stack: Stack, vm_before, case):
    _, path, body, headers, status = case
    h = {"authorization": "Bearer sk-e2e-acme", "content-type": "application/json", **headers}
    h = {k: v for k, v in h.items() if v != ""}
    got, _, rb = request("POST", stack.envoy.port, path, body, h)
    assert got == status, rb[:300]


def test_anthropic_errors_keep_anthropics_shape(stack: Stack, vm_before):
    h = {"x-api-key": "sk-e2e-acme", "content-type": "application/json"}
    for body, status in [(b"{", 400), (b"[]", 400), (j({"messages": OK_MSGS}), 400), (b"x" * 1_100_000, 413)]:
        got, _, rb = request("POST", stack.envoy.port, MSGS, body, h)
        assert got == status, rb[:200]
        check_shape(MSGS, rb, None)


def raw(port: int, data: bytes, read: bool = False) -> bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(data)
        if not read:
            return b""
        # No half-close: Envoy treats a client FIN as going away.
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
    finally:
        s.close()


def test_chunked_bodies_and_clients_that_vanish(stack: Stack, vm_before):
    port = stack.envoy.port
    body = j({"model": MODEL, "messages": OK_MSGS, "max_tokens": 2})
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7)) + b"0\r\n\r\n"
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-e2e-acme\r\n"
            b"content-type: application/json\r\n")
    out = raw(port, head + b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + chunked, read=True)
    assert out.startswith(b"HTTP/1.1 200"), out[:200]
    # A body ending in trailers must never be forwarded undecided (that
    # would skip the policies): the filter refuses it (400), or the HTTP/1
    # codec drops the trailers and the policy applies (403), never 200.
    blocked = j({"model": "blocked-model", "messages": OK_MSGS})
    out = raw(port, head + b"transfer-encoding: chunked\r\nte: trailers\r\nconnection: close\r\n\r\n"
              + b"%x\r\n%s\r\n0\r\nx-trailer: 1\r\n\r\n" % (len(blocked), blocked), read=True)
    assert out.startswith(b"HTTP/1.1 400") or out.startswith(b"HTTP/1.1 403"), out[:200]
    # Body cut short, then the client goes away (mid-buffering).
    raw(port, head + b"content-length: 1000\r\n\r\n" + body[:20])
    # Whole request, gone before the answer (mid-pick or mid-response).
    for _ in range(5):
        raw(port, head + b"content-length: %d\r\n\r\n" % len(body) + body)
    stream = j({"model": MODEL, "messages": OK_MSGS, "max_tokens": 200, "stream": True})
    raw(port, head + b"content-length: %d\r\n\r\n" % len(stream) + stream)
    # Envoy has seen every one of those clients go.
    wait_until("the vanished clients' connections closed",
               lambda: stack.envoy.stat("http.kvasir.downstream_cx_active") == 0, timeout=10)
    # Still serving.
    got, _, rb = request("POST", port, CHAT, body, {"authorization": "Bearer sk-e2e-acme"})
    assert got == 200, rb
