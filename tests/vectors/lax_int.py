"""The expected outcomes of tests/vectors/lax_int.json, computed with
pydantic v2 (the validator vLLM 0.34 runs on every request body) and
vLLM's rendering of its validation errors.

vLLM reads a body with `json.loads` and validates it with pydantic v2 in
lax (Python) mode, so an `int` field accepts more than JSON integers. The
filter (filter/src/request/int.rs) and the simulator
(sim/src/validation.rs) each follow that independently; their Rust tests
read lax_int.json, and tests/e2e/test_lax_int_vectors.py checks that the
file is what this script computes.

    python3 tests/vectors/lax_int.py           # prints the JSON
    python3 tests/vectors/lax_int.py --write   # rewrites lax_int.json

Needs pydantic 2 (the repository's file was made with the version it names).
The models below carry only the fields the two implementations read, in the
order of vLLM's request models (`ChatCompletionRequest`,
`CompletionRequest` in vllm/entrypoints/openai/*/protocol.py): pydantic
reports errors in field order.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import pydantic
from pydantic import BaseModel, Field, ValidationError

HERE = Path(__file__).resolve().parent
OUT = HERE / "lax_int.json"

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Int(BaseModel):
    value: int


class Chat(BaseModel):
    messages: list[Any]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = None
    min_tokens: int = 0
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)


class Completion(BaseModel):
    model: str | None = None
    prompt: (
        list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
        | str
        | list[str]
        | None
    ) = None
    max_tokens: int | None = 16
    n: int = 1
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = None
    min_tokens: int = 0
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)


# A lax `int` field: JSON text of the value -> accepted value or error type.
# (JSON integer literals past u64 are left out: Python reads them as ints,
# serde_json as floats; each implementation documents that case.)
INTS = [
    "100", "0", "-5", "9223372036854775807", "9223372036854775808", "18446744073709551615",
    "1e2", "1E+2", "100.0", "-0.0", "2e1", "9.2e18", "9.223372036854775807e18", "-9.223372036854775808e18",
    "1e20", "1.5", "1e-300", "0.5",
    "true", "false",
    '"100"', '" 7\\n"', '"\\t8\\t"', '"1_000"', '"100.000"', '"1_000.00"', '"+5"', '"-5"', '"007"', '"0.0"',
    '"-0"', '"0_0"', '"18446744073709551615"', '"18446744073709551616"', '"99999999999999999999.000"',
    '"\\u00a07"', '"\\u30007"', '"7\\u0085"', '"\\u000b7\\u000c"',
    '"1e2"', '"100."', '".0"', '"0x10"', '"100.5"', '"_1"', '"1_"', '"1__0"', '"1.0_0"', '""', '" "',
    '"+ 5"', '"++1"', '"+-1"', '"1.0e0"', '"-.0"', '"0."', '"\\u001c7"', '"\\u200b7"', '"\\ufeff7"',
    '"\\uff11\\uff12"', '"\\u0663"', '"1\\u0000"', '"abc"',
    "null", "[]", "[1]", "{}",
]

# Whole bodies whose 400 is checked word for word (vLLM's message and
# `param`), or accepted with the values read.
BODIES = [
    ("chat", '{"messages": [], "max_tokens": "1e2"}'),
    ("chat", '{"messages": [], "max_tokens": 1e20}'),
    ("chat", '{"messages": [], "max_tokens": 1.5, "n": "x", "priority": "high"}'),
    ("chat", '{"messages": [], "max_completion_tokens": [3], "seed": 9223372036854775808}'),
    ("chat", '{"messages": [], "top_k": "1.0_0", "min_tokens": null}'),
    ("chat", '{"messages": [], "priority": "-99999999999999999999"}'),
    ("chat", '{"messages": [], "max_tokens": " 12 ", "max_completion_tokens": "1_0", "n": true}'),
    ("completions", '{"prompt": [1.5]}'),
    ("completions", '{"prompt": [-1], "max_tokens": "x"}'),
    ("completions", '{"prompt": ["a", 1]}'),
    ("completions", '{"prompt": [[1], "2"]}'),
    ("completions", '{"prompt": 5}'),
    ("completions", '{"prompt": [1e20, true]}'),
    ("completions", '{"prompt": [1, "2", true, 3.0], "max_tokens": "100.000", "n": null}'),
    ("completions", '{"prompt": [["1_0"], [2]]}'),
    ("completions", '{"prompt": ["1", "2"]}'),
]

_INTERNAL = {"function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
             "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call", "arguments",
             "is-instance", "is-subclass", "callable", "str", "int", "float", "bool", "bytes", "bytearray",
             "list", "tuple", "dict", "set", "frozenset", "complex", "none", "nonetype"}


def _summary(value: Any) -> Any:
    """vLLM's stand-in for an error's input: containers described, long
    strings cut, anything else as its `str`."""
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


def _loc(loc: tuple) -> str:
    """`body` and the location, pydantic's member names dropped (as vLLM
    cleans them)."""
    parts = [str(p) for p in ("body", *loc)]
    return ".".join(p for p in parts if not re.search(r"[\[\]{}()]", p) and p.lower() not in _INTERNAL)


def vllm_400(e: ValidationError) -> dict[str, str]:
    """vLLM's 400 for a body pydantic refused: `param` and `message`."""
    errors = e.errors(include_url=False)
    rendered = []
    for err in errors[:10]:
        err = dict(err)
        err["input"] = _summary(err["input"])
        err["loc"] = _loc(err["loc"])
        rendered.append(str(err)[:1000])
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {r}\n" for r in rendered)
    if len(errors) > 10:
        message += f"  ...and {len(errors) - 10} more {label}\n"
    return {"param": _loc(errors[0]["loc"]), "message": message.rstrip()}


def _plain(v: Any) -> Any:
    """A validated value for JSON: ints as decimal strings (they may pass
    2^53), lists kept."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def ints() -> list[dict[str, Any]]:
    out = []
    for text in INTS:
        try:
            v = Int.model_validate({"value": json.loads(text)}).value
            out.append({"json": text, "value": str(v)})
        except ValidationError as e:
            out.append({"json": text, "error": e.errors()[0]["type"]})
    return out


def bodies() -> list[dict[str, Any]]:
    out = []
    for api, text in BODIES:
        model = Chat if api == "chat" else Completion
        try:
            m = model.model_validate(json.loads(text))
            fields = ["max_tokens", "n", "priority"] + (["max_completion_tokens"] if api == "chat" else ["prompt"])
            out.append({"api": api, "body": text, "accepted": {f: _plain(getattr(m, f)) for f in fields}})
        except ValidationError as e:
            out.append({"api": api, "body": text, **vllm_400(e)})
    return out


def compute() -> dict[str, Any]:
    return {
        "about": "Lax `int` parsing as vLLM 0.34 validates request bodies (pydantic v2, Python mode, after "
                 "json.loads). Made by tests/vectors/lax_int.py with the pydantic version below; "
                 "tests/e2e/test_lax_int_vectors.py checks it still matches. `ints`: a field's JSON text "
                 "and the int pydantic reads (`value`, decimal) or its error type. `bodies`: vLLM's 400 "
                 "(`param`, `message`) for a chat or completions body, or the values it reads.",
        "pydantic": pydantic.VERSION,
        "ints": ints(),
        "bodies": bodies(),
    }


def render(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    text = render(compute())
    if "--write" in sys.argv:
        OUT.write_text(text)
    else:
        sys.stdout.write(text)
