"""Every bootstrap we ship (and what render.py makes of it) passes
`envoy --mode validate`, which in 1.40 also loads the wasm module and runs
its on_configure; a bad plugin configuration is refused with a reason."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvasir_harness import ENVOY_BIN, POLICY, REPO, SETTINGS, WASM, compile_plugin, free_port, secrets_for
from kvasir_harness import bootstrap as render

SHIPPED = sorted((REPO / "envoy").glob("*.yaml"))


def render_in(tmp: Path, **options) -> str:
    """The template rendered to run from `tmp`: the shipped secret paths are
    relative to the repository root, so fresh ones are made in `tmp`."""
    s = secrets_for(tmp)
    return render.render(render.TEMPLATE.read_text(), provider_sds=str(s.provider_sds),
                         indexer_sds=str(s.indexer_sds), **options)


def validate(path: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ENVOY_BIN), "--mode", "validate", "-c", str(path), "--disable-hot-restart", "-l", "info"],
        cwd=cwd, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_bootstrap_validates(artifacts, path):
    # Relative wasm path: the shipped file is run from the repository root.
    r = validate(path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kvasir: configured sha256:" in r.stdout + r.stderr


def test_shipped_plugin_config_is_envoy_policy_json_compiled(artifacts):
    """envoy/envoy.yaml carries envoy/policy.json compiled: they cannot drift."""
    text = (REPO / "envoy" / "envoy.yaml").read_text()
    line = next(l for l in text.splitlines() if l.strip().startswith("value: '{"))
    shipped = json.loads(line.split("value: ", 1)[1].strip()[1:-1].replace("''", "'"))
    policy = json.loads((REPO / "envoy" / "policy.json").read_text())
    assert shipped == json.loads(compile_plugin(policy, shipped["filter"]))


def test_rendered_bootstrap_validates(artifacts, tmp_path):
    text = render_in(
        tmp_path,
        listen_port=free_port(), admin_port=free_port(),
        pool_endpoints=["127.0.0.1:18001", "127.0.0.1:18002", "[::1]:18003", "127.0.0.1:18004"],
        indexer="127.0.0.1:18050", provider="127.0.0.1:18100", wasm=str(WASM),
        plugin_config=compile_plugin(POLICY, SETTINGS), health_interval_s=0.5,
    )
    p = tmp_path / "envoy.yaml"
    p.write_text(text)
    r = validate(p, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("lb", sorted(render.POOL_LB))
def test_baseline_bootstraps_validate(artifacts, tmp_path, lb):
    """The routing benchmark's baselines: no filter, a plain load balancer,
    the upstream reported in the served-endpoint header."""
    text = render_in(tmp_path, pool_endpoints=["127.0.0.1:18001", "127.0.0.1:18002"], without_filter=True, pool_lb=lb)
    assert "name: envoy.load_balancing_policies.override_host" not in text
    assert f"name: envoy.load_balancing_policies.{lb}" in text
    assert "x-gateway-destination-endpoint-served" in text and "%UPSTREAM_HOST%" in text
    # No filter names a cluster: the inference route goes to the pool itself.
    route = text.split("# @inference-route-begin")[1].split("# @inference-route-end")[0]
    assert "x-kvasir-cluster" not in route and "cluster: kvasir_pool" in route, route
    p = tmp_path / "envoy.yaml"
    p.write_text(text)
    r = validate(p, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    with pytest.raises(ValueError, match="pool_lb must be one of"):
        render.render(render.TEMPLATE.read_text(), pool_lb="random")


@pytest.mark.parametrize(
    "plugin, reason",
    [
        ('{"version": "kvasir.filter/v9"}', "unsupported filter config version"),
        ('{"policy": {"version": "kvasir.filter/v1"}, "filter": {}}', "invalid filter config"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_bad_plugin_config_is_refused_with_a_reason(artifacts, tmp_path, plugin, reason):
    text = render_in(tmp_path, wasm=str(WASM), plugin_config=plugin)
    p = tmp_path / "envoy.yaml"
    p.write_text(text)
    r = validate(p, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "kvasir: refusing the plugin configuration" in out and reason in out, out
