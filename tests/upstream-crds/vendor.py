"""Writes the upstream CRDs the controller's tests install on a real
kube-apiserver (tests/e2e/test_controller.py) from ../shared/upstream-crds/,
with every schema `description` left out (they are most of the bytes and
the API server validates nothing with them; an object field that happens
to be named `description` is kept).

    .tools/venv/bin/python tests/upstream-crds/vendor.py

tests/e2e/test_controller.py checks that the files here are what this
prints from ../shared when that folder is present (so they cannot drift
from the schemas the manifest tests validate against).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1].parent / "shared" / "upstream-crds"

# (output file, source file in ../shared/upstream-crds, CRD names)
FILES = [
    ("gateway.networking.k8s.io.yaml", "gateway-api-crds.yaml",
     ["gateways.gateway.networking.k8s.io", "httproutes.gateway.networking.k8s.io"]),
    ("gateway.envoyproxy.io_envoyextensionpolicies.yaml", "gateway.envoyproxy.io_envoyextensionpolicies.yaml",
     ["envoyextensionpolicies.gateway.envoyproxy.io"]),
    ("inference.networking.k8s.io_inferencepools.yaml", "inference.networking.k8s.io_inferencepools.yaml",
     ["inferencepools.inference.networking.k8s.io"]),
]

HEADER = """# {names}
# From ../shared/upstream-crds/{source} (see README.md here for the upstream
# project, version and licence), schema descriptions removed by vendor.py.
# Licensed under the Apache License, Version 2.0.
"""


def strip(schema):
    """A JSON schema without `description`s; `properties` keys are field
    names, kept whatever they are called."""
    if isinstance(schema, list):
        return [strip(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "description":
            continue
        if k == "properties" and isinstance(v, dict):
            out[k] = {name: strip(sub) for name, sub in v.items()}
        else:
            out[k] = strip(v)
    return out


def render(shared: Path = SHARED) -> dict[str, str]:
    out = {}
    for name, source, wanted in FILES:
        docs = [d for d in yaml.safe_load_all((shared / source).read_text()) if d]
        picked = []
        for d in docs:
            if d.get("kind") == "CustomResourceDefinition" and d["metadata"]["name"] in wanted:
                for v in d["spec"]["versions"]:
                    v["schema"]["openAPIV3Schema"] = strip(v["schema"]["openAPIV3Schema"])
                picked.append(d)
        missing = set(wanted) - {d["metadata"]["name"] for d in picked}
        if missing:
            raise SystemExit(f"{source}: no {sorted(missing)}")
        text = HEADER.format(names=", ".join(wanted), source=source)
        text += "".join("---\n" + yaml.safe_dump(d, sort_keys=True, width=120) for d in picked)
        out[name] = text
    return out


def main() -> int:
    if not SHARED.is_dir():
        print(f"{SHARED} is not here", file=sys.stderr)
        return 1
    for name, text in render().items():
        (HERE / name).write_text(text)
        print(f"wrote {name} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
