"""docs/deploy.md's walk-through, "From an empty cluster" (the ```sh block
with steps 1-5), run by the test suite. Its command lines are read from
the document itself (continuation lines joined, compound commands kept
whole, in order), so the doc and this test cannot drift, and each runs in
that order against a real kube-apiserver on a real etcd (started on
127.0.0.1 by the harness) with Envoy Gateway's own controller (the binary
and configuration the gateway-helm chart runs, its Kubernetes provider)
watching that API server and writing status there.

Each command runs in a sandbox: one bash for the whole block (TOKEN set on
one line is there for the next) whose PATH holds only `kubectl`
(KUBECONFIG: the test's API server), `kvasirctl` (target/release) and
`openssl`; its working directory a copy of the repository's tracked
gateway-api/ and crds/ (the route-token step writes
gateway-api/install/route-token.env there, never into the checkout);
OPENAI_API_KEY, REGISTRY, TAG and VLLM_MANIFESTS (two vLLM Deployments as
"Your vLLM Deployments" describes them) set to test values. A command
that needs what no test machine has (helm and a chart registry, the
network, an image registry, a kubelet, an endpoint controller, a load
balancer) is handled by the entry of `SUBSTITUTIONS` that matches it,
which says what stands in and why; most entries write only what the
missing component would have written and then run the command as
written. The test fails when a command neither runs as written nor has an
entry (a new step must be handled here) and when an entry matches no
command (it is stale).

Envoy Gateway reads its certificates from /certs and binds fixed ports on
every interface, so it runs in a mount and network namespace of its own
(`start_envoy_gateway_kubernetes`), which needs root and `unshare`. Where
the machine has neither, or with KVASIR_WALKTHROUGH_WITHOUT_EG=1, the walk
runs without it, and the four waits on Envoy Gateway's status are replaced
by checks of what exists and of the controller's own status
(`Programmed=True`, "Envoy Gateway has not reported", the
GatewayVerdict::NotReported case of controller/src/plan.rs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import pytest
import yaml

from kvasir_harness import Proc, Processes, free_port, request, wait_until
from kvasir_harness.kube import (ENVOY_GATEWAY_BIN, ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, ApiServer,
                                 EnvoyGatewayKubernetes, eg_chart_crds, eg_version, isolation_available,
                                 start_apiserver, start_envoy_gateway_kubernetes, start_etcd, write_kubeconfig)
from kvasir_harness.procs import Exited
from test_controller import CONTROLLER, KVASIR_KINDS, KVASIRCTL, conditions, module_file, need

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "deploy.md"
SECTION = "### From an empty cluster"
UPSTREAM = REPO / "tests" / "upstream-crds"
NS = "serving"
EG_NS = "envoy-gateway-system"
GATEWAY = "inference-gateway"
EEP = f"kvasir-gateway-{GATEWAY}"
# Test values for the variables the walk-through reads.
ENV = {"OPENAI_API_KEY": "sk-walkthrough-openai-test-key", "REGISTRY": "registry.test.invalid/kvasir",
       "TAG": "walkthrough", "VLLM_MANIFESTS": "vllm.yaml"}
# The operator's vLLM Deployments (VLLM_MANIFESTS), as "Your vLLM
# Deployments" describes them: pods labelled app: vllm-llama-8b /
# vllm-llama-1b, serving on 8000, publishing KV events. Never run here (no
# kubelet, no GPU); the image is a placeholder.
VLLM = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: vllm-llama-8b}
spec:
  replicas: 2
  selector: {matchLabels: {app: vllm-llama-8b}}
  template:
    metadata: {labels: {app: vllm-llama-8b}}
    spec:
      containers:
        - name: vllm
          image: registry.test.invalid/vllm-openai:walkthrough
          args: [--model, meta-llama/Llama-3.1-8B-Instruct, --served-model-name, llama-3.1-8b-instruct, --port, "8000",
                 --kv-events-config, '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}']
          ports: [{name: http, containerPort: 8000}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: vllm-llama-1b}
spec:
  replicas: 1
  selector: {matchLabels: {app: vllm-llama-1b}}
  template:
    metadata: {labels: {app: vllm-llama-1b}}
    spec:
      containers:
        - name: vllm
          image: registry.test.invalid/vllm-openai:walkthrough
          args: [--model, meta-llama/Llama-3.2-1B-Instruct, --served-model-name, llama-3.2-1b-instruct, --port, "8000",
                 --kv-events-config, '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}']
          ports: [{name: http, containerPort: 8000}]
"""
# A command's own --timeout is kept; a wait on what never comes is cut
# here, so a broken step fails the test in minutes, not in the doc's 5.
COMMAND_CAP_S = 120.0
WITHOUT_EG = os.environ.get("KVASIR_WALKTHROUGH_WITHOUT_EG") == "1"


# The block
# ---------------------------------------------------------------------------


