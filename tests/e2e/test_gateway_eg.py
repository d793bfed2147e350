"""gateway-api/ on the real Envoy Gateway (v1.9.1, built from Go modules
into .tools/bin by scripts/go-tools.sh), with no cluster.

What is rendered: `kubectl kustomize gateway-api/` with a fresh route
token, exactly as `kubectl apply -k` would send it.

Cheap checks (no process but kubectl and egctl, a few seconds):

- the install renders only with a route token, and every value that selects
  a pool's or provider's rule carries it (no client can guess one);
- an overlay into another namespace renders with every name derived from
  the namespace rewritten (xDS names, DNS names, flags, RBAC subjects);
- demo keys are opt-in (gateway-api/demo/), never in the install;
- `egctl x translate` (Envoy Gateway's own translator) accepts every
  routing resource: every backendRef resolves (stock Envoy Gateway has no
  InferencePool backend), every policy is accepted, the EnvoyPatchPolicy is
  programmed under the pinned xDS name scheme, and the names it patches are
  the clusters of the rules it means.

The live part (class `TestOnEnvoyGateway`, about 40 s: slow, marked so).
Standalone Envoy Gateway (File provider, Host infrastructure) configures
the project's Envoy 1.40; a request goes client -> that Envoy -> the Kvasir
filter (the built module, loaded from the controller's EnvoyExtensionPolicy)
-> the real cache-indexer -> a vllm-sim, and back. What stands in for what
a cluster would have, and nothing else is changed:

- Envoy Gateway reads the routing kinds only (GatewayClass, Gateway,
  HTTPRoute, HTTPRouteFilter, Backend, Client/BackendTrafficPolicy,
  EnvoyPatchPolicy, Namespace); Deployments, RBAC, ConfigMaps and the
  pools' Services are not its input here, and the kvasir.dev kinds and
  InferencePools are read by `kvasirctl compile --output
  envoyextensionpolicy`, which writes the EnvoyExtensionPolicy byte for
  byte as the controller does (its module URL is the content-addressed one
  the controller serves, on a local server; `filter.exposeServedEndpoint`
  is added so the response names the engine that served);
- the pools: in a cluster each pool rule's backendRef is a Service whose
  endpoints (EndpointSlices, the InferencePool's ready pods) Envoy Gateway
  resolves; its File provider reads no EndpointSlices, so the same rules
  point at an Envoy Gateway Backend of the same name listing the local
  engines' addresses (the same EDS cluster, override-host and retry
  policy). The indexer gets those engines from flags, not from the
  InferencePool's pods (its discovery needs an API server);
- the engines are vllm-sims; one sits behind a recorder that keeps each
  request's headers (vllm-sim records none); the provider is a small
  local echo server (no TLS), reached through the `openai` Backend;
- the Gateway listens on a free port (not 80) and the HTTPRoute gets
  `hostnames`, as a platform would set them;
- the EnvoyPatchPolicy's indexer cluster is STATIC 127.0.0.1 instead of the
  indexer Service's DNS name, its token file local; the operator's Secret
  `openai-credential` is supplied; the harness's `wasm_cluster_patch` lets
  standalone Envoy Gateway hand the module to its Envoy (tools/README.md);
- Envoy Gateway runs with the configuration docs/deploy.md installs:
  EnvoyPatchPolicy and Backend on, XDSNameSchemeV2 pinned off.

Envoy Gateway binds fixed ports: the harness holds a machine-wide lock
while one runs. Every wait here is bounded.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from kvasir_harness import (ENVOY_BIN, INDEXER_BIN, TOKENIZER, WASM, Proc, Processes, free_port, request,  # noqa: E402
                            secrets_for, start_sim, wait_sim, wait_until)
from kvasir_harness.kube import (EG_FILE_KINDS, EGCTL_BIN, ENVOY_GATEWAY_BIN, KUBECTL, egctl_translate,  # noqa: E402
                                 kustomize, missing, start_envoy_gateway, wasm_cluster_patch, write_resources)

REPO = Path(__file__).resolve().parents[2]
GW = REPO / "gateway-api"
KVASIRCTL = REPO / "target" / "release" / "kvasirctl"
NS = "serving"
GATEWAY = "inference-gateway"
ROUTE = "inference"
EEP_NAME = "kvasir-gateway-inference-gateway"
PATCH = "kvasir"
ROUTE_HEADER = "x-kvasir-cluster"
ENDPOINT_HEADER = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
# docs/deploy.md installs Envoy Gateway with this (the patch's xDS names
# are the default scheme's).
RUNTIME_FLAGS = {"disabled": ["XDSNameSchemeV2"]}
MAIN_MODEL = "llama-3.1-8b-instruct"
SMALL_MODEL = "llama-3.2-1b-instruct"
PROVIDER_MODEL = "gpt-4o-mini"
ACME = "sk-acme-example-1"      # gateway-api/demo/demo-keys.yaml
PROVIDER_CREDENTIAL = "Bearer sk-provider-" + uuid.uuid4().hex
HOST = "inference.kvasir.test"
HARD = "Explain this code:\n```python\nprint('" + "x" * 40 + "')\n```\n"


def need(*bins) -> None:
    if m := missing(*bins):
        pytest.fail(f"missing {', '.join(m)}: run `bash scripts/go-tools.sh` (make setup does)")


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------


def copy_manifests(dst: Path) -> Path:
    """gateway-api/ copied without any route token of this checkout."""
    out = dst / "gateway-api"
    shutil.copytree(GW, out, ignore=shutil.ignore_patterns("route-token.env"))
    return out


def render(tmp: Path, token: str) -> list[dict[str, Any]]:
    """`kubectl kustomize gateway-api/` with `token` as the install's
    route token."""
    gw = copy_manifests(tmp)
    (gw / "install" / "route-token.env").write_text(f"routeToken={token}\n")
    return kustomize(gw)


def overlay(tmp: Path, namespace: str, token: str) -> Path:
    """docs/deploy.md's overlay into another namespace, outside the
    repository: a kustomization setting the namespace and the token (over
    gateway-api/base and examples), and one above it with
    components/kvasir."""
    root = tmp / f"install-{namespace}"
    inner = root / "namespace"
    inner.mkdir(parents=True)
    rel = os.path.relpath(GW, inner)
    (inner / "kustomization.yaml").write_text(f"""namespace: {namespace}
