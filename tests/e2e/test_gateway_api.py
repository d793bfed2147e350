"""gateway-api/: the manifests a platform engineer applies on a cluster with
Envoy Gateway, checked with no cluster (tests/e2e/test_gateway_eg.py runs
them in the real Envoy Gateway):

- every document validates against its real schema: Envoy Gateway v1.9.1's
  own CRDs (from the Go module cache scripts/go-tools.sh filled, else the
  copies in ../shared/upstream-crds/), Gateway API and InferencePool from
  ../shared/upstream-crds/, ours (crds/), turned into JSON Schema with
  unknown fields refused (as `kubectl apply`'s strict field validation
  does); core kinds against the Kubernetes 1.34 OpenAPI schemas bundled in
  PyPI's `kubernetes-validate` (offline, strict). CEL rules
  (`x-kubernetes-validations`) are skipped here: crds/' own are evaluated
  by the Rust tests (kube-cel); the upstream ones by Envoy Gateway itself
  (test_gateway_eg.py).
- `kubectl kustomize` renders base/, examples/, demo/ and the install
  (with a route token);
- `kvasirctl validate gateway-api/` passes; the EnvoyExtensionPolicy is
  not applied from git (the controller writes it); its reviewable copy,
  generated/envoyextensionpolicy.yaml, is exactly what `kvasirctl compile
  --output envoyextensionpolicy` prints (the controller's object), its
  `config` exactly `kvasirctl compile`'s output;
- the controller's flags, RBAC, Service and image agree with each other and
  with the indexer's, the patch's and the generated policy's names;
- the HTTPRoute's allowlist and its closed rules, the timeouts, retries,
  override-host field and the patch's xDS names agree with each other;
- that compiled configuration loads in the real Envoy 1.40 with the built
  filter (`envoy --mode validate` runs its on_configure), and the four
  example policies do what they say on requests through a real Envoy, the
  real cache-indexer and vllm-sims, with the compiled configuration as it
  is in the EnvoyExtensionPolicy (cluster names unchanged: the bootstrap
  gets clusters of those names).

Not proven here: RBAC against a real API server and the controller's
behaviour on a cluster; see docs/deploy.md, "What is proven where".
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from kvasir_harness import (ENVOY_BIN, INDEXER_BIN, TOKENIZER, WASM, Envoy, Proc, Processes, free_port, request,  # noqa: E402
                            secrets_for, start_sim, wait_sim, wait_until)
from kvasir_harness import bootstrap as render  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GW = REPO / "gateway-api"
UPSTREAM = REPO.parent / "shared" / "upstream-crds"
EG_VERSION = "v1.9.1"   # scripts/go-tools.sh EG_VERSION


def eg_crd_dir() -> Path | None:
    """Envoy Gateway's own CRDs of the release the tests run, from the Go
    module cache scripts/go-tools.sh filled (its chart's generated CRDs),
    when it is there."""
    cache = os.environ.get("GOMODCACHE")
    if not cache and shutil.which("go"):
        cache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, timeout=30).stdout.strip()
    if not cache:
        return None
    d = Path(cache) / "github.com" / "envoyproxy" / f"gateway@{EG_VERSION}" / "charts" / "gateway-helm" / "charts" \
        / "crds" / "crds" / "generated"
    return d if d.is_dir() else None
KVASIRCTL = REPO / "target" / "release" / "kvasirctl"
K8S_VERSION = "1.34"
# What the controller writes, kept for review; applied by nobody from git.
GENERATED_EEP = GW / "generated" / "envoyextensionpolicy.yaml"
EEP_NAME = "kvasir-gateway-inference-gateway"   # api/src/eep.rs name(): kvasir-gateway-<gateway>


# ---------------------------------------------------------------------------
# Documents and schemas
# ---------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in GW.rglob("*.yaml") if p.name != "kustomization.yaml")


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for p in manifest_files():
        for i, d in enumerate(yaml.safe_load_all(p.read_text())):
            if d:
                out.append((f"{p.relative_to(GW)}#{i + 1}", d))
    return out


def structural_to_json_schema(s: Any) -> Any:
    """A CRD's structural schema as JSON Schema: `nullable` allows null,
    `x-kubernetes-int-or-string` is integer or string, objects with
    `properties` refuse unknown fields unless
    `x-kubernetes-preserve-unknown-fields`; other `x-kubernetes-*` keys (CEL
    rules included) are dropped."""
    if isinstance(s, list):
        return [structural_to_json_schema(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: structural_to_json_schema(v) for k, v in s.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if s.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in s and "additionalProperties" not in s and not s.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if s.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@functools.lru_cache(maxsize=1)
def crd_schemas() -> dict[tuple[str, str], tuple[str, dict[str, Any]]]:
    """(apiVersion, kind) -> (source file, JSON Schema) of every served
    version; a later file's kind replaces an earlier one's (Envoy Gateway's
    release CRDs replace the upstream copies)."""
    eg = eg_crd_dir()
    files = sorted(UPSTREAM.glob("*.yaml")) + (sorted(eg.glob("*.yaml")) if eg else []) \
        + sorted((REPO / "crds").glob("*.yaml"))
    out = {}
    for f in files:
        for d in yaml.safe_load_all(f.read_text()):
            if not d or d.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = d["spec"]["group"], d["spec"]["names"]["kind"]
            for v in d["spec"]["versions"]:
                if v.get("served") and "schema" in v:
                    s = structural_to_json_schema(v["schema"]["openAPIV3Schema"])
                    # apiVersion, kind and metadata are the API server's at the
                    # root of every object, whatever the CRD's schema lists.
                    s.setdefault("properties", {})["metadata"] = {"type": "object"}
                    s["properties"].setdefault("apiVersion", {"type": "string"})
                    s["properties"].setdefault("kind", {"type": "string"})
                    out[(f"{group}/{v['name']}", kind)] = (f.name, s)
    return out


def test_the_schema_conversion_refuses_what_the_api_server_refuses():
    """The converter is what the manifest test trusts: a misspelt field, a
    wrong enum value and a missing required field are errors; an
    int-or-string takes both; a nullable field takes null."""
    schemas = crd_schemas()
    _, btp = schemas[("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy")]
    ok = {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "BackendTrafficPolicy", "metadata": {"name": "x"},
          "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "r"}],
                   "retry": {"numRetries": 2}}}
    jsonschema.validate(ok, btp)
    for bad in ({"retry": {"numRetrys": 2}}, {"loadBalancer": {"type": "Fastest"}}, {"loadBalancer": {"endpointOverride": {}}}):
        d = copy.deepcopy(ok)
        d["spec"].update(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(d, btp)
    _, ctp = schemas[("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy")]
    base = {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "ClientTrafficPolicy", "metadata": {"name": "x"}}
    for limit in ("2Mi", 2097152):
        jsonschema.validate({**base, "spec": {"connection": {"bufferLimit": limit}}}, ctp)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**base, "spec": {"connection": {"bufferLimit": [1]}}}, ctp)


@pytest.mark.parametrize("where, doc", documents(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_manifest_validates_against_its_schema(where, doc):
    api, kind = doc.get("apiVersion", ""), doc.get("kind", "")
    schemas = crd_schemas()
    if (api, kind) in schemas:
        src, schema = schemas[(api, kind)]
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{where}: {kind} against {src}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message[:300]}" for e in errors)
        return
    import kubernetes_validate

    assert "/" not in api or api.split("/")[0].endswith(".k8s.io") or api.startswith("apps/"), \
        f"{where}: {api} {kind} has no schema here (neither a CRD in upstream-crds/ or crds/ nor a core kind)"
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{where}: {kind} against Kubernetes {K8S_VERSION}: {str(e)[:600]}")


def test_every_kind_of_the_install_is_there():
    kinds = [d["kind"] for _, d in documents()]
    for k in ("Gateway", "HTTPRoute", "HTTPRouteFilter", "Backend", "InferencePool", "EnvoyExtensionPolicy",
              "EnvoyPatchPolicy", "ClientTrafficPolicy", "BackendTrafficPolicy", "Deployment", "Service",
              "ServiceAccount", "Role", "ConfigMap", "InferencePolicy", "InferenceTenant", "InferenceSettings",
              "InferenceProvider"):
        assert k in kinds, k
    policies = {d["metadata"]["name"] for _, d in documents() if d["kind"] == "InferencePolicy"}
    assert {"cheaper-model-for-easy-prompts", "batch-when-idle", "burst-to-provider", "pii-stays-inside"} <= policies


def doc(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def eep() -> dict[str, Any]:
    """The EnvoyExtensionPolicy the controller writes for base/ + examples/
    (generated/, not applied)."""
    return doc("EnvoyExtensionPolicy", EEP_NAME)


def eep_wasm() -> dict[str, Any]:
    return eep()["spec"]["wasm"][0]


# ---------------------------------------------------------------------------
# What the manifests say
# ---------------------------------------------------------------------------

INFERENCE_MATCHES = {
    ("POST", "Exact", "/v1/chat/completions"),
    ("POST", "Exact", "/v1/completions"),
    ("POST", "Exact", "/v1/messages"),
    ("POST", "Exact", "/v1/messages/count_tokens"),
    ("POST", "Exact", "/v1/responses"),
    ("GET", "RegularExpression", "^/v1/responses/[^/]+$"),
    ("POST", "RegularExpression", "^/v1/responses/[^/]+/cancel$"),
}
INFERENCE_PATHS = {p for _, _, p in INFERENCE_MATCHES}
ROUTE_HEADER = "x-kvasir-cluster"
ENDPOINT_HEADER = "x-gateway-destination-endpoint"


def route_filter(ref: dict[str, Any]) -> dict[str, Any]:
    """The HTTPRouteFilter an ExtensionRef filter names."""
    assert ref["type"] == "ExtensionRef" and ref["extensionRef"]["kind"] == "HTTPRouteFilter", ref
    return doc("HTTPRouteFilter", ref["extensionRef"]["name"])


def test_the_route_lets_only_the_inference_apis_through():
    route = doc("HTTPRoute", "inference")
    rules = {r["name"]: r for r in route["spec"]["rules"]}
    backends = {n for n, r in rules.items() if r.get("backendRefs")}
    seen = set()
    for name in backends:
        assert rules[name]["matches"], "a rule without matches matches every path"
        for m in rules[name]["matches"]:
            seen.add((m["method"], m["path"]["type"], m["path"]["value"]))
    assert seen == INFERENCE_MATCHES
    # The regular expressions are anchored and cannot reach another path.
    for _, typ, value in INFERENCE_MATCHES:
        if typ == "RegularExpression":
            rx = re.compile(value)
            assert rx.fullmatch("/v1/responses/resp_1") or rx.fullmatch("/v1/responses/resp_1/cancel"), value
            for other in ("/v1/responses/a/b", "/v1/responses/", "/v1/responses/a/../../metrics", "/metrics"):
                assert not rx.fullmatch(other), (value, other)
    # Each cluster the compiled configuration can name has a rule that
    # matches it in x-kvasir-cluster, for every inference path, and only
    # such rules reach a backend.
    cfg = eep_wasm()["config"]
    clusters = {p["cluster"] for p in cfg["pools"]} | {p["cluster"] for p in cfg["providers"]}
    by_header: dict[str, set[str]] = {}
    for name in backends:
        for m in rules[name]["matches"]:
            (h,) = m["headers"]
            assert h["name"] == ROUTE_HEADER and h["type"] == "Exact"
            by_header.setdefault(h["value"], set()).add(m["path"]["value"])
    assert by_header == {c: INFERENCE_PATHS for c in clusters}


def test_without_the_filter_no_rule_reaches_a_backend():
    """The rules a request matches before the filter ran (no route header)
    reach nothing: each inference path answers 503 in its API's shape, GET
    /v1/models the gateway's own list of the pools' models, any other path
    404 in its API's shape. Every value that selects a backend ends in the
    route token (ROUTE-TOKEN, replaced at build time: test_gateway_eg.py
    renders it), and the edge removes a client's route header and endpoint
    list before any route is matched."""
    route = doc("HTTPRoute", "inference")
    headerless = [r for r in route["spec"]["rules"] if not any(m.get("headers") for m in r["matches"])]
    assert {r["name"] for r in headerless} == {"unavailable", "unavailable-anthropic", "models", "not-found",
                                               "not-found-anthropic"}
    shapes = {}
    for r in headerless:
        assert not r.get("backendRefs"), r["name"]
        (f,) = r["filters"]
        resp = route_filter(f)["spec"]["directResponse"]
        body = json.loads(resp["body"]["inline"])
        assert resp["contentType"] == "application/json"
        shapes[r["name"]] = (resp["statusCode"], "openai" if "error" in body and "type" not in body else "anthropic",
                             {(m.get("method"), m["path"]["value"]) for m in r["matches"]})
    anthropic = {("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")}
    assert shapes["unavailable"] == (503, "openai", {(m, p) for m, _, p in INFERENCE_MATCHES} - anthropic)
    assert shapes["unavailable-anthropic"] == (503, "anthropic", anthropic)
    assert shapes["not-found"] == (404, "openai", {(None, "/")})
    assert shapes["not-found-anthropic"] == (404, "anthropic", {(None, "/v1/messages")})
    assert shapes["models"][0] == 200 and shapes["models"][2] == {("GET", "/v1/models")}
    models = json.loads(route_filter(next(r for r in headerless if r["name"] == "models")["filters"][0])
                        ["spec"]["directResponse"]["body"]["inline"])
    served = {m for _, d in documents() if d["kind"] == "InferencePool"
              for m in d["metadata"]["annotations"]["kvasir.dev/models"].split(",")}
    assert {m["id"] for m in models["data"]} == served
    for r in route["spec"]["rules"]:
        for m in r["matches"]:
            for h in m.get("headers", []):
                assert h["value"].endswith("/ROUTE-TOKEN"), h
    for _, d in documents():
        if d["kind"] in ("InferencePool", "InferenceProvider"):
            assert d["metadata"]["annotations"]["kvasir.dev/cluster"].endswith("/ROUTE-TOKEN"), d["metadata"]
    early = doc("ClientTrafficPolicy", "inference-gateway")["spec"]["headers"]["earlyRequestHeaders"]
    assert set(early["remove"]) == {ROUTE_HEADER, ENDPOINT_HEADER}


def test_internal_headers_and_credentials_stop_at_the_gateway():
    """Rules that reach a backend remove the route header (it carries the
    token); the provider's rules remove the endpoint list too and rewrite
    the host themselves (the provider sets no `authority`: a filter-side
    rewrite happens before the re-match and would select another virtual
    host once the route has hostnames); the provider's credential is an
    upstream filter of its cluster (a backendRef filter), never a route
    filter (which would not run after the re-match); the pools' clusters
    remove the endpoint list after load balancing (the patch)."""
    rules = {r["name"]: r for r in doc("HTTPRoute", "inference")["spec"]["rules"]}
    for name, r in rules.items():
        if not r.get("backendRefs"):
            continue
        mods = [f["requestHeaderModifier"] for f in r["filters"] if f["type"] == "RequestHeaderModifier"]
        removed = {h for m in mods for h in m.get("remove", [])}
        assert ROUTE_HEADER in removed, name
        assert not [f for f in r["filters"] if f["type"] == "ExtensionRef"], name
        (ref,) = r["backendRefs"]
        if ref.get("kind") == "Backend":
            assert ENDPOINT_HEADER in removed, name
            rewrite = [f["urlRewrite"]["hostname"] for f in r["filters"] if f["type"] == "URLRewrite"]
            assert rewrite == ["api.openai.com"], name
            (cred,) = ref["filters"]
            spec = route_filter(cred)["spec"]["credentialInjection"]
            assert spec["overwrite"] is True and spec["credential"]["valueRef"]["name"] == "openai-credential"
        else:
            # A route-level removal runs before load balancing and would
            # turn the pick off: the cluster removes it.
            assert ENDPOINT_HEADER not in removed, name
    assert [p for p in eep_wasm()["config"]["providers"] if p.get("authority")] == []
    assert doc("Backend", "openai")["spec"]["tls"]["wellKnownCACertificates"] == "System"


def test_the_pools_services_select_what_their_inferencepools_select():
    """Envoy Gateway routes to a Service per pool (it accepts no
    InferencePool backend); the InferencePool stays the source of truth
    for Kvasir (controller, indexer discovery): both select the same pods
    on the same port, and each pool rule routes to its pool's Service."""
    rules = {r["name"]: r for r in doc("HTTPRoute", "inference")["spec"]["rules"]}
    for _, pool in documents():
        if pool["kind"] != "InferencePool":
            continue
        name = pool["metadata"]["name"]
        svc = doc("Service", f"kvasir-pool-{name}")
        assert svc["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == [p["number"] for p in pool["spec"]["targetPorts"]]
        for rule in (name, f"{name}-stored"):
            assert rules[rule]["backendRefs"] == [{"name": svc["metadata"]["name"], "port": svc["spec"]["ports"][0]["port"]}]
        value = pool["metadata"]["annotations"]["kvasir.dev/cluster"]
        assert {h["value"] for m in rules[name]["matches"] for h in m["headers"]} == {value}


def test_client_and_backend_traffic_policies_carry_the_safe_defaults():
    ctp = doc("ClientTrafficPolicy", "inference-gateway")["spec"]
    assert ctp["timeout"]["http"] == {"requestReceivedTimeout": "60s", "requestHeadersReceivedTimeout": "10s",
                                      "streamIdleTimeout": "300s", "idleTimeout": "300s"}
    assert ctp["connection"]["bufferLimit"] == "2Mi"
    # The filter's body limit fits under Envoy's buffer.
    settings_limit = 1048575
    assert settings_limit < 2 * 1024 * 1024
    btp = doc("BackendTrafficPolicy", "inference")["spec"]
    assert btp["retry"]["retryOn"]["triggers"] == ["5xx", "connect-failure", "refused-stream", "reset"]
    assert btp["retry"]["numRetries"] == 1
    stored = doc("BackendTrafficPolicy", "inference-stored")["spec"]
    assert stored["retry"] == {"numRetries": 0}
    rules = {r["name"] for r in doc("HTTPRoute", "inference")["spec"]["rules"] if r.get("backendRefs")}
    assert sorted(t["sectionName"] for p in (btp, stored) for t in p["targetRefs"]) == sorted(rules)
    assert sorted(t["sectionName"] for t in stored["targetRefs"]) == sorted(r for r in rules if r.endswith("-stored"))
    for p in (btp, stored):
        assert p["loadBalancer"]["endpointOverride"]["extractFrom"] == [{"header": ENDPOINT_HEADER}]
        assert p["routingType"] == "Endpoint"
    # No override of answers by status: it would replace the filter's own
    # JSON replies and the Anthropic shape.
    assert not [d for _, d in documents() if d["kind"] == "BackendTrafficPolicy" and "responseOverride" in d["spec"]]


def test_the_extension_policy_does_not_fail_open_and_pins_the_module():
    w = eep()["spec"]["wasm"]
    assert len(w) == 1 and w[0]["failOpen"] is False
    assert w[0]["code"]["type"] == "HTTP" and re.fullmatch(r"[0-9a-f]{64}", w[0]["code"]["http"]["sha256"])
    # Content-addressed: the URL names the digest it must have.
    assert w[0]["code"]["http"]["url"].endswith(f"/kvasir_filter-{w[0]['code']['http']['sha256']}.wasm")
    # The digest is of a build, not necessarily of the one in target/ now
    # (other work changes the filter); the controller writes the served one.
    patch = doc("EnvoyPatchPolicy", "kvasir")["spec"]["jsonPatches"]
    assert any(p["operation"].get("path", "").endswith("allow_on_headers_stop_iteration") and p["operation"]["value"] is True
               for p in patch)
    indexer = [p for p in patch if p["name"] == "kvasir-indexer"]
    assert indexer and indexer[0]["operation"]["value"]["name"] == "kvasir-indexer"
    # The cluster is the one the compiled configuration names.
    cfg = eep_wasm()["config"]
    assert {p["indexerCluster"] for p in cfg["pools"]} == {"kvasir-indexer"}


def test_the_patch_names_follow_the_gateway_the_route_and_the_extension_policy():
    """Envoy Gateway's xDS names under the name scheme the install pins
    (docs/deploy.md: XDSNameSchemeV2 disabled): listener
    `<ns>/<gateway>/<listener>`, rule i's cluster `httproute/<ns>/<route>/rule/<i>`;
    the wasm filter is found by the policy's root id, not its name.
    Renaming the Gateway, its listener or reordering the rules must update
    the patch (test_gateway_eg.py checks them in Envoy Gateway itself)."""
    gw = doc("Gateway", "inference-gateway")
    ns = gw["metadata"]["namespace"]
    patch = doc("EnvoyPatchPolicy", "kvasir")["spec"]
    listener = f"{ns}/{gw['metadata']['name']}/{gw['spec']['listeners'][0]['name']}"
    op = next(p for p in patch["jsonPatches"] if p["type"].endswith("Listener"))
    assert op["name"] == listener
    assert op["operation"]["jsonPath"] == f"..http_filters[?(@.typed_config.config.root_id=='{eep_wasm()['rootID']}')]"
    assert patch["targetRef"]["name"] == gw["metadata"]["name"]
    route = doc("HTTPRoute", "inference")
    to_pools = [i for i, r in enumerate(route["spec"]["rules"])
                if any(b.get("kind", "Service") == "Service" for b in r.get("backendRefs", []))]
    clusters = [p["name"] for p in patch["jsonPatches"] if p["name"].startswith("httproute/")]
    assert clusters == [f"httproute/{ns}/{route['metadata']['name']}/rule/{i}" for i in to_pools]
    for p in patch["jsonPatches"]:
        if p["name"] in clusters:
            opts = p["operation"]["value"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            names = [f["name"] for f in opts["http_filters"]]
            assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.upstream_codec"]
            assert opts["http_filters"][0]["typed_config"]["mutations"]["request_mutations"] == [{"remove": ENDPOINT_HEADER}]
    # The deploy page pins the scheme these names are written for.
    deploy = (REPO / "docs" / "deploy.md").read_text()
    assert "runtimeFlags.disabled[0]=XDSNameSchemeV2" in deploy


def indexer_deployment() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    dep = doc("Deployment", "kvasir-indexer")
    pod = dep["spec"]["template"]["spec"]
    return dep, pod, pod["containers"][0]


def test_the_indexer_runs_twice_with_probes_resources_and_its_token():
    dep, pod, c = indexer_deployment()
    assert dep["spec"]["replicas"] == 2
    assert {"readinessProbe", "livenessProbe", "resources"} <= set(c)
    cfg = yaml.safe_load(doc("ConfigMap", "kvasir-indexer")["data"]["indexer.yaml"])
    token_dir = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "token")
    assert cfg["grpcTokenFile"].startswith(token_dir + "/")
    vol = next(v for v in pod["volumes"] if v["name"] == "token")
    assert vol["secret"]["secretName"] == "kvasir-indexer-token"
    # The config file the args name is the ConfigMap's key where it is mounted.
    config_dir = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    assert c["args"] == ["--config", f"{config_dir}/indexer.yaml"]
    assert next(v for v in pod["volumes"] if v["name"] == "config")["configMap"]["name"] == "kvasir-indexer"
    # No Secret with a value is shipped for the token or the provider key.
    for _, d in documents():
        if d["kind"] == "Secret":
            assert d["metadata"]["name"].endswith("-api-keys"), d["metadata"]["name"]


def test_the_indexer_reads_its_pools_from_the_controllers_configmap():
    """No pools inline: `poolsFile` is the key `pools.yaml` of the ConfigMap
    the controller writes (`--indexer-pools-configmap`), mounted optional
    (the pod starts before the controller wrote it), at a path that is not
    inside another ConfigMap volume; nobody ships that ConfigMap from git
    (the controller's server-side apply would conflict with it)."""
    _, pod, c = indexer_deployment()
    cfg = yaml.safe_load(doc("ConfigMap", "kvasir-indexer")["data"]["indexer.yaml"])
    assert cfg.get("pools", []) == []
    vol = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name") == "kvasir-indexer-pools")
    assert vol["configMap"].get("optional") is True
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == vol["name"])
    assert cfg["poolsFile"] == f"{mount}/pools.yaml"
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert not [(a, b) for a in mounts for b in mounts if a != b and b.startswith(a + "/")], mounts
    assert controller_flags()["--indexer-pools-configmap"] == ["kvasir-indexer-pools"]
    assert not [d for _, d in documents() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvasir-indexer-pools"]


def test_the_indexer_replicas_share_budgets_load_and_responses_through_the_redis_shipped():
    """Two replicas must act as one (one budget per tenant, not one per
    replica): budgets, shared load and the Responses store all point at the
    Service of the Redis Deployment base/ ships (by its short name: same
    namespace, whichever the install's is), which keeps nothing on disk
    (soft state) and runs unprivileged."""
    cfg = yaml.safe_load(doc("ConfigMap", "kvasir-indexer")["data"]["indexer.yaml"])
    svc = doc("Service", "kvasir-redis")
    port = svc["spec"]["ports"][0]["port"]
    assert svc["metadata"]["namespace"] == doc("Deployment", "kvasir-indexer")["metadata"]["namespace"]
    url = f"redis://{svc['metadata']['name']}:{port}"
    assert cfg["budgets"] == {"store": "redis", "redisUrl": url}
    assert cfg["sharedLoad"]["redisUrl"] == url
    assert cfg["responses"] == {"store": "redis", "redisUrl": url}
    dep = doc("Deployment", "kvasir-redis")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:4] == ["--save", "", "--appendonly", "no"], c["args"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def pools_file_for_the_example_pools() -> str:
    """What the controller's pools.yaml holds for base/inferencepools.yaml,
    restated here from the annotation table of api/src/indexer.rs (a
    `pools:` list in the indexer's pool shape, discovery by InferencePool).
    NOT the controller's generator itself (the Rust tests cover that): this
    shows only that the real indexer reads such a file next to the
    ConfigMap's indexer.yaml."""
    pools = []
    for _, d in documents():
        if d["kind"] == "InferencePool":
            a = d["metadata"].get("annotations", {})
            discovery = {"namespace": d["metadata"]["namespace"], "inferencePool": d["metadata"]["name"]}
            if any(k in a for k in ("kvasir.dev/kv-events-port", "kvasir.dev/kv-replay-port", "kvasir.dev/kv-events-topic")):
                discovery |= {"eventsPort": int(a.get("kvasir.dev/kv-events-port", 5557)),
                              "replayPort": int(a.get("kvasir.dev/kv-replay-port", 5558)),
                              "topic": a.get("kvasir.dev/kv-events-topic", "")}
            # Else no ports: the indexer asks each engine's /kv_event_sources.
            pools.append({"name": a.get("kvasir.dev/indexer-pool", d["metadata"]["name"]),
                          "model": a["kvasir.dev/models"].split(",")[0].strip(),
                          "blockSize": int(a.get("kvasir.dev/block-size", 16)),
                          "tokenizer": a.get("kvasir.dev/tokenizer", "render"),
                          "discovery": discovery})
    return yaml.safe_dump({"pools": pools}, sort_keys=False)


def test_the_indexer_accepts_its_configmap(tmp_path):
    """The ConfigMap's indexer.yaml passes the real cache-indexer's own
    configuration checks (exit 2 and a named field on a bad one, in either
    file). With a pools file of the example pools it stops at discovery,
    which needs a Kubernetes API server (exit 1): the file's pools were
    read. Without the file it starts, with a warning."""
    if not INDEXER_BIN.exists():
        pytest.fail(f"{INDEXER_BIN} is missing: run `make build`")
    text = doc("ConfigMap", "kvasir-indexer")["data"]["indexer.yaml"]
    cfg = yaml.safe_load(text)
    token = tmp_path / "token"
    token.write_text("t")
    pools = tmp_path / "pools.yaml"
    pools.write_text(pools_file_for_the_example_pools())
    good = tmp_path / "indexer.yaml"
    good.write_text(text.replace(cfg["grpcTokenFile"], str(token)).replace(cfg["poolsFile"], str(pools))
                    .replace(cfg["grpcAddr"], f"127.0.0.1:{free_port()}").replace(cfg["httpAddr"], f"127.0.0.1:{free_port()}"))
    r = subprocess.run([str(INDEXER_BIN), "--config", str(good)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "discovery needs a Kubernetes client" in r.stderr, (r.returncode, r.stderr)
    pools.write_text(pools.read_text().replace("blockSize: 16", "blockSizes: 16", 1))
    r = subprocess.run([str(INDEXER_BIN), "--config", str(good)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "blockSizes" in r.stderr, (r.returncode, r.stderr)
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("shutdownGraceMs", "shutdownGraceMS", 1))
    r = subprocess.run([str(INDEXER_BIN), "--config", str(bad)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "shutdownGraceMS" in r.stderr, (r.returncode, r.stderr)
    # Before the controller has written the ConfigMap the file is missing:
    # the indexer starts anyway (no pools, a warning naming the file)
    # instead of crash-looping; the controller rolls it once it writes.
    pools.unlink()
    p = subprocess.Popen([str(INDEXER_BIN), "--config", str(good)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=3)
    finally:
        p.kill()
        out = p.communicate(timeout=10)[0]
    assert "poolsFile not found" in out and str(pools) in out, out[-2000:]


# ---------------------------------------------------------------------------
# The controller
# ---------------------------------------------------------------------------


def controller_container() -> dict[str, Any]:
    return doc("Deployment", "kvasir-controller")["spec"]["template"]["spec"]["containers"][0]


def controller_flags() -> dict[str, list[str]]:
    """The controller's args as flag -> values (`--flag=value` or
    `--flag value`)."""
    out: dict[str, list[str]] = {}
    args = controller_container()["args"]
    i = 0
    while i < len(args):
        a = args[i]
        assert a.startswith("--"), args
        if "=" in a:
            k, v = a.split("=", 1)
        else:
            k, v = a, args[i + 1]
            i += 1
        out.setdefault(k, []).append(v)
        i += 1
    return out


def test_the_controller_runs_with_the_decided_flags():
    f = controller_flags()
    assert f == {
        "--http-addr": ["0.0.0.0:8080"], "--metrics-addr": ["0.0.0.0:9090"], "--wasm-file": ["/kvasir_filter.wasm"],
        "--wasm-url": ["http://kvasir-controller.$(POD_NAMESPACE).svc.cluster.local:8080/kvasir_filter-{sha256}.wasm"],
        "--namespace": ["$(POD_NAMESPACE)"], "--lease-namespace": ["$(POD_NAMESPACE)"], "--lease-name": ["kvasir-controller"],
        "--identity": ["$(POD_NAME)"], "--indexer-cluster": ["kvasir-indexer"],
        "--indexer-deployment": ["kvasir-indexer"], "--indexer-pools-configmap": ["kvasir-indexer-pools"]}
    c = controller_container()
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8080, "metrics": 9090}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # The Service the wasm URL names serves port http of these pods.
    dep = doc("Deployment", "kvasir-controller")
    svc = doc("Service", "kvasir-controller")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert {(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {("http", 8080, "http"),
                                                                                       ("metrics", 9090, "metrics")}
    # The controller serves its own namespace (the downward API's), where
    # everything else of the install is too.
    ns = dep["metadata"]["namespace"]
    assert {d["metadata"].get("namespace") for _, d in documents() if d["kind"] not in ("GatewayClass", "Namespace")} \
        == {ns}
    url = f["--wasm-url"][0]
    assert url == f"http://{svc['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local:8080/kvasir_filter-{{sha256}}.wasm"
    # The generated policy fetches the module from there, at the URL of its
    # digest; the compiled configuration names the same indexer cluster;
    # the indexer the controller rolls is the shipped one.
    code = eep_wasm()["code"]["http"]
    assert code["url"] == url.replace("$(POD_NAMESPACE)", ns).replace("{sha256}", code["sha256"])
    assert {p["indexerCluster"] for p in eep_wasm()["config"]["pools"]} == set(f["--indexer-cluster"])
    assert doc("Deployment", f["--indexer-deployment"][0])["metadata"]["namespace"] == ns
    # The image has the module where --wasm-file says and runs as the pod's user.
    dockerfile = (GW / "Dockerfile.controller").read_text()
    assert re.search(r"^COPY --from=build \S+ " + re.escape(f["--wasm-file"][0]) + "$", dockerfile, re.M), dockerfile
    assert re.search(r"^USER 65532:65532$", dockerfile, re.M)
    assert doc("Deployment", "kvasir-controller")["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 65532
    assert "does not exist" not in (GW / "base" / "controller.yaml").read_text() + dockerfile


def bindings_of(sa_namespace: str, sa: str) -> list[dict[str, Any]]:
    return [d for _, d in documents() if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
            and any(s["kind"] == "ServiceAccount" and s["name"] == sa and s["namespace"] == sa_namespace
                    for s in d["subjects"])]


def rules_of(binding: dict[str, Any]) -> list[dict[str, Any]]:
    ref = binding["roleRef"]
    if ref["kind"] == "ClusterRole":
        return doc("ClusterRole", ref["name"])["rules"]
    return next(d for _, d in documents() if d["kind"] == "Role" and d["metadata"]["name"] == ref["name"]
                and d["metadata"]["namespace"] == binding["metadata"]["namespace"])["rules"]


def grants(binding: dict[str, Any]) -> set[tuple[str, str, str, str | None]]:
    """(apiGroup, resource, verb, resourceName or None) for every rule."""
    out = set()
    for r in rules_of(binding):
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    for n in r.get("resourceNames") or [None]:
                        out.add((g, res, v, n))
    return out


KINDS = ["inferencepolicies", "inferencetenants", "inferenceproviders", "inferencesettings"]


def test_the_controller_rbac_is_least_privilege():
    """Exactly the calls the controller makes, in its own namespace (the one
    it serves): nothing cluster-wide, no wildcard, no delete but of its own
    EnvoyExtensionPolicies, names wherever RBAC can limit them (not
    `create`: the API server checks it before a name is known)."""
    ns = doc("Deployment", "kvasir-controller")["metadata"]["namespace"]
    bindings = bindings_of(ns, "kvasir-controller")
    assert bindings and all(b["kind"] == "RoleBinding" for b in bindings), "nothing is bound cluster-wide"
    assert all(b["roleRef"]["kind"] == "Role" for b in bindings)
    assert controller_flags()["--namespace"] == ["$(POD_NAMESPACE)"]
    served = {ns}
    per_ns: dict[str, set] = {}
    for b in bindings:
        for r in rules_of(b):
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in r.get(field, []), r
        per_ns.setdefault(b["metadata"]["namespace"], set()).update(grants(b))
    assert set(per_ns) == served
    want_served = {("kvasir.dev", k, v, None) for k in KINDS for v in ("get", "list", "watch", "patch")} \
        | {("kvasir.dev", f"{k}/status", "patch", None) for k in KINDS} \
        | {("inference.networking.k8s.io", "inferencepools", v, None) for v in ("get", "list", "watch")} \
        | {("", "secrets", v, None) for v in ("get", "list", "watch")} \
        | {("gateway.envoyproxy.io", "envoyextensionpolicies", v, None)
           for v in ("get", "list", "watch", "create", "patch", "delete")} \
        | {("", "configmaps", "create", None)} \
        | {("", "configmaps", v, "kvasir-indexer-pools") for v in ("get", "patch")} \
        | {("apps", "deployments", v, "kvasir-indexer") for v in ("get", "patch")} \
        | {("gateway.networking.k8s.io", r, v, None) for r in ("gateways", "httproutes") for v in ("list", "watch")}
    want_served |= {("coordination.k8s.io", "leases", "create", None),
                    ("coordination.k8s.io", "leases", "get", "kvasir-controller"),
                    ("coordination.k8s.io", "leases", "update", "kvasir-controller")}
    assert per_ns[ns] == want_served, (ns, sorted(per_ns[ns] ^ want_served, key=str))
    assert controller_flags()["--lease-name"] == ["kvasir-controller"]
    # No ClusterRole at all: nothing to bind cluster-wide by mistake.
    assert not [d for _, d in documents() if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    # The names RBAC limits are the objects the flags name.
    f = controller_flags()
    assert ("", "configmaps", "patch", f["--indexer-pools-configmap"][0]) in want_served
    assert ("apps", "deployments", "patch", f["--indexer-deployment"][0]) in want_served
    # The indexer's own ServiceAccount reads pools and pods, nothing else.
    idx = bindings_of(ns, "kvasir-indexer")
    assert set().union(*(grants(b) for b in idx)) == {
        ("inference.networking.k8s.io", "inferencepools", v, None) for v in ("get", "list", "watch")} | {
        ("", "pods", v, None) for v in ("get", "list", "watch")}


# ---------------------------------------------------------------------------
# kustomize and kvasirctl
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("root", ["base", "examples", "demo"])
def test_kustomize_renders(root):
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed: `make setup` installs Debian's kubernetes-client"
    r = subprocess.run([kubectl, "kustomize", str(GW / root)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rendered = [d for d in yaml.safe_load_all(r.stdout) if d]
    # Every file of the directory is in the kustomization.
    want = sorted((d["kind"], d["metadata"]["name"]) for f in sorted((GW / root).glob("*.yaml"))
                  if f.name != "kustomization.yaml" for d in yaml.safe_load_all(f.read_text()) if d)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == want


def test_the_install_is_base_and_examples_with_the_route_token(tmp_path):
    """`kubectl kustomize gateway-api/` (with a route token) is base/ and
    examples/, nothing more (the token's ConfigMap is never applied; demo/
    and generated/ are not in it)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed: `make setup` installs Debian's kubernetes-client"
    gw = tmp_path / "gateway-api"
    shutil.copytree(GW, gw, ignore=shutil.ignore_patterns("route-token.env"))
    (gw / "install" / "route-token.env").write_text("routeToken=abc123\n")
    r = subprocess.run([kubectl, "kustomize", str(gw)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rendered = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(r.stdout) if d)
    want = sorted((d["kind"], d["metadata"]["name"]) for p in (GW / "base", GW / "examples")
                  for f in sorted(p.glob("*.yaml")) if f.name != "kustomization.yaml"
                  for d in yaml.safe_load_all(f.read_text()) if d)
    assert rendered == want


def kvasirctl(*args: str) -> subprocess.CompletedProcess:
    if not KVASIRCTL.exists():
        pytest.fail(f"{KVASIRCTL} is missing: run `make build`")
    return subprocess.run([str(KVASIRCTL), *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_kvasirctl_validates_the_directory():
    r = kvasirctl("validate", "-o", "json", "gateway-api/")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["valid"] and out["errors"] == [] and out["targets"] == ["serving/Gateway/inference-gateway"]
    # Only kinds kvasirctl does not read are warned about.
    assert all("is not a kind kvasirctl reads" in w["message"] for w in out["warnings"]), out["warnings"]


def compiled() -> dict[str, Any]:
    r = kvasirctl("compile", "gateway-api/", "--target", "Gateway/inference-gateway")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_extension_policy_config_is_kvasirctl_compile_output():
    """The reviewable copy's config is kvasirctl's output: they cannot drift."""
    assert eep_wasm()["config"] == compiled()


def eep_command(sha256: str) -> list[str]:
    """The command generated/envoyextensionpolicy.yaml is the output of (its
    header says so)."""
    return ["compile", "gateway-api/", "--target", "Gateway/inference-gateway", "--output", "envoyextensionpolicy",
            "--format", "yaml", "--wasm-url", eep_wasm()["code"]["http"]["url"], "--wasm-sha256", sha256]


def strip_header(text: str) -> str:
    lines = text.splitlines(keepends=True)
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        lines.pop(0)
    return "".join(lines)


def test_the_generated_extension_policy_is_what_the_controller_writes():
    """generated/envoyextensionpolicy.yaml is `kvasirctl compile --output
    envoyextensionpolicy --format yaml` for base/ + examples/ (the
    controller's object, api/src/eep.rs), byte for byte after its comment
    header, and the same object as the JSON the controller applies. The
    module digest is the file's own (of the build it was generated with;
    the controller writes the digest of the module it serves)."""
    text = GENERATED_EEP.read_text()
    header = text[: len(text) - len(strip_header(text))]
    assert "generated" in header.lower() and "kvasirctl compile" in header and "must not be applied" in header, header
    w = eep_wasm()
    sha = w["code"]["http"]["sha256"]
    assert re.fullmatch(r"[0-9a-f]{64}", sha)
    # The header names the command (flags, URL and digest) that regenerates it.
    assert all(a in header for a in eep_command(sha)), header
    r = kvasirctl(*eep_command(sha))
    assert r.returncode == 0, f"{r.stderr} (a kvasirctl built before --output envoyextensionpolicy: run `make build`)"
    assert strip_header(text) == r.stdout, "regenerate: see the header of " + str(GENERATED_EEP)
    # The same object as the controller's exact bytes (JSON).
    j = kvasirctl(*[x for x in eep_command(sha) if x not in ("--format", "yaml")])
    assert j.returncode == 0, j.stderr
    assert json.loads(j.stdout) == yaml.safe_load(r.stdout) == eep()
    # What the controller's object must say, whatever kvasirctl prints.
    assert eep()["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "kvasir-controller",
                                           "kvasir.dev/target-kind": "Gateway", "kvasir.dev/target-name": "inference-gateway"}
    assert eep()["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"}]
    assert w["failOpen"] is False and w["code"]["type"] == "HTTP"
    assert eep()["metadata"]["annotations"]["kvasir.dev/config-sha256"] == \
        "sha256:" + hashlib.sha256(kvasirctl("compile", "gateway-api/", "--target", "Gateway/inference-gateway").stdout.encode()).hexdigest()


def test_the_extension_policy_is_not_applied_from_git():
    """The controller server-side applies the whole policy (Envoy Gateway's
    `spec.wasm` is an atomic list): one applied from git too would make
    its apply conflict. No kustomization names generated/, and nothing under
    base/ or examples/ is an EnvoyExtensionPolicy."""
    for root in ("base", "examples"):
        for f in (GW / root).glob("*.yaml"):
            assert "EnvoyExtensionPolicy" not in [d.get("kind") for d in yaml.safe_load_all(f.read_text()) if d], f
    for k in GW.rglob("kustomization.yaml"):
        assert "generated" not in yaml.safe_load(k.read_text()).get("resources", []), k
    assert not (GW / "generated" / "kustomization.yaml").exists()


# ---------------------------------------------------------------------------
# The compiled configuration in a real Envoy with the filter
# ---------------------------------------------------------------------------

MAIN_MODEL = "llama-3.1-8b-instruct"
SMALL_MODEL = "llama-3.2-1b-instruct"
PROVIDER_MODEL = "gpt-4o-mini"
ACME = "sk-acme-example-1"      # gateway-api/demo/demo-keys.yaml
BATCH = "sk-eval-example"       # nightly-eval's key (base64 in the example Secret)


def eep_config() -> str:
    return json.dumps(eep_wasm()["config"])


def bootstrap(tmp: Path, main: list[str], small: list[str], indexer: str, provider: str) -> tuple[str, int, int]:
    """The shipped bootstrap (envoy/render.py) with the EnvoyExtensionPolicy's
    config as the plugin configuration, unchanged, and clusters named as
    in it: the pool cluster copied to the pools' cluster values, the
    provider's renamed to its value, the indexer's `kvasir-indexer`."""
    s = secrets_for(tmp)
    port, admin = free_port(), free_port()
    text = render.render(render.TEMPLATE.read_text(), listen_port=port, admin_port=admin, pool_endpoints=main,
                         indexer=indexer, provider=provider, wasm=str(WASM), plugin_config=eep_config(),
                         health_interval_s=0.5, provider_sds=str(s.provider_sds), indexer_sds=str(s.indexer_sds))
    b = yaml.safe_load(text)
    clusters = b["static_resources"]["clusters"]
    by_name = {c["name"]: c for c in clusters}
    cfg = json.loads(eep_config())

    def endpoints(addrs):
        return [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": a.rsplit(":", 1)[0],
                                                                              "port_value": int(a.rsplit(":", 1)[1])}}}}
                                  for a in addrs]}]

    for pool, addrs in (("main", main), ("small", small)):
        name = next(p["cluster"] for p in cfg["pools"] if p["name"] == pool)
        c = copy.deepcopy(by_name["kvasir_pool"])
        c["name"] = name
        c["load_assignment"] = {"cluster_name": name, "endpoints": endpoints(addrs)}
        clusters.append(c)
    prov = by_name["provider_example"]
    prov["name"] = prov["load_assignment"]["cluster_name"] = cfg["providers"][0]["cluster"]
    idx = by_name["kvasir_indexer"]
    idx["name"] = idx["load_assignment"]["cluster_name"] = cfg["pools"][0]["indexerCluster"]
    return yaml.safe_dump(b, sort_keys=False), port, admin


def test_the_compiled_example_config_loads_in_envoy(artifacts, tmp_path):
    text, _, _ = bootstrap(tmp_path, ["127.0.0.1:18001"], ["127.0.0.1:18002"], "127.0.0.1:18050", "127.0.0.1:18100")
    p = tmp_path / "envoy.yaml"
    p.write_text(text)
    r = subprocess.run([str(ENVOY_BIN), "--mode", "validate", "-c", str(p), "--disable-hot-restart", "-l", "info"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # on_configure ran and accepted the document.
    assert "kvasir: configured sha256:" in out, out[-3000:]


class FakeLoad:
    """Serves an engine's real /metrics with the queue and KV usage replaced:
    the numbers a busy or idle vLLM reports, read by the real indexer."""

    def __init__(self, sims: dict[str, Any]):
        self.sims = sims
        self.waiting = {k: 0.0 for k in sims}
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                name = self.path.strip("/").split("/")[0]
                _, _, b = request("GET", outer.sims[name].port, "/metrics", timeout=2)
                lines = []
                for line in b.decode().splitlines():
                    if line.startswith("vllm:num_requests_waiting"):
                        line = line.rsplit(" ", 1)[0] + f" {outer.waiting[name]}"
                    lines.append(line)
                data = ("\n".join(lines) + "\n").encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def post(envoy: Envoy, key: str | None, content: str, model: str = MAIN_MODEL,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    h = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    return request("POST", envoy.port, "/v1/chat/completions", json.dumps(body), h)


def served(sim) -> float:
    return sim.metric("vllm:request_success_total")


HARD = "Explain this code:\n```python\nprint('" + "x" * 40 + "')\n```\n"


def test_the_four_example_policies_do_what_they_say(artifacts, logdir, tmp_path):
    if not INDEXER_BIN.exists():
        pytest.fail(f"{INDEXER_BIN} is missing: run `make build`")
    with Processes() as procs:
        main = procs.add(start_sim(logdir, "gw-main", model=MAIN_MODEL))
        small = procs.add(start_sim(logdir, "gw-small", model=SMALL_MODEL))
        provider = procs.add(start_sim(logdir, "gw-provider", model=PROVIDER_MODEL))
        for s in (main, small, provider):
            wait_sim(s)
        load = procs.add(FakeLoad({"main": main, "small": small}))
        grpc, http = free_port(), free_port()
        argv = [str(INDEXER_BIN), "--grpc-addr", f"127.0.0.1:{grpc}", "--http-addr", f"127.0.0.1:{http}",
                "--tokenizer", str(TOKENIZER), "--model", MAIN_MODEL, "--scrape-interval-ms", "100",
                "--grpc-token-file", str(secrets_for(tmp_path).token_file)]
        for name, s in (("main", main), ("small", small)):
            argv += ["--endpoint", f"pool={name},address={s.address},events=tcp://127.0.0.1:{s.events},"
                                   f"replay=tcp://127.0.0.1:{s.replay},metrics={load.url(name)}"]
        indexer = procs.add(Proc("gw-indexer", argv, logdir))
        wait_until("indexer /readyz", lambda: indexer.alive() and request("GET", http, "/readyz", timeout=2)[0] == 200)
        text, port, admin = bootstrap(tmp_path, [main.address], [small.address], f"127.0.0.1:{grpc}", provider.address)
        cfg = tmp_path / "envoy.yaml"
        cfg.write_text(text)
        proc = procs.add(Proc("gw-envoy", [str(ENVOY_BIN), "-c", str(cfg), "--concurrency", "1", "--disable-hot-restart",
                                           "-l", "info"], logdir))
        envoy = Envoy(proc, port, admin, cfg)
        wait_until("envoy /ready", lambda: proc.alive() and request("GET", admin, "/ready", timeout=2)[0] == 200)
        cluster = {p["name"]: p["cluster"] for p in eep_wasm()["config"]["pools"]}
        wait_until("pools and indexer healthy", lambda: envoy.healthy(cluster["main"], [main.address])
                   and envoy.healthy(cluster["small"], [small.address])
                   and envoy.healthy("kvasir-indexer", [f"127.0.0.1:{grpc}"]))

        # 1. Cheaper model for easy prompts: a short prompt for the 8B model
        #    is answered by the 1B model on the small pool.
        s0, m0 = served(small), served(main)
        status, h, b = post(envoy, ACME, "What is the capital of France?")
        assert status == 200, b
        assert json.loads(b)["model"] == SMALL_MODEL
        assert served(small) == s0 + 1 and served(main) == m0
        # ...a prompt with code is not easy: the 8B model on main.
        status, _, b = post(envoy, ACME, HARD + uuid.uuid4().hex)
        assert status == 200 and json.loads(b)["model"] == MAIN_MODEL, b

        # The example tenants are enforced: no key, or an unknown one, is 401.
        assert post(envoy, None, "hi")[0] == 401
        assert post(envoy, "sk-not-a-tenant", "hi")[0] == 401
        # A client cannot pick the provider by naming its cluster (the header
        # the HTTPRoute's rules match under Envoy Gateway).
        p0 = served(provider)
        status, _, b = post(envoy, ACME, HARD + uuid.uuid4().hex,
                            headers={"x-kvasir-cluster": eep_wasm()["config"]["providers"][0]["cluster"]})
        assert status == 200 and json.loads(b)["model"] == MAIN_MODEL, b
        assert served(provider) == p0

        # 2. Batch work only when GPUs are idle: main idle (saturation 0,
        #    known to the filter from the indexer) -> served at low urgency.
        def batch_served():
            st, _, body = post(envoy, BATCH, HARD + uuid.uuid4().hex)
            return st == 200 and json.loads(body)["model"] == MAIN_MODEL
        wait_until("batch served while main is idle", batch_served, timeout=20, interval=0.3)

        # Main becomes busy: 10 requests waiting on its only engine
        # (saturation 1 at the indexer's default `waiting: 5`).
        load.waiting["main"] = 10.0

        # 3. Burst to a provider when the pool is saturated.
        p0 = served(provider)

        def burst():
            st, _, body = post(envoy, ACME, HARD + uuid.uuid4().hex)
            return st == 200 and json.loads(body)["model"] == PROVIDER_MODEL
        wait_until("requests burst to the provider", burst, timeout=20, interval=0.3)
        assert served(provider) > p0
        # ...and batch work is told to come back later.
        status, h, b = post(envoy, BATCH, HARD + uuid.uuid4().hex)
        assert status == 429, b
        assert h["retry-after"] == "60"
        assert "GPUs are idle" in json.loads(b)["error"]["message"]

        # 4. Prompts with personal data stay inside, even while bursting.
        p1, m1 = served(provider), served(main)
        status, _, b = post(envoy, ACME, HARD + "Reply to bob@example.com about it. " + uuid.uuid4().hex)
        assert status == 200, b
        assert json.loads(b)["model"] == MAIN_MODEL
        assert served(provider) == p1 and served(main) == m1 + 1
        # (The same request without the address does go out.)
        assert burst()

        # Idle again: batch work runs again.
        load.waiting["main"] = 0.0
        wait_until("batch served again once main is idle", batch_served, timeout=20, interval=0.3)
        assert not [l for l in proc.log().splitlines() if "panicked" in l], proc.log()[-2000:]
