"""Real control planes, off-cluster: etcd and kube-apiserver on 127.0.0.1
with a kubeconfig `kubectl` uses, Envoy Gateway in standalone mode (File
provider, Host infrastructure) running the project's own Envoy (with the
statuses it computes, read from its log, and its Envoy's stats), `egctl x
translate` (Gateway API YAML in, xDS out, no control plane), and `kubectl
kustomize`. Envoy Gateway can also run as its Helm chart runs it, with its
Kubernetes provider against the API server here
(`start_envoy_gateway_kubernetes`, in namespaces of its own).

The binaries are built from Go modules by `scripts/go-tools.sh` into
`.tools/bin/` (tools/README.md); each path can be overridden by its
environment variable (`ETCD_BIN`, `KUBE_APISERVER_BIN`, `ENVOY_GATEWAY_BIN`,
`EGCTL_BIN`, `KUBECTL`). Keys and certificates are made with the `openssl`
command line.

Envoy Gateway standalone binds fixed ports on every interface (xDS 18000,
its wasm module server 18002, the File provider's health probe 8081, and
its Envoy's readiness listener 19003; its admin port, 19000, is moved to a
free one and its metrics server, 19001, switched off here): only one can
run on a machine at a time. `start_envoy_gateway` holds a machine-wide lock
for its lifetime and refuses to start when one of those ports is taken.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.client import HTTPSConnection
from pathlib import Path
from typing import Iterable

from .paths import ENVOY_BIN, REPO
from .procs import START_TIMEOUT_S, Exited, Proc, free_port, request, wait_until

TOOLS_BIN = REPO / ".tools" / "bin"
ETCD_BIN = Path(os.environ.get("ETCD_BIN", TOOLS_BIN / "etcd"))
KUBE_APISERVER_BIN = Path(os.environ.get("KUBE_APISERVER_BIN", TOOLS_BIN / "kube-apiserver"))
ENVOY_GATEWAY_BIN = Path(os.environ.get("ENVOY_GATEWAY_BIN", TOOLS_BIN / "envoy-gateway"))
EGCTL_BIN = Path(os.environ.get("EGCTL_BIN", TOOLS_BIN / "egctl"))
KUBECTL = os.environ.get("KUBECTL") or shutil.which("kubectl") or "kubectl"

# Envoy Gateway's ports that no configuration moves (v1.9.1), each on every
# interface: the xDS server (internal/xds/runner, 18000), the wasm module
# server (internal/wasm/httpserver.go, 18002, started in host mode too) and
# the File provider's health probe (internal/provider/file/file.go, 8081,
# /readyz and /healthz); and the readiness listener of the Envoy it launches
# (internal/xds/bootstrap/bootstrap.go EnvoyReadinessPort, 19003).
EG_FIXED_PORTS = (18000, 18002, 8081, 19003)
EG_HEALTH_PORT = 8081
EG_CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"
EG_LOCK = Path(os.environ.get("KVASIR_EG_LOCK", "/tmp/kvasir-envoy-gateway.lock"))
# The kinds standalone Envoy Gateway's File provider reads (v1.9.1,
# internal/gatewayapi/resource/load.go); any other kind in its file fails
# the whole load. No EndpointSlice: a Service backendRef has no endpoints
# there, so tests route to an Envoy Gateway Backend instead.
EG_FILE_KINDS = frozenset({
    "EnvoyProxy", "GatewayClass", "Gateway", "HTTPRoute", "GRPCRoute", "TCPRoute", "UDPRoute", "TLSRoute",
    "Namespace", "Service", "EnvoyPatchPolicy", "ClientTrafficPolicy", "BackendTrafficPolicy", "SecurityPolicy",
    "HTTPRouteFilter", "Backend", "Secret", "ConfigMap", "BackendTLSPolicy", "EnvoyExtensionPolicy",
    "ReferenceGrant"})
# One status in the File provider's log: kind, the status (YAML), the key.
_STATUS_LOG = re.compile(r'Got new status for (\w+)\n(.*?)\t\{"runner": "provider", "key": "([^"]+)"\}', re.S)

# kube-apiserver is ready 3-4 s after start here (2 cores); the deadline
# leaves room for a loaded machine.
APISERVER_START_TIMEOUT_S = 90.0


def missing(*bins: Path | str) -> list[str]:
    """The given executables that are not there (for a clear skip or
    failure message: `bash scripts/go-tools.sh` builds them)."""
    out = []
    for b in bins:
        p = Path(b)
        if not (p.is_file() and os.access(p, os.X_OK)) and shutil.which(str(b)) is None:
            out.append(str(b))
    return out


def _run(argv: list[str], timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r


# Keys and certificates
# ---------------------------------------------------------------------------


@dataclass
class Pki:
    """A throwaway CA, a serving certificate for 127.0.0.1/localhost signed
    by it, and a service-account signing key, all under `dir`."""

    dir: Path
    ca: Path
    ca_key: Path
    cert: Path
    key: Path
    sa_key: Path
    sa_pub: Path


def make_pki(dir: Path, cn: str = "kube-apiserver") -> Pki:
    """ECDSA P-256 keys (fast to make) with the `openssl` command line;
    valid one day."""
    dir.mkdir(parents=True, exist_ok=True)
    ssl_ = shutil.which("openssl")
    if ssl_ is None:
        raise FileNotFoundError("openssl not installed")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca, ca_key = dir / "ca.crt", dir / "ca.key"
    _run([ssl_, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
          "-subj", "/CN=kvasir-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
          "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
    cert, key, csr = dir / "tls.crt", dir / "tls.key", dir / "tls.csr"
    _run([ssl_, "req", "-new", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}"])
    ext = dir / "tls.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                   "basicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\n"
                   "extendedKeyUsage=serverAuth\n")
    _run([ssl_, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
          "-out", str(cert), "-days", "1", "-extfile", str(ext)])
    sa_key, sa_pub = dir / "sa.key", dir / "sa.pub"
    _run([ssl_, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", str(sa_key)])
    _run([ssl_, "pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub)])
    return Pki(dir, ca, ca_key, cert, key, sa_key, sa_pub)


# etcd
# ---------------------------------------------------------------------------


@dataclass
class Etcd:
    proc: Proc
    client_port: int
    peer_port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def healthy(self) -> bool:
        status, _, body = request("GET", self.client_port, "/health", timeout=2)
        return status == 200 and json.loads(body).get("health") == "true"

    def stop(self) -> None:
        self.proc.stop()


def start_etcd(dir: Path, name: str = "etcd", timeout: float = START_TIMEOUT_S) -> Etcd:
    """A one-member etcd with its data in `dir/<name>-data`, client and peer
    URLs on free 127.0.0.1 ports, no fsync (a test's data is throwaway);
    returns once `/health` says true (bounded). Its log is `dir/<name>.log`."""
    if m := missing(ETCD_BIN):
        raise FileNotFoundError(f"{m[0]} missing: run `bash scripts/go-tools.sh`")
    dir.mkdir(parents=True, exist_ok=True)
    data = dir / f"{name}-data"
    client, peer = free_port(), free_port()
    argv = [str(ETCD_BIN), "--name", name, "--data-dir", str(data),
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"{name}=http://127.0.0.1:{peer}",
            "--initial-cluster-state", "new",
            "--unsafe-no-fsync", "--log-level", "warn"]
    e = Etcd(Proc(name, argv, dir), client, peer, data)

    def up() -> bool:
        if not e.proc.alive():
            raise Exited(f"{name} exited: {e.proc.log()[-3000:]}")
        return e.healthy()

    try:
        wait_until(f"{name} /health", up, timeout)
    except BaseException:
        e.stop()
        raise
    return e


# kube-apiserver
# ---------------------------------------------------------------------------


@dataclass
class ApiServer:
    proc: Proc
    port: int
    token: str
    pki: Pki
    kubeconfig: Path
    dir: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """GET `path` as the admin (token), verifying the serving
        certificate against the test CA."""
        ctx = ssl.create_default_context(cafile=str(self.pki.ca))
        c = HTTPSConnection("127.0.0.1", self.port, context=ctx, timeout=timeout)
        try:
            c.request("GET", path, headers={"authorization": f"Bearer {self.token}"})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 60.0,
                check: bool = True) -> subprocess.CompletedProcess:
        """`kubectl --kubeconfig <ours> args...`; raises on failure when
        `check` (with kubectl's stderr), else returns the result."""
        argv = [KUBECTL, "--kubeconfig", str(self.kubeconfig), *args]
        r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-3000:]}")
        return r

    def stop(self) -> None:
        self.proc.stop()


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, name: str = "kvasir-test") -> Path:
    """A kubeconfig (JSON, which is YAML) for one cluster and a token user."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": "admin", "namespace": "default"}}],
        "current-context": name,
    }
    path.write_text(json.dumps(cfg, indent=2))
    path.chmod(0o600)
    return path


def start_apiserver(dir: Path, etcd: Etcd | str, name: str = "kube-apiserver", authorization: str = "RBAC",
                    extra_args: Iterable[str] = (), timeout: float = APISERVER_START_TIMEOUT_S) -> ApiServer:
    """kube-apiserver on a free 127.0.0.1 port against `etcd` (an Etcd or a
    client URL): a fresh CA and serving certificate, a service-account key,
    a static token for `admin` in `system:masters` (allowed everything under
    RBAC; `authorization="AlwaysAllow"` switches authorization off), client
    certificates signed by the CA also accepted. Returns once `/readyz` is
    200 (bounded); `kubeconfig` is ready for `kubectl`.

    No controller-manager or scheduler runs: objects are stored and
    validated (schemas, CEL, admission), nothing reconciles them."""
    if m := missing(KUBE_APISERVER_BIN):
        raise FileNotFoundError(f"{m[0]} missing: run `bash scripts/go-tools.sh`")
    dir.mkdir(parents=True, exist_ok=True)
    pki = make_pki(dir / f"{name}-pki")
    token = secrets.token_hex(16)
    tokens = dir / f"{name}-tokens.csv"
    tokens.write_text(f'{token},admin,admin-uid,"system:masters"\n')
    tokens.chmod(0o600)
    port = free_port()
    etcd_url = etcd.url if isinstance(etcd, Etcd) else etcd
    argv = [str(KUBE_APISERVER_BIN),
            "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(port),
            "--tls-cert-file", str(pki.cert), "--tls-private-key-file", str(pki.key),
            "--client-ca-file", str(pki.ca),
            "--token-auth-file", str(tokens),
            "--authorization-mode", authorization,
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(pki.sa_pub),
            "--service-account-signing-key-file", str(pki.sa_key),
            "--service-cluster-ip-range", "10.0.0.0/24",
            "--allow-privileged=true",
            # No controller-manager creates service-account tokens here.
            "--disable-admission-plugins", "ServiceAccount",
            # The `kubernetes` Service's endpoint would be 127.0.0.1, which
            # Endpoints refuse (loopback): nothing in-cluster needs it here.
            "--endpoint-reconciler-type", "none",
            "--profiling=false",
            *extra_args]
    kubeconfig = write_kubeconfig(dir / f"{name}.kubeconfig", f"https://127.0.0.1:{port}", pki.ca, token)
    a = ApiServer(Proc(name, argv, dir), port, token, pki, kubeconfig, dir)

    def ready() -> bool:
        if not a.proc.alive():
            raise Exited(f"{name} exited: {a.proc.log()[-4000:]}")
        status, _ = a.get("/readyz", timeout=2)
        return status == 200

    try:
        wait_until(f"{name} /readyz", ready, timeout, interval=0.25)
    except BaseException:
        a.stop()
        raise
    return a


def server_version(api: ApiServer) -> dict:
    """The server's /version (gitVersion is the one go-tools.sh stamped)."""
    status, body = api.get("/version")
    if status != 200:
        raise RuntimeError(f"/version answered {status}: {body[:500]!r}")
    return json.loads(body)


