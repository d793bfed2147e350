"""Every generation API vLLM 0.34 serves, end to end through the real
stack (Envoy + the wasm filter + the cache-indexer + three vllm-sims with
the Responses store on): Anthropic Messages and the Responses API, streamed
and not, each conversation served by the engine the pick chose, its prefix
found cached on later turns, its usage in the per-tenant stats; a
`previous_response_id` chain always served by the engine that holds it,
even when another engine holds a longer copy of its prompt; an unknown id
answered as vLLM answers it; `GET` and `cancel` by id; count_tokens.

Which engine served is read from `x-gateway-destination-endpoint-served`
(the stack's `exposeServedEndpoint`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvasir_harness import (MODEL, POLICY, SETTINGS, Processes, compile_plugin, indexer_for, request, restart_sim,
                            sse_events, sse_named_events, start_envoy, start_sim, wait_envoy, wait_sim, wait_until)
from kvasir_harness.prom import total as prom_total
from conftest import Stack

SERVED = "x-gateway-destination-endpoint-served"
M = MODEL.replace("/", "_")
TENANT = f"wasmcustom.kvasir.tenant.acme.model.{M}"


def system_text(tag: str, words: int = 240) -> str:
    # Unique per test so other tests' caches do not interfere; long enough
    # (hundreds of tokens) that reuse shows as whole KV blocks.
    return f"[{tag}] " + " ".join(f"clause{i % 29} of the {tag} rulebook" for i in range(words // 5))


# ---------------------------------------------------------------------------
# Anthropic Messages
# ---------------------------------------------------------------------------


def anthropic_prompt(usage: dict[str, int]) -> int:
    """The whole prompt of an Anthropic usage: vLLM reports `input_tokens`
    without the tokens read from or written to the cache."""
    return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) + usage.get("cache_creation_input_tokens", 0)


def messages_turn(stack: Stack, system: str, msgs: list[dict[str, Any]], stream: bool) -> tuple[str, dict, str]:
    body = {"model": MODEL, "system": system, "messages": msgs, "max_tokens": 6, "stream": stream}
    status, h, b = stack.envoy.post("/v1/messages", body)
    assert status == 200, b
    if not stream:
        r = json.loads(b)
        assert r["type"] == "message" and r["role"] == "assistant", r
        return h[SERVED], r["usage"], "".join(c["text"] for c in r["content"] if c["type"] == "text")
    events = sse_named_events(b)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert "message_delta" in names and "content_block_delta" in names, names
    for name, data in events:
        assert data["type"] == name, (name, data)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    usage = [d["usage"] for n, d in events if n == "message_delta"][-1]
    return h[SERVED], usage, text


def test_an_anthropic_conversation_stays_on_its_engine_and_reuses_its_prefix(stack: Stack):
    stack.need_indexer()
    before = {k: stack.envoy.stat(f"{TENANT}.{k}") for k in ("prompt_tokens.cached", "prompt_tokens.uncached",
                                                               "completion_tokens")}
    prompt = cached = 0
    for stream in (False, True):
        system = system_text(f"anthropic-{stream}-{uuid.uuid4().hex[:6]}")
        msgs: list[dict[str, Any]] = []
        turns = []
        for t in range(3):
            msgs.append({"role": "user", "content": [{"type": "text", "text": f"question {t}: what about part {t * 7}?"}]})
            served, usage, text = messages_turn(stack, system, msgs, stream)
            turns.append((served, usage))
            prompt += anthropic_prompt(usage)
            cached += usage.get("cache_read_input_tokens", 0)
            msgs.append({"role": "assistant", "content": text})
        assert {s for s, _ in turns} <= set(stack.by_address()), turns
        assert len({s for s, _ in turns}) == 1, turns
        # vLLM's Anthropic usage: input_tokens excludes what was read from
        # the cache; later turns read the earlier turns' blocks.
        for (_, usage), (_, prev) in zip(turns[1:], turns):
            assert usage["cache_read_input_tokens"] >= anthropic_prompt(prev) - 16, turns
            assert usage["output_tokens"] == 6
    after = {k: stack.envoy.stat(f"{TENANT}.{k}") - v for k, v in before.items()}
    assert after["completion_tokens"] == 6 * 6, after
    # Charged as the engine reported: cached = cache reads, the rest of the
    # whole prompt uncached.
    assert after["prompt_tokens.cached"] == cached > 0, (after, cached)
    assert after["prompt_tokens.cached"] + after["prompt_tokens.uncached"] == prompt, (after, prompt)


def test_anthropic_count_tokens_counts_the_rendered_prompt(stack: Stack):
    system = system_text(f"count-{uuid.uuid4().hex[:6]}")
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    status, _, b = stack.envoy.post("/v1/messages/count_tokens", {"model": MODEL, "system": system, "messages": msgs})
    assert status == 200, b
    counted = json.loads(b)["input_tokens"]
    # The same conversation, generated: its prompt is what was counted.
    _, usage, _ = messages_turn(stack, system, msgs, stream=False)
    assert counted == anthropic_prompt(usage) > 100, (counted, usage)


def test_anthropic_errors_come_in_anthropics_shape(stack: Stack):
    status, _, b = stack.envoy.post("/v1/messages", {"model": MODEL, "messages": "not a list", "max_tokens": 4})
    assert status == 400, b
    r = json.loads(b)
    assert r["type"] == "error" and r["error"]["type"] == "invalid_request_error" and r["error"]["message"], r


# ---------------------------------------------------------------------------
# The Responses API
# ---------------------------------------------------------------------------


def responses_turn(stack: Stack, body: dict[str, Any], stream: bool) -> tuple[str, str, dict, str]:
    """(served engine, response id, usage, output text) of one turn."""
    status, h, b = stack.envoy.post("/v1/responses", {"model": MODEL, "max_output_tokens": 6, "stream": stream, **body})
    assert status == 200, b
    if not stream:
        r = json.loads(b)
        # `max_output_tokens` reached: vLLM ends the response `incomplete`.
        assert r["object"] == "response" and r["status"] == "incomplete", r
        text = "".join(c["text"] for o in r["output"] if o["type"] == "message" for c in o["content"]
                       if c["type"] == "output_text")
        return h[SERVED], r["id"], r["usage"], text
    events = sse_named_events(b)
    names = [n for n, _ in events]
    assert names[0] == "response.created" and names[-1] == "response.incomplete", names
    seqs = [d["sequence_number"] for _, d in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    created = events[0][1]["response"]
    done = events[-1][1]["response"]
    assert created["id"] == done["id"]
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    return h[SERVED], done["id"], done["usage"], text


def test_a_previous_response_id_chain_is_served_by_the_engine_holding_it(stack: Stack):
    """Several chains, streamed and not. After each chain's first turn a
    longer copy of its conversation is planted on ANOTHER engine (sent to
    that engine directly, as traffic from outside the router would be), so
    prefix scoring alone would move the chain there; the stored response
    only exists on its own engine, and the chain must stay there."""
    stack.need_indexer()
    engines = stack.by_address()
    before = {k: stack.envoy.stat(f"{TENANT}.{k}") for k in ("prompt_tokens.cached", "completion_tokens")}
    hits_before = stack.indexer.metric("kvasir_indexer_response_lookups_total", result="hit")
    completion = 0
    for c in range(4):
        stream = c % 2 == 1
        tag = f"chain-{c}-{uuid.uuid4().hex[:6]}"
        instructions = system_text(tag)
        served, rid, usage, text = responses_turn(
            stack, {"instructions": instructions, "input": f"{tag}: first question?"}, stream)
        completion += usage["output_tokens"]
        home = served
        # The decoy: the same instructions and first question plus more, on
        # another engine, straight to its port.
        other = next(s for a, s in engines.items() if a != home)
        decoy = {"model": MODEL, "instructions": instructions, "max_output_tokens": 2, "store": False,
                 "input": [{"role": "user", "content": f"{tag}: first question?"},
                           {"role": "assistant", "content": text},
                           {"role": "user", "content": f"{tag}: second question? " + "padding " * 200}]}
        status, _, b = request("POST", other.port, "/v1/responses", json.dumps(decoy), {"content-type": "application/json"})
        assert status == 200, b
        prev_prompt = usage["input_tokens"]
        for t in range(2, 5):
            # `instructions` are not carried over from the previous response
            # (vLLM drops its system message, as OpenAI does): a client sends
            # them on every turn, and then the whole earlier prompt is reused.
            served, rid2, usage, text = responses_turn(
                stack, {"previous_response_id": rid, "instructions": instructions, "input": f"{tag}: question {t}?"},
                stream)
            completion += usage["output_tokens"]
            assert served == home, (c, t, served, home)
            assert rid2 != rid
            # vLLM prepends the stored conversation: its prompt is cached.
            assert usage["input_tokens_details"]["cached_tokens"] >= prev_prompt - 16, (c, t, usage, prev_prompt)
            prev_prompt = usage["input_tokens"]
            rid = rid2
        # GET by id goes to the same engine and returns the stored response.
        status, h, b = request("GET", stack.envoy.port, f"/v1/responses/{rid}", None,
                               {"authorization": "Bearer sk-e2e-acme"})
        assert status == 200, b
        assert h[SERVED] == home and json.loads(b)["id"] == rid
    after = {k: stack.envoy.stat(f"{TENANT}.{k}") - v for k, v in before.items()}
    assert after["completion_tokens"] == completion, (after, completion)
    assert after["prompt_tokens.cached"] > 0
    # Every follow-up and GET was placed by the indexer's response record,
    # not by prefix scoring.
    hits = stack.indexer.metric("kvasir_indexer_response_lookups_total", result="hit") - hits_before
    assert hits >= 4 * (3 + 1), hits


def test_an_unknown_response_id_gets_vllms_own_error(stack: Stack):
    stack.need_indexer()
    rid = f"resp_{uuid.uuid4().hex}"
    for stream in (False, True):
        status, _, b = stack.envoy.post("/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": rid,
                                                          "stream": stream})
        assert status == 404, b
        assert json.loads(b) == {"error": {"message": f"Response with id '{rid}' not found.",
                                           "type": "invalid_request_error", "param": "response_id", "code": 404}}
    status, _, b = request("GET", stack.envoy.port, f"/v1/responses/{rid}", None, {"authorization": "Bearer sk-e2e-acme"})
    assert status == 404, b
    assert json.loads(b)["error"]["message"] == f"Response with id '{rid}' not found."


def test_cancel_by_id_reaches_the_engine_holding_the_response(stack: Stack):
    stack.need_indexer()
    served, rid, _, _ = responses_turn(stack, {"input": f"cancel me {uuid.uuid4().hex}"}, stream=False)
    status, h, b = stack.envoy.post(f"/v1/responses/{rid}/cancel", None, raw=True)
    # A finished (synchronous) response cannot be cancelled: the engine that
    # holds it says so, as vLLM does; any other engine would answer 404.
    assert h.get(SERVED) == served, (status, h, b)
    assert status == 400, b
    assert json.loads(b)["error"]["message"] == "Cannot cancel a synchronous response."


def test_responses_usage_is_charged_once_per_request(stack: Stack):
    """A stored response read back with GET is not charged again."""
    before = stack.envoy.stat(f"{TENANT}.completion_tokens")
    _, rid, usage, _ = responses_turn(stack, {"input": f"charge me {uuid.uuid4().hex}"}, stream=False)
    assert stack.envoy.stat(f"{TENANT}.completion_tokens") - before == usage["output_tokens"] == 6
    status, _, b = request("GET", stack.envoy.port, f"/v1/responses/{rid}", None, {"authorization": "Bearer sk-e2e-acme"})
    assert status == 200, b
    assert stack.envoy.stat(f"{TENANT}.completion_tokens") - before == 6


def test_chat_completions_still_report_usage_as_before(stack: Stack):
    # The OpenAI chat path is unchanged by the new APIs (a guard on the
    # shared parsing and usage code).
    status, _, b = stack.envoy.post("/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": 3,
                                                              "stream_options": {"include_usage": True},
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, b
    assert [e["usage"] for e in sse_events(b) if e.get("usage")][-1]["completion_tokens"] == 3


def test_the_indexer_found_each_engines_kv_event_sockets_on_the_engine(stack: Stack):
    """The stack gives the indexer only the engines' HTTP addresses: every
    endpoint's event stream came from its GET /kv_event_sources, and is in
    sync (the routing tests above depend on it)."""
    stack.need_indexer()
    text = stack.indexer.metrics_text()
    for address in stack.by_address():
        assert prom_total(text, "kvasir_indexer_kv_event_source_lookups_total", endpoint=address) >= 1, address
        assert prom_total(text, "kvasir_indexer_kv_event_source_failures_total", endpoint=address) == 0, address
        assert prom_total(text, "kvasir_indexer_sync_state", endpoint=address, state="in_sync") == 1, address


def test_a_chain_whose_engine_died_is_refused_then_unknown_after_its_restart(artifacts, logdir):
    """Its own small stack (two engines), since an engine is killed. While
    the engine holding the response is down, the follow-up is refused (503,
    or the other engine's own 404: the response lives only there); once the
    engine restarted (its in-memory store, like vLLM's, is gone; the
    indexer sees its new event sockets), the client gets the 404 vLLM gives
    for an unknown id. Never another engine's answer made up without the
    stored conversation."""
    procs = Processes()
    indexer = None
    try:
        sims = [start_sim(logdir, f"gone{i}") for i in range(2)]
        for s in sims:
            procs.add(s.proc)
        indexer = indexer_for(sims, logdir, events_from_engine=True)
        envoy = start_envoy(logdir, compile_plugin(POLICY, SETTINGS), [s.address for s in sims], indexer.address,
                            sims[0].address, name="envoy-gone")
        procs.add(envoy.proc)
        for s in sims:
            wait_sim(s)
        indexer.start()
        wait_envoy(envoy, [s.address for s in sims])
        wait_until("indexer healthy in envoy", lambda: envoy.healthy("kvasir_indexer", [indexer.address]))

        def follow_up(rid: str) -> tuple[int, dict, bytes]:
            return envoy.post("/v1/responses", {"model": MODEL, "input": "and now?", "previous_response_id": rid,
                                                "max_output_tokens": 4})

        status, h, b = envoy.post("/v1/responses", {"model": MODEL, "input": "remember me", "max_output_tokens": 4})
        assert status == 200, b
        home, rid = h[SERVED], json.loads(b)["id"]
        status, h, b = follow_up(rid)
        assert status == 200 and h[SERVED] == home, b
        dead = next(s for s in sims if s.address == home)
        dead.proc.stop()
        # Envoy tries the listed holder, then its fallback balancer: either
        # no engine answered (503) or the other engine did, with vLLM's own
        # 404 for an id it does not hold.
        status, _, b = follow_up(rid)
        assert status in (503, 404), b
        if status == 404:
            assert json.loads(b)["error"]["message"] == f"Response with id '{rid}' not found.", b

        # The same address again, new KV-event sockets, an empty store.
        back = restart_sim(dead, logdir, "gone-restarted")
        procs.add(back.proc)
        wait_sim(back)
        assert back.address == home
        wait_until("the indexer follows the restarted engine's new sockets",
                   lambda: indexer.metric("kvasir_indexer_kv_event_source_changes_total", endpoint=home) >= 1, timeout=40)
        status, _, b = follow_up(rid)
        assert status == 404, b
        assert json.loads(b) == {"error": {"message": f"Response with id '{rid}' not found.",
                                           "type": "invalid_request_error", "param": "response_id", "code": 404}}
        assert indexer.metric("kvasir_indexer_response_lookups_total", result="endpoint_restarted") >= 1
    finally:
        if indexer is not None:
            indexer.stop()
        procs.stop_all()
