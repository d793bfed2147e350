"""A steady mixed load through Envoy for the fault scenarios: worker
threads, each sending one request after another (a new connection each,
stdlib only), cycling through the five generation APIs the filter routes
(chat completions, completions, Anthropic messages and count_tokens,
Responses, the latter also as a follow-up with `previous_response_id`),
streamed and not. Every request is recorded: when it started and ended,
its status, the engine that served it, whether a stream reached its last
event, and why it failed."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from http.client import HTTPConnection, IncompleteRead
from typing import Any

from ..paths import MODEL
from ..policy import KEYS

SERVED = "x-gateway-destination-endpoint-served"

# (api, streamed): the mix, sent in this order by every worker (each
# starting at its own offset, so the in-flight mix is even).
KINDS: list[tuple[str, bool]] = [
    ("chat", True), ("completions", True), ("messages", True), ("responses", True),
    ("chat", False), ("completions", False), ("messages", False), ("responses", False),
    ("count_tokens", False), ("responses_followup", True),
]

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
         "count_tokens": "/v1/messages/count_tokens", "responses": "/v1/responses",
         "responses_followup": "/v1/responses"}


@dataclass
class Record:
    api: str
    stream: bool
    tenant: str
    start: float
    port: int = 0
    end: float = 0.0
    status: int = 0
    served: str | None = None
    ok: bool = False
    reason: str | None = None
    # Time to the response headers (the pick and the engine's first byte).
    ttfb: float = 0.0
    response_id: str | None = None
    previous: str | None = None


def _system(worker: int) -> str:
    # A per-worker system prompt long enough for a few full blocks, so
    # requests of one worker share a prefix and picks find it.
    return f"[worker {worker}] " + " ".join(f"rule {i} of the house style of worker {worker}" for i in range(24))


def body_for(api: str, stream: bool, worker: int, n: int, max_tokens: int, previous: str | None) -> dict[str, Any]:
    user = f"request {n} of worker {worker}: {uuid.uuid4().hex[:8]} tell me about item {n * 7}"
    system = _system(worker)
    if api == "chat":
        b: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens,
                             "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    elif api == "completions":
        b = {"model": MODEL, "max_tokens": max_tokens, "prompt": system + "\n" + user}
    elif api in ("messages", "count_tokens"):
        b = {"model": MODEL, "system": system, "messages": [{"role": "user", "content": user}]}
        if api == "messages":
            b["max_tokens"] = max_tokens
    else:
        b = {"model": MODEL, "instructions": system, "input": user, "max_output_tokens": max_tokens, "store": True}
        if previous:
            b["previous_response_id"] = previous
    if stream:
        b["stream"] = True
    return b


def stream_complete(api: str, body: bytes) -> bool:
    """Whether a streamed body reached the API's last event."""
    if api in ("chat", "completions"):
        return b"data: [DONE]" in body
    if api == "messages":
        return b"event: message_stop" in body
    return b"response.completed" in body or b"response.incomplete" in body


def _response_id(api: str, stream: bool, body: bytes) -> str | None:
    if not api.startswith("responses"):
        return None
    try:
        if not stream:
            return json.loads(body).get("id")
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("data:") and '"response.created"' in line:
                return json.loads(line[5:])["response"]["id"]
    except (ValueError, KeyError, TypeError):
        return None
    return None


def _error_code(body: bytes) -> str:
    """`:<code>` of an error body in OpenAI's or Anthropic's shape, else ""."""
    try:
        err = json.loads(body).get("error") or {}
        code = err.get("code") or err.get("type")
    except (ValueError, AttributeError):
        return ""
    return f":{code}" if code else ""


def classify(records: list[Record], named: list[tuple[str, Any]]) -> tuple[dict[str, int], list[str]]:
    """Failed requests by the first rule of `named` ((label, predicate on a
    record)) they match; the ones none matches, described."""
    counts: Counter = Counter()
    other: list[str] = []
    for r in records:
        if r.ok:
            continue
        label = next((lab for lab, pred in named if pred(r)), None)
        if label is None:
            other.append(f"{r.api}{'/stream' if r.stream else ''}: {r.reason} via {r.served}")
        else:
            counts[label] += 1
    return dict(counts), other


@dataclass
class LoadConfig:
    # One Envoy listener, or several: request n of worker w goes to
    # ports[(w + n) % len(ports)], so a conversation crosses them.
    port: int | list[int]
    workers: int = 8
    max_tokens: int = 24
    timeout_s: float = 30.0
    # Pause between one worker's requests.
    think_s: float = 0.0
    tenants: tuple[str, ...] = ("acme",)
    kinds: list[tuple[str, bool]] = field(default_factory=lambda: list(KINDS))
    # Each worker stops after this many requests (a bound, should `stop()`
    # never come).
    max_requests_per_worker: int = 100_000


