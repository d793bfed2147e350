"""deploy/: the Grafana dashboard, the Prometheus scrape configuration and
the alerting rules, run for real.

A real Prometheus (Debian's 2.42) scrapes the local stack every second
through a rendered copy of deploy/prometheus/prometheus.yml (the same
jobs, paths and parameters, static targets in place of Kubernetes
discovery, which Debian's build leaves out) and evaluates
deploy/prometheus/kvasir-rules.yml: two vllm-sims, the cache-indexer with
its budgets in a real Redis, Envoy with the filter and envoy/policy.json
(scripts/demo.py's stack), and the controller against a real
kube-apiserver (harness/kvasir_harness/kube.py; about 9 s to start).

The workload produces every series the panels read: the demo's
multi-tenant multi-turn conversations (cached tokens, latencies), its
policies on a busy pool (a policy shed, a burst to the provider, a model
alias, a queued request, the budget's 429s), a flow-control shed (a
request kept on the pool by the PII guard while it stays busy past
maxWaitMs), a rejected prompt, an unauthorized key. Then faults, each
produced for real, not faked as zeros:

- Redis stopped: budget store errors (KvasirBudgetStoreDown);
- the indexer stopped, requests sent, started again: fail-opens per
  tenant and pool (KvasirIndexerDown, KvasirNoIndexer, KvasirFailOpenRate);
- an engine killed and restarted: its KV-event stream disconnected, then
  resynced (KvasirKVEventsOutOfSync, KvasirEndpointUnhealthy);
- an InferenceSettings naming a missing Gateway: controller errors and a
  second reconcile (KvasirControllerNeedsAttention);
- Envoy and the controller stopped (KvasirEnvoyStatsDown,
  KvasirControllerDown).

The pool is saturated while policies act, so KvasirPoolSaturated goes
pending too. Each of those alerts must show up in Prometheus's ALERTS
series. The rules whose faults cannot be produced in a minute
(KvasirFailOpenMostly, KvasirIndexerPoolNotWarm, KvasirKVEventResyncs,
KvasirCachePredictionOff, KvasirFilterStatsDropped,
KvasirControllerReconcilesFailing) are held to this instead: every
series they read exists, here with the labels they aggregate by, and
`promtool test rules` (test_the_rules_fire_on_synthetic_series) shows
each of them, and every other rule, firing with its labels and text.

Every query of every panel must return series over the run, each series
carrying the labels its legend and its `by (...)` name, at least one
point a finite number. Then deploy/render_panels.py draws the panels from
Prometheus's query_range into PNGs (into a temporary folder; `make
dashboards` sets KVASIR_PANELS_OUT=docs/images to refresh the docs' images).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import kvasir_harness as h
from kvasir_harness import prometheus as P
from kvasir_harness.examples import eg_gateway, example_docs
from kvasir_harness.kube import (EGCTL_BIN, ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, egctl_translate, missing,
                                 start_apiserver, start_etcd)

REPO = h.REPO
demo = h.load_script(REPO / "scripts" / "demo.py", "kvasir_demo")
panels_mod = h.load_script(REPO / "deploy" / "render_panels.py", "kvasir_render_panels")
dashboard_mod = h.load_script(REPO / "deploy" / "grafana" / "dashboard.py", "kvasir_dashboard")

EG_STATS = REPO / "deploy" / "envoy-gateway" / "envoyproxy-stats.yaml"
CONTROLLER = Path(os.environ.get("KVASIR_CONTROLLER_BIN", REPO / "target" / "release" / "kvasir-controller"))
NS = "serving"
GATEWAY = "inference-gateway"
RATE = "10s"  # $__rate_interval here: ten scrapes, two of Envoy's 5 s histogram flushes
ALERT_WAIT_S = 30.0

# Alerts the run produces (and what it did for each).
PRODUCED = {
    "KvasirBudgetStoreDown": "Redis stopped",
    "KvasirIndexerDown": "indexer stopped",
    "KvasirNoIndexer": "indexer stopped",
    "KvasirFailOpenRate": "indexer stopped",
    "KvasirKVEventsOutOfSync": "engine killed",
    "KvasirEndpointUnhealthy": "engine killed",
    "KvasirControllerNeedsAttention": "missing target",
    "KvasirEnvoyStatsDown": "Envoy stopped",
    "KvasirControllerDown": "controller stopped",
    "KvasirPoolSaturated": "pool saturated",
}


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(P.RULES.read_text())["groups"] for r in g["rules"]]


def targets() -> list[tuple[str, dict]]:
    """(panel title, target) for every panel's every query."""
    d = json.loads(P.DASHBOARD.read_text())
    return [(p["title"], t) for p in d["panels"] if p["type"] != "row" for t in p["targets"]]


