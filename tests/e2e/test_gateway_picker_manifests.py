"""gateway-api/picker/: Kvasir as the endpoint picker of a gateway that
implements the Inference Extension itself (docs/picker.md), checked with no
cluster:

- `kubectl kustomize` renders the picker install, and the operator's
  overlay docs/picker.md describes: the closed placeholder document
  replaced by one `kvasirctl compile` makes of the example policies and
  (standing in for an operator's Secrets) the demo keys;
- every object validates against its real schema the way
  test_gateway_api.py checks gateway-api/ (its converter: the upstream
  InferencePool and HTTPRoute CRDs as JSON Schema with unknown fields
  refused; core kinds against Kubernetes' own schemas, strict);
- the references hold: each InferencePool's endpointPickerRef names a
  Service whose port reaches the indexer container's picker port for that
  pool; the indexer configuration's pickers serve exactly the
  InferencePools, discovered in the install's namespace; each picker's
  policy file and the configuration itself are mounted from the ConfigMaps
  that hold them; the route sends the inference APIs to the pool; the
  NetworkPolicies let the route's gateway reach the picker and the engines;
- the configuration runs: the real cache-indexer, with the rendered
  ConfigMap's configuration (only its listen addresses and the Redis URL
  moved to 127.0.0.1 ports of the test's), discovers the InferencePool's
  pod through a real kube-apiserver as the install's own ServiceAccount
  under the rendered RBAC, gets ready, and a real Envoy 1.40 set up as an
  Inference Extension gateway (ext_proc to the picker, full duplex)
  serves the example tenants through it; the closed placeholder answers
  503 naming docs/picker.md.

Not proven here: any particular gateway implementation's controller
generating that Envoy configuration from the InferencePool (see
docs/picker.md, "Which gateways").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from kvasir_harness import (ENVOY_BIN, INDEXER_BIN, SIM_BIN, Processes, Proc, free_port, request,  # noqa: E402
                            start_sim, wait_sim, wait_until)
from kvasir_harness.kube import (ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, missing, start_apiserver,  # noqa: E402
                                 start_etcd, write_kubeconfig)
from kvasir_harness.picker import start_picker_envoy  # noqa: E402
from kvasir_harness.redis import redis_available, start_redis  # noqa: E402
from test_gateway_api import structural_to_json_schema  # noqa: E402  (the same converter)

REPO = Path(__file__).resolve().parents[2]
GW = REPO / "gateway-api"
PICKER = GW / "picker"
KVASIRCTL = REPO / "target" / "release" / "kvasirctl"
K8S_VERSION = "1.34"
# The complete upstream CRDs where the shared folder has them, else the
# copies vendored for the controller's tests (the same schemas, without
# their descriptions).
SHARED_UPSTREAM = REPO.parent / "shared" / "upstream-crds"
UPSTREAM = SHARED_UPSTREAM if (SHARED_UPSTREAM / "inference.networking.k8s.io_inferencepools.yaml").exists() \
    else REPO / "tests" / "upstream-crds"

# What docs/picker.md has an operator compile (`your key Secrets` being the
# demo keys here), and the tenants' keys that opens.
EXAMPLE_SOURCES = ["gateway-api/base/inferencepools.yaml", "gateway-api/examples/tenants-and-provider.yaml",
                   "gateway-api/examples/batch-when-idle.yaml"]
DEMO_KEYS = "gateway-api/demo/demo-keys.yaml"
TARGET = "Gateway/inference-gateway"
ACME = "sk-acme-example-1"          # gold
NIGHTLY_EVAL = "sk-eval-example"    # batch: served while the pool is idle
MAIN_MODEL = "llama-3.1-8b-instruct"
GATEWAY_LABEL = "gateway.networking.k8s.io/gateway-name"


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------


def kubectl() -> str:
    k = shutil.which("kubectl")
    assert k, "kubectl is not installed: `make setup` installs Debian's kubernetes-client"
    return k


def kustomize(path: Path) -> list[dict[str, Any]]:
    r = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def compile_example_policy() -> str:
    if not KVASIRCTL.exists():
        pytest.fail(f"{KVASIRCTL} is missing: run `make build`")
    r = subprocess.run([str(KVASIRCTL), "compile", *EXAMPLE_SOURCES, DEMO_KEYS, "--target", TARGET],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r.stdout


def write_overlay(d: Path, policy: str) -> Path:
    """The operator's overlay docs/picker.md describes: the picker install
    with the policy ConfigMap replaced by the compiled document."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "main.policy").write_text(policy)
    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(PICKER, d)],
        "configMapGenerator": [{"name": "kvasir-picker-policy", "behavior": "replace",
                                "files": ["main.json=main.policy"]}],
    }))
    return d


