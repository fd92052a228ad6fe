//! The observe step of a reconcile: everything the decision needs, read and never
//! written — the referenced Secrets, the database's facts (settings, table, slot and
//! publication), the relay's children as the API server has them, and whether the
//! Prometheus Operator's kinds are served.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use kube::api::ListParams;
use kube::{Api, ResourceExt};

use super::connection;
use super::database::{self, DatabaseSeen};
use super::referenced;
use super::status::{CONDITION_BROKER_READY, CONDITION_DATABASE_READY, Cond};
use super::{Context, Error};
use crate::api::OutboxRelay;
use crate::postgres::admin::Marker;
use crate::postgres::tls::{ClientPem, PgTls};
use crate::resources::{
    Desired, MONITORING_API_VERSION, PROMETHEUS_RULE_PLURAL, SERVICE_MONITOR_PLURAL,
};
use crate::secrets::{Content, SecretUse};
use crate::spec::{PG_CA_FIELD, PG_CLIENT_CERT_FIELD, PG_CLIENT_KEY_FIELD, Problem, ValidRelay};

/// How long the answer to "are the Prometheus Operator's CRDs served?" is reused.
const MONITORING_LOOKUP_TTL: Duration = Duration::from_secs(15);

/// What the referenced Secrets say.
#[derive(Clone, Debug)]
pub(super) struct SecretsSeen {
    /// `DatabaseReady` as far as its Secret goes.
    pub database: Cond,
    /// `BrokerReady` as far as its Secrets go.
    pub broker: Cond,
    /// Keys missing from a Secret that exists, or values the relay could not use.
    pub problems: Vec<Problem>,
    /// Per referenced Secret key (`name/key`), a digest of the value the relay reads,
    /// sorted: it changes when that value does (a rotated password or certificate) and
    /// only then — not when the Secret's metadata or another of its keys changes (a
    /// finalizer, a label from a GitOps tool), which would roll the relays for nothing.
    /// Salted with the Secret's uid; see [`value_digest`].
    pub versions: Vec<(String, String)>,
    /// The referenced Secrets that carry this relay's slot finalizer.
    pub finalized: Vec<String>,
}

/// The relay's children as the API server has them.
#[derive(Clone, Debug, Default)]
pub(super) struct ChildrenSeen {
    /// The Deployment (with its status).
    pub deployment: Option<Deployment>,
    /// Every pod of the relay runs the desired config: the Deployment's template has the
    /// desired config hash and its rollout is complete (no pod of an older template
    /// left). Also true when there is no Deployment (no pods).
    pub rolled_out: bool,
    /// The Deployment's pods poll (its mode annotation says so; Deployments made before
    /// the annotation: a rolling update strategy, as only polling has).
    pub runs_polling: bool,
    /// The Deployment's rollout is complete, whatever its template: every pod runs it
    /// and no pod of an older template is left (false without a Deployment).
    pub settled: bool,
    /// The ConfigMap and the Service as read (the apply compares them with what it
    /// would send, instead of reading them again).
    pub config_map: Option<ConfigMap>,
    pub service: Option<Service>,
    /// Why relay pods are unavailable, as their kubelet and the scheduler say (read only
    /// while the Deployment has fewer available pods than it wants).
    pub pod_trouble: Option<super::pods::PodTrouble>,
}

/// Whose the log-tailing slot is, by its publication's marker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) enum Claim {
    /// This relay's or nobody's: no marker of the operator's, one of this relay's name,
    /// or one for another slot name (the publication is then adopted).
    #[default]
    Free,
    /// Another OutboxRelay's that exists (`namespace/name`, and why it counts): two
    /// relays cannot stream one slot.
    Held(String),
    /// Another OutboxRelay's that is gone or being deleted: this relay succeeds it (a
    /// rename keeping `slotName`), with the slot's position.
    Released,
}

