//! The Gateway API objects a target names, read only as far as Kvasir
//! needs them: whether a `Gateway` or `HTTPRoute` exists, which routes
//! attach to a Gateway, and which of their rules match the filter's route
//! header.
//!
//! The filter names its destination by setting a request header
//! ([`ROUTE_HEADER`]) to a pool's or provider's cluster value and clearing
//! the route cache; on Envoy Gateway an `HTTPRoute` rule matching that
//! header value is what turns the choice into a backend. A compiled
//! destination that no rule matches is a silent misroute: the request is
//! served by whatever rule matches without the header. [`check_routes`]
//! finds those gaps before anything is applied.

use std::collections::{BTreeMap, BTreeSet};

use kube_derive::CustomResource;
use kvasir_policy::Severity;
use serde::{Deserialize, Serialize};

use crate::assemble::{Compiled, Finding, ObjectRef};
use crate::types::{TargetKind, TargetRef, GATEWAY_GROUP};

/// The request header the filter sets to the chosen destination's cluster
/// value (its default `routeHeader`).
pub const ROUTE_HEADER: &str = "x-kvasir-cluster";

/// A Gateway API `Gateway` (`gateway.networking.k8s.io/v1`): only its
/// metadata is read; the spec is kept as is.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "gateway.networking.k8s.io",
    version = "v1",
    kind = "Gateway",
    namespaced,
    schema = "disabled",
    crates(kube_core = "::kube_core")
)]
pub struct GatewaySpec {
    /// Every field of the Gateway's spec, unread.
    #[serde(flatten)]
    pub fields: BTreeMap<String, serde_json::Value>,
}

/// A Gateway API `HTTPRoute` (`gateway.networking.k8s.io/v1`): its parents
/// and its rules' matches; other fields are ignored.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "gateway.networking.k8s.io",
    version = "v1",
    kind = "HTTPRoute",
    root = "HttpRoute",
    namespaced,
    schema = "disabled",
    crates(kube_core = "::kube_core")
)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteSpec {
    /// The Gateways (or other parents) the route attaches to.
    #[serde(default)]
    pub parent_refs: Vec<ParentReference>,
    /// The rules.
    #[serde(default)]
    pub rules: Vec<HttpRouteRule>,
}

/// Gateway API's `ParentReference`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ParentReference {
    /// Default `gateway.networking.k8s.io`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Default `Gateway`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Default: the route's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The parent's name.
    pub name: String,
}

/// One rule of an `HTTPRoute`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteRule {
    /// The rule's optional name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The matches (any one selects the rule); none means every request.
    #[serde(default)]
    pub matches: Vec<HttpRouteMatch>,
}

/// One match of a rule: all its conditions hold.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteMatch {
    /// The path condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathMatch>,
    /// The method condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// Header conditions.
    #[serde(default)]
    pub headers: Vec<HeaderMatch>,
}

/// A path condition.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct PathMatch {
    /// `Exact`, `PathPrefix` (the default) or `RegularExpression`.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    /// The path (default `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// A header condition.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct HeaderMatch {
    /// `Exact` (the default) or `RegularExpression`.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    /// The header's name (case-insensitive).
    pub name: String,
    /// The value.
    pub value: String,
}

impl HttpRoute {
    /// Whether the route attaches to Gateway `gateway` of `namespace`
    /// (its parentRefs' defaults: group `gateway.networking.k8s.io`, kind
    /// `Gateway`, the route's own namespace).
    pub fn attaches_to(&self, gateway: &str, namespace: &str) -> bool {
        let own_ns = self.metadata.namespace.as_deref().unwrap_or(namespace);
        self.spec.parent_refs.iter().any(|p| {
            p.group.as_deref().unwrap_or(GATEWAY_GROUP) == GATEWAY_GROUP
                && p.kind.as_deref().unwrap_or("Gateway") == "Gateway"
                && p.namespace.as_deref().unwrap_or(own_ns) == namespace
                && p.name == gateway
        })
    }
}