# Envoy Gateway, standalone
# ---------------------------------------------------------------------------


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def envoy_version(envoy: Path = ENVOY_BIN) -> str:
    """X.Y.Z of an Envoy binary (`envoy --version`)."""
    out = _run([str(envoy), "--version"]).stdout
    m = re.search(r"/(\d+\.\d+\.\d+)/", out)
    if not m:
        raise RuntimeError(f"no version in `envoy --version`: {out!r}")
    return m.group(1)


def install_local_envoy(config_home: Path, data_home: Path, versions: Iterable[str],
                        envoy: Path = ENVOY_BIN) -> None:
    """Makes func-e (which Envoy Gateway's host infrastructure runs Envoy
    through) find `envoy` already installed under each version name, so it
    runs that binary and downloads nothing: func-e resolves a requested
    version X.Y.Z to `<dataHome>/envoy-versions/X.Y.Z/bin/envoy` and only
    downloads when that file is missing. The first version is also written
    to `<configHome>/envoy-version`, func-e's choice when it is asked for no
    version: Envoy Gateway v1.9.1 asks for none unless an EnvoyProxy sets
    `provider.host.envoyVersion` (it cannot read one from its default image
    reference, which ends in a digest), and func-e would then look the
    latest release up online."""
    versions = list(versions)
    config_home.mkdir(parents=True, exist_ok=True)
    (config_home / "envoy-version").write_text(versions[0] + "\n")
    for v in versions:
        d = data_home / "envoy-versions" / v / "bin"
        d.mkdir(parents=True, exist_ok=True)
        link = d / "envoy"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path(envoy).resolve())


