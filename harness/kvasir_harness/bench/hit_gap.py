"""Where a mode's cache hits fell short of the pooled-cache bound on the
trace (the deployed hit-rate target): each request's shortfall (the tokens
one pooled LRU cache would have served from cache, `bound.json`'s
`per_request_cached`, less the tokens its engine did) put down to one
cause, read from the run's own records and the trace's block hashes.

For a request R with a shortfall, the *holders* are the earlier requests
whose prompt shares more leading 512-token trace blocks with R's than R
got from cache: any of them could have given R more. Then:

- **in prefill**: no holder had its first token when R was sent (the
  prefix was still being computed: nothing held it yet);
- **sent elsewhere**: some holder had, but R went to an engine none of
  those holders ran on (the router chose another engine: load, or a
  prefix it did not know);
- **lost in the restart**: R went to the restarted engine and every ready
  holder there had finished before the restart;
- **evicted**: R went to an engine a ready holder ran on, and got less
  (the engine's cache, under pressure, had dropped it);
- **no earlier holder**: the bound's hit came from a request R's records
  do not show as earlier (failed or not yet sent).

For the requests sent elsewhere it also says how many found the latest
ready holder's engine with more prefill in progress (uncached tokens of
requests sent there and not at their first token yet), beyond the engine
they went to, than the holder's cache would have saved them: a trade of
hits for TTFT that the bound, one cache with no load, never makes; and
what the hit rate would be had only the others stayed and hit.

Given the engines' cache size, it also replays each engine's cache as an
LRU of trace blocks over the requests it served (in the order they were
sent; the restarted engine's emptied at the restart) and says, for each of
those others, whether the latest holder's engine still held the prefix
when the request was sent, another ready holder's engine did, or none did
(evicted everywhere: no router could have hit it). It states how often the
model's hits agree with the engines' own, request by request.

Usage: `.tools/venv/bin/python bench/hit_gap.py RESULTS_DIR [MODE ...]` (a deployed or
single-proxy routing results folder with `bound.json` and the trace's
runs; default: every mode of every trace run). Pure reading; prints a
Markdown table.
"""

from __future__ import annotations

import collections
import csv
import json
import math
import sys
from pathlib import Path

from kvasir_harness.paths import TRACE

BLOCK = 512
CAUSES = ["in prefill", "sent elsewhere", "lost in the restart", "evicted", "no earlier holder"]


def window_hashes(trace: Path, from_s: float, window_s: float | None) -> list[list[int]]:
    """The block hashes of the trace's requests in the window, in order
    (request ids are positions in the window, as kvasir-bench numbers them)."""
    to = math.inf if window_s is None else from_s + window_s
    out = []
    with trace.open() as f:
        for line in f:
            r = json.loads(line)
            if from_s * 1e3 <= r["timestamp"] < to * 1e3:
                out.append(r["hash_ids"])
    return out


def chain(hashes: list[int]) -> list[int]:
    """One key per leading-prefix length (the key of blocks 0..k)."""
    keys, k = [], 0
    for h in hashes:
        k = hash((k, h))
        keys.append(k)
    return keys


def restarted_endpoint(rows: list[dict], restart_s: float | None) -> str | None:
    """The engine whose requests failed around the restart (the kill cuts
    off what it had in flight)."""
    if restart_s is None:
        return None
    failed = collections.Counter(r["endpoint"] for r in rows
                                 if r["outcome"] != "ok" and r["endpoint"] and float(r["sent_s"]) <= restart_s)
    return failed.most_common(1)[0][0] if failed else None


def backlog(sent: list[tuple[float, float, int]], at: float) -> int:
    """Uncached prompt tokens of an engine's requests in prefill at `at`
    (sent before it, first token after it): the prefill a request sent
    then would queue behind."""
    return sum(u for s, ready, u in sent if s < at < ready)


class Caches:
    """Each engine's prefix cache modelled as an LRU of trace blocks (keys
    from `chain`), `capacity` blocks per engine: what vLLM's free-block
    queue keeps, at the trace's granularity."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.on: dict[str, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
        # Requests whose modelled hit was within one block of the engine's.
        self.agree = self.total = 0

    def holds(self, endpoint: str, key: int) -> bool:
        return key in self.on[endpoint]

    def clear(self, endpoint: str) -> None:
        self.on[endpoint] = collections.OrderedDict()

    def admit(self, endpoint: str, keys: list[int], cached_tokens: int) -> None:
        """A request served on `endpoint`: its blocks become the most recent;
        `cached_tokens`, what the engine said it hit, checks the model."""
        c = self.on[endpoint]
        n = 0
        while n < len(keys) and keys[n] in c:
            n += 1
        self.total += 1
        self.agree += abs(n - cached_tokens // BLOCK) <= 1
        for k in keys:
            if k in c:
                c.move_to_end(k)
            else:
                c[k] = True
        while len(c) > self.capacity:
            c.popitem(last=False)


def where_held(caches: Caches | None, key: int, latest: str, ready: list[tuple[str, float]], chosen: str) -> str:
    """Which engine the model says still held a request's missing prefix
    block when it was sent: the latest ready holder's, another ready
    holder's, or none (evicted everywhere)."""
    if caches is None:
        return ""
    if caches.holds(latest, key):
        return "holder"
    if any(caches.holds(e, key) for e, _ in ready if e != chosen):
        return "other holder"
    return "none"


