"""The one Prometheus text-format parser of the tests, the benchmarks and
the demo (vllm-sim's, the cache-indexer's and Envoy's /metrics), with the
lookups they need: a sum over matching samples, a sum per label value, and
the sample with exactly these labels.

Standard library only, and it reports sample names as written: the
reference parser (prometheus_client) renames a counter's samples to
`<name>_total`, and Envoy's counters do not end in `_total`. A line it
cannot read is an error (ValueError), not skipped, so malformed output
fails where it is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Family:
    """A `# TYPE`d (or, without one, a single sample name's) metric family."""

    name: str
    type: str = "untyped"
    documentation: str = ""
    samples: list[Sample] = field(default_factory=list)


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*\"((?:[^\"\\]|\\.)*)\"\s*")
_UNESCAPE = re.compile(r"\\(.)")
# The samples a family of each name owns besides its own name.
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_info")


def _sample(line: str, lineno: int) -> Sample:
    def bad(why: str) -> ValueError:
        return ValueError(f"line {lineno}: {why}: {line!r}")

    m = _NAME.match(line)
    if not m:
        raise bad("no metric name")
    name, i = m.group(), m.end()
    labels: dict[str, str] = {}
    if i < len(line) and line[i] == "{":
        i += 1
        while True:
            while i < len(line) and line[i] in " \t":
                i += 1
            if i < len(line) and line[i] == "}":
                i += 1
                break
            lm = _LABEL.match(line, i)
            if not lm:
                raise bad("bad label")
            labels[lm.group(1)] = _UNESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), lm.group(2))
            i = lm.end()
            if i < len(line) and line[i] == ",":
                i += 1
            elif i >= len(line) or line[i] != "}":
                raise bad("labels not closed")
    rest = line[i:].split()
    if not rest or len(rest) > 2 or (i < len(line) and line[i] not in " \t"):
        raise bad("no value")
    try:
        return Sample(name, labels, float(rest[0]))  # NaN, +Inf and -Inf included
    except ValueError:
        raise bad("bad value") from None


def parse(text: str) -> list[Family]:
    """The families of a /metrics body, in order."""
    fams: list[Family] = []
    by_name: dict[str, Family] = {}

    def family(name: str) -> Family:
        if name not in by_name:
            by_name[name] = Family(name)
            fams.append(by_name[name])
        return by_name[name]

    current: Family | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line[1:].split(None, 2)
            if len(parts) >= 2 and parts[0] in ("HELP", "TYPE"):
                current = family(parts[1])
                if parts[0] == "TYPE":
                    current.type = parts[2].strip() if len(parts) > 2 else "untyped"
                else:
                    current.documentation = parts[2] if len(parts) > 2 else ""
            continue
        s = _sample(line, n)
        owner = current
        if owner is None or not (s.name == owner.name or (s.name.startswith(owner.name)
                                                          and s.name[len(owner.name):] in _SUFFIXES)):
            owner = family(s.name)
        owner.samples.append(s)
    return fams


def samples(text: str) -> list[Sample]:
    """Every sample, in order; a histogram's `_bucket`, `_sum` and `_count`
    are samples of their own."""
    return [s for f in parse(text) for s in f.samples]


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