def walkthrough(text: str | None = None) -> list[str]:
    """The command lines of the section's first ```sh block, in order:
    comment lines and blank lines dropped, backslash continuations joined
    with one space, a compound command (for/while ... done, if ... fi)
    kept whole, its lines joined with newlines."""
    text = DOC.read_text() if text is None else text
    start = text.index(SECTION)
    m = re.search(r"^```sh\n(.*?)^```", text[start:], re.S | re.M)
    assert m, f"no ```sh block under {SECTION!r} in {DOC}"
    logical, buf = [], None
    for line in m.group(1).splitlines():
        buf = line if buf is None else f"{buf} {line.strip()}"
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        logical.append(buf)
        buf = None
    assert buf is None, f"the block ends in a continuation: {buf!r}"
    out, group, depth = [], [], 0
    for line in logical:
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        words = shlex.split(s, comments=True)
        depth += sum(w in ("do", "then") for w in words) - sum(w in ("done", "fi") for w in words)
        group.append(s)
        if depth == 0:
            out.append("\n".join(group))
            group = []
    assert not group, f"an unterminated compound command: {group!r}"
    return out


def words(cmd: str) -> list[str]:
    return shlex.split(cmd, comments=True)


# The sandbox's shell
# ---------------------------------------------------------------------------


class Shell:
    """One bash for the whole walk-through (a variable one line sets, such
    as TOKEN, is there for the next), each command run with stdin from
    /dev/null, its output and exit status read back within a deadline."""

    def __init__(self, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.log = open(log, "a")
        self.p = subprocess.Popen(["/bin/bash", "--noprofile", "--norc"], cwd=cwd, env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self.lines: list[str] = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self.cv:
                self.lines.append(line)
                self.cv.notify_all()
        with self.cv:
            self.lines.append(None)
            self.cv.notify_all()

    def run(self, cmd: str, timeout: float) -> tuple[int, str]:
        marker = f"__walkthrough_rc_{os.urandom(6).hex()}="
        with self.cv:
            start = len(self.lines)
        self.log.write(f"$ {cmd}\n")
        self.p.stdin.write(f"{{ {cmd}\n}} </dev/null\necho \"{marker}$?\"\n")
        self.p.stdin.flush()
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                got = self.lines[start:]
                if got and got[-1] is None:
                    raise Exited(f"the sandbox's bash exited: {''.join(x for x in got if x)}")
                if got and got[-1].startswith(marker):
                    out = "".join(got[:-1])
                    self.log.write(out)
                    self.log.flush()
                    return int(got[-1][len(marker):]), out
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop()
                    raise TimeoutError(f"{cmd!r} still running after {timeout:.0f} s: {''.join(got)[-3000:]}")
                self.cv.wait(left)

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, 9)
            except ProcessLookupError:
                pass
            self.p.wait(timeout=5)
        self.log.close()


def command_timeout(cmd: str) -> float:
    """The command's own `--timeout` (kubectl's), plus room for kubectl to
    start, capped."""
    total = 0.0
    for m in re.finditer(r"--timeout[= ](\d+)(ms|s|m|h)\b", cmd):
        total += int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    return min(total, COMMAND_CAP_S) + 30.0


def make_sandbox(d: Path, kubeconfig: Path) -> tuple[Path, dict[str, str]]:
    """The repository's tracked gateway-api/ and crds/ (as in the working
    tree) copied into `d/repo`, and the environment the commands run in:
    PATH = only kubectl, kvasirctl and openssl."""
    repo = d / "repo"
    files = subprocess.run(["git", "ls-files", "-z", "gateway-api", "crds"], cwd=REPO, capture_output=True,
                           check=True, timeout=30).stdout.decode().split("\0")
    for f in filter(None, files):
        if not (REPO / f).exists():   # deleted in the working tree
            continue
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, repo / f)
    assert not (repo / "gateway-api" / "install" / "route-token.env").exists()
    (repo / ENV["VLLM_MANIFESTS"]).write_text(VLLM)
    bin_ = d / "bin"
    bin_.mkdir()
    for name, target in (("kubectl", shutil.which(KUBECTL) or KUBECTL), ("kvasirctl", KVASIRCTL),
                         ("openssl", shutil.which("openssl"))):
        (bin_ / name).symlink_to(Path(target).resolve())
    home = d / "home"
    home.mkdir()
    env = {"PATH": str(bin_), "HOME": str(home), "KUBECONFIG": str(kubeconfig), "LANG": "C.UTF-8", **ENV}
    return repo, env


# The module's Service, as the cluster's DNS would serve it
# ---------------------------------------------------------------------------


class ServiceProxy:
    """An HTTP forward proxy on 127.0.0.1 for Envoy Gateway's module fetch
    (HTTP_PROXY): a request for `<service>.<ns>.svc.cluster.local:<port>`
    goes to the local process standing in for that Service's pods; any
    other host is refused and recorded."""

    def __init__(self) -> None:
        self.routes: dict[str, int] = {}
        self.refused: list[str] = []
        self.served: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                u = urlsplit(self.path)
                port = proxy.routes.get(u.netloc)
                if port is None:
                    proxy.refused.append(self.path)
                    self.send_response(502)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                c = HTTPConnection("127.0.0.1", port, timeout=30)
                try:
                    c.request("GET", u.path or "/")
                    r = c.getresponse()
                    body = r.read()
                finally:
                    c.close()
                proxy.served.append(f"{self.path} {r.status}")
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "connection", "transfer-encoding"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# The walk
# ---------------------------------------------------------------------------


