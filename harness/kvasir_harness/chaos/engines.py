"""Fault scenarios of the engines, each under the steady mixed load: an
engine SIGKILLed mid-load and restarted; its KV events lost, duplicated,
reordered, and its publisher restarted."""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

from .. import prom
from ..procs import request
from ..sim import restart_sim, wait_sim
from .load import Load, LoadConfig, summarize
from .result import Result, r3, timed_wait
from .stack import chaos_stack

RETRY = "cluster.kvasir_pool.upstream_rq_retry"
CUT = "stream already started on the killed engine: cut"
CX_FAIL = "cluster.kvasir_pool.upstream_cx_connect_fail"


def _by(ix, name: str, endpoint: str) -> float:
    return prom.total(ix.metrics_text(), name, endpoint=endpoint)


def engine_killed(logdir: Path, quick: bool) -> Result:
    r = Result("engine_killed", "an engine SIGKILLed mid-load, restarted on the same address",
               "make chaos SCENARIOS=engine_killed")
    warm, down = (3.0, 3.0) if quick else (5.0, 10.0)
    with chaos_stack(logdir, "engine-killed", sims=3, replicas=1) as st:
        e, ix = st.envoy, st.indexers[0]
        victim = st.sims[1]
        addr = victim.address
        load = Load(LoadConfig(e.port, workers=12, max_tokens=64)).start()
        try:
            time.sleep(warm)
            mem0 = st.memory()
            blocks_before = st.indexed_blocks(ix).get(addr, 0)
            restarts0 = _by(ix, "kvasir_indexer_engine_restarts_total", addr)
            changes0 = _by(ix, "kvasir_indexer_kv_event_source_changes_total", addr)
            resyncs0 = _by(ix, "kvasir_indexer_resyncs_total", addr)
            t_kill = time.monotonic()
            victim.proc.stop(signal.SIGKILL)
            d_ix = timed_wait("the indexer marks the engine unhealthy",
                              lambda: prom.by_label(ix.metrics_text(), "kvasir_indexer_endpoint_healthy",
                                                    "endpoint").get(addr) == 0, timeout=15)
            d_envoy = timed_wait("Envoy's health check marks it", lambda: not e.healthy("kvasir_pool", [addr]),
                                 timeout=15 - (d_ix or 0))
            gone = timed_wait("its blocks leave the index", lambda: st.indexed_blocks(ix).get(addr, 0) == 0, timeout=15)
            t_detected = time.monotonic()
            r.figures.update({"indexer_detects_s": r3(None if d_ix is None else time.monotonic() - t_kill),
                              "blocks_before_kill": blocks_before,
                              "blocks_left_index_s": None if gone is None else r3(t_detected - t_kill)})
            # After detection (and a grace for requests already past their
            # pick), nothing is sent to it: no retry, no refused connection.
            time.sleep(0.5)
            retry0, cx0, w0 = e.stat(RETRY), e.stat(CX_FAIL), time.monotonic()
            time.sleep(max(0.5, down - (time.monotonic() - t_kill)))
            retry_after, cx_after = e.stat(RETRY) - retry0, e.stat(CX_FAIL) - cx0
            r.figures["window_after_detection_s"] = r3(time.monotonic() - w0)
            t_restart = time.monotonic()
            new = restart_sim(victim, st.logdir, "sim1-restarted")
            st.sims[1] = new
            wait_sim(new)
            healthy = timed_wait("the indexer sees it healthy again",
                                 lambda: prom.by_label(ix.metrics_text(), "kvasir_indexer_endpoint_healthy",
                                                       "endpoint").get(addr) == 1, timeout=20)
            served = timed_wait("it serves picked requests again",
                                lambda: new.metric("vllm:request_success_total") > 0, timeout=20)
            indexed = timed_wait("its new blocks are indexed", lambda: st.indexed_blocks(ix).get(addr, 0) > 0,
                                 timeout=20)
            r.figures["back_in_service_s"] = None if served is None else r3(time.monotonic() - t_restart)
            time.sleep(1.0)
        finally:
            load.stop()
        r.memory = {"before": mem0, "after": st.memory()}
        r.figures["retries_total"] = st.retries()
        r.load = summarize(load.records)
        time.sleep(0.5)
        eng = st.engine_blocks()
        exact = timed_wait("the index equals the engines' blocks", lambda: st.indexed_blocks(ix) == eng, timeout=10)
        r.figures.update({
            "engine_restarts_seen": _by(ix, "kvasir_indexer_engine_restarts_total", addr) - restarts0,
            "event_source_changes": _by(ix, "kvasir_indexer_kv_event_source_changes_total", addr) - changes0,
            "resyncs": _by(ix, "kvasir_indexer_resyncs_total", addr) - resyncs0,
        })
        # Which requests the kill cost, and why.
        origin = {x.response_id: x.served for x in load.records if x.response_id}
        inflight = [x for x in load.records if x.start < t_kill < x.end]
        table: dict[str, Counter] = {}
        for x in inflight:
            k = f"{x.api}{'/stream' if x.stream else ''}"
            table.setdefault(k, Counter())["ok" if x.ok else (x.reason or "?")] += 1
        r.figures["in_flight_at_kill"] = {k: dict(v) for k, v in sorted(table.items())}
        named, unexplained = Counter(), []
        for x in load.records:
            if x.ok:
                continue
            if x.reason == "stream_cut" and x.served == addr and x.start < t_kill:
                named[CUT] += 1
            elif x.reason == "status_404" and x.previous and origin.get(x.previous) == addr:
                named["follow-up of a response stored on the killed engine: 404"] += 1
            else:
                unexplained.append(f"{x.api}{'/stream' if x.stream else ''}: {x.reason} via {x.served}")
        r.figures["failed_named"] = dict(named)
        # In flight on the killed engine: the streams it cut, and the
        # requests Envoy retried on another engine (its retry counter; the
        # load has no other retries).
        r.figures["on_killed_engine"] = {"cut": named.get(CUT, 0), "retried_elsewhere_and_served": st.retries()}
        r.figures["failed_unexplained"] = unexplained[:20]
        r.check("every failed request is a named loss (a stream cut on the killed engine, "
                "a stored response that died with it)", not unexplained, len(unexplained), 0)
        nonstream = [x for x in inflight if not x.stream and x.api != "count_tokens"]
        r.check("in-flight non-streamed requests all succeed (retried on another engine)",
                all(x.ok for x in nonstream), sum(not x.ok for x in nonstream), 0)
        r.figures["time_to_recover_s"] = r.figures["back_in_service_s"]
        r.check("the indexer detects the dead engine within 5 s", d_ix is not None and d_ix <= 5, r3(d_ix), 5)
        r.check("its blocks leave the index within 5 s", gone is not None and t_detected - t_kill <= 5,
                r.figures["blocks_left_index_s"], 5)
        r.figures["retries_after_detection"] = retry_after
        r.figures["refused_connections_after_detection"] = cx_after
        r.check("no request sent to it after detection (no retry, no refused connection)",
                retry_after == 0 and cx_after == 0, [retry_after, cx_after], [0, 0])
        r.check("picked again after its restart, new blocks indexed, within 20 s",
                healthy is not None and served is not None and indexed is not None,
                r.figures["back_in_service_s"], 20)
        r.check("its events followed from sequence 0 (restart or new sockets seen)",
                r.figures["engine_restarts_seen"] + r.figures["event_source_changes"] + r.figures["resyncs"] >= 1,
                r.figures["engine_restarts_seen"] + r.figures["event_source_changes"] + r.figures["resyncs"], ">= 1")
        r.check("after the load, the index holds exactly the engines' blocks", exact is not None, exact, 10)
        if d_envoy is not None:
            r.figures["envoy_health_detects_s"] = r3(d_envoy + (d_ix or 0))
    return r


