"""The real control planes, built from Go modules (scripts/go-tools.sh,
tools/README.md), run off-cluster on 127.0.0.1:

- etcd 3.6 and kube-apiserver 1.36 start; `kubectl` talks to them with the
  harness's kubeconfig (token auth, RBAC);
- `kubectl apply --server-side` of the project's CRDs (crds/), of the
  upstream CRDs (Gateway API, InferencePool, Envoy Gateway's; from
  ../shared/upstream-crds/) and of crds/examples/ succeeds: the examples
  pass the server's own structural schema and CEL validation;
- a CEL rule of ours (`x-kubernetes-validations` in crds/) is enforced by
  the server: an InferencePolicy with two actions is refused with the
  rule's message;
- Envoy Gateway standalone (File provider, Host infrastructure) runs the
  project's Envoy 1.40 (no download) and routes a request through a
  Gateway and HTTPRoute to a local HTTP backend;
- `egctl x translate` turns the same Gateway API YAML into xDS with no
  control plane, and says what it does with an HTTPRoute whose backend is
  an InferencePool (stock Envoy Gateway: ResolvedRefs=False/InvalidKind;
  an InferencePool object itself it cannot even read);
- a wasm EnvoyExtensionPolicy under Envoy Gateway standalone: refused by
  Envoy as Envoy Gateway builds it (its wasm_cluster is made for a pod),
  loaded and run once the harness's EnvoyPatchPolicy repoints that
  cluster (a hand-encoded proxy-wasm module adds a request header).

Envoy Gateway binds fixed ports (18000, 18002, 8081, 19003): the harness
holds a machine-wide lock while one runs, so two test runs on one machine
take turns instead of colliding.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvasir_harness import ENVOY_BIN, REPO, Processes, free_port, request, wait_until
from kvasir_harness.kube import (EGCTL_BIN, ENVOY_GATEWAY_BIN, ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, egctl_translate,
                                 envoy_version, missing, server_version, start_apiserver, start_envoy_gateway,
                                 start_etcd, wasm_cluster_patch, write_resources)

UPSTREAM = REPO.parent / "shared" / "upstream-crds"
KUBE_VERSION = "v1.36.3"     # scripts/go-tools.sh KUBE_VERSION
EG_VERSION = "v1.9.1"        # scripts/go-tools.sh EG_VERSION

# Every wait here has its own deadline; the file runs in well under two
# minutes once the tools are built.


def need(*bins) -> None:
    if m := missing(*bins):
        pytest.fail(f"missing {', '.join(m)}: run `bash scripts/go-tools.sh` (make setup does)")


@pytest.fixture(scope="module")
def workdir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvasir-kube-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(workdir):
    need(ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL)
    with Processes() as procs:
        etcd = procs.add(start_etcd(workdir))
        api = procs.add(start_apiserver(workdir, etcd))
        yield api


# ---------------------------------------------------------------------------
# etcd + kube-apiserver
# ---------------------------------------------------------------------------


def test_apiserver_on_etcd_serves_kubectl(cluster):
    v = server_version(cluster)
    assert v["gitVersion"] == KUBE_VERSION, v
    r = cluster.kubectl("get", "namespace", "default", "-o", "json")
    assert json.loads(r.stdout)["metadata"]["name"] == "default"
    # The admin token is system:masters under RBAC; an unknown token is not.
    assert cluster.kubectl("auth", "can-i", "create", "customresourcedefinitions").stdout.strip() == "yes"
    bad = cluster.kubectl("--token", "not-a-token", "get", "namespaces", check=False)
    assert bad.returncode != 0 and "Unauthorized" in bad.stderr, bad.stderr


def apply_server_side(cluster, *files: Path) -> None:
    args = ["apply", "--server-side", "--field-manager", "kvasir-tests"]
    for f in files:
        args += ["-f", str(f)]
    cluster.kubectl(*args, timeout=90)


def crd_names(*files: Path) -> list[str]:
    yaml = pytest.importorskip("yaml")
    names = []
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                names.append(doc["metadata"]["name"])
    return names


@pytest.fixture(scope="module")
def crds(cluster):
    """Ours and the upstream ones, applied server-side and Established."""
    ours = sorted((REPO / "crds").glob("*.yaml"))
    if not UPSTREAM.is_dir():
        pytest.skip(f"{UPSTREAM} (the upstream CRDs) is not here")
    upstream = sorted(UPSTREAM.glob("*.yaml"))
    apply_server_side(cluster, *upstream)
    apply_server_side(cluster, *ours)
    names = crd_names(*ours, *upstream)
    cluster.kubectl("wait", "--for", "condition=Established", "--timeout", "60s",
                    *[f"crd/{n}" for n in names], timeout=75)
    return names


def test_crds_apply_server_side_and_are_established(cluster, crds):
    assert any(n.endswith(".kvasir.dev") for n in crds)
    for must in ("inferencepools.inference.networking.k8s.io", "httproutes.gateway.networking.k8s.io",
                 "envoyextensionpolicies.gateway.envoyproxy.io"):
        assert must in crds
    # Served: the API server lists each new resource.
    r = cluster.kubectl("api-resources", "--api-group", "kvasir.dev", "-o", "name")
    assert {"inferencepolicies.kvasir.dev", "inferencesettings.kvasir.dev"} <= set(r.stdout.split())


def test_examples_pass_the_servers_schema_and_cel(cluster, crds):
    cluster.kubectl("create", "namespace", "serving", check=False)
    apply_server_side(cluster, *sorted((REPO / "crds" / "examples").glob("*.yaml")))
    r = cluster.kubectl("get", "inferencepolicies.kvasir.dev", "-n", "serving", "-o", "name")
    assert "inferencepolicy.kvasir.dev/batch-when-idle" in r.stdout.split()


INVALID_POLICY = """
apiVersion: kvasir.dev/v1alpha1
kind: InferencePolicy
metadata:
  name: two-actions
  namespace: default
