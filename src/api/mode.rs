//! `spec.mode`: polling, or log tailing through a replication slot.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::*;

/// How the relay finds committed rows. Exactly one field is set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.polling) != has(self.logTailing)").message("set exactly one of mode.polling and mode.logTailing"))]
pub struct ModeSpec {
    /// Poll the table for unpublished rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub polling: Option<PollingSpec>,
    /// Stream inserts from a logical replication slot (`pgoutput`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_tailing: Option<LogTailingSpec>,
}

/// The mode, as one value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode<'a> {
    /// Polling mode.
    Polling(&'a PollingSpec),
    /// Log-tailing mode.
    LogTailing(&'a LogTailingSpec),
}

impl ModeSpec {
    /// The one mode that is set. The schema guarantees exactly one; an object that
    /// bypassed it (set both) is read as polling, the mode that needs nothing in the
    /// database, and [`OutboxRelaySpec::validate`] reports it.
    pub fn get(&self) -> Option<Mode<'_>> {
        match (&self.polling, &self.log_tailing) {
            (Some(p), _) => Some(Mode::Polling(p)),
            (None, Some(l)) => Some(Mode::LogTailing(l)),
            (None, None) => None,
        }
    }
}

impl Mode<'_> {
    /// The mode's name as the spec spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Polling(_) => "polling",
            Mode::LogTailing(_) => "logTailing",
        }
    }
}

/// Polling mode settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PollingSpec {
    /// Time from one round of polls' start to the next (the longest a committed row
    /// waits to be looked at): a full batch polls again at once, within the round, and
    /// the round ends with a poll that does not fill a batch.
    #[serde(default = "default_interval")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1ms')").message("spec.mode.polling.interval must be at least 1ms"))]
    pub interval: String,
    /// Rows per batch (one transaction), at most: with large rows a batch takes fewer,
    /// about 2 MiB of payloads.
    #[serde(default = "default_batch_size")]
    #[schemars(range(min = 1, max = 10000))]
    pub batch_size: i32,
    /// What to do with a row once the broker acknowledged it.
    #[serde(default)]
    pub after_publish: AfterPublish,
    /// Batch loops each relay process runs at once, each on a database session of its
    /// own that owns its share of the partitions, so one loop's select and commit
    /// overlap another's publishing. Each is one more database connection; together
    /// they hold the same 2 MiB of payloads a single loop would. Worth 2 for a single
    /// replica; with several, each worker sees fewer aggregates per batch.
    #[serde(default = "default_workers", skip_serializing_if = "is_one")]
    #[schemars(range(min = 1, max = 16), extend("default" = 1))]
    pub workers: i32,
}

impl Default for PollingSpec {
    fn default() -> Self {
        Self {
            interval: default_interval(),
            batch_size: default_batch_size(),
            after_publish: AfterPublish::default(),
            workers: default_workers(),
        }
    }
}

fn default_interval() -> String {
    "500ms".to_owned()
}
fn default_batch_size() -> i32 {
    500
}
fn default_workers() -> i32 {
    1
}
/// The default worker count is left out of the relay's config, so a relay that does
/// not set it renders as before workers existed (and does not roll on upgrade).
#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_one(workers: &i32) -> bool {
    *workers == 1
}

/// What polling does with a published row.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum AfterPublish {
    /// Set the `publishedAt` column; `retention.publishedRows` deletes it later.
    #[default]
    Mark,
    /// Delete the row in the same transaction.
    Delete,
    /// Move the row to the archive table (`spec.table.archive`) in the same
    /// transaction, with the time it was moved; `retention.publishedRows` deletes it
    /// from there later.
    Archive,
}

