"""Envoy calling the cache-indexer's endpoint picker over ext_proc, as a
gateway that handles InferencePool itself configures it, in the two pool
cluster shapes such gateways generate:

- `original_dst`: an ORIGINAL_DST cluster dialling the address in
  `x-gateway-destination-endpoint` (Envoy AI Gateway's shape: one address,
  so the picker answers with one);
- `override_host`: a static pool whose `override_host` load balancer reads
  the header and the `envoy.lb` metadata (Envoy Gateway's
  `endpointOverride` shape: an ordered list, later entries for retries,
  an address that is not a member never dialled).

The bootstrap is JSON (Envoy reads it by the file's extension), built here
with the standard library only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .envoy import Envoy
from .paths import ENVOY_BIN
from .procs import Proc, free_port

DESTINATION = "x-gateway-destination-endpoint"


def _address(hostport: str) -> dict[str, Any]:
    host, port = hostport.rsplit(":", 1)
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _ext_proc(request_mode: str, response_mode: str, fail_open: bool) -> dict[str, Any]:
    trailers = "SEND" if "FULL_DUPLEX" in (request_mode + response_mode) else "SKIP"
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "30s"},
            "failure_mode_allow": fail_open,
            # A pick may wait in the pool's queue.
            "message_timeout": "10s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": request_mode,
                "response_body_mode": response_mode,
                "request_trailer_mode": trailers,
                "response_trailer_mode": trailers,
            },
            # The endpoint that served, for the picker's reports.
            "response_attributes": ["upstream.address"],
            "metadata_options": {
                "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
            },
        },
    }


def _subset_hint(addresses: list[str]) -> dict[str, Any]:
    """A filter that sets the gateway's subset hint before ext_proc."""
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{
                "metadata_namespace": "envoy.lb.subset_hint",
                "value": {"x-gateway-destination-endpoint-subset": addresses},
            }],
        },
    }


def _pool_cluster(shape: str, endpoints: list[str]) -> dict[str, Any]:
    if shape == "original_dst":
        return {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    assert shape == "override_host", shape
    return {
        "name": "pool",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [
                    {"header": DESTINATION},
                    {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}},
                ],
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.least_request",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
                    },
                }}]},
            },
        }}]},
        "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(e)}} for e in endpoints
        ]}]},
    }


def bootstrap(listen_port: int, admin_port: int, picker: str, endpoints: list[str], shape: str,
              request_mode: str = "FULL_DUPLEX_STREAMED", response_mode: str = "FULL_DUPLEX_STREAMED",
              fail_open: bool = False, subset: list[str] | None = None) -> dict[str, Any]:
    """The bootstrap of an Envoy that asks the picker at `picker` where each
    request to the pool goes."""
    filters = ([_subset_hint(subset)] if subset is not None else []) + [
        _ext_proc(request_mode, response_mode, fail_open),
        {"name": "envoy.filters.http.router",
         "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
    ]
    route = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": "pool",
            "timeout": "0s",
            # Before the first byte, once, to the list's next endpoint.
            "retry_policy": {"retry_on": "5xx,connect-failure,refused-stream,reset", "num_retries": 1},
        },
    }
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "picker_gw",
            "route_config": {"name": "gw", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
            "http_filters": filters,
        },
    }
    return {
        "admin": {"address": _address(f"127.0.0.1:{admin_port}")},
        "static_resources": {
            "listeners": [{
                "name": "gw",
                "address": _address(f"127.0.0.1:{listen_port}"),
                "per_connection_buffer_limit_bytes": 4194304,
                "filter_chains": [{"filters": [hcm]}],
            }],
            "clusters": [
                _pool_cluster(shape, endpoints),
                {
                    "name": "picker",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        },
                    },
                    "load_assignment": {"cluster_name": "picker", "endpoints": [{"lb_endpoints": [
                        {"endpoint": {"address": _address(picker)}},
                    ]}]},
                },
            ],
        },
    }


def start_picker_envoy(logdir: Path, picker: str, endpoints: list[str], shape: str, name: str = "gw-envoy",
                       **options: Any) -> Envoy:
    """An Envoy on free ports whose pool is picked by the picker at
    `picker` (`options`: `bootstrap`'s modes, `fail_open`, `subset`)."""
    port, admin = free_port(), free_port()
    cfg = logdir / f"{name}.json"
    cfg.write_text(json.dumps(bootstrap(port, admin, picker, endpoints, shape, **options), indent=1))
    argv = [str(ENVOY_BIN), "-c", str(cfg), "--concurrency", "2", "--disable-hot-restart", "-l", "warning"]
    return Envoy(Proc(name, argv, logdir), port, admin, cfg)