EVENT_FAULTS = [
    ("loss", {"drop_next_event_batches": 5}),
    ("duplicate", {"duplicate_next_event_batches": 5}),
    ("reorder", {"reorder_next_event_batches": 5}),
    # The engine restarted as vLLM restarts: the cache empty, the event
    # sequence back at 0, the replay buffer gone (done while the engine is
    # idle, between two load phases: the cache is only cleared when idle).
    ("publisher_restart", "restart"),
    # Only the publisher restarted, the engine keeping its cache (no vLLM
    # does this; a stand-in for a subscriber that cannot tell): the index
    # forgets what the engine held before, a cost in cache hits only.
    ("publisher_restart_cache_kept", "restart_kept"),
]

COUNTERS = ["event_gaps_total", "event_duplicates_total", "replays_total", "replayed_batches_total",
            "resyncs_total", "engine_restarts_total", "events_skipped_total"]


def _post(port: int, path: str) -> int:
    return request("POST", port, path, "", timeout=5)[0]


def kv_events(logdir: Path, quick: bool) -> Result:
    r = Result("kv_events", "KV events lost, duplicated, reordered; the publisher restarted",
               "make chaos SCENARIOS=kv_events")
    run_s = 2.0 if quick else 5.0
    with chaos_stack(logdir, "kv-events", sims=2, replicas=1) as st:
        e, ix = st.envoy, st.indexers[0]
        target = st.sims[0]
        addr = target.address
        records = []
        mem0 = st.memory()
        engine = lambda: target.metric("vllm_sim:cached_blocks")  # noqa: E731
        indexed = lambda: st.indexed_blocks(ix).get(addr, 0.0)  # noqa: E731
        for name, fault in EVENT_FAULTS:
            before = {c: _by(ix, f"kvasir_indexer_{c}", addr) for c in COUNTERS}
            if fault == "restart":
                timed_wait("the engine idle", lambda: target.metric("vllm:num_requests_running") == 0, timeout=10)
                assert _post(target.port, "/sim/clear-cache") == 200
                assert _post(target.port, "/sim/restart-events") == 200
            load = Load(LoadConfig(e.port, workers=6)).start()
            try:
                time.sleep(1.0)
                if fault == "restart_kept":
                    assert _post(target.port, "/sim/restart-events") == 200
                elif isinstance(fault, dict):
                    st.sim_fault(target, **fault)
                time.sleep(run_s)
            finally:
                load.stop()
            records += load.records
            t_stop = time.monotonic()
            seen = lambda: {c: _by(ix, f"kvasir_indexer_{c}", addr) - before[c] for c in COUNTERS}  # noqa: E731
            if fault == "restart_kept":
                time.sleep(1.0)
                got, true = indexed(), engine()
                r.figures[name] = {"indexer_saw": {k: v for k, v in seen().items() if v}, "engine_blocks": true,
                                   "indexed_blocks": got}
                r.check(f"{name}: the index claims no block the engine lacks (it may miss some)",
                        got <= true, got, f"<= {true}")
                continue

            # Converged: the index's count for the engine equals the
            # engine's own, twice in a row 200 ms apart (the load stopped,
            # so both stay put once equal).
            def same() -> bool:
                a = indexed() == engine()
                time.sleep(0.2)
                return a and indexed() == engine()
            conv = timed_wait(f"index converges after {name}", same, timeout=15)
            r.figures[name] = {"converged_after_load_stop_s": r3(None if conv is None else time.monotonic() - t_stop),
                               "indexer_saw": {k: v for k, v in seen().items() if v},
                               "engine_blocks": engine(), "indexed_blocks": indexed()}
            r.check(f"{name}: the index converges to the engine's blocks within 15 s of the load stopping",
                    conv is not None, r.figures[name]["converged_after_load_stop_s"], 15)
        r.memory = {"before": mem0, "after": st.memory()}
        r.figures["retries_total"] = st.retries()
        r.load = summarize(records)
        conv = [f["converged_after_load_stop_s"] for f in r.figures.values()
                if isinstance(f, dict) and "converged_after_load_stop_s" in f]
        r.figures["time_to_recover_s"] = None if None in conv else max(conv)
        r.check("zero failed requests", r.load["failed"] == 0, r.load["failed"], 0)
        for name, counter in (("loss", "event_gaps_total"), ("duplicate", "event_duplicates_total"),
                              ("reorder", "event_gaps_total"), ("publisher_restart", "engine_restarts_total")):
            n = r.figures[name]["indexer_saw"].get(counter, 0)
            r.check(f"{name} seen by the indexer ({counter})", n >= 1, n, ">= 1")
    return r