spec:
  precedence: 10
  targetRefs:
    - kind: Gateway
      name: inference-gateway
  action:
    route:
      pool: main
    shed:
      retryAfterS: 5
"""


def test_server_enforces_a_cel_rule_of_ours(cluster, crds):
    r = cluster.kubectl("apply", "--server-side", "-f", "-", input=INVALID_POLICY, check=False)
    assert r.returncode != 0
    assert "set exactly one of `route`, `reject`, `provider`, `shed`" in r.stderr, r.stderr
    # The same object with one action is accepted: it was the rule.
    ok = INVALID_POLICY.replace("    shed:\n      retryAfterS: 5\n", "")
    cluster.kubectl("apply", "--server-side", "-f", "-", input=ok)
    cluster.kubectl("delete", "inferencepolicies.kvasir.dev", "two-actions", "-n", "default")


# ---------------------------------------------------------------------------
# Envoy Gateway
# ---------------------------------------------------------------------------


class Backend:
    """A tiny HTTP backend on 127.0.0.1: answers JSON with what it got."""

    def __init__(self) -> None:
        seen = self.seen = []

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen.append((self.path, dict(self.headers)))
                body = json.dumps({"path": self.path, "host": self.headers.get("host")}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def gateway_docs(listener_port: int, backend_ip: str, backend_port: int) -> list[str]:
    return [
        """
apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata:
  name: eg
spec:
  controllerName: gateway.envoyproxy.io/gatewayclass-controller
""", f"""
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: eg
  namespace: default
spec:
  gatewayClassName: eg
  listeners:
    - name: http
      protocol: HTTP
      port: {listener_port}
""", """
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: backend
  namespace: default
spec:
  parentRefs:
    - name: eg
  hostnames: ["www.example.com"]
  rules:
    - matches:
        - path: {type: PathPrefix, value: /}
      backendRefs:
        - group: gateway.envoyproxy.io
          kind: Backend
          name: backend
""", f"""
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: Backend
metadata:
  name: backend
  namespace: default
spec:
  endpoints:
    - ip:
        address: {backend_ip}
        port: {backend_port}
