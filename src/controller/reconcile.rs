//! One reconcile of one OutboxRelay: finalizer, validate and build, check Secrets, apply
//! the children, delete the ones no longer built, write status and Events.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tracing::{info, warn};

use super::database::{self, Cleanup};
use super::status::{
    CONDITION_BROKER_READY, CONDITION_DATABASE_READY, CONDITION_DEGRADED,
    CONDITION_MONITORING_READY, CONDITION_READY, Cond, differs, figures_differ, find, merge,
};
use super::{Context, Error, FINALIZER};
use crate::api::{OutboxRelay, OutboxRelayStatus, SlotStatus};
use crate::postgres::admin::{Backlog, human_age};
use crate::resources::{
    Desired, FIELD_MANAGER, MONITORING_API_VERSION, PROMETHEUS_RULE_KIND, PROMETHEUS_RULE_PLURAL,
    SERVICE_MONITOR_KIND, SERVICE_MONITOR_PLURAL, build, children_selector, relay_object_name,
    selector_labels,
};
use crate::spec::ValidRelay;
use crate::spec::secrets::SecretUse;

/// How soon to look again when a referenced Secret is missing: Secrets are not watched
/// (that would cache every Secret's data in the operator), so this bounds the delay
/// between a user creating the Secret and the relay starting.
const SECRET_RETRY: Duration = Duration::from_secs(15);
/// Back-off after a failed reconcile.
const ERROR_RETRY: Duration = Duration::from_secs(15);
/// How soon the finalizer looks again while the relay's pods are still stopping.
const CLEANUP_POLL: Duration = Duration::from_secs(2);
/// How long the answer to "are the Prometheus Operator's CRDs served?" is reused.
const MONITORING_LOOKUP_TTL: Duration = Duration::from_secs(15);

