//! From a namespace's resources to the filter's compiled configuration:
//! the one function `kvasirctl compile` and the controller both call, so
//! they write the same bytes for the same resources by construction.
//!
//! One compiled document per *target* (a `Gateway` or an `HTTPRoute`):
//!
//! - **settings**: the one `InferenceSettings` whose `targetRefs` names the
//!   target (tenant source, default action, classifiers); none or two is an
//!   error;
//! - **policies**: every `InferencePolicy` naming the target, by ascending
//!   `spec.precedence`; two with the same precedence are an error;
//! - **tenants**: every `InferenceTenant` of the namespace (the tenant is
//!   `metadata.name`; API keys are read from the Secrets the caller
//!   resolved and only their SHA-256 is kept);
//! - **pools / providers**: the `InferencePool`s and `InferenceProvider`s
//!   that the policies and the default action name (so an unrelated pool
//!   cannot break a target). Envoy cluster names: [`pool_cluster`],
//!   [`provider_cluster`].
//!
//! `kvasir_policy::validate` then checks the assembled set, and each of its
//! paths (`policies[3].match.models[0]`) is mapped back to the resource and
//! its field (`InferencePolicy/cheap-easy` `spec.match.models[0]`).

use std::collections::{BTreeMap, BTreeSet};

use kube_core::ResourceExt;
use kvasir_policy::{
    hash_api_key, Action, FilterConfig, Policy, PolicySet, Pool, Provider, ProviderAuth, SecretRef,
    Severity, Tenant, TenantSource, ValidationError,
};

use crate::types::*;

/// Secret name -> key -> value: the Secrets of the namespace the caller
/// resolved (the controller from the API server, `kvasirctl` from `Secret`
/// documents in its input files).
pub type Secrets = BTreeMap<String, BTreeMap<String, Vec<u8>>>;

/// Everything in one namespace that compilation reads.
#[derive(Debug, Clone, Default)]
pub struct Resources {
    /// The namespace (part of the generated Envoy cluster names).
    pub namespace: String,
    /// `InferencePolicy` resources.
    pub policies: Vec<InferencePolicy>,
    /// `InferenceTenant` resources.
    pub tenants: Vec<InferenceTenant>,
    /// `InferenceProvider` resources.
    pub providers: Vec<InferenceProvider>,
    /// `InferenceSettings` resources.
    pub settings: Vec<InferenceSettings>,
    /// The Inference Extension's `InferencePool`s.
    pub pools: Vec<InferencePool>,
    /// The Secrets tenants refer to.
    pub secrets: Secrets,
}

/// Deployment choices that are not in the resources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// The Envoy cluster of the cache-indexer's gRPC service.
    pub indexer_cluster: String,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            indexer_cluster: "kvasir-indexer".to_owned(),
        }
    }
}

/// A resource kind and name (in the namespace being compiled).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectRef {
    /// `InferencePolicy`, `InferenceTenant`, `InferenceProvider`,
    /// `InferenceSettings` or `InferencePool`.
    pub kind: &'static str,
    /// `metadata.name`.
    pub name: String,
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.kind, self.name)
    }
}

/// One finding about the resources: which object, which field, why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Finding {
    /// The object; `None` when the target itself is the problem.
    pub object: Option<ObjectRef>,
    /// The field, e.g. `spec.match.models[0]`; empty for the whole object.
    pub path: String,
    /// Why, in a sentence a person can act on.
    pub message: String,
    /// Error or warning.
    pub severity: Severity,
}

impl Finding {
    fn error(
        object: Option<ObjectRef>,
        path: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Finding {
            object,
            path: path.into(),
            message: message.into(),
            severity: Severity::Error,
        }
    }
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.severity == Severity::Warning {
            f.write_str("warning: ")?;
        }
        if let Some(o) = &self.object {
            write!(f, "{o}: ")?;
        }
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

/// A compiled target.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The assembled policy set (before compilation).
    pub set: PolicySet,
    /// The compiled configuration.
    pub config: FilterConfig,
    /// [`FilterConfig::to_json`]: the bytes the controller writes.
    pub bytes: Vec<u8>,
    /// Warnings (the set is valid).
    pub warnings: Vec<Finding>,
}

/// The Envoy cluster of a pool: the `kvasir.dev/cluster` annotation, else
/// `kvasir/<namespace>/pool/<name>`.
pub fn pool_cluster(namespace: &str, pool: &InferencePool) -> String {
    pool.annotations()
        .get(CLUSTER_ANNOTATION)
        .cloned()
        .unwrap_or_else(|| format!("kvasir/{namespace}/pool/{}", pool.name_any()))
}