def write_resources(dir: Path, docs: str | Iterable[str], name: str = "resources.yaml") -> Path:
    """Writes Gateway API YAML (one string, or documents joined with
    `---`) where Envoy Gateway's File provider watches; rewriting the file
    is an update."""
    dir.mkdir(parents=True, exist_ok=True)
    text = docs if isinstance(docs, str) else "\n---\n".join(d.strip() for d in docs) + "\n"
    tmp = dir / f".{name}.tmp"
    tmp.write_text(text)
    tmp.replace(dir / name)
    return dir / name


@dataclass
class EnvoyGateway:
    """A standalone Envoy Gateway and the Envoy it launched (found through
    func-e's run folders)."""

    proc: Proc
    dir: Path
    resources: Path
    admin_port: int
    envoy_versions: list[str]
    _lock: object = field(repr=False, default=None)

    @property
    def runtime_dir(self) -> Path:
        return self.dir / "runtime"

    @property
    def state_dir(self) -> Path:
        return self.dir / "state"

    def envoy_admin(self) -> str | None:
        """host:port of the launched Envoy's admin (func-e writes
        `<runtimeDir>/<runID>/admin-address.txt`), None before it is up."""
        found = sorted(self.runtime_dir.glob("*/admin-address.txt"), key=lambda p: p.stat().st_mtime)
        if not found:
            return None
        text = found[-1].read_text().strip()
        return text or None

    def envoy_admin_get(self, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
        addr = self.envoy_admin()
        if addr is None:
            raise RuntimeError("no Envoy launched yet")
        port = int(addr.rsplit(":", 1)[1])
        status, _, body = request("GET", port, path, timeout=timeout)
        return status, body

    def envoy_logs(self) -> str:
        """stdout and stderr of every Envoy func-e ran for it."""
        parts = []
        for p in sorted(self.state_dir.rglob("std*.log")):
            parts.append(f"== {p}\n{p.read_text(errors='replace')}")
        return "\n".join(parts)

    def statuses(self) -> dict[tuple[str, str], dict]:
        """The latest status Envoy Gateway computed for each resource, by
        (kind, "namespace/name"). Standalone mode has no API server to write
        status to: its File provider logs each one ("Got new status for
        <Kind>", the status as YAML, then the resource's key)."""
        import yaml

        out: dict[tuple[str, str], dict] = {}
        for m in _STATUS_LOG.finditer(self.proc.log()):
            try:
                out[(m.group(1), m.group(3))] = yaml.safe_load(m.group(2)) or {}
            except yaml.YAMLError:
                continue
        return out

    def condition(self, kind: str, key: str, type_: str) -> dict | None:
        """The latest condition `type_` of resource `kind` `key`
        ("namespace/name"): a policy's first ancestor's, a route's first
        parent's, else the resource's own."""
        st = self.statuses().get((kind, key))
        if st is None:
            return None
        conds = st.get("conditions") or []
        for holder in ("ancestors", "parents"):
            if st.get(holder):
                conds = st[holder][0].get("conditions") or []
        return next((c for c in conds if c.get("type") == type_), None)

    def wait_condition(self, kind: str, key: str, type_: str, status: str = "True", reason: str | None = None,
                       timeout: float = 30.0) -> dict:
        """Until resource `kind` `key`'s condition `type_` has `status`
        (and `reason`, when given); returns it (bounded)."""
        def holds():
            if not self.proc.alive():
                raise Exited(f"envoy-gateway exited: {self.proc.log()[-4000:]}")
            c = self.condition(kind, key, type_)
            return c if c and c.get("status") == status and reason in (None, c.get("reason")) else None

        return wait_until(f"{kind} {key} {type_}={status}{'/' + reason if reason else ''}", holds, timeout,
                          interval=0.2)

    def envoy_stats(self) -> dict[str, int]:
        """The launched Envoy's counters and gauges by name."""
        status, body = self.envoy_admin_get("/stats?format=json", timeout=5)
        if status != 200:
            raise RuntimeError(f"/stats answered {status}")
        return {s["name"]: s["value"] for s in json.loads(body)["stats"] if "value" in s}

    def wait_listener(self, port: int, timeout: float = START_TIMEOUT_S) -> None:
        """Until the launched Envoy is LIVE (admin `/ready`; an Envoy whose
        first cluster update was rejected lists its listeners but never gets
        there, nor accepts connections) and has a listener on `port`."""

        def up() -> bool:
            if not self.proc.alive():
                raise Exited(f"envoy-gateway exited: {self.proc.log()[-4000:]}")
            if self.envoy_admin() is None:
                return False
            if self.envoy_admin_get("/ready")[0] != 200:
                return False
            status, body = self.envoy_admin_get("/listeners?format=json")
            return status == 200 and f'"port_value": {port}' in json.dumps(json.loads(body))

        wait_until(f"Envoy Gateway's Envoy listening on {port}", up, timeout, interval=0.2)

    def stop(self) -> None:
        """SIGTERM to Envoy Gateway's process group (it stops its Envoy),
        then the lock is released."""
        try:
            self.proc.stop()
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None


def wasm_cluster_patch(dir: Path, gateway: str, namespace: str = "default",
                       name: str = "kvasir-host-wasm-cluster") -> str:
    """An EnvoyPatchPolicy (YAML) that lets a wasm EnvoyExtensionPolicy load
    under Envoy Gateway standalone (`start_envoy_gateway(dir, ...,
    extension_apis={"enableEnvoyPatchPolicy": True})`).

    Envoy Gateway v1.9.1 fetches the module itself and serves it to Envoy
    from its wasm server (port 18002) through a `wasm_cluster` built for a
    pod: the address `envoy-gateway.envoy-gateway-system.svc.cluster.local`,
    the CA file `/certs/ca.crt` (missing on a host, so Envoy rejects the
    whole cluster update), and a client certificate from the in-memory
    `envoy` Secret, which standalone mode signs with a fresh CA at every
    start while the wasm server checks clients against the CA on disk. The
    patch points the cluster at 127.0.0.1, at the CA and the client
    certificate `certgen --local` wrote under `<dir>/config/certs/envoy/`."""
    certs = dir / "config" / "certs" / "envoy"
    base = "/transport_socket/typed_config/common_tls_context"
    ops = [
        {"op": "replace", "path": "/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address/address",
         "value": "127.0.0.1"},
        {"op": "replace", "path": f"{base}/validation_context/trusted_ca/filename", "value": str(certs / "ca.crt")},
        {"op": "remove", "path": f"{base}/tls_certificate_sds_secret_configs"},
        {"op": "add", "path": f"{base}/tls_certificates",
         "value": [{"certificate_chain": {"filename": str(certs / "tls.crt")},
                    "private_key": {"filename": str(certs / "tls.key")}}]},
    ]
    policy = {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "EnvoyPatchPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "targetRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway},
            "type": "JSONPatch",
            "jsonPatches": [{"type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", "name": "wasm_cluster",
                             "operation": op} for op in ops],
        },
    }
    return json.dumps(policy, indent=2)