@pytest.fixture(scope="module")
def installed() -> list[dict[str, Any]]:
    """The picker install as the repository has it (the closed document)."""
    return kustomize(PICKER)


@pytest.fixture(scope="module")
def overlaid(tmp_path_factory) -> list[dict[str, Any]]:
    """The operator's overlay with the compiled example policies."""
    return kustomize(write_overlay(tmp_path_factory.mktemp("overlay"), compile_example_policy()))


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def indexer_pod(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The indexer Deployment, its pod spec and its container."""
    dep = one(docs, "Deployment", "kvasir-indexer")
    pod = dep["spec"]["template"]["spec"]
    return dep, pod, pod["containers"][0]


def mounted_configmap(docs: list[dict[str, Any]], path: str) -> tuple[dict[str, Any], str]:
    """The ConfigMap and key a file path of the indexer container is read
    from (a volume mount holding it, the volume's ConfigMap, the key named
    by the rest of the path)."""
    _, pod, c = indexer_pod(docs)
    mounts = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, (path, c["volumeMounts"])
    vol = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
    assert "configMap" in vol, vol
    key = path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
    cm = one(docs, "ConfigMap", vol["configMap"]["name"])
    assert key in cm["data"], (path, sorted(cm["data"]))
    return cm, key


def indexer_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    _, _, c = indexer_pod(docs)
    assert c["args"][:1] == ["--config"] and len(c["args"]) == 2, c["args"]
    cm, key = mounted_configmap(docs, c["args"][1])
    return yaml.safe_load(cm["data"][key])


def policy_of(docs: list[dict[str, Any]], picker: dict[str, Any]) -> str:
    cm, key = mounted_configmap(docs, picker["policyFile"])
    return cm["data"][key]


# ---------------------------------------------------------------------------
# What the install is
# ---------------------------------------------------------------------------


def test_the_install_is_the_picker_and_what_it_needs(installed):
    """Exactly these objects: Envoy Gateway's, the filter's controller and
    its routes are not in it, nor any Secret to make."""
    got = sorted((d["kind"], re.sub(r"-[a-z0-9]{10}$", "-<hash>", d["metadata"]["name"])) for d in installed)
    assert got == sorted([
        ("Namespace", "serving"),
        ("ServiceAccount", "kvasir-indexer"), ("Role", "kvasir-indexer"), ("RoleBinding", "kvasir-indexer"),
        ("ConfigMap", "kvasir-picker-indexer"), ("ConfigMap", "kvasir-picker-policy-<hash>"),
        ("Deployment", "kvasir-indexer"), ("Service", "kvasir-indexer"), ("Service", "kvasir-picker-main"),
        ("Deployment", "kvasir-redis"), ("Service", "kvasir-redis"),
        ("InferencePool", "main"), ("HTTPRoute", "kvasir-main"),
        ("NetworkPolicy", "kvasir-default-deny-ingress"), ("NetworkPolicy", "kvasir-indexer"),
        ("NetworkPolicy", "kvasir-engines"), ("NetworkPolicy", "kvasir-redis"),
    ]), got
    assert {d["metadata"].get("namespace") for d in installed if d["kind"] != "Namespace"} == {"serving"}
    for d in installed:
        spec = d.get("spec", {}).get("template", {}).get("spec", {})
        assert not [v for v in spec.get("volumes", []) if "secret" in v], d["metadata"]["name"]
    # The indexer's own API is the filter's: loopback only, so no port of
    # the pod or its Service carries it.
    cfg = indexer_config(installed)
    assert cfg["grpcAddr"].startswith("127.0.0.1:") and "grpcTokenFile" not in cfg
    _, _, c = indexer_pod(installed)
    assert str(cfg["grpcAddr"].rsplit(":", 1)[1]) not in {str(p["containerPort"]) for p in c["ports"]}


@pytest.mark.parametrize("which", ["installed", "overlaid"])
def test_every_object_validates_against_its_schema(which, request):
    docs = request.getfixturevalue(which)
    schemas = {}
    for f in sorted(UPSTREAM.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d and d.get("kind") == "CustomResourceDefinition":
                for v in d["spec"]["versions"]:
                    if v.get("served") and "schema" in v:
                        s = structural_to_json_schema(v["schema"]["openAPIV3Schema"])
                        s.setdefault("properties", {})["metadata"] = {"type": "object"}
                        s["properties"].setdefault("apiVersion", {"type": "string"})
                        s["properties"].setdefault("kind", {"type": "string"})
                        schemas[(f"{d['spec']['group']}/{v['name']}", d["spec"]["names"]["kind"])] = (f.name, s)
    import kubernetes_validate

    checked = set()
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        key = (d["apiVersion"], d["kind"])
        if key in schemas:
            src, schema = schemas[key]
            errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(d), key=lambda e: list(e.path))
            assert not errors, f"{where} against {src}: " + "; ".join(
                f"{'.'.join(map(str, e.path))}: {e.message[:300]}" for e in errors)
            checked.add(d["kind"])
            continue
        assert "/" not in d["apiVersion"] or d["apiVersion"].split("/")[0].endswith(".k8s.io") \
            or d["apiVersion"].startswith("apps/"), f"{where}: {d['apiVersion']} has no schema here"
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where} against Kubernetes {K8S_VERSION}: {str(e)[:600]}")
    assert {"InferencePool", "HTTPRoute"} <= checked, "the upstream CRDs were found"


# ---------------------------------------------------------------------------
# The references
# ---------------------------------------------------------------------------


def port_of(container: dict[str, Any], target: int | str) -> int:
    for p in container["ports"]:
        if p.get("name") == target or p["containerPort"] == target:
            return p["containerPort"]
    raise AssertionError(f"no container port {target!r}: {container['ports']}")


def test_each_pools_picker_ref_reaches_the_indexers_picker_for_it(installed):
    """endpointPickerRef -> Service (same namespace) -> its port -> the
    targetPort on the indexer pods it selects -> the port the indexer's
    picker for that pool binds; FailClose (the gateway never picks an
    engine itself, past the tenant checks and budgets)."""
    cfg = indexer_config(installed)
    pickers = {p["pool"]: p for p in cfg["pickers"]}
    dep, _, c = indexer_pod(installed)
    pools = find(installed, "InferencePool")
    assert pools
    for pool in pools:
        name, ns = pool["metadata"]["name"], pool["metadata"]["namespace"]
        ref = pool["spec"]["endpointPickerRef"]
        assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
        assert ref["name"] == f"kvasir-picker-{name}"
        assert ref["failureMode"] == "FailClose"
        svc = one(installed, "Service", ref["name"])
        assert svc["metadata"]["namespace"] == ns
        assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
        assert sp.get("appProtocol") == "kubernetes.io/h2c", "gRPC in cleartext HTTP/2"
        assert port_of(c, sp["targetPort"]) == int(pickers[name]["addr"].rsplit(":", 1)[1])
        assert pickers[name]["addr"].startswith("0.0.0.0:"), "reachable from the gateway's pods"


def test_the_pickers_serve_exactly_the_inferencepools_discovered_here(installed, overlaid):
    for docs in (installed, overlaid):
        cfg = indexer_config(docs)
        ns = one(docs, "Deployment", "kvasir-indexer")["metadata"]["namespace"]
        pools = {p["metadata"]["name"] for p in find(docs, "InferencePool")}
        assert {p["pool"] for p in cfg["pickers"]} == pools
        assert {p["name"] for p in cfg["pools"]} == pools
        for p in cfg["pools"]:
            assert p["discovery"] == {"namespace": ns, "inferencePool": p["name"]}, p
            pool = one(docs, "InferencePool", p["name"])
            assert p["model"] in pool["metadata"]["annotations"]["kvasir.dev/models"].split(",")
        # Each picker's document is mounted, and is for its pool.
        for p in cfg["pickers"]:
            doc = json.loads(policy_of(docs, p))
            doc = doc.get("policy", doc)
            assert p["pool"] in {x["indexerPool"] for x in doc["pools"]}, p
        # The indexer's RBAC is what discovery needs, in this namespace.
        role = one(docs, "Role", "kvasir-indexer")
        grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                  for v in rule["verbs"]}
        assert grants == {(g, r, v) for g, r in (("inference.networking.k8s.io", "inferencepools"), ("", "pods"))
                          for v in ("get", "list", "watch")}
        binding = one(docs, "RoleBinding", "kvasir-indexer")
        sa = one(docs, "Deployment", "kvasir-indexer")["spec"]["template"]["spec"]["serviceAccountName"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]


def test_the_overlay_carries_the_compiled_document_and_rolls_the_indexer(installed, overlaid):
    """The placeholder is replaced by exactly what kvasirctl compiled; the
    ConfigMap's hashed name changes, so the Deployment's pods do."""
    (cfg,) = indexer_config(overlaid)["pickers"]
    assert json.loads(policy_of(overlaid, cfg)) == json.loads(compile_example_policy())
    closed = json.loads(policy_of(installed, cfg))
    assert closed["policy"]["defaultAction"]["reject"]["status"] == 503
    assert "docs/picker.md" in closed["policy"]["defaultAction"]["reject"]["message"]
    assert (PICKER / "closed.policy").read_text().strip() == policy_of(installed, cfg).strip()
    names = [[v["configMap"]["name"] for v in indexer_pod(d)[1]["volumes"] if v["name"] == "policy"] for d in
             (installed, overlaid)]
    assert names[0] != names[1] and all(n[0].startswith("kvasir-picker-policy-") for n in names)


def test_the_documented_compile_command_is_the_tested_one():
    """docs/picker.md and the kustomization name the sources compiled here."""
    page = (REPO / "docs" / "picker.md").read_text()
    for s in EXAMPLE_SOURCES + [f"--target {TARGET}", "behavior: replace", "main.json=main.policy"]:
        assert s in page, s


INFERENCE_MATCHES = {
    ("POST", "Exact", "/v1/chat/completions"),
    ("POST", "Exact", "/v1/completions"),
    ("POST", "Exact", "/v1/messages"),
    ("POST", "Exact", "/v1/messages/count_tokens"),
    ("POST", "Exact", "/v1/responses"),
    ("GET", "RegularExpression", "^/v1/responses/[^/]+$"),
    ("POST", "RegularExpression", "^/v1/responses/[^/]+/cancel$"),
}


def test_the_route_sends_only_the_inference_apis_to_the_pool(installed):
    """The same allowlist as the Envoy Gateway install (test_gateway_api.py),
    to the InferencePool as a backend."""
    (route,) = find(installed, "HTTPRoute")
    pools = {p["metadata"]["name"] for p in find(installed, "InferencePool")}
    seen = set()
    for rule in route["spec"]["rules"]:
        for ref in rule["backendRefs"]:
            assert (ref["group"], ref["kind"]) == ("inference.networking.k8s.io", "InferencePool"), ref
            assert ref["name"] in pools
        for m in rule["matches"]:
            seen.add((m["method"], m["path"]["type"], m["path"]["value"]))
    assert seen == INFERENCE_MATCHES
    for _, typ, value in INFERENCE_MATCHES:
        if typ == "RegularExpression":
            for other in ("/v1/responses/a/b", "/v1/responses/", "/v1/responses/a/input_items", "/metrics"):
                assert not re.fullmatch(value, other), (value, other)


def admits(policies: list[dict[str, Any]], pod_labels: dict[str, str], port: int | str,
           peer_ns: str, peer_labels: dict[str, str], ns: str) -> bool:
    """Whether some NetworkPolicy selecting the pod admits the peer on the
    port (the subset of the API the install uses: matchLabels and
    matchExpressions In, pod and namespace selectors, ports by name or
    number)."""
    def selects(sel: dict[str, Any], labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in (sel.get("matchLabels") or {}).items()) and all(
            labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions") or [] if e["operator"] == "In")

    for p in policies:
        if not selects(p["spec"]["podSelector"], pod_labels):
            continue
        for rule in p["spec"].get("ingress") or []:
            if not any(q["port"] == port for q in rule.get("ports") or [{"port": port}]):
                continue
            for f in rule.get("from") or []:
                nsel = f.get("namespaceSelector")
                in_ns = selects(nsel, {"kubernetes.io/metadata.name": peer_ns}) if nsel is not None else peer_ns == ns
                if in_ns and selects(f.get("podSelector") or {}, peer_labels):
                    return True
    return False


def test_the_routes_gateway_reaches_the_picker_and_the_engines(installed):
    """Under the default deny, the proxies of the Gateway the route names
    (found by GEP-1762's label) reach each picker port and each pool's
    engines; a pod of the namespace without that label reaches neither."""
    pols = find(installed, "NetworkPolicy")
    (route,) = find(installed, "HTTPRoute")
    ns = route["metadata"]["namespace"]
    (parent,) = route["spec"]["parentRefs"]
    assert parent.get("namespace", ns) == ns
    proxy = {GATEWAY_LABEL: parent["name"]}
    stranger = {"app": "debug"}
    _, _, c = indexer_pod(installed)
    labels = one(installed, "Deployment", "kvasir-indexer")["spec"]["template"]["metadata"]["labels"]
    for svc in find(installed, "Service"):
        if not svc["metadata"]["name"].startswith("kvasir-picker-"):
            continue
        for sp in svc["spec"]["ports"]:
            named = sp["targetPort"]
            assert admits(pols, labels, named, ns, proxy, ns), svc["metadata"]["name"]
            assert not admits(pols, labels, named, ns, stranger, ns)
            assert not admits(pols, labels, named, "default", proxy, ns)
    for pool in find(installed, "InferencePool"):
        engine = pool["spec"]["selector"]["matchLabels"]
        for tp in pool["spec"]["targetPorts"]:
            assert admits(pols, engine, tp["number"], ns, proxy, ns), pool["metadata"]["name"]
            assert not admits(pols, engine, tp["number"], ns, stranger, ns)


# ---------------------------------------------------------------------------
# The configuration, run
# ---------------------------------------------------------------------------


def need(*bins) -> None:
    if m := missing(*bins):
        pytest.fail(f"missing {', '.join(map(str, m))}: run `make setup` (scripts/go-tools.sh) and `make build`")


def runnable_config(docs: list[dict[str, Any]], tmp: Path, redis_url: str) -> tuple[Path, dict[str, int]]:
    """The rendered indexer configuration with its listen addresses on free
    127.0.0.1 ports, Redis at `redis_url` and each picker's policy file
    written where the test can read it; nothing else changed."""
    text = one(docs, "ConfigMap", "kvasir-picker-indexer")["data"]["indexer.yaml"]
    cfg = yaml.safe_load(text)
    ports = {"grpc": free_port(), "http": free_port()}
    text = text.replace(cfg["grpcAddr"], f"127.0.0.1:{ports['grpc']}", 1)
    text = text.replace(cfg["httpAddr"], f"127.0.0.1:{ports['http']}", 1)
    for url in {cfg["budgets"]["redisUrl"], cfg["sharedLoad"]["redisUrl"], cfg["responses"]["redisUrl"]}:
        text = text.replace(url, redis_url)
    for p in cfg["pickers"]:
        ports[p["pool"]] = free_port()
        policy = tmp / f"{p['pool']}.json"
        policy.write_text(policy_of(docs, p))
        text = text.replace(f"addr: {p['addr']}", f"addr: 127.0.0.1:{ports[p['pool']]}", 1)
        text = text.replace(p["policyFile"], str(policy), 1)
    path = tmp / "indexer.yaml"
    path.write_text(text)
    # Only those values moved.
    moved = yaml.safe_load(text)
    for k in ("pools", "shutdownGraceMs"):
        assert moved[k] == cfg[k], k
    return path, ports


@pytest.fixture(scope="module")
def running(overlaid, artifacts) -> Iterator[dict[str, Any]]:
    """The overlay's indexer, discovering through a real kube-apiserver,
    behind an Envoy that asks its picker as an Inference Extension gateway."""
    need(ETCD_BIN, KUBE_APISERVER_BIN, KUBECTL, INDEXER_BIN, ENVOY_BIN, SIM_BIN)
    if not redis_available():
        pytest.fail("redis-server is missing: `make setup` installs it")
    d = Path(tempfile.mkdtemp(prefix="kvasir-picker-install-"))
    try:
        with Processes() as procs:
            sim = procs.add(start_sim(d, "engine", model=MAIN_MODEL))
            etcd = procs.add(start_etcd(d))
            api = procs.add(start_apiserver(d, etcd))
            crd = UPSTREAM / "inference.networking.k8s.io_inferencepools.yaml"
            api.kubectl("apply", "--server-side", "-f", str(crd), timeout=90)
            api.kubectl("wait", "--for", "condition=Established", "--timeout", "60s",
                        "crd/inferencepools.inference.networking.k8s.io", timeout=75)
            wait_sim(sim)
            # The install's namespace, the indexer's ServiceAccount and RBAC
            # and the InferencePool as rendered; the pool's port moved to
            # the engine's (the one deviation), and one engine pod, Ready on
            # 127.0.0.1 (no kubelet runs here: its status is written).
            keep = [x for x in overlaid if x["kind"] in ("Namespace", "ServiceAccount", "Role", "RoleBinding",
                                                          "InferencePool")]
            pool = next(x for x in keep if x["kind"] == "InferencePool")
            pool["spec"]["targetPorts"] = [{"number": sim.port}]
            ns = pool["metadata"]["namespace"]
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "engine-0", "namespace": ns,
                                "labels": dict(pool["spec"]["selector"]["matchLabels"])},
                   "spec": {"containers": [{"name": "engine", "image": "registry.invalid/engine"}]}}
            api.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(keep + [pod]))
            api.kubectl("patch", "pod", "engine-0", "-n", ns, "--subresource=status", "--type=merge", "-p",
                        json.dumps({"status": {"phase": "Running", "podIP": "127.0.0.1",
                                               "podIPs": [{"ip": "127.0.0.1"}],
                                               "conditions": [{"type": "Ready", "status": "True"}]}}))
            token = api.kubectl("create", "token", "kvasir-indexer", "-n", ns, "--duration", "1h").stdout.strip()
            kubeconfig = write_kubeconfig(d / "indexer.kubeconfig", api.url, api.pki.ca, token)
            redis = procs.add(start_redis(d))
            cfg, ports = runnable_config(overlaid, d, redis.url)
            env = {**os.environ, "KUBECONFIG": str(kubeconfig), "RUST_LOG": "info,kube=warn"}
            ix = procs.add(Proc("cache-indexer", [str(INDEXER_BIN), "--config", str(cfg)], d, env=env))
            wait_until("the indexer ready (its pool discovered, in sync)",
                       lambda: ix.alive() and request("GET", ports["http"], "/readyz", timeout=2)[0] == 200,
                       timeout=60)
            gw = procs.add(start_picker_envoy(d, f"127.0.0.1:{ports['main']}", [sim.address], "override_host",
                                              name="gateway"))
            wait_until("the gateway's Envoy ready", lambda: request("GET", gw.admin, "/ready", timeout=2)[0] == 200)
            yield {"envoy": gw, "sim": sim, "indexer": ix, "http": ports["http"], "api": api, "ns": ns, "dir": d}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def chat(port: int, key: str | None, content: str) -> tuple[int, dict[str, str], bytes]:
    h = {"content-type": "application/json"}
    if key:
        h["authorization"] = f"Bearer {key}"
    body = {"model": MAIN_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    return request("POST", port, "/v1/chat/completions", json.dumps(body), h, timeout=30)


def test_the_indexer_runs_the_rendered_configuration_and_serves_the_gateway(running):
    """As the install's ServiceAccount it found the InferencePool's pod (no
    `forbidden`), and the example policies decide through the picker: a
    tenant's key is served by the discovered engine, no key is a 401, and
    batch work runs while the pool is idle."""
    e, sim = running["envoy"], running["sim"]
    before = sim.metric("vllm:request_success_total")
    status, _, b = chat(e.port, ACME, "What is the capital of France?")
    assert status == 200, b
    assert json.loads(b)["model"] == MAIN_MODEL
    assert chat(e.port, None, "hi")[0] == 401
    status, _, b = chat(e.port, "sk-not-a-tenant", "hi")
    assert status == 401, b
    # The batch class's policy tests the pool's saturation: known from the
    # pool itself, not only from earlier picks.
    status, _, b = chat(e.port, NIGHTLY_EVAL, "nightly evaluation item 1")
    assert status == 200, b
    assert sim.metric("vllm:request_success_total") == before + 2
    picked = request("GET", running["http"], "/metrics")[2].decode()
    assert re.search(r'kvasir_indexer_picker_requests_total\{[^}]*outcome="forwarded"[^}]*\} [1-9]', picked), \
        picked[-2000:]
    assert "forbidden" not in running["indexer"].log().lower(), running["indexer"].log()[-3000:]


def test_the_closed_placeholder_refuses_every_request_naming_the_page(artifacts, tmp_path, installed):
    """Before the operator's overlay, the install's own document answers
    503 in the API's shape and names docs/picker.md (an indexer over a
    static engine: the document is what is under test)."""
    need(INDEXER_BIN, ENVOY_BIN, SIM_BIN)
    with Processes() as procs:
        sim = procs.add(start_sim(tmp_path, "engine", model=MAIN_MODEL))
        wait_sim(sim)
        (p,) = indexer_config(installed)["pickers"]
        policy = tmp_path / "closed.json"
        policy.write_text(policy_of(installed, p))
        picker, http = free_port(), free_port()
        cfg = tmp_path / "indexer.json"
        cfg.write_text(json.dumps({
            "grpcAddr": f"127.0.0.1:{free_port()}", "httpAddr": f"127.0.0.1:{http}",
            "pools": [{"name": p["pool"], "model": MAIN_MODEL, "tokenizer": "approx", "index": "picks",
                       "endpoints": [{"address": sim.address}]}],
            "pickers": [{"addr": f"127.0.0.1:{picker}", "pool": p["pool"], "policyFile": str(policy)}]}))
        ix = procs.add(Proc("cache-indexer", [str(INDEXER_BIN), "--config", str(cfg)], tmp_path))
        wait_until("indexer ready", lambda: ix.alive() and request("GET", http, "/readyz", timeout=2)[0] == 200)
        gw = procs.add(start_picker_envoy(tmp_path, f"127.0.0.1:{picker}", [sim.address], "override_host",
                                          name="gateway"))
        wait_until("envoy ready", lambda: request("GET", gw.admin, "/ready", timeout=2)[0] == 200)
        for key in (ACME, None):
            status, _, b = chat(gw.port, key, "hi")
            assert status == 503, b
            assert "docs/picker.md" in json.loads(b)["error"]["message"], b
        assert sim.metric("vllm:request_success_total") == 0