resources: [{rel}/base, {rel}/examples]
configMapGenerator:
  - name: kvasir-route-token
    envs: [route-token.env]
    options:
      disableNameSuffixHash: true
      annotations: {{config.kubernetes.io/local-config: "true"}}
""")
    (inner / "route-token.env").write_text(f"routeToken={token}\n")
    (root / "kustomization.yaml").write_text(
        f"resources: [namespace]\ncomponents: [{os.path.relpath(GW, root)}/components/kvasir]\n")
    return root


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def route_values(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Where a value that selects a pool's or provider's rule is written:
    the `kvasir.dev/cluster` annotations (what the filter writes) and the
    HTTPRoute's header matches (what selects a rule)."""
    out: dict[str, list[str]] = {"annotations": [], "matches": []}
    for d in docs:
        if d["kind"] in ("InferencePool", "InferenceProvider"):
            out["annotations"].append(d["metadata"]["annotations"]["kvasir.dev/cluster"])
        if d["kind"] == "HTTPRoute":
            for rule in d["spec"]["rules"]:
                for m in rule.get("matches", []):
                    out["matches"] += [h["value"] for h in m.get("headers", []) if h["name"] == ROUTE_HEADER]
    return out


@pytest.fixture(scope="module")
def token() -> str:
    return "t" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, token) -> list[dict[str, Any]]:
    need(KUBECTL)
    return render(tmp_path_factory.mktemp("render"), token)


