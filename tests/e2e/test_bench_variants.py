"""`bench/routing.py --variants`: what a variant writes into each indexer
replica's config file. Pool keys go to the pool; `sharedLoad.*` keys go to
the replicas' sharing section (e.g. turning `sharedLoad.placements` off to
measure what sharing recent placements gives), leaving the pool as the
plain kvasir mode's; `flow.*` keys turn on late binding (the pool's flowControl)
in every replica and in the filter's policy. No processes are started."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvasir_harness import load_script

routing = load_script("bench/routing.py")


class _Redis:
    url = "redis://127.0.0.1:1"


def _config(spec: str, replica: int = 0, redis=_Redis()) -> dict:
    variants = routing.parse_variants(spec)
    (mode, overrides), = variants.items()
    cluster = routing.Cluster(mode, Path("/nonexistent"), 0.25)
    return cluster.indexer_config(replica, redis, overrides)


def test_a_shared_load_key_goes_to_the_sharing_section_not_the_pool():
    cfg = _config("noplace:sharedLoad.placements=false", replica=1)
    assert "pools" not in cfg, cfg
    shared = cfg["sharedLoad"]
    assert shared["placements"] is False
    assert shared["replicaId"] == "indexer-1"
    assert shared["intervalMs"] == max(routing.SHARED_LOAD_MIN_MS, round(routing.SHARED_LOAD_MS * 0.25))


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
    (mode, _), = routing.parse_variants(spec).items()
    routing.VARIANTS.update(routing.parse_variants(spec))
    try:
        want = {**routing.LATE_BINDING, "saturatedPrefillTokens": 8192}
        wall_ms = round(want.pop("maxWaitSimMs") * 0.25)
        for replica in (0, 1):
            cfg = _config(spec, replica=replica)
            (pool,) = cfg["pools"]
            assert pool["flowControl"] == {"enabled": True, **want, "maxWaitMs": wall_ms}, pool
            assert "flow" not in pool and "scoring" not in pool
            assert cfg["sharedLoad"]["replicaId"] == f"indexer-{replica}"
        # The filter's policy carries the same section (its pick deadline, first-token reports).
        policy = routing.Cluster(mode, Path("/nonexistent"), 0.25).policy()
        assert policy["pools"][0]["flowControl"] == pool["flowControl"]
        assert "flowControl" not in routing.POLICY["pools"][0], "the shared policy must stay untouched"
        assert "flowControl" not in routing.Cluster("kvasir", Path("/nonexistent"), 0.25).policy()["pools"][0]
    finally:
        routing.VARIANTS.pop(mode)


def test_a_flow_wait_is_given_in_simulated_ms():
    with pytest.raises(SystemExit):
        routing.parse_variants("lb:flow.maxWaitMs=100")


def test_late_bound_kvasir_carries_it_to_its_variants_but_not_to_approx_prefix():
    routing.VAR.KVASIR["flow"] = dict(routing.LATE_BINDING)
    variants = routing.parse_variants("noplace:sharedLoad.placements=false;off:flow.enabled=false")
    routing.VARIANTS.update(variants)
    try:
        want = routing.VAR.flow_section(routing.LATE_BINDING, 0.25)
        for mode in ("kvasir", "kvasir-noplace"):
            cluster = routing.Cluster(mode, Path("/nonexistent"), 0.25)
            for replica in (0, 1):
                cfg = cluster.indexer_config(replica, _Redis(), routing.VAR.overrides(mode))
                assert cfg["pools"][0]["flowControl"] == want, (mode, cfg)
            assert cluster.policy()["pools"][0]["flowControl"] == want
        for mode in ("approx-prefix", "kvasir-off"):
            cluster = routing.Cluster(mode, Path("/nonexistent"), 0.25)
            cfg = cluster.indexer_config(0, _Redis(), routing.VAR.overrides(mode))
            assert "flowControl" not in cfg.get("pools", [{}])[0], (mode, cfg)
            assert "flowControl" not in cluster.policy()["pools"][0]
    finally:
        routing.VAR.KVASIR.clear()
        for mode in variants:
            routing.VARIANTS.pop(mode)


def test_engine_priority_goes_to_the_indexers_only():
    spec = "prio:flow.enginePriority=true"
    (mode, overrides), = routing.parse_variants(spec).items()
    routing.VARIANTS.update({mode: overrides})
    try:
        assert _config(spec)["pools"][0]["flowControl"]["enginePriority"] is True
        assert "enginePriority" not in routing.Cluster(mode, Path("/nonexistent"), 0.25).policy()["pools"][0]["flowControl"]
    finally:
        routing.VARIANTS.pop(mode)
