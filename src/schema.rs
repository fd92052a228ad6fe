//! The CRD's OpenAPI schema held against a manifest before any API server sees it.
//!
//! `render` and `check` read OutboxRelay manifests from files, often in a GitOps
//! pipeline before `kubectl apply`. The API server holds each one to the CRD's schema:
//! lengths, patterns, ranges, entry counts, required fields and, with kubectl's strict
//! field validation, unknown fields. [`crate::spec::parse`] checks what the controller
//! needs, not every limit of the schema, so without this a manifest could pass both
//! commands and then be refused at apply. The schema is the one `crd` prints, built from
//! the same types, so the two cannot drift apart. (The CRD's CEL rules are mirrored by
//! `spec::parse`.)

use std::sync::LazyLock;

use kube::CustomResourceExt;
use serde_json::Value;

use crate::api::OutboxRelay;

/// Why the CRD's schema did not compile into a validator (a bug, reported per
/// manifest).
#[derive(Debug, thiserror::Error)]
enum SchemaError {
    /// The CRD or ObjectMeta's schema does not serialize.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// A part of the schema the validator is built from is not there.
    #[error("{0}")]
    Missing(&'static str),
    /// The validator refuses the schema.
    #[error("{0}")]
    Invalid(String),
}

/// The compiled schema, or why it did not compile (a bug, reported per manifest).
static VALIDATOR: LazyLock<Result<jsonschema::Validator, SchemaError>> = LazyLock::new(|| {
    let crd = serde_json::to_value(OutboxRelay::crd())?;
    let mut schema = crd
        .pointer("/spec/versions/0/schema/openAPIV3Schema")
        .cloned()
        .ok_or(SchemaError::Missing("the CRD has no openAPIV3Schema"))?;
    // The API server adds these three to every kind's schema itself; metadata's fields
    // are ObjectMeta's (their values are left to the API server, which sets most).
    let meta_fields: serde_json::Map<String, Value> = serde_json::to_value(schemars::schema_for!(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta
    ))?
    .get("properties")
    .and_then(Value::as_object)
    .ok_or(SchemaError::Missing(
        "ObjectMeta's schema lists no properties",
    ))?
    .keys()
    .map(|name| (name.clone(), serde_json::json!({})))
    .collect();
    if let Some(Value::Object(properties)) = schema.get_mut("properties") {
        for (name, schema) in [
            ("apiVersion", serde_json::json!({"type": "string"})),
            ("kind", serde_json::json!({"type": "string"})),
            (
                "metadata",
                serde_json::json!({"type": "object", "properties": meta_fields}),
            ),
        ] {
            properties.entry(name).or_insert(schema);
        }
    }
    refuse_unknown_fields(&mut schema);
    // OpenAPI 3.0's schema objects are JSON Schema draft 4's keywords (plus some the
    // validator ignores: nullable, x-kubernetes-*). Formats are not checked, as the API
    // server checks none of ours.
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft4)
        .should_validate_formats(false)
        .build(&schema)
        .map_err(|e| SchemaError::Invalid(e.to_string()))
});

