//! Creating or adopting a log-tailing relay's publication and slot, split in two: a pure
//! plan from the facts the preflight checks read ([`plan`]), and its execution
//! ([`execute`]). The controller decides with the first and applies with the second, so
//! nothing that looks at the database ever changes it.

use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use super::PgError;
use super::admin::{
    Facts, Marker, Origin, Owner, Plan, comment_sql, create_publication_sql, current_comment,
    gather, with_marker_lock,
};

/// Who made the publication and the slot, as the marker will record it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provisioned {
    /// Who made the publication (`None`: it carries someone else's comment).
    pub publication: Option<Origin>,
    /// Who made the slot (`None`: unrecorded, see `admin`'s module documentation).
    pub slot: Option<Origin>,
}

/// One change in the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Create the publication and write its marker, in one transaction.
    CreatePublication {
        /// Publication name (for messages).
        publication: String,
        /// `BEGIN; CREATE PUBLICATION …; COMMENT ON PUBLICATION …; COMMIT`.
        sql: String,
    },
    /// Rewrite the marker of a publication that exists, provided its comment is still
    /// the one the plan was made from (checked under the marker lock: a finalizer may
    /// be dropping it meanwhile).
    MarkPublication {
        /// Publication name.
        publication: String,
        /// The comment the plan saw.
        seen: Option<String>,
        /// `COMMENT ON PUBLICATION …`.
        sql: String,
    },
    /// Create the logical replication slot (its own statement: PostgreSQL refuses it
    /// in a transaction that wrote).
    CreateSlot {
        /// Slot name.
        slot: String,
        /// Made a failover slot (PostgreSQL 17+): standbys that synchronise slots keep
        /// it, so it survives a promotion.
        failover: bool,
    },
    /// Drop the slot of a relay that fell back to polling past its WAL budget (no pod
    /// streams it any more), provided the publication's marker is `owner`'s; the
    /// publication stays.
    DropSlotOverBudget {
        /// Slot name.
        slot: String,
        /// Publication name (its marker is checked).
        publication: String,
        /// Whose the slot must be.
        owner: Owner,
    },
    /// Drop the slot and publication of a relay that no longer tails the log, as the
    /// finalizer does: only what the marker says the operator created for `owner`.
    DropOwned {
        /// Slot name.
        slot: String,
        /// Publication name.
        publication: String,
        /// Whose they are.
        owner: Owner,
    },
}

/// What to do, and what will then be true.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProvisionPlan {
    /// The changes, in order (empty when everything exists and is marked).
    pub actions: Vec<Action>,
    /// Who made what, once the actions ran.
    pub outcome: Provisioned,
}

/// Plans the publication and slot of `plan` for `owner` from `facts` (pure). A marker
/// of the same namespace/name (this relay, or an earlier one of that name whose cleanup
/// could not run) is taken over with its facts, and so is the marker of another relay
/// when `successor` (that relay is gone or being deleted: a rename keeps the slot and
/// its position, and whoever holds the marker drops what the operator created); a
/// publication that carries someone else's comment is used as is and never commented
/// on.
pub fn plan(plan: &Plan, owner: &Owner, facts: &Facts, successor: bool) -> ProvisionPlan {
    let Some(lt) = &plan.log_tailing else {
        return ProvisionPlan {
            actions: Vec::new(),
            outcome: Provisioned {
                publication: None,
                slot: None,
            },
        };
    };
    let existing = facts.publication.as_ref();
    let previous = existing
        .and_then(|p| p.comment.as_deref())
        .and_then(Marker::from_comment);
    let foreign_comment = existing.is_some_and(|p| p.comment.is_some() && previous.is_none());
    let slot_exists = facts.slot.is_some();
    let inherited = previous
        .as_ref()
        .filter(|m| {
            successor || (m.owner.namespace == owner.namespace && m.owner.name == owner.name)
        })
        .filter(|m| m.slot == lt.slot);
    let publication_origin = match (existing, inherited) {
        (None, _) => Origin::Created,
        (Some(_), Some(m)) => m.publication,
        (Some(_), None) => Origin::Adopted,
    };
    let slot_origin = match inherited {
        Some(m) if m.slot_origin == Origin::Created => Origin::Created,
        _ if slot_exists => Origin::Adopted,
        _ => Origin::Created,
    };
    let marker = Marker {
        owner: owner.clone(),
        slot: lt.slot.clone(),
        publication: publication_origin,
        slot_origin,
    };
    let mut actions = Vec::new();
    if existing.is_none() {
        // The comment is written with the publication, before the slot exists: a crash
        // in between leaves a marker naming a missing slot, never an unmarked slot.
        actions.push(Action::CreatePublication {
            publication: lt.publication.clone(),
            sql: format!(
                "BEGIN; {}; {}; COMMIT",
                create_publication_sql(&lt.publication, &plan.schema, &plan.table),
                comment_sql(&lt.publication, Some(&marker.to_comment()))
            ),
        });
    } else if !foreign_comment && previous.as_ref() != Some(&marker) {
        actions.push(Action::MarkPublication {
            publication: lt.publication.clone(),
            seen: existing.and_then(|p| p.comment.clone()),
            sql: comment_sql(&lt.publication, Some(&marker.to_comment())),
        });
    }
    if !slot_exists {
        actions.push(Action::CreateSlot {
            slot: lt.slot.clone(),
            failover: facts.server.has_failover_slots(),
        });
    }
    ProvisionPlan {
        actions,
        outcome: Provisioned {
            publication: (!foreign_comment).then_some(publication_origin),
            slot: (!foreign_comment).then_some(slot_origin),
        },
    }
}

