"""Writes an Envoy bootstrap from envoy/envoy.yaml with other ports,
endpoints, wasm path and plugin configuration (stdlib only).

The template is the shipped, runnable envoy/envoy.yaml: every value this
module can change is marked there with a `# @name` comment, so the file a
test, the benchmark or the demo runs differs from the shipped one only in
those values.

As a module: `render(template_text, **options) -> str` and `sds_secret()`.
As a command, through the thin wrapper envoy/render.py:

    python3 envoy/render.py --listen-port 18000 --admin-port 18001 \
        --pool-endpoint 127.0.0.1:8001 --pool-endpoint 127.0.0.1:8002 \
        --indexer 127.0.0.1:50051 --provider 127.0.0.1:8100 \
        --wasm target/wasm32-wasip1/wasm-release/kvasir_filter.wasm \
        --plugin-config plugin.json > /tmp/envoy.yaml
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .paths import REPO

TEMPLATE = REPO / "envoy" / "envoy.yaml"


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not host:port: {addr!r}")
    return host.strip("[]"), int(port)


def _sub_marker(text: str, marker: str, pattern: str, repl: str) -> str:
    """Replaces `pattern` on the line carrying `# @marker`."""
    rx = re.compile(rf"^(?P<line>.*{pattern}.*# @{re.escape(marker)})$", re.M)
    out, n = rx.subn(lambda m: re.sub(pattern, repl, m.group("line"), count=1), text)
    if n != 1:
        raise ValueError(f"marker @{marker} not found exactly once in the template")
    return out


# Plain load balancers a baseline may use instead of override-host: name of
# the extension and of its config message.
POOL_LB = {
    "round_robin": ("round_robin", "RoundRobin"),
    "least_request": ("least_request", "LeastRequest"),
}


def _endpoint(host: str, port: int) -> str:
    return f"{{ address: {{ socket_address: {{ address: {host}, port_value: {port} }} }} }}"


def sds_secret(name: str, value_file: str) -> str:
    """A file-based SDS resource: the generic secret `name` read from
    `value_file` (what envoy/secrets/*.sds.yaml hold)."""
    return (
        "resources:\n"
        '- "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret\n'
        f"  name: {name}\n"
        "  generic_secret:\n"
        f"    secret: {{ filename: {json.dumps(value_file)} }}\n"
    )


def _edit_block(text: str, marker: str, edit) -> str:
    """Replaces the lines between `# @marker-begin` and `# @marker-end`
    with `edit(lines)` (the markers stay)."""
    rx = re.compile(rf"^(?P<begin> *# @{marker}-begin\n)(?P<body>.*?)(?P<end>^ *# @{marker}-end$)", re.M | re.S)
    m = rx.search(text)
    if not m:
        raise ValueError(f"@{marker} markers not found")
    return text[: m.start("body")] + edit(m.group("body")) + text[m.end("body") :]


def _route_to_pool(body: str) -> str:
    """The inference route without the filter's cluster header."""
    out = []
    skip_next = False
    for line in body.splitlines(keepends=True):
        s = line.strip()
        if skip_next:
            skip_next = False
            continue
        if s == "- name: x-kvasir-cluster":
            skip_next = True  # its `present_match: true`
            continue
        if s.startswith("request_headers_to_remove:") or s.startswith("# Runs after the cluster was chosen"):
            continue
        out.append(line.replace("cluster_header: x-kvasir-cluster", "cluster: kvasir_pool"))
    return "".join(out)


def _indexer_endpoints(t: str, indexers: list[str]) -> str:
    """The `@indexer-endpoint` line repeated once per replica."""
    rx = re.compile(r"^(?P<line>.*# @indexer-endpoint)$", re.M)
    m = rx.search(t)
    if not m or len(rx.findall(t)) != 1:
        raise ValueError("marker @indexer-endpoint not found exactly once in the template")
    pattern = r"socket_address: { address: [^,]+, port_value: \d+"
    lines = []
    for a in indexers:
        h, p = _split(a)
        lines.append(re.sub(pattern, f"socket_address: {{ address: {h}, port_value: {p}", m.group("line"), count=1))
    return t[: m.start()] + "\n".join(lines) + t[m.end() :]


def render(
    template: str,
    *,
    listen_port: int | None = None,
    admin_port: int | None = None,
    pool_endpoints: list[str] | None = None,
    indexer: str | None = None,
    provider: str | None = None,
    wasm: str | None = None,
    plugin_config: str | None = None,
    health_interval_s: float | None = None,
    pre_filters: str | None = None,
    without_filter: bool = False,
    pool_lb: str | None = None,
    provider_sds: str | None = None,
    indexer_sds: str | None = None,
    request_timeout_s: float | None = None,
    indexers: list[str] | None = None,
) -> str:
    """The bootstrap text with the given values substituted.

    `pre_filters`: YAML of HTTP filters (a list's items, starting with `- name:`)
    put before the Kvasir filter, e.g. `jwt_authn`. `without_filter`: drop the
    Kvasir filter and its header_to_metadata (the same route without the
    filter, as a baseline for benchmarks). `pool_lb`: `round_robin` or
    `least_request` replaces the pool cluster's override-host policy with
    Envoy's plain load balancer (a Kubernetes Service's behaviour, for
    baselines; use it with `without_filter`), and the routes then report the
    upstream in `x-gateway-destination-endpoint-served` as the filter does.
    `provider_sds` / `indexer_sds`: SDS files (see `sds_secret`) holding the
    provider's credential and the indexer token. `request_timeout_s`: the
    whole-request receive timeout (tests of slow clients shorten it).
    `indexers`: several indexer replicas as the indexer cluster's endpoints
    instead of `indexer` (the cluster's own load balancer spreads the
    filter's calls and `Session` streams over them).
    """
    t = template
    if listen_port is not None:
        t = _sub_marker(t, "listen-port", r"port_value: \d+", f"port_value: {listen_port}")
    if admin_port is not None:
        t = _sub_marker(t, "admin-port", r"port_value: \d+", f"port_value: {admin_port}")
    if indexer is not None:
        h, p = _split(indexer)
        t = _sub_marker(
            t, "indexer-endpoint", r"socket_address: { address: [^,]+, port_value: \d+", f"socket_address: {{ address: {h}, port_value: {p}"
        )
    if indexers:
        t = _indexer_endpoints(t, indexers)
    if provider is not None:
        h, p = _split(provider)
        t = _sub_marker(
            t, "provider-endpoint", r"socket_address: { address: [^,]+, port_value: \d+", f"socket_address: {{ address: {h}, port_value: {p}"
        )
    if wasm is not None:
        t = _sub_marker(t, "wasm-path", r"filename: \S+", f"filename: {wasm}")
    if provider_sds is not None:
        t = _sub_marker(t, "provider-sds", r"path: [^ }]+", f"path: {provider_sds}")
    if indexer_sds is not None:
        t = _sub_marker(t, "indexer-sds", r"path: [^ }]+", f"path: {indexer_sds}")
    if request_timeout_s is not None:
        t = _sub_marker(t, "request-timeout", r"request_timeout: [\d.]+s", f"request_timeout: {request_timeout_s}s")
    if health_interval_s is not None:
        for m in ("health-interval", "health-no-traffic-interval", "indexer-health-interval", "indexer-health-no-traffic-interval"):
            t = _sub_marker(t, m, r"interval: [\d.]+s", f"interval: {health_interval_s}s")
    if pool_endpoints is not None:
        rx = re.compile(r"^(?P<indent> *)# @pool-endpoints-begin\n.*?^ *# @pool-endpoints-end$", re.M | re.S)
        m = rx.search(t)
        if not m:
            raise ValueError("pool endpoint markers not found")
        ind = m.group("indent")
        lines = [f"{ind}# @pool-endpoints-begin"]
        lines += [f"{ind}- endpoint: {_endpoint(*_split(e))}" for e in pool_endpoints]
        lines.append(f"{ind}# @pool-endpoints-end")
        t = t[: m.start()] + "\n".join(lines) + t[m.end() :]
    if plugin_config is not None:
        json.loads(plugin_config)  # fail here, not in Envoy, on bad JSON
        rx = re.compile(r"^(?P<indent> *)# @plugin-config-begin\n.*?^ *# @plugin-config-end$", re.M | re.S)
        m = rx.search(t)
        if not m:
            raise ValueError("plugin config markers not found")
        ind = m.group("indent")
        compact = json.dumps(json.loads(plugin_config), separators=(",", ":"))
        quoted = "'" + compact.replace("'", "''") + "'"
        block = f"{ind}# @plugin-config-begin\n{ind}value: {quoted}\n{ind}# @plugin-config-end"
        t = t[: m.start()] + block + t[m.end() :]
    if pre_filters is not None:
        rx = re.compile(r"^(?P<indent> *)# @pre-filters.*$", re.M)
        m = rx.search(t)
        if not m:
            raise ValueError("pre-filters marker not found")
        ind = m.group("indent")
        block = "\n".join(ind + line if line.strip() else line for line in pre_filters.strip("\n").splitlines())
        t = t[: m.end()] + "\n" + block + t[m.end() :]
    if pool_lb is not None:
        if pool_lb not in POOL_LB:
            raise ValueError(f"pool_lb must be one of {sorted(POOL_LB)}, got {pool_lb!r}")
        rx = re.compile(r"^(?P<indent> *)# @pool-lb-begin\n.*?^ *# @pool-lb-end$", re.M | re.S)
        m = rx.search(t)
        if not m:
            raise ValueError("pool-lb markers not found")
        ind = m.group("indent")
        name, typ = POOL_LB[pool_lb]
        block = "\n".join(
            [
                f"{ind}# @pool-lb-begin",
                f"{ind}load_balancing_policy:",
                f"{ind}  policies:",
                f"{ind}  - typed_extension_config:",
                f"{ind}      name: envoy.load_balancing_policies.{name}",
                f"{ind}      typed_config:",
                f'{ind}        "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.{name}.v3.{typ}',
                f"{ind}# @pool-lb-end",
            ]
        )
        t = t[: m.start()] + block + t[m.end() :]
        served = (
            "                response_headers_to_add:\n"
            '                - header: { key: x-gateway-destination-endpoint-served, value: "%UPSTREAM_HOST%" }\n'
        )
        t = _edit_block(t, "inference-route", lambda body: body + served)
    if without_filter:
        rx = re.compile(r"^ *# @kvasir-filter-begin\n.*?^ *# @kvasir-filter-end\n", re.M | re.S)
        t, n = rx.subn("", t)
        if n != 1:
            raise ValueError("kvasir filter markers not found")
        # No filter names the cluster: the inference paths go to the pool.
        t = _edit_block(t, "inference-route", _route_to_pool)
    return t


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--template", default=str(TEMPLATE))
    ap.add_argument("--listen-port", type=int)
    ap.add_argument("--admin-port", type=int)
    ap.add_argument("--pool-endpoint", action="append", dest="pool_endpoints")
    ap.add_argument("--indexer")
    ap.add_argument("--indexer-replica", action="append", dest="indexers", help="an indexer replica, repeatable (instead of --indexer)")
    ap.add_argument("--provider")
    ap.add_argument("--wasm")
    ap.add_argument("--plugin-config", help="file with the plugin configuration JSON")
    ap.add_argument("--health-interval-s", type=float)
    ap.add_argument("--pre-filters", help="file with HTTP filters (YAML list items) to put before the Kvasir filter")
    ap.add_argument("--without-filter", action="store_true", help="the same bootstrap without the Kvasir filter (baseline)")
    ap.add_argument("--pool-lb", choices=sorted(POOL_LB), help="plain load balancer for the pool instead of override-host (baseline)")
    ap.add_argument("--provider-sds", help="SDS file with the provider's credential")
    ap.add_argument("--indexer-sds", help="SDS file with the indexer token")
    a = ap.parse_args(argv)
    cfg = Path(a.plugin_config).read_text() if a.plugin_config else None
    sys.stdout.write(
        render(
            Path(a.template).read_text(),
            listen_port=a.listen_port,
            admin_port=a.admin_port,
            pool_endpoints=a.pool_endpoints,
            indexer=a.indexer,
            provider=a.provider,
            wasm=a.wasm,
            plugin_config=cfg,
            health_interval_s=a.health_interval_s,
            pre_filters=Path(a.pre_filters).read_text() if a.pre_filters else None,
            without_filter=a.without_filter,
            pool_lb=a.pool_lb,
            provider_sds=a.provider_sds,
            indexer_sds=a.indexer_sds,
            indexers=a.indexers,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