/// Everything one reconcile looked at.
#[derive(Clone, Debug)]
pub(super) struct Observed {
    /// The Secrets.
    pub secrets: SecretsSeen,
    /// The database (not looked at while a Secret is missing or unusable).
    pub database: DatabaseSeen,
    /// Whose the slot is (log tailing, once the database was seen).
    pub claim: Claim,
    /// The children.
    pub children: ChildrenSeen,
    /// ServiceMonitor and PrometheusRule are served.
    pub monitoring: bool,
    /// The fall back to polling status recorded (a log-tailing relay past its WAL
    /// budget).
    pub fallback: Option<crate::api::FallbackStatus>,
    /// When it was observed.
    pub now: k8s_openapi::jiff::Timestamp,
    /// The value of [`crate::api::RECREATE_LOST_SLOT_ANNOTATION`]: which lost slot the
    /// user chose to replace.
    pub recreate_lost_slot: Option<String>,
    /// The CloudNativePG cluster `spec.database.databaseRef` names (`None`: no
    /// reference).
    pub cluster: Option<crate::cnpg::ClusterSeen>,
    /// The Strimzi Kafka and KafkaUser `spec.broker.kafka.kafkaRef` names (`None`: no
    /// reference).
    pub strimzi: Option<crate::strimzi::StrimziSeen>,
    /// Where the connection Secret's URL leads (`host:port/database`; `None` without a
    /// usable connection).
    pub location: Option<String>,
    /// The value of [`crate::api::LEFT_BEHIND_SLOT_DROPPED_ANNOTATION`].
    pub left_behind_dropped: Option<String>,
    /// How to reach the database, when the Secrets hold a usable connection: what the
    /// decision plans to run in it runs over this, so no Secret is read twice.
    pub connection: Option<connection::Conn>,
}

/// The slot and the fall back as status last showed them, read through this
/// controller's own last write where the cache does not hold it yet (a pass triggered
/// by a child right after the write): a loss is recorded once, with one time.
pub(super) fn remembered(
    relay: &OutboxRelay,
    ctx: &Context,
) -> (
    Option<crate::api::SlotStatus>,
    Option<crate::api::FallbackStatus>,
) {
    let written = ctx
        .written_status
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&relay.uid().unwrap_or_default())
        .cloned();
    let mut last_slot = relay.status.as_ref().and_then(|s| s.slot.clone());
    if let Some(written) = written.as_ref().and_then(|s| s.slot.as_ref())
        && let Some(slot) = last_slot.as_mut().filter(|s| s.name == written.name)
    {
        slot.existed = written.existed;
        slot.lost = written.lost.clone();
        slot.location = written.location.clone();
        slot.left_behind = written.left_behind.clone();
    }
    let fallback = match written {
        Some(written) => written.fallback,
        None => relay.status.as_ref().and_then(|s| s.fallback.clone()),
    };
    (last_slot, fallback)
}