/// The Envoy cluster of a provider: the `kvasir.dev/cluster` annotation,
/// else `kvasir/<namespace>/provider/<name>`.
pub fn provider_cluster(namespace: &str, provider: &InferenceProvider) -> String {
    provider
        .annotations()
        .get(CLUSTER_ANNOTATION)
        .cloned()
        .unwrap_or_else(|| format!("kvasir/{namespace}/provider/{}", provider.name_any()))
}

impl Resources {
    /// The Secrets the tenants name: what a controller fetches into
    /// [`Resources::secrets`] (it need not read any other Secret).
    pub fn secret_names(&self) -> BTreeSet<String> {
        self.tenants
            .iter()
            .filter_map(|t| t.spec.identity.api_keys.as_ref())
            .map(|k| k.secret_ref.name.clone())
            .collect()
    }
}

/// Every target named by a policy or a settings resource.
pub fn targets(res: &Resources) -> BTreeSet<TargetRef> {
    let p = res.policies.iter().flat_map(|p| p.spec.target_refs.iter());
    let s = res.settings.iter().flat_map(|s| s.spec.target_refs.iter());
    p.chain(s).map(normalize).collect()
}

/// Targets compare by kind and name (the group has one allowed value).
fn normalize(t: &TargetRef) -> TargetRef {
    TargetRef::new(t.kind, t.name.clone())
}

fn obj(kind: &'static str, name: String) -> Option<ObjectRef> {
    Some(ObjectRef { kind, name })
}

/// Where each entry of the assembled set came from, for mapping paths.
#[derive(Debug, Default)]
struct Origins {
    settings: String,
    policies: Vec<String>,
    tenants: Vec<String>,
    pools: Vec<String>,
    providers: Vec<String>,
    /// `headerValue` comes from `headerValue` or `jwtClaimValue`.
    tenant_value_field: &'static str,
}

/// Validates the resources for one target and compiles them. `Err` holds
/// every error and warning; `Ok` carries the warnings.
pub fn compile(
    res: &Resources,
    target: &TargetRef,
    opts: &Options,
) -> Result<Compiled, Vec<Finding>> {
    let (set, origins, mut findings) = assemble(res, target, opts)?;
    findings.extend(
        kvasir_policy::check(&set)
            .into_iter()
            .map(|e| map_finding(&origins, e)),
    );
    dedup(&mut findings);
    if findings.iter().any(|f| f.severity == Severity::Error) {
        return Err(findings);
    }
    match kvasir_policy::compile(&set) {
        Ok(config) => Ok(Compiled {
            bytes: config.to_json(),
            config,
            set,
            warnings: findings,
        }),
        Err(errs) => Err(errs.into_iter().map(|e| map_finding(&origins, e)).collect()),
    }
}

fn dedup(findings: &mut Vec<Finding>) {
    let mut seen = BTreeSet::new();
    findings.retain(|f| seen.insert((f.object.clone(), f.path.clone(), f.message.clone())));
}

type Assembly = (PolicySet, Origins, Vec<Finding>);

/// Builds the target's policy set. Reference errors that stop assembly
/// (no settings, ambiguous order) are `Err`; others are returned findings.
fn assemble(res: &Resources, target: &TargetRef, opts: &Options) -> Result<Assembly, Vec<Finding>> {
    let target = normalize(target);
    let settings = pick_settings(res, &target)?;
    let policies = ordered_policies(res, &target)?;
    let mut findings = Vec::new();
    let mut origins = Origins {
        settings: settings.name_any(),
        tenant_value_field: if settings.spec.tenant_source.jwt_claim.is_some() {
            "jwtClaimValue"
        } else {
            "headerValue"
        },
        ..Origins::default()
    };
    let tenants = tenants(
        res,
        &settings.spec.tenant_source,
        &mut origins,
        &mut findings,
    );
    let actions: Vec<&Action> = policies
        .iter()
        .map(|p| &p.spec.action)
        .chain([&settings.spec.default_action])
        .collect();
    let pools = pools(res, &policies, &actions, &mut origins, &mut findings);
    let providers = providers(res, &actions, &mut origins);
    origins.policies = policies.iter().map(|p| p.name_any()).collect();
    let set = PolicySet {
        tenants,
        class_budgets: settings.spec.class_budgets.clone().unwrap_or_default(),
        class_weights: settings.spec.class_weights.clone().unwrap_or_default(),
        tenant_source: settings.spec.tenant_source.clone(),
        pools: pools
            .into_iter()
            .map(|mut p| {
                p.indexer_cluster = opts.indexer_cluster.clone();
                p
            })
            .collect(),
        providers,
        classification: settings.spec.classification.clone().unwrap_or_default(),
        pool_state_max_age_ms: settings.spec.pool_state_max_age_ms,
        gateway_replicas: settings.spec.gateway_replicas,
        policies: policies
            .iter()
            .map(|p| Policy {
                name: p.name_any(),
                match_: p.spec.match_.clone(),
                action: p.spec.action.clone(),
                pii_guard: p.spec.pii_guard,
            })
            .collect(),
        default_action: settings.spec.default_action.clone(),
    };
    Ok((set, origins, findings))
}

