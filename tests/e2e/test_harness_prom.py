"""The harness's one Prometheus text parser (kvasir_harness.prom), on its
own: escapes, families, histograms, lookups, and refusal of broken lines
(every e2e test that reads a /metrics page relies on it)."""

from __future__ import annotations

import math

import pytest

from kvasir_harness import prom

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3
# TYPE envoy_cluster_upstream_rq counter
envoy_cluster_upstream_rq{envoy_cluster_name="a",envoy_response_code="200"} 97
envoy_cluster_upstream_rq{envoy_cluster_name="b",envoy_response_code="200"} 3
envoy_cluster_upstream_rq{envoy_cluster_name="a",envoy_response_code="503"} 2
# TYPE lat histogram
lat_bucket{le="0.1"} 1
lat_bucket{le="+Inf"} 4
lat_sum 2.5
lat_count 4
odd{v="quote \\" backslash \\\\ newline \\n end"} NaN
"""


def test_families_keep_names_types_and_their_samples():
    fams = {f.name: f for f in prom.parse(PAGE)}
    assert fams["vllm:num_requests_running"].type == "gauge"
    assert fams["vllm:num_requests_running"].documentation.startswith("Number of requests")
    # Envoy's counters do not end in _total; the name stays as written.
    assert fams["envoy_cluster_upstream_rq"].type == "counter"
    assert len(fams["envoy_cluster_upstream_rq"].samples) == 3
    assert [s.name for s in fams["lat"].samples] == ["lat_bucket", "lat_bucket", "lat_sum", "lat_count"]


def test_lookups():
    assert prom.value(PAGE, "vllm:num_requests_running", model_name="m") == 3
    assert prom.value(PAGE, "missing") == 0.0
    assert prom.total(PAGE, "envoy_cluster_upstream_rq") == 102
    assert prom.total(PAGE, "envoy_cluster_upstream_rq", envoy_cluster_name="a") == 99
    assert prom.by_label(PAGE, "envoy_cluster_upstream_rq", "envoy_response_code") == {"200": 100, "503": 2}
    assert prom.value(PAGE, "lat_bucket", le="+Inf") == 4


def test_escapes_and_special_values():
    odd = [s for s in prom.samples(PAGE) if s.name == "odd"][0]
    assert odd.labels["v"] == 'quote " backslash \\ newline \n end'
    assert math.isnan(odd.value)


@pytest.mark.parametrize("line", [
    "{a=\"b\"} 1",              # no name
    "x{a=b} 1",                 # unquoted label value
    "x{a=\"b\" 1",              # labels not closed
    "x",                        # no value
    "x one",                    # not a number
    "x 1 2 3",                  # too many fields
])
def test_broken_lines_are_refused_with_their_line_number(line):
    with pytest.raises(ValueError, match="line 2"):
        prom.parse("# TYPE x gauge\n" + line + "\n")