/// What the API server would refuse in `manifest` (one OutboxRelay, as JSON), as
/// `field: reason` lines in the order found; empty when it fits the schema. Values are
/// never repeated in a reason, so nothing written in the manifest reaches a log.
pub fn problems(manifest: &Value) -> Vec<String> {
    let validator = match &*VALIDATOR {
        Ok(validator) => validator,
        Err(why) => return vec![format!("the CRD's schema does not compile: {why}")],
    };
    // The API server drops a null where the schema does not allow one (nullable), and
    // so does our reading of the manifest: a null is a field left out.
    let mut manifest = manifest.clone();
    drop_nulls(&mut manifest);
    // Status is the controller's: the API server drops it from what is applied.
    if let Some(object) = manifest.as_object_mut() {
        object.remove("status");
    }
    let mut found = Vec::new();
    for error in validator.iter_errors(&manifest) {
        let at = field(error.instance_path().as_str());
        let mut push = |field: &str, why: String| found.push(format!("{field}: {why}"));
        use jsonschema::error::ValidationErrorKind as Kind;
        match error.kind() {
            Kind::AdditionalProperties { unexpected } => {
                for name in unexpected {
                    push(&join(&at, name), "unknown field".to_owned());
                }
            }
            Kind::Required { property } => push(
                &join(&at, property.as_str().unwrap_or_default()),
                "required, and not set".to_owned(),
            ),
            Kind::MaxLength { limit } => {
                push(&at, format!("may not be longer than {limit} characters"));
            }
            Kind::MinLength { limit } => {
                push(&at, format!("must be at least {limit} characters long"));
            }
            Kind::Pattern { pattern } => push(&at, format!("must match the pattern {pattern}")),
            Kind::MaxProperties { limit } => {
                push(&at, format!("may not have more than {limit} entries"));
            }
            Kind::MaxItems { limit } => {
                push(&at, format!("may not have more than {limit} items"));
            }
            Kind::MinItems { limit } => push(&at, format!("needs at least {limit} items")),
            Kind::Maximum { limit } => {
                push(&at, format!("may not be more than {}", number(limit)));
            }
            Kind::Minimum { limit } => {
                push(&at, format!("may not be less than {}", number(limit)));
            }
            Kind::Enum { options } => push(&at, format!("must be one of {options}")),
            Kind::Type { kind } => push(&at, format!("must be of type {}", type_name(kind))),
            _ => push(&at, "does not fit the CRD's schema".to_owned()),
        }
    }
    found
}

/// kubectl's strict field validation (its default) refuses a field the schema does not
/// name: each object schema that lists its properties, and neither allows others nor
/// keeps unknown fields, gets `additionalProperties: false`. (A structural schema puts
/// properties nowhere but there, so none is split across `allOf` and the like.)
fn refuse_unknown_fields(schema: &mut Value) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    // The API server reads `x-kubernetes-int-or-string` without a type as either
    // (a quantity: `cpu: 1` or `cpu: 500m`, never `cpu: 0.5`).
    if object
        .get("x-kubernetes-int-or-string")
        .is_some_and(|v| v == true)
        && !object.contains_key("type")
    {
        object.insert(
            "type".to_owned(),
            Value::Array(vec!["integer".into(), "string".into()]),
        );
    }
    let keeps_unknown = object
        .get("x-kubernetes-preserve-unknown-fields")
        .is_some_and(|v| v == true);
    if object.contains_key("properties")
        && !object.contains_key("additionalProperties")
        && !keeps_unknown
    {
        object.insert("additionalProperties".to_owned(), Value::Bool(false));
    }
    if let Some(Value::Object(properties)) = object.get_mut("properties") {
        for property in properties.values_mut() {
            refuse_unknown_fields(property);
        }
    }
    for key in ["items", "additionalProperties"] {
        if let Some(inner) = object.get_mut(key) {
            refuse_unknown_fields(inner);
        }
    }
}

