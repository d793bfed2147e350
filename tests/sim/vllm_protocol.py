"""Strict decoders of vLLM 0.34's Anthropic and Responses wire shapes.

Written from vLLM's protocol classes, not from the simulator:
- vllm/entrypoints/anthropic/protocol.py (AnthropicMessagesResponse,
  AnthropicUsage, AnthropicContentBlock, AnthropicStreamEvent, AnthropicDelta,
  AnthropicErrorResponse, AnthropicCountTokensResponse) and its serving.py
  (non-streaming bodies are `model_dump(exclude_none=True)`, stream events
  `model_dump_json(exclude_unset=True)`, `event: <type>` SSE framing);
- vllm/entrypoints/openai/responses/protocol.py (ResponsesResponse,
  ResponseUsage, InputTokensDetails, OutputTokensDetails; dumped with
  `model_dump(mode="json", by_alias=True)`, so every field is present, `metrics`
  excluded when None) and the openai 2.25 event/item types it uses;
- vllm/entrypoints/serve/engine/protocol.py (ErrorResponse / ErrorInfo);
- vllm/config/kv_events.py (KVEventsConfig, the values of /kv_event_sources).

Every decoder rejects unknown keys, missing keys and wrong types.
"""

from __future__ import annotations

import json
from typing import Any

NoneType = type(None)


class ShapeError(AssertionError):
    pass


def _fail(where: str, msg: str) -> None:
    raise ShapeError(f"{where}: {msg}")


def _type(where: str, v: Any, *types: type) -> Any:
    # bool is an int in Python; a field typed int must not take a bool.
    if isinstance(v, bool) and bool not in types:
        _fail(where, f"expected {types}, got bool {v!r}")
    if not isinstance(v, types):
        _fail(where, f"expected {[t.__name__ for t in types]}, got {type(v).__name__} {v!r}")
    return v


def _literal(where: str, v: Any, allowed: tuple) -> Any:
    if v not in allowed:
        _fail(where, f"{v!r} is not one of {allowed}")
    return v


def _keys(where: str, obj: Any, required: set[str], optional: set[str] = frozenset()) -> dict:
    _type(where, obj, dict)
    missing = required - obj.keys()
    unknown = obj.keys() - required - optional
    if missing:
        _fail(where, f"missing {sorted(missing)}")
    if unknown:
        _fail(where, f"unknown {sorted(unknown)}")
    return obj


# ---------------------------------------------------------------------------
# vLLM's OpenAI-shaped ErrorResponse
# ---------------------------------------------------------------------------
def error_response(body: Any, code: int) -> dict:
    _keys("ErrorResponse", body, {"error"})
    e = _keys("ErrorInfo", body["error"], {"message", "type", "code"}, {"param"})
    _type("ErrorInfo.message", e["message"], str)
    _type("ErrorInfo.type", e["type"], str)
    _type("ErrorInfo.param", e.get("param"), str, NoneType)
    if _type("ErrorInfo.code", e["code"], int) != code:
        _fail("ErrorInfo.code", f"{e['code']} != HTTP {code}")
    return e


# ---------------------------------------------------------------------------
# Anthropic
# ---------------------------------------------------------------------------
STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use")
BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
               "redacted_thinking", "tool_addition", "tool_removal")
BLOCK_FIELDS = {"type", "text", "source", "id", "tool_use_id", "name", "input", "content", "is_error",
                "tool_name", "thinking", "signature", "data", "tool"}
ANTHROPIC_ERROR_TYPES = ("invalid_request_error", "authentication_error", "permission_error",
                         "not_found_error", "request_too_large", "rate_limit_error", "overloaded_error",
                         "api_error")


def anthropic_usage(u: Any, where: str = "AnthropicUsage") -> dict:
    _keys(where, u, {"input_tokens", "output_tokens"},
          {"cache_creation_input_tokens", "cache_read_input_tokens"})
    for k, v in u.items():
        _type(f"{where}.{k}", v, int)
    return u


def content_block(b: Any, where: str = "AnthropicContentBlock") -> dict:
    _keys(where, b, {"type"}, BLOCK_FIELDS - {"type"})
    _literal(f"{where}.type", b["type"], BLOCK_TYPES)
    if b["type"] == "text":
        _type(f"{where}.text", b.get("text"), str)
    return b


