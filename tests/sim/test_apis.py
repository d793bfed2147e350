"""vllm-sim's Anthropic Messages, Responses and instrumentation endpoints
against vLLM 0.34's shapes (decoders in vllm_protocol.py, written from vLLM's
protocol classes) and its behaviour: prompts rendered as the equivalent chat
conversation, so prefix caching works across turns and across APIs."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

import vllm_protocol as vp
from conftest import FAST, MODEL, stored_tokens, wait_until

BS = 16
DETAILS = "--enable-prompt-tokens-details"
STORE = "--enable-responses-api-store"
SYSTEM = "You are a careful assistant. " * 12  # several full blocks
QUESTION = "Explain how a paged KV cache is shared between requests with a common prefix."


def stream(sim, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, list[str]]:
    conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, [l for l in text.splitlines() if l.strip()]
    finally:
        conn.close()


def messages_body(messages: list[dict], max_tokens: int = 64, **extra) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "system": SYSTEM, "messages": messages, **extra}


def chat_render(sim, messages: list[dict]) -> list[int]:
    return sim.post_ok("/v1/chat/completions/render", {"model": MODEL, "messages": messages})["token_ids"]


# ---------------------------------------------------------------------------
# Anthropic Messages
# ---------------------------------------------------------------------------
def test_messages_render_as_the_equivalent_chat_and_count_tokens_agrees(sim_factory):
    sim = sim_factory(*FAST, DETAILS)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}]
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "part one\npart two"}]
    ids = sim.post_ok("/v1/messages/render", messages_body(msgs))["token_ids"]
    assert ids == chat_render(sim, chat)
    r = sim.post("/v1/messages/count_tokens", {"model": MODEL, "system": SYSTEM, "messages": msgs})
    assert r.status == 200, r.body
    assert vp.count_tokens_response(r.json()) == len(ids)
    # Its usage splits the same prompt into reads, writes and the rest.
    m = vp.anthropic_message(sim.post_ok("/v1/messages", messages_body(msgs)))
    u = m["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == len(ids)
    assert u["cache_read_input_tokens"] == 0
    assert u["cache_creation_input_tokens"] == len(ids) // BS * BS


def test_messages_second_turn_reads_the_first_from_cache(sim_factory):
    sim = sim_factory(*FAST, DETAILS)
    turn1 = [{"role": "user", "content": QUESTION}]
    first = vp.anthropic_message(sim.post_ok("/v1/messages", messages_body(turn1)))
    assert first["stop_reason"] in ("end_turn", "max_tokens")
    p1 = len(chat_render(sim, [{"role": "system", "content": SYSTEM}, *turn1]))
    turn2 = [*turn1, {"role": "assistant", "content": first["content"][0]["text"]},
             {"role": "user", "content": "And when the cache is full?"}]
    second = vp.anthropic_message(sim.post_ok("/v1/messages", messages_body(turn2)))
    assert second["usage"]["cache_read_input_tokens"] >= p1 // BS * BS, second["usage"]
    # The same conversation through chat completions hits the same blocks.
    chat = [{"role": "system", "content": SYSTEM}, *turn2]
    c = sim.chat(chat, max_tokens=1)
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] >= p1 // BS * BS


def test_messages_stream_follows_vllms_event_sequence(sim_factory):
    sim = sim_factory(*FAST, DETAILS)
    status, headers, lines = stream(sim, "/v1/messages", messages_body([{"role": "user", "content": QUESTION}], stream=True),
                                    {"x-sim-output-tokens": "5"})
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    s = vp.anthropic_stream(lines)
    assert s["order"] == ["message_start", "content_block_start", *["content_block_delta"] * 5,
                          "content_block_stop", "message_delta", "message_stop"]  # vLLM sends no ping
    assert s["start"]["id"].startswith("chatcmpl-")
    assert s["start"]["usage"]["output_tokens"] == 0
    assert s["usage"]["output_tokens"] == 5
    assert s["stop_reason"] == "end_turn"
    start, end = s["start"]["usage"], s["usage"]
    assert {k: v for k, v in start.items() if k != "output_tokens"} == {k: v for k, v in end.items() if k != "output_tokens"}
    # Cut by max_tokens.
    _, _, lines = stream(sim, "/v1/messages", messages_body([{"role": "user", "content": "x"}], max_tokens=2, stream=True))
    assert vp.anthropic_stream(lines)["stop_reason"] == "max_tokens"


def test_messages_usage_without_prompt_token_details_has_no_cache_fields(sim_factory):
    sim = sim_factory(*FAST)
    m = vp.anthropic_message(sim.post_ok("/v1/messages", messages_body([{"role": "user", "content": "hi"}], max_tokens=3)))
    assert set(m["usage"]) == {"input_tokens", "output_tokens"}
    assert m["usage"]["output_tokens"] == 3 and m["stop_reason"] == "max_tokens"


def test_messages_errors_in_each_shape(sim_factory):
    sim = sim_factory(*FAST)
    # A body that does not fit vLLM's request model is refused by FastAPI
    # before the Anthropic router: vLLM's OpenAI shape, "Bad Request".
    r = sim.post("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    e = vp.error_response(r.json(), r.status)
    assert r.status == 400 and e["type"] == "Bad Request" and e["param"] == "body.max_tokens"
    r = sim.post("/v1/messages", messages_body([{"role": "robot", "content": "x"}]))
    assert r.status == 400 and vp.error_response(r.json(), 400)["param"] == "body.messages.0.role"
    r = sim.request("POST", "/v1/messages", raw=json.dumps(messages_body([])).encode(),
                    headers={"Content-Type": "text/plain"})
    assert r.status == 400 and "Unsupported Media Type" in vp.error_response(r.json(), 400)["message"]
    # Errors while serving come back in Anthropic's shape.
    r = sim.post("/v1/messages", {**messages_body([{"role": "user", "content": "x"}]), "model": "no-such-model"})
    assert r.status == 404 and vp.anthropic_error(r.json(), 404)["type"] == "not_found_error"
    r = sim.post("/v1/messages", messages_body([{"role": "user", "content": "x"}], max_tokens=10**9))
    assert r.status == 400 and vp.anthropic_error(r.json(), 400)["type"] == "invalid_request_error"
    r = sim.post("/v1/messages/count_tokens", {"model": "no-such-model", "messages": []})
    assert r.status == 404 and vp.anthropic_error(r.json(), 404)


def test_messages_kv_events_carry_the_chat_prompt(sim_factory):
    sim = sim_factory(*FAST, DETAILS)
    sub = sim_factory.subscribe(sim)  # settled once it returns
    msgs = [{"role": "user", "content": QUESTION}]
    ids = sim.post_ok("/v1/messages/render", messages_body(msgs))["token_ids"]
    sim.post_ok("/v1/messages", messages_body(msgs, max_tokens=1))
    full = len(ids) // BS * BS
    assert wait_until(lambda: len(stored_tokens(sub.events())) >= full)
    assert stored_tokens(sub.events())[:full] == ids[:full]


# ---------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------
def create(sim, **body) -> dict:
    r = sim.post("/v1/responses", {"model": MODEL, **body})
    assert r.status == 200, r.body
    return vp.responses_response(r.json())


def test_responses_render_and_usage(sim_factory):
    sim = sim_factory(*FAST)  # cached tokens are reported whatever the details flag says
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]
    r = create(sim, input=items, instructions=SYSTEM)
    ids = chat_render(sim, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a\nb"}])
    assert r["usage"]["input_tokens"] == len(ids)
    assert r["status"] == "completed" and r["incomplete_details"] is None
    assert r["tool_choice"] == "none" and r["max_output_tokens"] > 0
    assert r["output"][0]["content"][0]["text"]
    assert r["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": len(ids) // BS * BS,
                                                  "input_tokens_per_turn": [], "cached_tokens_per_turn": []}
    again = create(sim, input=items, instructions=SYSTEM, max_output_tokens=2)
    assert again["usage"]["input_tokens_details"]["cached_tokens"] == (len(ids) - 1) // BS * BS
    assert again["status"] == "incomplete"
    assert again["incomplete_details"] == {"reason": "max_output_tokens"}
    assert again["max_output_tokens"] == 2 and again["output"][0]["status"] == "incomplete"
    assert sim.post_ok("/v1/responses/render", {"model": MODEL, "input": items, "instructions": SYSTEM})["token_ids"] == ids


def test_previous_response_id_chain_renders_the_conversation(sim_factory):
    sim = sim_factory(*FAST, STORE)
    chat = [{"role": "system", "content": SYSTEM}]
    prev = None
    last_prompt = 0
    for turn, q in enumerate(["Tell me about caches.", "And eviction?", "And prefix sharing?"]):
        extra = {"previous_response_id": prev} if prev else {}
        r = create(sim, input=q, instructions=SYSTEM, **extra)
        chat.append({"role": "user", "content": q})
        ids = chat_render(sim, chat)
        assert r["usage"]["input_tokens"] == len(ids), f"turn {turn}: not the accumulated conversation"
        assert r["previous_response_id"] == prev
        if turn:
            assert r["usage"]["input_tokens_details"]["cached_tokens"] >= last_prompt // BS * BS
        assert vp.responses_response(sim.get(f"/v1/responses/{r['id']}").json()) == r
        chat.append({"role": "assistant", "content": r["output"][0]["content"][0]["text"]})
        prev, last_prompt = r["id"], len(ids)


def test_responses_ids_errors_and_cancel(sim_factory):
    sim = sim_factory(*FAST, STORE)
    r = sim.get("/v1/responses/resp_unknown")
    assert r.status == 404
    assert r.json() == {"error": {"message": "Response with id 'resp_unknown' not found.",
                                  "type": "invalid_request_error", "param": "response_id", "code": 404}}
    r = sim.post("/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": "resp_gone"})
    assert r.status == 404 and vp.error_response(r.json(), 404)["param"] == "response_id"
    assert sim.post("/v1/responses/resp_unknown/cancel").status == 404
    done = create(sim, input="hello")
    r = sim.post(f"/v1/responses/{done['id']}/cancel")
    assert r.status == 400
    assert vp.error_response(r.json(), 400) == {"message": "Cannot cancel a synchronous response.",
                                                "type": "invalid_request_error", "param": "response_id", "code": 400}
    # Not stored when asked not to.
    unstored = create(sim, input="hello", store=False)
    assert sim.get(f"/v1/responses/{unstored['id']}").status == 404
    r = sim.post("/v1/responses", {"model": MODEL})
    assert r.status == 400 and vp.error_response(r.json(), 400)["param"] == "body.input"
    r = sim.post("/v1/responses", {"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]})
    assert r.status == 400 and vp.error_response(r.json(), 400)["message"] == "Unsupported input item type: item_reference"


def test_store_off_by_default_silently_ignores_store(sim_factory):
    sim = sim_factory(*FAST)
    r = create(sim, input="hello", store=True)
    assert sim.get(f"/v1/responses/{r['id']}").status == 404
    r2 = sim.post("/v1/responses", {"model": MODEL, "input": "more", "previous_response_id": r["id"]})
    assert r2.status == 404
    r3 = sim.post("/v1/responses", {"model": MODEL, "input": "x", "background": True})
    e = vp.error_response(r3.json(), 400)
    assert (e["type"], e["param"]) == ("invalid_request_error", "background")
    assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in e["message"]


def test_responses_stream_events(sim_factory):
    sim = sim_factory(*FAST, STORE)
    status, headers, lines = stream(sim, "/v1/responses", {"model": MODEL, "input": QUESTION, "stream": True},
                                    {"x-sim-output-tokens": "4"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    s = vp.responses_stream(lines)
    assert s["names"].count("response.output_text.delta") == 4
    final = s["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == s["text"]
    assert final["id"] == s["created"]["id"]
    assert vp.responses_response(sim.get(f"/v1/responses/{final['id']}").json()) == final
    _, _, lines = stream(sim, "/v1/responses", {"model": MODEL, "input": QUESTION, "stream": True,
                                               "max_output_tokens": 2, "previous_response_id": final["id"]})
    s = vp.responses_stream(lines)
    assert s["names"][-1] == "response.incomplete"
    assert s["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0


# ---------------------------------------------------------------------------
# /kv_event_sources, /load, /version
# ---------------------------------------------------------------------------
def test_kv_event_sources_point_at_the_publisher(sim_factory):
    sim = sim_factory(*FAST, "--kv-events-topic", "kv@sim", "--data-parallel-rank", "0")
    r = sim.get("/kv_event_sources")
    assert r.status == 200
    sources = vp.kv_event_sources(r.json())
    assert list(sources) == [0]
    cfg = sources[0]
    assert cfg["endpoint"] == sim.ev_endpoint and cfg["replay_endpoint"] == sim.replay_endpoint
    assert cfg["topic"] == "kv@sim" and cfg["enable_kv_cache_events"] and cfg["publisher"] == "zmq"
    off = sim_factory(*FAST, "--kv-events-config", '{"enable_kv_cache_events": false}')
    assert off.get("/kv_event_sources").json() == {}


def test_version_and_load(sim_factory):
    sim = sim_factory(*FAST)
    assert sim.get("/version").json() == {"version": "0.34.0"}
    assert sim.get("/load").json() == {"server_load": 0}
    tracked = sim_factory("--profile", "zero", "--time-scale", "1", "--step-base-ms", "20",
                          "--enable-server-load-tracking")
    t = threading.Thread(target=stream, args=(tracked, "/v1/messages", messages_body(
        [{"role": "user", "content": "x"}], stream=True), {"x-sim-output-tokens": "50"}))
    t.start()
    try:
        assert wait_until(lambda: tracked.get("/load").json()["server_load"] == 1, timeout=5)
    finally:
        t.join()
    assert wait_until(lambda: tracked.get("/load").json()["server_load"] == 0, timeout=5)