@dataclass
class Walk:
    dir: Path
    api: ApiServer
    repo: Path
    shell: Shell
    procs: Processes
    proxy: ServiceProxy
    wasm: Path
    eg: EnvoyGatewayKubernetes | None = None
    eg_absent: str | None = None           # why Envoy Gateway does not run
    controller: Proc | None = None
    controller_http: int = 0
    images: dict[str, str] = field(default_factory=dict)
    done: list[tuple[str, str]] = field(default_factory=list)   # (command, what happened)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 90.0) -> subprocess.CompletedProcess:
        return self.api.kubectl(*args, input=input, check=check, timeout=timeout)

    def get(self, kind: str, name: str, ns: str | None = NS) -> dict | None:
        r = self.kubectl("get", kind, name, *(["-n", ns] if ns else []), "-o", "json", check=False)
        if r.returncode != 0:
            if "NotFound" in r.stderr:
                return None
            raise RuntimeError(r.stderr)
        return json.loads(r.stdout)

    def as_written(self, cmd: str) -> str:
        rc, out = self.shell.run(cmd, command_timeout(cmd))
        if rc != 0:
            pytest.fail(f"docs/deploy.md, {SECTION!r}: this command failed against the API server "
                        f"(exit {rc}); fix the step, or, if it needs what no test machine has, give it an entry "
                        f"in SUBSTITUTIONS:\n{cmd}\n{out[-4000:]}{self.waited_status(cmd)}", pytrace=False)
        return out

    def waited_status(self, cmd: str) -> str:
        """For a failed `kubectl wait` on one object: that object's status."""
        w = words(cmd)
        if w[:1] != ["kubectl"] or "wait" not in w:
            return ""
        ns = w[w.index("-n") + 1] if "-n" in w else None
        objs = [x for x in w[w.index("wait") + 1:] if re.fullmatch(r"[\w.]+/[\w.-]+", x)]
        if len(objs) != 1:
            return ""
        kind, name = objs[0].split("/")
        obj = self.get(kind, name, ns)
        return f"\n{objs[0]} status: {json.dumps((obj or {}).get('status'), indent=1)[-4000:]}"


def cond(obj: dict | None, t: str, holder: str | None = None) -> dict | None:
    """Condition `t` of an object, or of its first `holder`
    (status.ancestors / status.parents) entry."""
    st = (obj or {}).get("status") or {}
    cs = (st.get(holder) or [{}])[0].get("conditions", []) if holder else st.get("conditions", [])
    return next((c for c in cs if c.get("type") == t), None)


# Step 1: Envoy Gateway

