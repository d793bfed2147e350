#!/usr/bin/env python3
"""Writes kvasir.json, the Grafana dashboard, from the panel list below
(one place for the queries, their units and their layout; the JSON is
what Grafana imports). tests/e2e/test_dashboards.py checks that the JSON
is this script's output, and runs every query against a real Prometheus
scraping the local stack.

    python3 deploy/grafana/dashboard.py          # rewrite kvasir.json
    python3 deploy/grafana/dashboard.py --check  # exit 1 if kvasir.json differs

Conventions the test relies on: every target has a `legendFormat`
naming only labels its query keeps, and a query aggregates with one
`by (...)` label set (histogram buckets add `le`, which
histogram_quantile consumes). Variables: `$datasource`, `$tenant`,
`$pool` (multi-value, "All" is `.*`), and Grafana's `$__rate_interval`.
Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().with_name("kvasir.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
T = 'tenant=~"$tenant"'
P = 'pool=~"$pool"'
CACHED = 'cache="cached"'
PREFIX = 'decision="prefix"'
REPORTED = 'kind="reported"'
PREDICTED = 'kind="predicted"'
R = "$__rate_interval"


def rate(metric: str, by: str, sel: str = "", fn: str = "rate") -> str:
    return f"sum by ({by}) ({fn}({metric}{{{sel}}}[{R}]))"


def quantile(q: float, metric: str, by: str, sel: str = "", scale: str = "") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{sel}}}[{R}]))){scale}"


def pct(q: float) -> str:
    return f"p{round(q * 100)}"


def latency(metric: str, by: str = "tenant", sel: str = T) -> list[tuple[str, str]]:
    return [(quantile(q, metric, by, sel), f"{{{{{by}}}}} {pct(q)}") for q in (0.5, 0.99)]


# (title, unit, [(expr, legend)], description); rows in order, 3 panels a line.
ROWS: list[tuple[str, str, list[tuple[str, str, list[tuple[str, str]], str]]]] = [
    ("Tenants", "the filter's per-tenant stats (Envoy /stats/prometheus), summed over Envoys and models", [
        ("Requests by decision", "reqps",
         [(rate("kvasir_tenant_model_requests", "tenant, decision", T), "{{tenant}} {{decision}}")],
         "What the filter did with each request: route, provider, reject, shed, invalid, unauthorized, "
         "too_large, passthrough."),
        ("Responses by class", "reqps",
         [(rate("kvasir_tenant_model_responses", "tenant, class", T), "{{tenant}} {{class}}")],
         "Forwarded requests by outcome: 2xx, 4xx, 5xx, cut (reset after bytes flowed), cancelled "
         "(the client went away)."),
        ("Prompt tokens: cached and uncached", "suffix: tok/s",
         [(rate("kvasir_tenant_model_prompt_tokens", "tenant, cache", T), "{{tenant}} {{cache}}")],
         "Prompt tokens the engines found in their prefix cache (cached) and had to prefill (uncached), "
         "from each response's usage."),
        ("Prompt tokens served from cache", "percentunit",
         [(f'{rate("kvasir_tenant_model_prompt_tokens", "tenant", f"{T},{CACHED}")} / '
           f'{rate("kvasir_tenant_model_prompt_tokens", "tenant", T)}', "{{tenant}}")],
         "cached / (cached + uncached) prompt tokens: the share of prefill the caches saved."),
        ("Completion tokens", "suffix: tok/s",
         [(rate("kvasir_tenant_model_completion_tokens", "tenant", T), "{{tenant}}")],
         "Generated tokens, from each response's usage."),
        ("Time to first token", "ms", latency("kvasir_tenant_model_ttft_ms"),
         "Request start at Envoy to the first response byte, 2xx only; includes reading the body and the pick."),
        ("Inter-token latency", "ms", latency("kvasir_tenant_model_itl_ms"),
         "Gap between streamed chunks carrying tokens, per token."),
        ("End-to-end latency", "ms", latency("kvasir_tenant_model_e2e_ms"),
         "Request start to the last response byte, 2xx only."),
        ("Queue wait (flow control)", "ms",
         [(f'{rate("kvasir_tenant_model_queue_wait_ms_sum", "tenant", T)} / '
           f'{rate("kvasir_tenant_model_queue_wait_ms_count", "tenant", T)}', "{{tenant}} mean"),
          (quantile(0.99, "kvasir_tenant_model_queue_wait_ms", "tenant", T), "{{tenant}} p99")],
         "How long picks waited in the pool's fair queue while every engine was saturated (picks that "
         "waited only)."),
        ("Rejected", "reqps",
         [(rate("kvasir_tenant_model_requests", "tenant, decision",
                T + ',decision=~"reject|invalid|unauthorized|too_large"'), "{{tenant}} {{decision}}")],
         "Refused by a reject policy, or invalid (400/415), unauthorized (401/403), too large (413). "
         "Tenant `unknown`: refused before a tenant was known."),
        ("Shed", "reqps",
         [(rate("kvasir_tenant_model_requests", "tenant", T + ',decision="shed"'), "{{tenant}} by policy"),
          (rate("kvasir_tenant_model_shed", "tenant, cause", T), "{{tenant}} flow control: {{cause}}")],
         "429s because the pool was busy: a shed policy (poolState), or flow control (pool_full, "
         "tenant_full, no_wait, max_wait)."),
        ("Rate limited (budgets)", "reqps",
         [(rate("kvasir_tenant_model_rate_limited", "tenant, limit", T), "{{tenant}} {{limit}}")],
         "429s from the tenant's budget, by the limit that refused: requests, tokens, prompt_tokens, "
         "completion_tokens, concurrent, too_large."),
        ("Fail-opens", "reqps",
         [(rate("kvasir_tenant_model_failopen", "tenant", T), "{{tenant}}")],
         "Routed requests that went to Envoy's own balancing because the pick failed (indexer down, "
         "slow or unreachable)."),
        ("Budget: tokens charged and refused", "suffix: tok/s",
         [(rate("kvasir_indexer_budget_tokens_settled_total", "tenant", T), "{{tenant}} charged"),
          (rate("kvasir_indexer_budget_tokens_limited_total", "tenant", T), "{{tenant}} refused")],
         "From the cache-indexer: tokens of ended requests charged to the budget, and tokens of picks "
         "the budget refused (budgeted tenants only)."),
    ]),
    ("Pools", "load, saturation and cache hits per pool (the cache-indexer's view, and Envoy's)", [
        ("Saturation", "percentunit",
         [(f'max by (pool) (kvasir_indexer_pool_saturation{{{P}}})', "{{pool}} (indexer)"),
          (f'max by (pool) (kvasir_pool_saturation_permille{{{P}}}) / 1000', "{{pool}} (as Envoy last saw it)")],
         "Mean saturation of the pool's healthy engines (1 = every engine saturated, or none healthy); "
         "what poolState policies test."),
        ("Engine load: running and waiting", "short",
         [(f'max by (pool, endpoint) (kvasir_indexer_endpoint_running{{{P}}})', "{{endpoint}} running"),
          (f'max by (pool, endpoint) (kvasir_indexer_endpoint_waiting{{{P}}})', "{{endpoint}} waiting")],
         "vllm:num_requests_running and _waiting at the indexer's last scrape of each engine."),
        ("Engine KV-cache usage", "percentunit",
         [(f'max by (pool, endpoint) (kvasir_indexer_endpoint_kv_usage{{{P}}})', "{{endpoint}}")],
         "vllm:kv_cache_usage_perc at the last scrape."),
        ("Picks by decision", "reqps",
         [(rate("kvasir_indexer_picks_total", "pool, decision", P), "{{pool}} {{decision}}")],
         "prefix: a cached prefix decided; load: no useful prefix; all_saturated, rate_limited, shed, ..."),
        ("Prefix hit rate", "percentunit",
         [(f'{rate("kvasir_indexer_picks_total", "pool", f"{P},{PREFIX}")} / '
           f'{rate("kvasir_indexer_picks_total", "pool", P)}', "{{pool}} picks decided by a prefix"),
          (f'{rate("kvasir_indexer_cached_tokens_total", "pool", f"{P},{REPORTED}")} / '
           f'{rate("kvasir_indexer_cached_tokens_total", "pool", f"{P},{PREDICTED}")}',
           "{{pool}} reported / predicted cached tokens")],
         "The share of picks a cached prefix decided, and how much of the cache the index predicted the "
         "engines really had (1: exact; lower: the index lags the engines' KV events)."),
        ("Prompt tokens served from cache, by model", "percentunit",
         [('sum by (model) (rate(kvasir_tenant_model_prompt_tokens{cache="cached"}[$__rate_interval])) / '
           'sum by (model) (rate(kvasir_tenant_model_prompt_tokens[$__rate_interval]))', "{{model}}")],
         "From the engines' usage, over every tenant (Envoy's stats carry the model, not the pool)."),
        ("In-flight picks per engine", "short",
         [(f'sum by (pool, endpoint) (kvasir_indexer_endpoint_in_flight{{{P}}})', "{{endpoint}}")],
         "Picks sent to the engine and not reported done yet (every indexer replica's own)."),
        ("Flow control: waiting picks", "short",
         [(f'sum by (pool) (kvasir_indexer_flow_queue_length{{{P}}})', "{{pool}} waiting"),
          (rate("kvasir_indexer_flow_shed_total", "pool, cause", P), "{{pool}} shed/s: {{cause}}")],
         "Picks waiting in the pool's fair queue now, and picks shed per second by cause."),
        ("Pick latency p99", "ms",
         [(quantile(0.99, "kvasir_pool_pick_us", "pool", P, " / 1000"), "{{pool}} round trip (Envoy)"),
          (quantile(0.99, "kvasir_indexer_pick_duration_seconds", "pool", P, " * 1000"),
           "{{pool}} inside the indexer")],
         "A Pick's round trip as Envoy saw it, and the indexer's own time (tokenize, match, score)."),
        ("Picks by result (Envoy)", "reqps",
         [(rate("kvasir_pool_pick", "pool, result", P), "{{pool}} {{result}}"),
          (rate("kvasir_pool_failopen", "pool", P), "{{pool}} fail-open")],
         "ok, rate_limited and shed (429), unknown_response (404), or why the pick failed open "
         "(unavailable, timeout, grpc_error, ...)."),
    ]),
    ("Indexer", "the cache-indexer's health, KV-event streams and budget store", [
        ("Indexer replicas up", "short",
         [('sum by (job) (up{job="kvasir-indexer"})', "up"),
          ('count by (job) (up{job="kvasir-indexer"})', "scraped")],
         "Replicas answering scrapes, of those Prometheus scrapes."),
        ("Engines healthy (in picks)", "short",
         [(f'max by (pool, endpoint) (kvasir_indexer_endpoint_healthy{{{P}}})', "{{endpoint}}")],
         "1 while the engine's /metrics scrapes succeed (it takes picks)."),
        ("KV-event streams by state", "short",
         [(f'sum by (pool, state) (kvasir_indexer_sync_state{{{P}}})', "{{pool}} {{state}}")],
         "Engines' event streams per state: in_sync, replaying (catching up after a gap), resyncing, "
         "connecting, disconnected, no_source. Summed over indexer replicas."),
        ("KV-event lag: gaps, replays, resyncs", "short",
         [(rate("kvasir_indexer_event_gaps_total", "pool", P, "increase"), "{{pool}} gaps"),
          (rate("kvasir_indexer_replays_total", "pool", P, "increase"), "{{pool}} replays"),
          (rate("kvasir_indexer_resyncs_total", "pool", P, "increase"), "{{pool}} resyncs")],
         "The indexer exports no event timestamps: lag shows as gaps in the sequence, replays asked to "
         "cover them, and resyncs when a replay cannot (index cleared and rebuilt)."),
        ("KV events applied", "ops",
         [(rate("kvasir_indexer_events_applied_total", "pool, endpoint", P), "{{endpoint}}")],
         "BlockStored, BlockRemoved and AllBlocksCleared events applied to the index, per engine."),
        ("Engine scrape age", "s",
         [(f'max by (pool, endpoint) (kvasir_indexer_scrape_age_seconds{{{P}}})', "{{endpoint}}")],
         "Time since the last successful /metrics scrape of each engine: how stale the load view is."),
        ("Session streams open", "short",
         [('sum by (job) (kvasir_indexer_sessions_open)', "indexer"),
          ('sum by (job) (kvasir_session_opened)', "opened by Envoys (total)")],
         "Envoy's Session streams to the indexers (picks and reports ride them)."),
        ("Budget store (Redis) errors", "ops",
         [('sum by (op, error) (rate(kvasir_indexer_budget_store_errors_total[$__rate_interval])) > 0',
           "{{op}} {{error}}"),
          ('sum by (mode, decision) (rate(kvasir_indexer_budget_store_down_picks_total[$__rate_interval])) > 0',
           "decided without Redis: {{mode}} {{decision}}")],
         "Calls to the budgets' Redis that failed, and budgeted picks decided by onStoreDown meanwhile "
         "(empty while Redis answers, and always with store: memory)."),
    ]),
    ("Controller", "kvasir-controller: reconciles and what it applied", [
        ("Reconciles", "ops",
         [('sum by (result) (rate(kvasir_controller_reconciles_total[$__rate_interval]))', "{{result}}")],
         "Namespace reconciles, ok or error (an API call failed; retried with backoff)."),
        ("Reconcile duration p99", "s",
         [('histogram_quantile(0.99, sum by (le) (rate(kvasir_controller_reconcile_duration_seconds_bucket'
           '[$__rate_interval])))', "p99")],
         "One namespace's reconcile."),
        ("Errors by kind", "ops",
         [('sum by (kind) (rate(kvasir_controller_errors_total[$__rate_interval]))', "{{kind}}")],
         "api (retried), and those that need a person: conflict, gateway, invalid, secret, target."),
        ("Since the last apply", "s",
         [('time() - max by (namespace, target) (kvasir_controller_last_successful_compile_timestamp_seconds)',
           "{{namespace}} {{target}}")],
         "Per target: time since its EnvoyExtensionPolicy was last applied."),
        ("Applied configuration size", "bytes",
         [('max by (namespace, target) (kvasir_controller_config_bytes)', "{{namespace}} {{target}}")],
         "Size of each target's compiled configuration."),
        ("Leader", "short",
         [('max by (instance) (kvasir_controller_leader)', "{{instance}}")],
         "1 on the replica holding the Lease."),
    ]),
]


def variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
            "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}


def dashboard() -> dict:
    panels: list[dict] = []
    y, pid = 0, 1
    for row_title, row_desc, items in ROWS:
        panels.append({"type": "row", "id": pid, "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid += 1
        y += 1
        for i, (title, unit, targets, desc) in enumerate(items):
            panels.append({
                "type": "timeseries", "id": pid, "title": title, "description": desc, "datasource": DS,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10,
                                                                      "spanNulls": False}},
                                "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}},
                "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend, "range": True,
                             "refId": chr(ord("A") + k)} for k, (expr, legend) in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(items) + 2) // 3)
    return {
        "title": "Kvasir",
        "uid": "kvasir-overview",
        "description": "Kvasir: per tenant, per pool, the cache-indexer and the controller "
                       "(deploy/grafana/dashboard.py writes this file; docs/operations.md#dashboards-and-alerts)",
        "tags": ["kvasir", "vllm", "envoy"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            variable("tenant", "tenant", "label_values(kvasir_tenant_model_requests, tenant)"),
            variable("pool", "pool", "label_values(kvasir_indexer_pool_warm, pool)"),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is not what {Path(__file__).name} writes: run python3 {__file__}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
