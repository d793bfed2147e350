"""Black-box harness for vllm-sim.

Everything here is written from vLLM's documented wire formats (see
/work/shared/FACTS.md, "vLLM KV-cache events" and "vLLM serving API and
metrics"), not from the simulator's source.

- `SimProcess` starts the binary through the harness's simulator launcher
  (harness/kvasir_harness/sim.py: port 0 for HTTP and both KV-event sockets,
  the bound ports read from the ready line), waits for /health (bounded),
  is always killed, and is a plain HTTP client of it.
- `KvSubscriber` is a ZMQ SUB on the KV-events endpoint, collecting every
  3-frame message on a background thread.
- `replay()` is the DEALER side of vLLM's replay protocol.
- `decode_payload()` decodes a msgpack `[ts, events, dp_rank]` batch, events
  in either the map (vLLM >= 0.23) or positional array (<= 0.22) layout.
"""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import struct
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import pytest
import zmq

from kvasir_harness import MODEL, SIM_BIN, Sim, launch_sim, prom, wait_sim

FAST = ["--profile", "zero", "--time-scale", "0"]

START_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 30.0

# ---------------------------------------------------------------------------
# vLLM's event field order (kv_events.py). Positional (array) layout: element 0
# is the tag, then these fields in order. Map layout: the same names as keys.
# ---------------------------------------------------------------------------
BLOCK_STORED_FIELDS = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
]
BLOCK_REMOVED_FIELDS = ["block_hashes", "medium", "group_idx", "locality", "ownership"]
ALL_CLEARED_FIELDS: list[str] = []
EVENT_FIELDS = {
    "BlockStored": BLOCK_STORED_FIELDS,
    "BlockRemoved": BLOCK_REMOVED_FIELDS,
    "AllBlocksCleared": ALL_CLEARED_FIELDS,
}
# Fields every event of a type must carry (no default in vLLM).
REQUIRED_FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size"],
    "BlockRemoved": ["block_hashes"],
    "AllBlocksCleared": [],
}

SENTINEL_SEQ = b"\xff" * 8


class WireError(AssertionError):
    """The bytes on the wire do not follow vLLM's documented format."""


def decode_event(raw: Any) -> dict:
    """One event, map or array layout, into a dict with "type" and "_layout"."""
    if isinstance(raw, dict):
        if "type" not in raw:
            raise WireError(f"map event without a 'type' key: {raw!r}")
        tag = raw["type"]
        if tag not in EVENT_FIELDS:
            raise WireError(f"unknown event type {tag!r} in {raw!r}")
        known = set(EVENT_FIELDS[tag]) | {"type"}
        unknown = set(raw) - known
        if unknown:
            raise WireError(f"{tag} map has fields vLLM does not define: {sorted(unknown)}")
        ev = dict(raw)
        ev["_layout"] = "map"
    elif isinstance(raw, (list, tuple)):
        if not raw or not isinstance(raw[0], str):
            raise WireError(f"array event whose element 0 is not a tag string: {raw!r}")
        tag = raw[0]
        if tag not in EVENT_FIELDS:
            raise WireError(f"unknown event tag {tag!r} in {raw!r}")
        names = EVENT_FIELDS[tag]
        values = list(raw[1:])
        if len(values) > len(names):
            raise WireError(f"{tag} array has {len(values)} fields, vLLM defines {len(names)}: {raw!r}")
        ev = {"type": tag, "_layout": "array"}
        ev.update(zip(names, values))
    else:
        raise WireError(f"event is neither a map nor an array: {raw!r}")
    missing = [f for f in REQUIRED_FIELDS[tag] if f not in ev]
    if missing:
        raise WireError(f"{tag} lacks required fields {missing}: {raw!r}")
    return ev


@dataclass
class Batch:
    topic: bytes
    seq: int
    payload: bytes
    ts: float
    events: list[dict]
    dp_rank: int | None
    received_at: float = field(default_factory=time.time)


def decode_payload(payload: bytes) -> tuple[float, list[dict], int | None]:
    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(obj, (list, tuple)) or len(obj) != 3:
        raise WireError(f"payload is not a 3-element array [ts, events, dp_rank]: {obj!r}")
    ts, events, rank = obj
    if not isinstance(ts, float):
        raise WireError(f"ts is not a float: {ts!r}")
    if not isinstance(events, (list, tuple)):
        raise WireError(f"events is not an array: {events!r}")
    if not (rank is None or (isinstance(rank, int) and not isinstance(rank, bool))):
        raise WireError(f"data_parallel_rank is neither int nor nil: {rank!r}")
    return ts, [decode_event(e) for e in events], rank