def _take_eg_lock(timeout: float):
    EG_LOCK.parent.mkdir(parents=True, exist_ok=True)
    f = open(EG_LOCK, "a+")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.close()
                raise TimeoutError(f"another Envoy Gateway holds {EG_LOCK} (its ports {EG_FIXED_PORTS} are fixed: "
                                   "one at a time per machine)")
            time.sleep(0.2)


def start_envoy_gateway(dir: Path, resources: str | Iterable[str] | None = None, name: str = "envoy-gateway",
                        envoy: Path = ENVOY_BIN, extra_versions: Iterable[str] = (), log_level: str = "info",
                        extension_apis: dict | None = None, runtime_flags: dict | None = None,
                        lock_timeout: float = 60.0, timeout: float = START_TIMEOUT_S) -> EnvoyGateway:
    """Envoy Gateway in standalone mode: File provider watching
    `dir/resources/` (`resources`, if given, is written there first; use
    `write_resources` later to change it), Host infrastructure with all its
    XDG folders, certificates and HOME under `dir`, the admin server on a
    free 127.0.0.1 port, its Prometheus server switched off. Its Envoy is
    the project's own (`envoy`, `.tools/bin/envoy`): linked where func-e
    looks for installed versions under the binary's own version (and
    `extra_versions`, for an EnvoyProxy whose `provider.host.envoyVersion`
    names another) and made func-e's default, so nothing is downloaded.
    `extension_apis` adds to the EnvoyGateway's `extensionApis` (e.g.
    `{"enableEnvoyPatchPolicy": True}`; `enableBackend` is always on).
    `runtime_flags` is its `runtimeFlags` (e.g. `{"disabled":
    ["XDSNameSchemeV2"]}`; unset: Envoy Gateway's defaults).

    Returns once its admin answers and its File provider's `/readyz` (port
    8081) is 200 (bounded); the Envoy starts
    when a Gateway is accepted: wait for it with `wait_listener`. Only one
    runs per machine (fixed ports 18000, 18002, 8081, 19003): a machine-wide lock is
    held until `stop()`."""
    if m := missing(ENVOY_GATEWAY_BIN, envoy):
        raise FileNotFoundError(f"{', '.join(m)} missing: run `bash scripts/go-tools.sh` (and `make setup` for Envoy)")
    lock = _take_eg_lock(lock_timeout)
    try:
        taken = [p for p in EG_FIXED_PORTS if _port_taken(p)]
        if taken:
            raise RuntimeError(f"Envoy Gateway's fixed port(s) {taken} are in use on this machine")
        dir.mkdir(parents=True, exist_ok=True)
        res = dir / "resources"
        res.mkdir(exist_ok=True)
        if resources is not None:
            write_resources(res, resources)
        home = dir / "home"
        host = {k: str(dir / v) for k, v in
                (("configHome", "config"), ("dataHome", "data"), ("stateHome", "state"), ("runtimeDir", "runtime"))}
        versions = [envoy_version(envoy), *[v for v in extra_versions if v != envoy_version(envoy)]]
        install_local_envoy(Path(host["configHome"]), Path(host["dataHome"]), versions, envoy)
        # HOME: its wasm cache is ~/.eg/wasm. ENVOY_VERSION: func-e reads it
        # before any envoy-version file (even one in the working directory).
        env = {"HOME": str(home), "ENVOY_VERSION": versions[0]}
        home.mkdir(exist_ok=True)
        _run([str(ENVOY_GATEWAY_BIN), "certgen", "--local", "--config-home", host["configHome"]],
             env={**os.environ, **env})
        admin = free_port()
        cfg = {
            "apiVersion": "gateway.envoyproxy.io/v1alpha1",
            "kind": "EnvoyGateway",
            "gateway": {"controllerName": EG_CONTROLLER},
            "provider": {"type": "Custom", "custom": {
                "resource": {"type": "File", "file": {"paths": [str(res)]}},
                "infrastructure": {"type": "Host", "host": host},
            }},
            "admin": {"address": {"host": "127.0.0.1", "port": admin}},
            "telemetry": {"metrics": {"prometheus": {"disable": True}}},
            "logging": {"level": {"default": log_level}},
            "extensionApis": {"enableBackend": True, **(extension_apis or {})},
        }
        if runtime_flags is not None:
            cfg["runtimeFlags"] = runtime_flags
        cfg_path = dir / "envoy-gateway.yaml"
        cfg_path.write_text(json.dumps(cfg, indent=2))
        proc = Proc(name, [str(ENVOY_GATEWAY_BIN), "server", "--config-path", str(cfg_path)], dir, env=env)
    except BaseException:
        lock.close()
        raise
    eg = EnvoyGateway(proc, dir, res, admin, versions, lock)

    def up() -> bool:
        if not eg.proc.alive():
            raise Exited(f"{name} exited: {eg.proc.log()[-4000:]}")
        status, _, _ = request("GET", admin, "/", timeout=2)
        return status < 500 and request("GET", EG_HEALTH_PORT, "/readyz", timeout=2)[0] == 200

    try:
        wait_until(f"{name} admin on {admin}", up, timeout, interval=0.1)
    except BaseException:
        eg.stop()
        raise
    return eg


