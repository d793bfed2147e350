"""The `kvasir-controller` binary, as deployed, against a scripted API
server: the manifests of gateway-api/ (base + examples) are what the API
server lists, watches stay open and deliver the events the test pushes,
and every write the controller makes is recorded and checked.

There is no kube-apiserver on this machine; this stand-in speaks the API's
JSON (lists, watch event lines, `Status` errors, resourceVersion checks on
the Lease) for exactly the calls the controller makes. The reconcile logic
itself is tested request by request in controller/tests/mock_api.rs; this
file proves the shipped binary: kubeconfig, watches, leader election,
readiness, the served module, /metrics, SIGTERM.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from kvasir_harness import WASM, Proc, free_port, request, wait_until

REPO = Path(__file__).resolve().parents[2]
GW = REPO / "gateway-api"
CONTROLLER = REPO / "target" / "release" / "kvasir-controller"
GENERATED_EEP = GW / "generated" / "envoyextensionpolicy.yaml"
WASM_URL = "http://kvasir-controller.kvasir-system.svc.cluster.local:8080/kvasir_filter.wasm"
KVASIR = {"InferencePolicy": "inferencepolicies", "InferenceTenant": "inferencetenants",
          "InferenceProvider": "inferenceproviders", "InferenceSettings": "inferencesettings"}
EEP_PATH = "/apis/gateway.envoyproxy.io/v1alpha1/namespaces/serving/envoyextensionpolicies"
LEASE_PATH = "/apis/coordination.k8s.io/v1/namespaces/kvasir-system/leases/kvasir-controller"


def collection(kind: str) -> str:
    if kind in KVASIR:
        return f"/apis/kvasir.dev/v1alpha1/namespaces/serving/{KVASIR[kind]}"
    if kind == "InferencePool":
        return "/apis/inference.networking.k8s.io/v1/namespaces/serving/inferencepools"
    if kind == "Secret":
        return "/api/v1/namespaces/serving/secrets"
    raise KeyError(kind)


def manifests() -> list[dict[str, Any]]:
    """The kinds the controller reads, from base/ and examples/, as the API
    server stores them (uid, resourceVersion, generation; Secrets'
    stringData folded into data)."""
    out = []
    for p in sorted((GW / "base").glob("*.yaml")) + sorted((GW / "examples").glob("*.yaml")):
        if p.name == "kustomization.yaml":
            continue
        for d in yaml.safe_load_all(p.read_text()):
            if not d or d.get("kind") not in {*KVASIR, "InferencePool", "Secret"}:
                continue
            if d["metadata"].get("namespace") != "serving":
                continue
            d = copy.deepcopy(d)
            m = d["metadata"]
            m.update(uid=f"uid-{d['kind']}-{m['name']}", resourceVersion="1", generation=1,
                     creationTimestamp="2026-12-05T07:00:00Z")
            if d["kind"] == "Secret" and "stringData" in d:
                data = d.setdefault("data", {})
                for k, v in d.pop("stringData").items():
                    data[k] = base64.b64encode(v.encode()).decode()
            out.append(d)
    return out


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class FakeApi:
    """The API server's side of the controller's calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        for d in manifests():
            self.objects[(collection(d["kind"]), d["metadata"]["name"])] = d
        self.rv = 100
        self.lease: dict[str, Any] | None = None
        self.writes: list[dict[str, Any]] = []
        self.watches: dict[str, list[queue.Queue]] = {}
        self.stopping = threading.Event()

    def items(self, coll: str, metadata_only: bool) -> list[dict[str, Any]]:
        with self.lock:
            found = [copy.deepcopy(o) for (c, _), o in sorted(self.objects.items()) if c == coll]
        if metadata_only:
            return [{"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": o["metadata"]}
                    for o in found]
        return found

    def push(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        """Stores `obj` and delivers a watch event to every open watch."""
        coll = collection(kind)
        with self.lock:
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.objects[(coll, obj["metadata"]["name"])] = obj
            queues = list(self.watches.get(coll, []))
        for q in queues:
            q.put({"type": event, "object": obj})

    def written(self, method: str, path: str, who: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [w for w in self.writes
                    if w["method"] == method and w["path"] == path and who in (None, w["who"])]


def make_handler(api: FakeApi):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def strip(self) -> None:
            """`/c-NAME/...`: the client is replica NAME (its kubeconfig's
            server URL carries the prefix), so writes can be told apart."""
            self.who = ""
            if self.path.startswith("/c-"):
                first, _, rest = self.path[3:].partition("/")
                self.who, self.path = first, "/" + rest

        def reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self) -> bytes:
            n = int(self.headers.get("content-length") or 0)
            return self.rfile.read(n) if n else b""

        def do_GET(self) -> None:  # noqa: N802
            self.strip()
            u = urlsplit(self.path)
            q = parse_qs(u.query)
            if u.path == LEASE_PATH:
                with api.lock:
                    lease = copy.deepcopy(api.lease)
                return self.reply(200, lease) if lease else self.reply(404, status(404, "NotFound", "leases \"kvasir-controller\" not found"))
            if "watch" in q:
                return self.watch(u.path)
            for kind in [*KVASIR, "InferencePool", "Secret"]:
                coll = collection(kind)
                if u.path == coll:
                    meta_only = "PartialObjectMetadata" in (self.headers.get("accept") or "")
                    return self.reply(200, {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": str(api.rv)},
                                            "items": api.items(coll, meta_only)})
                if u.path.startswith(coll + "/"):
                    with api.lock:
                        o = api.objects.get((coll, u.path[len(coll) + 1:]))
                    return self.reply(200, o) if o else self.reply(404, status(404, "NotFound", f"{u.path} not found"))
            if u.path == EEP_PATH:
                return self.reply(200, {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyExtensionPolicyList",
                                        "metadata": {"resourceVersion": "1"}, "items": []})
            self.reply(404, status(404, "NotFound", f"{u.path} not served here"))

        def watch(self, path: str) -> None:
            q: queue.Queue = queue.Queue()
            with api.lock:
                api.watches.setdefault(path, []).append(q)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            deadline = time.monotonic() + 280
            try:
                while not api.stopping.is_set() and time.monotonic() < deadline:
                    try:
                        ev = q.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    line = json.dumps(ev).encode() + b"\n"
                    self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                with api.lock:
                    api.watches[path].remove(q)
                self.close_connection = True

        def record(self, method: str) -> tuple[str, dict[str, Any]]:
            u = urlsplit(self.path)
            raw = self.body()
            body = json.loads(raw) if raw else {}
            with api.lock:
                api.writes.append({"who": self.who, "method": method, "path": u.path, "query": u.query,
                                   "content_type": self.headers.get("content-type"), "body": copy.deepcopy(body), "raw": raw})
            return u.path, body

        def do_POST(self) -> None:  # noqa: N802
            self.strip()
            path, body = self.record("POST")
            if path == LEASE_PATH.rsplit("/", 1)[0]:
                with api.lock:
                    if api.lease:
                        return self.reply(409, status(409, "AlreadyExists", "lease exists"))
                    body["metadata"]["resourceVersion"] = "1"
                    api.lease = body
                return self.reply(201, body)
            self.reply(404, status(404, "NotFound", path))

        def do_PUT(self) -> None:  # noqa: N802
            self.strip()
            path, body = self.record("PUT")
            if path != LEASE_PATH:
                return self.reply(404, status(404, "NotFound", path))
            with api.lock:
                if not api.lease or body["metadata"].get("resourceVersion") != api.lease["metadata"]["resourceVersion"]:
                    return self.reply(409, status(409, "Conflict", "the object has been modified"))
                body["metadata"]["resourceVersion"] = str(int(api.lease["metadata"]["resourceVersion"]) + 1)
                api.lease = body
            self.reply(200, body)

        def do_PATCH(self) -> None:  # noqa: N802
            self.strip()
            path, body = self.record("PATCH")
            if (self.headers.get("content-type") or "").startswith("application/apply-patch"):
                body.setdefault("metadata", {}).update(uid="uid-applied", resourceVersion="1")
                return self.reply(200, body)
            sub = path.endswith("/status")
            base = path[: -len("/status")] if sub else path
            coll, _, name = base.rpartition("/")
            with api.lock:
                o = copy.deepcopy(api.objects.get((coll, name)))
            if o is None:
                return self.reply(404, status(404, "NotFound", path))
            if sub:
                o["status"] = body.get("status")
            else:
                o["metadata"]["finalizers"] = body.get("metadata", {}).get("finalizers", [])
            self.reply(200, o)

        def do_DELETE(self) -> None:  # noqa: N802
            self.strip()
            self.record("DELETE")
            self.reply(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 200})

    return Handler