/// Creates the publication and the slot when missing, adopting what exists, and records
/// what it created in the publication's comment: reads the facts, [`plan`]s and
/// [`execute`]s. Call it only after `admin::evaluate` found no failure. Idempotent.
pub async fn provision(
    client: &Client,
    plan: &Plan,
    owner: &Owner,
) -> Result<Provisioned, PgError> {
    let facts = gather(client, plan).await?;
    let planned = self::plan(plan, owner, &facts, false);
    execute(client, &planned.actions).await?;
    Ok(planned.outcome)
}

/// Carries out planned actions, in order. A slot or publication created concurrently
/// by someone else is reported for a retry (the next plan adopts it).
pub async fn execute(client: &Client, actions: &[Action]) -> Result<(), PgError> {
    for action in actions {
        match action {
            Action::CreatePublication { publication, sql } => {
                if let Err(e) = client.batch_execute(sql).await {
                    let _ = client.batch_execute("ROLLBACK").await;
                    if e.code() == Some(&SqlState::DUPLICATE_OBJECT) {
                        return Err(PgError::Replication(format!(
                            "publication {publication} was created concurrently by someone else; retrying"
                        )));
                    }
                    return Err(PgError::Db {
                        what: "creating the publication",
                        source: e,
                    });
                }
            }
            Action::MarkPublication {
                publication,
                seen,
                sql,
            } => {
                with_marker_lock(client, publication, async |client| {
                    if current_comment(client, publication).await? != Some(seen.clone()) {
                        return Err(PgError::Replication(format!(
                            "publication {publication} was changed or dropped while being marked (a finalizer ran); retrying"
                        )));
                    }
                    client
                        .batch_execute(sql)
                        .await
                        .map_err(|source| PgError::Db {
                            what: "marking the publication",
                            source,
                        })
                })
                .await?;
            }
            Action::DropOwned {
                slot,
                publication,
                owner,
            } => {
                super::admin::drop_owned(client, slot, publication, owner).await?;
            }
            Action::DropSlotOverBudget {
                slot,
                publication,
                owner,
            } => {
                if !super::admin::drop_slot_over_budget(client, slot, publication, owner).await? {
                    return Err(PgError::Replication(format!(
                        "replication slot {slot} was not dropped: publication {publication} no longer carries this relay's marker"
                    )));
                }
            }
            Action::CreateSlot { slot, failover } => {
                // (slot_name, plugin, temporary, twophase, failover): the fifth argument
                // exists from PostgreSQL 17 on.
                let sql = if *failover {
                    "SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
                } else {
                    "SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput')"
                };
                let created = client.query_one(sql, &[slot]).await;
                match created {
                    Ok(_) => {}
                    Err(e) if e.code() == Some(&SqlState::DUPLICATE_OBJECT) => {}
                    Err(source) => {
                        return Err(PgError::Db {
                            what: "creating the replication slot",
                            source,
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::admin::{PublicationFacts, ServerFacts, SlotFacts, SlotPlan, TableFacts};
    use super::*;

    fn plan_for() -> Plan {
        Plan {
            schema: "public".into(),
            table: "outbox".into(),
            id: "id".into(),
            columns: Vec::new(),
            created_at: "created_at".into(),
            published_at: None,
            marker: "published_at".into(),
            privileges: Vec::new(),
            log_tailing: Some(SlotPlan {
                slot: "s".into(),
                publication: "p".into(),
                delete_after_publish: true,
            }),
            archive: None,
            dead_letter: "outbox_dead_letter".into(),
        }
    }

    fn owner(name: &str) -> Owner {
        Owner {
            namespace: "shop".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    fn facts(publication: Option<Option<String>>, slot: bool) -> Facts {
        Facts {
            server: ServerFacts {
                wal_level: "logical".into(),
                max_replication_slots: 10,
                slots_in_use: 0,
                max_wal_senders: 10,
                replication: true,
                superuser: false,
                user: "u".into(),
                database: "d".into(),
                can_create: true,
                version_num: 150_000,
                synchronized_standby_slots: String::new(),
                physical_slots: Vec::new(),
            },
            table: TableFacts {
                exists: true,
                columns: Vec::new(),
                timestamp_type: None,
                id_column: Some(("bigint".into(), true)),
                order_column: None,
                owned: true,
                missing_privileges: Vec::new(),
            },
            slot: slot.then(|| SlotFacts {
                database: Some("d".into()),
                plugin: Some("pgoutput".into()),
                slot_type: "logical".into(),
                failover: None,
                retained_wal_bytes: None,
                active: false,
            }),
            publication: publication.map(|comment| PublicationFacts {
                publishes_insert: true,
                has_table: true,
                comment,
                identity: "16391/732;16394/730".into(),
            }),
            unpublished_before_slot: None,
            other_markers: Vec::new(),
            backlog: None,
            archive: None,
        }
    }

    #[test]
    fn nothing_there_creates_both_publication_first() {
        let p = plan(&plan_for(), &owner("orders"), &facts(None, false), false);
        assert!(matches!(p.actions[0], Action::CreatePublication { .. }));
        assert!(matches!(p.actions[1], Action::CreateSlot { .. }));
        assert_eq!(p.outcome.slot, Some(Origin::Created));
    }

    #[test]
    fn what_exists_is_adopted_and_a_marked_pair_needs_nothing() {
        let adopted = plan(
            &plan_for(),
            &owner("orders"),
            &facts(Some(None), true),
            false,
        );
        assert_eq!(adopted.outcome.publication, Some(Origin::Adopted));
        assert_eq!(adopted.outcome.slot, Some(Origin::Adopted));
        let Action::MarkPublication { sql, .. } = &adopted.actions[0] else {
            panic!("{adopted:?}");
        };
        let comment = sql.split("IS '").nth(1).unwrap().trim_end_matches('\'');
        let marked = plan(
            &plan_for(),
            &owner("orders"),
            &facts(Some(Some(comment.to_owned())), true),
            false,
        );
        assert!(marked.actions.is_empty(), "{marked:?}");
    }

    #[test]
    fn a_foreign_comment_is_never_touched() {
        let p = plan(
            &plan_for(),
            &owner("orders"),
            &facts(Some(Some("someone else's".into())), true),
            false,
        );
        assert!(p.actions.is_empty());
        assert_eq!(p.outcome.publication, None);
    }

    #[test]
    fn a_successor_takes_over_what_the_operator_created_for_another_relay() {
        let old = Marker {
            owner: owner("orders"),
            slot: "s".into(),
            publication: Origin::Created,
            slot_origin: Origin::Created,
        };
        let seen = facts(Some(Some(old.to_comment())), true);
        // While the other relay lives (not a successor): used, recorded as adopted.
        let beside = plan(&plan_for(), &owner("orders-v2"), &seen, false);
        assert_eq!(beside.outcome.slot, Some(Origin::Adopted));
        // Its successor inherits "created": deleting the successor drops them.
        let next = plan(&plan_for(), &owner("orders-v2"), &seen, true);
        assert_eq!(next.outcome.slot, Some(Origin::Created));
        assert_eq!(next.outcome.publication, Some(Origin::Created));
        let Action::MarkPublication { seen: was, sql, .. } = &next.actions[0] else {
            panic!("{next:?}");
        };
        assert_eq!(was.as_deref(), Some(old.to_comment().as_str()));
        assert!(sql.contains("orders-v2"), "{sql}");
        // A marker of another slot name is never inherited.
        let other = Marker {
            slot: "t".into(),
            ..old
        };
        let p = plan(
            &plan_for(),
            &owner("orders-v2"),
            &facts(Some(Some(other.to_comment())), true),
            true,
        );
        assert_eq!(p.outcome.slot, Some(Origin::Adopted));
    }
}
