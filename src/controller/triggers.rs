//! What makes a relay reconcile, and how often an unchanged one is looked at again.
//!
//! Reconciles cost API requests and database queries, and the API server's CPU is what
//! bounds how fast many relays are reconciled. So a reconcile runs when something it
//! acts on changed, not on the echoes of its own writes:
//! - an OutboxRelay's spec (its generation), labels, annotations or deletion — not its
//!   status (the controller and the figures task write it) nor its finalizers (the
//!   controller adds its own in the same pass that applies the children);
//! - a child changed or deleted by someone else (kube-controller-manager updating a
//!   Deployment's status, an edit, a delete) — not the version the controller's own
//!   apply returned, and not the children listed when the watch starts (every relay is
//!   reconciled then anyway);
//! - the periodic recheck (Secrets are not watched; the database is checked), spread so
//!   that all relays together stay within a rate budget.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::watcher;
use kube::runtime::{WatchStreamExt, watcher as watch_stream};
use serde::de::DeserializeOwned;

use crate::api::OutboxRelay;
use crate::resources::ChildKind;

/// The properties of an OutboxRelay whose change calls for a reconcile: the spec (by
/// its generation), labels, annotations, whether deletion started, and the state a
/// reconcile keeps in status for the next one to read (the slot's and publication's
/// names, the Secrets protected, the handover snapshot: a reconcile that recorded a
/// snapshot is followed by one that reads it, as soon as the cache holds it).
pub(super) fn relay_trigger(relay: &OutboxRelay) -> Option<u64> {
    let meta = relay.meta();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    meta.generation.hash(&mut hasher);
    meta.deletion_timestamp.is_some().hash(&mut hasher);
    meta.labels.hash(&mut hasher);
    meta.annotations.hash(&mut hasher);
    if let Some(slot) = relay.status.as_ref().and_then(|s| s.slot.as_ref()) {
        slot.name.hash(&mut hasher);
        slot.publication.hash(&mut hasher);
        slot.protected_secrets.hash(&mut hasher);
        slot.handover_snapshot.hash(&mut hasher);
    }
    if let Some(fallback) = relay.status.as_ref().and_then(|s| s.fallback.as_ref()) {
        fallback.since.hash(&mut hasher);
        fallback.slot_dropped.hash(&mut hasher);
    }
    Some(hasher.finish())
}

/// The controller's own writes of children, to tell their watch events from others'.
///
/// The resource version each child had right after the controller's own apply, by
/// uid: a watch event carrying exactly that version is the echo of that apply. The
/// event may also come in before the apply's answer is read: while a child is being
/// applied, its events are held back (their versions noted), and once the answer is
/// in, a noted version other than the apply's means someone else changed the child
/// meanwhile, which the reconcile that applied it looks at again (see
/// [`Echoes::wrote`]).
#[derive(Default)]
pub(super) struct Echoes(Mutex<Book>);

#[derive(Default)]
struct Book {
    /// The version the last apply returned, by uid.
    wrote: HashMap<String, String>,
    /// The children being applied now, with the versions their events carried meanwhile.
    applying: HashMap<ChildKey, Vec<String>>,
}

/// A child by kind, namespace and name: known before the child is first made, when its
/// uid is not.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct ChildKey {
    kind: String,
    namespace: Option<String>,
    name: Option<String>,
}

impl ChildKey {
    /// The key of a child of `kind` about to be applied in `namespace`.
    pub(super) fn to_apply(
        kind: ChildKind,
        namespace: &str,
        object: &kube::api::DynamicObject,
    ) -> Self {
        Self {
            kind: kind.api_resource().kind,
            namespace: Some(namespace.to_owned()),
            name: object.metadata.name.clone(),
        }
    }

    /// The key of a child a watch reported.
    fn of<K: Resource<DynamicType = ()>>(object: &K) -> Self {
        Self {
            kind: K::kind(&()).into_owned(),
            namespace: object.meta().namespace.clone(),
            name: object.meta().name.clone(),
        }
    }
}