def causes(rows: list[dict], hashes: list[list[int]], bound: list[int], restart_s: float | None,
           capacity_tokens: int | None = None) -> dict:
    """Tokens of shortfall per cause, and the totals; for each request sent
    elsewhere, what it would have queued behind on the latest ready
    holder's engine and what it did on its own (`elsewhere`) and, given
    each engine's cache size in tokens, where the LRU model says its
    prefix still was (`held`; the model's agreement in `caches`)."""
    restarted = restarted_endpoint(rows, restart_s)
    caches = Caches(capacity_tokens // BLOCK) if capacity_tokens else None
    cleared = restart_s is None
    by_id = sorted(rows, key=lambda r: (float(r["sent_s"]), int(r["id"])))
    # Per prefix key: (endpoint, ready at) of every request sent so far.
    seen: dict[int, list[tuple[str, float]]] = collections.defaultdict(list)
    # Per endpoint: (sent, ready at, uncached tokens) of its requests so far.
    on: dict[str, list[tuple[float, float, int]]] = collections.defaultdict(list)
    elsewhere = []
    lost = collections.Counter()
    count = collections.Counter()
    got_total = bound_total = beyond = 0
    for r in by_id:
        i = int(r["id"])
        keys = chain(hashes[i])
        sent = float(r["sent_s"])
        if caches is not None and not cleared and sent >= restart_s:
            cleared = True
            if restarted:
                caches.clear(restarted)
        ok = r["outcome"] == "ok"
        got = int(r["cached_tokens"] or 0) if ok else 0
        want = bound[i] if i < len(bound) else 0
        if ok:
            got_total += got
            bound_total += want
            beyond += max(0, got - want)
        short = want - got
        if ok and short > 0:
            need = got // BLOCK  # a holder shares more than `need` blocks
            holders = seen.get(keys[need], []) if need < len(keys) else []
            ready = [(e, t) for e, t in holders if t <= sent]
            if not holders:
                cause = "no earlier holder"
            elif not ready:
                cause = "in prefill"
            elif r["endpoint"] not in {e for e, _ in ready}:
                cause = "sent elsewhere"
                # The latest ready holder: the one most likely to hold it still.
                latest = max(ready, key=lambda x: x[1])[0]
                e = {"short": short, "chosen": backlog(on[r["endpoint"]], sent), "holder": backlog(on[latest], sent)}
                if caches is not None:
                    e["held"] = where_held(caches, keys[need], latest, ready, r["endpoint"])
                elsewhere.append(e)
            elif (restarted and r["endpoint"] == restarted and restart_s is not None
                  and all(t < restart_s for e, t in ready if e == restarted)):
                cause = "lost in the restart"
            else:
                cause = "evicted"
            lost[cause] += short
            count[cause] += 1
        ready_at = sent + float(r["ttft_ms"]) / 1e3 if ok and r["ttft_ms"] else math.inf
        for k in keys:
            seen[k].append((r["endpoint"], ready_at))
        if ok:
            on[r["endpoint"]].append((sent, ready_at, int(r.get("prompt_tokens") or 0) - got))
            if caches is not None:
                caches.admit(r["endpoint"], keys, got)
    return {"lost": lost, "count": count, "got": got_total, "bound": bound_total, "beyond": beyond,
            "restarted": restarted, "elsewhere": elsewhere, "caches": caches}


def elsewhere_why(c: dict) -> str:
    """Whether the requests sent away from their prefix's holder were sent
    away for a longer queue there, in prompt tokens of prefill: the wait
    behind the holder's prefills in progress against the tokens its cache
    would have saved."""
    e = c["elsewhere"]
    if not e:
        return ""
    longer = [x for x in e if busier_holder(x)]
    mean = lambda k, xs: sum(x[k] for x in xs) / len(xs)  # noqa: E731
    out = (f"of the {len(e)} requests sent elsewhere, {len(longer)} found the latest holder's engine with more prefill "
           f"in progress, beyond the engine they went to, than its cache would have saved them")
    if longer:
        out += (f" (on average {mean('holder', longer) / 1e3:.0f}k tokens in prefill there against "
                f"{mean('chosen', longer) / 1e3:.0f}k, to save {mean('short', longer) / 1e3:.1f}k)")
        if c["bound"] and c.get("caches") is None:
            # The hit rate as a share of the bound had every other request
            # sent elsewhere stayed and hit: what load cost at most (with the
            # LRU model, `held_why` counts only those still held).
            rest = sum(x["short"] for x in e if not busier_holder(x))
            share = (c["got"] + rest) / c["bound"]
            out += (f"; had only the other {len(e) - len(longer)} stayed with the holder and hit, the hits would be "
                    f"{100 * share:.1f}% of the bound")
    held = held_why(c)
    return out + (f"; {held}" if held else "")


def busier_holder(x: dict) -> bool:
    """Whether a request sent elsewhere found the latest holder's engine
    with more prefill in progress, beyond the one it went to, than the
    holder's cache would have saved it."""
    return x["holder"] - x["chosen"] > x["short"]


def held_why(c: dict) -> str:
    """Where the LRU model says the prefixes of the requests sent elsewhere
    still were: evicted from every engine (no router could hit them), or
    still on a holder's engine; and the hits had every request whose
    prefix a holder still held, and whose holder was not the busier by
    more than it saved, stayed and hit."""
    caches = c.get("caches")
    e = c["elsewhere"]
    if caches is None or not caches.total or not e:
        return ""
    n, tok = collections.Counter(), collections.Counter()
    for x in e:
        n[x["held"]] += 1
        tok[x["held"]] += x["short"]
    out = (f"replaying each engine's cache as an LRU of trace blocks (within one block of the engines' own hits on "
           f"{100 * caches.agree / caches.total:.1f}% of requests), {n['none']} of the {len(e)} had lost the prefix "
           f"on every engine ({tok['none'] / 1e3:.0f}k tokens no router could hit), {n['holder']} were still on the "
           f"latest holder's engine and {n['other holder']} on another holder's")
    free = [x for x in e if x["held"] != "none" and not busier_holder(x)]
    if c["bound"]:
        share = (c["got"] + sum(x["short"] for x in free)) / c["bound"]
        out += (f"; had the {len(free)} of those held with no busier holder stayed and hit, the hits would be "
                f"{100 * share:.1f}% of the bound")
    return out


def engine_capacity(bound: dict, summary: dict, rows: list[dict]) -> int | None:
    """One engine's cache in tokens: the bound's pooled capacity over the
    engines (the deployment record's count, else the endpoints the records
    name)."""
    engines = summary.get("deployment", {}).get("engines") or len({r["endpoint"] for r in rows if r["endpoint"]})
    total = bound.get("capacity_tokens")
    return total // engines if total and engines else None


class NoWindow(ValueError):
    """A results folder whose trace window cannot be read."""


def folder(d: Path, s: dict) -> tuple[dict, list[list[int]]]:
    """Results folder `d`'s bound.json and its trace window's block hashes
    (`s`: its summary.json). Runs record their window (`deployment`);
    older ones do not and are read as the whole trace, which the bound's
    request count checks (NoWindow when it disagrees)."""
    b = json.loads((d / "bound.json").read_text())
    w = s.get("deployment", {}).get("workloads", {}).get("trace", {})
    hashes = window_hashes(TRACE, w.get("from_s", 0.0), w.get("window_s"))
    if len(hashes) != len(b["per_request_cached"]):
        raise NoWindow(f"{d}: bound.json prices {len(b['per_request_cached'])} requests but the trace window read "
                       f"has {len(hashes)}: this run's summary.json records no trace window (`deployment`) to read")
    return b, hashes


def run_causes(d: Path, s: dict, b: dict, hashes: list[list[int]], run: dict) -> dict:
    """`causes` for one trace run of folder `d` (`run`: its entry in
    summary.json's runs), with the engines' cache size for the LRU model."""
    rows = list(csv.DictReader((d / f"trace-{run['load']:.2f}-{run['mode']}.csv").open()))
    return causes(rows, hashes, b["per_request_cached"], run.get("notes", {}).get("restart at s"),
                  engine_capacity(b, s, rows))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    d = Path(argv[0])
    s = json.loads((d / "summary.json").read_text())
    try:
        b, hashes = folder(d, s)
    except NoWindow as e:
        print(e, file=sys.stderr)
        return 2
    want = set(argv[1:])
    notes = []
    print("| load | mode | hit (tokens) | bound | " + " | ".join(CAUSES) + " | beyond the bound |")
    print("| ---: | --- | ---: | ---: |" + " ---: |" * (len(CAUSES) + 1))
    for run in sorted(s["runs"], key=lambda r: (r["load"], r["mode"])):
        if run["workload"] != "trace" or (want and run["mode"] not in want):
            continue
        c = run_causes(d, s, b, hashes, run)
        gap = max(1, c["bound"] - c["got"] + c["beyond"])
        cells = [f"{c['lost'][k] / 1e3:.0f}k ({100 * c['lost'][k] / gap:.0f}%, {c['count'][k]})" for k in CAUSES]
        print(f"| {run['load']:.1f} | {run['mode']} | {c['got'] / 1e6:.2f}M | {c['bound'] / 1e6:.2f}M | "
              + " | ".join(cells) + f" | {c['beyond'] / 1e3:.0f}k |")
        why = elsewhere_why(c)
        if why:
            notes.append(f"{run['mode']} at {run['load']:.1f}: {why}.")
    print("\nEach cause: tokens short of the bound (share of all shortfall, requests). Answered requests only.")
    for n in notes:
        print(f"\n{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