/// The controller's reconcile function: everything runs inside the finalizer helper.
pub(super) async fn reconcile(relay: Arc<OutboxRelay>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Never write without the Lease: the controller stops when it is lost, and this
    // closes the window between losing it and the stop taking effect.
    if !*ctx.leader.borrow() {
        return Ok(Action::await_change());
    }
    let started = Instant::now();
    let namespace = relay.namespace().unwrap_or_default();
    let api: Api<OutboxRelay> = Api::namespaced(ctx.client.clone(), &namespace);
    let result = finalizer(&api, FINALIZER, relay, |event| async {
        match event {
            Finalizer::Apply(relay) => apply(&relay, &ctx).await,
            Finalizer::Cleanup(relay) => cleanup(&relay, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)));
    ctx.metrics.reconciled(
        started.elapsed(),
        result.as_ref().err().map(Error::category),
    );
    result
}

/// Logs, counts (in `reconcile`) and retries a failed reconcile.
pub(super) fn error_policy(relay: Arc<OutboxRelay>, error: &Error, _ctx: Arc<Context>) -> Action {
    if error.category() == "cleanup_pending" {
        // Not a failure: the finalizer waits for the relay to stop or the database to
        // come back, and looks again soon.
        info!(
            relay = %relay.name_any(),
            namespace = %relay.namespace().unwrap_or_default(),
            reason = %error,
            "cleanup not finished yet; looking again"
        );
        return Action::requeue(CLEANUP_POLL);
    }
    warn!(
        relay = %relay.name_any(),
        namespace = %relay.namespace().unwrap_or_default(),
        category = error.category(),
        error = %error,
        "reconcile failed; retrying"
    );
    Action::requeue(ERROR_RETRY)
}

async fn apply(relay: &OutboxRelay, ctx: &Context) -> Result<Action, Error> {
    // While the database cannot be looked at (Secret missing, database unreachable, spec
    // invalid), status keeps showing the slot as last seen: the finalizer reads it to
    // tell a slot left behind from one never created, and a slot does not vanish
    // because its Secret did or because the spec was edited into something invalid.
    let last_slot = relay.status.as_ref().and_then(|s| s.slot.clone());

    // Parse once: every rule, every problem, before anything is read or created.
    let valid = match crate::spec::parse(relay) {
        Ok(valid) => valid,
        Err(problems) => {
            // A spec the schema let through but that cannot run: say so and change
            // nothing else; the next edit of the spec triggers a new reconcile.
            invalid_spec(relay, ctx, &problems.0, last_slot).await?;
            return Ok(Action::await_change());
        }
    };
    let desired = build(&valid, &ctx.options)?;
    let last_slot = last_slot.filter(|_| valid.mode.log_tailing().is_some());

    let secrets = check_secrets(&valid, ctx).await?;
    if !secrets.problems.is_empty() {
        // A Secret holds a value the relay could not use: as bad as a bad spec, but
        // Secrets are not watched, so look again soon.
        invalid_spec(relay, ctx, &secrets.problems, last_slot).await?;
        return Ok(Action::requeue(SECRET_RETRY));
    }
    let (database, broker) = (secrets.database, secrets.broker);
    let secrets_ok = database.status && broker.status;
    if !secrets_ok {
        // Pods started now would crash-loop on the missing variable or volume; create
        // nothing and delete nothing (a Secret being rotated must not stop a running
        // relay), and look again soon.
        let problem = if database.status { &broker } else { &database };
        let conditions = vec![
            Cond::no(CONDITION_READY, problem.reason, problem.message.clone()),
            Cond::yes(CONDITION_DEGRADED, problem.reason, problem.message.clone()),
            database,
            broker,
        ];
        let figures = Figures {
            backlog: None,
            slot: last_slot,
        };
        update_status(relay, ctx, conditions, figures).await?;
        return Ok(Action::requeue(SECRET_RETRY));
    }

    // The database checks (and, for log tailing, the slot and publication) come before
    // any child: nothing is half-created when they fail. A Deployment that already runs
    // is left as it is — a database that is briefly unreachable must not stop it.
    let inspection = database::inspect(relay, &valid, ctx).await?;
    let database = inspection.database;
    let slot_cond = inspection.slot;
    let figures = Figures {
        backlog: inspection.backlog,
        slot: inspection.slot_status,
    };
    let refresh = ctx.status_interval.min(ctx.resync);
    if !inspection.ready {
        let problem = if database.status {
            slot_cond.as_ref().unwrap_or(&database)
        } else {
            &database
        };
        let mut conditions = vec![
            Cond::no(CONDITION_READY, problem.reason, problem.message.clone()),
            Cond::yes(CONDITION_DEGRADED, problem.reason, problem.message.clone()),
            database.clone(),
            broker,
        ];
        conditions.extend(slot_cond);
        let figures = Figures {
            slot: figures.slot.or(last_slot),
            ..figures
        };
        update_status(relay, ctx, conditions, figures).await?;
        return Ok(Action::requeue(refresh));
    }

    let monitoring = monitoring_available(ctx).await?;
    let deployment = apply_if_changed(relay, ctx, &desired, monitoring).await?;

    let wanted = valid.effective_replicas();
    let available = deployment
        .status
        .as_ref()
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    let ready = if wanted == 0 {
        Cond::no(
            CONDITION_READY,
            "ScaledToZero",
            "spec.replicas is 0: no relay runs and nothing is published",
        )
    } else if available > 0 {
        Cond::yes(
            CONDITION_READY,
            "RelayAvailable",
            format!("{available} of {wanted} relay pods available"),
        )
    } else {
        Cond::no(
            CONDITION_READY,
            "RelayUnavailable",
            format!(
                "0 of {wanted} relay pods available (Deployment {})",
                deployment.name_any()
            ),
        )
    };
    let monitoring_cond = if monitoring {
        let what = if desired.prometheus_rule.is_some() {
            "ServiceMonitor and PrometheusRule applied"
        } else {
            "ServiceMonitor applied; alerting is disabled in spec.alerting"
        };
        Cond::yes(CONDITION_MONITORING_READY, "Applied", what)
    } else {
        Cond::no(
            CONDITION_MONITORING_READY,
            "PrometheusOperatorNotInstalled",
            format!(
                "the {MONITORING_API_VERSION} ServiceMonitor and PrometheusRule CRDs are not installed: no scrape config or alerts were created (`outbox-operator render` prints them)"
            ),
        )
    };
    let mut conditions = vec![
        ready,
        Cond::no(
            CONDITION_DEGRADED,
            "AsExpected",
            "the relay runs as specified",
        ),
        database,
        broker,
        monitoring_cond,
    ];
    conditions.extend(slot_cond);
    update_status(relay, ctx, conditions, figures).await?;
    // Soon again: status tracks the backlog and the slot's lag.
    Ok(Action::requeue(refresh))
}

/// `Ready=False, reason=InvalidSpec` listing every problem; status keeps the slot it
/// showed, and nothing else changes.
async fn invalid_spec(
    relay: &OutboxRelay,
    ctx: &Context,
    problems: &[crate::spec::Problem],
    last_slot: Option<SlotStatus>,
) -> Result<(), Error> {
    let list = problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    let message = format!(
        "{} problem{} in the spec; nothing was created or changed: {list}",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    let conditions = vec![
        Cond::no(CONDITION_READY, "InvalidSpec", message.clone()),
        Cond::yes(CONDITION_DEGRADED, "InvalidSpec", message),
    ];
    let figures = Figures {
        backlog: None,
        slot: last_slot,
    };
    update_status(relay, ctx, conditions, figures).await
}

/// What the referenced Secrets say.
struct SecretCheck {
    /// `DatabaseReady` as far as its Secret goes.
    database: Cond,
    /// `BrokerReady` as far as its Secrets go.
    broker: Cond,
    /// Keys that exist but hold nothing the relay can use, or are missing from a Secret
    /// that exists, as spec problems.
    problems: Vec<crate::spec::Problem>,
}

/// Checks every Secret key the pods need: a missing Secret is a condition (it may be
/// created any moment, e.g. by a GitOps tool in another order); a Secret without the
/// key, or with a value the relay could not use, is a spec problem. Only names and keys
/// are reported, never values.
async fn check_secrets(valid: &ValidRelay, ctx: &Context) -> Result<SecretCheck, Error> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &valid.namespace);
    let mut database = Cond::yes(
        CONDITION_DATABASE_READY,
        "SecretFound",
        format!(
            "Secret {} has key {}; the database is checked once the broker Secrets exist too",
            valid.connection.name, valid.connection.key
        ),
    );
    let mut broker = Cond::yes(
        CONDITION_BROKER_READY,
        "SecretsFound",
        "every Secret the broker connection needs exists; the relay checks the connection itself",
    );
    let mut problems = Vec::new();
    for slot in valid.secrets() {
        let reference = &slot.reference;
        let Some(secret) = secrets.get_opt(&reference.name).await? else {
            let cond = match slot.purpose {
                SecretUse::Database => &mut database,
                SecretUse::Broker => &mut broker,
            };
            // Report the first missing Secret per condition; creating it reveals the next.
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
        let value = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&reference.key))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .or_else(|| {
                secret
                    .string_data
                    .as_ref()
                    .and_then(|d| d.get(&reference.key).cloned())
            });
        let outcome = match value {
            None => Err(format!(
                "Secret {} has no key {}",
                reference.name, reference.key
            )),
            Some(value) => slot.check_value(&value),
        };
        if let Err(message) = outcome {
            problems.push(crate::spec::Problem {
                field: slot.field.to_owned(),
                message,
                fix: format!(
                    "put the value under key {} of Secret {}, or point {}.key at the key that holds it",
                    reference.key, reference.name, slot.field
                ),
            });
        }
    }
    Ok(SecretCheck {
        database,
        broker,
        problems,
    })
}

