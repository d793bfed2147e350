"""A real Prometheus (Debian's `prometheus` package, installed by
scripts/setup.sh) on 127.0.0.1 for the dashboards' test and the demo: the
shipped scrape configuration (deploy/prometheus/prometheus.yml) rendered
with the local stack's addresses in place of Kubernetes service discovery,
started on a free port with its data in a temporary folder, and read
through its HTTP API (instant and range queries, targets, alerts).

Not re-exported by the package: it needs PyYAML (in the venv), where the
rest of the harness needs only the standard library.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .paths import REPO
from .procs import START_TIMEOUT_S, Exited, Proc, free_port, wait_until

PROMETHEUS_BIN = os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL_BIN = os.environ.get("PROMTOOL_BIN") or shutil.which("promtool") or "/usr/bin/promtool"
DEPLOY = REPO / "deploy"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "kvasir-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "kvasir.json"


def prometheus_available() -> bool:
    return Path(PROMETHEUS_BIN).exists() and Path(PROMTOOL_BIN).exists()


def promtool(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`promtool ARGS` (check config, check rules, test rules), its output
    captured."""
    return subprocess.run([PROMTOOL_BIN, *args], capture_output=True, text=True, timeout=timeout)


def render_config(targets: dict[str, list[str]], interval_s: float = 1.0, rule_files: list[Path] | None = None,
                  shipped: Path = SCRAPE_CONFIG) -> str:
    """The shipped configuration with each job's service discovery
    replaced by `targets[job]` (static `host:port`s) and the Kubernetes
    relabelling dropped (it keeps targets by pod labels a static target
    does not have); every other setting of a job (its path, its
    parameters, the metric relabelling) is kept as shipped. Scrape and
    rule evaluation every `interval_s`; `rule_files` replace the shipped
    ones (absolute paths). A job of the shipped file missing from
    `targets` is an error: the test must reach every job the alerts
    name."""
    cfg = yaml.safe_load(shipped.read_text())
    interval = f"{int(interval_s * 1000)}ms"
    cfg["global"] = {**cfg.get("global", {}), "scrape_interval": interval, "evaluation_interval": interval,
                     "scrape_timeout": interval}
    if rule_files is not None:
        cfg["rule_files"] = [str(p) for p in rule_files]
    jobs = []
    for job in cfg["scrape_configs"]:
        name = job["job_name"]
        if name not in targets:
            raise KeyError(f"no targets for job {name}")
        job = copy.deepcopy(job)
        for k in [k for k in job if k.endswith("_sd_configs")]:
            del job[k]
        job.pop("relabel_configs", None)
        job.pop("scrape_interval", None)
        job.pop("scrape_timeout", None)
        job["static_configs"] = [{"targets": list(targets[name])}]
        jobs.append(job)
    unknown = set(targets) - {j["job_name"] for j in jobs}
    if unknown:
        raise KeyError(f"jobs not in {shipped}: {sorted(unknown)}")
    cfg["scrape_configs"] = jobs
    cfg.pop("alerting", None)
    return yaml.safe_dump(cfg, sort_keys=False)


@dataclass
class Prometheus:
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, params: dict[str, Any] | None = None, timeout: float = 20) -> Any:
        """GET /api/v1/`path`: its `data`, or RuntimeError with Prometheus's
        error (a bad query names its position)."""
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{q}", timeout=timeout) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query: [{metric: labels, value: [t, "v"]}]."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """A range query: [{metric: labels, values: [[t, "v"], ...]}]."""
        return self.api("query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                        "step": f"{step}"})["result"]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def alerts(self) -> list[dict]:
        """Alerts pending or firing now."""
        return self.api("alerts")["alerts"]

    def stop(self) -> None:
        self.proc.stop()


def start_prometheus(logdir: Path, config: str, name: str = "prometheus") -> Prometheus:
    """Prometheus with `config` (text) on a free 127.0.0.1 port, its TSDB
    under `logdir`; returns once /-/ready answers (bounded)."""
    port = free_port()
    cfg = logdir / f"{name}.yml"
    cfg.write_text(config)
    data = logdir / f"{name}-data"
    data.mkdir(exist_ok=True)
    argv = [PROMETHEUS_BIN, f"--config.file={cfg}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d",
            "--log.level=warn"]
    p = Prometheus(Proc(name, argv, logdir), port)

    def ready() -> bool:
        if not p.proc.alive():
            raise Exited(f"{name} exited: {p.proc.log()[-3000:]}")
        with urllib.request.urlopen(f"{p.url}/-/ready", timeout=2) as r:
            return r.status == 200

    try:
        wait_until(f"{name} /-/ready", ready, timeout=START_TIMEOUT_S, interval=0.1)
    except BaseException:
        p.stop()
        raise
    return p
