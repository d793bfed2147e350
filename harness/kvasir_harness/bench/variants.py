"""The kvasir mode's variants in the routing benchmark (`bench/routing.py
--variants`): other cache-indexer pool settings, the replicas' sharing
settings, and late binding (the pool's flow control), which
bench/governance.py's below-saturation runs use too."""

from __future__ import annotations


# Scoring variants of the kvasir mode (`--variants`): mode name -> the
# cache-indexer pool's settings to override (see cache-indexer/README.md):
# `scoring` weights by bare key, other pool sections by dotted key
# (`saturation.waiting`); `flow.*` keys turn on late binding (below).
VARIANTS: dict[str, dict] = {}

# Late binding: the pool's flow control with picks held only
# once every engine has about 0.2 s of prefill queued (6,554 tokens at
# h100-8b's ~30k tokens/s), released as the engines' queued prefill drains
# (learned from first-token reports) and re-checked every 10 ms while picks
# wait; never shed (waits in simulated ms, scaled by the run's time scale).
# Chosen from the tries in bench/results/governance.md ("Below
# saturation"): by requests alone, threshold 0.4 held almost no pick and
# holding picks (0.2) was worse than kvasir alone. No reserve: this late
# binding places picks, it does not isolate tenants; with the pool default
# the chat's popular tenants waited while engines had room
# (bench/results/late-binding-deployed/README.md). The trace has one
# tenant, which the reserve never holds. bench/governance.py's
# FLOW["below"]; a variant's `flow.*` keys override it.
LATE_BINDING = {"threshold": 1.0, "saturatedPrefillTokens": 6554, "maxWaitSimMs": 60000, "maxQueued": 4096,
                "maxQueuedPerTenant": 4096, "reserve": 0.0}

# The scoring weights kvasir runs with late binding: `queuedPrefill` 0.15
# instead of the indexer's 0.25. Late binding already holds picks while
# every engine is busy, so the queue term can weigh less against the
# prefix: on the deployed 2x2 shape it met the deployed hit-rate target where
# 0.25 missed it, TTFT and balance no worse on the trace and the chat within
# its run-to-run noise (bench/results/late-binding-deployed/README.md).
# Without late binding the single-proxy sweep found 0.1 and below piled
# long prompts onto their holders.
LATE_SCORING = {"queuedPrefill": 0.15}

# Whether the deployed shape's kvasir mode runs with late binding unless
# `--late-binding` says otherwise. On: it beat kvasir without it on
# balance and TTFT at trace loads 1.0 and 1.5 and on the chat
# (bench/results/late-binding-deployed/README.md). It needs
# sharedLoad.shareReports: without it reports that reached the other
# replica left their prefill queued, the pool looked saturated, and the
# queue ran away in most 2x2 runs (bench/results/routing-deployed-analysis.md).
# The single-proxy shape keeps it off, so its results stay comparable.
DEPLOYED_LATE_BINDING = True


def flow_section(flow: dict, time_scale: float) -> dict:
    """A pool's `flowControl` (indexer pools file and policy alike) from
    `flow`, whose `maxWaitSimMs` is in simulated ms, waits in wall ms."""
    f = dict(flow)
    sim_ms = f.pop("maxWaitSimMs")
    return {"enabled": True, **f, "maxWaitMs": max(1, round(sim_ms * time_scale))}


# The kvasir mode's own pool settings, by section (`--late-binding on`:
# {"flow": LATE_BINDING, "scoring": LATE_SCORING}); its variants start
# from them.
KVASIR: dict[str, dict] = {}


def overrides(mode: str) -> dict | None:
    """The pool settings of `mode` by section: kvasir's own, a variant's
    over them; None for other modes or none to change."""
    if mode in ("kvasir", "picker"):  # the picker ranks as kvasir does
        return dict(KVASIR) or None
    if mode not in VARIANTS:
        return None
    out = dict(KVASIR)
    for section, kv in VARIANTS[mode].items():
        out[section] = {**out.get(section, {}), **kv}
    return out


def flow(mode: str, time_scale: float) -> dict | None:
    """`mode`'s pool `flowControl` (late binding), or None when it has none
    or a variant turns it off (`flow.enabled=false`)."""
    f = (overrides(mode) or {}).get("flow")
    return flow_section(f, time_scale) if f and f.get("enabled", True) else None


def configure(late: bool, spec: str) -> list[str]:
    """Sets KVASIR and VARIANTS for one run, from nothing (a process that
    runs the benchmark more than once, as the tests do, carries nothing
    over): kvasir's late binding and its scoring when `late`, the variants
    `spec` names. Returns the variants' mode names."""
    KVASIR.clear()
    VARIANTS.clear()
    if late:
        KVASIR["flow"] = dict(LATE_BINDING)
        KVASIR["scoring"] = dict(LATE_SCORING)
    VARIANTS.update(parse_variants(spec))
    return list(VARIANTS)


def parse_variants(spec: str) -> dict[str, dict]:
    """`name:key=v,sec.key=v;name2:...` -> {"kvasir-name": {"scoring": {key: v}, "sec": {key: v}}}.
    The `sim` section is the engines' (`sim.schedulingPolicy=priority`:
    vLLM's `--scheduling-policy`), not the indexer's."""
    out = {}
    for part in filter(None, (x.strip() for x in spec.split(";"))):
        name, _, kvs = part.partition(":")
        if not name or not kvs:
            raise SystemExit(f"--variants: expected name:key=value[,key=value], got {part!r}")
        w: dict[str, dict] = {}
        for kv in kvs.split(","):
            k, _, v = kv.partition("=")
            section, _, key = k.strip().rpartition(".")
            v = v.strip()
            if v in ("true", "false"):
                val: object = v == "true"
            elif v == "null":
                val = None
            else:
                try:
                    f = float(v)
                except ValueError:
                    # A word (`flow.enginePriorityBy=prefill`, `sim.schedulingPolicy=priority`).
                    val = v
                else:
                    # Integral values as JSON integers: counts (`saturation.waiting`) are u32.
                    val = int(f) if f.is_integer() else f
            w.setdefault(section or "scoring", {})[key] = val
        sim = w.get("sim", {})
        if set(sim) - {"schedulingPolicy"} or sim.get("schedulingPolicy", "fcfs") not in ("fcfs", "priority"):
            raise SystemExit(f"--variants {name}: the engines take sim.schedulingPolicy=fcfs|priority only, "
                             f"got {sim}")
        if "flow" in w:
            if "maxWaitMs" in w["flow"]:
                raise SystemExit(f"--variants {name}: give flow.maxWaitSimMs (simulated ms), not flow.maxWaitMs")
            w["flow"] = {**LATE_BINDING, **w["flow"]}
        out[f"kvasir-{name}"] = w
    return out
