//! The plugin configuration: the compiled policy document plus the
//! filter's own settings, parsed once in the root context's
//! `on_configure`.
//!
//! Two shapes are accepted, so the same filter reads what `kvasirctl
//! compile` prints and what an operator wraps by hand:
//!
//! - the bare compiled document (`{"version": "kvasir.filter/v1", ...}`),
//!   optionally with a sibling `"filter": {...}` object of settings (the
//!   policy reader ignores keys it does not know);
//! - an envelope `{"policy": {<compiled document>}, "filter": {...}}`.
//!
//! Every setting has a default, unknown setting names are refused (a typo
//! must not silently keep a default), and [`PluginConfig::from_bytes`]
//! checks every value, so nothing here can fail on a request.

use std::collections::BTreeSet;

use kvasir_policy::config::ActionConfig;
use kvasir_policy::FilterConfig;
use serde::Deserialize;

/// The filter's own settings (the `filter` object of the plugin config).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct FilterSettings {
    /// Largest request body the filter buffers and parses (bytes). Larger
    /// bodies get a 413 in the API's error shape. Keep it below Envoy's
    /// buffer limit (the listener's `per_connection_buffer_limit_bytes` or
    /// the route's `request_body_buffer_limit`, 1 MiB by default): past
    /// that limit Envoy answers 413 itself, in plain text.
    pub body_limit_bytes: usize,
    /// Most endpoints asked of the indexer (the ordered fallback list in
    /// `x-gateway-destination-endpoint`; later entries serve retries).
    pub max_endpoints: u32,
    /// The request header the bootstrap's route uses as `cluster_header`:
    /// the filter sets it to the pool's or the provider's cluster. A
    /// client-sent value is always removed.
    pub route_header: String,
    /// The header the override-host load balancer reads (through
    /// `header_to_metadata`). A client-sent value is always removed.
    pub endpoint_header: String,
    /// The response header that names the endpoint that served, when an
    /// upstream proxy sets it; else the filter uses Envoy's
    /// `upstream.address`.
    pub served_header: String,
    /// Whether to add `served_header` to the client's response (handy in
    /// tests and demos; off by default because it shows internal addresses).
    pub expose_served_endpoint: bool,
    /// Whether to send `Report` (done) to the indexer after each picked
    /// request.
    pub report: bool,
    /// Whether to also send a `Report` at the first response byte (makes
    /// the indexer's queued-prefill term exact; one more call per request).
    pub report_first_token: bool,
    /// Timeout of `Report` calls (ms); reports are fire and forget.
    pub report_timeout_ms: u32,
    /// Whether picks and reports go over one `Session` stream per VM and
    /// indexer cluster (a message on an open stream instead of a new gRPC
    /// call: less Envoy CPU and latency per request). Unary calls serve
    /// while the stream is not open, and always when this is off.
    pub indexer_session: bool,
    /// Period of the root context's timer (ms): polls `PoolState` for pools
    /// that saturation policies test, and refreshes the saturation gauges.
    /// 0 turns the timer off (saturation is then learned from picks only).
    pub pool_state_poll_ms: u32,
    /// Largest non-streaming response body kept to read `usage` from
    /// (bytes); the response itself is never held back.
    pub response_body_limit_bytes: usize,
    /// Most distinct stat names the filter defines (tenants x models x
    /// stats); beyond it new names are not created and
    /// `kvasir.stats.dropped` counts the misses. Bounds Envoy memory.
    pub max_stats: usize,
}

impl Default for FilterSettings {
    fn default() -> Self {
        FilterSettings {
            body_limit_bytes: 1024 * 1024 - 1,
            max_endpoints: 3,
            route_header: "x-kvasir-cluster".into(),
            endpoint_header: "x-gateway-destination-endpoint".into(),
            served_header: "x-gateway-destination-endpoint-served".into(),
            expose_served_endpoint: false,
            report: true,
            report_first_token: false,
            report_timeout_ms: 1000,
            indexer_session: true,
            pool_state_poll_ms: 1000,
            response_body_limit_bytes: 256 * 1024,
            max_stats: 4096,
        }
    }
}

/// Everything the filter knows after `on_configure`.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// The compiled policy document, with its lookup index.
    pub policy: FilterConfig,
    /// The filter's settings.
    pub settings: FilterSettings,
    /// Model names allowed as a stats label (see [`PluginConfig::model_label`]).
    known_models: BTreeSet<String>,
}

/// The label used for models the configuration does not name.
pub const OTHER_MODEL: &str = "other";

fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl PluginConfig {
    /// Parses and checks the plugin configuration bytes. The error is a
    /// one-line reason for Envoy's log (it never echoes secrets: policy
    /// errors name paths, not values).
    pub fn from_bytes(bytes: &[u8]) -> Result<PluginConfig, String> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(
                "empty plugin configuration: expected the compiled kvasir.filter/v1 document"
                    .into(),
            );
        }
        let mut top: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| format!("plugin configuration is not JSON: {e}"))?;
        let Some(obj) = top.as_object_mut() else {
            return Err("plugin configuration is not a JSON object".into());
        };
        let settings = match obj.remove("filter") {
            None => FilterSettings::default(),
            Some(v) => {
                serde_json::from_value(v).map_err(|e| format!("invalid `filter` settings: {e}"))?
            }
        };
        let policy = match obj.remove("policy") {
            Some(doc) => {
                let doc = serde_json::to_vec(&doc).map_err(|e| format!("invalid `policy`: {e}"))?;
                FilterConfig::from_json(&doc)
            }
            None => FilterConfig::from_json(bytes),
        }
        .map_err(|e| e.to_string())?;
        settings.check()?;
        let known_models = known_models(&policy);
        Ok(PluginConfig {
            policy,
            settings,
            known_models,
        })
    }

    /// The stats label of a requested model: the model itself when the
    /// configuration names it (a pool's models, a provider's model, a
    /// policy's exact model list or rewrite target), else [`OTHER_MODEL`].
    /// Clients choose the model string, so using it unchecked would let
    /// them create unbounded stats.
    pub fn model_label<'a>(&'a self, model: &'a str) -> &'a str {
        if self.known_models.contains(model) {
            model
        } else {
            OTHER_MODEL
        }
    }
}