fn monitoring_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("monitoring.coreos.com", "v1", kind),
        plural,
    )
}

/// Whether the Prometheus operator's ServiceMonitor and PrometheusRule kinds are served.
async fn monitoring_available(ctx: &Context) -> Result<bool, Error> {
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

/// What was last applied for one relay.
pub(super) struct Applied {
    /// Hash of every desired child (and whether monitoring objects were included).
    fingerprint: u64,
    /// The Deployment's `metadata.generation` right after the apply.
    deployment_generation: Option<i64>,
    /// The ConfigMap's and the Service's `resourceVersion` right after the apply.
    config_map_version: Option<String>,
    service_version: Option<String>,
    /// When.
    at: Instant,
    /// The Deployment as the apply returned it.
    deployment: Deployment,
}

/// A hash of the desired children as they would be sent.
fn fingerprint(desired: &Desired, monitoring: bool) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    monitoring.hash(&mut hasher);
    for part in [
        serde_json::to_string(&desired.config_map),
        serde_json::to_string(&desired.deployment),
        serde_json::to_string(&desired.service),
        serde_json::to_string(&desired.pod_disruption_budget),
        serde_json::to_string(&desired.service_monitor),
        serde_json::to_string(&desired.prometheus_rule),
    ] {
        part.unwrap_or_default().hash(&mut hasher);
    }
    hasher.finish()
}

