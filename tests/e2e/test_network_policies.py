"""gateway-api/'s NetworkPolicies, checked on the rendered install with no
cluster: a small evaluator of NetworkPolicy ingress semantics (isolation,
additive rules, pod and namespace selectors, named and numbered ports)
asks, for every port of every Kvasir pod and every engine of the pools,
which of a set of peers may connect, and the answer must be exactly the
intended peers:

    indexer    grpc     the inference Gateway's Envoy proxies
               http     Prometheus
    controller http     the Envoy Gateway controller (it fetches the module)
               metrics  Prometheus
    redis      redis    the indexer
    engines    8000     the proxies, the indexer, Prometheus
               5557/8   the indexer (KV events)

A port added to a Kvasir container or Service with no entry here fails
(closed by the default deny, it would break whoever needs it; opened, it
must be meant), and so does a Kvasir workload outside the default deny.
The peers are labelled as Envoy Gateway labels its pods (checked against
its source when the Go module cache has it). Also here: no deployable
manifest or image ships the simulator or its admin endpoints.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
GW = REPO / "gateway-api"
PART_OF = ("app.kubernetes.io/part-of", "kvasir")
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod"}
# Folders of gateway-api/ that are not an install of their own.
NOT_ROOTS = {"base", "examples", "demo", "generated", "components", "install"}
EG_NAMESPACE = "envoy-gateway-system"
MONITORING = "monitoring"
GATEWAY = "inference-gateway"


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------


def kubectl() -> str:
    k = shutil.which("kubectl")
    assert k, "kubectl is not installed: `make setup` installs Debian's kubernetes-client"
    return k


def render(tmp: Path, root: str = "", namespace: str | None = None) -> list[dict[str, Any]]:
    """`kubectl kustomize gateway-api/<root>` of a copy with a route token
    (and the install's namespace set to `namespace`)."""
    gw = tmp / "gateway-api"
    if not gw.exists():
        shutil.copytree(GW, gw, ignore=shutil.ignore_patterns("route-token.env"))
        (gw / "install" / "route-token.env").write_text("routeToken=t0123456789abcdef\n")
        if namespace:
            k = gw / "install" / "kustomization.yaml"
            k.write_text(re.sub(r"(?m)^namespace: serving$", f"namespace: {namespace}", k.read_text()))
    r = subprocess.run([kubectl(), "kustomize", str(gw / root)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def deployable_roots() -> list[str]:
    """The install (gateway-api/ itself) and any other folder of
    gateway-api/ that is a kustomization of its own (not a component)."""
    roots = [""]
    for k in sorted(GW.glob("*/kustomization.yaml")):
        if k.parent.name in NOT_ROOTS:
            continue
        if (yaml.safe_load(k.read_text()) or {}).get("kind", "Kustomization") == "Kustomization":
            roots.append(k.parent.name)
    return roots


# ---------------------------------------------------------------------------
# The evaluator
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """A pod that may try to connect."""

    namespace: str
    labels: tuple[tuple[str, str], ...]

    @staticmethod
    def of(namespace: str, labels: dict[str, str]) -> "Peer":
        return Peer(namespace, tuple(sorted(labels.items())))

    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


@dataclass
class Port:
    number: int
    name: str | None = None
    protocol: str = "TCP"


@dataclass
class Target:
    """A pod (from a workload's template, or an engine of a pool) and its ports."""

    what: str
    namespace: str
    labels: dict[str, str]
    ports: list[Port] = field(default_factory=list)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def policy_types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))


def peer_matches(rule_peer: dict[str, Any], policy_ns: str, peer: Peer) -> bool:
    assert "ipBlock" not in rule_peer, "Kvasir's policies select peers by labels, never by address"
    ns_sel, pod_sel = rule_peer.get("namespaceSelector"), rule_peer.get("podSelector")
    ns_ok = peer.namespace == policy_ns if ns_sel is None else selects(ns_sel, peer.namespace_labels())
    return ns_ok and (pod_sel is None or selects(pod_sel, peer.label_map()))


def port_matches(rule_ports: list[dict[str, Any]] | None, port: Port) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != port.protocol:
            continue
        if "port" not in p:
            return True
        v = p["port"]
        if isinstance(v, str):
            if v == port.name:
                return True
        elif v <= port.number <= p.get("endPort", v):
            return True
    return False


def selecting(policies: list[dict[str, Any]], target: Target) -> list[dict[str, Any]]:
    return [p for p in policies if p["metadata"]["namespace"] == target.namespace
            and "Ingress" in policy_types(p) and selects(p["spec"]["podSelector"], target.labels)]


def admits(policies: list[dict[str, Any]], target: Target, port: Port, peer: Peer) -> bool:
    isolating = selecting(policies, target)
    if not isolating:
        return True
    for p in isolating:
        for rule in p["spec"].get("ingress") or []:
            peers = rule.get("from") or []
            if (not peers or any(peer_matches(f, p["metadata"]["namespace"], peer) for f in peers)) \
                    and port_matches(rule.get("ports"), port):
                return True
    return False


def test_the_evaluator_follows_the_api():
    """Isolation only by a selecting policy; rules add up; a peer's two
    selectors both hold; an absent namespace selector is the policy's own
    namespace; named ports match the container port's name."""
    t = Target("t", "ns", {"app": "t"}, [Port(80, "http")])
    a, b, other_ns = Peer.of("ns", {"app": "a"}), Peer.of("ns", {"app": "b"}), Peer.of("x", {"app": "a"})
    assert admits([], t, t.ports[0], a)
    deny = {"metadata": {"namespace": "ns"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert not admits([deny], t, t.ports[0], a)
    allow_a = {"metadata": {"namespace": "ns"}, "spec": {"podSelector": {"matchLabels": {"app": "t"}}, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"app": "a"}}}], "ports": [{"port": "http"}]}]}}
    assert admits([deny, allow_a], t, t.ports[0], a)
    assert not admits([deny, allow_a], t, t.ports[0], b)
    assert not admits([deny, allow_a], t, t.ports[0], other_ns)
    assert not admits([deny, allow_a], t, Port(81, "other"), a)
    egress_only = {"metadata": {"namespace": "ns"}, "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    assert admits([egress_only], t, t.ports[0], b)
    both = {"metadata": {"namespace": "ns"}, "spec": {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "x"}},
         "podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["a"]}]}}],
        "ports": [{"port": 80, "endPort": 90}]}]}}
    assert admits([both], t, Port(85), other_ns)
    assert not admits([both], t, Port(85), a)
    assert not admits([both], t, Port(85), Peer.of("x", {"app": "b"}))