/// A value the filter can write into [`ROUTE_HEADER`] for a target, and
/// the pool or provider it stands for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Destination {
    /// The header value (the pool's or provider's cluster).
    pub value: String,
    /// `InferencePool/<name>` or `InferenceProvider/<name>`.
    pub object: ObjectRef,
}

/// Every destination a compiled target can name: its pools and providers.
pub fn destinations(compiled: &Compiled) -> Vec<Destination> {
    let pools = compiled.set.pools.iter().map(|p| Destination {
        value: p.cluster.clone(),
        object: ObjectRef {
            kind: "InferencePool",
            name: p.name.clone(),
        },
    });
    let providers = compiled.set.providers.iter().map(|p| Destination {
        value: p.cluster.clone(),
        object: ObjectRef {
            kind: "InferenceProvider",
            name: p.name.clone(),
        },
    });
    let mut v: Vec<Destination> = pools.chain(providers).collect();
    v.sort();
    v.dedup();
    v
}

/// The routes that carry `target`'s traffic among `routes` (any
/// namespace): the route itself for an HTTPRoute target, the routes
/// attached to it for a Gateway.
pub fn routes_of<'a>(
    namespace: &str,
    target: &TargetRef,
    routes: &'a [HttpRoute],
) -> Vec<&'a HttpRoute> {
    routes
        .iter()
        .filter(|r| match target.kind {
            TargetKind::HttpRoute => {
                r.metadata.namespace.as_deref() == Some(namespace)
                    && r.metadata.name.as_deref() == Some(target.name.as_str())
            }
            TargetKind::Gateway => r.attaches_to(&target.name, namespace),
        })
        .collect()
}

fn route_ref(r: &HttpRoute) -> Option<ObjectRef> {
    Some(ObjectRef {
        kind: "HTTPRoute",
        name: r.metadata.name.clone().unwrap_or_default(),
    })
}

/// `METHOD path` of a match, for messages and for comparing the requests
/// two rules cover.
fn request_shape(m: &HttpRouteMatch) -> String {
    let path = m.path.as_ref();
    let kind = path
        .and_then(|p| p.type_.as_deref())
        .unwrap_or("PathPrefix");
    let value = path.and_then(|p| p.value.as_deref()).unwrap_or("/");
    let method = m.method.as_deref().unwrap_or("any method");
    format!("{method} {kind} {value}")
}

fn route_header_value(m: &HttpRouteMatch) -> Option<&str> {
    m.headers
        .iter()
        .find(|h| {
            h.name.eq_ignore_ascii_case(ROUTE_HEADER)
                && h.type_.as_deref().unwrap_or("Exact") == "Exact"
        })
        .map(|h| h.value.as_str())
}