/// Reads everything a parsed relay's decision needs. Writes nothing.
pub(super) async fn observe(
    relay: &OutboxRelay,
    valid: &ValidRelay,
    desired: &Desired,
    fallback: Option<crate::api::FallbackStatus>,
    ctx: &Context,
) -> Result<Observed, Error> {
    let started = std::time::Instant::now();
    let cluster = match &relay.spec.database.database_ref {
        Some(reference) => Some(referenced::cluster(relay, reference, ctx).await?),
        None => None,
    };
    let strimzi = match relay
        .spec
        .broker
        .kafka
        .as_ref()
        .and_then(|k| k.kafka_ref.as_ref())
    {
        Some(reference) => Some(referenced::strimzi(relay, reference, ctx).await?),
        None => None,
    };
    let (secrets, conn) = secrets(valid, ctx).await?;
    // Kept for the status figures while the Secrets hold a usable connection; a
    // rotated password reaches them with the next reconcile (a recheck at the latest).
    if let Some(uid) = relay.uid() {
        let mut known = ctx
            .connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &conn {
            Some(conn) if secrets.problems.is_empty() && secrets.database.status => {
                known.insert(uid, (relay.metadata.generation, conn.clone()));
            }
            _ => {
                known.remove(&uid);
            }
        }
    }
    let secrets_ms = started.elapsed().as_millis();
    let location = conn.as_ref().map(|c| connection::database_key(&c.url));
    let connection = conn.filter(|_| secrets.problems.is_empty());
    let database = match &connection {
        Some(conn) => database::observe(relay, valid, conn, fallback.is_some(), ctx).await,
        None => DatabaseSeen::NotLooked,
    };
    let database_ms = started.elapsed().as_millis() - secrets_ms;
    let claim = claim(relay, valid, &database, ctx).await?;
    let children = children(relay, desired, ctx).await?;
    let monitoring = monitoring_available(ctx).await?;
    tracing::debug!(
        secrets_ms,
        database_ms,
        total_ms = started.elapsed().as_millis(),
        "observed"
    );
    Ok(Observed {
        secrets,
        database,
        claim,
        children,
        monitoring,
        fallback,
        now: k8s_openapi::jiff::Timestamp::now(),
        recreate_lost_slot: relay
            .annotations()
            .get(crate::api::RECREATE_LOST_SLOT_ANNOTATION)
            .cloned(),
        cluster,
        strimzi,
        location,
        left_behind_dropped: relay
            .annotations()
            .get(crate::api::LEFT_BEHIND_SLOT_DROPPED_ANNOTATION)
            .cloned(),
        connection,
    })
}

/// Whose the slot is: when the publication's marker names another OutboxRelay for the
/// same slot, whether that relay still exists.
async fn claim(
    relay: &OutboxRelay,
    valid: &ValidRelay,
    database: &DatabaseSeen,
    ctx: &Context,
) -> Result<Claim, Error> {
    let (DatabaseSeen::Seen(facts), Some(lt)) = (database, valid.mode.log_tailing()) else {
        return Ok(Claim::Free);
    };
    let ours =
        |m: &Marker| m.owner.namespace == valid.namespace && m.owner.name == relay.name_any();
    // The publication's marker for this slot, else another publication's marker naming
    // the slot (same slotName, another publicationName): either way another relay's.
    let on_publication = facts
        .publication
        .as_ref()
        .and_then(|p| p.comment.as_deref())
        .and_then(Marker::from_comment)
        .filter(|m| m.slot == lt.slot && !ours(m));
    let (marker, other_publication) = match on_publication {
        Some(marker) => (marker, false),
        None => match facts.other_markers.iter().find(|m| !ours(m)) {
            Some(marker) => (marker.clone(), true),
            None => return Ok(Claim::Free),
        },
    };
    let other = format!("{}/{}", marker.owner.namespace, marker.owner.name);
    let api: Api<OutboxRelay> = Api::namespaced(ctx.client.clone(), &marker.owner.namespace);
    match api.get_opt(&marker.owner.name).await {
        Ok(Some(found)) if found.metadata.deletion_timestamp.is_none() => {
            Ok(Claim::Held(if other_publication {
                format!("OutboxRelay {other} (through its own publication), which exists")
            } else {
                format!("OutboxRelay {other}, which exists")
            }))
        }
        // Gone: with its own publication there is no marker here to take over, and the
        // slot is adopted as any slot that exists.
        Ok(_) if other_publication => Ok(Claim::Free),
        Ok(_) if valid.may_take_over(&marker.owner.namespace) => Ok(Claim::Released),
        // A relay of another namespace whose default slot name is this one's too: its
        // slot and position are not this relay's to take.
        Ok(_) => Ok(Claim::Held(format!(
            "OutboxRelay {other}, of another namespace, whose default slot name is this relay's too (it is gone, but its slot and position are not this relay's; to take them over, name the slot in spec.mode.logTailing.slotName)"
        ))),
        // Not allowed to look (a namespace the operator does not watch): assume it
        // lives, the safe side for a slot.
        Err(kube::Error::Api(status)) if status.code == 403 => Ok(Claim::Held(format!(
            "OutboxRelay {other}, which the operator may not read (so it is taken to exist)"
        ))),
        Err(err) => Err(err.into()),
    }
}