"""]


def test_envoy_gateway_standalone_routes_through_local_envoy(workdir):
    need(ENVOY_GATEWAY_BIN, ENVOY_BIN)
    backend = Backend()
    listener = free_port()
    try:
        with Processes() as procs:
            eg = procs.add(start_envoy_gateway(workdir / "eg", gateway_docs(listener, "127.0.0.1", backend.port)))
            try:
                eg.wait_listener(listener, timeout=60)

                def routed():
                    status, _, body = request("GET", listener, "/hello?x=1", headers={"host": "www.example.com"},
                                              timeout=2)
                    return (status, body) if status == 200 else None

                status, body = wait_until("a request routed to the backend", routed, timeout=30, interval=0.2)
            except BaseException:
                print(eg.proc.log()[-6000:])
                print(eg.envoy_logs()[-6000:])
                raise
            assert json.loads(body)["path"] == "/hello?x=1"
            assert backend.seen and backend.seen[-1][0] == "/hello?x=1"
            # No route for another host: Envoy's own 404, not the backend.
            assert request("GET", listener, "/", headers={"host": "other.example"}, timeout=5)[0] == 404
            # The Envoy it launched is ours (no download): its server_info says 1.40.
            s, info = eg.envoy_admin_get("/server_info")
            assert s == 200 and json.loads(info)["version"].split("/")[1] == envoy_version()
            assert "downloading" not in eg.proc.log()
            version = subprocess.run([str(ENVOY_GATEWAY_BIN), "version"], capture_output=True, text=True, timeout=30)
            assert f"ENVOY_GATEWAY_VERSION: {EG_VERSION}" in version.stdout, version.stdout
    finally:
        backend.stop()


# ---------------------------------------------------------------------------
# egctl x translate
# ---------------------------------------------------------------------------


def _configs(xds: dict) -> dict[str, dict]:
    """egctl's xDS output (protobuf JSON, camelCase) by config dump type:
    {"xds": {"<ns>/<gateway>": {"configs": [{"@type": ...}, ...]}}}."""
    (gateway,) = xds["xds"].values()
    return {c["@type"].rsplit(".", 1)[1]: c for c in gateway["configs"]}


def test_egctl_translates_gateway_api_to_xds():
    need(EGCTL_BIN)
    # Loopback Backends are for the Host infrastructure only; the translator
    # alone refuses them, so a routable address stands in.
    cfg = _configs(egctl_translate(gateway_docs(8080, "10.1.2.3", 8000), to="xds", resource_type="all"))
    assert set(cfg) >= {"BootstrapConfigDump", "ClustersConfigDump", "EndpointsConfigDump", "ListenersConfigDump",
                        "RoutesConfigDump"}
    listeners = [dl["activeState"]["listener"] for dl in cfg["ListenersConfigDump"]["dynamicListeners"]]
    # The Gateway's listener, and Envoy Gateway's readiness listener (19003).
    assert sorted(lst["address"]["socketAddress"]["portValue"] for lst in listeners) == [8080, 19003]
    eps = [lb["endpoint"]["address"]["socketAddress"]
           for e in cfg["EndpointsConfigDump"]["dynamicEndpointConfigs"]
           for group in e["endpointConfig"].get("endpoints", []) for lb in group["lbEndpoints"]]
    assert {"address": "10.1.2.3", "portValue": 8000} in eps
    routes = json.dumps(cfg["RoutesConfigDump"])
    assert "www.example.com" in routes and "httproute/default/backend/rule/0" in routes
    # The bootstrap points Envoy at the xDS server's fixed port.
    assert "18000" in json.dumps(cfg["BootstrapConfigDump"])


INFERENCEPOOL_ROUTE = """
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: backend
  namespace: default
spec:
  parentRefs:
    - name: eg
  rules:
    - backendRefs:
        - group: inference.networking.k8s.io
          kind: InferencePool
          name: main
"""


def test_egctl_stock_envoy_gateway_refuses_an_inferencepool_backend():
    """Stock Envoy Gateway has no InferencePool: egctl cannot even read one
    (it is not in its scheme: "no kind InferencePool is registered"), and
    an HTTPRoute pointing at one does not resolve."""
    need(EGCTL_BIN)
    docs = gateway_docs(8080, "10.1.2.3", 8000)[:2] + [INFERENCEPOOL_ROUTE]
    out = egctl_translate(docs, to="gateway-api", resource_type="all")
    routes = [r for d in (out if isinstance(out, list) else [out])
              for r in d.get("httpRoutes", [])]
    assert routes, out
    conds = [c for p in routes[0]["status"]["parents"] for c in p["conditions"]]
    resolved = [c for c in conds if c["type"] == "ResolvedRefs"]
    assert resolved and resolved[0]["status"] == "False" and resolved[0]["reason"] == "InvalidKind", conds
    pool = """
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata:
  name: main
  namespace: default
spec:
  selector:
    matchLabels: {app: vllm}
  targetPorts:
    - number: 8000