def anthropic_message(m: Any, streamed_start: bool = False) -> dict:
    """AnthropicMessagesResponse: non-streamed (exclude_none) or the
    message of message_start (exclude_unset, stop fields set to None)."""
    optional = {"stop_reason", "stop_sequence", "usage", "kv_transfer_params", "ec_transfer_params"}
    required = {"id", "type", "role", "content", "model"}
    if streamed_start:
        required |= {"stop_reason", "stop_sequence", "usage"}
    _keys("AnthropicMessagesResponse", m, required, optional)
    _type("id", m["id"], str)
    _literal("type", m["type"], ("message",))
    _literal("role", m["role"], ("assistant",))
    _type("model", m["model"], str)
    for i, b in enumerate(_type("content", m["content"], list)):
        content_block(b, f"content[{i}]")
    if streamed_start:
        if m["content"] != [] or m["stop_reason"] is not None or m["stop_sequence"] is not None:
            _fail("message_start.message", f"not empty: {m}")
    else:
        if "stop_reason" in m:
            _literal("stop_reason", m["stop_reason"], STOP_REASONS)
        if m.get("stop_sequence") is None and "stop_sequence" in m:
            _fail("stop_sequence", "None must be excluded (exclude_none)")
    if "usage" in m:
        anthropic_usage(m["usage"])
    return m


def anthropic_error(body: Any, status: int) -> dict:
    _keys("AnthropicErrorResponse", body, {"type", "error"})
    _literal("type", body["type"], ("error",))
    e = _keys("AnthropicError", body["error"], {"type", "message"})
    _literal("AnthropicError.type", e["type"], ANTHROPIC_ERROR_TYPES)
    _type("AnthropicError.message", e["message"], str)
    expected = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}.get(status, "api_error" if status >= 500 else "invalid_request_error")
    if e["type"] != expected:
        _fail("AnthropicError.type", f"{e['type']} for HTTP {status}, vLLM's translate_error_type gives {expected}")
    return e


def count_tokens_response(body: Any) -> int:
    _keys("AnthropicCountTokensResponse", body, {"input_tokens"}, {"context_management"})
    n = _type("input_tokens", body["input_tokens"], int)
    if "context_management" in body:
        cm = _keys("AnthropicContextManagement", body["context_management"], {"original_input_tokens"})
        _type("original_input_tokens", cm["original_input_tokens"], int)
    return n