fn pick_settings<'r>(
    res: &'r Resources,
    target: &TargetRef,
) -> Result<&'r InferenceSettings, Vec<Finding>> {
    let mut found: Vec<&InferenceSettings> = res
        .settings
        .iter()
        .filter(|s| s.spec.target_refs.iter().any(|t| &normalize(t) == target))
        .collect();
    found.sort_by_key(|s| s.name_any());
    match found.as_slice() {
        [one] => Ok(one),
        [] => {
            // Blame the first policy naming the target, if any: that is
            // where a user looks.
            let blame = res.policies.iter().find_map(|p| {
                let j = p
                    .spec
                    .target_refs
                    .iter()
                    .position(|t| &normalize(t) == target)?;
                Some((p.name_any(), j))
            });
            let msg = format!("no InferenceSettings targets {target}: it says where the tenant comes from and what happens when no policy matches");
            Err(vec![match blame {
                Some((name, j)) => Finding::error(
                    obj("InferencePolicy", name),
                    format!("spec.targetRefs[{j}]"),
                    msg,
                ),
                None => Finding::error(None, "", msg),
            }])
        }
        [first, rest @ ..] => Err(rest
            .iter()
            .map(|s| {
                let j = s
                    .spec
                    .target_refs
                    .iter()
                    .position(|t| &normalize(t) == target)
                    .unwrap_or(0);
                Finding::error(
                    obj("InferenceSettings", s.name_any()),
                    format!("spec.targetRefs[{j}]"),
                    format!(
                        "{target} already has InferenceSettings `{}`: a target takes exactly one",
                        first.name_any()
                    ),
                )
            })
            .collect()),
    }
}

fn ordered_policies<'r>(
    res: &'r Resources,
    target: &TargetRef,
) -> Result<Vec<&'r InferencePolicy>, Vec<Finding>> {
    let mut ps: Vec<&InferencePolicy> = res
        .policies
        .iter()
        .filter(|p| p.spec.target_refs.iter().any(|t| &normalize(t) == target))
        .collect();
    // The name only orders the error messages: equal precedences are refused.
    ps.sort_by_key(|p| (p.spec.precedence, p.name_any()));
    let errs: Vec<Finding> = ps
        .windows(2)
        .filter(|w| w[0].spec.precedence == w[1].spec.precedence)
        .map(|w| {
            Finding::error(
                obj("InferencePolicy", w[1].name_any()),
                "spec.precedence",
                format!(
                    "precedence {} is also used by InferencePolicy `{}` on {target}: the order of the two would be ambiguous; give each policy on a target its own precedence",
                    w[1].spec.precedence,
                    w[0].name_any()
                ),
            )
        })
        .collect();
    if errs.is_empty() {
        Ok(ps)
    } else {
        Err(errs)
    }
}

fn tenants(
    res: &Resources,
    src: &TenantSource,
    origins: &mut Origins,
    findings: &mut Vec<Finding>,
) -> Vec<Tenant> {
    let mut ts: Vec<&InferenceTenant> = res.tenants.iter().collect();
    ts.sort_by_key(|t| t.name_any());
    origins.tenants = ts.iter().map(|t| t.name_any()).collect();
    ts.iter()
        .map(|t| {
            let id = &t.spec.identity;
            let header_value = if src.jwt_claim.is_some() {
                id.jwt_claim_value.clone()
            } else if src.header.is_some() {
                id.header_value.clone()
            } else {
                None
            };
            let api_key_hashes = match (&src.api_key, &id.api_keys) {
                (Some(_), Some(keys)) => key_hashes(res, t, keys, findings),
                _ => Vec::new(),
            };
            Tenant {
                name: t.name_any(),
                class: t.spec.class.clone(),
                api_key_hashes,
                header_value,
                budget: t.spec.budget.clone(),
                weight: t.spec.weight,
            }
        })
        .collect()
}