/// Applies every child unless the same children were applied less than `resync` ago
/// and the ConfigMap, Deployment and Service are still as that apply left them; then
/// three reads (the Deployment for its status, the others' metadata) replace four to
/// six applies and six prune lists.
///
/// Relays are reconciled every status interval to refresh their figures; re-applying
/// and re-listing every child each time cost the API server some 600 requests a second
/// with 500 relays. A changed spec, or a ConfigMap, Deployment or Service edited or
/// deleted by someone else, is applied at once; drift in the PodDisruptionBudget,
/// ServiceMonitor or PrometheusRule is repaired within `resync`.
async fn apply_if_changed(
    relay: &OutboxRelay,
    ctx: &Context,
    desired: &Desired,
    monitoring: bool,
) -> Result<Deployment, Error> {
    let uid = relay.uid().ok_or(Error::MissingField("metadata.uid"))?;
    let fingerprint = fingerprint(desired, monitoring);
    let known = ctx
        .applied
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&uid)
        .filter(|a| a.fingerprint == fingerprint && a.at.elapsed() < ctx.resync)
        .map(|a| {
            (
                a.deployment_generation,
                a.config_map_version.clone(),
                a.service_version.clone(),
            )
        });
    if let Some((generation, config_map_version, service_version)) = known {
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
            config_maps.get_metadata_opt(&names.1),
            services.get_metadata_opt(&names.2),
        )?;
        let as_left = config_map.is_some_and(|c| c.metadata.resource_version == config_map_version)
            && service.is_some_and(|s| s.metadata.resource_version == service_version);
        if as_left
            && let Some(current) = deployment
            && current.metadata.generation == generation
            && current.metadata.deletion_timestamp.is_none()
        {
            return Ok(current);
        }
    }
    let applied = apply_children(relay, ctx, desired, monitoring, fingerprint).await?;
    let deployment = applied.deployment.clone();
    ctx.applied
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(uid, applied);
    Ok(deployment)
}

/// Applies every desired child (whose hash is `fingerprint`), deletes the children no
/// longer built, and returns the Deployment as the API server has it (with its status)
/// and the versions it left.
async fn apply_children(
    relay: &OutboxRelay,
    ctx: &Context,
    desired: &Desired,
    monitoring: bool,
    fingerprint: u64,
) -> Result<Applied, Error> {
    let client = &ctx.client;
    let namespace = relay.namespace().unwrap_or_default();
    let uid = relay.uid().ok_or(Error::MissingField("metadata.uid"))?;
    let selector = children_selector(relay);

    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &namespace);
    let services: Api<Service> = Api::namespaced(client.clone(), &namespace);
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &namespace);

    // The ConfigMap first: pods of the new Deployment mount it.
    let config_map = ssa(&config_maps, &desired.config_map, ctx).await?;
    let deployment = ssa(&deployments, &desired.deployment, ctx).await?;
    let service = ssa(&services, &desired.service, ctx).await?;
    if let Some(pdb) = &desired.pod_disruption_budget {
        ssa(&budgets, pdb, ctx).await?;
    }

    let keep = |o: Option<&kube::core::ObjectMeta>| -> Vec<String> {
        o.and_then(|m| m.name.clone()).into_iter().collect()
    };
    prune(
        &config_maps,
        &selector,
        &uid,
        &keep(Some(&desired.config_map.metadata)),
        ctx,
    )
    .await?;
    prune(
        &deployments,
        &selector,
        &uid,
        &keep(Some(&desired.deployment.metadata)),
        ctx,
    )
    .await?;
    prune(
        &services,
        &selector,
        &uid,
        &keep(Some(&desired.service.metadata)),
        ctx,
    )
    .await?;
    prune(
        &budgets,
        &selector,
        &uid,
        &keep(desired.pod_disruption_budget.as_ref().map(|p| &p.metadata)),
        ctx,
    )
    .await?;

    if monitoring {
        let monitors: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            &namespace,
            &monitoring_resource(SERVICE_MONITOR_KIND, SERVICE_MONITOR_PLURAL),
        );
        let rules: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            &namespace,
            &monitoring_resource(PROMETHEUS_RULE_KIND, PROMETHEUS_RULE_PLURAL),
        );
        ssa(&monitors, &desired.service_monitor, ctx).await?;
        if let Some(rule) = &desired.prometheus_rule {
            ssa(&rules, rule, ctx).await?;
        }
        prune(
            &monitors,
            &selector,
            &uid,
            &keep(Some(&desired.service_monitor.metadata)),
            ctx,
        )
        .await?;
        prune(
            &rules,
            &selector,
            &uid,
            &keep(desired.prometheus_rule.as_ref().map(|r| &r.metadata)),
            ctx,
        )
        .await?;
    }
    Ok(Applied {
        fingerprint,
        deployment_generation: deployment.metadata.generation,
        config_map_version: config_map.metadata.resource_version,
        service_version: service.metadata.resource_version,
        at: Instant::now(),
        deployment,
    })
}

