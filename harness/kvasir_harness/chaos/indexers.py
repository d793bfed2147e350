"""Fault scenarios of the cache-indexer and the path to it, each under the
steady mixed load: a replica of two SIGKILLed and restarted; the indexer
stopped (SIGSTOP) and slowed; the network to it cut mid Session stream
(a blackhole, not a close)."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

from ..paths import MODEL
from .load import Load, LoadConfig, classify, percentile, summarize
from .result import Result, r3, timed_wait
from .stack import ChaosStack, chaos_stack
from .tcpproxy import BLACKHOLE, DELAY, FORWARD

FO = "wasmcustom.kvasir.pool.main.failopen"
OK = "wasmcustom.kvasir.pool.main.pick.ok"
RETRY = "cluster.kvasir_pool.upstream_rq_retry"
STALLED = "wasmcustom.kvasir.session.stalled"
PICK_TIMEOUT_MS = 200

# Only the indexer knows which engine holds a stored response (and for
# which tenant): a request bound to one whose pick cannot be made is
# refused, never sent to an engine Envoy chooses (docs/security.md).
UNBOUND = ("follow-up on a stored response while no pick could be made: 503 responses_unavailable",
           lambda r: r.api == "responses_followup" and r.reason == "status_503:responses_unavailable")


# What the replica kill shows (the filter's Session stream handling): the
# picks waiting on the dead replica's stream, and those made until the VM
# opens a new stream (it waits 500 ms after one ends), fail open instead of
# going to the surviving replica. An ordinary request does not notice
# (Envoy balances it), but a Responses follow-up in that window is refused
# with 503 responses_unavailable although the survivor knows its engine.
# And a stored response whose id report went to the dying replica in its
# last moments (on its Session stream, or before the background write to
# Redis) is unknown to the survivor: its follow-up is answered 404 although
# the engine still holds it.
REPLICA_GAP = ("picks pending on, or made just after, a dead replica's Session stream fail open for up to "
               "0.5 s instead of going to the survivor, and a Responses follow-up among them gets 503 "
               "responses_unavailable; a response whose id report reached the replica just before it died "
               "(not yet in Redis) is unknown to the survivor, and its follow-up gets 404")


def _failures(r: Result, records, what: str, more: list | None = None) -> None:
    """The check that every failed request is a named loss, with the
    counts of each named loss in the figures."""
    named, other = classify(records, [UNBOUND, *(more or [])])
    r.figures["failed_named"] = named
    r.figures["failed_unexplained"] = other[:20]
    r.check(what, not other, len(other), 0)


def _blocks_agree(a: dict[str, float], b: dict[str, float], slack: float = 0.02) -> bool:
    """Two block counts per endpoint agree within `slack` (load keeps
    storing blocks between the two reads)."""
    if set(a) != set(b) or not a:
        return False
    return all(abs(a[k] - b[k]) <= max(4.0, slack * max(a[k], b[k])) for k in a)


def _probe_pick(st: ChaosStack, probe, tag: str) -> tuple[bool, str | None, str | None]:
    """A conversation's first turn through the loaded Envoy, then its second
    through `probe` (an Envoy asking one replica only): (the probe's pick
    succeeded, engine of turn 1, engine of turn 2). A correct index sends
    turn 2 to the engine that cached turn 1."""
    system = f"[{tag}] " + " ".join(f"probe rule {i} for {tag}" for i in range(60))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "first"}]
    s1, h1, b1 = st.envoy.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
    if s1 != 200:
        return False, None, None
    msgs += [{"role": "assistant", "content": json.loads(b1)["choices"][0]["message"]["content"]},
             {"role": "user", "content": "second"}]
    ok0 = probe.stat(OK)
    s2, h2, _ = probe.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
    return s2 == 200 and probe.stat(OK) > ok0, h1.get("x-gateway-destination-endpoint-served"), \
        h2.get("x-gateway-destination-endpoint-served")


def replica_killed(logdir: Path, quick: bool) -> Result:
    r = Result("indexer_replica_killed", "one of two indexer replicas SIGKILLed mid-load, restarted",
               "make chaos SCENARIOS=indexer_replica_killed")
    warm, down = (2.0, 3.0) if quick else (5.0, 10.0)
    # Two replicas as deployed: stored-response ids and load shared
    # through Redis (docs/indexer.md), so a follow-up the survivor answers
    # finds the response its peer recorded.
    top = {"responses": {"store": "redis", "redisUrl": "{redis}"}, "sharedLoad": {"redisUrl": "{redis}"}}
    with chaos_stack(logdir, "replica-killed", sims=3, replicas=2, probes=True, redis=True, top=top) as st:
        e = st.envoy
        load = Load(LoadConfig(e.port, workers=8)).start()
        try:
            time.sleep(warm)
            mem0 = st.memory()
            # The victim: the replica answering most picks (Envoy's Session
            # streams may all be on one), so its death matters.
            picks = [ix.metric("kvasir_indexer_picks_total") for ix in st.indexers]
            vi = 0 if picks[0] >= picks[1] else 1
            b, a = st.indexers[vi], st.indexers[1 - vi]
            r.figures["picks_before_kill"] = {"killed": picks[vi], "survivor": picks[1 - vi]}
            r.figures["sessions_on_killed"] = b.metric("kvasir_indexer_sessions_open")
            fo0, pa0 = e.stat(FO), a.metric("kvasir_indexer_picks_total")
            t_kill = time.monotonic()
            b.proc.stop(signal.SIGKILL)
            # Fail-opens while the stream to the dead replica is replaced.
            last_fo, fo_prev, deadline = t_kill, e.stat(FO), t_kill + down
            while time.monotonic() < deadline:
                time.sleep(0.1)
                f = e.stat(FO)
                if f > fo_prev:
                    last_fo, fo_prev = time.monotonic(), f
            ok_d = e.stat(OK)
            fo_kill = e.stat(FO) - fo0
            survivor = a.metric("kvasir_indexer_picks_total") - pa0
            r.figures["failopen_after_kill"] = fo_kill
            r.figures["last_failopen_after_kill_s"] = r3(last_fo - t_kill)
            r.figures["survivor_picks_while_down"] = survivor
            r.check("the survivor takes the picks: fail-opens stop within 2 s of the kill",
                    last_fo - t_kill <= 2.0, r3(last_fo - t_kill), 2.0)
            t_restart = time.monotonic()
            b.start()  # same ports; waits for /readyz (bounded)
            t_ready = time.monotonic() - t_restart
            r.figures["restarted_ready_s"] = r3(t_ready)
            agree = timed_wait("the restarted replica's index agrees with the survivor's",
                               lambda: _blocks_agree(st.indexed_blocks(a), st.indexed_blocks(b)), timeout=30)
            r.figures["restarted_index_agrees_s"] = None if agree is None else r3(t_ready + agree)
            r.check("the restarted replica's index matches the survivor's within 30 s of its start",
                    agree is not None, r.figures["restarted_index_agrees_s"], 30)
            probe = st.probes[vi]
            tag = uuid.uuid4().hex[:8]
            served = timed_wait("the restarted replica picks the engine holding the prefix",
                                lambda: (lambda p: p[0] and p[1] == p[2])(_probe_pick(st, probe, f"{tag}-{time.monotonic()}")),
                                timeout=20, interval=0.2)
            r.figures["restarted_correct_pick_s"] = None if served is None else r3(time.monotonic() - t_restart)
            r.check("the restarted replica serves a correct prefix pick (through an Envoy asking it alone)",
                    served is not None, r.figures["restarted_correct_pick_s"], 20 + 30)
            time.sleep(1.0)
        finally:
            load.stop()
        r.memory = {"before": mem0, "after": st.memory()}
        r.figures["retries_total"] = st.retries()
        r.load = summarize(load.records)
        r.figures["pick_ok_while_one_down"] = ok_d
        r.figures["kill_at_s"] = r3(t_kill - min(x.start for x in load.records))
        ended = {x.response_id: x.end for x in load.records if x.response_id}
        died_with = ("follow-up on a response recorded by the killed replica in its last second: 404",
                     lambda x: x.api == "responses_followup" and (x.reason or "").startswith("status_404")
                     and t_kill - 1.0 <= ended.get(x.previous, 0.0) <= t_kill + 0.5)
        _failures(r, load.records, "zero failed requests but follow-ups refused while picks failed open, or on "
                  "responses recorded by the killed replica in its last second", [died_with])
        r.figures["time_to_recover_s"] = r.figures["restarted_correct_pick_s"]
        lost = sum(r.figures["failed_named"].values())
        # Whether the responses those 404s followed are in Redis now (the
        # killed replica never wrote them through, or it did and the
        # survivor did not read them).
        from .shared_store import redis_cmd
        gone = [x.previous for x in load.records if died_with[1](x)]
        r.figures["404_followed_ids_in_redis"] = {
            i: bool(redis_cmd(st.redis.port, "KEYS", f"*{i}*").strip() not in (b"*0", b"")) for i in gone}
        r.check("no request lost when one replica of two dies", lost == 0, lost, 0, known_bug=REPLICA_GAP)
        # Both replicas agree with the engines once the load stops.
        time.sleep(0.5)
        eng = st.engine_blocks()
        exact = timed_wait("both replicas' indexes equal the engines' blocks",
                           lambda: st.indexed_blocks(a) == eng == st.indexed_blocks(b), timeout=10)
        r.check("after the load, both replicas hold exactly the engines' blocks", exact is not None, exact, 10)
    return r


# Scheduling slack on a 2-core machine shared with other builds: a
# request's own threads and Envoy's can wait this long for a core.
SLACK_MS = 250


def _added_bound(base_p50: float, base_p99: float) -> float:
    """The bound on the p99 latency a fault adds: the pick timeout, plus the
    machine's noise (what the baseline's own p99 shows above its p50) and
    SLACK_MS."""
    return PICK_TIMEOUT_MS + (base_p99 - base_p50) * 1000 + SLACK_MS


def _ttfb(records, t0: float, t1: float) -> list[float]:
    """Time to the response headers of the streamed requests started in
    [t0, t1): the pick plus the engine's prefill (a non-streamed answer's
    headers wait for its whole generation, which the pick does not change)."""
    return [x.ttfb for x in records if t0 <= x.start < t1 and x.ok and x.stream]


def stalled_and_slowed(logdir: Path, quick: bool) -> Result:
    r = Result("indexer_stalled_slowed", "indexer SIGSTOPped, then 50 ms and 500 ms added each way on its connection",
               "make chaos SCENARIOS=indexer_stalled_slowed")
    phase = 3.0 if quick else 8.0
    with chaos_stack(logdir, "stalled", sims=3, replicas=1, proxied=True, pick_timeout_ms=PICK_TIMEOUT_MS) as st:
        e, ix, px = st.envoy, st.indexers[0], st.proxies[0]
        load = Load(LoadConfig(e.port, workers=6)).start()
        marks: dict[str, tuple[float, float, int, int]] = {}

        def run(name: str, secs: float) -> None:
            t0, ok0, fo0 = time.monotonic(), e.stat(OK), e.stat(FO)
            time.sleep(secs)
            marks[name] = (t0, time.monotonic(), e.stat(OK) - ok0, e.stat(FO) - fo0)

        try:
            time.sleep(1.0)
            mem0 = st.memory()
            run("baseline", phase)
            os.kill(ix.proc.p.pid, signal.SIGSTOP)
            try:
                run("sigstop", phase)
            finally:
                os.kill(ix.proc.p.pid, signal.SIGCONT)
            resumed = time.monotonic()
            back = timed_wait("picks again after SIGCONT", lambda: _picks_flow(e),
                              timeout=20, interval=0.1)
            r.figures["picks_resume_after_sigcont_s"] = None if back is None else r3(time.monotonic() - resumed)
            px.set(DELAY, 0.05)
            run("slow_50ms", phase)
            px.set(DELAY, 0.5)
            run("slow_500ms", phase)
            px.set(FORWARD)
            restored = time.monotonic()
            back2 = timed_wait("picks again after the delay ends", lambda: _picks_flow(e), timeout=20, interval=0.1)
            r.figures["picks_resume_after_delay_s"] = None if back2 is None else r3(time.monotonic() - restored)
            time.sleep(0.5)
        finally:
            px.set(FORWARD)
            load.stop()
        r.memory = {"before": mem0, "after": st.memory()}
        r.figures["retries_total"] = st.retries()
        r.load = summarize(load.records)
        _failures(r, load.records, "zero failed requests but follow-ups on stored responses while picks failed open")
        base = _ttfb(load.records, *marks["baseline"][:2])
        base_p50, base_p99 = percentile(base, 0.5), percentile(base, 0.99)
        r.figures["baseline_ttfb_p50_ms"] = r3(base_p50 * 1000)
        r.figures["baseline_ttfb_p99_ms"] = r3(base_p99 * 1000)
        bound_ms = _added_bound(base_p50, base_p99)
        for name in ("sigstop", "slow_50ms", "slow_500ms"):
            t0, t1, ok, fo = marks[name]
            xs = _ttfb(load.records, t0, t1)
            p99 = percentile(xs, 0.99)
            added = None if p99 is None else (p99 - base_p50) * 1000
            r.figures[f"{name}_picks_ok"] = ok
            r.figures[f"{name}_failopen"] = fo
            r.figures[f"{name}_ttfb_p99_ms"] = r3(None if p99 is None else p99 * 1000)
            r.figures[f"{name}_added_p99_ms"] = r3(added)
            r.check(f"{name}: p99 added latency within the pick timeout ({PICK_TIMEOUT_MS} ms) + noise",
                    added is not None and added <= bound_ms, r3(added), r3(bound_ms))
        r.check("sigstop: picks failed open", marks["sigstop"][3] > 0, marks["sigstop"][3], "> 0")
        r.check("slow_500ms: picks failed open at their deadline", marks["slow_500ms"][3] > 0, marks["slow_500ms"][3], "> 0")
        r.check("slow_50ms: picks still answered (below the timeout)", marks["slow_50ms"][2] > 0, marks["slow_50ms"][2], "> 0")
        resumes = [r.figures["picks_resume_after_sigcont_s"], r.figures["picks_resume_after_delay_s"]]
        r.figures["time_to_recover_s"] = None if None in resumes else max(resumes)
        r.check("picks resume after the stall and after the delay",
                back is not None and back2 is not None, [r.figures["picks_resume_after_sigcont_s"],
                                                         r.figures["picks_resume_after_delay_s"]], 20)
    return r


def _picks_flow(e) -> bool:
    ok = e.stat(OK)
    time.sleep(0.3)
    return e.stat(OK) > ok


def network_cut(logdir: Path, quick: bool) -> Result:
    r = Result("indexer_network_cut", "Envoy-to-indexer network cut mid Session stream (blackhole: no FIN, no RST)",
               "make chaos SCENARIOS=indexer_network_cut")
    cut = 5.0 if quick else 30.0
    with chaos_stack(logdir, "netcut", sims=3, replicas=1, proxied=True, pick_timeout_ms=PICK_TIMEOUT_MS) as st:
        e, ix, px = st.envoy, st.indexers[0], st.proxies[0]
        load = Load(LoadConfig(e.port, workers=6)).start()
        try:
            timed_wait("session streams open", lambda: ix.metric("kvasir_indexer_sessions_open") >= 1, timeout=10)
            time.sleep(1.5)
            mem0 = st.memory()
            base = (time.monotonic(), e.stat(OK), e.stat(FO), e.stat(STALLED))
            time.sleep(1.5)
            t_cut = time.monotonic()
            ok0, fo0, stalled0 = e.stat(OK), e.stat(FO), e.stat(STALLED)
            r.figures["sessions_open_at_cut"] = ix.metric("kvasir_indexer_sessions_open")
            px.set(BLACKHOLE)
            time.sleep(cut)
            t_restore = time.monotonic()
            ok1, fo1, stalled1 = e.stat(OK), e.stat(FO), e.stat(STALLED)
            px.set(FORWARD)
            back = timed_wait("picks again after the link returns", lambda: _picks_flow(e), timeout=30, interval=0.1)
            r.figures["picks_resume_after_restore_s"] = None if back is None else r3(time.monotonic() - t_restore)
            time.sleep(1.0)
        finally:
            px.set(FORWARD)
            load.stop()
        r.memory = {"before": mem0, "after": st.memory()}
        r.figures["retries_total"] = st.retries()
        r.load = summarize(load.records)
        r.figures.update({"cut_s": cut, "picks_ok_during_cut": ok1 - ok0, "failopen_during_cut": fo1 - fo0,
                          "session_stalled_during_cut": stalled1 - stalled0})
        _failures(r, load.records, "zero failed requests but follow-ups on stored responses while picks failed open")
        basel = _ttfb(load.records, base[0], t_cut)
        during = _ttfb(load.records, t_cut, t_restore)
        p50, bp99, p99 = percentile(basel, 0.5), percentile(basel, 0.99), percentile(during, 0.99)
        added = None if p99 is None or p50 is None else (p99 - p50) * 1000
        bound = _added_bound(p50 or 0.0, bp99 or 0.0)
        r.figures["added_p99_ms_during_cut"] = r3(added)
        r.check("p99 added latency during the cut within the pick timeout + noise",
                added is not None and added <= bound, r3(added), r3(bound))
        r.check("the filter gave the silent stream up (session.stalled)", stalled1 - stalled0 >= 1,
                stalled1 - stalled0, ">= 1")
        r.figures["time_to_recover_s"] = r.figures["picks_resume_after_restore_s"]
        r.check("picks resume after the link returns", back is not None, r.figures["picks_resume_after_restore_s"], 30)
    return r
