//! Tenant resolution, including spoofing attempts.

use kvasir_policy::*;

const MULTI: &str = include_str!("../../examples/multi-tenant-pii.json");
const BURST: &str = include_str!("../../examples/saturation-burst.json");
const JWT: &str = include_str!("../../examples/jwt-models.json");

fn load(doc: &str) -> FilterConfig {
    compile(&parse_json(doc).unwrap()).unwrap()
}

fn resolve<'c>(
    c: &'c FilterConfig,
    headers: &[(&str, &str)],
) -> Result<TenantMatch<'c>, TenantError> {
    resolve_tenant(
        c,
        &TenantInput {
            headers: &headers,
            jwt_claim: None,
        },
    )
}

#[test]
fn api_keys_by_bearer_or_x_api_key() {
    let c = load(MULTI);
    let t = resolve(&c, &[("authorization", "Bearer sk-acme-0001")]).unwrap();
    assert_eq!(
        (t.name, t.class, t.via),
        ("acme", Some("gold"), TenantVia::ApiKey)
    );
    assert_eq!(t.index, c.tenant_index("acme").unwrap());
    assert_eq!(
        resolve(&c, &[("Authorization", "bearer   sk-acme-0002 ")])
            .unwrap()
            .name,
        "acme"
    );
    assert_eq!(
        resolve(&c, &[("x-api-key", "sk-globex-0001")])
            .unwrap()
            .name,
        "globex"
    );
    // Both key headers with the same key: one credential.
    let t = resolve(
        &c,
        &[
            ("x-api-key", " sk-initech-0001"),
            ("authorization", "Bearer sk-initech-0001"),
        ],
    )
    .unwrap();
    assert_eq!((t.name, t.via), ("initech", TenantVia::ApiKey));
    // A non-bearer Authorization falls back to x-api-key.
    let t = resolve(
        &c,
        &[
            ("authorization", "Basic dXNlcjpwYXNz"),
            ("x-api-key", "sk-globex-0001"),
        ],
    )
    .unwrap();
    assert_eq!(t.name, "globex");
}

#[test]
fn wrong_keys_are_rejected_even_with_a_default_tenant() {
    let c = load(MULTI);
    for h in [
        [("authorization", "Bearer sk-acme-0003")],
        [("authorization", "Bearer SK-ACME-0001")],
        [(
            "x-api-key",
            "sha256:f64df940e75359a440632480fb0bb219a66c8db9e108aa87fc8208436e460138",
        )],
    ] {
        let e = resolve(&c, &h).unwrap_err();
        assert_eq!(e, TenantError::UnknownApiKey);
        assert_eq!(e.status(), 401);
        assert_eq!(
            e.to_string(),
            "invalid API key",
            "no key material in the error"
        );
    }
    // No key at all: the default tenant.
    let t = resolve(&c, &[]).unwrap();
    assert_eq!((t.name, t.via), ("anonymous", TenantVia::Default));
    let t = resolve(&c, &[("authorization", "Bearer ")]).unwrap();
    assert_eq!(t.via, TenantVia::Default, "an empty bearer is no key");
}

#[test]
fn spoofed_tenant_header_is_ignored_with_api_keys() {
    let c = load(MULTI);
    let t = resolve(
        &c,
        &[
            ("x-tenant", "globex"),
            ("authorization", "Bearer sk-initech-0001"),
        ],
    )
    .unwrap();
    assert_eq!(t.name, "initech");
    assert!(t.client_header_ignored);
    // Without a key the header does not help either: default tenant.
    let t = resolve(&c, &[("x-tenant", "acme")]).unwrap();
    assert_eq!(
        (t.name, t.via, t.client_header_ignored),
        ("anonymous", TenantVia::Default, true)
    );
    let t = resolve(&c, &[("authorization", "Bearer sk-initech-0001")]).unwrap();
    assert!(!t.client_header_ignored);
}

#[test]
fn spoofed_tenant_header_is_rejected_when_configured() {
    let c = load(JWT);
    let e = resolve(&c, &[("x-jwt-org", "red"), ("x-tenant", "org-blue")]).unwrap_err();
    assert_eq!(
        e,
        TenantError::TenantHeaderNotAllowed {
            header: "x-tenant".into()
        }
    );
    assert_eq!(e.status(), 403);
    assert_eq!(e.to_string(), "the `x-tenant` header is not accepted");
    let e = resolve(&c, &[("X-Tenant", "org-blue")]).unwrap_err();
    assert_eq!(e.status(), 403, "header names are case-insensitive");
}

