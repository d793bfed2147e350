"""Writes the seed corpora under fuzz/corpus/<target>/ from the project's
own fixtures: the request bodies of the filter's tests, the policy
examples, the CRD and Gateway API examples, the promtext tests' pages, and
KV-event and Session messages built like the simulator and the filter
send them. Deterministic; run from the repository root with the project's
venv (it needs msgpack): .tools/venv/bin/python fuzz/seeds.py
"""

import hashlib
import json
import pathlib
import re
import struct

import msgpack

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
# ApiKind order of the request_body and rewrite targets' first byte.
APIS = ["chat", "completions", "messages", "count_tokens", "responses"]
MAX_SEED = 4096


def write(target, data):
    if isinstance(data, str):
        data = data.encode()
    if len(data) > MAX_SEED:
        return
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)


def raw_strings(path):
    """The Rust raw strings (r#"..."#) of a test file."""
    return re.findall(r'r#"(.*?)"#', path.read_text(), re.S)


def api_of_body(body):
    if "previous_response_id" in body or '"input"' in body or "instructions" in body:
        return "responses"
    if '"system"' in body or "max_tokens" in body and "anthropic" in body:
        return "messages"
    if '"prompt"' in body:
        return "completions"
    return "chat"


def request_bodies():
    files = {
        "filter/src/request/messages_tests.rs": "messages",
        "filter/src/request/responses_tests.rs": "responses",
        "filter/src/request/tests.rs": None,
        "filter/src/engine/api_tests.rs": None,
        "filter/src/engine/body_tests.rs": None,
        "filter/src/engine/request_tests.rs": None,
    }
    out = []
    for f, api in files.items():
        for s in raw_strings(ROOT / f):
            if not s.lstrip().startswith("{"):
                continue
            out.append((api or api_of_body(s), s))
    return out


def requests():
    bodies = request_bodies()
    for api, body in bodies:
        sel = bytes([APIS.index(api)])
        write("request_body", sel + body.encode())
        if api == "messages":
            write("request_body", bytes([APIS.index("count_tokens")]) + body.encode())
    # Rewrite: API byte, flags byte (model, include_usage, priority).
    for i, (api, body) in enumerate(bodies):
        flags = [0x01, 0x09, 0x11, 0x19, 0x1B, 0x1D][i % 6]
        write("rewrite", bytes([APIS.index(api), flags]) + body.encode())


def policies():
    for f in sorted((ROOT / "policy/examples").glob("*.json")):
        write("policy", f.read_text())
    write("policy", (ROOT / "envoy/policy.json").read_text())
    play = json.loads((ROOT / "playground/examples.json").read_text())
    for s in raw_strings(ROOT / "policy/src/lib.rs"):
        if s.lstrip().startswith("{"):
            write("policy", s)
    for f in sorted((ROOT / "policy/tests").glob("*.rs")):
        for s in raw_strings(f):
            if s.lstrip().startswith("{") and '"' in s:
                write("policy", s)
    return play


def yamls(play):
    dirs = ["crds/examples", "gateway-api/examples", "gateway-api/base", "cli/tests/fixtures"]
    for d in dirs:
        for f in sorted((ROOT / d).glob("*.yaml")):
            write("kvasirctl_yaml", f.read_text())
    for s in raw_strings(ROOT / "cli/src/yaml.rs"):
        write("kvasirctl_yaml", s)
    # The playground's sets: the files of each, read as one stream.
    for st in play["sets"]:
        write("kvasirctl_yaml", "\n---\n".join((ROOT / f).read_text() for f in st["files"]))


def pages():
    src = (ROOT / "promtext/src/lib.rs").read_text()
    for s in re.findall(r'"((?:[^"\\]|\\.)*\\n(?:[^"\\]|\\.)*)"', src):
        write("promtext", s.encode().decode("unicode_escape"))
    write("promtext", (
        "# HELP vllm:num_requests_running Running.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m",engine="0"} 3\n'
        'vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 1.2e3 1700000000000\n'
        'kvasir_tenant_requests_total{tenant="a\\"b\\\\c\\nd"} +Inf\n'
        "up NaN\n"))