/// The SHA-256 of each key the tenant's Secret holds. Values are trimmed:
/// a key file usually ends with a newline, and the filter trims the
/// presented key too.
fn key_hashes(
    res: &Resources,
    t: &InferenceTenant,
    keys: &ApiKeys,
    findings: &mut Vec<Finding>,
) -> Vec<String> {
    let who = obj("InferenceTenant", t.name_any());
    let sel = &keys.secret_ref;
    let Some(secret) = res.secrets.get(&sel.name) else {
        findings.push(Finding::error(
            who,
            "spec.identity.apiKeys.secretRef.name",
            format!(
                "Secret `{}` not found in namespace `{}`",
                sel.name, res.namespace
            ),
        ));
        return Vec::new();
    };
    let entries: Vec<(&String, &Vec<u8>)> = match &sel.key {
        Some(k) => match secret.get_key_value(k) {
            Some(e) => vec![e],
            None => {
                findings.push(Finding::error(
                    who,
                    "spec.identity.apiKeys.secretRef.key",
                    format!("Secret `{}` has no key `{k}`", sel.name),
                ));
                return Vec::new();
            }
        },
        None => secret.iter().collect(),
    };
    let mut hashes = BTreeSet::new();
    for (k, v) in entries {
        match std::str::from_utf8(v).map(str::trim) {
            Ok(key) if !key.is_empty() => {
                hashes.insert(hash_api_key(key));
            }
            // Never echo the value: it is a credential.
            _ => findings.push(Finding::error(
                who.clone(),
                "spec.identity.apiKeys.secretRef",
                format!("Secret `{}` key `{k}` is empty or not UTF-8 text", sel.name),
            )),
        }
    }
    if hashes.is_empty() && findings.iter().all(|f| f.object != who) {
        findings.push(Finding::error(
            who,
            "spec.identity.apiKeys.secretRef.name",
            format!("Secret `{}` holds no API key", sel.name),
        ));
    }
    hashes.into_iter().collect()
}

fn pools(
    res: &Resources,
    policies: &[&InferencePolicy],
    actions: &[&Action],
    origins: &mut Origins,
    findings: &mut Vec<Finding>,
) -> Vec<Pool> {
    let mut names = BTreeSet::new();
    for a in actions {
        if let Action::Route(r) = a {
            names.insert(r.pool.clone());
        }
    }
    for p in policies {
        if let Some(ps) = &p.spec.match_.pool_state {
            names.insert(ps.pool.clone());
        }
    }
    let mut out = Vec::new();
    for pool in res.pools.iter().filter(|p| names.contains(&p.name_any())) {
        let ann = pool.annotations();
        let models: Vec<String> = ann
            .get(MODELS_ANNOTATION)
            .map(|m| {
                m.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        if models.is_empty() {
            findings.push(Finding::error(
                obj("InferencePool", pool.name_any()),
                format!("metadata.annotations[\"{MODELS_ANNOTATION}\"]"),
                "required: the model names this pool serves, comma separated (a route's rewriteModel must be one of them)",
            ));
        }
        let flow_control = crate::flow::flow_control(pool).unwrap_or_else(|errs| {
            findings.extend(errs.into_iter().map(|(key, message)| {
                Finding::error(
                    obj("InferencePool", pool.name_any()),
                    format!("metadata.annotations[\"{key}\"]"),
                    message,
                )
            }));
            None
        });
        origins.pools.push(pool.name_any());
        out.push(Pool {
            name: pool.name_any(),
            models,
            cluster: pool_cluster(&res.namespace, pool),
            indexer_cluster: String::new(),
            indexer_pool: ann.get(INDEXER_POOL_ANNOTATION).cloned(),
            indexer_timeout_ms: None,
            flow_control,
        });
    }
    out
}

fn providers(res: &Resources, actions: &[&Action], origins: &mut Origins) -> Vec<Provider> {
    let names: BTreeSet<&str> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Provider(p) => Some(p.provider.as_str()),
            _ => None,
        })
        .collect();
    let mut out = Vec::new();
    for p in res
        .providers
        .iter()
        .filter(|p| names.contains(p.name_any().as_str()))
    {
        origins.providers.push(p.name_any());
        out.push(Provider {
            name: p.name_any(),
            cluster: provider_cluster(&res.namespace, p),
            authority: p.spec.authority.clone(),
            model: p.spec.model.clone(),
            auth: p.spec.auth.as_ref().map(|a| ProviderAuth {
                header: a.header.clone(),
                value: None,
                secret_ref: Some(SecretRef {
                    name: a.secret_ref.name.clone(),
                    key: a.secret_ref.key.clone(),
                }),
            }),
        });
    }
    out
}