"""
    with pytest.raises(RuntimeError, match='no kind "InferencePool" is registered'):
        egctl_translate(docs + [pool], to="gateway-api")


# ---------------------------------------------------------------------------
# A wasm EnvoyExtensionPolicy under Envoy Gateway standalone
# ---------------------------------------------------------------------------


def _uleb(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _sleb(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        done = (n == 0 and not b & 0x40) or (n == -1 and b & 0x40)
        out.append(b | (0 if done else 0x80))
        if done:
            return bytes(out)


def header_wasm(name: bytes = b"x-wasm-filter", value: bytes = b"ran") -> bytes:
    """The smallest proxy-wasm module (ABI 0.2.1) that does something
    visible, encoded by hand: `proxy_on_request_headers` adds request
    header `name: value` and continues. Independent of the project's
    filter, so this test pins Envoy Gateway's wasm path only."""
    def vec(items: list[bytes]) -> bytes:
        return _uleb(len(items)) + b"".join(items)

    def section(sid: int, body: bytes) -> bytes:
        return bytes([sid]) + _uleb(len(body)) + body

    def name_(s: str) -> bytes:
        return _uleb(len(s)) + s.encode()

    i32 = 0x7F
    def ftype(params: int, results: int) -> bytes:
        return b"\x60" + vec([bytes([i32])] * params) + vec([bytes([i32])] * results)

    def const(n: int) -> bytes:
        return b"\x41" + _sleb(n)

    def body(code: bytes) -> bytes:
        b = b"\x00" + code + b"\x0b"  # no locals ... end
        return _uleb(len(b)) + b

    NAME, VALUE = 1024, 1024 + len(name) + 16
    types = vec([ftype(0, 0), ftype(1, 1), ftype(2, 0), ftype(2, 1), ftype(3, 1), ftype(5, 1)])
    imports = vec([name_("env") + name_("proxy_add_header_map_value") + b"\x00" + _uleb(5)])
    funcs = vec([_uleb(t) for t in (0, 1, 2, 3, 3, 4)])  # functions 1..6 (0 is the import)
    memory = vec([b"\x00" + _uleb(1)])
    exports = vec([name_("memory") + b"\x02\x00"] + [name_(n) + b"\x00" + _uleb(i) for i, n in enumerate(
        ["proxy_abi_version_0_2_1", "proxy_on_memory_allocate", "proxy_on_context_create", "proxy_on_vm_start",
         "proxy_on_configure", "proxy_on_request_headers"], start=1)])
    code = vec([
        body(b""),                                   # proxy_abi_version_0_2_1
        body(const(4096)),                           # proxy_on_memory_allocate: a scratch area
        body(b""),                                   # proxy_on_context_create
        body(const(1)),                              # proxy_on_vm_start: ok
        body(const(1)),                              # proxy_on_configure: ok
        # proxy_add_header_map_value(request headers, name, value); Continue
        body(const(0) + const(NAME) + const(len(name)) + const(VALUE) + const(len(value)) + b"\x10\x00\x1a"
             + const(0)),
    ])
    data = vec([b"\x00" + const(NAME) + b"\x0b" + vec([bytes([c]) for c in name]),
                b"\x00" + const(VALUE) + b"\x0b" + vec([bytes([c]) for c in value])])
    return (b"\x00asm\x01\x00\x00\x00" + section(1, types) + section(2, imports) + section(3, funcs)
            + section(5, memory) + section(7, exports) + section(10, code) + section(11, data))


def test_wasm_policy_loads_in_standalone_only_with_the_wasm_cluster_patch(workdir):
    """Stock Envoy Gateway standalone cannot deliver a wasm module to its
    Envoy (its `wasm_cluster` is built for a pod: CA file /certs/ca.crt,
    in-cluster DNS name): Envoy rejects the cluster update. With the
    harness's EnvoyPatchPolicy (`wasm_cluster_patch`) the module is fetched
    by Envoy Gateway, served to Envoy over mTLS on 18002, and runs."""
    need(ENVOY_GATEWAY_BIN, ENVOY_BIN)
    wasm = header_wasm()
    www = workdir / "www"
    www.mkdir(exist_ok=True)
    (www / "filter.wasm").write_bytes(wasm)
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    files = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(www)))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    backend = Backend()
    listener = free_port()
    policy = f"""
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyExtensionPolicy
metadata:
  name: wasm
  namespace: default
spec:
  targetRefs:
    - group: gateway.networking.k8s.io
      kind: HTTPRoute
      name: backend
  wasm:
    - name: header
      rootID: header
      code:
        type: HTTP
        http:
          url: http://127.0.0.1:{files.server_address[1]}/filter.wasm
          sha256: {hashlib.sha256(wasm).hexdigest()}
"""
    docs = gateway_docs(listener, "127.0.0.1", backend.port) + [policy]
    egdir = workdir / "eg-wasm"
    try:
        with Processes() as procs:
            eg = procs.add(start_envoy_gateway(egdir, docs, extension_apis={"enableEnvoyPatchPolicy": True}))
            try:
                # Unpatched: Envoy refuses the cluster update that carries wasm_cluster.
                wait_until("Envoy rejecting wasm_cluster",
                           lambda: "wasm_cluster: Invalid path: /certs/ca.crt" in eg.proc.log(), timeout=60)
                write_resources(eg.resources, docs + [wasm_cluster_patch(egdir, "eg")])

                def routed():
                    status, _, body = request("GET", listener, "/w", headers={"host": "www.example.com"}, timeout=2)
                    return body if status == 200 else None

                wait_until("a request through the wasm filter", routed, timeout=45, interval=0.25)
            except BaseException:
                print(eg.proc.log()[-8000:])
                raise
            path, headers = backend.seen[-1]
            assert path == "/w"
            assert {k.lower(): v for k, v in headers.items()}.get("x-wasm-filter") == "ran", headers
    finally:
        backend.stop()
        files.shutdown()
        files.server_close()
