"""The `kvasir-controller` binary, as deployed, against a real
kube-apiserver v1.36 on a real etcd (both built from Go modules, started on
127.0.0.1 by the harness): the CRDs are installed and the server enforces
their schemas and CEL rules, and every write the controller makes goes
through the server's own server-side apply, field ownership, status
subresource, finalizers, watches and Lease.

No Envoy Gateway runs against this API server: where a test needs Envoy
Gateway's verdict on a policy, it writes `status.ancestors` on the
EnvoyExtensionPolicy through the status subresource, as Envoy Gateway
does. The upstream CRDs (Gateway, HTTPRoute, EnvoyExtensionPolicy,
InferencePool) come from tests/upstream-crds/, vendored from
../shared/upstream-crds/ with their schema descriptions removed
(tests/upstream-crds/README.md).

Each test works in a namespace of its own with a Lease of its own, so the
tests share one API server (about 4 s to start) and stay independent.
Fault injection the real server cannot produce on demand (a 500, a stale
resourceVersion) is in controller/tests/it/mock_api.rs.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvasir_harness import WASM, Proc, Processes, free_port, request, wait_until
from kvasir_harness.examples import example_docs
from kvasir_harness.kube import (ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, ApiServer, missing, start_apiserver,
                                 start_etcd, write_kubeconfig)
from kvasir_harness.procs import Exited

REPO = Path(__file__).resolve().parents[2]
# Overridable, to run these tests against another build of the binaries.
CONTROLLER = Path(os.environ.get("KVASIR_CONTROLLER_BIN", REPO / "target" / "release" / "kvasir-controller"))
KVASIRCTL = Path(os.environ.get("KVASIRCTL_BIN", REPO / "target" / "release" / "kvasirctl"))
UPSTREAM = REPO / "tests" / "upstream-crds"
SHARED_UPSTREAM = REPO.parent / "shared" / "upstream-crds"
WASM_URL = "http://kvasir-controller.kvasir-system.svc.cluster.local:8080/kvasir_filter-{sha256}.wasm"
EG_CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"
KVASIR_KINDS = ("inferencepolicies", "inferencesettings", "inferencetenants", "inferenceproviders")
GATEWAY = "inference-gateway"
EEP = f"kvasir-gateway-{GATEWAY}"

# Every wait below has its own deadline. The controller reacts to watch
# events within its 200 ms debounce; PROMPT is what "promptly" means here
# (the periodic resync is 300 s, so anything under it proves the watch).
PROMPT = 10.0


def need(*bins) -> None:
    if m := missing(*bins):
        pytest.fail(f"missing {', '.join(map(str, m))}: run `make setup` (scripts/go-tools.sh) and `make build`")


# The API server
# ---------------------------------------------------------------------------


@dataclass
class Cluster:
    api: ApiServer
    etcd: Any
    dir: Path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60.0) -> subprocess.CompletedProcess:
        return self.api.kubectl(*args, input=input, check=check, timeout=timeout)

    def get(self, kind: str, name: str, ns: str) -> dict | None:
        r = self.kubectl("get", kind, name, "-n", ns, "-o", "json", "--show-managed-fields", check=False)
        if r.returncode != 0:
            if "NotFound" in r.stderr:
                return None
            raise RuntimeError(r.stderr)
        return json.loads(r.stdout)

    def apply(self, docs: list[dict], manager: str = "kvasir-tests", force: bool = False) -> None:
        text = yaml.safe_dump_all(docs)
        args = ["apply", "--server-side", "--field-manager", manager, "-f", "-"]
        if force:
            args.append("--force-conflicts")
        self.kubectl(*args, input=text)

    def restart_apiserver(self) -> None:
        """Stops kube-apiserver and starts it again on the same port, with
        the same certificates and token, against the same etcd: what a
        client sees when the control plane restarts."""
        argv = self.api.proc.argv
        self.api.proc.stop()
        self.api.proc = Proc("kube-apiserver-restarted", argv, self.dir)

        def ready() -> bool:
            if not self.api.proc.alive():
                raise Exited(f"kube-apiserver exited: {self.api.proc.log()[-3000:]}")
            return self.api.get("/readyz", timeout=2)[0] == 200

        wait_until("kube-apiserver /readyz after the restart", ready, timeout=90, interval=0.2)


def crd_names(*files: Path) -> list[str]:
    names = []
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                names.append(doc["metadata"]["name"])
    return names


@pytest.fixture(scope="module")
def cluster():
    need(ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, CONTROLLER, KVASIRCTL)
    d = Path(tempfile.mkdtemp(prefix="kvasir-ctl-"))
    try:
        with Processes() as procs:
            etcd = procs.add(start_etcd(d))
            api = procs.add(start_apiserver(d, etcd))
            c = Cluster(api, etcd, d)
            files = sorted(UPSTREAM.glob("*.yaml")) + sorted((REPO / "crds").glob("*.yaml"))
            args = ["apply", "--server-side", "--field-manager", "kvasir-tests"]
            for f in files:
                args += ["-f", str(f)]
            c.kubectl(*args, timeout=90)
            c.kubectl("wait", "--for", "condition=Established", "--timeout", "60s",
                      *[f"crd/{n}" for n in crd_names(*files)], timeout=75)
            c.kubectl("create", "namespace", "kvasir-system")
            yield c
    finally:
        shutil.rmtree(d, ignore_errors=True)


# The objects
# ---------------------------------------------------------------------------


def examples(ns: str) -> list[dict]:
    """crds/examples/ (settings, tenants and their key Secrets, pools, the
    provider, the four policies) in namespace `ns`."""
    return example_docs(ns)


def gateway(ns: str, name: str = GATEWAY) -> dict:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"gatewayClassName": "eg", "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}]}}


def httproute(ns: str, gw: str = GATEWAY) -> dict:
    """An HTTPRoute with a rule per destination of the examples."""
    def rule(value: str, backend: dict) -> dict:
        return {"matches": [{"path": {"type": "Exact", "value": "/v1/chat/completions"}, "method": "POST",
                             "headers": [{"type": "Exact", "name": "x-kvasir-cluster", "value": value}]}],
                "backendRefs": [backend]}
    pool = lambda n: {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": n}  # noqa: E731
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "inference", "namespace": ns},
            "spec": {"parentRefs": [{"name": gw}], "rules": [
                rule(f"kvasir/{ns}/pool/main", pool("main")),
                rule(f"kvasir/{ns}/pool/small", pool("small")),
                rule(f"kvasir/{ns}/provider/openai",
                     {"group": "gateway.envoyproxy.io", "kind": "Backend", "name": "openai"}),
            ]}}


def setup_namespace(c: Cluster, ns: str, with_gateway: bool = True) -> list[dict]:
    c.kubectl("create", "namespace", ns)
    docs = examples(ns)
    extra = [gateway(ns), httproute(ns)] if with_gateway else []
    c.apply(docs + extra)
    return docs + extra


def conditions(obj: dict | None) -> dict[str, dict]:
    return {x["type"]: x for x in ((obj or {}).get("status") or {}).get("conditions", [])}


def condition(c: Cluster, kind: str, name: str, ns: str, t: str) -> dict | None:
    return conditions(c.get(kind, name, ns)).get(t)


def wait_condition(c: Cluster, kind: str, name: str, ns: str, t: str, status: str, reason: str | None = None,
                   timeout: float = PROMPT) -> dict:
    def ok():
        got = condition(c, kind, name, ns, t)
        if got and got["status"] == status and (reason is None or got["reason"] == reason):
            return got
        return None

    return wait_until(f"{kind}/{name} {t}={status} {reason or ''}", ok, timeout=timeout, interval=0.1)


# The controller
# ---------------------------------------------------------------------------


def module_file(dir: Path) -> Path:
    """The built filter when there is one, else a stand-in module (the
    controller only hashes and serves the bytes)."""
    if WASM.exists():
        return WASM
    p = dir / "stand-in.wasm"
    p.write_bytes(b"\0asm\x01\0\0\0" + os.urandom(64))
    return p


@dataclass
class Controller:
    proc: Proc
    http: int
    metrics: int
    identity: str

    def metric(self, line_prefix: str) -> float | None:
        status, _, body = request("GET", self.metrics, "/metrics", timeout=5)
        assert status == 200
        for line in body.decode().splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.split()[-1])
        return None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.stop(sig)


def start_controller(c: Cluster, ns: str, identity: str, lease: str, wasm: Path, kubeconfig: Path | None = None,
                     lease_ns: str = "kvasir-system", extra: tuple[str, ...] = ("--indexer-deployment", "")) -> Controller:
    """The controller binary serving `ns` (by default as the cluster's admin,
    without an indexer Deployment to roll)."""
    http, metrics = free_port(), free_port()
    argv = [str(CONTROLLER), "--http-addr", f"127.0.0.1:{http}", "--metrics-addr", f"127.0.0.1:{metrics}",
            "--wasm-file", str(wasm), "--wasm-url", WASM_URL, "--namespace", ns,
            "--lease-namespace", lease_ns, "--lease-name", lease, "--identity", identity, *extra]
    proc = Proc(f"controller-{ns}-{identity}", argv, c.dir,
                env={"KUBECONFIG": str(kubeconfig or c.api.kubeconfig), "RUST_LOG": "info,kube=warn"})
    ctl = Controller(proc, http, metrics, identity)

    def ready():
        if not proc.alive():
            raise Exited(f"controller exited: {proc.log()[-3000:]}")
        return request("GET", http, "/readyz", timeout=2)[0] == 200

    try:
        wait_until(f"controller {identity} /readyz", ready, timeout=30, interval=0.1)
    except BaseException:
        print(proc.log()[-4000:])
        proc.stop()
        raise
    return ctl


@pytest.fixture
def controllers(cluster):
    """Starts controllers for a test and stops (and prints the log of) each."""
    started: list[Controller] = []
    d = Path(tempfile.mkdtemp(prefix="kvasir-ctl-wasm-"))
    wasm = module_file(d)

    def start(ns: str, identity: str = "a", lease: str | None = None, **kw) -> Controller:
        ctl = start_controller(cluster, ns, identity, lease or f"kvasir-{ns}", wasm, **kw)
        started.append(ctl)
        return ctl

    start.wasm = wasm
    yield start
    for ctl in started:
        ctl.stop()
        if os.environ.get("KVASIR_E2E_KEEP_LOGS"):
            print(ctl.proc.log()[-6000:])
    shutil.rmtree(d, ignore_errors=True)


def kvasirctl_policy(docs: list[dict], ns: str, wasm: Path, tmp: Path) -> dict:
    """What `kvasirctl compile --output envoyextensionpolicy` prints for the
    same documents and module."""
    f = tmp / f"{ns}.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    r = subprocess.run([str(KVASIRCTL), "compile", str(f), "--namespace", ns, "--target", f"Gateway/{GATEWAY}",
                        "--output", "envoyextensionpolicy", "--wasm-url", WASM_URL, "--wasm-file", str(wasm)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_eep(c: Cluster, ns: str, name: str = EEP, present: bool = True, timeout: float = PROMPT) -> dict | None:
    if present:
        return wait_until(f"EnvoyExtensionPolicy {ns}/{name}", lambda: c.get("eep", name, ns), timeout=timeout,
                          interval=0.1)
    wait_until(f"EnvoyExtensionPolicy {ns}/{name} gone", lambda: c.get("eep", name, ns) is None, timeout=timeout,
               interval=0.1)
    return None


def settle(c: Cluster, ns: str, quiet: float = 1.0) -> None:
    """Until no kvasir.dev object and no EnvoyExtensionPolicy of `ns`
    changes for `quiet` seconds: the controller has finished reacting, so
    what happens next is a reaction to what the test does next."""
    def versions():
        out = {}
        for kind in (*KVASIR_KINDS, "eep"):
            for o in json.loads(c.kubectl("get", kind, "-n", ns, "-o", "json").stdout)["items"]:
                out[(kind, o["metadata"]["name"])] = o["metadata"]["resourceVersion"]
        return out

    def settled():
        a = versions()
        time.sleep(quiet)
        return a == versions()

    wait_until(f"{ns} settled", settled, timeout=3 * PROMPT, interval=0)


def eg_status(c: Cluster, ns: str, accepted: bool, reason: str, message: str, name: str = EEP) -> None:
    """Writes `status.ancestors` on the EnvoyExtensionPolicy as Envoy
    Gateway does (the status subresource, its controllerName, the
    generation it read)."""
    eep = c.get("eep", name, ns)
    gen = eep["metadata"]["generation"]
    status = {"status": {"ancestors": [{
        "ancestorRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": ns, "name": GATEWAY},
        "controllerName": EG_CONTROLLER,
        "conditions": [{"type": "Accepted", "status": "True" if accepted else "False", "reason": reason,
                        "message": message, "observedGeneration": gen,
                        "lastTransitionTime": "2026-12-07T00:00:00Z"}]}]}}
    c.kubectl("patch", "eep", name, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(status),
              "--field-manager", "envoy-gateway")


# ---------------------------------------------------------------------------
# CRDs
# ---------------------------------------------------------------------------


TWO_ACTIONS = """
apiVersion: kvasir.dev/v1alpha1
kind: InferencePolicy
metadata: {name: two-actions, namespace: default}
spec:
  precedence: 10
  targetRefs: [{kind: Gateway, name: inference-gateway}]
  action: {route: {pool: main}, shed: {retryAfterS: 5}}