/// `section[index]rest` -> (section, index, rest).
fn split_index(path: &str) -> Option<(&str, usize, &str)> {
    let open = path.find('[')?;
    let close = open + path[open..].find(']')?;
    let idx = path[open + 1..close].parse().ok()?;
    Some((&path[..open], idx, &path[close + 1..]))
}

/// Maps a `PolicySet` path to the resource and field it came from.
fn map_path(o: &Origins, path: &str) -> (Option<ObjectRef>, String) {
    let settings = || obj("InferenceSettings", o.settings.clone());
    let Some((section, i, rest)) = split_index(path) else {
        // tenantSource..., defaultAction..., classification..., the set.
        let field = if path.is_empty() {
            "spec".to_owned()
        } else {
            format!("spec.{path}")
        };
        return (settings(), field);
    };
    let rest = rest.strip_prefix('.').unwrap_or(rest);
    let at = |names: &[String], kind: &'static str| names.get(i).and_then(|n| obj(kind, n.clone()));
    match section {
        "policies" => {
            let field = match rest {
                "" => "spec".to_owned(),
                "name" => "metadata.name".to_owned(),
                r => format!("spec.{r}"),
            };
            (at(&o.policies, "InferencePolicy"), field)
        }
        "tenants" => {
            let field = match rest {
                "" => "spec".to_owned(),
                "name" => "metadata.name".to_owned(),
                "headerValue" => format!("spec.identity.{}", o.tenant_value_field),
                r if r.starts_with("apiKeyHashes") => "spec.identity.apiKeys".to_owned(),
                r => format!("spec.{r}"),
            };
            (at(&o.tenants, "InferenceTenant"), field)
        }
        "pools" => {
            let field = match rest.split(['.', '[']).next().unwrap_or("") {
                // The flow-control keys are annotations of their own.
                "flowControl" => {
                    let key = rest.trim_start_matches("flowControl");
                    match crate::flow::annotation_of(key.trim_start_matches('.')) {
                        Some(a) => format!("metadata.annotations[\"{a}\"]"),
                        None => "metadata.annotations".to_owned(),
                    }
                }
                "name" => "metadata.name".to_owned(),
                "models" => format!("metadata.annotations[\"{MODELS_ANNOTATION}\"]"),
                "cluster" => format!("metadata.annotations[\"{CLUSTER_ANNOTATION}\"]"),
                "indexerPool" => format!("metadata.annotations[\"{INDEXER_POOL_ANNOTATION}\"]"),
                _ => "metadata".to_owned(),
            };
            (at(&o.pools, "InferencePool"), field)
        }
        "providers" => {
            let field = match rest {
                "" => "spec".to_owned(),
                "name" => "metadata.name".to_owned(),
                "cluster" => format!("metadata.annotations[\"{CLUSTER_ANNOTATION}\"]"),
                r => format!("spec.{r}"),
            };
            (at(&o.providers, "InferenceProvider"), field)
        }
        _ => (settings(), format!("spec.{path}")),
    }
}

fn map_finding(o: &Origins, e: ValidationError) -> Finding {
    let (object, path) = map_path(o, &e.path);
    let message = rename_sections(&e.message, o);
    Finding {
        object,
        path,
        message,
        severity: e.severity,
    }
}

/// Messages mention other entries as `policies[2]`: name them as resources.
fn rename_sections(msg: &str, o: &Origins) -> String {
    let mut out = msg.to_owned();
    for (section, names, kind) in [
        ("policies", &o.policies, "InferencePolicy"),
        ("tenants", &o.tenants, "InferenceTenant"),
        ("pools", &o.pools, "InferencePool"),
        ("providers", &o.providers, "InferenceProvider"),
    ] {
        for (i, n) in names.iter().enumerate().rev() {
            out = out.replace(&format!("{section}[{i}]"), &format!("{kind}/{n}"));
        }
    }
    out
}

#[cfg(test)]
#[path = "assemble_tests.rs"]
mod tests;
