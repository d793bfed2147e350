"""`bench/hit_gap.py`: each request's shortfall against the pooled-cache
bound goes to the cause its records show. Records and trace hashes are
written here; no processes are started."""

from __future__ import annotations


from kvasir_harness.bench import hit_gap as gap

K = gap.BLOCK  # tokens per trace block


def row(i: int, sent: float, endpoint: str, cached: int, ttft_ms: float = 100.0, ok: bool = True) -> dict:
    return {"id": str(i), "sent_s": str(sent), "endpoint": endpoint, "cached_tokens": str(cached),
            "ttft_ms": str(ttft_ms) if ok else "", "outcome": "ok" if ok else "error"}


def test_each_shortfall_goes_to_its_cause():
    # Request 0 computes prefix [1, 2, 3] on e1 (first token at 0.1 s).
    hashes = [[1, 2, 3], [1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 3, 7], [4, 5]]
    rows = [
        row(0, 0.0, "e1", 0),
        # Sent while request 0 was still in prefill, to the same engine.
        row(1, 0.05, "e1", 0),
        # After it: sent to another engine.
        row(2, 1.0, "e2", 0),
        # After it, to e1, which no longer held it.
        row(3, 2.0, "e1", K),
        # Nothing earlier shares its blocks, yet the bound says it hit.
        row(4, 3.0, "e3", 0),
    ]
    bound = [0, 3 * K, 3 * K, 3 * K, 2 * K]
    c = gap.causes(rows, hashes, bound, restart_s=None)
    assert c["count"] == {"in prefill": 1, "sent elsewhere": 1, "evicted": 1, "no earlier holder": 1}
    assert c["lost"]["evicted"] == 2 * K
    assert c["got"] == K and c["bound"] == 11 * K and c["beyond"] == 0


def test_a_prefix_the_restarted_engine_held_before_the_restart_is_lost_in_it():
    hashes = [[1, 2], [6], [1, 2, 3]]
    rows = [
        row(0, 0.0, "e1", 0),
        # Cut off by the kill at 5 s: names the restarted engine.
        row(1, 4.0, "e1", 0, ok=False),
        row(2, 10.0, "e1", 0),
    ]
    c = gap.causes(rows, hashes, [0, 0, 2 * K], restart_s=5.0)
    assert c["restarted"] == "e1"
    assert c["count"] == {"lost in the restart": 1}


def test_hits_beyond_the_bound_are_counted_not_subtracted():
    hashes = [[1, 2], [1, 2, 3]]
    rows = [row(0, 0.0, "e1", 0), row(1, 1.0, "e1", 2 * K)]
    c = gap.causes(rows, hashes, [0, K], restart_s=None)
    assert c["beyond"] == K and not c["count"]


def test_a_request_sent_away_from_a_busy_holder_is_told_apart_from_one_sent_away_from_an_idle_one():
    # Request 0 holds [1, 2] on e1 from 0.1 s. Request 1, a 100k-token
    # prompt, is in prefill on e1 from 1.0 s to 9 s. Request 2 (sent at 2 s)
    # goes to e2: e1 had 100k tokens in prefill, more than the 1k its cache
    # saves. Request 3 (sent at 10 s, e1 idle again) goes to e3 too.
    hashes = [[1, 2], [7], [1, 2, 3], [1, 2, 4]]
    rows = [row(0, 0.0, "e1", 0), row(1, 1.0, "e1", 0, ttft_ms=8000.0), row(2, 2.0, "e2", 0),
            row(3, 10.0, "e3", 0)]
    for r, prompt in zip(rows, [2 * K, 100_000, 3 * K, 3 * K]):
        r["prompt_tokens"] = str(prompt)
    c = gap.causes(rows, hashes, [0, 0, 2 * K, 2 * K], restart_s=None)
    assert c["count"] == {"sent elsewhere": 2}
    assert c["elsewhere"] == [{"short": 2 * K, "chosen": 0, "holder": 100_000},
                              {"short": 2 * K, "chosen": 0, "holder": 0}]
    why = gap.elsewhere_why(c)
    assert why.startswith("of the 2 requests sent elsewhere, 1 found the latest holder's engine with more "
                          "prefill in progress"), why
    # Had request 3 stayed: 1k more of the 2k the bound hits (got 0).
    assert why.endswith("had only the other 1 stayed with the holder and hit, the hits would be 50.0% of the "
                        "bound"), why


def test_the_lru_model_tells_an_evicted_prefix_from_one_its_holder_still_held():
    # Engines hold 3 trace blocks. Request 0 puts [1, 2] on e1; request 1's
    # three new blocks push them out. Request 2 wants [1, 2] and goes to e2:
    # no engine held it any more. Request 3 puts [8, 9] on e3; request 4
    # wants it and goes to e4 while e3, idle, still held it.
    hashes = [[1, 2], [5, 6, 7], [1, 2, 3], [8, 9], [8, 9, 10]]
    rows = [row(0, 0.0, "e1", 0), row(1, 1.0, "e1", 0), row(2, 2.0, "e2", 0), row(3, 3.0, "e3", 0),
            row(4, 4.0, "e4", 0)]
    for r in rows:
        r["prompt_tokens"] = str(3 * K)
    c = gap.causes(rows, hashes, [0, 0, 2 * K, 0, 2 * K], restart_s=None, capacity_tokens=3 * K)
    assert [x["held"] for x in c["elsewhere"]] == ["none", "holder"]
    # Every request's modelled hit (none) matches what its engine said.
    assert (c["caches"].agree, c["caches"].total) == (5, 5)
    why = gap.held_why(c)
    assert "1 of the 2 had lost the prefix on every engine (1k tokens no router could hit), 1 were still on the " \
           "latest holder's engine" in why, why
    # Had request 4 stayed: 2k of the bound's 4k.
    assert why.endswith("had the 1 of those held with no busier holder stayed and hit, the hits would be 50.0% of "
                        "the bound"), why


def test_the_lru_model_empties_the_restarted_engine():
    hashes = [[1, 2], [6], [1, 2, 3]]
    rows = [row(0, 0.0, "e1", 0), row(1, 4.0, "e1", 0, ok=False), row(2, 10.0, "e2", 0)]
    c = gap.causes(rows, hashes, [0, 0, 2 * K], restart_s=5.0, capacity_tokens=100 * K)
    assert [x["held"] for x in c["elsewhere"]] == ["none"]


def test_a_run_without_its_trace_window_is_refused_not_misread(tmp_path, capsys):
    # No `deployment` record: read as the whole trace (3,993 requests),
    # which a bound over 2 requests contradicts.
    (tmp_path / "summary.json").write_text('{"runs": []}')
    (tmp_path / "bound.json").write_text('{"per_request_cached": [0, 0], "capacity_tokens": 100}')
    assert gap.main([str(tmp_path)]) == 2
    assert "records no trace window" in capsys.readouterr().err
