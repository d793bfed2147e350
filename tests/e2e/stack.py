"""Process plumbing shared by the end-to-end tests, `make demo` and the
filter benchmark: the built artifacts, free ports, bounded waits, and
handles for vllm-sim, the cache-indexer and Envoy (rendered from the shipped
envoy/envoy.yaml). No pytest here: conftest.py adds the fixtures."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from http.client import HTTPConnection
from typing import Any


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "envoy"))
import render  # noqa: E402  (envoy/render.py)

TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
WASM = TARGET / "wasm32-wasip1" / "wasm-release" / "kvasir_filter.wasm"
COMPILE = TARGET / "release" / "examples" / "compile_policy"
SIM_BIN = Path(os.environ.get("VLLM_SIM_BIN", TARGET / "release" / "vllm-sim"))
INDEXER_BIN = Path(os.environ.get("KVASIR_INDEXER_BIN", TARGET / "release" / "cache-indexer"))
ENVOY_BIN = Path(os.environ.get("ENVOY_BIN", REPO / ".tools" / "bin" / "envoy"))
TOKENIZER = Path(os.environ.get("KVASIR_TOKENIZER_DIR", REPO / ".tools" / "tokenizers" / "qwen3"))
MODEL = "Qwen/Qwen3-8B"
PROVIDER_MODEL = "provider-model"
START_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 20.0

# Tenants and keys of the e2e policy set.
KEYS = {"acme": "sk-e2e-acme", "beta": "sk-e2e-beta"}
# What Envoy injects on the provider cluster (after "Bearer ").
PROVIDER_KEY = "sk-e2e-provider"


def sha256(s: str) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(s.encode()).hexdigest()


POLICY = {
    "tenantSource": {"apiKey": {}},
    "tenants": [
        {"name": "acme", "class": "gold", "apiKeyHashes": [sha256(KEYS["acme"])]},
        {"name": "beta", "class": "free", "apiKeyHashes": [sha256(KEYS["beta"])]},
    ],
    "pools": [
        {
            "name": "main",
            "models": [MODEL],
            "cluster": "kvasir_pool",
            "indexerCluster": "kvasir_indexer",
            "indexerTimeoutMs": 200,
        }
    ],
    "providers": [
        {
            "name": "ext",
            "cluster": "provider_example",
            "model": PROVIDER_MODEL,
            "auth": {"header": "authorization", "secretRef": {"name": "ext", "key": "api-key"}},
        }
    ],
    "policies": [
        {"name": "blocked", "match": {"models": ["blocked-model"]}, "action": {"reject": {"status": 403, "message": "blocked by policy"}}},
        {"name": "busy", "match": {"models": ["shed-model"]}, "action": {"shed": {"retryAfterS": 5, "message": "pool saturated"}}},
        {"name": "to-provider", "match": {"models": ["gpt-4o"]}, "action": {"provider": {"provider": "ext"}}},
        {"name": "alias", "match": {"models": ["alias-model"]}, "action": {"route": {"pool": "main", "rewriteModel": MODEL}}},
    ],
    "defaultAction": {"route": {"pool": "main", "includeUsage": True}},
}
SETTINGS = {"exposeServedEndpoint": True, "bodyLimitBytes": 1048575}


# ---------------------------------------------------------------------------
# Builds (idempotent; `make build` normally did them already)
# ---------------------------------------------------------------------------


def _cargo(*args: str, timeout: float = 1500) -> None:
    subprocess.run(["cargo", *args], cwd=REPO, check=True, timeout=timeout)


def _stale(artifact: Path) -> bool:
    """Missing, or older than a source it is built from."""
    if not artifact.exists():
        return True
    built = artifact.stat().st_mtime
    for d in ("filter/src", "filter/examples", "policy/src", "proto/src", "proto/proto"):
        for f in (REPO / d).rglob("*"):
            if f.suffix in (".rs", ".proto") and f.stat().st_mtime > built:
                return True
    return any((REPO / d / "Cargo.toml").stat().st_mtime > built for d in ("filter", "policy", "proto"))


def compile_plugin(policy: dict[str, Any], settings: dict[str, Any] | None = None) -> str:
    """The plugin configuration JSON for a policy set (through the policy
    compiler and the filter's own loader)."""
    p = subprocess.run(
        [str(COMPILE), "-", json.dumps(settings or {})],
        input=json.dumps(policy),
        capture_output=True,
        text=True,
        timeout=30,
    )
    if p.returncode != 0:
        raise AssertionError(f"compile_policy failed: {p.stderr}")
    return p.stdout


def indexer_available() -> bool:
    if not INDEXER_BIN.exists():
        return False
    try:
        out = subprocess.run([str(INDEXER_BIN), "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--endpoint" in out and "--grpc-addr" in out


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, fn, timeout: float = START_TIMEOUT_S, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
            last = v
        except Exception as e:  # noqa: BLE001 - polled until the deadline
            last = e
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what} (last: {last!r})")


class Proc:
    """A child process with its output in a log file; killed on stop."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.p = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.p.poll() is None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=5)
        self._log.close()


class Processes:
    """Owns a stack's processes (anything with a `proc`, or a `stop()`):
    on exit, also on an exception or Ctrl-C, stops them all, the last
    started first, each stop's failure reported and the others still
    stopped."""

    def __init__(self) -> None:
        self._items: list[Any] = []

    def add(self, item: Any) -> Any:
        self._items.append(item)
        return item

    def __enter__(self) -> "Processes":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        while self._items:
            item = self._items.pop()
            try:
                item.stop() if hasattr(item, "stop") else item.proc.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"stopping {item!r}: {e}", file=sys.stderr)


def request(method: str, port: int, path: str, body: bytes | str | None = None, headers: dict[str, str] | None = None,
         timeout: float = HTTP_TIMEOUT_S) -> tuple[int, dict[str, str], bytes]:
    if isinstance(body, str):
        body = body.encode()
    c = HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


_READY_PORT = re.compile(r' (http|kv_events|kv_events_replay)=(?:Some\(")?(?:tcp://)?[0-9.]+:(\d+)')


class Sim:
    """A vllm-sim started on port 0 (HTTP and both KV-event sockets): it
    binds what the kernel gives it and logs the ports in its `vllm-sim
    ready` line, read on first use. (Choosing free ports first and passing
    them in races: anything else binding or connecting in between, an
    outgoing connection included, can take one.)"""

    def __init__(self, proc: Proc, model: str):
        self.proc = proc
        self.model = model
        self._ports: dict[str, int] | None = None

    def ports(self) -> dict[str, int]:
        if self._ports is None:
            def ready():
                if not self.proc.alive():
                    raise RuntimeError(f"{self.proc.name} exited: {self.proc.log()[-2000:]}")
                line = next((l for l in self.proc.log().splitlines() if "vllm-sim ready" in l), None)
                return dict((k, int(v)) for k, v in _READY_PORT.findall(line)) if line else None
            self._ports = wait_until(f"{self.proc.name}'s ready line", ready)
        return self._ports

    @property
    def port(self) -> int:
        return self.ports()["http"]

    @property
    def events(self) -> int:
        return self.ports()["kv_events"]

    @property
    def replay(self) -> int:
        return self.ports()["kv_events_replay"]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        _, _, b = request("GET", self.port, "/metrics")
        total = 0.0
        for line in b.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_sim(logdir: Path, name: str, model: str = MODEL, profile: str = "zero", time_scale: float = 0,
              extra: list[str] | None = None) -> Sim:
    """A vllm-sim on ports of its own (see `Sim`); the tests' default costs
    no time at all. `extra`: more vllm-sim flags."""
    argv = [
        str(SIM_BIN), "--port", "0", "--model", model, "--profile", profile, "--time-scale", str(time_scale),
        "--enable-prompt-tokens-details", "--kv-events-port", "0", "--kv-events-replay-port", "0",
        "--tokenizer", str(TOKENIZER), *(extra or []),
    ]
    # The ready line (with the bound ports) is logged at info.
    return Sim(Proc(name, argv, logdir, env={"RUST_LOG": "info"}), model)


def wait_sim(s: Sim) -> None:
    wait_until(f"{s.proc.name} /health", lambda: s.proc.alive() and request("GET", s.port, "/health", timeout=2)[0] == 200)


@dataclass
class Indexer:
    proc: Proc | None
    grpc_port: int
    http_port: int
    argv: list[str] = field(default_factory=list)
    logdir: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        assert self.logdir is not None
        self.proc = Proc("cache-indexer", self.argv, self.logdir)
        wait_until("cache-indexer /readyz", lambda: self.proc.alive() and request("GET", self.http_port, "/readyz", timeout=2)[0] == 200)

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()

    def _samples(self, name: str) -> list[tuple[str, float]]:
        """One /metrics fetch: (name{labels}, value) of every sample of `name`."""
        _, _, b = request("GET", self.http_port, "/metrics")
        out = []
        for line in b.decode().splitlines():
            if not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            if head == name or head.startswith(name + "{"):
                out.append((head, float(value)))
        return out

    def metric(self, name: str, **labels: str) -> float:
        return sum(v for head, v in self._samples(name) if all(f'{k}="{x}"' in head for k, x in labels.items()))

    def metric_by(self, name: str, label: str) -> dict[str, float]:
        """`name` summed per value of `label`, from one fetch."""
        out: dict[str, float] = {}
        for head, v in self._samples(name):
            m = re.search(rf'[{{,]{label}="([^"]*)"', head)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + v
        return out


@dataclass
class Secrets:
    """Envoy's SDS files and the indexer's token file for one log dir."""

    provider_sds: Path
    indexer_sds: Path
    token_file: Path
    token: str


def secrets_for(logdir: Path) -> Secrets:
    """Fresh secrets for the processes of `logdir` (made once, then reused, so
    every Envoy and indexer started there share the token)."""
    d = logdir / "secrets"
    token_file = d / "indexer-token"
    if not token_file.exists():
        d.mkdir(parents=True, exist_ok=True)
        token_file.write_text(os.urandom(16).hex())
        (d / "provider.key").write_text(PROVIDER_KEY)
        (d / "provider.sds.yaml").write_text(render.sds_secret("provider-example-credential", str(d / "provider.key")))
        (d / "indexer.sds.yaml").write_text(render.sds_secret("kvasir-indexer-token", str(token_file)))
    return Secrets(d / "provider.sds.yaml", d / "indexer.sds.yaml", token_file, token_file.read_text())


def indexer_for(sims: list[Sim], logdir: Path, scrape_interval_ms: int = 100, extra: list[str] | None = None) -> Indexer:
    """An (unstarted) cache-indexer with one pool `main` over `sims`, on free
    ports, taking only calls with the token of `secrets_for(logdir)` (the one
    Envoys started there inject); `start()` runs it and waits for /readyz.
    `extra`: more flags."""
    grpc_port, http_port = free_port(), free_port()
    argv = [
        str(INDEXER_BIN), "--grpc-addr", f"127.0.0.1:{grpc_port}", "--http-addr", f"127.0.0.1:{http_port}",
        "--tokenizer", str(TOKENIZER), "--model", MODEL, "--scrape-interval-ms", str(scrape_interval_ms),
        *(extra or []),
    ]
    # Secure by default, as deployed: only Envoy (which injects the token
    # from the same file) may call the indexer.
    argv += ["--grpc-token-file", str(secrets_for(logdir).token_file)]
    for s in sims:
        argv += ["--endpoint", f"pool=main,address={s.address},events=tcp://127.0.0.1:{s.events},replay=tcp://127.0.0.1:{s.replay}"]
    return Indexer(None, grpc_port, http_port, argv, logdir)


@dataclass
class Envoy:
    proc: Proc
    port: int
    admin: int
    config_path: Path

    def stats(self) -> dict[str, int]:
        _, _, b = request("GET", self.admin, "/stats?format=json")
        out = {}
        for s in json.loads(b)["stats"]:
            if "value" in s:
                out[s["name"]] = s["value"]
        return out

    def stat(self, name: str) -> int:
        return self.stats().get(name, 0)

    def prometheus(self) -> str:
        return request("GET", self.admin, "/stats/prometheus")[2].decode()

    def healthy(self, cluster: str, addresses: list[str]) -> bool:
        _, _, b = request("GET", self.admin, "/clusters", timeout=2)
        text = b.decode()
        return all(f"{cluster}::{a}::health_flags::healthy" in text for a in addresses)

    def post(self, path: str, body: Any, key: str | None = "acme", headers: dict[str, str] | None = None,
             raw: bool = False) -> tuple[int, dict[str, str], bytes]:
        h = {"content-type": "application/json"}
        if key is not None:
            h["authorization"] = f"Bearer {KEYS.get(key, key)}"
        h.update(headers or {})
        data = body if raw else json.dumps(body)
        return request("POST", self.port, path, data, h)


def start_envoy(logdir: Path, plugin: str, pool: list[str], indexer: str, provider: str, name: str = "envoy",
                pre_filters: str | None = None, without_filter: bool = False, concurrency: int = 2,
                log_level: str = "info", pool_lb: str | None = None, request_timeout_s: float | None = None) -> Envoy:
    """Envoy from the shipped bootstrap; `without_filter` renders the same
    bootstrap minus the Kvasir filter (the benchmark's baseline), `pool_lb`
    swaps the pool's override-host policy for a plain load balancer."""
    port, admin = free_port(), free_port()
    text = render.render(
        render.TEMPLATE.read_text(),
        listen_port=port,
        admin_port=admin,
        pool_endpoints=pool,
        indexer=indexer,
        provider=provider,
        wasm=str(WASM),
        plugin_config=plugin,
        health_interval_s=0.5,
        pre_filters=pre_filters,
        without_filter=without_filter,
        pool_lb=pool_lb,
        provider_sds=str(secrets_for(logdir).provider_sds),
        indexer_sds=str(secrets_for(logdir).indexer_sds),
        request_timeout_s=request_timeout_s,
    )
    cfg = logdir / f"{name}.yaml"
    cfg.write_text(text)
    argv = [str(ENVOY_BIN), "-c", str(cfg), "--concurrency", str(concurrency), "--disable-hot-restart",
            "-l", log_level, "--component-log-level", f"wasm:{log_level}"]
    return Envoy(Proc(name, argv, logdir), port, admin, cfg)


def wait_envoy(e: Envoy, pool: list[str]) -> None:
    wait_until("envoy admin /ready", lambda: e.proc.alive() and request("GET", e.admin, "/ready", timeout=2)[0] == 200)
    wait_until("pool endpoints healthy in envoy", lambda: e.healthy("kvasir_pool", pool))


# ---------------------------------------------------------------------------


def chat(model: str = MODEL, content: str = "hello", system: str | None = None, **extra: Any) -> dict[str, Any]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"model": model, "messages": msgs, "max_tokens": 4, **extra}


def sse_events(body: bytes) -> list[Any]:
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data:"):
            p = line[5:].strip()
            if p and p != "[DONE]":
                out.append(json.loads(p))
    return out


def wasm_failures(e: Envoy) -> dict[str, Any]:
    """Signs of a failed or reloaded VM: reload counters, and panics or VM
    failures in the log."""
    st = e.stats()
    counters = {k: v for k, v in st.items() if k.startswith("wasm.kvasir.vm_reload") and v}
    log = e.proc.log()
    bad = [l for l in log.splitlines() if "panicked" in l or "Wasm VM failed" in l or "wasm vm failed" in l.lower()
           or ("wasm" in l and "critical" in l)]
    return {"counters": counters, "log": bad}