/// `value` without the object members that are null, at every depth.
fn drop_nulls(value: &mut Value) {
    match value {
        Value::Object(object) => {
            object.retain(|_, v| !v.is_null());
            object.values_mut().for_each(drop_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

/// A JSON pointer (`/spec/broker/kafka/properties/linger.ms`) as the field names the
/// rest of the crate reports (`spec.broker.kafka.properties.linger.ms`).
fn field(pointer: &str) -> String {
    pointer
        .split('/')
        .skip(1)
        .map(|segment| segment.replace("~1", "/").replace("~0", "~"))
        .collect::<Vec<_>>()
        .join(".")
}

/// `name` under `parent` (the manifest's top when `parent` is empty).
fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}.{name}")
    }
}

/// A schema's limit as written for people: `64`, not the generator's `64.0`.
fn number(limit: &Value) -> String {
    match limit.as_f64() {
        Some(n) if n.fract() == 0.0 && n.abs() < 1e15 => format!("{n:.0}"),
        _ => limit.to_string(),
    }
}

/// The JSON type(s) a value should have had.
fn type_name(kind: &jsonschema::error::TypeKind) -> String {
    match kind {
        jsonschema::error::TypeKind::Single(t) => t.to_string(),
        jsonschema::error::TypeKind::Multiple(set) => format!("{set:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A relay that fits the schema, edited by `edit`.
    fn relay(edit: impl FnOnce(&mut Value)) -> Value {
        let mut relay = json!({
            "apiVersion": "outbox.dev/v1alpha1",
            "kind": "OutboxRelay",
            "metadata": {"name": "orders", "namespace": "shop", "labels": {"a": "b"}},
            "spec": {
                "database": {"postgres": {"connectionSecretRef": {"name": "orders-db"}}},
                "mode": {"logTailing": {}},
                "broker": {"kafka": {"bootstrapServers": "kafka:9092", "properties": {"linger.ms": "5"}}},
            }
        });
        edit(&mut relay);
        relay
    }

    #[test]
    fn a_relay_that_fits_has_no_problem() {
        assert_eq!(problems(&relay(|_| {})), Vec::<String>::new());
        // A null is a field left out.
        let with_null = relay(|r| r["spec"]["table"] = Value::Null);
        assert_eq!(problems(&with_null), Vec::<String>::new());
        // Quantities as integers or strings; status, as `kubectl get -o yaml` shows it,
        // is not applied.
        let more = relay(|r| {
            r["spec"]["relay"] = json!({"resources": {"requests": {"cpu": 1, "memory": "64Mi"}, "limits": {"cpu": "500m"}}});
            r["status"] = json!({"observedGeneration": "not a number", "anything": true});
        });
        assert_eq!(problems(&more), Vec::<String>::new());
    }

    #[test]
    fn what_the_api_server_refuses_is_named_by_field() {
        let found = problems(&relay(|r| {
            let kafka = &mut r["spec"]["broker"]["kafka"];
            kafka["bootstrapServer"] = json!("typo:9092");
            kafka["bootstrapServers"] = json!("k".repeat(2049));
            let many: serde_json::Map<String, Value> =
                (0..129).map(|i| (format!("x.{i}"), json!("1"))).collect();
            kafka["properties"] = Value::Object(many);
            r["spec"]["alerting"] = json!({"oldestUnpublishedAge": "1h".repeat(20)});
            r["spec"]["mode"]["logTailing"]["heartbeatInterval"] = json!("soon");
            r["spec"]["replicas"] = json!(-1);
            r["spec"]["relay"] = json!({"resources": {"requests": {"cpu": 0.5, "memory": "64Mi"}, "limits": {"cpu": 1}}});
            r["spec"]["database"]["postgres"]["sslMode"] = json!("sometimes");
            r["spec"]["database"]["postgres"]["connectionSecretRef"] = json!({});
            r["extra"] = json!(true);
            r["metadata"]["namespce"] = json!("shop");
        }));
        for expected in [
            "extra: unknown field",
            "metadata.namespce: unknown field",
            "spec.broker.kafka.bootstrapServer: unknown field",
            "spec.broker.kafka.bootstrapServers: may not be longer than 2048 characters",
            "spec.broker.kafka.properties: may not have more than 128 entries",
            "spec.alerting.oldestUnpublishedAge: may not be longer than 32 characters",
            "spec.mode.logTailing.heartbeatInterval: must match the pattern",
            "spec.replicas: may not be less than 0",
            "spec.relay.resources.requests.cpu: must be of type",
            "spec.database.postgres.sslMode: must be one of",
            "spec.database.postgres.connectionSecretRef.name: required, and not set",
        ] {
            assert!(
                found.iter().any(|f| f.starts_with(expected)),
                "{expected:?} not among {found:#?}"
            );
        }
        // No value written in the manifest is repeated.
        assert!(
            !found
                .iter()
                .any(|f| f.contains("typo") || f.contains("kkkk") || f.contains("0.5")),
            "{found:#?}"
        );
    }

    #[test]
    fn pointers_become_field_names() {
        assert_eq!(
            field("/spec/broker/kafka/properties/linger.ms"),
            "spec.broker.kafka.properties.linger.ms"
        );
        assert_eq!(field("/a~1b/c~0d/0"), "a/b.c~d.0");
        assert_eq!(field(""), "");
    }
}