/// Reads every Secret key the pods need: a missing Secret is a condition (it may be
/// created any moment, e.g. by a GitOps tool in another order); a Secret without the
/// key, or with a value the relay could not use, is a spec problem. Returns the
/// database URL when it could be read. Only names and keys are reported, never values.
async fn secrets(
    valid: &ValidRelay,
    ctx: &Context,
) -> Result<(SecretsSeen, Option<connection::Conn>), Error> {
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &valid.namespace);
    let mut seen = SecretsSeen {
        database: Cond::yes(
            CONDITION_DATABASE_READY,
            "SecretFound",
            format!(
                "Secret {} has key {}; the database is checked once the broker Secrets exist too",
                valid.connection.name, valid.connection.key
            ),
        ),
        broker: Cond::yes(
            CONDITION_BROKER_READY,
            "SecretsFound",
            "every Secret the broker connection needs exists; the relay checks the connection itself",
        ),
        problems: Vec::new(),
        versions: Vec::new(),
        finalized: Vec::new(),
    };
    let ours = super::protect::finalizer_of(&valid.name);
    let mut url = None;
    let (mut login_user, mut login_password) = (None, None);
    let mut ca_pem = None;
    let mut client_cert = None;
    let mut client_key = None;
    for slot in valid.secrets() {
        let reference = &slot.reference;
        let found = api.get_opt(&reference.name).await?;
        if let Some(secret) = &found {
            if let Some(bytes) = secret_value(secret, &reference.key) {
                let entry = (
                    format!("{}/{}", reference.name, reference.key),
                    value_digest(secret.metadata.uid.as_deref().unwrap_or_default(), &bytes),
                );
                if !seen.versions.contains(&entry) {
                    seen.versions.push(entry);
                }
            }
            if secret.finalizers().contains(&ours) && !seen.finalized.contains(&reference.name) {
                seen.finalized.push(reference.name.clone());
            }
        }
        let Some(secret) = found else {
            let cond = match slot.purpose {
                SecretUse::Database => &mut seen.database,
                SecretUse::Broker => &mut seen.broker,
            };
            // The first missing Secret per condition; creating it reveals the next.
            if cond.status {
                *cond = Cond::no(
                    cond.type_,
                    "SecretNotFound",
                    format!(
                        "Secret {} not found in namespace {}; create it with key {}",
                        reference.name, valid.namespace, reference.key
                    ),
                );
            }
            continue;
        };
        if let Some(problem) = ctx.policy.secret_problem(
            slot.field,
            &reference.name,
            &valid.namespace,
            secret.labels(),
        ) {
            if !seen.problems.contains(&problem) {
                seen.problems.push(problem);
            }
            continue;
        }
        let value =
            secret_value(&secret, &reference.key).map(|b| String::from_utf8_lossy(&b).into_owned());
        let checked = match value {
            None => Err(format!(
                "Secret {} has no key {}",
                reference.name, reference.key
            )),
            Some(value) => slot.check_value(&value).map(|()| value),
        };
        match checked {
            Ok(value) => match slot.field {
                _ if slot.content == Content::PostgresUrl => url = Some(value.trim().to_owned()),
                _ if slot.content == Content::PostgresUser => login_user = Some(value),
                _ if slot.content == Content::PostgresPassword => login_password = Some(value),
                PG_CA_FIELD => ca_pem = Some(value),
                PG_CLIENT_CERT_FIELD => client_cert = Some(value),
                PG_CLIENT_KEY_FIELD => client_key = Some(value),
                _ => {}
            },
            Err(message) => seen.problems.push(match valid.referenced_field(slot.field) {
                // Filled in from a cluster reference: the Secret is the other
                // operator's, and the reference is what the user can change.
                Some(field) => Problem {
                    field: field.to_owned(),
                    message,
                    fix: format!(
                        "Secret {} is where {field} finds it: check the operator that writes it, or name the Secret that holds it in {field}",
                        reference.name
                    ),
                },
                None => Problem {
                    field: slot.field.to_owned(),
                    message,
                    fix: format!(
                        "put the value under key {} of Secret {}, or point {}.key at the key that holds it",
                        reference.key, reference.name, slot.field
                    ),
                },
            }),
        }
    }
    seen.versions.sort();
    if let Some(login) = &valid.login {
        url = login_user
            .zip(login_password)
            .map(|(user, password)| login.url(&user, &password));
    }
    let conn = url.map(|url| connection::Conn {
        url,
        tls: PgTls {
            mode: valid.ssl_mode,
            ca_pem,
            client: client_cert
                .zip(client_key)
                .map(|(cert_pem, key_pem)| ClientPem { cert_pem, key_pem }),
        },
    });
    Ok((seen, conn))
}

