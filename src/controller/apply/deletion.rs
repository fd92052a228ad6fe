//! The finalizer's effects: it looks at what `decide::deletion` asks for, stops the
//! relay, hands the slot over or drops it, records the Events and lets the relay go.
//! Every choice, and every Event's wording, is `decide::deletion`'s.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use tokio_postgres::Client;
use tracing::info;

use crate::api::OutboxRelay;
use crate::controller::connection::{self, Conn, database_key, read_connection};
use crate::controller::decide::deletion::{self, Look, Reach, Running, Step, Unreachable};
use crate::controller::{Context, Error, database, protect};
use crate::postgres::PgError;
use crate::postgres::admin::{self, Owner, Plan, SlotPlan};
use crate::resources::relay_object_name;

/// Steps one pass of the finalizer takes at most: every look and every effect is one,
/// and there are fewer than this many of them.
const MAX_STEPS: usize = 16;

/// Cleanup before the OutboxRelay goes: children need nothing (garbage collection
/// removes them through their owner references); the slot is looked after as
/// `decide::deletion` says, step by step. Tolerates apply never having run.
pub(in crate::controller) async fn cleanup(
    relay: &OutboxRelay,
    ctx: &Context,
) -> Result<Action, Error> {
    let mut seen = deletion::seen(relay, protect::database_secrets(relay));
    let mut session: Option<(Conn, Client)> = None;
    for _ in 0..MAX_STEPS {
        let target = seen.target.clone().unwrap_or_else(|| SlotPlan {
            slot: String::new(),
            publication: String::new(),
            delete_after_publish: false,
        });
        match deletion::next(&seen) {
            Step::Look(Look::Running) => seen.running = Some(running(relay, ctx).await?),
            Step::Look(Look::Cluster) => {
                seen.cluster_gone = Some(match &relay.spec.database.database_ref {
                    Some(reference) => connection::cluster_gone(relay, reference, ctx).await?,
                    None => false,
                });
            }
            Step::Look(Look::Reach) => {
                let (reach, reached) = reach(relay, ctx).await?;
                seen.reach = Some(reach);
                session = reached;
            }
            Step::Look(Look::Successor) => {
                seen.successor = Some(match &session {
                    Some((conn, _)) => successor(relay, &target, conn, ctx).await?,
                    None => None,
                });
            }
            Step::StopRelay => {
                stop_relay(relay, ctx).await?;
                seen.running = None;
            }
            Step::Wait(message) => return Err(Error::CleanupPending(message)),
            Step::HandOver(next) => {
                seen.handed_over = Some(match &session {
                    Some((_, client)) => admin::hand_over(
                        client,
                        &target.slot,
                        &target.publication,
                        &database::owner(relay),
                        &next,
                    )
                    .await
                    .map_err(|e| e.to_string()),
                    None => Err("not connected".to_owned()),
                });
            }
            Step::Drop => {
                seen.dropped = Some(match &session {
                    Some((_, client)) => admin::drop_owned(
                        client,
                        &target.slot,
                        &target.publication,
                        &database::owner(relay),
                    )
                    .await
                    .map_err(|e| e.to_string()),
                    None => Err("not connected".to_owned()),
                });
            }
            Step::Retry(message) => {
                ctx.publish(
                    relay,
                    EventType::Warning,
                    "CleanupRetrying",
                    message.clone(),
                )
                .await;
                return Err(Error::CleanupBlocked(message));
            }
            Step::Done(note, secrets) => {
                if let Some(note) = note {
                    info!(relay = %relay.name_any(), reason = note.reason, note = %note.message, "cleanup in PostgreSQL done");
                    super::publish(relay, ctx, &[note]).await;
                }
                protect::release(relay, &secrets, ctx).await?;
                forget(relay, ctx);
                ctx.publish(
                    relay,
                    EventType::Normal,
                    "Deleting",
                    "finalizer done; child objects are garbage-collected".to_owned(),
                )
                .await;
                return Ok(Action::await_change());
            }
        }
    }
    Err(Error::CleanupPending(
        "the finalizer has not finished within one pass; looking again".to_owned(),
    ))
}

