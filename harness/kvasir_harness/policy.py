"""The local stack's policy set (the end-to-end tests', also the filter
benchmark's and the demo's): two tenants with API keys, one pool, an
external provider, and a policy of each action."""

from __future__ import annotations

import hashlib

from .paths import MODEL, PROVIDER_MODEL

# Tenants and keys of the policy set.
KEYS = {"acme": "sk-e2e-acme", "beta": "sk-e2e-beta"}
# What Envoy injects on the provider cluster (after "Bearer ").
PROVIDER_KEY = "sk-e2e-provider"


def sha256(s: str) -> str:
    return "sha256:" + hashlib.sha256(s.encode()).hexdigest()


POLICY = {
    "tenantSource": {"apiKey": {}},
    "tenants": [
        {"name": "acme", "class": "gold", "apiKeyHashes": [sha256(KEYS["acme"])]},
        {"name": "beta", "class": "free", "apiKeyHashes": [sha256(KEYS["beta"])]},
    ],
    "pools": [
        {
            "name": "main",
            "models": [MODEL],
            "cluster": "kvasir_pool",
            "indexerCluster": "kvasir_indexer",
            "indexerTimeoutMs": 200,
        }
    ],
    "providers": [
        {
            "name": "ext",
            "cluster": "provider_example",
            "model": PROVIDER_MODEL,
            "auth": {"header": "authorization", "secretRef": {"name": "ext", "key": "api-key"}},
        }
    ],
    "policies": [
        {"name": "blocked", "match": {"models": ["blocked-model"]}, "action": {"reject": {"status": 403, "message": "blocked by policy"}}},
        {"name": "busy", "match": {"models": ["shed-model"]}, "action": {"shed": {"retryAfterS": 5, "message": "pool saturated"}}},
        {"name": "to-provider", "match": {"models": ["gpt-4o"]}, "action": {"provider": {"provider": "ext"}}},
        {"name": "alias", "match": {"models": ["alias-model"]}, "action": {"route": {"pool": "main", "rewriteModel": MODEL}}},
    ],
    "defaultAction": {"route": {"pool": "main", "includeUsage": True}},
}
SETTINGS = {"exposeServedEndpoint": True, "bodyLimitBytes": 1048575}