# Envoy Gateway with its Kubernetes provider, against our API server
# ---------------------------------------------------------------------------

# What the gateway-helm chart runs, with the paths it mounts: the
# `envoy-gateway` Secret (certgen's) at /certs, where the Kubernetes
# provider reads its xDS, wasm-server and webhook certificates from
# (fixed paths in v1.9.1: internal/xds/runner/runner.go,
# internal/gatewayapi/runner/runner.go, internal/provider/kubernetes), and
# a writable wasm cache at /var/lib/eg/wasm.
# Its readiness probe (controller-runtime's health probe, the port the
# chart's Deployment probes): fixed, like the rest of its ports (xDS 18000,
# wasm 18002, webhook 9443, controller-runtime metrics :8080, admin 19000).
EG_K8S_HEALTH_PORT = 8081

# Run inside a new mount and network namespace (unshare, as root): builds a
# root of bind mounts of the real one on a tmpfs, adds /certs and the wasm
# cache (directories the real root does not have and never gets), starts
# the loopback bridge and execs the command chrooted there. Every port the
# process binds, on whatever interface, is in its own network namespace:
# nothing is bound on the machine's interfaces and no fixed port can
# collide with another test.
_ISOLATE_SH = r'''
set -e
R=$1; CERTS=$2; WASM=$3; PY=$4; BRIDGE=$5; BDIR=$6; OUTS=$7; INS=$8; shift 8
mount -t tmpfs -o mode=755 kvasir-eg-root "$R"
for e in /*; do
  n=${e#/}
  case "$n" in certs|var) continue;; esac
  if [ -L "$e" ]; then cp -P "$e" "$R/$n"
  elif [ -d "$e" ]; then mkdir "$R/$n"; mount --rbind "$e" "$R/$n"
  fi
done
mkdir -p "$R/certs" "$R/var/lib/eg/wasm" "$R/var/tmp"
mount --bind "$CERTS" "$R/certs"
mount --bind "$WASM" "$R/var/lib/eg/wasm"
"$PY" "$BRIDGE" "$BDIR" "$OUTS" "$INS" &
for _ in $(seq 1 200); do [ -e "$BDIR/ready" ] && break; sleep 0.05; done
[ -e "$BDIR/ready" ] || { echo "loopback bridge did not start" >&2; exit 1; }
exec chroot "$R" "$@"
'''