def helm_values(cmd: str) -> tuple[str, str, dict]:
    """(chart version, namespace, the chart's EnvoyGateway configuration
    with the command's `--set config.envoyGateway.*` values applied, as
    helm would render the envoy-gateway-config ConfigMap; the chart's
    image settings left out, no pod runs)."""
    w = words(cmd)
    version = w[w.index("--version") + 1]
    ns = w[w.index("-n") + 1]
    cfg: dict = {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyGateway",
                 "gateway": {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller"},
                 "provider": {"type": "Kubernetes"}, "logging": {"level": {"default": "info"}},
                 "extensionApis": {}}
    for i, x in enumerate(w):
        if x != "--set":
            continue
        key, value = w[i + 1].split("=", 1)
        assert key.startswith("config.envoyGateway."), \
            f"helm value {key} is not modelled by this substitution: add it to helm_values()"
        v: object = {"true": True, "false": False}.get(value, value)
        *path, last = key[len("config.envoyGateway."):].split(".")
        node = cfg
        for p in path:
            node = node.setdefault(p, {})
        if m := re.fullmatch(r"(\w+)\[(\d+)\]", last):
            lst = node.setdefault(m.group(1), [])
            assert int(m.group(2)) == len(lst), f"helm list index out of order in {key}"
            lst.append(v)
        else:
            node[last] = v
    return version, ns, cfg


def install_envoy_gateway(walk: Walk, m: re.Match) -> str:
    version, ns, cfg = helm_values(m.string)
    assert version == eg_version(), f"the doc installs Envoy Gateway {version}, the tools are {eg_version()}"
    assert ns == EG_NS
    crds = eg_chart_crds()
    if not crds:
        pytest.fail(f"Envoy Gateway {version}'s chart CRDs are not in the Go module cache: run `make setup` "
                    "(scripts/go-tools.sh)")
    args = ["apply", "--server-side", "--field-manager", "helm"]
    for f in crds:
        args += ["-f", str(f)]
    walk.kubectl(*args, timeout=180)
    walk.kubectl("create", "namespace", ns)
    if walk.eg_absent:
        return f"the chart's CRDs applied and {ns} created; Envoy Gateway not run: {walk.eg_absent}"
    walk.eg = walk.procs.add(start_envoy_gateway_kubernetes(
        walk.dir / "envoy-gateway", walk.api, cfg, namespace=ns, egress_ports=[walk.proxy.port],
        env={"HTTP_PROXY": f"http://127.0.0.1:{walk.proxy.port}"}))
    return (f"the chart's CRDs applied, {ns} created, `envoy-gateway certgen` (the chart's Job) and "
            f"`envoy-gateway server` with the chart's configuration and the command's values {cfg['extensionApis']}, "
            f"{cfg.get('runtimeFlags')} run as local processes against the API server")


def envoy_gateway_available(walk: Walk, m: re.Match) -> str:
    if walk.eg is None:
        return "skipped: Envoy Gateway does not run here"
    wait_until("Envoy Gateway ready", walk.eg.ready, timeout=60, interval=0.2)
    return "Envoy Gateway's readiness probe (/readyz, what the Deployment's Available follows) answers 200"


# Step 2: CRDs

def inference_extension_crds(walk: Walk, m: re.Match) -> str:
    vendored = UPSTREAM / "inference.networking.k8s.io_inferencepools.yaml"
    assert m.group(1) in (UPSTREAM / "README.md").read_text(), \
        f"the doc's Inference Extension {m.group(1)} is not the one tests/upstream-crds/ vendors"
    walk.kubectl("apply", "-f", str(vendored))
    return f"applied the vendored InferencePool CRD ({vendored.relative_to(REPO)}) with `kubectl apply -f`"


# Step 4: images

def images_built(walk: Walk, m: re.Match) -> str:
    """Points the sandbox's gateway-api/kustomization.yaml `images:` at
    $REGISTRY/<name>:$TAG, as the step's text says to."""
    k = walk.repo / "gateway-api" / "kustomization.yaml"
    doc = yaml.safe_load(k.read_text())
    for img in doc["images"]:
        base = img["name"].rsplit("/", 1)[1]
        img["newName"], img["newTag"] = f"{ENV['REGISTRY']}/{base}", ENV["TAG"]
        img.pop("digest", None)
        walk.images[base] = f"{ENV['REGISTRY']}/{base}:{ENV['TAG']}"
    k.write_text(yaml.safe_dump(doc, sort_keys=False))
    return f"skipped; the sandbox's kustomization `images:` pointed at {sorted(walk.images.values())}"


def images_pushed(walk: Walk, m: re.Match) -> str:
    head = words(m.string.splitlines()[0])
    names = [x.rstrip(";") for x in head[3:head.index("do")] if x != ";"]
    assert sorted(names) == sorted(walk.images), (names, walk.images)
    return f"skipped; pushes {names}, the images `images:` names"


# Step 5: the pods

def rollout(walk: Walk, m: re.Match) -> str:
    name = m.group(1)
    d = walk.get("deployment", name)
    assert d is not None, f"deployment/{name} not applied"
    spec = d["spec"]
    assert spec["replicas"] >= 1 and spec["selector"]["matchLabels"].items() <= \
        spec["template"]["metadata"]["labels"].items(), spec
    (c0, *_) = spec["template"]["spec"]["containers"]
    if name in ("kvasir-controller", "kvasir-indexer"):
        assert c0["image"] in walk.images.values(), (c0["image"], walk.images)
    if name != "kvasir-controller":
        return f"deployment/{name} applied ({spec['replicas']} replicas of {c0['image']}); no kubelet runs it"
    start_controller(walk, d)
    return ("deployment/kvasir-controller applied; its container's args run as a local process, as its "
            "ServiceAccount, and its readiness probe answers 200")


def start_controller(walk: Walk, deployment: dict) -> None:
    """The controller as the Deployment would run it: the container's
    args with $(POD_NAMESPACE) and $(POD_NAME) filled in, its listen
    addresses moved to free 127.0.0.1 ports, the module the image carries
    (/kvasir_filter.wasm) replaced by the built one, authenticated as the
    Deployment's ServiceAccount (a token from the API server)."""
    pod = deployment["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "controller"]
    fields = {"metadata.namespace": NS, "metadata.name": "kvasir-controller-walkthrough"}
    env = {e["name"]: fields[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in c.get("env", [])
           if "fieldRef" in e.get("valueFrom", {})}
    http, metrics = free_port(), free_port()
    args = []
    for a in c.get("args", []):
        a = re.sub(r"\$\((\w+)\)", lambda x: env[x.group(1)], a)
        if a.startswith("--http-addr="):
            a = f"--http-addr=127.0.0.1:{http}"
        elif a.startswith("--metrics-addr="):
            a = f"--metrics-addr=127.0.0.1:{metrics}"
        elif a.startswith("--wasm-file="):
            a = f"--wasm-file={walk.wasm}"
        args.append(a)
    sa = pod["serviceAccountName"]
    token = walk.kubectl("create", "token", sa, "-n", NS, "--duration", "1h").stdout.strip()
    kubeconfig = write_kubeconfig(walk.dir / f"{sa}.kubeconfig", walk.api.url, walk.api.pki.ca, token)
    proc = walk.procs.add(Proc("kvasir-controller", [str(CONTROLLER), *args], walk.dir,
                               env={"KUBECONFIG": str(kubeconfig), "RUST_LOG": "info,kube=warn"}))
    walk.controller, walk.controller_http = proc, http
    # The Service the module URL names now has an endpoint: this process.
    svc = walk.get("service", "kvasir-controller")
    port = next(p for p in svc["spec"]["ports"] if p["name"] == "http")
    assert port["targetPort"] == "http" and any(p["name"] == "http" and p["containerPort"] == port["port"]
                                                for p in c["ports"])
    walk.proxy.routes[f"kvasir-controller.{NS}.svc.cluster.local:{port['port']}"] = http
    probe = c["readinessProbe"]["httpGet"]["path"]

    def ready():
        if not proc.alive():
            raise Exited(f"controller exited: {proc.log()[-3000:]}")
        return request("GET", http, probe, timeout=2)[0] == 200

    wait_until(f"the controller's {probe}", ready, timeout=30, interval=0.1)


def pool_endpoints(walk: Walk, m: re.Match) -> str:
    """Writes, for each Service the wait names, the EndpointSlice the
    endpointslice controller would once the pods of the Deployments its
    selector matches are ready (one endpoint per replica, the Service's
    ports resolved against the containers'), then waits as written."""
    made = []
    for name in m.group(1).split(","):
        svc = walk.get("service", name)
        assert svc is not None, f"service/{name} not applied"
        sel = svc["spec"]["selector"]
        deps = [d for d in json.loads(walk.kubectl("get", "deployments", "-n", NS, "-o", "json").stdout)["items"]
                if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        endpoints, ports = [], []
        for i, d in enumerate(deps):
            containers = d["spec"]["template"]["spec"]["containers"]
            for r in range(d["spec"]["replicas"]):
                endpoints.append({"addresses": [f"10.244.{len(made)}.{10 * i + r + 2}"],
                                  "conditions": {"ready": True, "serving": True, "terminating": False},
                                  "targetRef": {"kind": "Pod", "namespace": NS, "name": f"{d['metadata']['name']}-{r}"}})
            for p in svc["spec"]["ports"]:
                t = p.get("targetPort", p["port"])
                if isinstance(t, str):
                    t = next(cp["containerPort"] for c in containers for cp in c.get("ports", []) if cp.get("name") == t)
                ports.append({"name": p.get("name", ""), "port": t, "protocol": p.get("protocol", "TCP")})
        if not endpoints:
            continue
        slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                  "metadata": {"name": f"{name}-walkthrough", "namespace": NS,
                               "labels": {"kubernetes.io/service-name": name,
                                          "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
                               "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": name,
                                                    "uid": svc["metadata"]["uid"]}]},
                  "endpoints": endpoints, "ports": [dict(t) for t in {tuple(p.items()) for p in ports}]}
        walk.kubectl("apply", "--server-side", "--field-manager", "endpointslice-controller", "-f", "-",
                     input=json.dumps(slice_))
        made.append(f"{name}: {len(endpoints)} endpoints")
    walk.as_written(m.string)
    return f"ran as written, after the EndpointSlices the endpoint controller would write for ready pods ({made})"


# Step 5: Envoy Gateway's view

def gateway_programmed(walk: Walk, m: re.Match) -> str:
    if walk.eg is None:
        gw = walk.get("gateway", GATEWAY)
        assert gw is not None
        return "substituted: the Gateway exists (nothing programs it without Envoy Gateway)"
    # Envoy Gateway made the proxy's Deployment and Service; a kubelet and a
    # load balancer would make them ready and give the Service an address,
    # from which Envoy Gateway derives Programmed. Write those two statuses
    # as they would, then wait as written.
    sel = f"gateway.envoyproxy.io/owning-gateway-namespace={NS},gateway.envoyproxy.io/owning-gateway-name={GATEWAY}"

    def made():
        ds = json.loads(walk.kubectl("get", "deployment", "-n", EG_NS, "-l", sel, "-o", "json").stdout)["items"]
        ss = json.loads(walk.kubectl("get", "service", "-n", EG_NS, "-l", sel, "-o", "json").stdout)["items"]
        return (ds, ss) if ds and ss else None

    (dep,), (svc,) = wait_until("Envoy Gateway's proxy Deployment and Service", made, timeout=60, interval=0.5)
    n = dep["spec"].get("replicas") or 1
    walk.kubectl("patch", "deployment", dep["metadata"]["name"], "-n", EG_NS, "--subresource=status",
                 "--type=merge", "--field-manager", "kubelet-stand-in", "-p", json.dumps({"status": {
                     "observedGeneration": dep["metadata"]["generation"], "replicas": n, "readyReplicas": n,
                     "availableReplicas": n, "updatedReplicas": n}}))
    walk.kubectl("patch", "service", svc["metadata"]["name"], "-n", EG_NS, "--subresource=status",
                 "--type=merge", "--field-manager", "load-balancer-stand-in", "-p",
                 json.dumps({"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}}}))
    walk.as_written(m.string)
    return (f"ran as written, after the status a kubelet and a load balancer would write on Envoy Gateway's "
            f"deployment/{dep['metadata']['name']} and service/{svc['metadata']['name']}")


def route_resolved(walk: Walk, m: re.Match) -> str:
    if walk.eg is not None:
        walk.as_written(m.string)
        return "ran as written"
    route = walk.get("httproute", "inference")
    kinds = {"Service": "service", "Backend": "backend.gateway.envoyproxy.io",
             "InferencePool": "inferencepool.inference.networking.k8s.io"}
    for rule in route["spec"]["rules"]:
        for b in rule.get("backendRefs", []):
            assert walk.get(kinds[b.get("kind", "Service")], b["name"]) is not None, b
    return "substituted: every backendRef of the HTTPRoute names an object that exists"


def eep_accepted(walk: Walk, m: re.Match) -> str:
    if walk.eg is not None:
        walk.as_written(m.string)
        return "ran as written (Envoy Gateway fetched the module through the controller's Service name)"
    prog = wait_until("the controller's Programmed", lambda: (c := cond(walk.get("inferencepolicy",
                                                                                  "pii-stays-inside"),
                                                                         "Programmed")) and c["status"] == "True"
                      and c, timeout=30, interval=0.2)
    assert "Envoy Gateway has not reported" in prog["message"], prog
    return ("substituted: the controller's Programmed=True, saying Envoy Gateway has not reported "
            "(GatewayVerdict::NotReported)")


def patch_programmed(walk: Walk, m: re.Match) -> str:
    if walk.eg is not None:
        walk.as_written(m.string)
        return "ran as written"
    assert walk.get("envoypatchpolicy", "kvasir") is not None
    return "substituted: the EnvoyPatchPolicy exists (only Envoy Gateway programs it)"


@dataclass(frozen=True)
class Substitution:
    """`pattern` (a regular expression matched at the start of a command,
    `.` matching newlines) selects the commands `action` replaces; `why` is
    the reason, reviewed. `action` returns what it did."""

    pattern: str
    why: str
    action: Callable[[Walk, re.Match], str]


SUBSTITUTIONS: tuple[Substitution, ...] = (
    Substitution(
        r"helm install eg oci://docker\.io/envoyproxy/gateway-helm ",
        "no helm, registry or pods here: the chart's CRDs (Gateway API's bundle and Envoy Gateway's, from the Go "
        "module cache of the release the tools are built from) are applied, its namespace created, and its "
        "certgen Job and controller Deployment are run as local processes (the same binary, the chart's "
        "configuration with the command's --set values) against the API server, as its admin (the chart's RBAC "
        "is not applied); the topology-injector webhook is left out (it only acts on Envoy pods)",
        install_envoy_gateway),
    Substitution(
        r"kubectl -n envoy-gateway-system wait --for=condition=Available deployment/envoy-gateway\b",
        "no kubelet runs the chart's Deployment: its local process's readiness probe is waited on instead",
        envoy_gateway_available),
    Substitution(
        r"kubectl apply -f https://github\.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/"
        r"(v[\d.]+)/manifests\.yaml$",
        "no network: the InferencePool CRD vendored in tests/upstream-crds/ is applied instead",
        inference_extension_crds),
    Substitution(
        r"make images ",
        "images are built by `make images` (buildah), outside `make test`, and no registry is reachable: skipped, "
        "and the sandbox's kustomization `images:` is pointed at $REGISTRY/<name>:$TAG as the step says",
        images_built),
    Substitution(
        r"for i in [\w -]+; do.*skopeo copy ",
        "no registry: skipped (the names it pushes are checked against `images:`)",
        images_pushed),
    Substitution(
        r"kubectl -n serving rollout status deployment/([\w-]+) ",
        "no kubelet to run pods: the Deployment is checked to be applied with the images `images:` names; the "
        "controller's container args are run as a local process, as its ServiceAccount, and its readiness "
        "probe waited on",
        rollout),
    Substitution(
        r"kubectl -n serving wait endpointslice .*'kubernetes\.io/service-name in \(([\w,-]+)\)'",
        "no kubelet runs the vLLM pods and no endpoint controller runs: the EndpointSlices it would write for "
        "the ready pods of the Deployments each Service selects are written, then the wait runs as written",
        pool_endpoints),
    Substitution(
        r"kubectl -n serving wait --for=condition=Programmed gateway/inference-gateway ",
        "Envoy Gateway derives Programmed from its proxy Deployment's ready replicas and its Service's address, "
        "which only a kubelet and a load balancer write: their statuses are written as they would, then the "
        "wait runs as written (without Envoy Gateway: the Gateway is checked to exist)",
        gateway_programmed),
    Substitution(
        r"kubectl -n serving wait httproute/inference ",
        "runs as written when Envoy Gateway runs; without it, the route's backendRefs are checked to exist",
        route_resolved),
    Substitution(
        r"kubectl -n serving wait envoyextensionpolicy/kvasir-gateway-inference-gateway .*Accepted",
        "runs as written when Envoy Gateway runs (its module fetch reaches the controller's Service name through "
        "an HTTP proxy standing in for cluster DNS); without it, the controller's own Programmed=True "
        "(Envoy Gateway has not reported) is checked",
        eep_accepted),
    Substitution(
        r"kubectl -n serving wait envoypatchpolicy/kvasir ",
        "runs as written when Envoy Gateway runs; without it, the EnvoyPatchPolicy is checked to exist",
        patch_programmed),
)

# What a command run as written may start with: the sandbox's PATH has
# kubectl, kvasirctl and openssl only, and bash's own `echo` and
# assignments.
RUNNABLE = re.compile(r"(kubectl|kvasirctl|echo)\b|[A-Za-z_]\w*=")


def substitution_for(cmd: str) -> tuple[Substitution, re.Match] | None:
    found = [(s, m) for s in SUBSTITUTIONS if (m := re.match(s.pattern, cmd, re.S))]
    assert len(found) <= 1, f"more than one substitution matches {cmd!r}: {[s.pattern for s, _ in found]}"
    return found[0] if found else None


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_the_block_parses_and_every_command_runs_or_has_a_substitution():
    cmds = walkthrough()
    assert len(cmds) >= 10, cmds
    assert all("\\\n" not in c for c in cmds)
    unhandled = [c for c in cmds if substitution_for(c) is None and not RUNNABLE.match(c)]
    assert not unhandled, ("docs/deploy.md's walk-through has commands that neither run in the sandbox "
                           "(kubectl, kvasirctl, openssl) nor have an entry in SUBSTITUTIONS:\n" + "\n".join(unhandled))
    stale = [s.pattern for s in SUBSTITUTIONS if not any(re.match(s.pattern, c, re.S) for c in cmds)]
    assert not stale, f"SUBSTITUTIONS entries that match no command of the walk-through (stale): {stale}"


def test_the_parser_joins_continuations_and_keeps_compounds():
    text = (f"{SECTION}\n\n```sh\n# a comment\nkubectl apply \\\n  -f x/   # trailing\n\n"
            "for i in a b; do   # loop\n  echo $i\ndone\nTOKEN=\"$(openssl rand -hex 4)\"\n```\n")
    assert walkthrough(text) == ["kubectl apply -f x/   # trailing",
                                 "for i in a b; do   # loop\necho $i\ndone", 'TOKEN="$(openssl rand -hex 4)"']


@pytest.fixture
def walk():
    need(ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, CONTROLLER, KVASIRCTL)
    if shutil.which("openssl") is None:
        pytest.fail("openssl not installed")
    d = Path(tempfile.mkdtemp(prefix="kvasir-walk-"))
    shell = proxy = None
    try:
        with Processes() as procs:
            etcd = procs.add(start_etcd(d))
            api = procs.add(start_apiserver(d, etcd))
            repo, env = make_sandbox(d, api.kubeconfig)
            shell = Shell(repo, env, d / "walkthrough.log")
            proxy = ServiceProxy()
            w = Walk(d, api, repo, shell, procs, proxy, module_file(d))
            if WITHOUT_EG:
                w.eg_absent = "KVASIR_WALKTHROUGH_WITHOUT_EG=1"
            elif not isolation_available():
                w.eg_absent = "no mount and network namespace for it here (needs root and unshare)"
            elif not (ENVOY_GATEWAY_BIN.is_file() and os.access(ENVOY_GATEWAY_BIN, os.X_OK)):
                pytest.fail(f"{ENVOY_GATEWAY_BIN} missing: run `make setup` (scripts/go-tools.sh)")
            yield w
            for cmd, what in w.done:
                print(f"- {cmd.splitlines()[0][:110]}\n    {what}")
    finally:
        if shell is not None:
            shell.stop()
        if proxy is not None:
            proxy.stop()
        if os.environ.get("KVASIR_E2E_KEEP_LOGS") != "1":
            shutil.rmtree(d, ignore_errors=True)


def test_the_walkthrough_against_the_api_server(walk):
    t0 = time.monotonic()
    for cmd in walkthrough():
        found = substitution_for(cmd)
        if found is None:
            assert RUNNABLE.match(cmd), f"no substitution for {cmd!r}, and it cannot run in the sandbox"
            walk.as_written(cmd)
            walk.done.append((cmd, "ran as written"))
        else:
            sub, m = found
            walk.done.append((cmd, sub.action(walk, m)))
    print(f"walk-through done in {time.monotonic() - t0:.1f} s")
    assert_end_state(walk)


def assert_end_state(walk: Walk) -> None:
    # The CRDs, served.
    crds = {c["metadata"]["name"]: c for c in json.loads(walk.kubectl("get", "crd", "-o", "json").stdout)["items"]}
    want = {f"{k}.kvasir.dev" for k in KVASIR_KINDS} | {"inferencepools.inference.networking.k8s.io",
                                                       "gateways.gateway.networking.k8s.io",
                                                       "httproutes.gateway.networking.k8s.io",
                                                       "envoyextensionpolicies.gateway.envoyproxy.io",
                                                       "envoypatchpolicies.gateway.envoyproxy.io",
                                                       "backends.gateway.envoyproxy.io",
                                                       "httproutefilters.gateway.envoyproxy.io"}
    assert want <= crds.keys(), want - crds.keys()
    for n in want:
        assert (cond(crds[n], "Established") or {}).get("status") == "True", n

    # Every object `kubectl apply -k gateway-api/` renders is there.
    rendered = [d for d in yaml.safe_load_all(subprocess.run(
        [KUBECTL, "kustomize", str(walk.repo / "gateway-api")], capture_output=True, text=True, check=True,
        timeout=60).stdout) if d]
    applied = [d for d in rendered
               if (d["metadata"].get("annotations") or {}).get("config.kubernetes.io/local-config") != "true"]
    assert {d["metadata"].get("namespace", NS) for d in applied} == {NS} and len(applied) >= 40
    got = json.loads(walk.kubectl("get", "-f", "-", "-o", "json", input=yaml.safe_dump_all(applied)).stdout)
    names = {(o["kind"], o["metadata"]["name"]) for o in got["items"]}
    assert names == {(d["kind"], d["metadata"]["name"]) for d in applied}
    # The route token the walk-through wrote reached both sides.
    token = (walk.repo / "gateway-api" / "install" / "route-token.env").read_text().strip().split("=", 1)[1]
    assert re.fullmatch(r"[0-9a-f]{48}", token)
    pool = walk.get("inferencepool", "main")
    assert pool["metadata"]["annotations"]["kvasir.dev/cluster"].endswith(f"/{token}")
    assert token in json.dumps(walk.get("httproute", "inference")["spec"])

    # The controller's EnvoyExtensionPolicy and its verdicts.
    eep = json.loads(walk.kubectl("get", "envoyextensionpolicy", EEP, "-n", NS, "-o", "json",
                                  "--show-managed-fields").stdout)
    assert eep["metadata"]["labels"].get("app.kubernetes.io/managed-by") == "kvasir-controller"
    assert {m["manager"] for m in eep["metadata"]["managedFields"] if m.get("subresource") != "status"} \
        == {"kvasir-controller"}
    (wasm,) = eep["spec"]["wasm"]
    assert wasm["failOpen"] is False
    sha = hashlib.sha256(walk.wasm.read_bytes()).hexdigest()
    assert wasm["code"]["http"]["sha256"] == sha
    assert wasm["code"]["http"]["url"] == \
        f"http://kvasir-controller.{NS}.svc.cluster.local:8080/kvasir_filter-{sha}.wasm"
    assert token in json.dumps(wasm["config"])
    verdict = "accepted by Envoy Gateway" if walk.eg else "Envoy Gateway has not reported"
    for kind in KVASIR_KINDS:
        items = json.loads(walk.kubectl("get", kind, "-n", NS, "-o", "json").stdout)["items"]
        assert items, kind
        for o in items:
            c = conditions(o)
            assert all(c.get(t, {}).get("status") == "True" for t in ("Accepted", "ResolvedRefs", "Programmed")), \
                (kind, o["metadata"]["name"], c)
            assert verdict in c["Programmed"]["message"], (kind, o["metadata"]["name"], c["Programmed"])
    if walk.eg:
        a = cond(eep, "Accepted", "ancestors")
        assert a and a["status"] == "True" and a["observedGeneration"] == eep["metadata"]["generation"], eep["status"]
        assert any(f"kvasir_filter-{sha}.wasm 200" in s for s in walk.proxy.served), walk.proxy.served
        assert not walk.proxy.refused, walk.proxy.refused
        p = cond(walk.get("envoypatchpolicy", "kvasir"), "Programmed", "ancestors")
        assert p and p["status"] == "True", p

    # The indexer's pools, written, and the indexer rolled for them.
    cm = walk.get("configmap", "kvasir-indexer-pools")
    assert cm is not None
    text = json.dumps(cm["data"])
    assert "main" in text and "small" in text, cm["data"]
    ann = walk.get("deployment", "kvasir-indexer")["spec"]["template"]["metadata"].get("annotations") or {}
    assert "kvasir.dev/pools-sha256" in ann, ann
    log = walk.controller.log()
    assert "forbidden" not in log.lower(), log[-4000:]