def sse_events(lines: list[str]) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) pairs from SSE lines (blank lines dropped)."""
    out: list[tuple[str | None, Any]] = []
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[len("data: "):])))
            name = None
        else:
            _fail("SSE", f"unexpected line {line!r}")
    return out


STREAM_EVENT_FIELDS = {"type", "message", "delta", "content_block", "index", "error", "usage"}
DELTA_FIELDS = {"type", "text", "thinking", "partial_json", "signature", "stop_reason", "stop_sequence"}


def anthropic_stream(lines: list[str]) -> dict:
    """Checks a /v1/messages stream event by event and its order; returns
    the message_start message, the text, and the final usage/stop."""
    events = sse_events(lines)
    if not events:
        _fail("stream", "no events")
    order = []
    text = ""
    start = final_usage = stop = None
    open_index = None
    next_index = 0
    for n, (name, ev) in enumerate(events):
        where = f"event {n} ({name})"
        _keys(where, ev, {"type"}, STREAM_EVENT_FIELDS - {"type"})
        t = _literal(f"{where}.type", ev["type"], ("message_start", "message_delta", "message_stop",
                                                 "content_block_start", "content_block_delta",
                                                 "content_block_stop", "ping", "error"))
        if name != t:
            _fail(where, f"SSE event name {name!r} != data.type {t!r}")
        order.append(t)
        if t == "message_start":
            _keys(where, ev, {"type", "message"})
            start = anthropic_message(ev["message"], streamed_start=True)
        elif t == "content_block_start":
            _keys(where, ev, {"type", "content_block", "index"})
            content_block(ev["content_block"])
            if ev["index"] != next_index or open_index is not None:
                _fail(where, f"block {ev['index']} starts while {open_index} open / expected {next_index}")
            open_index = ev["index"]
        elif t == "content_block_delta":
            _keys(where, ev, {"type", "delta", "index"})
            d = _keys(f"{where}.delta", ev["delta"], {"type"}, DELTA_FIELDS - {"type"})
            if ev["index"] != open_index:
                _fail(where, f"delta for block {ev['index']}, open is {open_index}")
            if d["type"] == "text_delta":
                _keys(f"{where}.delta", d, {"type", "text"})
                text += _type(f"{where}.delta.text", d["text"], str)
        elif t == "content_block_stop":
            _keys(where, ev, {"type", "index"})
            if ev["index"] != open_index:
                _fail(where, f"stop for block {ev['index']}, open is {open_index}")
            open_index = None
            next_index += 1
        elif t == "message_delta":
            _keys(where, ev, {"type", "delta", "usage"})
            d = _keys(f"{where}.delta", ev["delta"], {"stop_reason", "stop_sequence"})
            stop = _literal(f"{where}.stop_reason", d["stop_reason"], STOP_REASONS)
            final_usage = anthropic_usage(ev["usage"])
        elif t == "message_stop":
            _keys(where, ev, {"type"})
        elif t == "error":
            _keys(where, ev, {"type", "error"})
    body = [t for t in order if t != "ping"]
    if body[0] != "message_start" or body[-2:] != ["message_delta", "message_stop"]:
        _fail("stream order", f"{order}")
    if open_index is not None:
        _fail("stream order", f"block {open_index} never stopped: {order}")
    return {"start": start, "text": text, "usage": final_usage, "stop_reason": stop, "order": order}


# ---------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------
RESPONSE_FIELDS = {
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object", "output",
    "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background", "max_output_tokens",
    "max_tool_calls", "previous_response_id", "prompt", "prompt_cache_options", "prompt_cache_key",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "status", "text",
    "top_logprobs", "truncation", "usage", "user", "presence_penalty", "frequency_penalty",
    "kv_transfer_params", "ec_transfer_params", "input_messages", "output_messages",
}
RESPONSE_STATUS = ("completed", "failed", "in_progress", "cancelled", "queued", "incomplete")


def output_text(p: Any, where: str) -> dict:
    _keys(where, p, {"annotations", "text", "type"}, {"logprobs"})
    _literal(f"{where}.type", p["type"], ("output_text",))
    _type(f"{where}.text", p["text"], str)
    _type(f"{where}.annotations", p["annotations"], list)
    _type(f"{where}.logprobs", p.get("logprobs"), list, NoneType)
    return p


def output_message(m: Any, where: str = "ResponseOutputMessage") -> dict:
    _keys(where, m, {"id", "content", "role", "status", "type"}, {"phase"})
    _type(f"{where}.id", m["id"], str)
    _literal(f"{where}.role", m["role"], ("assistant",))
    _literal(f"{where}.status", m["status"], ("in_progress", "completed", "incomplete"))
    _literal(f"{where}.type", m["type"], ("message",))
    _literal(f"{where}.phase", m.get("phase"), (None, "commentary", "final_answer"))
    for i, p in enumerate(_type(f"{where}.content", m["content"], list)):
        output_text(p, f"{where}.content[{i}]")
    return m


def response_usage(u: Any) -> dict:
    _keys("ResponseUsage", u, {"input_tokens", "input_tokens_details", "output_tokens",
                               "output_tokens_details", "total_tokens"})
    d = _keys("InputTokensDetails", u["input_tokens_details"],
              {"cached_tokens", "cache_write_tokens", "input_tokens_per_turn", "cached_tokens_per_turn"})
    o = _keys("OutputTokensDetails", u["output_tokens_details"],
              {"reasoning_tokens", "tool_output_tokens", "output_tokens_per_turn", "tool_output_tokens_per_turn"})
    for k in ("input_tokens", "output_tokens", "total_tokens"):
        _type(k, u[k], int)
    for k in ("cached_tokens", "cache_write_tokens"):
        _type(k, d[k], int)
    for k in ("reasoning_tokens", "tool_output_tokens"):
        _type(k, o[k], int)
    for part, keys in ((d, ("input_tokens_per_turn", "cached_tokens_per_turn")),
                       (o, ("output_tokens_per_turn", "tool_output_tokens_per_turn"))):
        for k in keys:
            _type(k, part[k], list)
    if u["total_tokens"] != u["input_tokens"] + u["output_tokens"]:
        _fail("ResponseUsage", f"total {u['total_tokens']} != input + output")
    return u


def responses_response(r: Any) -> dict:
    _keys("ResponsesResponse", r, RESPONSE_FIELDS)
    _type("id", r["id"], str)
    _type("created_at", r["created_at"], int)
    _literal("object", r["object"], ("response",))
    _type("model", r["model"], str)
    _type("instructions", r["instructions"], str, NoneType)
    _type("parallel_tool_calls", r["parallel_tool_calls"], bool)
    _type("temperature", r["temperature"], float, int)
    _type("top_p", r["top_p"], float, int)
    _type("tools", r["tools"], list)
    _type("tool_choice", r["tool_choice"], str, dict)
    _type("background", r["background"], bool)
    _type("max_output_tokens", r["max_output_tokens"], int)
    _type("previous_response_id", r["previous_response_id"], str, NoneType)
    _literal("service_tier", r["service_tier"], ("auto", "default", "flex", "scale", "priority"))
    _literal("status", r["status"], RESPONSE_STATUS)
    _literal("truncation", r["truncation"], ("auto", "disabled"))
    _type("top_logprobs", r["top_logprobs"], int, NoneType)
    if r["incomplete_details"] is not None:
        _keys("IncompleteDetails", r["incomplete_details"], {"reason"})
        _literal("reason", r["incomplete_details"]["reason"], ("max_output_tokens", "content_filter"))
    if (r["status"] == "incomplete") != (r["incomplete_details"] is not None):
        _fail("incomplete_details", f"status {r['status']} with {r['incomplete_details']}")
    for i, item in enumerate(_type("output", r["output"], list)):
        output_message(item, f"output[{i}]")
    if r["usage"] is not None:
        response_usage(r["usage"])
    return r


EVENT_FIELDS = {
    "response.created": {"response", "sequence_number", "type"},
    "response.in_progress": {"response", "sequence_number", "type"},
    "response.completed": {"response", "sequence_number", "type"},
    "response.incomplete": {"response", "sequence_number", "type"},
    "response.output_item.added": {"item", "output_index", "sequence_number", "type"},
    "response.output_item.done": {"item", "output_index", "sequence_number", "type"},
    "response.content_part.added": {"content_index", "item_id", "output_index", "part", "sequence_number", "type"},
    "response.content_part.done": {"content_index", "item_id", "output_index", "part", "sequence_number", "type"},
    "response.output_text.delta": {"content_index", "delta", "item_id", "logprobs", "output_index",
                                   "sequence_number", "type"},
    "response.output_text.done": {"content_index", "item_id", "logprobs", "output_index", "sequence_number",
                                  "text", "type"},
}


def responses_stream(lines: list[str]) -> dict:
    """Checks a /v1/responses stream (the simple path's content events)
    field by field, its order and sequence numbers; returns the final
    response and the streamed text."""
    events = sse_events(lines)
    names = []
    text = ""
    item_id = None
    for n, (name, ev) in enumerate(events):
        where = f"event {n} ({name})"
        t = ev.get("type")
        if t not in EVENT_FIELDS:
            _fail(where, f"unexpected type {t!r}")
        _keys(where, ev, EVENT_FIELDS[t])
        if name != t:
            _fail(where, f"SSE event name {name!r} != type {t!r}")
        if ev["sequence_number"] != n:
            _fail(where, f"sequence_number {ev['sequence_number']} != {n}")
        names.append(t)
        if "response" in ev:
            responses_response(ev["response"])
        if "item" in ev:
            output_message(ev["item"], f"{where}.item")
            item_id = item_id or ev["item"]["id"]
        if "part" in ev:
            output_text(ev["part"], f"{where}.part")
        if "item_id" in ev and ev["item_id"] != item_id:
            _fail(where, f"item_id {ev['item_id']} != {item_id}")
        if t == "response.output_text.delta":
            text += _type(f"{where}.delta", ev["delta"], str)
        if t == "response.output_text.done" and ev["text"] != text:
            _fail(where, f"done text {ev['text']!r} != deltas {text!r}")
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = names[len(head):len(names) - len(tail) - 1]
    if (names[:len(head)] != head or names[-len(tail) - 1:-1] != tail or not deltas
            or set(deltas) != {"response.output_text.delta"}
            or names[-1] not in ("response.completed", "response.incomplete")):
        _fail("stream order", f"{names}")
    first, final = events[0][1]["response"], events[-1][1]["response"]
    if first["status"] != "in_progress" or first["output"] != [] or first["usage"] is not None:
        _fail("response.created", f"not an empty in-progress response: {first}")
    if (final["status"] == "incomplete") != (names[-1] == "response.incomplete"):
        _fail("terminal event", f"{names[-1]} with status {final['status']}")
    return {"response": final, "text": text, "names": names, "created": first}


# ---------------------------------------------------------------------------
# /kv_event_sources, /load, /version
# ---------------------------------------------------------------------------
def kv_event_sources(body: Any) -> dict[int, dict]:
    _type("kv_event_sources", body, dict)
    out = {}
    for rank, cfg in body.items():
        if not rank.isdigit():
            _fail("kv_event_sources", f"key {rank!r} is not a data-parallel rank")
        _keys(f"KVEventsConfig[{rank}]", cfg, {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
                                              "buffer_steps", "hwm", "max_queue_size", "topic"})
        _type("enable_kv_cache_events", cfg["enable_kv_cache_events"], bool)
        _literal("publisher", cfg["publisher"], ("null", "zmq"))
        _type("endpoint", cfg["endpoint"], str)
        _type("replay_endpoint", cfg["replay_endpoint"], str, NoneType)
        for k in ("buffer_steps", "hwm", "max_queue_size"):
            _type(k, cfg[k], int)
        _type("topic", cfg["topic"], str)
        out[int(rank)] = cfg
    return out