/// Cross-checks a compiled target against the HTTPRoutes that carry its
/// traffic (`routes`: those of [`routes_of`]; route findings are reported
/// on the route, in the route's namespace):
///
/// - **error**: a destination the filter can name that no rule matches
///   with `x-kvasir-cluster: <value>` (requests sent there would be
///   served by a rule without the header: a misroute no one sees);
/// - **warning**: a destination whose rules cover fewer requests
///   (method and path) than another destination's rules do (a request of
///   that shape sent there falls through the same way);
/// - **warning**: a rule matching a header value that the target's
///   configuration never names (a typo leaves it dead).
///
/// With no route at all there is nothing to check against: a single
/// warning says so.
pub fn check_routes(
    target: &TargetRef,
    compiled: &Compiled,
    routes: &[&HttpRoute],
) -> Vec<Finding> {
    let dests = destinations(compiled);
    let mut out = Vec::new();
    let Some(first) = routes.first() else {
        if !dests.is_empty() {
            out.push(Finding {
                object: None,
                path: String::new(),
                message: format!(
                    "no HTTPRoute in the inputs carries {target}'s traffic: the `{ROUTE_HEADER}` rules were not checked against its destinations"
                ),
                severity: Severity::Warning,
            });
        }
        return out;
    };
    // value -> request shapes its rules match
    let mut covered: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    // (route, path, value) of every header match, for dead values
    let mut matched = Vec::new();
    for r in routes {
        for (ri, rule) in r.spec.rules.iter().enumerate() {
            for (mi, m) in rule.matches.iter().enumerate() {
                let Some(v) = route_header_value(m) else {
                    continue;
                };
                covered.entry(v).or_default().insert(request_shape(m));
                let hi = m
                    .headers
                    .iter()
                    .position(|h| h.name.eq_ignore_ascii_case(ROUTE_HEADER))
                    .unwrap_or(0);
                matched.push((
                    *r,
                    format!("spec.rules[{ri}].matches[{mi}].headers[{hi}].value"),
                    v,
                ));
            }
        }
    }
    let all_shapes: BTreeSet<&String> = dests
        .iter()
        .filter_map(|d| covered.get(d.value.as_str()))
        .flatten()
        .collect();
    for d in &dests {
        match covered.get(d.value.as_str()) {
            None => out.push(Finding {
                object: route_ref(first),
                path: "spec.rules".into(),
                message: format!(
                    "no rule matches `{ROUTE_HEADER}: {}`, the value the filter sets for {} on {target}: those requests would be served by a rule without the header (a silent misroute); add a rule with that header match",
                    d.value, d.object
                ),
                severity: Severity::Error,
            }),
            Some(shapes) => {
                let missing: Vec<&str> = all_shapes
                    .iter()
                    .filter(|s| !shapes.contains(s.as_str()))
                    .map(|s| s.as_str())
                    .collect();
                if !missing.is_empty() {
                    out.push(Finding {
                        object: route_ref(first),
                        path: "spec.rules".into(),
                        message: format!(
                            "the rules for `{ROUTE_HEADER}: {}` ({}) do not match {}, which other destinations' rules match: such a request sent to {} would be served by a rule without the header",
                            d.value,
                            d.object,
                            missing.join(", "),
                            d.object
                        ),
                        severity: Severity::Warning,
                    });
                }
            }
        }
    }
    let known: BTreeSet<&str> = dests.iter().map(|d| d.value.as_str()).collect();
    for (r, path, v) in matched {
        if !known.contains(v) {
            out.push(Finding {
                object: route_ref(r),
                path,
                message: format!(
                    "`{ROUTE_HEADER}: {v}` is never set for {target}: its configuration names {}",
                    if known.is_empty() {
                        "no destination".to_owned()
                    } else {
                        known.iter().copied().collect::<Vec<_>>().join(", ")
                    }
                ),
                severity: Severity::Warning,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(yaml: &str) -> HttpRoute {
        serde_yaml::from_str(yaml).expect("route")
    }

    const ROUTE: &str = r#"
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: inference, namespace: serving}
spec:
  parentRefs: [{name: gw}]
  rules:
    - matches:
        - path: {type: Exact, value: /v1/chat/completions}
          method: POST
          headers: [{name: x-kvasir-cluster, value: kvasir/serving/pool/main}]
    - matches:
        - path: {type: Exact, value: /v1/chat/completions}
          method: POST
"#;

    #[test]
    fn parents_default_to_a_gateway_in_the_routes_namespace() {
        let r = route(ROUTE);
        assert!(r.attaches_to("gw", "serving"));
        assert!(!r.attaches_to("gw", "other"));
        assert!(!r.attaches_to("gw2", "serving"));
        let mut cross = r.clone();
        cross.metadata.namespace = Some("apps".into());
        cross.spec.parent_refs[0].namespace = Some("serving".into());
        assert!(cross.attaches_to("gw", "serving"));
        cross.spec.parent_refs[0].kind = Some("Service".into());
        assert!(!cross.attaches_to("gw", "serving"));
    }

    #[test]
    fn routes_of_a_target() {
        let routes = vec![route(ROUTE)];
        let gw = TargetRef::new(TargetKind::Gateway, "gw");
        assert_eq!(routes_of("serving", &gw, &routes).len(), 1);
        let hr = TargetRef::new(TargetKind::HttpRoute, "inference");
        assert_eq!(routes_of("serving", &hr, &routes).len(), 1);
        let other = TargetRef::new(TargetKind::HttpRoute, "other");
        assert!(routes_of("serving", &other, &routes).is_empty());
    }
}
