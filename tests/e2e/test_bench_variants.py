"""`bench/routing.py --variants`: what a variant writes into each indexer
replica's config file. Pool keys go to the pool; `sharedLoad.*` keys go to
the replicas' sharing section (e.g. turning `sharedLoad.placements` off to
measure what sharing recent placements gives), leaving the pool as the
plain kvasir mode's; `flow.*` keys turn on late binding (the pool's flowControl)
in every replica and in the filter's policy. No processes are started."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest


from kvasir_harness.bench import sim_cluster as CL  # the cluster each run starts
from kvasir_harness.bench import variants as VAR


class _Redis:
    url = "redis://127.0.0.1:1"


def _config(spec: str, replica: int = 0, redis=_Redis()) -> dict:
    variants = VAR.parse_variants(spec)
    (mode, overrides), = variants.items()
    cluster = CL.Cluster(mode, Path("/nonexistent"), 0.25)
    return cluster.indexer_config(replica, redis, overrides)


def test_a_shared_load_key_goes_to_the_sharing_section_not_the_pool():
    cfg = _config("noplace:sharedLoad.placements=false", replica=1)
    assert "pools" not in cfg, cfg
    shared = cfg["sharedLoad"]
    assert shared["placements"] is False
    assert shared["replicaId"] == "indexer-1"
    assert shared["intervalMs"] == max(CL.SHARED_LOAD_MIN_MS, round(CL.SHARED_LOAD_MS * 0.25))


def test_pool_keys_still_go_to_the_pool_beside_a_shared_load_key():
    cfg = _config("mix:queuedPrefill=0.5,sharedLoad.placements=false")
    (pool,) = cfg["pools"]
    assert pool["scoring"] == {"queuedPrefill": 0.5}
    assert "sharedLoad" not in pool
    assert cfg["sharedLoad"]["placements"] is False


def test_without_redis_a_shared_load_key_writes_nothing():
    assert _config("noplace:sharedLoad.placements=false", redis=None) == {}


def test_a_flow_key_turns_on_late_binding_in_every_replica_and_the_policy():
    spec = "lb:flow.saturatedPrefillTokens=8192"
    (mode, _), = VAR.parse_variants(spec).items()
    VAR.VARIANTS.update(VAR.parse_variants(spec))
    try:
        want = {**VAR.LATE_BINDING, "saturatedPrefillTokens": 8192}
        wall_ms = round(want.pop("maxWaitSimMs") * 0.25)
        for replica in (0, 1):
            cfg = _config(spec, replica=replica)
            (pool,) = cfg["pools"]
            assert pool["flowControl"] == {"enabled": True, **want, "maxWaitMs": wall_ms}, pool
            assert "flow" not in pool and "scoring" not in pool
            assert cfg["sharedLoad"]["replicaId"] == f"indexer-{replica}"
        # The filter's policy carries the same section (its pick deadline, first-token reports).
        policy = CL.Cluster(mode, Path("/nonexistent"), 0.25).policy()
        assert policy["pools"][0]["flowControl"] == pool["flowControl"]
        assert "flowControl" not in CL.POLICY["pools"][0], "the shared policy must stay untouched"
        assert "flowControl" not in CL.Cluster("kvasir", Path("/nonexistent"), 0.25).policy()["pools"][0]
    finally:
        VAR.VARIANTS.pop(mode)


def test_a_flow_wait_is_given_in_simulated_ms():
    with pytest.raises(SystemExit):
        VAR.parse_variants("lb:flow.maxWaitMs=100")


def test_late_bound_kvasir_carries_it_to_its_variants_but_not_to_approx_prefix():
    modes = VAR.configure(True, "noplace:sharedLoad.placements=false;off:flow.enabled=false;qp25:queuedPrefill=0.25")
    try:
        assert modes == ["kvasir-noplace", "kvasir-off", "kvasir-qp25"]
        want = VAR.flow_section(VAR.LATE_BINDING, 0.25)
        for mode in ("kvasir", "kvasir-noplace", "kvasir-qp25"):
            cluster = CL.Cluster(mode, Path("/nonexistent"), 0.25)
            for replica in (0, 1):
                cfg = cluster.indexer_config(replica, _Redis(), VAR.overrides(mode))
                assert cfg["pools"][0]["flowControl"] == want, (mode, cfg)
            assert cluster.policy()["pools"][0]["flowControl"] == want
        # Late binding brings its scoring weights; a variant's own keys win.
        scoring = {m: CL.Cluster(m, Path("/nonexistent"), 0.25).indexer_config(0, None, VAR.overrides(m))
                   ["pools"][0].get("scoring") for m in ("kvasir", "kvasir-noplace", "kvasir-qp25")}
        assert scoring == {"kvasir": VAR.LATE_SCORING, "kvasir-noplace": VAR.LATE_SCORING,
                           "kvasir-qp25": {"queuedPrefill": 0.25}}, scoring
        for mode in ("approx-prefix", "kvasir-off"):
            cluster = CL.Cluster(mode, Path("/nonexistent"), 0.25)
            cfg = cluster.indexer_config(0, _Redis(), VAR.overrides(mode))
            assert "flowControl" not in cfg.get("pools", [{}])[0], (mode, cfg)
            assert "flowControl" not in cluster.policy()["pools"][0]
        assert "pools" not in CL.Cluster("approx-prefix", Path("/nonexistent"), 0.25).indexer_config(
            0, None, VAR.overrides("approx-prefix"))
    finally:
        VAR.configure(False, "")


def test_engine_priority_goes_to_the_indexers_only():
    spec = "prio:flow.enginePriority=true"
    (mode, overrides), = VAR.parse_variants(spec).items()
    VAR.VARIANTS.update({mode: overrides})
    try:
        assert _config(spec)["pools"][0]["flowControl"]["enginePriority"] is True
        assert "enginePriority" not in CL.Cluster(mode, Path("/nonexistent"), 0.25).policy()["pools"][0]["flowControl"]
    finally:
        VAR.VARIANTS.pop(mode)


def test_shortest_prefill_first_goes_to_the_indexers_and_the_engines_policy_to_the_sims():
    spec = "sjf:flow.enginePriority=true,flow.enginePriorityBy=prefill,sim.schedulingPolicy=priority"
    (mode, overrides), = VAR.parse_variants(spec).items()
    assert overrides["sim"] == {"schedulingPolicy": "priority"}
    VAR.VARIANTS.update({mode: overrides})
    try:
        pool = _config(spec)["pools"][0]
        assert pool["flowControl"]["enginePriorityBy"] == "prefill", pool
        assert "sim" not in pool and "schedulingPolicy" not in json.dumps(_config(spec)), pool
        cluster = CL.Cluster(mode, Path("/nonexistent"), 0.25)
        assert "enginePriorityBy" not in cluster.policy()["pools"][0]["flowControl"]
        assert cluster.sim_args()[-2:] == ["--scheduling-policy", "priority"]
    finally:
        VAR.VARIANTS.pop(mode)
    assert "--scheduling-policy" not in CL.Cluster("kvasir", Path("/nonexistent"), 0.25).sim_args()


@pytest.mark.parametrize("spec", ["x:sim.schedulingPolicy=sjf", "x:sim.maxNumSeqs=8"])
def test_the_engines_take_only_a_known_scheduling_policy(spec):
    with pytest.raises(SystemExit, match=re.escape("sim.schedulingPolicy=fcfs|priority only")):
        VAR.parse_variants(spec)
