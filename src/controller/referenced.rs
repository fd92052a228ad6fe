//! Objects of other operators a relay names, as the observe step reads them: the
//! CloudNativePG `Cluster` of `spec.database.databaseRef`, and the Strimzi `Kafka` and
//! `KafkaUser` of `spec.broker.kafka.kafkaRef`. Each is found, missing, unreadable, or
//! of a kind the API server does not serve (the other operator is not installed).

use k8s_openapi::api::core::v1::Service;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Api, ResourceExt};

use super::{Context, Error};
use crate::api::OutboxRelay;

/// An object looked up by name.
enum Lookup {
    /// The kind is not served.
    NotInstalled,
    /// No object of that name.
    Missing,
    /// Not allowed to read it.
    Forbidden,
    /// The object's JSON, `metadata.name` and `metadata.labels` included.
    Found(serde_json::Value),
}

/// Looks up `name` of a kind (`group`, `version`, `kind`, `plural`) in `namespace`.
/// A 404 is a missing object when the kind is served and a missing operator when
/// not: the API server answers both alike, so discovery tells them apart.
async fn lookup(
    ctx: &Context,
    namespace: &str,
    (group, version, kind, plural): (&str, &str, &str, &str),
    name: &str,
) -> Result<Lookup, Error> {
    let resource =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), namespace, &resource);
    match api.get_opt(name).await {
        Ok(Some(object)) => {
            let mut value = object.data.clone();
            if let Some(fields) = value.as_object_mut() {
                fields.insert(
                    "metadata".to_owned(),
                    serde_json::json!({"name": object.name_any(), "labels": object.labels()}),
                );
            }
            Ok(Lookup::Found(value))
        }
        Ok(None) => {
            let served = match ctx
                .client
                .list_api_group_resources(&format!("{group}/{version}"))
                .await
            {
                Ok(list) => list.resources.iter().any(|r| r.name == plural),
                Err(kube::Error::Api(status)) if status.code == 404 => false,
                Err(err) => return Err(err.into()),
            };
            Ok(if served {
                Lookup::Missing
            } else {
                Lookup::NotInstalled
            })
        }
        // Not allowed to read it: a condition, not a failed reconcile.
        Err(kube::Error::Api(status)) if status.code == 403 => Ok(Lookup::Forbidden),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(Lookup::NotInstalled),
        Err(err) => Err(err.into()),
    }
}

/// The CloudNativePG Cluster a relay names, and whether its `-rw` Service exists.
pub(super) async fn cluster(
    relay: &OutboxRelay,
    reference: &crate::api::DatabaseRef,
    ctx: &Context,
) -> Result<crate::cnpg::ClusterSeen, Error> {
    use crate::cnpg::{ClusterSeen, GROUP, KIND, PLURAL, VERSION};
    let namespace = relay.namespace().unwrap_or_default();
    let value = match lookup(
        ctx,
        &namespace,
        (GROUP, VERSION, KIND, PLURAL),
        &reference.name,
    )
    .await?
    {
        Lookup::Found(value) => value,
        Lookup::Missing => return Ok(ClusterSeen::Missing),
        Lookup::NotInstalled => return Ok(ClusterSeen::NotInstalled),
        Lookup::Forbidden => return Ok(ClusterSeen::Forbidden),
    };
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
    let rw_service = services.get_opt(&reference.rw_service()).await?.is_some();
    Ok(ClusterSeen::Found {
        facts: crate::cnpg::facts_of(&value),
        rw_service,
    })
}

/// The Strimzi Kafka a relay names, and its KafkaUser when it names one.
pub(super) async fn strimzi(
    relay: &OutboxRelay,
    reference: &crate::api::KafkaRef,
    ctx: &Context,
) -> Result<crate::strimzi::StrimziSeen, Error> {
    use crate::strimzi::{GROUP, KAFKA, KAFKA_USER, Seen, StrimziSeen, VERSION};
    let namespace = relay.namespace().unwrap_or_default();
    let seen = |lookup: Lookup| match lookup {
        Lookup::Found(value) => Seen::Found(value),
        Lookup::Missing => Seen::Missing,
        Lookup::NotInstalled => Seen::NotInstalled,
        Lookup::Forbidden => Seen::Forbidden,
    };
    let kafka = seen(
        lookup(
            ctx,
            &namespace,
            (GROUP, VERSION, KAFKA.0, KAFKA.1),
            &reference.name,
        )
        .await?,
    );
    let user = match &reference.user {
        Some(user) => Some(seen(
            lookup(
                ctx,
                &namespace,
                (GROUP, VERSION, KAFKA_USER.0, KAFKA_USER.1),
                user,
            )
            .await?,
        )),
        None => None,
    };
    Ok(StrimziSeen {
        kafka: kafka.map(crate::strimzi::kafka_facts),
        user: user.map(|u| u.map(crate::strimzi::user_facts)),
    })
}
