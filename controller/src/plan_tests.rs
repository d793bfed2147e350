use super::*;
use kvasir_api::TargetKind;

fn policy(name: &str, target: &TargetRef) -> Object {
    Object {
        id: ObjectRef {
            kind: "InferencePolicy",
            name: name.into(),
        },
        generation: Some(2),
        deleting: false,
        finalized: true,
        conditions: vec![],
        ancestors: vec![],
        targets: Some([target.clone()].into()),
    }
}

fn gw() -> TargetRef {
    TargetRef::new(TargetKind::Gateway, "gw")
}

fn applied() -> Outcome {
    Outcome::Applied {
        policy: "kvasir-gateway-gw".into(),
        hash: "sha256:00".into(),
        gateway: GatewayVerdict::NotReported,
    }
}

fn error(object: &str, path: &str, message: &str) -> Finding {
    Finding {
        object: Some(ObjectRef {
            kind: "InferencePolicy",
            name: object.into(),
        }),
        path: path.into(),
        message: message.into(),
        severity: Severity::Error,
    }
}

fn by_type<'a>(c: &'a [Condition], t: &str) -> &'a Condition {
    c.iter().find(|c| c.type_ == t).unwrap()
}

#[test]
fn an_applied_target_programs_its_objects() {
    let o = Outcomes {
        targets: [(gw(), applied())].into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    let c = conditions(&policy("p", &gw()), &o, "t1");
    assert!(c.iter().all(|c| c.status == "True"), "{c:?}");
    assert_eq!(by_type(&c, PROGRAMMED).observed_generation, Some(2));
    assert!(by_type(&c, PROGRAMMED)
        .message
        .contains("kvasir-gateway-gw"));
}

#[test]
fn an_invalid_object_names_its_field_and_others_say_why_they_wait() {
    let bad = error("bad", "spec.match.models[0]", "empty model name");
    let o = Outcomes {
        targets: [(gw(), Outcome::Invalid(vec![bad]))].into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    let c = conditions(&policy("bad", &gw()), &o, "t");
    let a = by_type(&c, ACCEPTED);
    assert_eq!((a.status.as_str(), a.reason.as_str()), ("False", "Invalid"));
    assert_eq!(a.message, "spec.match.models[0]: empty model name");
    let c = conditions(&policy("good", &gw()), &o, "t");
    assert_eq!(by_type(&c, ACCEPTED).status, "True");
    let p = by_type(&c, PROGRAMMED);
    assert_eq!(p.status, "False");
    assert!(
        p.message.contains("last good configuration"),
        "{}",
        p.message
    );
    assert!(p.message.contains("InferencePolicy/bad"), "{}", p.message);
}

#[test]
fn missing_references_are_resolved_refs_not_accepted() {
    let f = error("p", "spec.action.route.pool", "unknown pool `x`");
    let o = Outcomes {
        targets: [(gw(), Outcome::Invalid(vec![f]))].into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    let c = conditions(&policy("p", &gw()), &o, "t");
    assert_eq!(by_type(&c, ACCEPTED).status, "True");
    let r = by_type(&c, RESOLVED_REFS);
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("False", "PoolNotFound")
    );
}

#[test]
fn transition_times_move_only_with_the_status() {
    let o = Outcomes {
        targets: [(gw(), applied())].into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    let mut p = policy("p", &gw());
    p.conditions = conditions(&p, &o, "t1");
    let again = conditions(&p, &o, "t2");
    assert!(again.iter().all(|c| c.last_transition_time == "t1"));
    assert!(!status_changed(&p.conditions, &again));
    let conflicted = Outcomes {
        targets: [(gw(), Outcome::Conflicted("owned by kubectl".into()))].into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    let c = conditions(&p, &conflicted, "t3");
    assert_eq!(by_type(&c, PROGRAMMED).last_transition_time, "t3");
    assert_eq!(by_type(&c, PROGRAMMED).reason, "Conflicted");
    assert!(status_changed(&p.conditions, &c));
}

#[test]
fn a_deleted_object_is_released_only_once_out_of_force() {
    let mut p = policy("p", &gw());
    p.deleting = true;
    let ok = Outcomes {
        targets: [(gw(), applied())].into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    assert!(may_release(&p, &ok));
    let stuck = Outcomes {
        targets: [(gw(), Outcome::Invalid(vec![]))].into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    assert!(!may_release(&p, &stuck));
    // Its target is gone: nothing can hold it.
    assert!(may_release(&p, &Outcomes::default()));
}

#[test]
fn envoy_gateways_verdict_is_read_for_the_current_generation_only() {
    let eep = |generation: i64, conds: serde_json::Value| {
        serde_json::json!({"metadata": {"generation": generation}, "status": {"ancestors": [{
            "ancestorRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "serving", "name": "gw"},
            "controllerName": "gateway.envoyproxy.io/gatewayclass-controller",
            "conditions": conds}]}})
    };
    let c = |t: &str, st: &str, reason: &str, gen: i64| serde_json::json!({"type": t, "status": st, "reason": reason, "message": "m", "observedGeneration": gen});
    assert_eq!(
        gateway_verdict(&serde_json::json!({"metadata": {"generation": 1}})),
        GatewayVerdict::NotReported
    );
    assert_eq!(
        gateway_verdict(&eep(
            2,
            serde_json::json!([c("Accepted", "True", "Accepted", 2)])
        )),
        GatewayVerdict::Accepted
    );
    let refused = gateway_verdict(&eep(
        2,
        serde_json::json!([c("Accepted", "False", "Conflicted", 2)]),
    ));
    assert_eq!(
        refused,
        GatewayVerdict::NotAccepted {
            ancestor: "Gateway serving/gw".into(),
            reason: "Conflicted".into(),
            message: "m".into()
        }
    );
    // A refusal of generation 1 says nothing about generation 2.
    assert_eq!(
        gateway_verdict(&eep(
            2,
            serde_json::json!([c("Accepted", "False", "Invalid", 1)])
        )),
        GatewayVerdict::NotReported
    );
    assert!(matches!(
        gateway_verdict(&eep(
            3,
            serde_json::json!([
                c("Accepted", "True", "Accepted", 3),
                c("Overridden", "True", "Overridden", 3)
            ])
        )),
        GatewayVerdict::Overridden { .. }
    ));
}

#[test]
fn a_refused_policy_is_not_programmed_and_its_ancestor_says_so() {
    let mut o = Outcomes {
        targets: [(
            gw(),
            Outcome::Applied {
                policy: "kvasir-gateway-gw".into(),
                hash: "sha256:00".into(),
                gateway: GatewayVerdict::NotAccepted {
                    ancestor: "Gateway serving/gw".into(),
                    reason: "Conflicted".into(),
                    message: "another policy targets it".into(),
                },
            },
        )]
        .into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    let p = policy("p", &gw());
    let c = conditions(&p, &o, "t");
    let prog = by_type(&c, PROGRAMMED);
    assert_eq!(
        (prog.status.as_str(), prog.reason.as_str()),
        ("False", REASON_NOT_ACCEPTED)
    );
    assert!(prog.message.contains("Conflicted"), "{}", prog.message);
    let a = ancestors(&p, &o, "t");
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].controller_name, CONTROLLER_NAME);
    assert_eq!(a[0].ancestor_ref.name, "gw");
    assert_eq!(a[0].ancestor_ref.namespace.as_deref(), Some("serving"));
    assert_eq!(by_type(&a[0].conditions, ACCEPTED).status, "True");
    assert_eq!(by_type(&a[0].conditions, PROGRAMMED).status, "False");
    // Accepted by Envoy Gateway: programmed, and the message says who.
    o.targets.insert(gw(), applied());
    if let Some(Outcome::Applied { gateway, .. }) = o.targets.get_mut(&gw()) {
        *gateway = GatewayVerdict::Accepted;
    }
    let c = conditions(&p, &o, "t");
    assert_eq!(by_type(&c, PROGRAMMED).status, "True");
    assert!(by_type(&c, PROGRAMMED)
        .message
        .contains("accepted by Envoy Gateway"));
}

#[test]
fn a_missing_target_is_reported_everywhere_and_releases_finalizers() {
    let o = Outcomes {
        targets: [(gw(), Outcome::TargetNotFound)].into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    let mut p = policy("p", &gw());
    let c = conditions(&p, &o, "t");
    assert_eq!(by_type(&c, ACCEPTED).status, "True");
    let r = by_type(&c, RESOLVED_REFS);
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("False", REASON_TARGET_NOT_FOUND)
    );
    assert!(r.message.contains("Gateway/gw"), "{}", r.message);
    assert_eq!(by_type(&c, PROGRAMMED).reason, REASON_TARGET_NOT_FOUND);
    let a = ancestors(&p, &o, "t");
    assert_eq!(
        by_type(&a[0].conditions, ACCEPTED).reason,
        REASON_TARGET_NOT_FOUND
    );
    p.ancestors = a.clone();
    assert!(!ancestors_changed(&p.ancestors, &ancestors(&p, &o, "t2")));
    assert_eq!(
        ancestors(&p, &o, "t2")[0].conditions[0].last_transition_time,
        "t"
    );
    p.deleting = true;
    assert!(may_release(&p, &o));
    // A tenant (every target) is programmed wherever a target exists.
    let mut both = Outcomes {
        targets: [(gw(), Outcome::TargetNotFound)].into(),
        warnings: vec![],
        namespace: "serving".into(),
    };
    let mut tenant = policy("t", &gw());
    tenant.targets = None;
    let c = conditions(&tenant, &both, "t");
    assert_eq!(by_type(&c, PROGRAMMED).reason, REASON_TARGET_NOT_FOUND);
    both.targets
        .insert(TargetRef::new(TargetKind::Gateway, "real"), applied());
    let c = conditions(&tenant, &both, "t");
    assert_eq!(by_type(&c, PROGRAMMED).status, "True", "{c:?}");
    assert_eq!(by_type(&c, RESOLVED_REFS).status, "True");
}

#[test]
fn objects_without_targets_say_so() {
    let mut t = policy("t", &gw());
    t.targets = None;
    let c = conditions(&t, &Outcomes::default(), "t");
    assert_eq!(by_type(&c, PROGRAMMED).reason, "NoTarget");
}