/// A child being applied: its events are held back until [`Applying::wrote`], or
/// judged as usual again when this is dropped first (the apply failed or was
/// abandoned: the reconcile is retried and reads the child afresh, so the events held
/// back meanwhile are not lost).
pub(super) struct Applying<'a> {
    echoes: &'a Echoes,
    key: ChildKey,
}

impl Applying<'_> {
    /// Records what the apply returned; see [`Echoes::wrote`].
    pub(super) fn wrote<K: Resource>(self, object: &K) -> bool {
        self.echoes.wrote(&self.key, object)
    }
}

impl Drop for Applying<'_> {
    fn drop(&mut self) {
        self.echoes.book().applying.remove(&self.key);
    }
}

impl Echoes {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The controller is about to apply child `key`: its events wait for the answer.
    pub(super) fn applying(&self, key: ChildKey) -> Applying<'_> {
        self.book().applying.insert(key.clone(), Vec::new());
        Applying { echoes: self, key }
    }

    /// Records what the controller's apply of child `key` returned (or the version it
    /// found in place). Returns whether an event of another version came in while it
    /// was applied: someone else changed the child meanwhile, and the caller must look
    /// again, since that event triggered nothing.
    fn wrote<K: Resource>(&self, key: &ChildKey, object: &K) -> bool {
        let meta = object.meta();
        let mut book = self.book();
        let held = book.applying.remove(key).unwrap_or_default();
        if let (Some(uid), Some(version)) = (&meta.uid, &meta.resource_version) {
            book.wrote.insert(uid.clone(), version.clone());
        }
        held.iter()
            .any(|seen| Some(seen) != meta.resource_version.as_ref())
    }

    /// Whether `object` is as the controller's last apply left it, or is being applied
    /// now (then its version is noted for [`Echoes::wrote`]). One look at the book, so
    /// an answer recorded in between cannot slip past both checks.
    fn is_own<K: Resource<DynamicType = ()>>(&self, object: &K) -> bool {
        let meta = object.meta();
        let mut book = self.book();
        if let (Some(uid), Some(version)) = (&meta.uid, &meta.resource_version)
            && book.wrote.get(uid) == Some(version)
        {
            return true;
        }
        match book.applying.get_mut(&ChildKey::of(object)) {
            Some(held) => {
                held.extend(meta.resource_version.clone());
                true
            }
            None => false,
        }
    }

    fn forget<K: Resource>(&self, object: &K) {
        if let Some(uid) = &object.meta().uid {
            self.book().wrote.remove(uid);
        }
    }
}

/// Whether a child watch event should reconcile the child's owner.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Trigger,
    Skip,
}

/// The verdict on one event of a child watch. `first_listing` is true until the
/// watch's first listing ended: the relays' own listing reconciles every relay then,
/// so the children listed alongside add nothing. Later listings (after the watch lost
/// its place) pass through the echo check like any change.
fn verdict<K: Resource<DynamicType = ()>>(
    event: &watcher::Event<K>,
    first_listing: &mut bool,
    echoes: &Echoes,
) -> Verdict {
    match event {
        watcher::Event::Init => Verdict::Skip,
        watcher::Event::InitDone => {
            *first_listing = false;
            Verdict::Skip
        }
        watcher::Event::InitApply(_) if *first_listing => Verdict::Skip,
        watcher::Event::InitApply(object) | watcher::Event::Apply(object) => {
            if echoes.is_own(object) {
                Verdict::Skip
            } else {
                Verdict::Trigger
            }
        }
        watcher::Event::Delete(object) => {
            echoes.forget(object);
            Verdict::Trigger
        }
    }
}