# ---------------------------------------------------------------------------
# The install
# ---------------------------------------------------------------------------


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_template(w: dict[str, Any]) -> dict[str, Any]:
    if w["kind"] == "Pod":
        return w
    if w["kind"] == "CronJob":
        return w["spec"]["jobTemplate"]["spec"]["template"]
    return w["spec"]["template"]


def kvasir_targets(docs: list[dict[str, Any]]) -> list[Target]:
    out = []
    for w in workloads(docs):
        tpl = pod_template(w)
        ports = [Port(p["containerPort"], p.get("name"), p.get("protocol", "TCP"))
                 for c in tpl["spec"].get("containers", []) + tpl["spec"].get("initContainers", [])
                 for p in c.get("ports", [])]
        out.append(Target(w["metadata"]["name"], w["metadata"]["namespace"], tpl["metadata"].get("labels", {}), ports))
    return out


def engine_targets(docs: list[dict[str, Any]]) -> list[Target]:
    """One engine per InferencePool: its selector's labels; its target
    ports and KV-event ports (the pool's annotations, else the ones
    docs/deploy.md gives vLLM)."""
    out = []
    for p in docs:
        if p["kind"] != "InferencePool":
            continue
        ann = p["metadata"].get("annotations", {})
        ports = [Port(t["number"]) for t in p["spec"]["targetPorts"]]
        ports += [Port(int(ann.get("kvasir.dev/kv-events-port", 5557)), "kv-events"),
                  Port(int(ann.get("kvasir.dev/kv-replay-port", 5558)), "kv-replay")]
        out.append(Target(f"engine of InferencePool {p['metadata']['name']}", p["metadata"]["namespace"],
                          dict(p["spec"]["selector"]["matchLabels"]), ports))
    return out


