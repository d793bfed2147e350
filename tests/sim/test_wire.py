"""vllm-sim against vLLM's documented wire formats (black box).

Expected behaviour comes from vLLM (0.34 `vllm/distributed/kv_events.py`,
its OpenAI server and Prometheus metrics) as recorded in /work/shared/FACTS.md.
"""

from __future__ import annotations

import json
import random
import struct
import threading
import time

import msgpack
import pytest

from conftest import (
    FAST,
    MODEL,
    SENTINEL_SEQ,
    decode_payload,
    hkey,
    removed,
    replay,
    stored,
    stored_hashes,
    stored_tokens,
    wait_until,
)

BS = 16  # vLLM's default block size; the simulator's too.
U64 = 2**64


def token_prompt(seed: int, n: int) -> list[int]:
    """Deterministic, distinct token ids (ordinary Qwen3 vocabulary range)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def check_chain(evs: list[dict], first_parent, block_size: int = BS) -> None:
    """BlockStored events of one request: block sizes, token counts and parent links."""
    assert evs, "no BlockStored events"
    prev_last = first_parent
    for e in evs:
        assert e["block_size"] == block_size, e
        assert len(e["block_hashes"]) >= 1, e
        assert len(e["token_ids"]) == block_size * len(e["block_hashes"]), \
            f"token_ids ({len(e['token_ids'])}) is not block_size x number of blocks ({len(e['block_hashes'])}): {e}"
        got_parent = None if e["parent_block_hash"] is None else hkey(e["parent_block_hash"])
        assert got_parent == prev_last, f"parent_block_hash {got_parent!r}, expected {prev_last!r}"
        prev_last = hkey(e["block_hashes"][-1])


def seqs(batches) -> list[int]:
    return [b.seq for b in batches]


# ---------------------------------------------------------------------------
# 1. Frame layout
# ---------------------------------------------------------------------------
def test_frame_layout_topic_and_sequence(sim_factory):
    sim = sim_factory(*FAST, "--kv-events-topic", "kv-test")
    info = sim.get("/sim/info").json()
    assert info["kv_events_endpoint"].endswith(f":{sim.ev_port}"), info
    assert info["kv_events_replay_endpoint"].endswith(f":{sim.replay_port}"), info
    sub = sim_factory.subscribe(sim)
    for i in range(3):
        sim.complete(token_prompt(100 + i, 40), max_tokens=1)
    batches = sub.wait(lambda s: len(stored([e for b in s for e in b.events])) >= 3, what="3 BlockStored")
    batches = sub.quiet()
    for frames in sub.raw_frames:
        assert len(frames) == 3, f"message has {len(frames)} frames, vLLM sends 3 (topic, seq, payload)"
        assert frames[0] == b"kv-test", f"topic frame {frames[0]!r}, expected b'kv-test'"
        assert len(frames[1]) == 8, f"sequence frame {frames[1]!r} is not 8 bytes"
        obj = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        assert isinstance(obj, list) and len(obj) == 3, obj
        assert isinstance(obj[0], float), f"ts {obj[0]!r} is not a float"
        assert isinstance(obj[1], list), obj
        assert obj[2] is None or (isinstance(obj[2], int) and not isinstance(obj[2], bool)), obj
    assert seqs(batches) == list(range(len(batches))), f"sequence numbers {seqs(batches)} are not 0,1,2,..."
    now = time.time()
    for b in batches:
        # vLLM stamps each batch with time.time() (wall-clock seconds).
        assert abs(b.ts - now) < 3600, f"batch ts {b.ts} is not wall-clock seconds (now {now})"
        assert b.dp_rank == 0, f"data_parallel_rank {b.dp_rank!r}, expected 0 (the default)"
    assert all(b.events for b in batches), "a batch with no events was published"


# ---------------------------------------------------------------------------
# 2. Shared prefix: full blocks, parent links, token ids, cache hits
# ---------------------------------------------------------------------------
SYSTEM = ("You are a meticulous assistant for a logistics company. Answer questions about "
          "shipments, warehouses, customs paperwork and delivery windows. Always state your "
          "assumptions, cite the relevant policy section, and keep answers under two hundred words. "
          "If a question is ambiguous, ask one clarifying question before answering. ") * 2


def test_shared_prefix_blocks_parents_and_hits(sim_factory):
    sim = sim_factory(*FAST, "--enable-prompt-tokens-details")
    sub = sim_factory.subscribe(sim)
    msgs_a = [{"role": "system", "content": SYSTEM},
              {"role": "user", "content": "Where is shipment 4471 right now?"}]
    msgs_b = [{"role": "system", "content": SYSTEM},
              {"role": "user", "content": "Which customs form do I need for lithium batteries to Norway?"}]
    tok_a, tok_b = sim.tokenize_messages(msgs_a), sim.tokenize_messages(msgs_b)
    full_a = len(tok_a) // BS
    assert full_a >= 5, f"system prompt too short: {len(tok_a)} tokens"

    # --- first chat
    ra = sim.chat(msgs_a, max_tokens=4)
    assert ra["usage"]["prompt_tokens"] == len(tok_a), (ra["usage"], len(tok_a))
    assert ra["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, ra["usage"]
    sub.wait(lambda s: len(stored_tokens([e for b in s for e in b.events])) >= full_a * BS,
             what="first chat's full blocks")
    sub.quiet(0.3)
    ev_a = sub.events()
    n_a = len(sub.snapshot())
    st_a = stored(ev_a)
    assert not removed(ev_a), removed(ev_a)
    check_chain(st_a, None)
    toks = stored_tokens(ev_a)
    assert toks[: full_a * BS] == tok_a[: full_a * BS], \
        "stored token_ids are not /tokenize's ids (chat template, add_generation_prompt) cut to full blocks"
    # Decode tokens may fill further blocks, but no partial block is ever stored.
    assert len(toks) <= ((len(tok_a) + 4) // BS) * BS, (len(toks), len(tok_a))
    hashes_a = stored_hashes(ev_a)
    assert len(set(hashes_a)) == len(hashes_a), "a block hash stored twice in one request"

    # --- second chat sharing the system prompt
    common = 0
    while common < min(len(tok_a), len(tok_b)) and tok_a[common] == tok_b[common]:
        common += 1
    shared_blocks = common // BS
    assert 0 < shared_blocks < len(tok_b) // BS
    hits0 = sim.sample("vllm:prefix_cache_hits_total", model_name=MODEL)
    queries0 = sim.sample("vllm:prefix_cache_queries_total", model_name=MODEL)
    rb = sim.chat(msgs_b, max_tokens=4)
    assert rb["usage"]["prompt_tokens"] == len(tok_b)
    cached = rb["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == shared_blocks * BS, f"cached_tokens {cached}, expected {shared_blocks * BS} (shared full blocks)"
    full_b = len(tok_b) // BS
    need = (full_b - shared_blocks) * BS
    sub.wait(lambda s: len(stored_tokens([e for b in s[n_a:] for e in b.events])) >= need,
             what="second chat's new blocks")
    sub.quiet(0.3)
    ev_b = sub.events(n_a)
    st_b = stored(ev_b)
    check_chain(st_b, hashes_a[shared_blocks - 1])
    toks_b = stored_tokens(ev_b)
    assert toks_b[:need] == tok_b[shared_blocks * BS: full_b * BS], \
        "second chat's stored tokens do not start where the shared prefix ends"
    assert not set(stored_hashes(ev_b)) & set(hashes_a), "a cached prefix block was stored again"

    assert wait_until(lambda: sim.sample("vllm:prefix_cache_hits_total", model_name=MODEL) - hits0 == cached, 3), \
        f"prefix_cache_hits_total moved by {sim.sample('vllm:prefix_cache_hits_total', model_name=MODEL) - hits0}, " \
        f"expected {cached}"
    dq = sim.sample("vllm:prefix_cache_queries_total", model_name=MODEL) - queries0
    assert dq == len(tok_b), f"prefix_cache_queries_total moved by {dq}, expected the prompt's {len(tok_b)} tokens"

    # --- the first chat again: every full prompt block is a hit, none re-stored.
    n_b = len(sub.snapshot())
    ra2 = sim.chat(msgs_a, max_tokens=1)
    exp = full_a * BS if len(tok_a) % BS else (full_a - 1) * BS  # vLLM recomputes the last token
    assert ra2["usage"]["prompt_tokens_details"]["cached_tokens"] == exp, ra2["usage"]
    sub.quiet(0.3)
    again = set(stored_hashes(sub.events(n_b)))
    assert not again & set(hashes_a[:full_a]), "fully cached prompt blocks were stored again"


# ---------------------------------------------------------------------------
# 3. Encodings and hash formats
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("encoding,hash_format", [("map", "int"), ("map", "bytes"), ("array", "int"), ("array", "bytes")])
def test_encodings_and_hash_formats(sim_factory, encoding, hash_format):
    sim = sim_factory(*FAST, "--kv-events-encoding", encoding, "--kv-events-hash-format", hash_format,
                      "--num-gpu-blocks", "8", "--max-model-len", "64")
    sub = sim_factory.subscribe(sim)
    prompts = [token_prompt(300 + i, 40) for i in range(5)]  # 2 full blocks each; 8 blocks force evictions
    sim.complete(prompts[0], max_tokens=1)
    # Extends prompts[0]'s two cached blocks: a stored block with a parent, in this hash format.
    ext = prompts[0][:32] + token_prompt(399, 24)
    sim.complete(ext, max_tokens=1)
    for p in prompts[1:]:
        sim.complete(p, max_tokens=1)
    sub.wait(lambda s: any(e["type"] == "BlockRemoved" for b in s for e in b.events), what="BlockRemoved")
    sub.quiet(0.2)
    assert sim.post("/reset_prefix_cache").status == 200
    sub.wait(lambda s: any(e["type"] == "AllBlocksCleared" for b in s for e in b.events), what="AllBlocksCleared")

    def check_hash(h, what):
        if hash_format == "int":
            assert isinstance(h, int) and not isinstance(h, bool), f"{what} {h!r} is not an int"
            assert 0 <= h < U64, f"{what} {h} is not a uint64"
        else:
            assert isinstance(h, bytes) and len(h) == 32, f"{what} {h!r} is not 32-byte bin"

    seen = set()
    for frames in sub.raw_frames:
        raw_events = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)[1]
        for raw in raw_events:
            if encoding == "map":
                assert isinstance(raw, dict) and "type" in raw, f"map encoding sent {raw!r}"
                tag = raw["type"]
            else:
                assert isinstance(raw, list) and isinstance(raw[0], str), f"array encoding sent {raw!r}"
                tag = raw[0]
            seen.add(tag)
            if tag == "AllBlocksCleared":
                assert raw == ({"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]), raw
            if tag == "BlockStored" and encoding == "array":
                # positional: tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, ...
                assert len(raw) >= 8, f"array BlockStored shorter than vLLM's required fields: {raw!r}"
                assert isinstance(raw[1], list) and isinstance(raw[3], list) and raw[4] == BS, raw
                assert raw[6] == "GPU", f"medium (position 6) is {raw[6]!r}"
            if tag == "BlockRemoved" and encoding == "array":
                assert len(raw) >= 3 and isinstance(raw[1], list) and raw[2] == "GPU", raw
    assert seen == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, seen

    evs = sub.events()
    for e in evs:
        assert e["_layout"] == encoding
        if e["type"] == "BlockStored":
            for h in e["block_hashes"]:
                check_hash(h, "block hash")
            if e["parent_block_hash"] is not None:
                check_hash(e["parent_block_hash"], "parent_block_hash")
            assert e.get("medium") == "GPU", e
            assert all(isinstance(t, int) for t in e["token_ids"])
        elif e["type"] == "BlockRemoved":
            for h in e["block_hashes"]:
                check_hash(h, "removed hash")
            assert e.get("medium") == "GPU", e
    # Token ids round-trip: each prompt's 2 full blocks, in order, no parent.
    st = stored(evs)
    for p in prompts:
        match = [e for e in st if e["token_ids"] == p[:32]]
        assert len(match) == 1, f"prompt's full blocks not stored exactly once as one event ({len(match)})"
        assert match[0]["parent_block_hash"] is None
    first = [e for e in st if e["token_ids"] == prompts[0][:32]][0]
    child = [e for e in st if e["token_ids"] == ext[32:48]]
    assert len(child) == 1, "the extending prompt's new full block was not stored once"
    assert child[0]["parent_block_hash"] == first["block_hashes"][-1], \
        f"parent {child[0]['parent_block_hash']!r}, expected {first['block_hashes'][-1]!r}"
    stored_set = set(stored_hashes(evs))
    for e in removed(evs):
        assert set(map(hkey, e["block_hashes"])) <= stored_set


# ---------------------------------------------------------------------------
# 4. Eviction: LRU, later blocks first, only stored hashes removed once
# ---------------------------------------------------------------------------
def test_eviction_lru_order(sim_factory):
    sim = sim_factory(*FAST, "--enable-prompt-tokens-details", "--num-gpu-blocks", "64", "--max-model-len", "512")
    sub = sim_factory.subscribe(sim)
    L = 200  # 12 full blocks + 8 tokens
    full = L // BS
    prompts = {"A": token_prompt(1, L), "B": token_prompt(2, L)}
    order = ["A", "B", "A"] + [f"C{i}" for i in range(7)]
    for i in range(7):
        prompts[f"C{i}"] = token_prompt(10 + i, L)

    owner: dict = {}  # hash -> (request, position)
    last_use: dict = {}
    mark = 0
    for step, name in enumerate(order):
        r = sim.complete(prompts[name], max_tokens=1)
        if step == 2:
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == full * BS, r["usage"]
        if step != 2:
            sub.wait(lambda s: stored_tokens([e for b in s[mark:] for e in b.events])[:full * BS] == prompts[name][:full * BS],
                     what=f"{name}'s blocks")
        sub.quiet(0.15)
        new = sub.events(mark)
        mark = len(sub.snapshot())
        st = stored(new)
        if step == 2:
            assert not st, f"re-sent fully cached prompt stored blocks again: {st}"
        else:
            check_chain(st, None)
            for pos, h in enumerate(stored_hashes(new)[:full]):
                owner[h] = (name, pos)
        last_use[name] = step

    # Replay the whole event stream in sequence order against a model of the cache.
    live: set = set()
    removed_order: list = []
    for e in sub.events():
        if e["type"] == "BlockStored":
            for h in map(hkey, e["block_hashes"]):
                assert h not in live, f"hash {h!r} stored while still cached (no BlockRemoved in between)"
                live.add(h)
        elif e["type"] == "BlockRemoved":
            for h in map(hkey, e["block_hashes"]):
                assert h in live, f"BlockRemoved of {h!r}, which is not stored (or already removed)"
                live.remove(h)
                removed_order.append(h)
    assert removed_order, "no BlockRemoved although 9 x 12 blocks went through a 64-block cache"

    gone: set = set()
    for h in removed_order:
        if h not in owner:
            gone.add(h)
            continue
        req, pos = owner[h]
        # LRU across requests: everything of a less recently used request left before.
        older = [x for x, (r2, _) in owner.items() if last_use[r2] < last_use[req] and x not in gone]
        assert not older, (f"evicted {req}[{pos}] (last used at step {last_use[req]}) while "
                           f"{len(older)} blocks of less recently used requests were still cached, e.g. {owner[older[0]]}")
        # Within a request: later blocks leave first.
        later = [p for x, (r2, p) in owner.items() if r2 == req and p > pos and x not in gone]
        assert not later, f"evicted {req}[{pos}] before its later blocks {sorted(later)}"
        gone.add(h)
    for name in ("A", "B"):
        left = [p for x, (r2, p) in owner.items() if r2 == name and x not in gone]
        assert not left, f"{name}'s blocks {left} never evicted, though 7 newer prompts overflowed the cache"
    last_b = max(i for i, h in enumerate(removed_order) if owner.get(h, ("",))[0] == "B")
    first_a = min(i for i, h in enumerate(removed_order) if owner.get(h, ("",))[0] == "A")
    assert last_b < first_a, "A was used after B, so all of B must be evicted before any of A"


# ---------------------------------------------------------------------------
# 5. Replay, gaps, restart
# ---------------------------------------------------------------------------
def test_replay_fills_gaps_and_restart(sim_factory):
    sim = sim_factory(*FAST, "--kv-events-topic", "kv")
    sub = sim_factory.subscribe(sim)
    sim.complete(token_prompt(500, 40), max_tokens=1)
    sub.wait_count(1)
    n0 = len(sub.quiet(0.2))
    assert seqs(sub.snapshot()) == list(range(n0))

    r = sim.post("/sim/faults", {"drop_next_event_batches": 2})
    assert r.status == 200, r
    prompts = []
    for i in range(8):  # until something past the dropped batches arrives
        p = token_prompt(600 + i, 40)
        prompts.append(p)
        sim.complete(p, max_tokens=1)
        if wait_until(lambda: any(b.seq >= n0 + 2 for b in sub.snapshot()), 1.0):
            break
    live = {b.seq: b for b in sub.quiet(0.2)}
    top = max(live)
    missing = sorted(set(range(top + 1)) - set(live))
    assert missing == [n0, n0 + 1], f"after drop_next_event_batches=2 the live gap is {missing}, expected {[n0, n0 + 1]}"

    got, sentinel = replay(sim.replay_endpoint, missing[0])
    assert sentinel == [b"", b"", SENTINEL_SEQ, b""], sentinel
    rseqs = [struct.unpack(">Q", f[1])[0] for f in got]
    assert rseqs == list(range(missing[0], top + 1)), f"replay from {missing[0]} returned seqs {rseqs}"
    for topic, seq8, payload in got:
        seq = struct.unpack(">Q", seq8)[0]
        assert topic == b"kv", topic
        decode_payload(payload)
        if seq in live:
            assert payload == live[seq].payload, f"replayed batch {seq} differs from the live one"
    # With the missing batches filled in, every prompt's full blocks were stored.
    merged = {**{s: p for s, p in ((struct.unpack('>Q', f[1])[0], f[2]) for f in got)},
              **{s: b.payload for s, b in live.items()}}
    all_events = [e for s in sorted(merged) for e in decode_payload(merged[s])[1]]
    st_tokens = [e["token_ids"] for e in stored(all_events)]
    for p in prompts:
        assert p[:32] in st_tokens, "a prompt's blocks are missing even after replay"

    full, _ = replay(sim.replay_endpoint, 0)
    assert [struct.unpack(">Q", f[1])[0] for f in full] == list(range(top + 1))
    for f in full:
        s = struct.unpack(">Q", f[1])[0]
        if s in live:
            assert f[2] == live[s].payload
    none, sentinel2 = replay(sim.replay_endpoint, top + 1000)
    assert none == [] and sentinel2 == [b"", b"", SENTINEL_SEQ, b""]

    # restart-events: sequence back to 0, replay buffer forgotten.
    assert sim.post("/sim/restart-events").status == 200
    mark = len(sub.snapshot())
    sim.complete(token_prompt(700, 40), max_tokens=1)
    sub.wait(lambda s: len(s) > mark, what="a batch after restart")
    after = sub.quiet(0.2)[mark:]
    assert seqs(after) == list(range(len(after))), f"after restart-events the sequence is {seqs(after)}, expected 0,1,..."
    again, _ = replay(sim.replay_endpoint, 0)
    assert [f[2] for f in again] == [b.payload for b in after], "replay buffer still holds batches from before the restart"


# ---------------------------------------------------------------------------
# 6. Metrics
# ---------------------------------------------------------------------------
def test_metrics_families_and_live_values(sim_factory):
    from prometheus_client.parser import text_string_to_metric_families

    sim = sim_factory("--profile", "h100-8b", "--time-scale", "1", "--num-gpu-blocks", "1000", "--block-size", "16",
                      "--max-model-len", "4096")
    fams = {f.name: f for f in text_string_to_metric_families(sim.metrics_text())}

    def fam(name):
        f = fams.get(name) or fams.get(name.removesuffix("_total"))
        assert f is not None, f"metric family {name} missing; have {sorted(fams)}"
        return f

    expect = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
              "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries_total": "counter",
              "vllm:prefix_cache_hits_total": "counter", "vllm:time_to_first_token_seconds": "histogram",
              "vllm:cache_config_info": "gauge"}
    for name, typ in expect.items():
        f = fam(name)
        assert f.type == typ, f"{name} has type {f.type}, vLLM's is {typ}"
        assert f.samples, name
        for s in f.samples:
            # vLLM's *_info gauges carry the config's fields and engine, not necessarily model_name.
            assert s.labels.get("model_name") == MODEL or name == "vllm:cache_config_info", (name, s.labels)
            assert "engine" in s.labels, (name, s.labels)
    cc = fam("vllm:cache_config_info").samples
    assert len(cc) == 1 and cc[0].value == 1.0, cc
    assert cc[0].labels.get("block_size") == "16", cc[0].labels
    assert cc[0].labels.get("num_gpu_blocks") == "1000", cc[0].labels

    for i in range(2):
        sim.chat([{"role": "user", "content": f"short question {i}"}], max_tokens=2)

    result = {}

    def long_request():
        result["r"] = sim.chat([{"role": "user", "content": "Write a long story about a lighthouse."}], max_tokens=300)

    t = threading.Thread(target=long_request)
    t0 = time.time()
    t.start()
    max_running, usages = 0.0, []
    while t.is_alive() and time.time() - t0 < 30:
        samples = sim.samples()
        for s in samples:
            if s.name == "vllm:num_requests_running":
                max_running = max(max_running, s.value)
            if s.name == "vllm:kv_cache_usage_perc":
                usages.append(s.value)
        time.sleep(0.05)
    t.join(30)
    assert not t.is_alive(), "long request did not finish"
    assert result["r"]["usage"]["completion_tokens"] == 300
    assert time.time() - t0 > 0.5, "300 tokens at --time-scale 1 finished implausibly fast for h100-8b"
    assert max_running >= 1, "vllm:num_requests_running never rose above 0 during a running request"
    assert usages and all(0.0 <= u <= 1.0 for u in usages), usages
    assert max(usages) > 0, "kv_cache_usage_perc stayed 0 while a request held blocks"
    assert wait_until(lambda: sim.sample("vllm:num_requests_running", model_name=MODEL) == 0, 3)
    assert sim.sample("vllm:num_requests_waiting", model_name=MODEL) == 0
    ok = wait_until(lambda: sim.sample("vllm:time_to_first_token_seconds_count", model_name=MODEL) == 3, 3)
    assert ok, f"TTFT histogram count {sim.sample('vllm:time_to_first_token_seconds_count', model_name=MODEL)}, expected 3"
    inf = sim.sample("vllm:time_to_first_token_seconds_bucket", model_name=MODEL, le="+Inf")
    assert inf == 3
    assert sim.sample("vllm:time_to_first_token_seconds_sum", model_name=MODEL) > 0
    assert 0.0 <= sim.sample("vllm:kv_cache_usage_perc", model_name=MODEL) <= 1.0


# ---------------------------------------------------------------------------
# 7. AllBlocksCleared
# ---------------------------------------------------------------------------
def test_reset_prefix_cache_emits_all_blocks_cleared(sim_factory):
    sim = sim_factory(*FAST, "--enable-prompt-tokens-details")
    sub = sim_factory.subscribe(sim)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    sim.chat(msgs, max_tokens=1)
    sub.wait(lambda s: stored([e for b in s for e in b.events]), what="BlockStored")
    sub.quiet(0.2)
    mark = len(sub.snapshot())
    assert sim.chat(msgs, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    sub.quiet(0.2)
    mark = len(sub.snapshot())
    r = sim.post("/reset_prefix_cache")
    assert r.status == 200, r
    sub.wait(lambda s: any(e["type"] == "AllBlocksCleared" for b in s[mark:] for e in b.events), what="AllBlocksCleared")
    sub.quiet(0.2)
    evs = sub.events(mark)
    assert [e["type"] for e in evs] == ["AllBlocksCleared"], [e["type"] for e in evs]
    # After the reset nothing is cached: the same chat is a full miss and stores from the root again.
    mark = len(sub.snapshot())
    r2 = sim.chat(msgs, max_tokens=1)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r2["usage"]
    sub.wait(lambda s: stored([e for b in s[mark:] for e in b.events]), what="BlockStored after reset")
    assert stored(sub.events(mark))[0]["parent_block_hash"] is None


# ---------------------------------------------------------------------------
# 8. Streaming and completions
# ---------------------------------------------------------------------------
@pytest.fixture
def plain_sim(sim_factory):
    return sim_factory(*FAST, "--max-model-len", "256", "--num-gpu-blocks", "100")


def parse_sse(lines: list[str]) -> list:
    assert lines, "empty stream"
    for l in lines:
        assert l.startswith("data: "), f"SSE line without 'data: ': {l!r}"
    assert lines[-1] == "data: [DONE]", lines[-1]
    assert lines.count("data: [DONE]") == 1
    return [json.loads(l[len("data: "):]) for l in lines[:-1]]


def test_streaming_chat_with_usage(plain_sim):
    sim = plain_sim
    msgs = [{"role": "user", "content": "Count to ten."}]
    n_prompt = len(sim.tokenize_messages(msgs))
    status, headers, lines = sim.stream("/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "max_tokens": 7, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    assert headers.get("content-type", "").startswith("text/event-stream"), headers
    chunks = parse_sse(lines)
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["model"] == MODEL, c
    last = chunks[-1]
    assert last["choices"] == [], f"with include_usage the last chunk must have empty choices: {last}"
    u = last["usage"]
    assert u["prompt_tokens"] == n_prompt and u["completion_tokens"] == 7, u
    assert u["total_tokens"] == n_prompt + 7, u
    body = [c for c in chunks[:-1] if c["choices"]]
    assert body and body[0]["choices"][0]["delta"].get("role") == "assistant", body[:1]
    finals = [c["choices"][0]["finish_reason"] for c in body if c["choices"][0].get("finish_reason")]
    assert finals == ["length"], finals
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in body), "no content streamed"

    # Non-streaming.
    r = sim.chat(msgs, max_tokens=5)
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["message"]["role"] == "assistant"
    assert r["usage"]["completion_tokens"] == 5 and r["usage"]["prompt_tokens"] == n_prompt


def test_completions_with_token_ids(plain_sim):
    sim = plain_sim
    ids = token_prompt(900, 37)
    r = sim.complete(ids, max_tokens=3)
    assert r["object"] == "text_completion"
    assert isinstance(r["choices"][0]["text"], str)
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] == 37 and r["usage"]["completion_tokens"] == 3, r["usage"]
    status, _, lines = sim.stream("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 4, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = parse_sse(lines)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4, chunks[-1]
    assert chunks[-1]["usage"]["prompt_tokens"] == 37
    for c in chunks[:-1]:
        assert c["object"] == "text_completion"
    # String prompt as well; /tokenize with a prompt counts the same tokens.
    text = "The capital of France is"
    tk = sim.post_ok("/tokenize", {"model": MODEL, "prompt": text})
    assert tk["count"] == len(tk["tokens"]) and tk["max_model_len"] == 256, tk
    r2 = sim.complete(text, max_tokens=2)
    assert r2["usage"]["completion_tokens"] == 2
    assert r2["usage"]["prompt_tokens"] == tk["count"], (r2["usage"], tk)


# ---------------------------------------------------------------------------
# 9. Errors
# ---------------------------------------------------------------------------
def check_error(r, status):
    assert r.status == status, f"expected HTTP {status}, got {r.status}: {r.body[:300]!r}"
    body = r.json()
    assert set(body) == {"error"}, f"error body is not {{'error': {{...}}}}: {body}"
    err = body["error"]
    for k in ("message", "type", "param", "code"):
        assert k in err, f"error lacks {k!r}: {err}"
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] == status, f"error.code {err['code']!r}, expected {status}"


def test_bad_input_errors(plain_sim):
    sim = plain_sim
    chat = "/v1/chat/completions"
    check_error(sim.post(chat, raw=b'{"model": "Qwen/Qwen3-8B", "messages": ['), 400)
    check_error(sim.post(chat, {"model": MODEL, "messages": "hello"}), 400)
    check_error(sim.post(chat, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": "ten"}), 400)
    check_error(sim.post(chat, {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 400}]}), 400)
    check_error(sim.post("/v1/completions", {"model": MODEL, "prompt": token_prompt(1, 300), "max_tokens": 1}), 400)
    # prompt + max_tokens over --max-model-len: vLLM rejects it up front.
    check_error(sim.post("/v1/completions", {"model": MODEL, "prompt": token_prompt(2, 200), "max_tokens": 100}), 400)
    check_error(sim.post(chat, {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}), 404)
    assert sim.get("/health").status == 200
    r = sim.chat([{"role": "user", "content": "still there?"}], max_tokens=2)
    assert r["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------
# 0. The decoder itself, on payloads hand-built from vLLM's documented layout
#    (so a sim test failing is about the sim, not the decoder).
# ---------------------------------------------------------------------------
def test_decoder_on_hand_built_vllm_payloads():
    from conftest import WireError, decode_frames

    h1, h2 = 2**64 - 5, 12345
    map_ev = [{"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None,
               "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
               "lora_name": None},
              {"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU"},
              {"type": "AllBlocksCleared"}]
    arr_ev = [["BlockStored", [h1, h2], None, list(range(32)), 16, None, "GPU", None],
              ["BlockRemoved", [h2], "GPU"], ["AllBlocksCleared"]]
    for evs in (map_ev, arr_ev):
        payload = msgpack.packb([time.time(), evs, 0])
        b = decode_frames([b"kv", struct.pack(">Q", 7), payload])
        assert b.seq == 7 and b.topic == b"kv" and b.dp_rank == 0
        assert [e["type"] for e in b.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
        assert b.events[0]["block_hashes"] == [h1, h2] and b.events[0]["medium"] == "GPU"
        assert b.events[1]["block_hashes"] == [h2]
    bad = [
        [b"kv", struct.pack(">Q", 0)],                                              # 2 frames
        [b"kv", b"\x00" * 4, msgpack.packb([1.0, [], None])],                       # short seq
        [b"kv", struct.pack(">Q", 0), msgpack.packb([1, [], None])],                 # int ts
        [b"kv", struct.pack(">Q", 0), msgpack.packb([1.0, [], None, 1])],            # 4 elements
        [b"kv", struct.pack(">Q", 0), msgpack.packb([1.0, [{"block_hashes": []}], None])],  # no type
        [b"kv", struct.pack(">Q", 0), msgpack.packb([1.0, [["BlockStored", [1]]], None])],  # missing fields
        [b"kv", struct.pack(">Q", 0), msgpack.packb([1.0, [{"type": "Nope"}], None])],
    ]
    for frames in bad:
        with pytest.raises(WireError):
            decode_frames(frames)


def test_fault_admin(plain_sim):
    sim = plain_sim
    msgs = [{"role": "user", "content": "hi"}]
    assert sim.post("/sim/faults", {"fail_rate": 1.0}).status == 200
    r = sim.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1})
    assert r.status == 500, r
    assert sim.post("/sim/faults", {"fail_rate": 0.0, "unhealthy": True}).status == 200
    assert sim.get("/health").status == 503
    assert sim.post("/sim/faults", {"unhealthy": False}).status == 200
    assert sim.get("/health").status == 200
    assert sim.chat(msgs, max_tokens=1)["usage"]["completion_tokens"] == 1


# ---------------------------------------------------------------------------
# Chunked prefill and decode blocks
# ---------------------------------------------------------------------------
def test_chunked_prefill_and_decode_blocks(sim_factory):
    sim = sim_factory(*FAST, "--max-num-batched-tokens", "64", "--max-model-len", "1024")
    sub = sim_factory.subscribe(sim)
    # A 200-token prompt prefilled in 64-token chunks: one parent chain, full blocks only.
    p = token_prompt(1234, 200)
    sim.complete(p, max_tokens=1)
    sub.wait(lambda s: len(stored_tokens([e for b in s for e in b.events])) >= 192, what="12 blocks")
    sub.quiet(0.2)
    evs = sub.events()
    check_chain(stored(evs), None)
    assert stored_tokens(evs) == p[:192]
    # Decode fills blocks too. vLLM caches only tokens whose KV was computed: the
    # last sampled token never is, so P + O tokens leave floor((P + O - 1) / 16) blocks.
    mark = len(sub.snapshot())
    q = token_prompt(4321, 40)
    r = sim.complete(q, max_tokens=24)  # 64 tokens in all, 63 computed -> 3 blocks
    assert r["usage"]["completion_tokens"] == 24
    sub.wait(lambda s: len(stored_tokens([e for b in s[mark:] for e in b.events])) >= 32, what="q's blocks")
    sub.quiet(0.3)
    evs = sub.events(mark)
    check_chain(stored(evs), None)
    toks = stored_tokens(evs)
    assert toks[:40] == q, "decode blocks do not continue the prompt's tokens"
    assert len(toks) == 48, f"stored {len(toks)} tokens for a 40+24-token request, expected 48 (63 computed tokens)"