def test_the_install_renders_only_with_a_route_token(tmp_path):
    """No token, no install: a missing route-token.env fails the render
    instead of shipping a value anyone could read in this repository."""
    need(KUBECTL)
    gw = copy_manifests(tmp_path)
    r = subprocess.run([KUBECTL, "kustomize", str(gw)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "route-token.env" in r.stderr, r.stderr[-2000:]


def test_every_value_that_selects_a_backend_carries_the_route_token(rendered, token):
    values = route_values(rendered)
    assert values["annotations"] and values["matches"]
    for v in values["annotations"] + values["matches"]:
        assert v.endswith("/" + token), v
    # Each value the filter can write is matched by a rule, and nothing
    # else is.
    assert set(values["matches"]) == set(values["annotations"])
    assert "ROUTE-TOKEN" not in json.dumps(rendered)
    # The reader of the token is never applied.
    assert not [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvasir-route-token"]


def test_an_overlay_into_another_namespace_renders_with_every_derived_name(tmp_path, token):
    need(KUBECTL)
    docs = kustomize(overlay(tmp_path, "llm-team", token))
    namespaced = [d for d in docs if d["kind"] not in ("GatewayClass", "Namespace")]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"llm-team"}
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"] == ["llm-team"]
    # Not one string still names the default namespace.
    assert not re.search(r"\bserving\b", json.dumps(docs)), [
        (d["kind"], d["metadata"]["name"]) for d in docs if re.search(r"\bserving\b", json.dumps(d))]
    patch = find(docs, "EnvoyPatchPolicy", PATCH)["spec"]["jsonPatches"]
    names = [p["name"] for p in patch]
    assert "llm-team/inference-gateway/http" in names
    assert {n for n in names if n.startswith("httproute/")} == {f"httproute/llm-team/inference/rule/{i}" for i in range(4)}
    indexer = next(p for p in patch if p["name"] == "kvasir-indexer")["operation"]["value"]
    addr = indexer["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert addr["address"] == "kvasir-indexer.llm-team.svc.cluster.local"
    for d in docs:
        if d["kind"] == "RoleBinding":
            assert {s["namespace"] for s in d["subjects"]} == {"llm-team"}, d
    args = find(docs, "Deployment", "kvasir-controller")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=$(POD_NAMESPACE)" in args
    assert all(v.endswith("/" + token) for vs in route_values(docs).values() for v in vs)


def test_demo_keys_are_opt_in(rendered, tmp_path):
    """The install carries no Secret (the tenants' keys, the provider's
    credential and the indexer token are the operator's); the example
    keys are in gateway-api/demo/ only."""
    assert [d for d in rendered if d["kind"] == "Secret"] == []
    demo = kustomize(GW / "demo")
    assert {d["kind"] for d in demo} == {"Secret"}
    assert {d["metadata"]["name"] for d in demo} == {"acme-api-keys", "nightly-eval-api-keys"}


# ---------------------------------------------------------------------------
# Envoy Gateway's translator (egctl x translate): no process started
# ---------------------------------------------------------------------------


def credential_secret() -> dict[str, Any]:
    """The operator's Secret for the provider (docs/deploy.md): key
    `credential`, the whole header value. `data`, as the API server stores
    it (Envoy Gateway's File provider reads no `stringData`)."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "openai-credential", "namespace": NS},
            "data": {"credential": base64.b64encode(PROVIDER_CREDENTIAL.encode()).decode()}}


def routing(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rendered documents Envoy Gateway reads, less the pools'
    Services (their endpoints would come from EndpointSlices)."""
    return [copy.deepcopy(d) for d in docs if d["kind"] in EG_FILE_KINDS - {"Service", "ConfigMap", "Secret"}]


def egctl_status(out: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """egctl's gateway-api output: (kind, name) -> status."""
    found = {}
    for d in (out if isinstance(out, list) else [out]):
        for key, objs in d.items():
            if isinstance(objs, list):
                for o in objs:
                    if isinstance(o, dict) and "metadata" in o and "kind" in o:
                        found[(o["kind"], o["metadata"]["name"])] = o.get("status", {})
    return found


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    for holder in ("ancestors", "parents"):
        if status.get(holder):
            return {c["type"]: c for c in status[holder][0]["conditions"]}
    return {c["type"]: c for c in status.get("conditions", [])}


@pytest.fixture(scope="module")
def translated(rendered) -> dict[tuple[str, str], dict[str, Any]]:
    need(EGCTL_BIN)
    docs = routing(rendered) + [credential_secret()]
    return egctl_status(egctl_translate([yaml.safe_dump(d) for d in docs], to="gateway-api"))


def test_envoy_gateway_resolves_every_backend_and_accepts_every_policy(translated):
    """Every rule's backendRefs resolve (a Service per pool, the provider's
    Backend with its credential filter): no `InvalidKind`, which an
    InferencePool backendRef gets from stock Envoy Gateway."""
    route = conditions(translated[("HTTPRoute", ROUTE)])
    assert route["Accepted"]["status"] == "True", route
    assert route["ResolvedRefs"]["status"] == "True", route["ResolvedRefs"]
    for (kind, name), st in translated.items():
        if kind in ("ClientTrafficPolicy", "BackendTrafficPolicy", "EnvoyPatchPolicy"):
            c = conditions(st)
            assert c["Accepted"]["status"] == "True", (kind, name, c)


def xds_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    out = egctl_translate([yaml.safe_dump(d) for d in docs], to="xds", resource_type="all")
    (gateway,) = out["xds"].values()
    return {c["@type"].rsplit(".", 1)[1]: c for c in gateway["configs"]}


def test_the_patches_name_the_clusters_of_the_rules_they_mean(rendered):
    """The EnvoyPatchPolicy names Envoy Gateway's clusters by rule index
    (`httproute/<ns>/inference/rule/<i>`): each one it patches is the
    cluster of a rule that reaches a pool (Envoy Gateway records the rule's
    name in the cluster's metadata), every such rule is patched, and Envoy
    Gateway itself sets no protocol options there (the patch adds them
    whole, so it must replace nothing)."""
    need(EGCTL_BIN)
    docs = routing(rendered) + [credential_secret()]
    plain = xds_of([d for d in docs if d["kind"] != "EnvoyPatchPolicy"])
    clusters = {c["cluster"]["name"]: c["cluster"] for c in plain["ClustersConfigDump"]["dynamicActiveClusters"]}
    section = {n: c["metadata"]["filterMetadata"]["envoy-gateway"]["resources"][0].get("sectionName")
               for n, c in clusters.items() if n.startswith("httproute/")}
    pool_rules = {r["name"] for r in find(rendered, "HTTPRoute", ROUTE)["spec"]["rules"]
                  if any(b.get("kind", "Service") == "Service" for b in r.get("backendRefs", []))}
    assert pool_rules == {"main", "main-stored", "small", "small-stored"}
    patch = find(rendered, "EnvoyPatchPolicy", PATCH)["spec"]["jsonPatches"]
    patched = {p["name"] for p in patch if p["name"].startswith("httproute/")}
    assert {section[n] for n in patched} == pool_rules, section
    for n in patched:
        assert "typedExtensionProtocolOptions" not in clusters[n], clusters[n]
    # With the patch: the endpoint list is removed after load balancing
    # on exactly those clusters, and the listener the first patch names
    # exists.
    xds = xds_of(docs)
    after = {c["cluster"]["name"]: c["cluster"] for c in xds["ClustersConfigDump"]["dynamicActiveClusters"]}
    for n, c in after.items():
        text = json.dumps(c)
        assert (ENDPOINT_HEADER in text and "header_mutation" in text) == (n in patched), n
    listeners = [dl["activeState"]["listener"]["name"] for dl in xds["ListenersConfigDump"]["dynamicListeners"]]
    listener_patch = next(p for p in patch if p["type"].endswith("Listener"))
    assert listener_patch["name"] in listeners, listeners


# ---------------------------------------------------------------------------
# Local stand-ins: an engine's recorder, a trap, the provider, the load
# the indexer reads, the controller's two replicas
# ---------------------------------------------------------------------------


class Backlogged(ThreadingHTTPServer):
    # The default backlog (5) refuses connections under a burst of scrapes
    # and requests, which the indexer takes for an engine that is down.
    request_queue_size = 128
    daemon_threads = True


class Server:
    """A threaded HTTP server on 127.0.0.1 with handler class `handler`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = Backlogged(("127.0.0.1", 0), handler)
        self.port = self.server.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a: Any) -> None:
        pass

    def body(self) -> bytes:
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""

    def answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def recorder(upstream: int) -> Server:
    """An engine's front: records each request's method, path and headers,
    then forwards it to the engine on `upstream` and relays the answer
    (vllm-sim records no headers; Envoy sees this address as the engine)."""
    seen: list[tuple[str, str, dict[str, str]]] = []

    class H(Quiet):
        def forward(self) -> None:
            b = self.body()
            seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
            hop = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
            status, h, out = request(self.command, upstream, self.path, b or None,
                                     {k: v for k, v in self.headers.items() if k.lower() not in hop}, timeout=30)
            self.answer(status, out, {k: v for k, v in h.items() if k not in hop})

        do_GET = do_POST = forward

    s = Server(H)
    s.seen = seen
    return s


class Trap:
    """A TCP listener that counts the connections it is given: an address
    the indexer names but that is not a member of the pool's cluster."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            c.close()

    def stop(self) -> None:
        self.sock.close()


def provider() -> Server:
    """The provider's stand-in: records each request and answers a chat
    completion for the model asked."""
    seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    class H(Quiet):
        def do_POST(self) -> None:  # noqa: N802
            req = json.loads(self.body() or b"{}")
            seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, req))
            out = json.dumps({"id": "chatcmpl-provider", "object": "chat.completion", "created": 0,
                              "model": req.get("model"),
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                           "finish_reason": "stop"}],
                              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
            self.answer(200, out, {"content-type": "application/json"})

    s = Server(H)
    s.seen = seen
    return s


def fake_load(sims: dict[str, Any]) -> Server:
    """Serves each engine's real /metrics with `vllm:num_requests_waiting`
    replaced by `waiting[name]`: the numbers a busy or idle vLLM reports,
    read by the real indexer (`metrics=` of its endpoint)."""
    waiting = {k: 0.0 for k in sims}

    class H(Quiet):
        def do_GET(self) -> None:  # noqa: N802
            name = self.path.strip("/").split("/")[0]
            _, _, b = request("GET", sims[name].port, "/metrics", timeout=5)
            lines = [line.rsplit(" ", 1)[0] + f" {waiting[name]}" if line.startswith("vllm:num_requests_waiting")
                     else line for line in b.decode().splitlines()]
            self.answer(200, ("\n".join(lines) + "\n").encode(), {"content-type": "text/plain; version=0.0.4"})

    s = Server(H)
    s.waiting = waiting
    s.url = lambda name: f"http://127.0.0.1:{s.port}/{name}/metrics"
    return s


MODULE_PATH = re.compile(r"^/kvasir_filter-([0-9a-f]{64})\.wasm$")


def replica(modules: dict[str, bytes], fetched: list[str]) -> Server:
    """One controller replica's module server, as the controller must serve
    it: `GET /kvasir_filter-<sha256>.wasm` answers the module it holds
    with that digest; for a digest it does not hold (another version's,
    during a rollout) 503 with `Connection: close`, which Envoy Gateway's
    fetcher retries on a new connection, so the retry can reach a replica
    that has it (a 404 would not be retried, nor would 200 with other
    bytes: a checksum failure)."""

    class H(Quiet):
        def do_GET(self) -> None:  # noqa: N802
            m = MODULE_PATH.match(self.path)
            fetched.append(self.path)
            if m and m.group(1) in modules:
                self.answer(200, modules[m.group(1)], {"content-type": "application/wasm"})
            elif m:
                self.answer(503, b"module not held by this replica", {"connection": "close", "retry-after": "1"})
            else:
                self.answer(404, b"")

    return Server(H)


class RoundRobin:
    """A Service in front of replicas: each new TCP connection goes to the
    next one in turn (as kube-proxy spreads connections)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.next = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            port = self.ports[self.next % len(self.ports)]
            self.next += 1
            try:
                u = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                c.close()
                continue
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.sock.close()


def other_build(wasm: bytes, tag: str) -> bytes:
    """The same module with a custom section added: another build as far
    as its digest goes, the same filter when it runs."""
    name = b"kvasir-build"
    payload = bytes([len(name)]) + name + tag.encode()
    return wasm + b"\x00" + bytes([len(payload)]) + payload


# ---------------------------------------------------------------------------
# The live gateway: Envoy Gateway standalone, its Envoy, the filter, the
# indexer, the engines
# ---------------------------------------------------------------------------


def ip_endpoints(addresses: list[str]) -> list[dict[str, Any]]:
    return [{"ip": {"address": a.rsplit(":", 1)[0], "port": int(a.rsplit(":", 1)[1])}} for a in addresses]


def eg_input(rendered: list[dict[str, Any]], listener: int, pools: dict[str, list[str]], provider_address: str,
             indexer_port: int, indexer_sds: Path) -> list[dict[str, Any]]:
    """The rendered routing documents with the stand-ins the module
    docstring lists, and nothing else changed."""
    docs = routing(rendered)
    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind == "Gateway":
            d["spec"]["listeners"][0]["port"] = listener
        elif kind == "HTTPRoute":
            d["spec"]["hostnames"] = [HOST]
            for rule in d["spec"]["rules"]:
                for ref in rule.get("backendRefs", []):
                    if ref.get("kind", "Service") == "Service":
                        ref.pop("port")
                        ref.update(group="gateway.envoyproxy.io", kind="Backend")
        elif kind == "Backend" and name == "openai":
            d["spec"] = {"endpoints": ip_endpoints([provider_address])}
        elif kind == "EnvoyPatchPolicy" and name == PATCH:
            idx = next(p for p in d["spec"]["jsonPatches"] if p["name"] == "kvasir-indexer")["operation"]["value"]
            idx["type"] = "STATIC"
            idx.pop("dns_lookup_family", None)
            idx["load_assignment"]["endpoints"] = [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": indexer_port}}}}]}]
            opts = idx["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            cred = opts["http_filters"][0]["typed_config"]["credential"]["typed_config"]["credential"]
            cred["sds_config"]["path_config_source"]["path"] = str(indexer_sds)
    for name, addresses in pools.items():
        docs.append({"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "Backend",
                     "metadata": {"name": f"kvasir-pool-{name}", "namespace": NS},
                     "spec": {"endpoints": ip_endpoints(addresses)}})
    return docs + [credential_secret()]


def extension_policy(rendered: list[dict[str, Any]], tmp: Path, url: str, sha256: str) -> dict[str, Any]:
    """What the controller writes for this install: `kvasirctl compile
    --output envoyextensionpolicy` over the rendered documents and the demo
    keys, with the module's content-addressed URL and digest."""
    d = tmp / f"eep-{sha256[:12]}"
    d.mkdir()
    (d / "install.yaml").write_text(yaml.safe_dump_all(rendered))
    shutil.copy(GW / "demo" / "demo-keys.yaml", d / "demo-keys.yaml")
    r = subprocess.run([str(KVASIRCTL), "compile", str(d), "--target", f"Gateway/{GATEWAY}", "--output",
                        "envoyextensionpolicy", "--wasm-url", url, "--wasm-sha256", sha256],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    eep = json.loads(r.stdout)
    # The response names the engine that served (a test's window on the pick).
    eep["spec"]["wasm"][0]["config"]["filter"] = {"exposeServedEndpoint": True}
    return eep


@dataclass
class Live:
    eg: Any
    dir: Path
    tmp: Path
    port: int
    token: str
    rendered: list[dict[str, Any]]
    docs: list[dict[str, Any]]
    sims: dict[str, Any]
    rec: Server
    trap: Trap
    echo: Server
    load: Server
    indexer_http: int
    wasm: bytes
    modules: dict[str, dict[str, bytes]]
    fetched: dict[str, list[str]]
    service: RoundRobin
    extra: dict[str, Any] = field(default_factory=dict)

    def url(self, sha256: str) -> str:
        """The module's URL as the controller writes it (--wasm-url with
        `{sha256}` replaced), at the replicas' Service."""
        return f"http://127.0.0.1:{self.service.port}/kvasir_filter-{sha256}.wasm"

    def write(self, eep: dict[str, Any] | None) -> None:
        texts = [yaml.safe_dump(d) for d in self.docs + ([eep] if eep else [])]
        write_resources(self.dir / "resources", texts + [wasm_cluster_patch(self.dir, GATEWAY, namespace=NS)])

    def send(self, method: str, path: str, body: Any = None, key: str | None = ACME,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        h = {"host": HOST, **(headers or {})}
        if body is not None:
            h["content-type"] = "application/json"
        if key is not None:
            h["authorization"] = f"Bearer {key}"
        return request(method, self.port, path, json.dumps(body) if body is not None else None, h, timeout=30)

    def chat(self, content: str, model: str = MAIN_MODEL, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        return self.send("POST", "/v1/chat/completions",
                         {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}, **kw)

    def wait_main_serves(self, in_a_row: int = 6) -> None:
        """Until the filter sends requests to main again, `in_a_row` times
        running: it learns main's load from the indexer about once a
        second, in each of Envoy's workers separately."""
        streak = [0]

        def served_by_main():
            status, _, b = self.chat(HARD + uuid.uuid4().hex)
            streak[0] = streak[0] + 1 if status == 200 and json.loads(b)["model"] == MAIN_MODEL else 0
            return streak[0] >= in_a_row

        wait_until("main serving", served_by_main, timeout=30, interval=0.1)

    def failed_open(self) -> int:
        """Requests the filter sent on without a pick (the indexer did not
        answer in time): Envoy's own balancing chose their engine."""
        return self.eg.envoy_stats().get("wasmcustom.kvasir.failopen", 0)

    def picked_chat(self, content: str) -> tuple[int, dict[str, str], bytes] | None:
        """A chat, or None when its pick failed open (on a loaded machine
        the indexer can miss the filter's deadline): what is asserted of a
        pick is asserted of picked requests only."""
        before = self.failed_open()
        out = self.chat(content)
        return None if self.failed_open() != before else out

    def indexer_metric(self, name: str, **labels: str) -> float:
        from kvasir_harness import prom

        return prom.total(request("GET", self.indexer_http, "/metrics", timeout=5)[2].decode(), name, **labels)

    def cluster_stat(self, rule: str, stat: str) -> int:
        i = [r["name"] for r in find(self.rendered, "HTTPRoute", ROUTE)["spec"]["rules"]].index(rule)
        return self.eg.envoy_stats().get(f"cluster.httproute/{NS}/{ROUTE}/rule/{i}.{stat}", 0)


@pytest.fixture(scope="class")
def live(rendered, token, tmp_path_factory) -> Live:
    need(ENVOY_GATEWAY_BIN, ENVOY_BIN, INDEXER_BIN, KVASIRCTL)
    tmp = tmp_path_factory.mktemp("eg-live")
    logdir = tmp / "logs"
    logdir.mkdir()
    with Processes() as procs:
        sims = {"a": procs.add(start_sim(logdir, "main-a", model=MAIN_MODEL)),
                "b": procs.add(start_sim(logdir, "main-b", model=MAIN_MODEL)),
                "s": procs.add(start_sim(logdir, "small-s", model=SMALL_MODEL))}
        for s in sims.values():
            wait_sim(s)
        rec = procs.add(recorder(sims["b"].port))
        trap = procs.add(Trap())
        echo = procs.add(provider())
        load = procs.add(fake_load(sims))
        secrets = secrets_for(logdir)
        grpc, http = free_port(), free_port()

        # The indexer's pools: main knows one of its two engines (seen
        # through the recorder), small only an address outside its cluster
        # (the trap, with the small engine's events and load).
        indexer_argv = [str(INDEXER_BIN), "--grpc-addr", f"127.0.0.1:{grpc}", "--http-addr", f"127.0.0.1:{http}",
                        "--tokenizer", str(TOKENIZER), "--model", MAIN_MODEL, "--scrape-interval-ms", "250",
                        "--grpc-token-file", str(secrets.token_file)]
        small = [("small", trap.address, sims["s"], f"http://{sims['s'].address}/metrics")]

        def start_indexer(main: list[tuple[str, Any, str]]) -> Proc:
            argv = list(indexer_argv)
            for pool, address, engine, metrics in [("main", *m) for m in main] + small:
                argv += ["--endpoint", f"pool={pool},address={address},events=tcp://127.0.0.1:{engine.events},"
                                       f"replay=tcp://127.0.0.1:{engine.replay},metrics={metrics}"]
            p = procs.add(Proc("cache-indexer", argv, logdir))
            wait_until("indexer /readyz", lambda: p.alive() and request("GET", http, "/readyz", timeout=2)[0] == 200)
            return p

        indexer = start_indexer([(rec.address, sims["b"], load.url("b"))])

        # The controller's two replicas behind their Service, both holding
        # the module (steady state).
        wasm = WASM.read_bytes()
        sha = hashlib.sha256(wasm).hexdigest()
        modules = {"old": {sha: wasm}, "new": {sha: wasm}}
        fetched: dict[str, list[str]] = {"old": [], "new": []}
        replicas = {k: procs.add(replica(modules[k], fetched[k])) for k in ("old", "new")}
        service = procs.add(RoundRobin([replicas["old"].port, replicas["new"].port]))

        port = free_port()
        docs = eg_input(rendered, port, {"main": [sims["a"].address, rec.address], "small": [sims["s"].address]},
                        echo.address, grpc, secrets.indexer_sds)
        egdir = tmp / "eg"
        live = Live(None, egdir, tmp, port, token, rendered, docs, sims, rec, trap, echo, load, http, wasm, modules,
                    fetched, service)
        live.extra.update(indexer=indexer, start_indexer=start_indexer, grpc=grpc)
        eep = extension_policy(rendered, tmp, live.url(sha), sha)
        live.extra["eep"] = eep
        live.write(eep)
        live.eg = procs.add(start_envoy_gateway(egdir, None, extension_apis={"enableEnvoyPatchPolicy": True},
                                                runtime_flags=RUNTIME_FLAGS))
        try:
            live.eg.wait_listener(port, timeout=60)

            def through_the_filter():
                status, h, _ = live.chat(HARD + uuid.uuid4().hex)
                return status == 200 and SERVED in h

            wait_until("a request through the filter", through_the_filter, timeout=45, interval=0.3)
            yield live
        except BaseException:
            print(live.eg.proc.log()[-8000:])
            print(live.eg.envoy_logs()[-8000:])
            raise


@pytest.mark.slow
@pytest.mark.usefixtures("live")
class TestOnEnvoyGateway:
    def test_the_patches_are_programmed_under_the_pinned_name_scheme(self, live):
        live.eg.wait_condition("EnvoyPatchPolicy", f"{NS}/{PATCH}", "Programmed", "True")
        live.eg.wait_condition("EnvoyExtensionPolicy", f"{NS}/{EEP_NAME}", "Accepted", "True")
        live.eg.wait_condition("HTTPRoute", f"{NS}/{ROUTE}", "ResolvedRefs", "True")

    def test_the_pick_is_honoured_and_no_engine_sees_an_internal_header(self, live):
        """Main's cluster has two members and the indexer knows one of them
        (the recorder's address): every request is served there, where
        Envoy's own balancing would send about half to the other. The
        engine sees neither the route header (and its token) nor the
        endpoint list."""
        before = len(live.rec.seen)
        served = []
        for i in range(24):
            got = live.picked_chat(HARD + f"{i} {uuid.uuid4().hex}")
            if got is None:
                continue
            status, h, b = got
            assert status == 200, b
            assert json.loads(b)["model"] == MAIN_MODEL
            served.append(h[SERVED])
            if len(served) == 12:
                break
        assert served == [live.rec.address] * 12, served
        seen = live.rec.seen[before:]
        assert len(seen) >= 12
        for method, path, headers in seen:
            assert (method, path) == ("POST", "/v1/chat/completions")
            assert ROUTE_HEADER not in headers and ENDPOINT_HEADER not in headers, headers
            assert live.token not in json.dumps(headers)

    def test_an_address_outside_the_pool_is_never_dialled(self, live):
        """For pool small the indexer knows only an address that is not a
        member of the pool's cluster: its picks name it, Envoy falls back
        to its own balancing over the members, and never dials it."""
        picks = lambda: sum(live.indexer_metric("kvasir_indexer_picks_total", pool="small", decision=d)
                            for d in ("prefix", "load", "no_index"))
        before = picks()
        for i in range(6):
            # Short and without code: cheaper-model-for-easy-prompts sends
            # it to small.
            status, h, b = live.chat(f"What is the capital of France? {i} {uuid.uuid4().hex[:6]}")
            assert status == 200, b
            assert json.loads(b)["model"] == SMALL_MODEL
            assert h[SERVED] == live.sims["s"].address
        assert picks() - before >= 6, "the indexer named no address: the test proves nothing"
        assert live.trap.accepted == 0

    def test_a_client_cannot_select_a_rule(self, live):
        """A client sending the route header, even with the install's real
        token, or an endpoint list: both are removed at the edge (and by
        the filter); the request goes where the policies send it."""
        before = len(live.echo.seen)
        for value in (f"provider/openai/{live.token}", "provider/openai/guess", f"pool/small/{live.token}"):
            status, h, b = live.chat(HARD + uuid.uuid4().hex,
                                     headers={ROUTE_HEADER: value, ENDPOINT_HEADER: live.sims["a"].address})
            assert status == 200, b
            assert json.loads(b)["model"] == MAIN_MODEL and h[SERVED] == live.rec.address
        assert len(live.echo.seen) == before

    def test_the_api_shapes_of_the_gateways_own_answers(self, live):
        """Paths outside the allowlist: 404 in the API's shape; the model
        list is the gateway's, behind the tenant's key; the filter's own
        replies pass unchanged."""
        status, _, b = live.send("GET", "/metrics")
        assert status == 404 and json.loads(b)["error"]["code"] == "not_found", b
        status, _, b = live.send("POST", "/v1/messages/batches", {"x": 1})
        assert status == 404 and json.loads(b)["type"] == "error", b
        status, _, b = live.send("POST", "/v1/chat/completions/", {"x": 1})
        assert status == 404, b
        status, _, b = live.send("GET", "/v1/models")
        assert status == 200 and {m["id"] for m in json.loads(b)["data"]} == {MAIN_MODEL, SMALL_MODEL}, b
        assert live.send("GET", "/v1/models", key=None)[0] == 401
        status, h, b = live.send("GET", "/v1/responses/resp_not_here")
        assert status == 404 and h.get("x-kvasir-reply") == "filter", (h, b)
        assert json.loads(b)["error"]["param"] == "response_id"

    def test_the_provider_gets_its_credential_from_the_cluster_and_nothing_internal(self, live):
        """main saturated (its engines report 10 waiting): burst-to-provider
        sends requests to the provider. The provider rule is reached only
        on the re-match, yet the credential is there (injected at the
        cluster), the client's key is not, the host is the provider's
        (rewritten on the final route, with `hostnames` on the route), and
        no internal header leaves."""
        for name in ("a", "b"):
            live.load.waiting[name] = 10.0
        try:
            def burst():
                status, _, b = live.chat(HARD + uuid.uuid4().hex)
                return status == 200 and json.loads(b)["model"] == PROVIDER_MODEL

            wait_until("a request bursts to the provider", burst, timeout=30, interval=0.3)
        finally:
            for name in ("a", "b"):
                live.load.waiting[name] = 0.0
            live.wait_main_serves()
        path, headers, body = live.echo.seen[-1]
        assert path == "/v1/chat/completions" and body["model"] == PROVIDER_MODEL
        assert headers["authorization"] == PROVIDER_CREDENTIAL
        assert ACME not in json.dumps(headers)
        assert headers["host"] == "api.openai.com"
        assert ROUTE_HEADER not in headers and ENDPOINT_HEADER not in headers, headers
        assert live.token not in json.dumps(headers)

    def test_a_failed_engine_is_retried_on_the_picks_next_endpoint(self, live):
        """The indexer now knows both engines of main; one answers 500 to
        everything. Each request it was picked for first is retried once,
        on the next endpoint of the pick: every client gets a 200 from the
        other engine."""
        grpc = live.extra["grpc"]
        live.extra["indexer"].stop()
        live.extra["indexer"] = live.extra["start_indexer"](
            [(live.rec.address, live.sims["b"], live.load.url("b")),
             (live.sims["a"].address, live.sims["a"], live.load.url("a"))])

        def indexer_healthy():
            s, body = live.eg.envoy_admin_get("/clusters", timeout=5)
            return s == 200 and f"kvasir-indexer::127.0.0.1:{grpc}::health_flags::healthy" in body.decode()

        wait_until("the indexer healthy in Envoy", indexer_healthy, timeout=20, interval=0.2)
        live.wait_main_serves()
        bad = live.sims["b"]
        assert request("POST", bad.port, "/sim/faults", json.dumps({"fail_rate": 1.0}))[0] == 200
        retries0 = live.cluster_stat("main", "upstream_rq_retry")
        failed0 = bad.metric("vllm_sim:requests_failed_total")
        try:
            served = []
            for i in range(40):
                got = live.picked_chat(HARD + f"retry {i} {uuid.uuid4().hex}")
                if got is None:
                    continue
                status, h, b = got
                assert status == 200 and json.loads(b)["model"] == MAIN_MODEL, b
                served.append(h[SERVED])
                if len(served) == 20:
                    break
        finally:
            request("POST", bad.port, "/sim/faults", json.dumps({"fail_rate": 0.0}))
        tried = bad.metric("vllm_sim:requests_failed_total") - failed0
        assert tried >= 1, "the failing engine was never picked first: the test proves nothing"
        assert served == [live.sims["a"].address] * 20, served
        assert live.cluster_stat("main", "upstream_rq_retry") - retries0 >= tried

    def test_without_the_filter_every_route_is_closed(self, live):
        """The controller's EnvoyExtensionPolicy deleted (as before its first
        apply, or with another policy in conflict): nothing reaches an
        engine or the provider; the inference paths answer 503 in their
        API's shape, whatever header a client sends."""
        live.write(None)

        def closed():
            status, _, b = live.chat(HARD)
            return status == 503 and json.loads(b)["error"]["code"] == "gateway_unavailable"

        wait_until("the routes closed", closed, timeout=30, interval=0.3)
        engines = lambda: [s.metric("vllm:request_success_total") for s in live.sims.values()]
        before, echoed, recorded = engines(), len(live.echo.seen), len(live.rec.seen)
        for value in (f"pool/main/{live.token}", f"provider/openai/{live.token}", "kvasir/serving/pool/main"):
            status, h, b = live.chat(HARD, key=None, headers={ROUTE_HEADER: value})
            assert status == 503 and json.loads(b)["error"]["type"] == "server_error", b
            assert SERVED not in h
        status, _, b = live.send("POST", "/v1/messages", {"model": MAIN_MODEL, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "hi"}]},
                                 key=None, headers={ROUTE_HEADER: f"pool/main/{live.token}"})
        assert status == 503 and json.loads(b)["type"] == "error", b
        assert json.loads(b)["error"]["type"] == "overloaded_error"
        status, _, b = live.send("GET", f"/v1/responses/resp_{uuid.uuid4().hex}", key=None)
        assert status == 503, b
        status, _, b = live.send("POST", "/v1/completions", {"model": MAIN_MODEL, "prompt": "hi", "max_tokens": 2},
                                 key=None)
        assert status == 503, b
        assert engines() == before and len(live.echo.seen) == echoed and len(live.rec.seen) == recorded

    def test_a_module_rollout_reaches_the_replica_that_holds_it(self, live):
        """A new controller version rolls out: the replica of the old one
        holds only the old module, the new replica the new one, and the
        policy names the new module's content-addressed URL. Envoy
        Gateway's first fetch reaches the old replica, which answers 503
        with `Connection: close`; its retry reaches the new replica, and
        the filter runs again (with a fixed URL the old replica would have
        answered 200 with the old bytes: a checksum failure, not retried,
        and every route under the policy answering 500)."""
        new = other_build(live.wasm, "rollout")
        sha = hashlib.sha256(new).hexdigest()
        live.modules["old"].clear()
        live.modules["old"][hashlib.sha256(live.wasm).hexdigest()] = live.wasm
        live.modules["new"].clear()
        live.modules["new"][sha] = new
        eep = extension_policy(live.rendered, live.tmp, live.url(sha), sha)
        assert eep["spec"]["wasm"][0]["code"]["http"]["url"].endswith(f"/kvasir_filter-{sha}.wasm")
        live.fetched["old"].clear()
        live.fetched["new"].clear()
        live.service.next = 0       # the next connection reaches the old replica
        live.write(eep)

        def through_the_filter():
            status, h, _ = live.chat(HARD + uuid.uuid4().hex)
            return status == 200 and SERVED in h

        wait_until("the filter back, from the new module", through_the_filter, timeout=45, interval=0.3)
        path = f"/kvasir_filter-{sha}.wasm"
        assert path in live.fetched["old"] and path in live.fetched["new"], live.fetched
        _, dump = live.eg.envoy_admin_get("/config_dump?resource=dynamic_listeners", timeout=5)
        assert sha in dump.decode()


def test_the_patches_find_nothing_under_xds_name_scheme_v2(rendered, tmp_path):
    """Why docs/deploy.md pins the xDS name scheme: under XDSNameSchemeV2
    the listener is named `tcp-<port>`, the first patch finds nothing and
    Envoy Gateway says so on the policy (and the filter would stop every
    request for good). The same documents, Envoy Gateway's other scheme."""
    need(ENVOY_GATEWAY_BIN, ENVOY_BIN)
    port = free_port()
    docs = eg_input(rendered, port, {"main": ["127.0.0.1:9"], "small": ["127.0.0.1:9"]}, "127.0.0.1:9", 9,
                    tmp_path / "sds.yaml")
    with Processes() as procs:
        eg = procs.add(start_envoy_gateway(tmp_path / "eg", [yaml.safe_dump(d) for d in docs],
                                           extension_apis={"enableEnvoyPatchPolicy": True},
                                           runtime_flags={"enabled": ["XDSNameSchemeV2"]}))
        c = eg.wait_condition("EnvoyPatchPolicy", f"{NS}/{PATCH}", "Programmed", "False", timeout=30)
        assert c["reason"] == "ResourceNotFound" and f"{NS}/{GATEWAY}/http" in c["message"], c
