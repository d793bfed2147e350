"""crds/examples/ as documents for a namespace (settings, tenants and their
key Secrets, pools, the provider, the policies), and the Envoy Gateway
`Gateway` they attach to: what the controller's tests and its fault
scenario apply to a real kube-apiserver."""

from __future__ import annotations

import yaml

from .paths import REPO

EXAMPLES = REPO / "crds" / "examples"


def example_docs(ns: str) -> list[dict]:
    """Every document of crds/examples/ (file order), in namespace `ns`."""
    out = []
    for p in sorted(EXAMPLES.glob("*.yaml")):
        for d in yaml.safe_load_all(p.read_text()):
            if d:
                d["metadata"]["namespace"] = ns
                out.append(d)
    return out


def eg_gateway(name: str, ns: str) -> dict:
    """A Gateway of Envoy Gateway's class `eg` with one HTTP listener."""
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"gatewayClassName": "eg", "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}]}}
