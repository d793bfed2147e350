"""OpenAI-shaped request bodies and server-sent events, as clients send
and read them through the gateway."""

from __future__ import annotations

import json
from typing import Any

from .paths import MODEL


def chat(model: str = MODEL, content: str = "hello", system: str | None = None, **extra: Any) -> dict[str, Any]:
    """A chat completion body (4 tokens of answer unless `max_tokens` is given)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"model": model, "messages": msgs, "max_tokens": 4, **extra}


def sse_events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body's `data:` lines, `[DONE]` left out."""
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data:"):
            p = line[5:].strip()
            if p and p != "[DONE]":
                out.append(json.loads(p))
    return out


def sse_named_events(body: bytes) -> list[tuple[str | None, Any]]:
    """(event name, JSON payload) of each event of an SSE body, for the
    streams that name their events (Anthropic Messages, the Responses API);
    the name is None where an event has no `event:` line."""
    out: list[tuple[str | None, Any]] = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data and data != ["[DONE]"]:
            out.append((name, json.loads("\n".join(data))))
    return out