@pytest.fixture
def fake_api():
    api = FakeApi()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(api))
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield api, server.server_address[1]
    finally:
        api.stopping.set()
        server.shutdown()
        server.server_close()


def kubeconfig(path: Path, port: int, who: str = "") -> Path:
    prefix = f"/c-{who}" if who else ""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{port}{prefix}"}}],
        "users": [{"name": "test", "user": {}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "serving"}}],
    }))
    return path


def conditions(write: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in write["body"]["status"]["conditions"]}


@pytest.mark.skipif(not CONTROLLER.exists(), reason="make build builds kvasir-controller")
def test_the_controller_binary_programs_the_examples_and_guards_the_last_good_config(fake_api, tmp_path):
    api, api_port = fake_api
    http_port, metrics_port = free_port(), free_port()
    proc = Proc("controller", [str(CONTROLLER), "--namespace", "serving", "--wasm-file", str(WASM),
                               "--wasm-url", WASM_URL, "--identity", "ctl-a", "--lease-namespace", "kvasir-system",
                               "--http-addr", f"127.0.0.1:{http_port}", "--metrics-addr", f"127.0.0.1:{metrics_port}"],
                tmp_path, env={"KUBECONFIG": str(kubeconfig(tmp_path / "kubeconfig", api_port)),
                               "RUST_LOG": "info"})
    try:
        wait_until("healthz", lambda: proc.alive() and _ok(http_port, "/healthz"), timeout=30)
        wait_until("readyz", lambda: _ok(http_port, "/readyz"), timeout=30)
        wait_until("the lease is taken", lambda: api.lease is not None, timeout=30)
        assert api.lease["spec"]["holderIdentity"] == "ctl-a"

        # The policy: exactly the generated file, with the served module's digest.
        eep_path = f"{EEP_PATH}/kvasir-gateway-inference-gateway"
        wait_until("the extension policy is applied", lambda: api.written("PATCH", eep_path), timeout=30)
        w = api.written("PATCH", eep_path)[0]
        assert w["content_type"].startswith("application/apply-patch")
        q = parse_qs(w["query"])
        assert q["fieldManager"] == ["kvasir-controller"] and "force" not in q, w["query"]
        want = yaml.safe_load(GENERATED_EEP.read_text())
        digest = hashlib.sha256(Path(WASM).read_bytes()).hexdigest()
        want["spec"]["wasm"][0]["code"]["http"].update(url=WASM_URL, sha256=digest)
        assert w["body"] == want
        assert b"sk-acme-example" not in w["raw"] and b"sk-eval-example" not in w["raw"]

        # Every kvasir.dev object reports Accepted / ResolvedRefs / Programmed.
        names = [(KVASIR[k], n) for (c, n), o in api.objects.items() for k in [o["kind"]] if k in KVASIR]
        assert len(names) >= 8
        for plural, name in names:
            p = f"/apis/kvasir.dev/v1alpha1/namespaces/serving/{plural}/{name}/status"
            wait_until(f"status of {plural}/{name}", lambda p=p: api.written("PATCH", p), timeout=15)
            c = conditions(api.written("PATCH", p)[-1])
            assert {t: c[t]["status"] for t in c} == {"Accepted": "True", "ResolvedRefs": "True", "Programmed": "True"}, (name, c)

        # The indexer's pools, and the roll of its Deployment.
        cm = api.written("PATCH", "/api/v1/namespaces/serving/configmaps/kvasir-indexer-pools")
        assert cm, "the pools ConfigMap was not written"
        pools = yaml.safe_load(cm[-1]["body"]["data"]["pools.yaml"])["pools"]
        assert sorted(p["name"] for p in pools) == ["main", "small"]
        dep = api.written("PATCH", "/apis/apps/v1/namespaces/serving/deployments/kvasir-indexer")
        # A merge patch: an apply would create a Deployment where none runs.
        assert dep[-1]["content_type"].startswith("application/merge-patch+json"), dep[-1]["content_type"]
        assert dep[-1]["body"]["spec"]["template"]["metadata"]["annotations"]["kvasir.dev/pools-sha256"].startswith("sha256:")

        # The module Envoy Gateway downloads, and the metrics.
        code, headers, body = request("GET", http_port, "/kvasir_filter.wasm", timeout=5)
        assert code == 200 and body == Path(WASM).read_bytes()
        _, _, m = request("GET", metrics_port, "/metrics", timeout=5)
        text = m.decode()
        assert "kvasir_controller_leader 1" in text
        assert 'kvasir_controller_config_bytes{namespace="serving",target="Gateway/inference-gateway"}' in text

        # An invalid edit: Accepted=False with the path; the policy is not rewritten.
        applied = len(api.written("PATCH", eep_path))
        bad = copy.deepcopy(api.objects[(collection("InferencePolicy"), "batch-when-idle")])
        bad["metadata"]["generation"] = 2
        bad["spec"]["action"]["route"]["rewriteModel"] = "no-such-model"
        api.push("InferencePolicy", "MODIFIED", bad)
        sp = "/apis/kvasir.dev/v1alpha1/namespaces/serving/inferencepolicies/batch-when-idle/status"
        wait_until("the invalid policy's status", lambda: any(
            conditions(w)["Accepted"]["status"] == "False" for w in api.written("PATCH", sp)), timeout=15)
        c = conditions(api.written("PATCH", sp)[-1])["Accepted"]
        assert c["observedGeneration"] == 2 and c["message"].startswith("spec.action.route.rewriteModel"), c
        time.sleep(0.5)
        assert len(api.written("PATCH", eep_path)) == applied, "an invalid policy reached the filter's config"
        assert proc.alive()
    finally:
        proc.stop()
    assert proc.p.returncode == 0, proc.log()
    # On SIGTERM the leader hands the Lease back.
    assert api.lease["spec"].get("holderIdentity", "") in ("", None), api.lease


