"""The simulator launcher: vllm-sim on port 0 for HTTP and both KV-event
sockets, its bound ports read from its `vllm-sim ready` log line. The one
launcher of tests/e2e, tests/sim, the benchmarks and the demo."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

from . import prom
from .paths import MODEL, SIM_BIN, TOKENIZER
from .procs import START_TIMEOUT_S, Exited, Proc, request, wait_until

# Every simulator of the tests serves the admin endpoints they inject
# faults through (`/sim/faults`, ...), which vllm-sim serves only when
# asked (`--enable-sim-admin`, or this variable); the ready line (with the
# bound ports) is logged at info.
SIM_ENV = {"RUST_LOG": "info", "VLLM_SIM_ENABLE_ADMIN": "1"}

_READY_PORT = re.compile(r' (http|kv_events|kv_events_replay)=(?:Some\(")?(?:tcp://)?[0-9.]+:(\d+)')


class Sim:
    """A started vllm-sim: it binds what the kernel gives it and logs the
    ports in its ready line, read on first use. (Choosing free ports first
    and passing them in races: anything else binding or connecting in
    between, an outgoing connection included, can take one.)"""

    def __init__(self, proc: Proc, model: str):
        self.proc = proc
        self.model = model
        self._ports: dict[str, int] | None = None

    def ports(self) -> dict[str, int]:
        if self._ports is None:
            def ready():
                if not self.proc.alive():
                    raise Exited(f"{self.proc.name} exited: {self.proc.log()[-2000:]}")
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

    def metrics_text(self) -> str:
        return request("GET", self.port, "/metrics")[2].decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples (carrying `labels`) in /metrics."""
        return prom.total(self.metrics_text(), name, **labels)

    def stop(self) -> None:
        self.proc.stop()


def launch_sim(logdir: Path, name: str, args: list[str], model: str = MODEL) -> Sim:
    """vllm-sim with `args` (any flags but its three ports) on ports of its
    own (see `Sim`), its output in `logdir/<name>.log`. `model` is only
    recorded on the handle: pass `--model` in `args` to serve another."""
    argv = [str(SIM_BIN), "--port", "0", "--kv-events-port", "0", "--kv-events-replay-port", "0", *args]
    return Sim(Proc(name, argv, logdir, env=SIM_ENV), model)


def start_sim(logdir: Path, name: str, model: str = MODEL, profile: str = "zero", time_scale: float = 0,
              extra: list[str] | None = None) -> Sim:
    """A vllm-sim as the local stack runs them: prompt-token details on, the
    Responses API's store on (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE`, so
    `previous_response_id` works), the project's tokenizer; the default
    profile costs no time at all. `extra`: more vllm-sim flags."""
    args = ["--model", model, "--profile", profile, "--time-scale", str(time_scale), "--enable-prompt-tokens-details",
            "--enable-responses-api-store", "--tokenizer", str(TOKENIZER), *(extra or [])]
    return launch_sim(logdir, name, args, model)


def wait_sim(s: Sim, timeout: float = START_TIMEOUT_S) -> None:
    """Until its /health answers 200 (bounded); `Exited` (with its log's
    tail) as soon as it is gone."""
    def healthy() -> bool:
        if not s.proc.alive():
            raise Exited(f"{s.proc.name} exited: {s.proc.log()[-2000:]}")
        return request("GET", s.port, "/health", timeout=2)[0] == 200

    wait_until(f"{s.proc.name} /health", healthy, timeout=timeout)


def restart_sim(s: Sim, logdir: Path, name: str, down_s: float = 0.0) -> Sim:
    """Kills `s` (SIGKILL, as a crash: nothing flushed, no goodbye) and,
    `down_s` later, starts the same argv again on the same HTTP port, its
    KV-event sockets on new ports and its cache, event sequence and stores
    empty, as a restarted vLLM pod behind the same address. Returns the new
    handle (ports read from its ready line); wait for it with `wait_sim`."""
    port = s.port
    s.proc.stop(signal.SIGKILL)
    time.sleep(down_s)
    argv = list(s.proc.argv)
    i = argv.index("--port")
    argv[i + 1] = str(port)
    return Sim(Proc(name, argv, logdir, env=SIM_ENV), s.model)