/// The children of one kind that should reconcile their owner (see [`verdict`]).
pub(super) fn child_triggers<K>(
    api: kube::Api<K>,
    config: watcher::Config,
    echoes: Arc<Echoes>,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let mut first_listing = true;
    watch_stream(api, config)
        .default_backoff()
        .filter_map(move |event| {
            let out = match event {
                Err(err) => Some(Err(err)),
                Ok(event) => match verdict(&event, &mut first_listing, &echoes) {
                    Verdict::Skip => None,
                    Verdict::Trigger => match event {
                        watcher::Event::Apply(o)
                        | watcher::Event::InitApply(o)
                        | watcher::Event::Delete(o) => Some(Ok(o)),
                        watcher::Event::Init | watcher::Event::InitDone => None,
                    },
                },
            };
            std::future::ready(out)
        })
}

/// How long an unchanged relay waits for its next recheck: the status interval, or
/// longer when `relays` rechecked that often would pass `per_second` rechecks a second
/// over all relays; then spread by `jitter` (in [0, 1)) over ±10%, so relays created
/// together do not stay in step.
pub(super) fn recheck_after(
    status_interval: Duration,
    relays: usize,
    per_second: f64,
    jitter: f64,
) -> Duration {
    let budget = if per_second > 0.0 {
        Duration::try_from_secs_f64(relays as f64 / per_second).unwrap_or(LONGEST_RECHECK)
    } else {
        status_interval
    };
    status_interval
        .max(budget)
        .min(LONGEST_RECHECK.max(status_interval))
        .mul_f64(0.9 + 0.2 * jitter.clamp(0.0, 1.0))
}

/// However many relays and however small the budget: an hour at most between rechecks.
pub(super) const LONGEST_RECHECK: Duration = Duration::from_secs(3600);