def _ok(port: int, path: str) -> bool:
    try:
        return request("GET", port, path, timeout=2)[0] == 200
    except OSError:
        return False


def start_controller(tmp_path: Path, api_port: int, who: str) -> tuple[Proc, int, int]:
    http_port, metrics_port = free_port(), free_port()
    proc = Proc(f"controller-{who}", [str(CONTROLLER), "--namespace", "serving", "--wasm-file", str(WASM),
                                      "--wasm-url", WASM_URL, "--identity", who, "--lease-namespace", "kvasir-system",
                                      "--http-addr", f"127.0.0.1:{http_port}", "--metrics-addr", f"127.0.0.1:{metrics_port}"],
                tmp_path, env={"KUBECONFIG": str(kubeconfig(tmp_path / f"kubeconfig-{who}", api_port, who))})
    return proc, http_port, metrics_port


WRITES = ("PATCH", "POST", "PUT", "DELETE")


@pytest.mark.skipif(not CONTROLLER.exists(), reason="make build builds kvasir-controller")
def test_two_replicas_one_writer_and_a_handover(fake_api, tmp_path):
    api, api_port = fake_api
    a, a_http, _ = start_controller(tmp_path, api_port, "a")
    b = None
    try:
        wait_until("a leads", lambda: api.lease is not None and api.lease["spec"]["holderIdentity"] == "a", timeout=30)
        eep_path = f"{EEP_PATH}/kvasir-gateway-inference-gateway"
        wait_until("a applies", lambda: api.written("PATCH", eep_path, who="a"), timeout=30)
        b, b_http, b_metrics = start_controller(tmp_path, api_port, "b")
        wait_until("b is ready (its caches are warm)", lambda: _ok(b_http, "/readyz"), timeout=30)
        time.sleep(1.0)
        with api.lock:
            b_writes = [w for w in api.writes if w["who"] == "b" and w["method"] in WRITES]
        assert b_writes == [], f"a follower wrote: {b_writes}"
        assert "kvasir_controller_leader 0" in request("GET", b_metrics, "/metrics", timeout=5)[2].decode()

        # a stops (SIGTERM): it hands the Lease back, b takes it on its next
        # round and, as the new leader, reconciles everything.
        a.stop()
        assert a.p.returncode == 0, a.log()
        wait_until("b leads", lambda: api.lease["spec"].get("holderIdentity") == "b", timeout=15)
        wait_until("b applies", lambda: api.written("PATCH", eep_path, who="b"), timeout=15)
        assert api.lease["spec"]["leaseTransitions"] >= 1
        assert "kvasir_controller_leader 1" in request("GET", b_metrics, "/metrics", timeout=5)[2].decode()
    finally:
        a.stop()
        if b:
            b.stop()