def kv_events():
    h1, h2, neg = 2**64 - 5, 12345, -(2**40)
    b32 = bytes(range(32))
    maps = [
        {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None,
         "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockStored", "block_hashes": [b32], "parent_block_hash": b32,
         "token_ids": list(range(16)), "block_size": 16, "lora_name": "ad",
         "group_idx": 1, "kv_cache_spec_kind": "sliding_window"},
        {"type": "BlockStored", "block_hashes": [neg], "parent_block_hash": h2,
         "token_ids": [70000] * 16, "block_size": 16},
        {"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [b32, neg], "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNewer", "x": [1, {"y": None}]},
    ]
    arrays = [
        ["BlockStored", [h1, h2], None, list(range(32)), 16, None, "GPU", None],
        ["BlockStored", [b32], b32, list(range(16)), 16],
        ["BlockStored", [neg], h2, [1] * 16, 16, None, None, None, 0, "full_attention", "extra"],
        ["BlockRemoved", [h2], "GPU"],
        ["BlockRemoved", [b32]],
        ["AllBlocksCleared"],
        ["Unknown", 1, 2],
    ]
    for evs in (maps, arrays):
        for i in range(len(evs)):
            write("kv_events", msgpack.packb([1700000000.5, [evs[i]], 0]))
        write("kv_events", msgpack.packb([1700000000.5, evs, None]))
        write("kv_events", msgpack.packb([1.0, evs, 3, "trailing"]))
    write("kv_events", msgpack.packb([1.0, []]))
    write("kv_events", msgpack.packb([1.0, [], None]))
    # Malformed payloads the wire tests use.
    write("kv_events", msgpack.packb([1, [], None]))
    write("kv_events", msgpack.packb([1.0, [{"block_hashes": []}], None]))
    write("kv_events", msgpack.packb([1.0, [["BlockStored", [1]]], None]))


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(num, value):
    if isinstance(value, int):
        return varint(num << 3) + varint(value)
    if isinstance(value, float):
        return varint(num << 3 | 1) + struct.pack("<d", value)
    if isinstance(value, str):
        value = value.encode()
    return varint(num << 3 | 2) + varint(len(value)) + value


def frame(msg):
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def sessions():
    chat = field(1, field(1, "system") + field(2, "You are terse.")) + \
        field(1, field(1, "user") + field(2, "hello"))
    picks = [
        field(1, "main") + field(2, "llama-3-8b") + field(3, "acme") + field(4, "req-1") +
        field(5, chat) + field(9, 2),
        field(1, "main") + field(4, "req-2") + field(6, "Once upon a time"),
        field(1, "main") + field(4, "req-3") + field(7, field(1, b"".join(varint(i) for i in range(1, 40)))),
    ]
    report = field(1, "main") + field(2, "req-1") + field(3, "127.0.0.1:8000") + field(4, 120) + \
        field(5, 64) + field(6, 30) + field(7, 12.5) + field(8, 340.0) + field(9, 1)
    msgs = [field(1, i + 1) + field(2, p) for i, p in enumerate(picks)]
    msgs.append(field(1, 9) + field(3, report))
    msgs.append(field(1, 10))
    # limit byte (x4 = the limit), split byte, then the wire.
    for limit in (0x40, 0xFF):
        for split in (0, 3, 200):
            write("session_framing", bytes([limit, split]) + b"".join(frame(m) for m in msgs))
    for m in msgs:
        write("session_framing", bytes([0xFF, 7]) + frame(m))
    # A message over the limit after two that fit.
    write("session_framing", bytes([0x10, 2]) + frame(b"a" * 8) + frame(b"") + frame(b"b" * 100))


def main():
    requests()
    play = policies()
    yamls(play)
    pages()
    kv_events()
    sessions()
    for d in sorted(CORPUS.iterdir()):
        files = list(d.iterdir())
        print(f"{d.name}: {len(files)} seeds, {sum(f.stat().st_size for f in files)} bytes")


if __name__ == "__main__":
    main()