def proxy_labels(gateway: str, namespace: str) -> dict[str, str]:
    """What Envoy Gateway labels every proxy pod of a Gateway with
    (internal/infrastructure/kubernetes/proxy: EnvoyAppLabel and the
    owning-gateway labels)."""
    return {"app.kubernetes.io/name": "envoy", "app.kubernetes.io/component": "proxy",
            "app.kubernetes.io/managed-by": "envoy-gateway",
            "gateway.envoyproxy.io/owning-gateway-name": gateway,
            "gateway.envoyproxy.io/owning-gateway-namespace": namespace}


# The Envoy Gateway controller's pod (its Helm chart's Deployment).
EG_CONTROLLER = {"control-plane": "envoy-gateway", "app.kubernetes.io/name": "gateway-helm",
                 "app.kubernetes.io/instance": "eg"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"}


def peers(docs: list[dict[str, Any]], ns: str) -> dict[str, Peer]:
    labels = {t.what: t.labels for t in kvasir_targets(docs)}
    engine = engine_targets(docs)[0].labels
    return {
        "gateway proxy": Peer.of(EG_NAMESPACE, proxy_labels(GATEWAY, ns)),
        "envoy gateway controller": Peer.of(EG_NAMESPACE, EG_CONTROLLER),
        "prometheus": Peer.of(MONITORING, PROMETHEUS),
        "indexer": Peer.of(ns, labels["kvasir-indexer"]),
        "controller": Peer.of(ns, labels["kvasir-controller"]),
        "redis": Peer.of(ns, labels["kvasir-redis"]),
        "engine": Peer.of(ns, engine),
        # Who must get nothing.
        "a proxy of another Gateway": Peer.of(EG_NAMESPACE, proxy_labels("other-gateway", ns)),
        "a proxy of a same-named Gateway elsewhere": Peer.of(EG_NAMESPACE, proxy_labels(GATEWAY, "other-team")),
        "a proxy-labelled pod outside Envoy Gateway's namespace": Peer.of(ns, proxy_labels(GATEWAY, ns)),
        "another pod of the namespace": Peer.of(ns, {"app": "debug"}),
        "a pod of another namespace": Peer.of("default", {"app": "debug"}),
        "a prometheus-labelled pod elsewhere": Peer.of("default", PROMETHEUS),
        "an unlabelled pod of Envoy Gateway's namespace": Peer.of(EG_NAMESPACE, {}),
        "an unlabelled pod of the monitoring namespace": Peer.of(MONITORING, {}),
    }


# (workload, port name) -> the peers that may connect.
INTENDED = {
    ("kvasir-indexer", "grpc"): {"gateway proxy"},
    ("kvasir-indexer", "http"): {"prometheus"},
    ("kvasir-controller", "http"): {"envoy gateway controller"},
    ("kvasir-controller", "metrics"): {"prometheus"},
    ("kvasir-redis", "redis"): {"indexer"},
}
ENGINE_INTENDED = {"http": {"gateway proxy", "indexer", "prometheus"}, "kv": {"indexer"}}
# Ports no Kvasir pod declares: closed to everyone by the default deny.
UNDECLARED = [Port(1), Port(22), Port(6443), Port(12345), Port(50052), Port(53, protocol="UDP")]


@pytest.fixture(scope="module", params=["serving", "llm-team"])
def installed(request, tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    """The install rendered into the default namespace and into another."""
    ns = request.param
    return ns, render(tmp_path_factory.mktemp(f"np-{ns}"), namespace=None if ns == "serving" else ns)


def network_policies(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "NetworkPolicy"]


def test_every_kvasir_workload_is_under_the_default_deny(installed):
    ns, docs = installed
    pols = network_policies(docs)
    deny = [p for p in pols if p["spec"]["podSelector"] == {"matchLabels": dict([PART_OF])}
            and policy_types(p) == ["Ingress"] and not p["spec"].get("ingress")]
    assert len(deny) == 1, "one default-deny ingress policy over app.kubernetes.io/part-of=kvasir"
    ws = workloads(docs)
    assert {w["metadata"]["name"] for w in ws} >= {"kvasir-indexer", "kvasir-controller", "kvasir-redis"}
    for w in ws:
        labels = pod_template(w)["metadata"].get("labels", {})
        assert labels.get(PART_OF[0]) == PART_OF[1], \
            f"{w['kind']} {w['metadata']['name']}: its pods need {PART_OF[0]}={PART_OF[1]} (the default deny)"
        assert w["metadata"]["namespace"] == ns


def test_every_port_admits_exactly_its_intended_peers(installed):
    ns, docs = installed
    pols, who = network_policies(docs), peers(docs, ns)
    for t in kvasir_targets(docs):
        assert t.ports or t.what == "kvasir-redis", t.what
        for port in t.ports:
            want = INTENDED.get((t.what, port.name))
            assert want is not None, (
                f"{t.what} port {port.name} ({port.number}) has no intended peers: add a NetworkPolicy rule for "
                "who needs it to gateway-api/base/networkpolicies.yaml and its entry to INTENDED here")
            got = {name for name, p in who.items() if admits(pols, t, port, p)}
            assert got == want, f"{t.what} port {port.name}: admits {sorted(got)}, meant {sorted(want)}"
        for port in UNDECLARED:
            got = {name for name, p in who.items() if admits(pols, t, port, p)}
            assert not got, f"{t.what} port {port.number}/{port.protocol} is open to {sorted(got)}"
    assert {(t.what, p.name) for t in kvasir_targets(docs) for p in t.ports} == set(INTENDED), \
        "every intended port exists"


def test_the_engines_take_only_the_gateway_the_indexer_and_prometheus(installed):
    ns, docs = installed
    pols, who = network_policies(docs), peers(docs, ns)
    engines = engine_targets(docs)
    assert len(engines) >= 2
    for t in engines:
        assert selecting(pols, t), f"no NetworkPolicy selects the {t.what}: keep kvasir-engines' selector in step"
        for port in t.ports:
            want = ENGINE_INTENDED["kv" if port.name and port.name.startswith("kv-") else "http"]
            got = {name for name, p in who.items() if admits(pols, t, port, p)}
            assert got == want, f"{t.what} port {port.number}: admits {sorted(got)}, meant {sorted(want)}"
        for port in UNDECLARED:
            got = {name for name, p in who.items() if admits(pols, t, port, p)}
            assert not got, f"{t.what} port {port.number} is open to {sorted(got)}"


def test_every_service_port_reaches_a_checked_port(installed):
    """A Service port is as open as the pod port it targets: each one's
    targetPort is a port checked above."""
    _, docs = installed
    targets = kvasir_targets(docs) + engine_targets(docs)
    for s in (d for d in docs if d["kind"] == "Service"):
        sel = s["spec"].get("selector")
        assert sel, f"Service {s['metadata']['name']}: no selector"
        behind = [t for t in targets if selects({"matchLabels": sel}, t.labels)]
        assert behind, f"Service {s['metadata']['name']} selects no pod checked here"
        for sp in s["spec"]["ports"]:
            tp = sp.get("targetPort", sp["port"])
            for t in behind:
                assert any(p.name == tp if isinstance(tp, str) else p.number == tp for p in t.ports), \
                    f"Service {s['metadata']['name']} port {sp['port']} -> {tp}: not a port of {t.what}"


def test_named_ports_in_the_policies_name_real_ports(installed):
    """A rule naming a port no selected container has opens nothing and
    hides a typo."""
    _, docs = installed
    targets = kvasir_targets(docs)
    for p in network_policies(docs):
        selected = [t for t in targets if selects(p["spec"]["podSelector"], t.labels)]
        for rule in p["spec"].get("ingress") or []:
            for port in rule.get("ports") or []:
                if isinstance(port.get("port"), str):
                    assert selected and all(any(q.name == port["port"] for q in t.ports) for t in selected), \
                        f"{p['metadata']['name']}: port {port['port']} is not a port of {[t.what for t in selected]}"


@pytest.mark.parametrize("root", deployable_roots())
def test_every_deployable_root_is_covered(root, tmp_path):
    """Each install of gateway-api/ (the main one and any other
    kustomization there): its Kvasir pods are under a policy, and no port
    of theirs is open to a stranger."""
    docs = render(tmp_path, root)
    ns = next(d["metadata"]["namespace"] for d in docs if d.get("metadata", {}).get("namespace"))
    pols, strangers = network_policies(docs), [Peer.of(ns, {"app": "debug"}), Peer.of("default", {})]
    for t in kvasir_targets(docs):
        assert t.labels.get(PART_OF[0]) == PART_OF[1], f"{root or 'install'}: {t.what} is outside the default deny"
        for port in t.ports + UNDECLARED:
            assert not any(admits(pols, t, port, s) for s in strangers), \
                f"{root or 'install'}: {t.what} port {port.name or port.number} is open to any pod"


# ---------------------------------------------------------------------------
# The peers' labels are Envoy Gateway's
# ---------------------------------------------------------------------------


def eg_source() -> Path | None:
    cache = os.environ.get("GOMODCACHE")
    if not cache and shutil.which("go"):
        cache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, timeout=30).stdout.strip()
    d = Path(cache or "/nonexistent") / "github.com" / "envoyproxy" / "gateway@v1.9.1"
    return d if d.is_dir() else None


def test_the_peer_labels_are_the_ones_envoy_gateway_sets():
    src = eg_source()
    if src is None:
        pytest.skip("Envoy Gateway's source is not in the Go module cache (scripts/go-tools.sh fills it)")
    app = (src / "internal/infrastructure/kubernetes/proxy/resource.go").read_text()
    for k, v in list(proxy_labels(GATEWAY, "ns").items())[:3]:
        assert f'"{k}": ' in app and f'"{v}"' in app, (k, v)
    names = (src / "internal/gatewayapi/translator.go").read_text()
    assert 'OwningGatewayNameLabel = "gateway.envoyproxy.io/owning-gateway-name"' in names
    assert 'OwningGatewayNamespaceLabel = "gateway.envoyproxy.io/owning-gateway-namespace"' in names
    chart = (src / "charts/gateway-helm/templates/envoy-gateway-deployment.yaml").read_text()
    assert "control-plane: envoy-gateway" in chart.split("template:")[1]


# ---------------------------------------------------------------------------
# The simulator is not deployable
# ---------------------------------------------------------------------------

SIM = re.compile(r"vllm[-_]sim|enable-sim-admin|VLLM_SIM_ENABLE_ADMIN|/sim/|--fault-")


def test_no_deployable_manifest_or_image_ships_the_simulator():
    """vllm-sim and its admin endpoints (fault injection) are for tests:
    nothing a user applies or builds names them."""
    files = [p for p in GW.rglob("*") if p.is_file() and p.name != "route-token.env"]
    files.append(REPO / "scripts" / "images.sh")
    for f in files:
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            assert not SIM.search(line), f"{f.relative_to(REPO)}:{i}: {line.strip()}"
    allowed_packages = {"kvasir-controller", "kvasir-cache-indexer", "kvasir-filter"}
    allowed_bins = {"kvasir-controller", "cache-indexer"}
    for f in [REPO / "scripts" / "images.sh", *GW.glob("Dockerfile*")]:
        text = f.read_text()
        assert set(re.findall(r"(?:^|\s)-p\s+([\w-]+)", text)) <= allowed_packages, f
        assert set(re.findall(r"--bin\s+([\w-]+)", text)) <= allowed_bins, f