/// Server-side apply under the operator's one field manager. Forced: the operator owns
/// these objects, and a conflicting manual edit is drift to repair.
async fn ssa<K>(api: &Api<K>, object: &K, ctx: &Context) -> Result<K, Error>
where
    K: Resource + Serialize + DeserializeOwned + Clone + Debug,
{
    let name = object
        .meta()
        .name
        .clone()
        .ok_or(Error::MissingField("metadata.name"))?;
    ctx.metrics.wrote();
    Ok(api
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(object),
        )
        .await?)
}

/// Deletes this relay's children of one kind that are not in `keep`. Children are found
/// by label and confirmed by the controller owner reference, so objects someone else
/// labelled alike are never touched.
async fn prune<K>(
    api: &Api<K>,
    selector: &str,
    owner_uid: &str,
    keep: &[String],
    ctx: &Context,
) -> Result<(), Error>
where
    K: Resource + DeserializeOwned + Clone + Debug,
{
    let list = api
        .list_metadata(&ListParams::default().labels(selector))
        .await?;
    for object in list.items {
        let name = object.metadata.name.clone().unwrap_or_default();
        let owned = object
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.uid == owner_uid && o.controller == Some(true));
        if owned && !keep.contains(&name) {
            info!(child = %name, "deleting a child the relay no longer needs");
            ctx.metrics.wrote();
            match api.delete(&name, &DeleteParams::background()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(err) => return Err(err.into()),
            }
        }
    }
    Ok(())
}

/// What the controller measured in the database for status.
#[derive(Debug, Default)]
pub(super) struct Figures {
    /// Backlog rows and oldest age.
    pub backlog: Option<Backlog>,
    /// The slot (log tailing).
    pub slot: Option<SlotStatus>,
}