# The bridge's inside half (run by the isolated shell, inside the network
# namespace): brings the namespace's loopback up; for each `out` port,
# listens on 127.0.0.1:<port> there and carries each connection over the
# UNIX socket `<dir>/out-<port>.sock` (the outside half connects it to the
# machine's 127.0.0.1:<port>); for each `in` port, listens on
# `<dir>/in-<port>.sock` and connects to 127.0.0.1:<port> inside.
_BRIDGE_INSIDE = r'''
import fcntl, os, socket, struct, sys, threading
d, outs, ins = sys.argv[1], sys.argv[2], sys.argv[3]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
def pipe(a, b):
    try:
        while True:
            x = a.recv(65536)
            if not x:
                break
            b.sendall(x)
    except OSError:
        pass
    finally:
        for c in (a, b):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
def serve(listener, connect):
    while True:
        c, _ = listener.accept()
        try:
            u = connect()
        except OSError:
            c.close()
            continue
        threading.Thread(target=pipe, args=(c, u), daemon=True).start()
        threading.Thread(target=pipe, args=(u, c), daemon=True).start()
def unix_to(path):
    def f():
        u = socket.socket(socket.AF_UNIX); u.connect(path); return u
    return f
def tcp_to(port):
    return lambda: socket.create_connection(("127.0.0.1", port))
ts = []
for p in filter(None, outs.split(",")):
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("127.0.0.1", int(p))); l.listen(64)
    ts.append(threading.Thread(target=serve, args=(l, unix_to(os.path.join(d, f"out-{p}.sock"))), daemon=True))
for p in filter(None, ins.split(",")):
    path = os.path.join(d, f"in-{p}.sock")
    l = socket.socket(socket.AF_UNIX); l.bind(path); l.listen(64)
    ts.append(threading.Thread(target=serve, args=(l, tcp_to(int(p))), daemon=True))
for t in ts:
    t.start()
open(os.path.join(d, "ready"), "w").close()
threading.Event().wait()
'''


def eg_version() -> str:
    """The Envoy Gateway release the tools are built from
    (`EG_VERSION` in scripts/go-tools.sh)."""
    m = re.search(r"^EG_VERSION=(\S+)", (REPO / "scripts" / "go-tools.sh").read_text(), re.M)
    if not m:
        raise RuntimeError("no EG_VERSION in scripts/go-tools.sh")
    return m.group(1)


