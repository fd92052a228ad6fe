//! Writing the status a decision made, and its `Ready` Event.

use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

use crate::api::{OutboxRelay, OutboxRelayStatus, SlotStatus};
use crate::controller::decide;
use crate::controller::status::{differs, merge};
use crate::controller::{Context, Error};
use crate::resources::FIELD_MANAGER;

/// Writes the fields of status a reconcile decides — observed generation, conditions,
/// mode, broker and the slot's and publication's names — when one of them changed
/// (ignoring timestamps), and records an Event when the `Ready` condition changed its
/// status or reason. The measured figures (backlog, oldest age, slot lag) are the
/// figures task's, under a field manager of its own (`figures.rs`); this apply never
/// names them, so server-side apply leaves them alone.
pub(super) async fn update_status(
    relay: &OutboxRelay,
    ctx: &Context,
    plan: &decide::Effects,
) -> Result<(), Error> {
    let (conditions, slot, fallback) = (&plan.conditions, plan.slot.clone(), plan.fallback.clone());
    // The cache may not hold this controller's last status write yet (a pass triggered
    // by a child right after it): what it wrote last is what the API server holds,
    // unless someone changed it since, which the cache then shows. So both are compared.
    let uid = relay.uid().unwrap_or_default();
    let last = ctx
        .written_status
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&uid)
        .cloned();
    let cached = relay.status.as_ref();
    let current = last.as_ref().or(cached);
    let generation = relay.metadata.generation;
    let merged = merge(
        current.map_or(&[][..], |s| &s.conditions[..]),
        conditions,
        generation,
        Timestamp::now(),
    );
    let desired = OutboxRelayStatus {
        observed_generation: generation,
        conditions: merged,
        mode: relay.spec.mode.get().map(|m| m.name().to_owned()),
        broker: relay.spec.broker.get().map(|b| b.name().to_owned()),
        slot: slot.map(|s| SlotStatus {
            name: s.name,
            publication: s.publication,
            protected_secrets: s.protected_secrets,
            handover_snapshot: s.handover_snapshot,
            existed: s.existed,
            lost: s.lost,
            coverage_baseline: s.coverage_baseline,
            location: s.location,
            left_behind: s.left_behind,
            ..SlotStatus::default()
        }),
        fallback,
        replicas: plan.scale.as_ref().map(|(replicas, _)| *replicas),
        selector: plan.scale.as_ref().map(|(_, selector)| selector.clone()),
        ..OutboxRelayStatus::default()
    };
    let event = decide::ready_transition(current, conditions);
    let slot_names = |s: Option<&OutboxRelayStatus>| {
        s.and_then(|s| s.slot.as_ref()).map(|s| {
            (
                s.name.clone(),
                s.publication.clone(),
                s.protected_secrets.clone(),
                s.handover_snapshot.clone(),
                s.existed,
                s.lost.clone(),
                s.coverage_baseline.clone(),
                s.location.clone(),
                s.left_behind.clone(),
            )
        })
    };
    let stale = |s: Option<&OutboxRelayStatus>| {
        differs(s, &desired)
            || slot_names(s) != slot_names(Some(&desired))
            || s.and_then(|s| s.fallback.as_ref()) != desired.fallback.as_ref()
            || s.map(|s| (s.replicas, s.selector.as_ref()))
                != Some((desired.replicas, desired.selector.as_ref()))
    };
    if stale(current) || stale(cached) {
        let namespace = relay.namespace().unwrap_or_default();
        let api: Api<OutboxRelay> = Api::namespaced(ctx.client.clone(), &namespace);
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
        ctx.written_status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(uid, desired);
    }
    if let Some(note) = event {
        super::publish(relay, ctx, &[note]).await;
    }
    Ok(())
}