impl FilterSettings {
    fn check(&self) -> Result<(), String> {
        if self.body_limit_bytes == 0 {
            return Err("filter.bodyLimitBytes must be at least 1".into());
        }
        if self.max_endpoints == 0 || self.max_endpoints > 64 {
            return Err("filter.maxEndpoints must be in 1..=64".into());
        }
        for (name, v) in [
            ("routeHeader", &self.route_header),
            ("endpointHeader", &self.endpoint_header),
            ("servedHeader", &self.served_header),
        ] {
            if !is_header_name(v) {
                return Err(format!(
                    "filter.{name} must be a lowercase header name, got `{v}`"
                ));
            }
        }
        if self.report_timeout_ms == 0 {
            return Err("filter.reportTimeoutMs must be at least 1".into());
        }
        if self.max_stats == 0 {
            return Err("filter.maxStats must be at least 1".into());
        }
        Ok(())
    }
}

fn known_models(cfg: &FilterConfig) -> BTreeSet<String> {
    let mut m = BTreeSet::new();
    for p in cfg.pools() {
        m.extend(p.models.iter().cloned());
    }
    for p in cfg.providers() {
        m.extend(p.model.iter().cloned());
    }
    let mut action = |a: &ActionConfig| match a {
        ActionConfig::Route(r) => m.extend(r.rewrite_model.iter().cloned()),
        ActionConfig::Provider(p) => m.extend(p.rewrite_model.iter().cloned()),
        _ => {}
    };
    for p in cfg.policies() {
        action(&p.action);
    }
    action(cfg.default_action());
    for p in cfg.policies() {
        if let Some(ms) = &p.match_.models {
            m.extend(ms.exact.iter().cloned());
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const DOC: &str = r#"{
      "tenantSource": {"header": "x-tenant"},
      "tenants": [{"name": "acme"}],
      "pools": [{"name": "main", "models": ["qwen"], "cluster": "pool", "indexerCluster": "indexer"}],
      "policies": [{"name": "gpt", "match": {"models": ["gpt-4o"]},
                    "action": {"route": {"pool": "main", "rewriteModel": "qwen"}}}],
      "defaultAction": {"route": {"pool": "main"}}
    }"#;

    fn compiled() -> Vec<u8> {
        let set = kvasir_policy::parse_json(DOC).unwrap();
        kvasir_policy::compile(&set).unwrap().to_json()
    }

    #[test]
    fn bare_document_gets_default_settings() {
        let c = PluginConfig::from_bytes(&compiled()).unwrap();
        assert_eq!(c.settings, FilterSettings::default());
        assert_eq!(c.policy.pools()[0].indexer_timeout_ms, 50);
    }

    #[test]
    fn envelope_and_sibling_settings() {
        let doc = String::from_utf8(compiled()).unwrap();
        let env = format!(
            r#"{{"policy": {doc}, "filter": {{"maxEndpoints": 2, "exposeServedEndpoint": true}}}}"#
        );
        let c = PluginConfig::from_bytes(env.as_bytes()).unwrap();
        assert_eq!(c.settings.max_endpoints, 2);
        assert!(c.settings.expose_served_endpoint);
        let sib = format!(
            r#"{},"filter":{{"bodyLimitBytes":10}}}}"#,
            doc.strip_suffix('}').unwrap()
        );
        let c = PluginConfig::from_bytes(sib.as_bytes()).unwrap();
        assert_eq!(c.settings.body_limit_bytes, 10);
    }

    #[test]
    fn bad_configs_are_refused_with_a_reason() {
        for (bytes, want) in [
            ("", "empty"),
            ("[1]", "not a JSON object"),
            ("{nope", "not JSON"),
            (
                r#"{"version": "kvasir.filter/v9"}"#,
                "unsupported filter config version",
            ),
            (r#"{"filter": {"bodyLimitByte": 1}}"#, "unknown field"),
        ] {
            let e = PluginConfig::from_bytes(bytes.as_bytes()).unwrap_err();
            assert!(e.contains(want), "{bytes}: {e}");
        }
        let doc = String::from_utf8(compiled()).unwrap();
        let env = format!(r#"{{"policy": {doc}, "filter": {{"routeHeader": "X Bad"}}}}"#);
        assert!(PluginConfig::from_bytes(env.as_bytes())
            .unwrap_err()
            .contains("routeHeader"));
    }

    #[test]
    fn model_labels_are_bounded_to_configured_models() {
        let c = PluginConfig::from_bytes(&compiled()).unwrap();
        assert_eq!(c.model_label("qwen"), "qwen");
        assert_eq!(c.model_label("gpt-4o"), "gpt-4o");
        assert_eq!(c.model_label("random-123"), OTHER_MODEL);
    }
}
