"""The simulator's KV-event faults a subscriber must survive, seen on the
wire: `duplicate_next_event_batches` sends each of the next N batches twice
(same sequence number, same bytes), `reorder_next_event_batches` sends each
of the next N batches after the batch that follows it (n+1 before n), and
no batch is lost either way."""

from __future__ import annotations

import random

from conftest import FAST


def token_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def _batches_after(sim, sub, mark: int, prompts: int, seed: int) -> list:
    """Sends `prompts` requests (one step's events each, at least), then the
    live batches received past `mark`."""
    for i in range(prompts):
        sim.complete(token_prompt(seed + i, 40), max_tokens=1)
    sub.wait(lambda s: len(s) >= mark + prompts, what=f"{prompts} batches")
    return sub.quiet(0.3)[mark:]


def test_duplicated_batches_repeat_seq_and_bytes(sim_factory):
    sim = sim_factory(*FAST)
    sub = sim_factory.subscribe(sim)
    sim.complete(token_prompt(1, 40), max_tokens=1)
    sub.wait_count(1)
    mark = len(sub.quiet(0.2))
    r = sim.post("/sim/faults", {"duplicate_next_event_batches": 2})
    assert r.status == 200, r
    got = _batches_after(sim, sub, mark, 4, 100)
    seqs = [b.seq for b in got]
    first = seqs[0]
    # The first two batches twice each, then the others once: nothing lost.
    assert seqs[:4] == [first, first, first + 1, first + 1], seqs
    assert sorted(set(seqs)) == list(range(first, max(seqs) + 1)), seqs
    assert got[0].payload == got[1].payload and got[2].payload == got[3].payload
    assert sim.get("/sim/faults").json()["duplicate_next_event_batches"] == 0


def test_reordered_batches_come_after_the_next_one(sim_factory):
    sim = sim_factory(*FAST)
    sub = sim_factory.subscribe(sim)
    sim.complete(token_prompt(2, 40), max_tokens=1)
    sub.wait_count(1)
    mark = len(sub.quiet(0.2))
    r = sim.post("/sim/faults", {"reorder_next_event_batches": 2})
    assert r.status == 200, r
    got = _batches_after(sim, sub, mark, 5, 200)
    seqs = [b.seq for b in got]
    n = min(seqs)
    # Held n goes out after n+1; the next held one (n+2) after n+3.
    assert seqs[:4] == [n + 1, n, n + 3, n + 2], seqs
    assert sorted(seqs) == list(range(n, n + len(seqs))), "every batch arrives exactly once"
    assert sim.get("/sim/faults").json()["reorder_next_event_batches"] == 0