def by_labels(expr: str) -> set[str]:
    """Labels an expression aggregates by (`le` is consumed by
    histogram_quantile)."""
    out: set[str] = set()
    for m in re.finditer(r"\bby\s*\(([^)]*)\)", expr):
        out |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    return out - {"le"}


def legend_labels(fmt: str) -> set[str]:
    return set(re.findall(r"\{\{\s*\$?(?:labels\.)?(\w+)\s*\}\}", fmt))


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
             "inf", "nan"}


def selectors(expr: str) -> list[str]:
    """The series selectors an expression reads, `name{matchers}` as
    written (functions, keywords, label lists and ranges left out)."""
    def blank(pattern: str, text: str, keep_ends: bool = False) -> str:
        def sub(m: re.Match) -> str:
            g = m.group()
            return g[0] + " " * (len(g) - 2) + g[-1] if keep_ends else " " * len(g)
        return re.sub(pattern, sub, text)

    # Blanked to the same length, so positions still index `expr`.
    b = blank(r'"(?:[^"\\]|\\.)*"', expr, keep_ends=True)
    b = blank(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", b)
    b = blank(r"\[[^\]]*\]", b)
    b = blank(r"\{[^}]*\}", b, keep_ends=True)
    out = []
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", b):
        rest = b[m.end():]
        if m.group() in _KEYWORDS or rest.lstrip().startswith("("):
            continue
        sel = m.group()
        if rest.startswith("{"):
            sel += expr[m.end():b.index("}", m.end()) + 1]
        out.append(sel)
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------
# Offline checks: the files themselves
# ---------------------------------------------------------------------------


def need_prometheus() -> None:
    if not P.prometheus_available():
        pytest.fail("prometheus/promtool missing: run `make setup` (Debian's prometheus package)")


def test_the_dashboard_json_is_the_generators_output():
    assert P.DASHBOARD.read_text() == dashboard_mod.render(), "run python3 deploy/grafana/dashboard.py"
    d = json.loads(P.DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in d["templating"]["list"]}
    assert names == {"datasource", "tenant", "pool"}
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["fieldConfig"]["defaults"]["unit"], p["title"]
        for t in p["targets"]:
            assert t["expr"] and t["legendFormat"] and t["datasource"]["uid"] == "${datasource}", p["title"]
            # Every legend label is one the query keeps.
            assert legend_labels(t["legendFormat"]) <= by_labels(t["expr"]), (p["title"], t["legendFormat"])


def test_promtool_checks_the_rules_and_the_scrape_config(tmp_path):
    need_prometheus()
    r = P.promtool("check", "rules", str(P.RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout, r.stdout
    # Debian's Prometheus is built without Kubernetes discovery: promtool
    # checks the rendered copy (every job, path, parameter and rule file as
    # shipped, static targets), and the discovery part is checked here.
    shipped = yaml.safe_load(P.SCRAPE_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in shipped["scrape_configs"]}
    assert set(jobs) == {"kvasir-envoy", "kvasir-indexer", "kvasir-controller"}
    assert jobs["kvasir-envoy"]["metrics_path"] == "/stats/prometheus"
    for name, job in jobs.items():
        assert job["kubernetes_sd_configs"] == [{"role": "pod"}], name
        keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
        assert keep and all(r["source_labels"][0].startswith("__meta_kubernetes_pod_") for r in keep), name
    rules_copy = tmp_path / "kvasir-rules.yml"
    shutil.copy(P.RULES, rules_copy)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(P.render_config({j: ["127.0.0.1:1"] for j in jobs}, rule_files=[rules_copy]))
    r = P.promtool("check", "config", str(cfg))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout and "16 rules found" in r.stdout, r.stdout


def test_envoy_gateways_bootstrap_gets_the_stat_labels():
    """deploy/envoy-gateway/envoyproxy-stats.yaml carries envoy/envoy.yaml's
    stats_config (the one the live run below scrapes), and Envoy Gateway's
    own translation (egctl, v1.9.1) merges every tag and bucket setting of
    it into the bootstrap of a Gateway that references the EnvoyProxy."""
    proxy = yaml.safe_load(EG_STATS.read_text())
    merged = yaml.safe_load(proxy["spec"]["bootstrap"]["value"])
    shipped = yaml.safe_load((REPO / "envoy" / "envoy.yaml").read_text())["stats_config"]
    assert proxy["spec"]["bootstrap"]["type"] == "Merge" and merged == {"stats_config": shipped}
    if m := missing(EGCTL_BIN):
        pytest.fail(f"missing {m[0]}: run `make setup` (scripts/go-tools.sh)")
    ns, name = proxy["metadata"]["namespace"], proxy["metadata"]["name"]
    docs = [yaml.safe_dump(d) for d in (
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass", "metadata": {"name": "eg"},
         "spec": {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller"}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway", "metadata": {"name": GATEWAY, "namespace": ns},
         "spec": {"gatewayClassName": "eg", "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}],
                  "infrastructure": {"parametersRef": {"group": "gateway.envoyproxy.io", "kind": "EnvoyProxy",
                                                       "name": name}}}},
        proxy)]
    out = egctl_translate(docs, resource_type="bootstrap", add_missing=False)
    boot = out["xds"][f"{ns}/{GATEWAY}"]["bootstrap"]
    tags = {t["tagName"]: t["regex"] for t in boot["statsConfig"]["statsTags"]}
    for t in shipped["stats_tags"]:
        assert tags.get(t["tag_name"]) == t["regex"], (t, tags)
    buckets = [(b["match"], b["buckets"]) for b in boot["statsConfig"]["histogramBucketSettings"]]
    assert buckets == [(b["match"], b["buckets"]) for b in shipped["histogram_bucket_settings"]], buckets
    assert "/stats/prometheus" in json.dumps(boot["staticResources"]) and "19001" in json.dumps(boot)


# `promtool test rules`: each rule fires on synthetic series, with its
# labels and its summary rendered (descriptions are taken from the file).
# (alert, input series, eval time, expected labels beyond alertname and severity, expected summary)
RULE_CASES: list[tuple[str, list[tuple[str, str]], str, list[dict[str, str]], list[str]]] = [
    ("KvasirIndexerDown", [('up{job="kvasir-indexer",instance="i:9090"}', "1 0x10")], "5m",
     [{"job": "kvasir-indexer", "instance": "i:9090"}], ["cache-indexer i:9090 is not answering scrapes"]),
    ("KvasirNoIndexer", [('up{job="kvasir-indexer",instance="i:9090"}', "1 0x10")], "5m",
     [{}], ["no cache-indexer replica is up"]),
    ("KvasirIndexerPoolNotWarm", [('kvasir_indexer_pool_warm{job="kvasir-indexer",instance="i:9090",pool="main"}',
                                   "0x10")], "6m",
     [{"job": "kvasir-indexer", "instance": "i:9090", "pool": "main"}], ["pool main is not warm on i:9090"]),
    ("KvasirEnvoyStatsDown", [('up{job="kvasir-envoy",instance="e:19001"}', "1 0x10")], "5m",
     [{"job": "kvasir-envoy", "instance": "e:19001"}], ["Envoy e:19001 does not answer /stats/prometheus"]),
    ("KvasirControllerDown", [('up{job="kvasir-controller",instance="c:9090"}', "1 0x10")], "7m",
     [{"job": "kvasir-controller", "instance": "c:9090"}], ["kvasir-controller c:9090 is not answering scrapes"]),
    # 10 fail-opens of 100 picks a minute: 10%.
    ("KvasirFailOpenRate", [('kvasir_pool_failopen{instance="e1",pool="main"}', "0+10x30"),
                            ('kvasir_pool_pick{instance="e1",pool="main",result="ok"}', "0+90x30"),
                            ('kvasir_pool_pick{instance="e1",pool="main",result="unavailable"}', "0+10x30")], "20m",
     [{"pool": "main"}], ["10% of pool main's picks fail open"]),
    ("KvasirFailOpenMostly", [('kvasir_pool_failopen{instance="e1",pool="main"}', "0+80x10"),
                              ('kvasir_pool_pick{instance="e1",pool="main",result="ok"}', "0+20x10"),
                              ('kvasir_pool_pick{instance="e1",pool="main",result="unavailable"}', "0+80x10")], "6m",
     [{"pool": "main"}], ["most of pool main's picks fail open (80%)"]),
    ("KvasirEndpointUnhealthy", [('kvasir_indexer_endpoint_healthy{instance="i1",pool="main",endpoint="10.0.0.1:8000"}',
                                  "0x10"),
                                 ('kvasir_indexer_endpoint_healthy{instance="i2",pool="main",endpoint="10.0.0.1:8000"}',
                                  "0x10")], "6m",
     [{"pool": "main", "endpoint": "10.0.0.1:8000"}], ["engine 10.0.0.1:8000 of pool main is out of picks"]),
    ("KvasirPoolSaturated", [('kvasir_indexer_pool_saturation{instance="i1",pool="main"}', "0.95x20")], "16m",
     [{"pool": "main"}], ["pool main has been saturated for 15 minutes"]),
    ("KvasirKVEventsOutOfSync", [
        ('kvasir_indexer_sync_state{instance="i1",pool="main",endpoint="10.0.0.1:8000",state="in_sync"}', "0x10"),
        ('kvasir_indexer_sync_state{instance="i1",pool="main",endpoint="10.0.0.1:8000",state="disconnected"}', "1x10"),
        ('kvasir_indexer_sync_state{instance="i1",pool="main",endpoint="10.0.0.2:8000",state="in_sync"}', "1x10"),
        ('kvasir_indexer_sync_state{instance="i1",pool="main",endpoint="10.0.0.2:8000",state="disconnected"}', "0x10")],
     "6m", [{"pool": "main", "endpoint": "10.0.0.1:8000"}],
     ["KV events of 10.0.0.1:8000 (pool main) are not in sync"]),
    ("KvasirKVEventResyncs", [('kvasir_indexer_resyncs_total{instance="i1",pool="main",endpoint="10.0.0.1:8000"}',
                               "0 1 2 3 4 5 6 7 8 9 10")], "10m",
     [{"pool": "main", "endpoint": "10.0.0.1:8000"}], ["10.0.0.1:8000's index was rebuilt 10 times in 15 minutes"]),
    ("KvasirCachePredictionOff", [('kvasir_indexer_cached_tokens_total{instance="i1",pool="main",kind="predicted"}',
                                   "0+1000x60"),
                                  ('kvasir_indexer_cached_tokens_total{instance="i1",pool="main",kind="reported"}',
                                   "0+300x60")], "50m",
     [{"pool": "main"}], ["engines of pool main find 30% of the cached tokens the index predicted"]),
    ("KvasirBudgetStoreDown", [('kvasir_indexer_budget_store_errors_total{job="kvasir-indexer",instance="i:9090",'
                                'op="reserve",error="timeout"}', "0+5x10")], "5m",
     [{"job": "kvasir-indexer", "instance": "i:9090"}], ["cache-indexer i:9090 cannot reach the budgets' Redis"]),
    ("KvasirFilterStatsDropped", [('kvasir_stats_dropped{job="kvasir-envoy",instance="e:19001"}', "0 0 3 3")], "3m",
     [{"job": "kvasir-envoy", "instance": "e:19001"}], ["Envoy e:19001 dropped filter stats (maxStats reached)"]),
    ("KvasirControllerNeedsAttention", [
        ('kvasir_controller_errors_total{job="kvasir-controller",instance="c:9090",kind="target"}', "0 0 1 1"),
        ('kvasir_controller_errors_total{job="kvasir-controller",instance="c:9090",kind="api"}', "0 0 5 5")], "3m",
     [{"job": "kvasir-controller", "instance": "c:9090", "kind": "target"}],
     ["kvasir-controller reports target errors"]),
    ("KvasirControllerReconcilesFailing", [
        ('kvasir_controller_reconciles_total{job="kvasir-controller",instance="c:9090",result="error"}', "0+1x40"),
        ('kvasir_controller_reconciles_total{job="kvasir-controller",instance="c:9090",result="ok"}', "3x40")], "30m",
     [{"job": "kvasir-controller", "instance": "c:9090"}],
     ["kvasir-controller c:9090 has not reconciled successfully for 15 minutes"]),
]


def test_the_rules_fire_on_synthetic_series(tmp_path):
    need_prometheus()
    by_name = {r["alert"]: r for r in rules()}
    assert set(by_name) == {c[0] for c in RULE_CASES}, "every rule has a case, every case a rule"
    tests = []
    for alert, series, at, labels, summaries in RULE_CASES:
        rule = by_name[alert]
        exp = [{"exp_labels": {**extra, "severity": rule["labels"]["severity"]},
                "exp_annotations": {"summary": s, "description": rule["annotations"]["description"]}}
               for extra, s in zip(labels, summaries)]
        tests.append({"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                      "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": exp}]})
        # And not before its `for` has passed (from the start of the series).
        if rule.get("for", "0m") not in ("0m", "0s"):
            tests.append({"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                          "alert_rule_test": [{"eval_time": "0m", "alertname": alert, "exp_alerts": []}]})
    shutil.copy(P.RULES, tmp_path / "kvasir-rules.yml")
    f = tmp_path / "kvasir-rules.test.yml"
    f.write_text(yaml.safe_dump({"rule_files": ["kvasir-rules.yml"], "evaluation_interval": "1m", "tests": tests},
                                sort_keys=False))
    r = P.promtool("test", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------
# The live run
# ---------------------------------------------------------------------------


@dataclass
class Run:
    prom: P.Prometheus
    start: float
    end: float = 0.0
    marks: list[tuple[float, str]] = field(default_factory=list)
    notes: dict[str, object] = field(default_factory=dict)

    def mark(self, label: str) -> None:
        self.marks.append((time.time(), label))


@dataclass
class ControlPlane:
    api: object
    controller: h.Proc
    metrics_port: int


def start_control_plane(logdir: Path, procs: h.Processes) -> ControlPlane:
    """etcd, kube-apiserver, the CRDs, crds/examples/ and their Gateway in
    namespace `serving`, and the controller programming it (its first
    reconcile done)."""
    if m := missing(ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, CONTROLLER):
        pytest.fail(f"missing {', '.join(map(str, m))}: run `make setup` (scripts/go-tools.sh) and `make build`")
    d = logdir / "kube"
    etcd = procs.add(start_etcd(d))
    api = procs.add(start_apiserver(d, etcd))
    files = sorted((REPO / "tests" / "upstream-crds").glob("*.yaml")) + sorted((REPO / "crds").glob("*.yaml"))
    args = ["apply", "--server-side", "--field-manager", "kvasir-tests"]
    for f in files:
        args += ["-f", str(f)]
    api.kubectl(*args, timeout=90)
    names = [doc["metadata"]["name"] for f in files for doc in yaml.safe_load_all(f.read_text())
             if doc and doc.get("kind") == "CustomResourceDefinition"]
    api.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", *[f"crd/{n}" for n in names], timeout=75)
    api.kubectl("create", "namespace", NS)
    docs = example_docs(NS) + [eg_gateway(GATEWAY, NS)]
    api.kubectl("apply", "--server-side", "--field-manager", "kvasir-tests", "-f", "-", input=yaml.safe_dump_all(docs))
    http, metrics = h.free_port(), h.free_port()
    argv = [str(CONTROLLER), "--http-addr", f"127.0.0.1:{http}", "--metrics-addr", f"127.0.0.1:{metrics}",
            "--wasm-file", str(h.WASM), "--wasm-url", "http://kvasir-controller.kvasir.svc:8080/kvasir_filter-{sha256}.wasm",
            "--namespace", NS, "--lease-namespace", NS, "--lease-name", "kvasir-controller", "--identity", "a",
            "--indexer-deployment", ""]
    proc = procs.add(h.Proc("kvasir-controller", argv, d, env={"KUBECONFIG": str(api.kubeconfig),
                                                               "RUST_LOG": "info,kube=warn"}))

    def reconciled() -> bool:
        if not proc.alive():
            raise h.Exited(f"controller exited: {proc.log()[-3000:]}")
        text = h.request("GET", metrics, "/metrics", timeout=2)[2].decode()
        return h.prom.total(text, "kvasir_controller_reconciles_total", result="ok") >= 1

    h.wait_until("the controller's first reconcile", reconciled, timeout=60, interval=0.1)
    return ControlPlane(api, proc, metrics)


def ask(port: int, tenant_key: str, content: str, max_tokens: int = 4, model: str = h.MODEL) -> object:
    return demo.stream_chat(port, tenant_key, {"model": model, "stream": True, "max_tokens": max_tokens,
                                                "messages": [{"role": "user", "content": content}]})


def wait_alert(run: Run, name: str, timeout: float = ALERT_WAIT_S) -> dict:
    """Until `name` is pending or firing (bounded)."""
    return h.wait_until(f"alert {name} pending or firing",
                        lambda: next((a for a in run.prom.alerts() if a["labels"]["alertname"] == name), None),
                        timeout=timeout, interval=0.2)


@pytest.fixture(scope="module")
def live():
    need_prometheus()
    for p in (h.WASM, h.SIM_BIN, h.INDEXER_BIN, h.ENVOY_BIN):
        if not p.exists():
            pytest.fail(f"{p} is missing: run `make build`")
    if not h.redis_available():
        pytest.fail("redis-server missing: run `make setup`")
    logdir = Path(tempfile.mkdtemp(prefix="kvasir-dash-"))
    saved = dict(demo.FLOW), demo.demo_policy
    # A short queue bound, so that a request kept on a busy pool is shed
    # within the run (max_wait); long enough for the demo's queued request
    # to be released once the pool frees up. The filter waits for a pick
    # indexerTimeoutMs past it: 200 ms rather than the shipped 50 leaves a
    # loaded machine room to deliver the shed before the filter fails open.
    demo.FLOW["maxWaitMs"] = 2500

    def policy() -> dict:
        p = saved[1]()
        p["pools"][0]["indexerTimeoutMs"] = 200
        return p

    demo.demo_policy = policy
    try:
        with h.Processes() as procs:
            cp = start_control_plane(logdir, procs)
            redis = procs.add(h.start_redis(logdir))
            budgets = {"store": "redis", "redisUrl": redis.url, "timeoutMs": 50, "retryMs": 300}
            st = demo.start_stack("kvasir", logdir, procs, budgets=budgets, engines=2)
            cfg = P.render_config({"kvasir-envoy": [f"127.0.0.1:{st.envoy.admin}"],
                                   "kvasir-indexer": [f"127.0.0.1:{st.indexer.http_port}"],
                                   "kvasir-controller": [f"127.0.0.1:{cp.metrics_port}"]},
                                  interval_s=1.0, rule_files=[P.RULES])
            prom = procs.add(P.start_prometheus(logdir, cfg))
            h.wait_until("every target scraped and up", lambda: len(prom.targets()) == 3 and all(
                t["health"] == "up" for t in prom.targets()), timeout=30, interval=0.2)
            run = Run(prom, time.time())
            drive(run, st, cp, redis, logdir, procs)
            # One more evaluation, so that the last step of a range query
            # sees the alerts the last faults raised.
            scraped_since(run, time.time(), 1)
            run.end = time.time()
            yield run
    finally:
        demo.FLOW.clear()
        demo.FLOW.update(saved[0])
        demo.demo_policy = saved[1]
        if os.environ.get("KVASIR_E2E_KEEP_LOGS") != "1":
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            print(f"logs kept in {logdir}")


def scraped_since(run: Run, t: float, scrapes: int = 2) -> None:
    """Until every target has been scraped `scrapes` more times after `t`."""
    h.wait_until(f"{scrapes} scrapes of every target", lambda: (lambda r: len(r) == 3 and all(
        float(x["value"][1]) >= t + scrapes for x in r))(run.prom.query("timestamp(up)")),
        timeout=10 + 3 * scrapes, interval=0.2)


def drive(run: Run, st, cp: ControlPlane, redis, logdir: Path, procs: h.Processes) -> None:
    """The workload, then the faults; every step bounded."""
    keys, port = demo.KEYS, st.envoy.port
    run.mark("workload")
    res = demo.run_workload(port, demo.conversations(demo.QUICK), demo.QUICK)
    assert sum(r.status == 200 for r in res) == sum(len(c.turns) for c in demo.conversations(demo.QUICK)), \
        [(r.status, r.error) for r in res if r.status != 200]
    run.mark("policies")
    rows = demo.policies_at_work(st)
    run.notes["policies"] = rows
    assert "429" in rows[1][1] and "provider" in rows[2][1] and rows[4][1] == "2 x 200, 3 x 429", rows

    # Each rare event happens twice, scrapes apart: a counter the filter
    # creates at its first event starts at 1, and rate() counts increases
    # only from a series' first sample.
    def refused() -> None:
        r = ask(port, keys["beta"], "robot " * 40000)  # over 32k tokens on the free plan
        assert r.status == 400, (r.status, r.error)
        r = ask(port, "sk-nobody", "hello")
        assert r.status == 401, (r.status, r.error)

    refused()
    # Flow-control sheds: acme's requests with personal data stay on the
    # busy pool (the PII guard) and wait past maxWaitMs; beta's are shed by
    # policy meanwhile.
    run.mark("flow sheds")
    holders = demo.saturate(st)
    try:
        demo.wait_filter_sees(st, "the pool saturated in the filter's view", busy=True)
        for i in range(2):
            r = ask(port, keys["beta"], f"[{i}] a question while busy")
            assert r.status == 429 and "shed" in r.error, (r.status, r.error)
            r = ask(port, keys["acme"], f"[{i}] My e-mail is jane.doe@example.com: summarise my warranty.")
            assert r.status == 429 and "shed" in r.error, (r.status, r.error)
    finally:
        for x in holders:
            x.release()
    demo.wait_filter_sees(st, "the pool idle again in the filter's view", busy=False)
    refused()
    # beta's budget again (2 in flight): 3 of 5 streams answered 429.
    out: list = []
    ts = [threading.Thread(target=lambda i=i: out.append(ask(port, keys["beta"], f"[{i}] enzymes, at length",
                                                             max_tokens=200))) for i in range(5)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=demo.REQUEST_DEADLINE_S)
    assert sorted(r.status for r in out) == [200, 200, 429, 429, 429], [(r.status, r.error) for r in out]
    demo.wait_stats_flushed(st.envoy)

    # Redis down: budgeted picks (beta's) are decided locally.
    run.mark("Redis stopped")
    redis.stop()
    for i in range(4):
        r = ask(port, keys["beta"], f"[{i}] folding, briefly")
        assert r.status == 200, (r.status, r.error)
    wait_alert(run, "KvasirBudgetStoreDown")

    # The indexer down: picks fail open to Envoy's balancing.
    run.mark("indexer stopped")
    st.indexer.stop()
    h.wait_until("the indexer unhealthy in Envoy", lambda: not st.envoy.healthy("kvasir_indexer", [st.indexer.address]),
                 timeout=15, interval=0.1)
    # Fail-opens over several scrapes: rate() counts a series' increases
    # from its first sample, and the fail-open counters start with the
    # first fail-open.
    sent = [0]

    def failing_open() -> bool:
        for t in ("acme", "beta"):
            r = ask(port, keys[t], f"[{sent[0]}] while the indexer is away")
            assert r.status == 200, (r.status, r.error)
        sent[0] += 1
        return any(a["labels"]["alertname"] == "KvasirFailOpenRate" for a in run.prom.alerts())

    h.wait_until("alert KvasirFailOpenRate pending or firing", failing_open, timeout=ALERT_WAIT_S, interval=0.1)
    run.notes["failopens"] = sent[0]
    for name in ("KvasirIndexerDown", "KvasirNoIndexer"):
        wait_alert(run, name)
    run.mark("indexer back")
    st.indexer.start()
    h.wait_until("the indexer healthy in Envoy", lambda: st.envoy.healthy("kvasir_indexer", [st.indexer.address]),
                 timeout=30, interval=0.1)

    # An engine killed: its event stream disconnects, it leaves the picks;
    # then back on the same address, empty (a resync).
    run.mark("engine killed")
    victim = st.sims[0]
    port0 = victim.port
    victim.proc.stop(signal.SIGKILL)
    for name in ("KvasirKVEventsOutOfSync", "KvasirEndpointUnhealthy"):
        wait_alert(run, name)
    run.mark("engine back")
    back = procs.add(h.restart_sim(victim, logdir, "kvasir-vllm-0-restarted"))
    h.wait_sim(back)
    assert back.port == port0
    st.sims[0] = back
    h.wait_until("the engine in sync again", lambda: h.prom.total(
        st.indexer.metrics_text(), "kvasir_indexer_sync_state", endpoint=back.address, state="in_sync") == 1,
        timeout=30, interval=0.1)
    for i in range(4):
        r = ask(port, keys["acme"], f"[{i}] after the restart")
        assert r.status == 200, (r.status, r.error)

    # A policy naming a Gateway that does not exist.
    run.mark("missing target")
    typo = {"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceSettings",
            "metadata": {"name": "typo", "namespace": NS},
            "spec": {"targetRefs": [{"kind": "Gateway", "name": "inference-gatewy"}],
                     "tenantSource": {"apiKey": {}}, "defaultAction": {"route": {"pool": "main"}}}}
    cp.api.kubectl("apply", "--server-side", "--field-manager", "kvasir-tests", "-f", "-", input=yaml.safe_dump(typo))
    wait_alert(run, "KvasirControllerNeedsAttention")
    demo.wait_stats_flushed(st.envoy)
    scraped_since(run, time.time())
    run.notes["before_stop"] = time.time()

    run.mark("Envoy, controller stopped")
    st.envoy.proc.stop()
    cp.controller.stop()
    for name in ("KvasirEnvoyStatsDown", "KvasirControllerDown"):
        wait_alert(run, name)


def test_every_panel_query_returns_labelled_series(live):
    run = live
    problems = []
    for title, t in targets():
        expr = panels_mod.substitute(t["expr"], RATE)
        series = run.prom.query_range(expr, run.start, run.end, 1)
        want = legend_labels(t["legendFormat"]) | by_labels(t["expr"])
        if not series:
            problems.append(f"{title}: no series for {expr}")
            continue
        for s in series:
            if not want <= set(s["metric"]):
                problems.append(f"{title}: {s['metric']} lacks {want - set(s['metric'])} ({expr})")
        finite = [float(v) for s in series for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
        if not finite:
            problems.append(f"{title}: never a finite value ({expr})")
    assert not problems, "\n".join(problems)


def test_the_variables_list_the_stacks_tenants_and_pools(live):
    tenants = live.prom.api("label/tenant/values", {"match[]": "kvasir_tenant_model_requests",
                                                    "start": live.start, "end": live.end})
    assert {"acme", "beta", "unknown"} <= set(tenants), tenants
    pools = live.prom.api("label/pool/values", {"match[]": "kvasir_indexer_pool_warm",
                                                "start": live.start, "end": live.end})
    assert pools == ["main"], pools


def test_what_the_panels_show_is_what_happened(live):
    """A few figures checked against what the run did."""
    p, s, e = live.prom, live.start, live.end

    def peak(expr: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for x in p.query_range(expr, s, e, 1):
            key = ",".join(f"{k}={v}" for k, v in sorted(x["metric"].items()))
            out[key] = max(float(v) for _, v in x["values"])
        return out

    def at_end(expr: str) -> dict[str, float]:
        return {",".join(f"{k}={v}" for k, v in sorted(x["metric"].items())): float(x["value"][1])
                for x in p.query(expr, at=live.notes["before_stop"])}

    # Counters as of before the last faults (Envoy is stopped at the end).
    assert at_end('sum by (tenant) (kvasir_tenant_model_rate_limited{limit="concurrent"})') == {"tenant=beta": 6}
    assert at_end('sum by (tenant, cause) (kvasir_tenant_model_shed)') == {"cause=max_wait,tenant=acme": 2}
    assert at_end('sum by (tenant) (kvasir_tenant_model_requests{decision="shed"})') == {"tenant=beta": 3}
    assert at_end('sum by (tenant) (kvasir_tenant_model_requests{decision="reject"})') == {"tenant=beta": 2}
    assert at_end('sum by (tenant) (kvasir_tenant_model_requests{decision="unauthorized"})') == {"tenant=unknown": 2}
    # Each shows on its panel as a rate, at least once.
    for what in ("kvasir_tenant_model_rate_limited", "kvasir_tenant_model_shed", "kvasir_tenant_model_failopen",
                 'kvasir_tenant_model_requests{decision=~"shed|reject|unauthorized"}'):
        rates = peak(f"sum by (tenant) (rate({what}[{RATE}]))")
        assert rates and max(rates.values()) > 0, (what, rates)
    failopen = at_end('sum by (tenant) (kvasir_tenant_model_failopen)')
    assert set(failopen) == {"tenant=acme", "tenant=beta"}, failopen
    assert min(failopen.values()) >= live.notes["failopens"], (failopen, live.notes)
    cached = at_end('sum by (tenant) (kvasir_tenant_model_prompt_tokens{cache="cached"})')
    assert cached["tenant=acme"] > 0 and cached["tenant=beta"] > 0, cached
    assert max(peak('max by (pool) (kvasir_indexer_pool_saturation)').values()) >= 0.99
    assert max(peak('sum by (pool, state) (kvasir_indexer_sync_state{state="disconnected"})').values()) >= 1
    assert max(peak('sum by (op) (increase(kvasir_indexer_budget_store_errors_total[5s]))').values()) > 0
    assert p.query_range('up{job="kvasir-indexer"} == 0', s, e, 1), "the indexer's stop shows as up == 0"


def test_the_rules_read_existing_series_and_the_produced_alerts_went_pending(live):
    p, s, e = live.prom, live.start, live.end
    problems = []
    for rule in rules():
        name = rule["alert"]
        for sel in selectors(rule["expr"]):
            series = p.query_range(sel, s, e, 1)
            if not series:
                problems.append(f"{name}: no series {sel}")
                continue
            want = by_labels(rule["expr"])
            have = set().union(*(x["metric"] for x in series))
            if not want <= have:
                problems.append(f"{name}: {sel} lacks {want - have}")
        if name in PRODUCED:
            alerts = p.query_range(f'ALERTS{{alertname="{name}"}}', s, e, 1)
            if not alerts:
                problems.append(f"{name}: never pending or firing although {PRODUCED[name]}")
                continue
            used = set(re.findall(r"\$labels\.(\w+)", rule["annotations"]["summary"]))
            for a in alerts:
                if not used <= set(a["metric"]):
                    problems.append(f"{name}: alert {a['metric']} lacks {used - set(a['metric'])}")
    assert not problems, "\n".join(problems)


def test_the_panels_render_to_png(live, tmp_path):
    out = Path(os.environ.get("KVASIR_PANELS_OUT") or tmp_path)
    paths = panels_mod.render(live.prom.url, live.start, live.end, out, step=1, rate_interval=RATE,
                              marks=live.marks)
    rows = [p["title"] for p in json.loads(P.DASHBOARD.read_text())["panels"] if p["type"] == "row"]
    assert len(paths) == len(rows)
    for path in paths:
        head = path.read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000, path