/// Writes status when conditions changed (ignoring timestamps), or when only the
/// measured figures changed and they were last written at least half a status interval
/// ago (they move constantly while rows flow, and every write wakes the watch), and
/// records an Event when the `Ready` condition changed its status or reason.
async fn update_status(
    relay: &OutboxRelay,
    ctx: &Context,
    conditions: Vec<Cond>,
    figures: Figures,
) -> Result<(), Error> {
    let current = relay.status.as_ref();
    let generation = relay.metadata.generation;
    let merged = merge(
        current.map_or(&[][..], |s| &s.conditions[..]),
        &conditions,
        generation,
        Timestamp::now(),
    );
    // No waiting row: age 0. Rows waiting without a created-at column: unknown (left
    // out). Tenths of a second: finer figures would only make writes.
    let age = figures.backlog.and_then(|b| {
        if b.rows == 0 {
            Some(0.0)
        } else {
            b.oldest_age_seconds.map(|a| (a * 10.0).round() / 10.0)
        }
    });
    let desired = OutboxRelayStatus {
        observed_generation: generation,
        conditions: merged,
        mode: relay.spec.mode.get().map(|m| m.name().to_owned()),
        broker: relay.spec.broker.get().map(|b| b.name().to_owned()),
        backlog_rows: figures.backlog.map(|b| b.rows),
        oldest_unpublished_age_seconds: age,
        oldest_unpublished_age: age.map(human_age),
        slot: figures.slot,
        partitions: None,
    };
    let event = ready_transition(current, &conditions);
    let uid = relay.uid().unwrap_or_default();
    let figures_due = figures_differ(current, &desired) && {
        let written = ctx
            .figures_written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        written
            .get(&uid)
            .is_none_or(|at| at.elapsed() >= ctx.status_interval / 2)
    };
    if differs(current, &desired) || figures_due {
        let namespace = relay.namespace().unwrap_or_default();
        let api: Api<OutboxRelay> = Api::namespaced(ctx.client.clone(), &namespace);
        // Every status field is the controller's; absent figures are left out, so
        // server-side apply removes what they said before.
        let patch = json!({
            "apiVersion": OutboxRelay::api_version(&()),
            "kind": OutboxRelay::kind(&()),
            "status": desired,
        });
        ctx.metrics.wrote();
        api.patch_status(
            &relay.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
        ctx.figures_written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(uid, Instant::now());
    }
    if let Some((type_, reason, note)) = event {
        publish(relay, ctx, type_, reason, note).await;
    }
    Ok(())
}

/// An Event for a change of the `Ready` condition's status or reason.
fn ready_transition(
    current: Option<&OutboxRelayStatus>,
    conditions: &[Cond],
) -> Option<(EventType, &'static str, String)> {
    let new = conditions.iter().find(|c| c.type_ == CONDITION_READY)?;
    let status = if new.status { "True" } else { "False" };
    let unchanged = find(current, CONDITION_READY)
        .is_some_and(|old| old.status == status && old.reason == new.reason);
    if unchanged {
        return None;
    }
    let type_ = if new.status || new.reason == "RelayUnavailable" || new.reason == "ScaledToZero" {
        EventType::Normal
    } else {
        EventType::Warning
    };
    Some((type_, new.reason, new.message.clone()))
}

/// Publishes an Event; a failure is logged, not fatal (Events are advisory).
pub(super) async fn publish(
    relay: &OutboxRelay,
    ctx: &Context,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    ctx.metrics.wrote();
    if let Err(err) = ctx.recorder().publish(&event, &relay.object_ref(&())).await {
        warn!(relay = %relay.name_any(), error = %err, "could not record an Event");
    }
}

/// Cleanup before the OutboxRelay goes. Children need nothing (garbage collection
/// removes them through their owner references). For log tailing the relay is stopped
/// first (its Deployment deleted, then waiting until its pods are gone), so that no
/// walsender streams the slot, and then the slot and publication the operator created
/// are dropped. Tolerates apply never having run; never blocks on an invalid spec.
async fn cleanup(relay: &OutboxRelay, ctx: &Context) -> Result<Action, Error> {
    if let Some(target) = database::cleanup_target(relay) {
        stop_relay(relay, ctx).await?;
        match database::drop_external(relay, &target, ctx).await? {
            Cleanup::Done(type_, reason, note) => {
                info!(relay = %relay.name_any(), reason, note = %note, "cleanup in PostgreSQL done");
                publish(relay, ctx, type_, reason, note).await;
            }
            Cleanup::Retry(message) => {
                publish(
                    relay,
                    ctx,
                    EventType::Warning,
                    "CleanupRetrying",
                    message.clone(),
                )
                .await;
                return Err(Error::CleanupBlocked(message));
            }
        }
    }
    // Forget the relay's bookkeeping.
    if let Some(uid) = relay.uid() {
        ctx.figures_written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
        ctx.applied
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
    }
    publish(
        relay,
        ctx,
        EventType::Normal,
        "Deleting",
        "finalizer done; child objects are garbage-collected".to_owned(),
    )
    .await;
    Ok(Action::await_change())
}

/// Deletes the relay's Deployment and returns `CleanupPending` until none of its pods is
/// left: only then can no walsender take the slot again.
async fn stop_relay(relay: &OutboxRelay, ctx: &Context) -> Result<(), Error> {
    let namespace = relay.namespace().unwrap_or_default();
    let uid = relay.uid().unwrap_or_default();
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);
    let name = relay_object_name(relay);
    if let Some(deployment) = deployments.get_opt(&name).await? {
        let owned = deployment
            .owner_references()
            .iter()
            .any(|o| o.uid == uid && o.controller == Some(true));
        if owned && deployment.metadata.deletion_timestamp.is_none() {
            info!(relay = %relay.name_any(), deployment = %name, "stopping the relay before dropping its slot");
            ctx.metrics.wrote();
            match deployments.delete(&name, &DeleteParams::background()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(err) => return Err(err.into()),
            }
        }
    }
    let selector = selector_labels(relay)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let left = pods
        .list_metadata(&ListParams::default().labels(&selector))
        .await?
        .items
        .len();
    if left > 0 {
        return Err(Error::CleanupPending(format!(
            "waiting for {left} relay pod(s) to stop before dropping the replication slot"
        )));
    }
    Ok(())
}