def decode_frames(frames: list[bytes]) -> Batch:
    if len(frames) != 3:
        raise WireError(f"expected 3 frames (topic, seq, payload), got {len(frames)}: {frames!r}")
    topic, seq8, payload = frames
    if len(seq8) != 8:
        raise WireError(f"sequence frame is {len(seq8)} bytes, not 8: {seq8!r}")
    (seq,) = struct.unpack(">Q", seq8)
    ts, events, rank = decode_payload(payload)
    return Batch(topic, seq, payload, ts, events, rank)


# ---------------------------------------------------------------------------
# ZMQ
# ---------------------------------------------------------------------------
_ctx = zmq.Context.instance()


class KvSubscriber:
    """SUB socket on a background thread; keeps every message in order."""

    def __init__(self, endpoint: str, subscribe: bytes = b""):
        self.endpoint = endpoint
        self.raw_frames: list[list[bytes]] = []
        self.batches: list[Batch] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._sub = subscribe
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"SUB could not connect to {endpoint}")
        # ZMQ slow joiner: the subscription travels after the handshake.
        time.sleep(0.3)

    def _run(self) -> None:
        sock = _ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self._sub)
        mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            deadline = time.time() + 10
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if mon in ready:
                    mon.recv_multipart()
                    self._ready.set()
                if not self._ready.is_set() and time.time() > deadline:
                    break
                if sock in ready:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        with self._lock:
                            self.raw_frames.append(frames)
                            try:
                                self.batches.append(decode_frames(frames))
                            except Exception as e:  # keep the thread alive; tests assert on errors
                                self.errors.append(f"{e!r} in {frames!r}")
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)

    def snapshot(self) -> list[Batch]:
        with self._lock:
            if self.errors:
                raise WireError("undecodable messages: " + "; ".join(self.errors[:3]))
            return list(self.batches)

    def events(self, start: int = 0) -> list[dict]:
        out = []
        for b in self.snapshot()[start:]:
            for e in b.events:
                e = dict(e)
                e["_seq"] = b.seq
                out.append(e)
        return out

    def wait(self, pred: Callable[[list[Batch]], bool], timeout: float = 10.0, what: str = "events") -> list[Batch]:
        deadline = time.time() + timeout
        while True:
            snap = self.snapshot()
            if pred(snap):
                return snap
            if time.time() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; got {len(snap)} batches: "
                                     f"{[(b.seq, [e['type'] for e in b.events]) for b in snap][-20:]}")
            time.sleep(0.02)

    def wait_count(self, n: int, timeout: float = 10.0) -> list[Batch]:
        return self.wait(lambda s: len(s) >= n, timeout, f"{n} batches")

    def quiet(self, period: float = 0.3, timeout: float = 10.0) -> list[Batch]:
        """Wait until no new batch arrived for `period` seconds."""
        deadline = time.time() + timeout
        last = len(self.snapshot())
        last_change = time.time()
        while time.time() < deadline:
            time.sleep(0.05)
            n = len(self.snapshot())
            if n != last:
                last, last_change = n, time.time()
            elif time.time() - last_change >= period:
                break
        return self.snapshot()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def replay(endpoint: str, start_seq: int, timeout: float = 10.0, max_msgs: int = 100_000) -> tuple[list[list[bytes]], list[bytes]]:
    """vLLM replay: DEALER sends ["", start_seq8]; returns (batch frames, sentinel frames).

    Each batch frame list is [topic, seq8, payload] (the leading empty delimiter
    checked and stripped)."""
    sock = _ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", struct.pack(">Q", start_seq)])
        out: list[list[bytes]] = []
        deadline = time.time() + timeout
        for _ in range(max_msgs):
            left = deadline - time.time()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise AssertionError(f"replay from {start_seq}: no end sentinel within {timeout}s "
                                     f"(got {len(out)} batches)")
            frames = sock.recv_multipart()
            if len(frames) != 4 or frames[0] != b"":
                raise WireError(f"replay reply is not ['', topic, seq8, payload]: {frames!r}")
            if frames[2] == SENTINEL_SEQ:
                return out, frames
            out.append(frames[1:])
        raise AssertionError("replay never ended")
    finally:
        sock.close(0)