/// A number in [0, 1) that differs from call to call (the process's random hash keys
/// over a counter); good enough to spread timers, not for anything secret.
pub(super) fn jitter() -> f64 {
    static STATE: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let bits = STATE
        .get_or_init(std::collections::hash_map::RandomState::new)
        .hash_one(n);
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    fn relay(generation: i64) -> OutboxRelay {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "outbox.dev/v1alpha1",
            "kind": "OutboxRelay",
            "metadata": {"name": "orders", "namespace": "shop", "generation": generation,
                          "resourceVersion": "1"},
            "spec": {
                "database": {"postgres": {"connectionSecretRef": {"name": "db", "key": "uri"}}},
                "mode": {"polling": {}},
                "broker": {"kafka": {"bootstrapServers": "kafka:9092"}}
            }
        }))
        .unwrap()
    }

    #[test]
    fn status_and_finalizers_do_not_trigger_spec_labels_annotations_deletion_do() {
        let base = relay(1);
        let h = relay_trigger(&base);

        // Status: conditions and figures (the slot's position among them) do not
        // trigger; the slot state a reconcile leaves for the next one does.
        let mut status_only = base.clone();
        status_only.metadata.resource_version = Some("2".into());
        status_only.status = Some(
            serde_json::from_value(serde_json::json!({
                "observedGeneration": 1,
                "backlogRows": 12,
                "conditions": [{"type": "Ready", "status": "False", "reason": "RelayUnavailable",
                                "message": "0 of 1", "lastTransitionTime": "2026-12-04T00:00:00Z"}],
                "slot": {"name": "s", "confirmedFlushLsn": "0/16B3748", "active": true}
            }))
            .unwrap(),
        );
        let with_slot = relay_trigger(&status_only);
        let mut moved = status_only.clone();
        if let Some(slot) = moved.status.as_mut().and_then(|s| s.slot.as_mut()) {
            slot.confirmed_flush_lsn = Some("0/16B3800".into());
            slot.active = Some(false);
        }
        assert_eq!(relay_trigger(&moved), with_slot);
        let mut snapshot = status_only.clone();
        if let Some(slot) = snapshot.status.as_mut().and_then(|s| s.slot.as_mut()) {
            slot.handover_snapshot = Some("784:790:".into());
        }
        assert_ne!(relay_trigger(&snapshot), with_slot);
        status_only.status = Some(Default::default());
        assert_eq!(relay_trigger(&status_only), h);

        let mut finalized = base.clone();
        finalized.metadata.finalizers = Some(vec!["outbox.dev/cleanup".into()]);
        assert_eq!(relay_trigger(&finalized), h);

        assert_ne!(relay_trigger(&relay(2)), h);
        let mut labelled = base.clone();
        labelled.metadata.labels = Some([("team".to_owned(), "a".to_owned())].into());
        assert_ne!(relay_trigger(&labelled), h);
        let mut annotated = base.clone();
        annotated.metadata.annotations =
            Some([("outbox.dev/abandon-slot".to_owned(), "true".to_owned())].into());
        assert_ne!(relay_trigger(&annotated), h);
        let mut deleting = base.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-04T00:00:00Z".parse().unwrap(),
            ));
        assert_ne!(relay_trigger(&deleting), h);
    }

    fn config_map(uid: &str, version: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some("c".into()),
                uid: Some(uid.into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    #[test]
    fn own_writes_and_the_first_listing_are_skipped_other_changes_trigger() {
        let echoes = Echoes::default();
        let mut first = true;
        // The first listing: skipped, whatever it holds.
        assert_eq!(
            verdict::<ConfigMap>(&watcher::Event::Init, &mut first, &echoes),
            Verdict::Skip
        );
        assert_eq!(
            verdict(
                &watcher::Event::InitApply(config_map("u1", "5")),
                &mut first,
                &echoes
            ),
            Verdict::Skip
        );
        assert_eq!(
            verdict::<ConfigMap>(&watcher::Event::InitDone, &mut first, &echoes),
            Verdict::Skip
        );
        assert!(!first);

        // The controller applied version 7: its echo is skipped, a later version is not.
        assert!(!echoes.applying(key()).wrote(&config_map("u1", "7")));
        assert_eq!(
            verdict(
                &watcher::Event::Apply(config_map("u1", "7")),
                &mut first,
                &echoes
            ),
            Verdict::Skip
        );
        assert_eq!(
            verdict(
                &watcher::Event::Apply(config_map("u1", "8")),
                &mut first,
                &echoes
            ),
            Verdict::Trigger
        );
        // Another object, or a relisting after the first, goes through the same check.
        assert_eq!(
            verdict(
                &watcher::Event::InitApply(config_map("u2", "7")),
                &mut first,
                &echoes
            ),
            Verdict::Trigger
        );
        assert_eq!(
            verdict(
                &watcher::Event::InitApply(config_map("u1", "7")),
                &mut first,
                &echoes
            ),
            Verdict::Skip
        );
        // A delete always triggers (the child is to be made again) and is forgotten.
        assert_eq!(
            verdict(
                &watcher::Event::Delete(config_map("u1", "7")),
                &mut first,
                &echoes
            ),
            Verdict::Trigger
        );
        assert_eq!(
            verdict(
                &watcher::Event::Apply(config_map("u1", "7")),
                &mut first,
                &echoes
            ),
            Verdict::Trigger
        );
    }

    fn key() -> ChildKey {
        ChildKey {
            kind: "ConfigMap".into(),
            namespace: None,
            name: Some("c".into()),
        }
    }

    /// The key an apply holds is the key its watch events carry, for every watched kind.
    #[test]
    fn a_child_is_held_under_the_key_its_events_carry() {
        use k8s_openapi::api::apps::v1::Deployment;
        use k8s_openapi::api::core::v1::Service;
        use k8s_openapi::api::policy::v1::PodDisruptionBudget;
        fn event_key<K: Resource<DynamicType = ()> + Default>() -> ChildKey {
            let mut object = K::default();
            object.meta_mut().namespace = Some("shop".into());
            object.meta_mut().name = Some("orders-relay".into());
            ChildKey::of(&object)
        }
        let named: kube::api::DynamicObject =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "orders-relay"}}))
                .unwrap();
        let expected = [
            event_key::<ConfigMap>(),
            event_key::<Deployment>(),
            event_key::<Service>(),
            event_key::<PodDisruptionBudget>(),
        ];
        let watched: Vec<ChildKind> = ChildKind::ALL.into_iter().filter(|k| k.watched()).collect();
        assert_eq!(
            watched.len(),
            expected.len(),
            "a watched kind left unchecked"
        );
        for kind in watched {
            let key = ChildKey::to_apply(kind, "shop", &named);
            assert!(expected.contains(&key), "{kind:?}: {key:?}");
        }
    }

    #[test]
    fn events_that_overtake_the_apply_are_held_until_its_answer() {
        let echoes = Echoes::default();
        let mut first = false;
        let apply = |version: &str| watcher::Event::Apply(config_map("u1", version));
        // Its own echo before the answer: held, and nothing to look at again.
        let applying = echoes.applying(key());
        assert_eq!(verdict(&apply("7"), &mut first, &echoes), Verdict::Skip);
        assert!(!applying.wrote(&config_map("u1", "7")));
        assert_eq!(verdict(&apply("7"), &mut first, &echoes), Verdict::Skip);
        // Someone else's change while the controller applied: held, then reported.
        let applying = echoes.applying(key());
        assert_eq!(verdict(&apply("8"), &mut first, &echoes), Verdict::Skip);
        assert_eq!(verdict(&apply("9"), &mut first, &echoes), Verdict::Skip);
        assert!(applying.wrote(&config_map("u1", "9")));
        // Afterwards, events are judged as usual.
        assert_eq!(verdict(&apply("10"), &mut first, &echoes), Verdict::Trigger);
        // A failed apply (the hold dropped unanswered) holds nothing back any more.
        drop(echoes.applying(key()));
        assert_eq!(verdict(&apply("11"), &mut first, &echoes), Verdict::Trigger);
        // Another child is not held by this one's apply.
        let _applying = echoes.applying(key());
        let other = ConfigMap {
            metadata: ObjectMeta {
                name: Some("d".into()),
                ..config_map("u2", "3").metadata
            },
            ..ConfigMap::default()
        };
        assert_eq!(
            verdict(&watcher::Event::Apply(other), &mut first, &echoes),
            Verdict::Trigger
        );
    }

    #[test]
    fn rechecks_stay_within_the_budget_and_spread() {
        let ten = Duration::from_secs(10);
        // Few relays: the status interval, ±10%.
        assert_eq!(recheck_after(ten, 5, 20.0, 0.5), ten);
        assert_eq!(recheck_after(ten, 5, 20.0, 0.0), Duration::from_secs(9));
        assert_eq!(recheck_after(ten, 5, 20.0, 1.0), Duration::from_secs(11));
        // 1,000 relays at 20 a second: every 50 s.
        assert_eq!(recheck_after(ten, 1000, 20.0, 0.5), Duration::from_secs(50));
        // No budget: the status interval.
        assert_eq!(recheck_after(ten, 1000, 0.0, 0.5), ten);
        // A budget next to nothing: an hour at most, never an overflow.
        assert_eq!(
            recheck_after(ten, 1000, 1e-300, 0.5),
            Duration::from_secs(3600)
        );
        assert_eq!(
            recheck_after(ten, usize::MAX, 1e-20, 1.0),
            Duration::from_secs(3960)
        );
        let spread: Vec<f64> = (0..1000).map(|_| jitter()).collect();
        assert!(spread.iter().all(|j| (0.0..1.0).contains(j)));
        let mean = spread.iter().sum::<f64>() / spread.len() as f64;
        assert!((0.4..0.6).contains(&mean), "mean {mean}");
    }
}