class Load:
    """Runs `cfg.workers` threads until `stop()` (or each worker's request
    bound); `records` holds every finished request."""

    def __init__(self, cfg: LoadConfig):
        self.cfg = cfg
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._inflight: dict[int, Record] = {}
        self.started_at = 0.0

    def start(self) -> "Load":
        self.started_at = time.monotonic()
        for w in range(self.cfg.workers):
            t = threading.Thread(target=self._worker, args=(w,), name=f"load-{w}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, join_s: float | None = None) -> None:
        self._stop.set()
        deadline = time.monotonic() + (join_s if join_s is not None else self.cfg.timeout_s + 5)
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> "Load":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def in_flight(self) -> list[Record]:
        with self._lock:
            return list(self._inflight.values())

    def done(self) -> int:
        with self._lock:
            return len(self.records)

    def wait_done(self, n: int, timeout: float) -> None:
        """Until `n` more requests than now finished (bounded)."""
        target = self.done() + n
        deadline = time.monotonic() + timeout
        while self.done() < target and time.monotonic() < deadline:
            time.sleep(0.02)

    def _worker(self, w: int) -> None:
        kinds = self.cfg.kinds
        # The last stored response of this worker, whose it is, and the
        # listener it was made through.
        last_response: tuple[str, str, int] | None = None
        for n in range(self.cfg.max_requests_per_worker):
            if self._stop.is_set():
                return
            api, stream = kinds[(w + n) % len(kinds)]
            tenant = self.cfg.tenants[(w + n) % len(self.cfg.tenants)]
            previous = None
            if api == "responses_followup":
                if last_response is None:
                    api = "responses"
                else:
                    previous, tenant, made_at = last_response
            ports = self.cfg.port if isinstance(self.cfg.port, list) else [self.cfg.port]
            port = ports[(w + n) % len(ports)]
            if previous is not None and len(ports) > 1:
                # A follow-up through another listener than its response:
                # with one Envoy per indexer replica, another replica.
                port = ports[(ports.index(made_at) + 1) % len(ports)]
            rec = Record(api, stream, tenant, time.monotonic(), port, previous=previous)
            with self._lock:
                self._inflight[id(rec)] = rec
            self._one(rec, body_for(api, stream, w, n, self.cfg.max_tokens, previous))
            with self._lock:
                self._inflight.pop(id(rec), None)
                self.records.append(rec)
            if rec.response_id:
                last_response = (rec.response_id, rec.tenant, rec.port)
            if self.cfg.think_s:
                time.sleep(self.cfg.think_s)

    def _one(self, rec: Record, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEYS[rec.tenant]}"}
        c = HTTPConnection("127.0.0.1", rec.port, timeout=self.cfg.timeout_s)
        try:
            c.request("POST", PATHS[rec.api], body=data, headers=headers)
            r = c.getresponse()
            rec.ttfb = time.monotonic() - rec.start
            rec.status = r.status
            rec.served = r.getheader(SERVED)
            out = r.read()
            rec.end = time.monotonic()
            if r.status != 200:
                rec.reason = f"status_{r.status}{_error_code(out)}"
                return
            if rec.stream and not stream_complete(rec.api, out):
                rec.reason = "stream_cut"
                return
            if not rec.stream:
                try:
                    json.loads(out)
                except ValueError:
                    rec.reason = "body_cut"
                    return
            rec.response_id = _response_id(rec.api, rec.stream, out)
            rec.ok = True
        except IncompleteRead:
            # The response started, then the connection ended before its
            # last chunk: Envoy cut it (an upstream reset mid-response).
            rec.reason = "stream_cut" if rec.stream else "body_cut"
        except socket.timeout:
            rec.reason = "client_timeout"
        except (ConnectionError, OSError) as e:  # reset, refused, incomplete read
            rec.reason = f"connection:{type(e).__name__}"
        except Exception as e:  # noqa: BLE001 - http.client's IncompleteRead and the like
            rec.reason = f"error:{type(e).__name__}"
        finally:
            if not rec.end:
                rec.end = time.monotonic()
            c.close()


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(records: list[Record], t0: float | None = None) -> dict[str, Any]:
    """Counts of a set of requests: sent, succeeded, failed by reason, and
    by (api, streamed)."""
    failed = [r for r in records if not r.ok]
    if t0 is None:
        t0 = min((r.start for r in records), default=0.0)
    by_kind: dict[str, dict[str, int]] = {}
    for r in records:
        k = f"{r.api}{'/stream' if r.stream else ''}"
        d = by_kind.setdefault(k, {"sent": 0, "ok": 0, "failed": 0})
        d["sent"] += 1
        d["ok" if r.ok else "failed"] += 1
    lat = [r.end - r.start for r in records if r.ok]
    return {
        "sent": len(records),
        "succeeded": len(records) - len(failed),
        "failed": len(failed),
        "failed_by_reason": dict(Counter(r.reason or "?" for r in failed)),
        "by_kind": by_kind,
        "latency_p50_s": percentile(lat, 0.5),
        "latency_p99_s": percentile(lat, 0.99),
        # A few failures in full: when (seconds after the first request),
        # which API, why, which engine answered.
        "failed_samples": [{"at_s": round(r.start - t0, 2), "api": r.api, "stream": r.stream, "reason": r.reason,
                            "served": r.served, "took_s": round(r.end - r.start, 3)} for r in failed[:12]],
    }


def record_dict(r: Record, t0: float) -> dict[str, Any]:
    d = asdict(r)
    d["start"] = round(r.start - t0, 4)
    d["end"] = round(r.end - t0, 4)
    return d