/// Log-tailing mode settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(oldSelf.slotName) == has(self.slotName)").message("logTailing.slotName cannot be added or removed once the relay tails the log: the slot would change and its position be lost"))]
#[x_kube(validation = Rule::new("has(oldSelf.publicationName) == has(self.publicationName)").message("logTailing.publicationName cannot be added or removed once the relay tails the log"))]
#[x_kube(validation = Rule::new("!has(self.maxRetainedWal) || !has(self.deleteAfterPublish) || self.deleteAfterPublish").message("spec.mode.logTailing.maxRetainedWal needs deleteAfterPublish: true (the fall back to polling finds the rows not yet published only when published rows leave the table)"))]
pub struct LogTailingSpec {
    /// Replication slot name; default `outbox_<namespace>_<name>`. Cannot change once
    /// set: a new name would abandon the old slot and its position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = SLOT_NAME_PATTERN))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("logTailing.slotName is immutable"))]
    pub slot_name: Option<String>,
    /// Publication name; default the slot name. Cannot change once set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = SLOT_NAME_PATTERN))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("logTailing.publicationName is immutable"))]
    pub publication_name: Option<String>,
    /// How often an idle relay writes a heartbeat so the slot keeps advancing.
    #[serde(default = "default_heartbeat")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('100ms')").message("spec.mode.logTailing.heartbeatInterval must be at least 100ms"))]
    pub heartbeat_interval: String,
    /// Delete rows once published, so the table stays small (deletes are not published).
    #[serde(default = "default_true")]
    pub delete_after_publish: bool,
    /// A reconciliation sweep: now and then the relay looks in the table for rows older
    /// than `olderThan` (with `deleteAfterPublish`, rows the log tail should long have
    /// published and deleted: the publication was altered, the slot recreated) and
    /// publishes them, counting them in `outbox_relay_sweep_found_total`, which the
    /// `OutboxRelaySweepFoundRows` alert watches. Needs the `createdAt` column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep: Option<SweepSpec>,
    /// A WAL budget, as a Kubernetes quantity (`10Gi`): when the slot retains more WAL
    /// than this (the relay is stuck, the broker down for long), the operator switches
    /// the relay to polling the same table, drops the slot so the server's disk is safe,
    /// and returns to log tailing once the backlog is drained (and `returnAfter` has
    /// passed), with no event lost and per-aggregate order kept. Needs
    /// `deleteAfterPublish` (the table then holds exactly the rows not yet published).
    /// Absent: no budget; the `OutboxRelaySlotRetainedWalHigh` alert still warns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), regex(pattern = "^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$"))]
    #[x_kube(validation = Rule::new("!self.matches('^0+[A-Za-z]*$')").message("spec.mode.logTailing.maxRetainedWal must be positive"))]
    pub max_retained_wal: Option<String>,
    /// After a fall back to polling, the least time the relay polls before log tailing
    /// is tried again (each try creates the slot anew); default `5m`. Ignored without
    /// `maxRetainedWal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("spec.mode.logTailing.returnAfter must be at least 1s"))]
    pub return_after: Option<String>,
    /// Physical replication slots of standbys that must hold a commit before the relay
    /// publishes it: an event is sent only once every named slot's `restart_lsn` (the
    /// position its standby flushed) has passed the commit. After a failover to one of
    /// them, no event is out for a commit the new primary lacks. PostgreSQL 17+ does
    /// the same server-side with `synchronized_standby_slots`; on 15 and 16 this is the
    /// way to fail over without phantom events. A named slot that is missing holds
    /// publishing back (logged, `outbox_relay_standby_wait_bytes`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(regex(pattern = SLOT_NAME_PATTERN)))]
    pub synchronized_standby_slots: Vec<String>,
}

/// The reconciliation sweep of a log-tailing relay.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SweepSpec {
    /// Time between sweeps.
    #[serde(default = "default_sweep_interval")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub interval: String,
    /// Age (by `createdAt`) from which a row still in the table counts as missed.
    #[serde(default = "default_sweep_older_than")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub older_than: String,
}

fn default_sweep_interval() -> String {
    "1m".to_owned()
}
fn default_sweep_older_than() -> String {
    "5m".to_owned()
}

impl Default for LogTailingSpec {
    fn default() -> Self {
        Self {
            slot_name: None,
            publication_name: None,
            heartbeat_interval: default_heartbeat(),
            delete_after_publish: true,
            sweep: None,
            max_retained_wal: None,
            return_after: None,
            synchronized_standby_slots: Vec::new(),
        }
    }
}

fn default_heartbeat() -> String {
    "30s".to_owned()
}
