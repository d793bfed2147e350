"""The one Prometheus text-format parser of the tests, the benchmarks and
the demo: prometheus_client's (the reference implementation, strict about
the format, so malformed /metrics output fails where it is read), plus the
lookups they need: a sum over matching samples, a sum per label value, and
the sample with exactly these labels."""

from __future__ import annotations

from typing import Any


def families(text: str) -> list[Any]:
    """The metric families of a /metrics body (prometheus_client's
    `Metric`s: name, type, documentation, samples)."""
    # Imported here, not at the top: the package's stdlib-only parts (the
    # bootstrap renderer behind envoy/render.py) must load in a bare python3.
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def samples(text: str) -> list[Any]:
    """Every sample, in order: (name, labels, value, ...) tuples; a
    histogram's `_bucket`, `_sum` and `_count` are samples of their own."""
    return [s for f in families(text) for s in f.samples]


def _has(got: dict[str, str], labels: dict[str, str]) -> bool:
    return all(got.get(k) == v for k, v in labels.items())


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` that carry (at least) `labels`;
    0.0 when there are none."""
    return sum(s.value for s in samples(text) if s.name == name and _has(s.labels, labels))


def by_label(text: str, name: str, label: str, **labels: str) -> dict[str, float]:
    """The samples named `name` (carrying `labels`) summed per value of
    `label`; samples without `label` are left out."""
    out: dict[str, float] = {}
    for s in samples(text):
        if s.name == name and label in s.labels and _has(s.labels, labels):
            out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """The value of the first sample named `name` whose labels are exactly
    `labels` (a histogram bucket's `le` is compared only when given);
    0.0 when there is none."""
    want = set(labels) - {"le"}
    for s in samples(text):
        if s.name == name and s.labels and _has(s.labels, labels) and set(s.labels) - {"le"} == want:
            return s.value
    return 0.0
