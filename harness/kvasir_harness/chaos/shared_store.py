"""The shared store under load: two indexer replicas (each behind its own
Envoy, the load crossing both) share budgets, load and Responses ids
through one Redis, which is killed, restarted empty, stalled (SIGSTOP) and
resumed. For each: budgets (a tenant limited to 2 requests in flight),
shared load and Responses affinity keep their documented behaviour, no
request hangs, the budget's overshoot stays bounded, and sharing resumes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ..procs import Proc, wait_until
from ..redis import Redis
from .load import Load, LoadConfig, classify, percentile, summarize
from .result import Result, r3, timed_wait
from .stack import chaos_stack

LIMIT = 2

# The stall also checks that no reservation outlives it: a reserve call
# that times out (timeoutMs) is decided locally, but its EVALSHA is still in
# the stopped server's socket buffer and runs when Redis resumes. The
# indexer remembers each reserve it gave up on and undoes it in front of
# its next call once Redis answers (cache-indexer/src/budgets/redis/
# abandon.rs), so the tenant's slots are free again right after the retry
# delay instead of held until inFlight.timeoutS (300 s).
TOP = {
    "budgets": {"store": "redis", "redisUrl": "{redis}", "timeoutMs": 50, "retryMs": 1000, "replicas": 2},
    "responses": {"store": "redis", "redisUrl": "{redis}"},
    "sharedLoad": {"redisUrl": "{redis}"},
}


def _policy() -> dict:
    import copy

    from ..policy import POLICY
    p = copy.deepcopy(POLICY)
    for t in p["tenants"]:
        if t["name"] == "beta":
            t["budget"] = {"maxConcurrent": LIMIT}
    return p


def _restart_redis(r: Redis) -> Redis:
    """The same redis-server argv (port included) again: empty, as a
    restarted Redis without persistence."""
    r.proc.stop(signal.SIGKILL)
    n = Redis(Proc(r.proc.name + "-again", r.proc.argv, r.proc.log_path.parent), r.port)
    wait_until("redis PING after restart", n.ping, timeout=20)
    return n


def redis_cmd(port: int, *args: str) -> bytes:
    """One command to 127.0.0.1:`port` in RESP; the raw reply."""
    import socket
    msg = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
        c.sendall(msg.encode())
        time.sleep(0.05)
        return c.recv(65536)


def open_reservations(port: int) -> dict[str, int]:
    """Open reservations per budget key in Redis (the `...:open` hashes)."""
    out = {}
    keys = [l for l in redis_cmd(port, "KEYS", "*budget*:open").decode(errors="replace").split("\r\n")
            if l and not l[0] in "*$"]
    for k in keys:
        n = redis_cmd(port, "HLEN", k).decode().strip()
        out[k] = int(n[1:]) if n.startswith(":") else -1
    return out


def _max_concurrent(records, t0: float, t1: float) -> int:
    """Most admitted (served) requests open at once within [t0, t1): each
    from its response headers (admitted and prefilled) to its end, less
    20 ms (the client sees the end after the gateway released it)."""
    ev = []
    for x in records:
        if not x.ok:
            continue
        a, b = max(t0, x.start + x.ttfb), min(t1, x.end - 0.02)
        if a < b:
            ev += [(a, 1), (b, -1)]
    best = cur = 0
    for _, d in sorted(ev, key=lambda e: (e[0], e[1])):
        cur += d
        best = max(best, cur)
    return best


def redis_faults(logdir: Path, quick: bool) -> Result:
    r = Result("redis_faults", "Redis (budgets, shared load, Responses ids) killed, restarted empty, stalled, "
               "under two replicas", "make chaos SCENARIOS=redis_faults")
    phase = 4.0 if quick else 10.0
    with chaos_stack(logdir, "redis", sims=3, replicas=2, redis=True, top=TOP, policy=_policy(),
                     envoy_per_replica=True) as st:
        ports = [e.port for e in st.envoys]
        acme = Load(LoadConfig(ports, workers=6)).start()
        beta = Load(LoadConfig(ports, workers=4, max_tokens=48, tenants=("beta",), kinds=[("chat", True)],
                               think_s=0.05)).start()
        marks: dict[str, tuple[float, float]] = {}
        recovery: dict[str, float | None] = {}

        def mark(name: str, secs: float) -> None:
            t0 = time.monotonic()
            time.sleep(secs)
            marks[name] = (t0, time.monotonic())

        def sharing() -> bool:
            return all(ix.metric("kvasir_indexer_shared_load_local_only") == 0
                       and ix.metric("kvasir_indexer_shared_load_peers") >= 1 for ix in st.indexers)

        def store_errors() -> float:
            return sum(ix.metric("kvasir_indexer_budget_store_errors_total") for ix in st.indexers)

        def store_calm() -> bool:
            a = store_errors()
            time.sleep(0.5)
            return store_errors() == a

        try:
            time.sleep(1.5)
            mem0 = st.memory()
            mark("baseline", phase)
            st.redis.proc.stop(signal.SIGKILL)
            mark("killed", phase)
            t = time.monotonic()
            st.redis = st.ps.add(_restart_redis(st.redis))
            recovery["restarted_empty_sharing_s"] = timed_wait("load shared again", sharing, timeout=15)
            recovery["restarted_empty_budget_store_s"] = timed_wait("budget store answers", store_calm, timeout=15)
            mark("restarted_empty", max(0.5, phase - (time.monotonic() - t)))
            pid = st.redis.proc.p.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                mark("stalled", phase)
            finally:
                os.kill(pid, signal.SIGCONT)
            t = time.monotonic()
            recovery["resumed_sharing_s"] = timed_wait("load shared again", sharing, timeout=15)
            recovery["resumed_budget_store_s"] = timed_wait("budget store answers", store_calm, timeout=15)
            mark("resumed", max(0.5, phase - (time.monotonic() - t)))
            # Served again? (A reservation Redis ran after its caller gave
            # up on it would hold a slot until it is old enough to be
            # dropped, were it not undone.)
            served_before = sum(1 for x in beta.records if x.ok)
            r.figures["redis_open_reservations_after_resume"] = open_reservations(st.redis.port)
            wait = 20.0 if quick else 60.0
            again = timed_wait("the budgeted tenant served again",
                               lambda: sum(1 for x in beta.records if x.ok) > served_before, timeout=wait)
            r.figures["budgeted_tenant_served_again_after_resume_s"] = r3(
                None if again is None else time.monotonic() - marks["resumed"][0])
        finally:
            acme.stop()
            beta.stop()
        r.memory = {"before": mem0, "after": st.memory()}
        r.figures["retries_total"] = st.retries()
        # The load is the unbudgeted tenant's mix; the budgeted tenant's
        # requests (refused 429 by design beyond its budget) apart.
        r.load = summarize(acme.records)
        b = summarize(beta.records)
        r.figures["budgeted_tenant"] = {"sent": b["sent"], "served": b["succeeded"],
                                        "refused": b["failed_by_reason"]}
        r.figures["recovery_s"] = {k: r3(v) for k, v in recovery.items()}
        r.figures["time_to_recover_s"] = None if None in recovery.values() else r3(max(recovery.values()))
        r.figures["store_down_picks"] = sum(ix.metric("kvasir_indexer_budget_store_down_picks_total")
                                            for ix in st.indexers)
        r.figures["responses_store_fallbacks"] = sum(ix.metric("kvasir_indexer_responses_store_fallbacks_total")
                                                     for ix in st.indexers)
        r.figures["shared_load_failed_rounds"] = sum(ix.metric("kvasir_indexer_shared_load_rounds_total", result="failed")
                                                     for ix in st.indexers)
        t_fault = marks["killed"][0]
        named, other = classify(acme.records, [
            ("follow-up reaching the replica without the response's record while Redis was down or emptied: 404",
             lambda x: x.api == "responses_followup" and (x.reason or "").startswith("status_404") and x.start >= t_fault),
        ])
        r.figures["acme_failed_named"] = named
        r.figures["acme_failed_unexplained"] = other[:20]
        r.check("the unbudgeted tenant: zero failed requests but named follow-ups", not other, len(other), 0)
        base = [x.end - x.start for x in acme.records if x.ok and marks["baseline"][0] <= x.start < marks["baseline"][1]]
        base_p99 = percentile(base, 0.99) or 0.0
        beta_refused = [x for x in beta.records if not x.ok and x.reason != "status_429:rate_limit_exceeded"]
        r.check("the budgeted tenant: every request served or refused 429 (nothing else)", not beta_refused,
                len(beta_refused), 0)
        for name, (t0, t1) in marks.items():
            lat = [x.end - x.start for x in acme.records if x.ok and t0 <= x.start < t1]
            p99 = percentile(lat, 0.99)
            served = [x for x in beta.records if x.ok and t0 <= x.start < t1]
            conc = _max_concurrent(beta.records, t0, t1)
            r.figures[name] = {"acme_p99_s": r3(p99), "acme_max_s": r3(max(lat) if lat else None),
                               "beta_served": len(served),
                               "beta_refused_429": sum(1 for x in beta.records if not x.ok and t0 <= x.start < t1),
                               "beta_max_in_flight": conc,
                               "followups": sum(1 for x in acme.records
                                                if x.api == "responses_followup" and t0 <= x.start < t1),
                               "followups_404": sum(1 for x in acme.records if x.api == "responses_followup"
                                                    and (x.reason or "").startswith("status_404") and t0 <= x.start < t1)}
            r.check(f"{name}: no hang (p99 within the baseline's + 1 s)", p99 is not None and p99 <= base_p99 + 1.0,
                    r3(p99), r3(base_p99 + 1.0))
            bound = LIMIT if name in ("baseline", "resumed") else 2 * LIMIT
            r.check(f"{name}: the budget of {LIMIT} in flight holds (bound {bound}: one extra window when the "
                    "store's state is lost)", conc <= bound, conc, bound)
        lock = r.figures["budgeted_tenant_served_again_after_resume_s"]
        lock_bound = phase + (20.0 if quick else 60.0)
        r.check("no lockout: the budgeted tenant is served again after the stall",
                lock is not None and lock <= lock_bound, lock, lock_bound)
        r.check("sharing resumes within 15 s of Redis' return (both replicas)",
                None not in recovery.values(), r.figures["recovery_s"], 15)
    return r