/// The bytes under `key` of a Secret (`data`, or `stringData` of an object not yet
/// normalised by the API server).
fn secret_value(secret: &Secret, key: &str) -> Option<Vec<u8>> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|v| v.clone().into_bytes())
        })
}

/// A digest of a Secret value, salted with the Secret's uid so the digest of a common
/// value (a short password) cannot be looked up in a precomputed table. Only a
/// truncation of a hash over all of a relay's digests reaches the pod template.
fn value_digest(salt: &str, value: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(salt.as_bytes());
    hasher.update([0]);
    hasher.update(value);
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The Deployment (with its status), the ConfigMap and the Service.
async fn children(
    relay: &OutboxRelay,
    desired: &Desired,
    ctx: &Context,
) -> Result<ChildrenSeen, Error> {
    let namespace = relay.namespace().unwrap_or_default();
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);
    let config_maps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &namespace);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
    let names = (
        desired.deployment.name_any(),
        desired.config_map.name_any(),
        desired.service.name_any(),
    );
    let (deployment, config_map, service) = futures::try_join!(
        deployments.get_opt(&names.0),
        config_maps.get_opt(&names.1),
        services.get_opt(&names.2),
    )?;
    let deployment = deployment.filter(|d| d.metadata.deletion_timestamp.is_none());
    let rolled_out = deployment
        .as_ref()
        .is_none_or(|d| rolled_out(d, &desired.deployment));
    let settled = deployment.as_ref().is_some_and(settled);
    let runs_polling = deployment.as_ref().is_some_and(|d| {
        match d
            .annotations()
            .get(crate::resources::MODE_ANNOTATION)
            .map(String::as_str)
        {
            Some(mode) => mode == crate::resources::MODE_POLLING,
            None => d
                .spec
                .as_ref()
                .and_then(|s| s.strategy.as_ref())
                .and_then(|s| s.type_.as_deref())
                .is_some_and(|t| t != "Recreate"),
        }
    });
    let pod_trouble = match deployment.as_ref() {
        Some(d) if short_of_pods(d) => match super::pods::refused(d) {
            Some(refused) => Some(refused),
            None => pod_trouble(relay, ctx).await,
        },
        _ => None,
    };
    Ok(ChildrenSeen {
        rolled_out,
        runs_polling,
        settled,
        deployment,
        config_map,
        service,
        pod_trouble,
    })
}

/// The pods a Deployment asks for (the API's default for an unset count is 1).
fn wanted_replicas(deployment: &Deployment) -> i32 {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .unwrap_or(1)
}

/// Whether `deployment` has fewer available pods than it wants.
fn short_of_pods(deployment: &Deployment) -> bool {
    let want = wanted_replicas(deployment);
    let available = deployment
        .status
        .as_ref()
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    available < want
}