# ---------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------
@dataclass
class Resp:
    status: int
    headers: dict
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class SimProcess:
    def __init__(self, args: list[str]):
        self.args = args
        self.sim: Sim | None = None
        self.logdir = Path(tempfile.mkdtemp(prefix="vllm-sim-"))

    # -- lifecycle --
    def start(self) -> "SimProcess":
        if not SIM_BIN.exists():
            pytest.fail(f"vllm-sim binary not found at {SIM_BIN} (set VLLM_SIM_BIN)")
        # Port 0 everywhere: nothing to race for, so no retries.
        self.sim = launch_sim(self.logdir, "vllm-sim", ["--host", "127.0.0.1", *self.args])
        self.cmd = self.sim.proc.argv
        try:
            wait_sim(self.sim, timeout=START_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - reported with the log below
            self.kill()
            pytest.fail(f"vllm-sim did not become healthy: {self.cmd}\n{self.log_tail()}")
        return self

    def kill(self) -> None:
        if self.sim is not None:
            self.sim.proc.stop(signal.SIGKILL)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.logdir / "vllm-sim.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def remove_log(self) -> None:
        shutil.rmtree(self.logdir, ignore_errors=True)

    @property
    def port(self) -> int:
        return self.sim.port

    @property
    def ev_port(self) -> int:
        return self.sim.events

    @property
    def replay_port(self) -> int:
        return self.sim.replay

    @property
    def ev_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ev_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    # -- http --
    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                timeout: float = HTTP_TIMEOUT_S, headers: dict | None = None) -> Resp:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return Resp(r.status, dict(r.headers), r.read())
        except urllib.error.HTTPError as e:
            return Resp(e.code, dict(e.headers), e.read())

    def get(self, path: str, timeout: float = HTTP_TIMEOUT_S) -> Resp:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any = None, **kw) -> Resp:
        return self.request("POST", path, body, **kw)

    def post_ok(self, path: str, body: Any) -> Any:
        r = self.post(path, body)
        assert r.status == 200, f"POST {path} -> {r.status}: {r.body[:500]!r}"
        return r.json()

    def chat(self, messages: list[dict], max_tokens: int = 4, **extra) -> dict:
        return self.post_ok("/v1/chat/completions",
                            {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra})

    def complete(self, prompt: Any, max_tokens: int = 1, **extra) -> dict:
        return self.post_ok("/v1/completions",
                            {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra})

    def tokenize_messages(self, messages: list[dict]) -> list[int]:
        r = self.post_ok("/tokenize", {"model": MODEL, "messages": messages})
        assert r["count"] == len(r["tokens"]), r
        return r["tokens"]

    def stream(self, path: str, body: dict, timeout: float = HTTP_TIMEOUT_S) -> tuple[int, dict, list[str]]:
        """POST and return (status, headers, SSE lines as text, blank lines dropped)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
            r = conn.getresponse()
            text = r.read().decode()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, [l for l in text.splitlines() if l.strip()]
        finally:
            conn.close()

    # -- metrics --
    def metrics_text(self) -> str:
        r = self.get("/metrics")
        assert r.status == 200, r
        return r.body.decode()

    def samples(self) -> list:
        """All samples (name, labels, value), parsed by the harness's parser
        (prometheus_client's)."""
        return prom.samples(self.metrics_text())

    def sample(self, name: str, **labels) -> float:
        vals = [s.value for s in self.samples()
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(vals) == 1, f"expected one sample {name}{labels}, found {len(vals)}"
        return vals[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def sim_factory(request):
    """start(*args) -> a healthy SimProcess; every one started is killed at teardown."""
    started: list[SimProcess] = []
    subs: list[KvSubscriber] = []

    def start(*args: str) -> SimProcess:
        s = SimProcess(list(args))
        started.append(s)
        return s.start()

    def subscribe(sim: SimProcess, topic: bytes = b"") -> KvSubscriber:
        sub = KvSubscriber(sim.ev_endpoint, topic)
        subs.append(sub)
        return sub

    start.subscribe = subscribe  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for sub in subs:
            sub.close()
        failed = getattr(getattr(request.node, "rep_call", None), "failed", False)
        for s in started:
            s.kill()
            if failed:
                print(f"\n--- vllm-sim log ({' '.join(s.args)}) ---\n{s.log_tail(3000)}")
            s.remove_log()


# ---------------------------------------------------------------------------
# Helpers on decoded events
# ---------------------------------------------------------------------------
def stored(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "BlockStored"]


def removed(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "BlockRemoved"]


def hkey(h: Any) -> Any:
    """A hashable key for a block hash (int or bytes)."""
    return bytes(h) if isinstance(h, (bytes, bytearray)) else h


def stored_tokens(events: list[dict]) -> list[int]:
    out: list[int] = []
    for e in stored(events):
        out.extend(e["token_ids"])
    return out


def stored_hashes(events: list[dict]) -> list[Any]:
    out: list[Any] = []
    for e in stored(events):
        out.extend(hkey(h) for h in e["block_hashes"])
    return out


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while True:
        if pred():
            return True
        if time.time() > deadline:
            return False
        time.sleep(interval)
