"""Tenants from a JWT verified by Envoy's jwt_authn filter: the claim read
from jwt_authn's `payload_in_metadata` (dynamic metadata) or from the header
`claim_to_headers` writes. A client-sent tenant header never wins."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid

import pytest

from kvasir_harness import MODEL, chat, compile_plugin, start_envoy, wait_envoy
from conftest import Stack

SECRET = b"kvasir-e2e-jwt-secret-0123456789abcdef"
M = MODEL.replace("/", "_")


def b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def token(claims: dict, secret: bytes = SECRET) -> str:
    head = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    body = b64(json.dumps({"iss": "kvasir-e2e", "exp": int(time.time()) + 3600, **claims}).encode())
    sig = b64(hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest())
    return f"{head}.{body}.{sig}"


JWKS = json.dumps({"keys": [{"kty": "oct", "alg": "HS256", "kid": "k1", "k": b64(SECRET)}]})
JWT_AUTHN = f"""
- name: envoy.filters.http.jwt_authn
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
    providers:
      e2e:
        issuer: kvasir-e2e
        local_jwks:
          inline_string: '{JWKS}'
        payload_in_metadata: jwt_payload
        claim_to_headers:
        - header_name: x-jwt-org
          claim_name: org
    rules:
    - match: {{ prefix: / }}
      requires: {{ provider_name: e2e }}
"""


def policy(source: dict) -> dict:
    return {
        "tenantSource": source,
        "tenants": [{"name": "acme", "headerValue": "org-acme"}, {"name": "beta", "headerValue": "org-beta"}],
        "pools": [{"name": "main", "models": [MODEL], "cluster": "kvasir_pool", "indexerCluster": "kvasir_indexer"}],
        "defaultAction": {"route": {"pool": "main"}},
    }


@pytest.fixture(scope="module", params=["metadata", "header"])
def jwt_envoy(request, stack: Stack, logdir):
    mode = request.param
    src = {"jwtClaim": {"claim": "org", "payloadInMetadata": "jwt_payload"}} if mode == "metadata" \
        else {"jwtClaim": {"claim": "org", "header": "x-jwt-org"}}
    plugin = compile_plugin(policy(src), {"exposeServedEndpoint": True})
    pool = [s.address for s in stack.sims]
    e = start_envoy(logdir, plugin, pool, stack.indexer.address, stack.provider.address, name=f"envoy-jwt-{mode}",
                    pre_filters=JWT_AUTHN)
    try:
        wait_envoy(e, pool)
        yield e
    finally:
        e.proc.stop()


def test_tenant_comes_from_the_verified_claim(jwt_envoy):
    e = jwt_envoy
    acme = f"wasmcustom.kvasir.tenant.acme.model.{M}.requests.route"
    beta = f"wasmcustom.kvasir.tenant.beta.model.{M}.requests.route"
    a0, b0 = e.stat(acme), e.stat(beta)
    for _ in range(2):
        status, _, b = e.post("/v1/chat/completions", chat(content=uuid.uuid4().hex), key=token({"org": "org-acme"}),
                              headers={"x-tenant": "beta"})
        assert status == 200, b
    assert e.stat(acme) - a0 == 2
    assert e.stat(beta) - b0 == 0


def test_unknown_claim_is_401_and_no_token_is_jwt_authns_401(jwt_envoy):
    e = jwt_envoy
    status, _, b = e.post("/v1/chat/completions", chat(), key=token({"org": "org-nobody"}))
    assert status == 401
    assert json.loads(b)["error"]["code"] == "unknown_tenant"
    status, _, _ = e.post("/v1/chat/completions", chat(), key=None)
    assert status == 401  # jwt_authn: "Jwt is missing"
    status, _, _ = e.post("/v1/chat/completions", chat(), key=token({"org": "org-acme"}, secret=b"wrong" * 8))
    assert status == 401  # jwt_authn: bad signature