#[test]
fn jwt_claim_from_header_or_metadata() {
    let c = load(JWT);
    let t = resolve(&c, &[("x-jwt-org", "red")]).unwrap();
    assert_eq!(
        (t.name, t.class, t.via),
        ("org-red", Some("enterprise"), TenantVia::JwtClaim)
    );
    assert_eq!(
        resolve(&c, &[("x-jwt-org", "org-green")]).unwrap().name,
        "org-green"
    );
    assert_eq!(
        resolve(&c, &[("x-jwt-org", "org-red")]).unwrap_err(),
        TenantError::UnknownTenant
    );
    assert_eq!(
        resolve(&c, &[]).unwrap_err(),
        TenantError::MissingCredentials
    );
    // The claim header is trusted, the metadata argument is not used then.
    let t = resolve_tenant(
        &c,
        &TenantInput {
            headers: &[("x-jwt-org", "blue")],
            jwt_claim: Some("red"),
        },
    )
    .unwrap();
    assert_eq!(t.name, "org-blue");

    let mut set = parse_json(JWT).unwrap();
    set.tenant_source.jwt_claim = Some(JwtClaimSource {
        claim: "org".into(),
        header: None,
        payload_in_metadata: Some("jwt_payload".into()),
    });
    let c = compile(&set).unwrap();
    assert_eq!(
        c.tenant_source().jwt_metadata_key.as_deref(),
        Some("jwt_payload")
    );
    assert_eq!(c.tenant_source().jwt_claim.as_deref(), Some("org"));
    let t = resolve_tenant(
        &c,
        &TenantInput {
            headers: &[("x-jwt-org", "blue")],
            jwt_claim: Some("red"),
        },
    )
    .unwrap();
    assert_eq!(
        t.name, "org-red",
        "from metadata; a client header of the old name is meaningless"
    );
    assert_eq!(
        resolve_tenant(
            &c,
            &TenantInput {
                headers: &NoHeaders,
                jwt_claim: None
            }
        )
        .unwrap_err(),
        TenantError::MissingCredentials
    );
}

#[test]
fn trusted_header_source() {
    let c = load(BURST);
    let t = resolve(&c, &[("x-tenant", "trial-users")]).unwrap();
    assert_eq!(
        (t.name, t.via, t.client_header_ignored),
        ("trial", TenantVia::Header, false)
    );
    assert_eq!(
        resolve(&c, &[("x-tenant", "team-a")]).unwrap().name,
        "team-a"
    );
    assert_eq!(
        resolve(&c, &[("x-tenant", "trial")]).unwrap_err(),
        TenantError::UnknownTenant,
        "the header value, not the name"
    );
    assert_eq!(
        resolve(&c, &[("x-tenant", "Team-A")]).unwrap_err(),
        TenantError::UnknownTenant,
        "values are exact"
    );
    let e = resolve(&c, &[]).unwrap_err();
    assert_eq!(
        (e.clone(), e.status()),
        (TenantError::MissingCredentials, 401)
    );
}

#[test]
fn header_source_with_default_tenant() {
    let mut set = parse_json(BURST).unwrap();
    set.tenant_source.unknown_tenant = Some(UnknownTenant::Default);
    set.tenant_source.default_tenant = Some("trial".into());
    let c = compile(&set).unwrap();
    assert_eq!(resolve(&c, &[]).unwrap().via, TenantVia::Default);
    // A value that names nobody is still an error: no silent downgrade.
    assert_eq!(
        resolve(&c, &[("x-tenant", "tema-a")]).unwrap_err(),
        TenantError::UnknownTenant
    );
}

#[test]
fn key_hashes_match_what_kvasirctl_writes() {
    assert_eq!(
        hash_api_key("sk-acme-0001"),
        "sha256:f64df940e75359a440632480fb0bb219a66c8db9e108aa87fc8208436e460138"
    );
    // The empty string's SHA-256 (FIPS 180-2 test vector).
    assert_eq!(
        hash_api_key(""),
        "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
}

#[test]
fn two_different_keys_are_refused_whichever_is_valid() {
    let c = load(MULTI);
    for (bearer, x_api_key) in [
        // Two tenants' keys: charging either would be a guess.
        ("sk-initech-0001", "sk-globex-0001"),
        // A valid key next to an unknown one.
        ("sk-acme-0001", "sk-nobody"),
        ("sk-nobody", "sk-acme-0001"),
        // Two keys of the same tenant are still two different keys.
        ("sk-acme-0001", "sk-acme-0002"),
    ] {
        let e = resolve(
            &c,
            &[
                ("authorization", &format!("Bearer {bearer}")),
                ("x-api-key", x_api_key),
            ],
        )
        .unwrap_err();
        assert_eq!(
            e,
            TenantError::ConflictingCredentials,
            "{bearer} {x_api_key}"
        );
        assert_eq!(e.status(), 401);
        // The message names the headers, never a key.
        let msg = e.to_string();
        assert!(msg.contains("x-api-key") && !msg.contains(bearer) && !msg.contains(x_api_key));
    }
    // Empty values are no key: the other one counts.
    let t = resolve(
        &c,
        &[
            ("authorization", "Bearer  "),
            ("x-api-key", "sk-globex-0001"),
        ],
    )
    .unwrap();
    assert_eq!(t.name, "globex");
    let t = resolve(
        &c,
        &[
            ("authorization", "Bearer sk-globex-0001"),
            ("x-api-key", " "),
        ],
    )
    .unwrap();
    assert_eq!(t.name, "globex");
}