"""


def test_crds_install_and_the_server_enforces_their_rules(cluster):
    c = cluster
    names = set(c.kubectl("api-resources", "--api-group", "kvasir.dev", "-o", "name").stdout.split())
    assert {f"{k}.kvasir.dev" for k in KVASIR_KINDS} <= names
    # The kinds that attach through targetRefs carry Gateway API's policy label.
    for kind, label in [("inferencepolicies", "Direct"), ("inferencesettings", "Direct"),
                        ("inferencetenants", None), ("inferenceproviders", None)]:
        crd = json.loads(c.kubectl("get", "crd", f"{kind}.kvasir.dev", "-o", "json").stdout)
        assert (crd["metadata"].get("labels") or {}).get("gateway.networking.k8s.io/policy") == label, kind
    # CEL: one action only; names that are stats labels.
    r = c.kubectl("apply", "--server-side", "-f", "-", input=TWO_ACTIONS, check=False)
    assert r.returncode != 0 and "set exactly one of `route`, `reject`, `provider`, `shed`" in r.stderr, r.stderr
    long_name = TWO_ACTIONS.replace("two-actions", "x" * 64).replace("    shed: {retryAfterS: 5}\n", "") \
        .replace(", shed: {retryAfterS: 5}", "")
    r = c.kubectl("apply", "--server-side", "-f", "-", input=long_name, check=False)
    assert r.returncode != 0 and "DNS-1123 label" in r.stderr, r.stderr
    # The status schema: an ancestor entry needs its conditions.
    ok = TWO_ACTIONS.replace(", shed: {retryAfterS: 5}", "")
    c.kubectl("apply", "--server-side", "-f", "-", input=ok)
    bad = {"status": {"ancestors": [{"ancestorRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                                     "name": "g"}, "controllerName": "kvasir.dev/controller",
                                     "conditions": []}]}}
    r = c.kubectl("patch", "inferencepolicy", "two-actions", "-n", "default", "--subresource=status",
                  "--type=merge", "-p", json.dumps(bad), check=False)
    assert r.returncode != 0 and "conditions" in r.stderr, r.stderr
    c.kubectl("delete", "inferencepolicy", "two-actions", "-n", "default")


def test_vendored_upstream_crds_match_shared():
    """tests/upstream-crds/ is what its vendor.py makes of
    ../shared/upstream-crds/ (checked where that folder is present)."""
    if not SHARED_UPSTREAM.is_dir():
        pytest.skip(f"{SHARED_UPSTREAM} is not here")
    import importlib.util
    spec = importlib.util.spec_from_file_location("vendor", UPSTREAM / "vendor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, text in mod.render(SHARED_UPSTREAM).items():
        assert (UPSTREAM / name).read_text() == text, f"{name}: run tests/upstream-crds/vendor.py"


# ---------------------------------------------------------------------------
# The controller
# ---------------------------------------------------------------------------


INDEXER_DEPLOYMENT = {
    "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "kvasir-indexer"},
    "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "kvasir-indexer"}},
             "template": {"metadata": {"labels": {"app": "kvasir-indexer"}},
                          "spec": {"containers": [{"name": "indexer", "image": "cache-indexer:dev"}]}}},
}


def test_the_controller_applies_the_policy_server_side_and_reports_status(cluster, controllers, tmp_path):
    c, ns = cluster, "t-apply"
    docs = setup_namespace(c, ns)
    # The indexer's Deployment (stored only: no controller-manager runs
    # it), so the roll on a pools change is a real patch of a real object.
    dep = copy.deepcopy(INDEXER_DEPLOYMENT)
    dep["metadata"]["namespace"] = ns
    c.apply([dep])
    t0 = time.monotonic()
    ctl = controllers(ns, extra=("--indexer-deployment", "kvasir-indexer"))
    eep = wait_eep(c, ns)
    programmed = wait_condition(c, "inferencepolicy", "burst-to-provider", ns, "Programmed", "True")
    print(f"programmed {time.monotonic() - t0:.2f} s after the controller started")

    # Exactly what kvasirctl prints for the same documents and module.
    want = kvasirctl_policy(docs, ns, controllers.wasm, tmp_path)
    assert eep["spec"] == want["spec"]
    assert eep["metadata"]["labels"] == want["metadata"]["labels"]
    assert eep["metadata"]["annotations"] == want["metadata"]["annotations"]
    sha = eep["spec"]["wasm"][0]["code"]["http"]["sha256"]
    assert eep["spec"]["wasm"][0]["code"]["http"]["url"].endswith(f"/kvasir_filter-{sha}.wasm")
    # Server-side apply, field manager kvasir-controller, owning spec.wasm.
    managers = {m["manager"]: m for m in eep["metadata"]["managedFields"]}
    assert managers["kvasir-controller"]["operation"] == "Apply", managers
    assert "f:wasm" in json.dumps(managers["kvasir-controller"]["fieldsV1"]["f:spec"])
    assert set(managers) == {"kvasir-controller"}, set(managers)
    # The module is served at the URL's path, content addressed.
    status, headers, body = request("GET", ctl.http, f"/kvasir_filter-{sha}.wasm", timeout=5)
    assert status == 200 and body == controllers.wasm.read_bytes()
    assert request("GET", ctl.http, "/kvasir_filter.wasm", timeout=5)[0] == 200
    # Another module's digest: a 503 Envoy Gateway retries on a new
    # connection (another replica may hold it), never these bytes.
    status, headers, _ = request("GET", ctl.http, f"/kvasir_filter-{'0' * 64}.wasm", timeout=5)
    assert (status, headers.get("connection")) == (503, "close")

    # Finalizers on every kvasir.dev object; status through the subresource.
    for kind in KVASIR_KINDS:
        items = json.loads(c.kubectl("get", kind, "-n", ns, "-o", "json").stdout)["items"]
        assert items, kind
        for o in items:
            assert "kvasir.dev/controller" in o["metadata"].get("finalizers", []), o["metadata"]["name"]
            wait_condition(c, kind, o["metadata"]["name"], ns, "Programmed", "True")
            got = conditions(c.get(kind, o["metadata"]["name"], ns))
            assert {t: got[t]["status"] for t in ("Accepted", "ResolvedRefs", "Programmed")} == \
                {"Accepted": "True", "ResolvedRefs": "True", "Programmed": "True"}, got
    assert eep["metadata"]["annotations"]["kvasir.dev/config-sha256"] in programmed["message"]
    # Gateway API policy status on the kinds that attach: one ancestor, the
    # target, in this namespace.
    pol = c.get("inferencepolicy", "burst-to-provider", ns)
    (anc,) = pol["status"]["ancestors"]
    assert anc["ancestorRef"] == {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": ns,
                                  "name": GATEWAY}
    assert anc["controllerName"] == "kvasir.dev/controller"
    assert {x["type"]: x["status"] for x in anc["conditions"]} == {"Accepted": "True", "Programmed": "True"}
    assert "ancestors" not in c.get("inferencetenant", "acme", ns)["status"]
    # The status is written by the controller's manager, on the subresource.
    status_managers = [m for m in pol["metadata"]["managedFields"] if m.get("subresource") == "status"]
    assert status_managers and all(m["manager"] == "kvasir-controller" for m in status_managers), status_managers
    # The indexer's pools, applied beside it, and the indexer rolled: the
    # pod template's annotation is the pools file's hash, written by a
    # merge patch of that one field.
    cm = c.get("configmap", "kvasir-indexer-pools", ns)
    assert "inferencePool: main" in cm["data"]["pools.yaml"]
    rolled = c.get("deployment", "kvasir-indexer", ns)
    ann = rolled["spec"]["template"]["metadata"].get("annotations", {}).get("kvasir.dev/pools-sha256", "")
    assert ann.startswith("sha256:"), rolled["spec"]["template"]["metadata"]
    assert rolled["spec"]["replicas"] == 2 and rolled["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "cache-indexer:dev"
    assert any(m["manager"] == "kvasir-controller" and m["operation"] == "Update"
               for m in rolled["metadata"]["managedFields"])
    # Leader: the Lease and the metric.
    lease = c.get("lease", f"kvasir-{ns}", "kvasir-system")
    assert lease["spec"]["holderIdentity"] == "a"
    assert ctl.metric("kvasir_controller_leader") == 1
    assert ctl.metric('kvasir_controller_reconciles_total{result="ok"}') >= 1

    # Settled: a quiet second later no kvasir.dev object or policy changes
    # (no status rewritten every reconcile, no apply that is not a no-op).
    settle(c, ns)
    # A pools change (an InferencePool's annotation) rolls the indexer again.
    c.kubectl("annotate", "inferencepool", "small", "-n", ns, "kvasir.dev/block-size=32")

    def rolled_again():
        d = c.get("deployment", "kvasir-indexer", ns)
        return d["spec"]["template"]["metadata"]["annotations"]["kvasir.dev/pools-sha256"] != ann

    wait_until("the indexer rolled on a pools change", rolled_again, timeout=PROMPT, interval=0.1)
    assert "blockSize: 32" in c.get("configmap", "kvasir-indexer-pools", ns)["data"]["pools.yaml"]


def test_a_deleted_policy_is_recreated_at_once(cluster, controllers):
    c, ns = cluster, "t-recreate"
    setup_namespace(c, ns)
    controllers(ns)
    first = wait_eep(c, ns)
    settle(c, ns)
    c.kubectl("delete", "eep", EEP, "-n", ns)
    t0 = time.monotonic()
    again = wait_until("EnvoyExtensionPolicy recreated",
                       lambda: (e := c.get("eep", EEP, ns)) and e["metadata"]["uid"] != first["metadata"]["uid"] and e,
                       timeout=PROMPT, interval=0.05)
    took = time.monotonic() - t0
    print(f"recreated in {took:.2f} s")
    assert took < PROMPT
    assert again["spec"] == first["spec"]


TYPO_SETTINGS = {
    "apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceSettings",
    "metadata": {"name": "typo"},
    "spec": {"targetRefs": [{"kind": "Gateway", "name": "inference-gatewy"}],
             "tenantSource": {"apiKey": {}}, "defaultAction": {"route": {"pool": "main"}}},
}


def test_a_misspelt_target_is_reported_and_nothing_is_applied_for_it(cluster, controllers):
    c, ns = cluster, "t-typo"
    setup_namespace(c, ns)
    controllers(ns)
    wait_eep(c, ns)
    typo = copy.deepcopy(TYPO_SETTINGS)
    typo["metadata"]["namespace"] = ns
    c.apply([typo])
    prog = wait_condition(c, "inferencesettings", "typo", ns, "Programmed", "False", "TargetNotFound")
    assert "Gateway/inference-gatewy does not exist" in prog["message"], prog
    refs = condition(c, "inferencesettings", "typo", ns, "ResolvedRefs")
    assert (refs["status"], refs["reason"]) == ("False", "TargetNotFound"), refs
    (anc,) = c.get("inferencesettings", "typo", ns)["status"]["ancestors"]
    acc = {x["type"]: x for x in anc["conditions"]}["Accepted"]
    assert (acc["status"], acc["reason"]) == ("False", "TargetNotFound")
    assert c.get("eep", "kvasir-gateway-inference-gatewy", ns) is None
    # The others are not held back by it (a tenant serves every target).
    assert condition(c, "inferencetenant", "acme", ns, "Programmed")["status"] == "True"
    assert condition(c, "inferencepolicy", "burst-to-provider", ns, "Programmed")["status"] == "True"
    # The Gateway appears: the Gateway watch programs it without a resync.
    c.apply([gateway(ns, "inference-gatewy")])
    wait_condition(c, "inferencesettings", "typo", ns, "Programmed", "True")
    wait_eep(c, ns, "kvasir-gateway-inference-gatewy")
    # And goes away: its policy goes with it.
    c.kubectl("delete", "gateway", "inference-gatewy", "-n", ns)
    wait_eep(c, ns, "kvasir-gateway-inference-gatewy", present=False)
    wait_condition(c, "inferencesettings", "typo", ns, "Programmed", "False", "TargetNotFound")


def test_a_long_target_name_is_programmed(cluster, controllers):
    c, ns = cluster, "t-long"
    setup_namespace(c, ns)
    controllers(ns)
    wait_eep(c, ns)
    name = "a-gateway-whose-name-is-longer-than-a-label-value-may-be-" + "x" * 40
    s = copy.deepcopy(TYPO_SETTINGS)
    s["metadata"] = {"name": "long", "namespace": ns}
    s["spec"]["targetRefs"][0]["name"] = name
    c.apply([gateway(ns, name), s])
    wait_condition(c, "inferencesettings", "long", ns, "Programmed", "True")
    eep = wait_eep(c, ns, f"kvasir-gateway-{name}")
    label = eep["metadata"]["labels"]["kvasir.dev/target-name"]
    assert len(label) <= 63 and label != name[:63], label
    assert eep["spec"]["targetRefs"][0]["name"] == name
    # Found again by what it targets: deleting the settings deletes it.
    c.kubectl("delete", "inferencesettings", "long", "-n", ns)
    wait_eep(c, ns, f"kvasir-gateway-{name}", present=False)


def test_envoy_gateways_verdict_is_read_back(cluster, controllers):
    c, ns = cluster, "t-verdict"
    setup_namespace(c, ns)
    controllers(ns)
    wait_eep(c, ns)
    prog = wait_condition(c, "inferencepolicy", "pii-stays-inside", ns, "Programmed", "True")
    assert "Envoy Gateway has not reported" in prog["message"], prog
    settle(c, ns)
    msg = "Unable to target Gateway inference-gateway, another EnvoyExtensionPolicy has already attached to it"
    eg_status(c, ns, accepted=False, reason="Conflicted", message=msg)
    prog = wait_condition(c, "inferencepolicy", "pii-stays-inside", ns, "Programmed", "False", "NotAccepted")
    assert "Conflicted" in prog["message"] and msg in prog["message"], prog
    (anc,) = c.get("inferencepolicy", "pii-stays-inside", ns)["status"]["ancestors"]
    p = {x["type"]: x for x in anc["conditions"]}["Programmed"]
    assert (p["status"], p["reason"]) == ("False", "NotAccepted")
    wait_condition(c, "inferencetenant", "acme", ns, "Programmed", "False", "NotAccepted")
    eg_status(c, ns, accepted=True, reason="Accepted", message="Policy has been accepted.")
    prog = wait_condition(c, "inferencepolicy", "pii-stays-inside", ns, "Programmed", "True")
    assert "accepted by Envoy Gateway" in prog["message"], prog


def test_a_conflicting_field_manager_is_reported_not_forced(cluster, controllers):
    c, ns = cluster, "t-conflict"
    setup_namespace(c, ns)
    controllers(ns)
    eep = wait_eep(c, ns)
    settle(c, ns)
    # Someone applies their own copy of the filter list (failOpen: true).
    theirs = {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyExtensionPolicy",
              "metadata": {"name": EEP, "namespace": ns},
              "spec": {"wasm": [dict(eep["spec"]["wasm"][0], failOpen=True)]}}
    c.apply([theirs], manager="someone-else", force=True)
    prog = wait_condition(c, "inferencepolicy", "burst-to-provider", ns, "Programmed", "False", "Conflicted")
    assert "someone-else" in prog["message"], prog
    # Not forced: their value stays once the controller has done all it does.
    settle(c, ns)
    assert c.get("eep", EEP, ns)["spec"]["wasm"][0]["failOpen"] is True
    # The documented way out: delete it; the controller recreates its own.
    c.kubectl("delete", "eep", EEP, "-n", ns)
    wait_condition(c, "inferencepolicy", "burst-to-provider", ns, "Programmed", "True")
    again = wait_eep(c, ns)
    assert again["spec"]["wasm"][0]["failOpen"] is False
    assert {m["manager"] for m in again["metadata"]["managedFields"]} == {"kvasir-controller"}


def test_finalizers_hold_a_deleted_object_until_the_config_drops_it(cluster, controllers):
    c, ns = cluster, "t-finalizer"
    setup_namespace(c, ns)
    controllers(ns)
    wait_eep(c, ns)
    wait_condition(c, "inferenceprovider", "openai", ns, "Programmed", "True")
    # The provider is still named by burst-to-provider: without it the
    # target does not compile, so the last good policy (holding the
    # provider) stays in force, and so does the provider's finalizer.
    c.kubectl("delete", "inferenceprovider", "openai", "-n", ns, "--wait=false")
    wait_condition(c, "inferencepolicy", "burst-to-provider", ns, "ResolvedRefs", "False", "ProviderNotFound")
    held = c.get("inferenceprovider", "openai", ns)
    assert held["metadata"].get("deletionTimestamp") and "kvasir.dev/controller" in held["metadata"]["finalizers"]
    assert "provider/openai" in json.dumps(c.get("eep", EEP, ns)["spec"])
    # Remove the policy that names it: both go, and the config is without them.
    c.kubectl("delete", "inferencepolicy", "burst-to-provider", "-n", ns, "--wait=false")
    wait_until("the provider and the policy deleted",
               lambda: c.get("inferenceprovider", "openai", ns) is None
               and c.get("inferencepolicy", "burst-to-provider", ns) is None, timeout=PROMPT, interval=0.1)
    spec = json.dumps(c.get("eep", EEP, ns)["spec"])
    assert "burst-to-provider" not in spec and "provider/openai" not in spec
    wait_condition(c, "inferencepolicy", "pii-stays-inside", ns, "Programmed", "True")


def test_a_missing_secret_then_created(cluster, controllers):
    c, ns = cluster, "t-secret"
    c.kubectl("create", "namespace", ns)
    docs = [d for d in examples(ns) if not (d["kind"] == "Secret" and d["metadata"]["name"] == "acme-api-keys")]
    c.apply(docs + [gateway(ns), httproute(ns)])
    controllers(ns)
    refs = wait_condition(c, "inferencetenant", "acme", ns, "ResolvedRefs", "False", "SecretNotFound")
    assert "acme-api-keys" in refs["message"]
    assert c.get("eep", EEP, ns) is None
    secret = next(d for d in examples(ns) if d["kind"] == "Secret" and d["metadata"]["name"] == "acme-api-keys")
    c.apply([secret])
    wait_condition(c, "inferencetenant", "acme", ns, "Programmed", "True")
    wait_eep(c, ns)


def test_leader_election_hands_over_on_sigterm(cluster, controllers):
    c, ns = cluster, "t-leader"
    setup_namespace(c, ns)
    a = controllers(ns, "a", lease="kvasir-leader")
    wait_eep(c, ns)
    b = controllers(ns, "b", lease="kvasir-leader")
    lease = c.get("lease", "kvasir-leader", "kvasir-system")
    assert lease["spec"]["holderIdentity"] == "a"
    assert a.metric("kvasir_controller_leader") == 1 and b.metric("kvasir_controller_leader") == 0
    transitions = lease["spec"].get("leaseTransitions", 0)
    t0 = time.monotonic()
    a.stop()
    wait_until("b holds the Lease",
               lambda: c.get("lease", "kvasir-leader", "kvasir-system")["spec"].get("holderIdentity") == "b",
               timeout=PROMPT, interval=0.1)
    print(f"handed over in {time.monotonic() - t0:.2f} s")
    assert c.get("lease", "kvasir-leader", "kvasir-system")["spec"]["leaseTransitions"] == transitions + 1
    wait_until("b's leader metric", lambda: b.metric("kvasir_controller_leader") == 1, timeout=PROMPT, interval=0.1)
    # The new leader writes: an edit is applied by b.
    c.kubectl("patch", "inferencepolicy", "burst-to-provider", "-n", ns, "--type=merge",
              "-p", json.dumps({"spec": {"precedence": 310}}))
    wait_until("b applied the edit",
               lambda: '"burst-to-provider"' in json.dumps(c.get("eep", EEP, ns)["spec"])
               and any(p.get("name") == "burst-to-provider"
                       for p in c.get("eep", EEP, ns)["spec"]["wasm"][0]["config"]["policies"])
               and condition(c, "inferencepolicy", "burst-to-provider", ns, "Programmed")["observedGeneration"] == 2,
               timeout=PROMPT, interval=0.1)


def test_watches_resume_after_an_apiserver_restart(cluster, controllers):
    c, ns = cluster, "t-restart"
    setup_namespace(c, ns)
    ctl = controllers(ns)
    first = wait_eep(c, ns)
    t0 = time.monotonic()
    c.restart_apiserver()
    print(f"kube-apiserver back in {time.monotonic() - t0:.2f} s")
    assert ctl.proc.alive(), ctl.proc.log()[-3000:]
    # Once the watches have relisted (and what that triggered is done), an
    # event after the restart reaches the controller: the policy is
    # recreated promptly, and an edit is applied.
    settle(c, ns)
    c.kubectl("delete", "eep", EEP, "-n", ns)
    t1 = time.monotonic()
    wait_until("EnvoyExtensionPolicy recreated after the restart",
               lambda: (e := c.get("eep", EEP, ns)) and e["metadata"]["uid"] != first["metadata"]["uid"],
               timeout=30, interval=0.1)
    print(f"recreated {time.monotonic() - t1:.2f} s after the delete")
    c.kubectl("patch", "inferencepolicy", "pii-stays-inside", "-n", ns, "--type=merge",
              "-p", json.dumps({"spec": {"precedence": 11}}))
    wait_until("the edit applied",
               lambda: (condition(c, "inferencepolicy", "pii-stays-inside", ns, "Programmed") or {})
               .get("observedGeneration") == 2, timeout=30, interval=0.1)
    assert ctl.proc.alive()
    assert re.search(r"kvasir_controller_leader 1", request("GET", ctl.metrics, "/metrics")[2].decode())


def test_an_invalid_edit_keeps_the_last_good_policy(cluster, controllers):
    c, ns = cluster, "t-invalid"
    setup_namespace(c, ns)
    controllers(ns)
    good = wait_eep(c, ns)
    wait_condition(c, "inferencepolicy", "cheaper-model-for-easy-prompts", ns, "Programmed", "True")
    c.kubectl("patch", "inferencepolicy", "cheaper-model-for-easy-prompts", "-n", ns, "--type=json", "-p",
              json.dumps([{"op": "replace", "path": "/spec/action/route/rewriteModel", "value": "no-such-model"}]))
    acc = wait_condition(c, "inferencepolicy", "cheaper-model-for-easy-prompts", ns, "Accepted", "False", "Invalid")
    assert acc["message"].startswith("spec.action.route.rewriteModel") and "no-such-model" in acc["message"], acc
    prog = wait_condition(c, "inferencepolicy", "pii-stays-inside", ns, "Programmed", "False", "Invalid")
    assert "keeps its last good configuration" in prog["message"], prog
    assert c.get("eep", EEP, ns)["spec"] == good["spec"]


# Rules the controller needs that a manifest may not have yet, and why:
# without them it never gets ready (its watches cannot list) and writes
# nothing.
NEEDED_RULES = [
    ("gateway.networking.k8s.io", "gateways", {"list", "watch"}),
    ("gateway.networking.k8s.io", "httproutes", {"list", "watch"}),
]


def rbac_docs(ns: str) -> list[dict]:
    """The controller's ServiceAccount and RBAC from
    gateway-api/base/controller.yaml, moved from `serving` into `ns`."""
    path = REPO / "gateway-api" / "base" / "controller.yaml"
    kinds = {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") in kinds]
    text = json.dumps(docs).replace('"namespace": "serving"', f'"namespace": "{ns}"') \
        .replace('"namespace": "kvasir-system"', f'"namespace": "{ns}"')
    out = json.loads(text)
    for d in out:
        if d["kind"].startswith("Cluster"):
            d["metadata"]["name"] = f"{d['metadata']['name']}-{ns}"
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding") and d["roleRef"]["kind"] == "ClusterRole":
            d["roleRef"]["name"] = f"{d['roleRef']['name']}-{ns}"
    return out


def granted(docs: list[dict], group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for d in docs:
        for r in d.get("rules", []):
            if group in r.get("apiGroups", []) and resource in r.get("resources", []) and not r.get("resourceNames"):
                verbs |= set(r.get("verbs", []))
    return verbs


def test_the_shipped_rbac_is_enough(cluster, controllers):
    """The controller as its own ServiceAccount, with exactly the Roles
    and bindings of gateway-api/base/controller.yaml (moved into a
    namespace of the test's own), under the API server's RBAC
    authorizer: it programs the examples and nothing it does is
    forbidden."""
    c, ns = cluster, "t-rbac"
    setup_namespace(c, ns)
    docs = rbac_docs(ns)
    c.apply(docs)
    token = c.kubectl("create", "token", "kvasir-controller", "-n", ns, "--duration", "1h").stdout.strip()
    kubeconfig = write_kubeconfig(c.dir / f"{ns}.kubeconfig", c.api.url, c.api.pki.ca, token)
    lacking = [f"{g} {r}: {sorted(v - granted(docs, g, r))}" for g, r, v in NEEDED_RULES if v - granted(docs, g, r)]
    assert not lacking, ("gateway-api/base/controller.yaml does not grant " + "; ".join(lacking)
                         + " (the controller checks that each target exists)")
    ctl = controllers(ns, "rbac", lease="kvasir-controller", kubeconfig=kubeconfig, lease_ns=ns, extra=())
    wait_eep(c, ns)
    wait_condition(c, "inferencepolicy", "burst-to-provider", ns, "Programmed", "True")
    wait_condition(c, "inferencetenant", "acme", ns, "Programmed", "True")
    assert c.get("configmap", "kvasir-indexer-pools", ns)
    assert c.get("lease", "kvasir-controller", ns)["spec"]["holderIdentity"] == "rbac"
    log = ctl.proc.log()
    assert "forbidden" not in log.lower(), log[-4000:]



IMAGE = os.environ.get("KVASIR_CONTROLLER_IMAGE", "localhost/kvasir/kvasir-controller:dev")


def test_the_controller_image_programs_the_api_server(cluster, tmp_path):
    """The image `make images` builds (skipped when it has not been built,
    or without buildah): its entrypoint, run inside the image's own root
    filesystem as the image's user (buildah's chroot isolation, sharing
    the host's network), programs the API server and serves the module it
    carries at the URL it writes."""
    c, ns = cluster, "t-image"
    buildah = shutil.which("buildah")
    sd = ["--storage-driver", os.environ.get("STORAGE_DRIVER", "vfs")]
    if buildah is None or os.geteuid() != 0:
        pytest.skip("needs buildah, as root")
    if subprocess.run([buildah, *sd, "inspect", IMAGE], capture_output=True, timeout=60).returncode != 0:
        pytest.skip(f"{IMAGE} not built (make images)")
    setup_namespace(c, ns)
    # The image runs as uid 65532: it gets a readable copy of the kubeconfig.
    d = tmp_path / "kube"
    d.mkdir()
    (d / "ca.crt").write_bytes(c.api.pki.ca.read_bytes())
    cfg = json.loads(c.api.kubeconfig.read_text())
    cfg["clusters"][0]["cluster"]["certificate-authority"] = str(d / "ca.crt")
    (d / "kubeconfig").write_text(json.dumps(cfg))
    for p in (tmp_path, d):
        p.chmod(0o755)
    for f in d.iterdir():
        f.chmod(0o644)
    ctr = subprocess.run([buildah, *sd, "from", "--pull=never", IMAGE], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    http, metrics = free_port(), free_port()
    proc = Proc("controller-image", [buildah, *sd, "run", "--isolation", "chroot", "--user", "65532:65532",
                                     "-v", f"{d}:{d}:ro", "--env", f"KUBECONFIG={d / 'kubeconfig'}", ctr, "--",
                                     "/kvasir-controller", "--wasm-file", "/kvasir_filter.wasm", "--wasm-url", WASM_URL,
                                     "--namespace", ns, "--identity", "image", "--lease-namespace", "kvasir-system",
                                     "--lease-name", f"kvasir-{ns}", "--http-addr", f"127.0.0.1:{http}",
                                     "--metrics-addr", f"127.0.0.1:{metrics}", "--indexer-deployment", ""], c.dir)
    try:
        def ready():
            if not proc.alive():
                raise Exited(f"the image's controller exited: {proc.log()[-3000:]}")
            return request("GET", http, "/readyz", timeout=2)[0] == 200

        wait_until("the image's controller /readyz", ready, timeout=60, interval=0.2)
        eep = wait_eep(c, ns)
        wait_condition(c, "inferencepolicy", "burst-to-provider", ns, "Programmed", "True")
        code = eep["spec"]["wasm"][0]["code"]["http"]
        status, _, body = request("GET", http, "/" + code["url"].rsplit("/", 1)[1], timeout=10)
        assert status == 200 and body.startswith(b"\0asm")
        assert hashlib.sha256(body).hexdigest() == code["sha256"]
    finally:
        proc.stop()
        subprocess.run([buildah, *sd, "rm", ctr], capture_output=True, timeout=60)