/// An image that cannot be pulled: which of the pod's pull Secrets the namespace lacks
/// (the usual cause with a private registry: the Secret exists where the operator runs,
/// not where the relay does).
async fn with_missing_pull_secrets(
    trouble: super::pods::PodTrouble,
    relay: &OutboxRelay,
    ctx: &Context,
) -> super::pods::PodTrouble {
    let super::pods::PodTrouble::ImagePull {
        pod,
        image,
        pull_secrets,
        ..
    } = trouble
    else {
        return trouble;
    };
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &relay.namespace().unwrap_or_default());
    let mut missing = Vec::new();
    for name in &pull_secrets {
        if let Ok(None) = secrets.get_metadata_opt(name).await {
            missing.push(name.clone());
        }
    }
    super::pods::PodTrouble::ImagePull {
        pod,
        image,
        pull_secrets,
        missing,
    }
}

/// The relay pods' trouble, if any (see [`super::pods`]). Only a diagnosis: a failed
/// read is logged and the relay reconciled without it.
async fn pod_trouble(relay: &OutboxRelay, ctx: &Context) -> Option<super::pods::PodTrouble> {
    let selector = crate::resources::pod_selector(relay);
    let pods: Api<Pod> =
        Api::namespaced(ctx.client.clone(), &relay.namespace().unwrap_or_default());
    match pods.list(&ListParams::default().labels(&selector)).await {
        Ok(list) => {
            if let Some(found) =
                super::pods::diagnose(&list.items, k8s_openapi::jiff::Timestamp::now())
            {
                return Some(with_missing_pull_secrets(found, relay, ctx).await);
            }
            // Running but not ready: the relay says why.
            for (pod, ip) in super::pods::running_unready(&list.items) {
                if let Some(why) =
                    super::readyz::why_not_ready(&ip, crate::spec::config::HTTP_PORT).await
                {
                    return Some(super::pods::PodTrouble::NotReady { pod, why });
                }
            }
            None
        }
        Err(err) => {
            tracing::warn!(
                relay = %relay.name_any(),
                namespace = %relay.namespace().unwrap_or_default(),
                error = %err,
                "cannot read the relay's pods to tell why they are unavailable"
            );
            None
        }
    }
}

/// Whether `seen` runs `desired`'s config hash in every pod: the same template hash,
/// and the rollout [`settled`].
fn rolled_out(seen: &Deployment, desired: &Deployment) -> bool {
    let hash = |d: &Deployment| {
        d.spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get(crate::resources::CONFIG_HASH_ANNOTATION).cloned())
    };
    hash(seen).is_some() && hash(seen) == hash(desired) && settled(seen)
}

/// Whether `seen`'s rollout is complete: observed, every replica updated and no other
/// replica left.
fn settled(seen: &Deployment) -> bool {
    let Some(status) = seen.status.as_ref() else {
        return false;
    };
    let want = wanted_replicas(seen);
    status.observed_generation >= seen.metadata.generation
        && status.updated_replicas.unwrap_or(0) == want
        && status.replicas.unwrap_or(0) == want
}

/// Whether the Prometheus operator's ServiceMonitor and PrometheusRule kinds are served.
pub(super) async fn monitoring_available(ctx: &Context) -> Result<bool, Error> {
    let cached = *ctx
        .monitoring
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((served, at)) = cached
        && at.elapsed() < MONITORING_LOOKUP_TTL
    {
        return Ok(served);
    }
    let served = match ctx
        .client
        .list_api_group_resources(MONITORING_API_VERSION)
        .await
    {
        Ok(list) => {
            let served: BTreeSet<&str> = list.resources.iter().map(|r| r.name.as_str()).collect();
            served.contains(SERVICE_MONITOR_PLURAL) && served.contains(PROMETHEUS_RULE_PLURAL)
        }
        Err(kube::Error::Api(status)) if status.code == 404 => false,
        Err(err) => return Err(err.into()),
    };
    *ctx.monitoring
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((served, Instant::now()));
    Ok(served)
}