/// Forgets the relay's bookkeeping: its metric, last apply, status write and
/// connection.
fn forget(relay: &OutboxRelay, ctx: &Context) {
    let namespace = relay.namespace().unwrap_or_default();
    ctx.metrics
        .set_slot_lost(&namespace, &relay.name_any(), None);
    ctx.metrics
        .set_slot_retained_wal(&namespace, &relay.name_any(), None);
    if let Some(uid) = relay.uid() {
        ctx.applied
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
        ctx.written_status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
        ctx.connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
    }
}

/// The relay's Deployment (whether it is the relay's own and not being deleted yet) and
/// how many of its pods are left.
async fn running(relay: &OutboxRelay, ctx: &Context) -> Result<Running, Error> {
    let namespace = relay.namespace().unwrap_or_default();
    let uid = relay.uid().unwrap_or_default();
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);
    let deployment = deployments
        .get_opt(&relay_object_name(relay))
        .await?
        .is_some_and(|d| {
            d.metadata.deletion_timestamp.is_none()
                && d.owner_references()
                    .iter()
                    .any(|o| o.uid == uid && o.controller == Some(true))
        });
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let selector = crate::resources::pod_selector(relay);
    let pods = pods
        .list_metadata(&ListParams::default().labels(&selector))
        .await?
        .items
        .len();
    Ok(Running { deployment, pods })
}

/// Deletes the relay's Deployment: once none of its pods is left, no walsender can take
/// the slot again.
async fn stop_relay(relay: &OutboxRelay, ctx: &Context) -> Result<(), Error> {
    let namespace = relay.namespace().unwrap_or_default();
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);
    let name = relay_object_name(relay);
    info!(relay = %relay.name_any(), deployment = %name, "stopping the relay before dropping its slot");
    ctx.metrics.wrote();
    match deployments.delete(&name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// Reads the connection from the Secrets as they are now and connects with it.
async fn reach(
    relay: &OutboxRelay,
    ctx: &Context,
) -> Result<(Reach, Option<(Conn, Client)>), Error> {
    let Some(conn) = read_connection(relay, ctx).await? else {
        return Ok((Reach::SecretMissing, None));
    };
    let here = database_key(&conn.url);
    Ok(match connection::connect(relay, &conn).await {
        Ok(client) => (
            Reach::Read {
                here,
                connected: Ok(()),
            },
            Some((conn, client)),
        ),
        Err(err) => {
            let why = if admin::database_is_gone(&err) {
                Unreachable::Gone(err.to_string())
            } else if matches!(err, PgError::Url { .. }) {
                Unreachable::BadUrl(err.to_string())
            } else {
                Unreachable::Failed(err.to_string())
            };
            (
                Reach::Read {
                    here,
                    connected: Err(why),
                },
                None,
            )
        }
    })
}

/// The relay that takes this one's slot over: not being deleted, its spec names the
/// same slot and publication, and its Secret the same database (`host:port/database`).
/// That is a rename keeping `slotName`, applied before or after the old name was
/// deleted: decided from the specs alone, so it does not matter whether the new relay
/// has been reconciled yet.
async fn successor(
    relay: &OutboxRelay,
    lt: &SlotPlan,
    conn: &Conn,
    ctx: &Context,
) -> Result<Option<Owner>, kube::Error> {
    let api: Api<OutboxRelay> = match &ctx.watch_namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let database = database_key(&conn.url);
    for candidate in api.list(&ListParams::default()).await?.items {
        let namespace = relay.namespace().unwrap_or_default();
        let same_slot = candidate.uid() != relay.uid()
            && candidate.metadata.deletion_timestamp.is_none()
            && crate::spec::parse(&candidate)
                .ok()
                .filter(|v| v.may_take_over(&namespace))
                .and_then(|v| Plan::for_relay(&v).log_tailing)
                .is_some_and(|p| p.slot == lt.slot && p.publication == lt.publication);
        if !same_slot {
            continue;
        }
        if let Some(theirs) = read_connection(&candidate, ctx).await?
            && database_key(&theirs.url) == database
        {
            return Ok(Some(database::owner(&candidate)));
        }
    }
    Ok(None)
}