def eg_chart_crds() -> list[Path]:
    """The CRDs the gateway-helm chart of `eg_version()` installs (its
    `crds` subchart: Gateway API's bundle and Envoy Gateway's own), from
    the Go module cache scripts/go-tools.sh filled; [] when it is not
    there."""
    cache = os.environ.get("GOMODCACHE")
    if not cache and shutil.which("go"):
        cache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, timeout=30).stdout.strip()
    if not cache:
        cache = str(Path.home() / "go" / "pkg" / "mod")
    d = Path(cache) / "github.com" / "envoyproxy" / f"gateway@{eg_version()}" / "charts" / "gateway-helm" / "charts" \
        / "crds" / "crds"
    if not d.is_dir():
        return []
    return sorted(d.glob("*.yaml")) + sorted((d / "generated").glob("*.yaml"))


class _UnixBridge:
    """The bridge's outside half: for each port, a UNIX socket
    `<dir>/out-<port>.sock` whose connections are carried to the machine's
    127.0.0.1:<port>."""

    def __init__(self, dir: Path, ports: Iterable[int]) -> None:
        self._listeners: list[socket.socket] = []
        for p in ports:
            path = dir / f"out-{p}.sock"
            l = socket.socket(socket.AF_UNIX)
            l.bind(str(path))
            l.listen(64)
            self._listeners.append(l)
            threading.Thread(target=self._serve, args=(l, p), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                x = a.recv(65536)
                if not x:
                    break
                b.sendall(x)
        except OSError:
            pass
        finally:
            for c in (a, b):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _serve(self, listener: socket.socket, port: int) -> None:
        while True:
            try:
                c, _ = listener.accept()
            except OSError:
                return
            try:
                t = socket.create_connection(("127.0.0.1", port), timeout=10)
                t.settimeout(None)
            except OSError:
                c.close()
                continue
            threading.Thread(target=self._pipe, args=(c, t), daemon=True).start()
            threading.Thread(target=self._pipe, args=(t, c), daemon=True).start()

    def stop(self) -> None:
        for l in self._listeners:
            l.close()


def isolation_available() -> bool:
    """Whether this machine lets us make a mount and network namespace
    (`unshare`, as root): what `start_envoy_gateway_kubernetes` needs."""
    if shutil.which("unshare") is None or shutil.which("chroot") is None:
        return False
    try:
        r = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "true"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@dataclass
class EnvoyGatewayKubernetes:
    """Envoy Gateway's controller with its Kubernetes provider, as the
    chart's Deployment runs it, against an `ApiServer`: it watches the
    server's Gateway API and Envoy Gateway objects, writes their status
    there, and creates the Envoy proxies' Deployments and Services there
    (which nothing runs: no kubelet)."""

    proc: Proc
    dir: Path
    namespace: str
    config: dict
    _bridge: _UnixBridge = field(repr=False, default=None)

    def _inside_get(self, port: int, path: str, timeout: float = 2.0) -> int:
        """Status of a GET to 127.0.0.1:`port` inside its network
        namespace (through the bridge), 0 when nothing answers."""
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        try:
            s.connect(str(self.dir / "bridge" / f"in-{port}.sock"))
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
            head = s.recv(64).decode(errors="replace")
        except OSError:
            return 0
        finally:
            s.close()
        m = re.match(r"HTTP/1\.[01] (\d{3})", head)
        return int(m.group(1)) if m else 0

    def ready(self) -> bool:
        """Its readiness probe (`/readyz` on 8081) answers 200."""
        if not self.proc.alive():
            raise Exited(f"envoy-gateway exited: {self.proc.log()[-4000:]}")
        return self._inside_get(EG_K8S_HEALTH_PORT, "/readyz") == 200

    def stop(self) -> None:
        try:
            self.proc.stop()
        finally:
            if self._bridge is not None:
                self._bridge.stop()


def start_envoy_gateway_kubernetes(dir: Path, api: ApiServer, config: dict, namespace: str = "envoy-gateway-system",
                                   egress_ports: Iterable[int] = (), env: dict[str, str] | None = None,
                                   certgen_args: Iterable[str] = ("--disable-topology-injector",),
                                   name: str = "envoy-gateway", timeout: float = START_TIMEOUT_S
                                   ) -> EnvoyGatewayKubernetes:
    """Envoy Gateway as the gateway-helm chart installs it, run as a local
    process against `api`: `envoy-gateway certgen` first (the chart's Job:
    the `envoy-gateway`, `envoy`, `envoy-rate-limit` and `envoy-oidc-hmac`
    Secrets in `namespace`, which must exist), then `envoy-gateway server`
    with `config` (the chart's ConfigMap: an EnvoyGateway with
    `provider.type: Kubernetes`), with `ENVOY_GATEWAY_NAMESPACE=namespace`,
    the `envoy-gateway` Secret at /certs and KUBECONFIG pointing at `api`.

    The server has fixed paths (/certs) and fixed ports on every interface
    (8080, 8081, 9443, 18000, 18002), so it runs in a mount and network
    namespace of its own (`isolation_available()`: root and `unshare`):
    inside, 127.0.0.1:<api port> and each of `egress_ports` (e.g. an HTTP
    proxy the caller runs, named in `env` as HTTP_PROXY) lead to the
    machine's 127.0.0.1 ports of the same numbers, and nothing else leaves.
    Returns once its readiness probe answers 200 (bounded)."""
    if m := missing(ENVOY_GATEWAY_BIN):
        raise FileNotFoundError(f"{m[0]} missing: run `bash scripts/go-tools.sh`")
    if not isolation_available():
        raise RuntimeError("cannot make a mount and network namespace here (needs root and unshare)")
    dir.mkdir(parents=True, exist_ok=True)
    base_env = {"KUBECONFIG": str(api.kubeconfig), "ENVOY_GATEWAY_NAMESPACE": namespace,
                "KUBERNETES_CLUSTER_DOMAIN": "cluster.local", "HOME": str(dir)}
    _run([str(ENVOY_GATEWAY_BIN), "certgen", *certgen_args], timeout=60, env={**os.environ, **base_env})
    secret = json.loads(api.kubectl("get", "secret", "envoy-gateway", "-n", namespace, "-o", "json").stdout)
    certs = dir / "certs"
    certs.mkdir(exist_ok=True)
    for k, v in secret["data"].items():
        (certs / k).write_bytes(base64.b64decode(v))
        (certs / k).chmod(0o600)
    wasm = dir / "wasm-cache"
    wasm.mkdir(exist_ok=True)
    root = dir / "root"
    root.mkdir(exist_ok=True)
    bridge_dir = dir / "bridge"
    bridge_dir.mkdir(exist_ok=True)
    (bridge_dir / "ready").unlink(missing_ok=True)
    inside = dir / "bridge-inside.py"
    inside.write_text(_BRIDGE_INSIDE)
    outs = [api.port, *egress_ports]
    bridge = _UnixBridge(bridge_dir, outs)
    cfg_path = dir / "envoy-gateway.yaml"
    cfg_path.write_text(json.dumps(config, indent=2))
    argv = ["unshare", "--mount", "--net", "--propagation", "private", "bash", "-c", _ISOLATE_SH, "isolate",
            str(root), str(certs), str(wasm), sys.executable, str(inside), str(bridge_dir),
            ",".join(map(str, outs)), str(EG_K8S_HEALTH_PORT),
            str(ENVOY_GATEWAY_BIN), "server", "--config-path", str(cfg_path)]
    try:
        proc = Proc(name, argv, dir, env={**base_env, **(env or {})})
    except BaseException:
        bridge.stop()
        raise
    eg = EnvoyGatewayKubernetes(proc, dir, namespace, config, bridge)
    try:
        wait_until(f"{name} /readyz", eg.ready, timeout, interval=0.2)
    except BaseException:
        eg.stop()
        raise
    return eg


# kustomize
# ---------------------------------------------------------------------------


def kustomize(dir: Path, timeout: float = 60.0) -> list[dict]:
    """`kubectl kustomize dir`, parsed: the documents as the API server
    would receive them from `kubectl apply -k`."""
    import yaml

    if m := missing(KUBECTL):
        raise FileNotFoundError(f"{m[0]} missing (Debian: kubernetes-client)")
    out = _run([KUBECTL, "kustomize", str(dir)], timeout=timeout).stdout
    return [d for d in yaml.safe_load_all(out) if d]


# egctl x translate
# ---------------------------------------------------------------------------


def egctl_translate(docs: str | Iterable[str], to: str = "xds", resource_type: str = "all",
                    add_missing: bool = True, namespace: str = "envoy-gateway-system",
                    workdir: Path | None = None, timeout: float = 60.0) -> dict | list:
    """`egctl x translate --from gateway-api --to <to> -t <resource_type> -o
    json` over the given Gateway API YAML (a GatewayClass for Envoy
    Gateway's controller included): the translated xDS (or, with
    `to="gateway-api"`, the resources with their status), parsed. Runs no
    control plane. Raises with egctl's stderr on failure."""
    if m := missing(EGCTL_BIN):
        raise FileNotFoundError(f"{m[0]} missing: run `bash scripts/go-tools.sh`")
    text = docs if isinstance(docs, str) else "\n---\n".join(d.strip() for d in docs) + "\n"
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        f = Path(d) / "in.yaml"
        f.write_text(text)
        argv = [str(EGCTL_BIN), "x", "translate", "--from", "gateway-api", "--to", to, "-t", resource_type,
                "-o", "json", "-n", namespace, "-f", str(f)]
        if add_missing:
            argv.append("--add-missing-resources")
        out = _run(argv, timeout=timeout, env={**os.environ, "HOME": d}).stdout
    return _json_documents(out)


def _json_documents(out: str) -> dict | list:
    """egctl prints one JSON document per output type; one comes back as
    itself, several as a list."""
    dec = json.JSONDecoder()
    docs, i = [], 0
    while True:
        while i < len(out) and out[i] in " \t\r\n":
            i += 1
        if i >= len(out):
            break
        obj, i = dec.raw_decode(out, i)
        docs.append(obj)
    return docs[0] if len(docs) == 1 else docs
