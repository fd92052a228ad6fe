//! CloudNativePG clusters named by `spec.database.databaseRef`: what the controller
//! reads from a `Cluster` (`postgresql.cnpg.io/v1`) and what it checks, as pure
//! functions of the object's JSON. The connection itself is what
//! [`crate::api::DatabaseRef::connection`] says (the app Secret's `uri`, the cluster's
//! CA), so the controller, `render` and the relay agree without reading the cluster.

use serde_json::Value;

use crate::api::DatabaseRef;

/// API group of CloudNativePG's Cluster.
pub const GROUP: &str = "postgresql.cnpg.io";
/// Its version.
pub const VERSION: &str = "v1";
/// Its kind.
pub const KIND: &str = "Cluster";
/// Its plural.
pub const PLURAL: &str = "clusters";

/// What the controller reads from a Cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterFacts {
    /// The Secret of its application user: `spec.bootstrap.<method>.secret.name`, else
    /// `<name>-app`.
    pub app_secret: String,
    /// The Secret of its server CA: `status.certificates.serverCASecret`, else
    /// `spec.certificates.serverCASecret`, else `<name>-ca`.
    pub ca_secret: String,
    /// `spec.postgresql.parameters.wal_level` when set (CloudNativePG's default is
    /// `logical`).
    pub wal_level: Option<String>,
    /// `spec.replicationSlots.highAvailability.synchronizeLogicalDecoding`, with
    /// `highAvailability.enabled` not turned off: logical slots are synchronised to the
    /// standbys (PostgreSQL 17+), so a failover keeps the relay's slot.
    pub synchronizes_logical_slots: bool,
    /// `spec.instances` (default 1).
    pub instances: i64,
    /// `status.phase`, when reported.
    pub phase: Option<String>,
}

/// Reads a Cluster object (its JSON, `metadata.name` included).
pub fn facts_of(cluster: &Value) -> ClusterFacts {
    let name = cluster
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let text = |path: &str| {
        cluster
            .pointer(path)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    let app_secret = ["initdb", "recovery", "pg_basebackup"]
        .iter()
        .find_map(|method| text(&format!("/spec/bootstrap/{method}/secret/name")))
        .unwrap_or_else(|| format!("{name}-app"));
    let ca_secret = text("/status/certificates/serverCASecret")
        .or_else(|| text("/spec/certificates/serverCASecret"))
        .unwrap_or_else(|| format!("{name}-ca"));
    let ha = cluster.pointer("/spec/replicationSlots/highAvailability");
    let synchronizes_logical_slots = ha.is_some_and(|ha| {
        ha.get("enabled").and_then(Value::as_bool) != Some(false)
            && ha
                .get("synchronizeLogicalDecoding")
                .and_then(Value::as_bool)
                == Some(true)
    });
    ClusterFacts {
        app_secret,
        ca_secret,
        wal_level: text("/spec/postgresql/parameters/wal_level"),
        synchronizes_logical_slots,
        instances: cluster
            .pointer("/spec/instances")
            .and_then(Value::as_i64)
            .unwrap_or(1),
        phase: text("/status/phase"),
    }
}

/// The cluster as the controller found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterSeen {
    /// The Cluster kind is not served: CloudNativePG is not installed.
    NotInstalled,
    /// No Cluster of that name in the relay's namespace.
    Missing,
    /// The operator may not read Clusters (its RBAC lacks `get` on them).
    Forbidden,
    /// The Cluster, and whether its `-rw` Service exists.
    Found {
        /// What it says.
        facts: ClusterFacts,
        /// Its read-write Service exists.
        rw_service: bool,
    },
}

/// A reason the relay cannot use the cluster, for `DatabaseReady`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterProblem {
    /// The condition reason.
    pub reason: &'static str,
    /// What is wrong and the fix.
    pub message: String,
}

/// The first reason `reference` cannot be used as `seen` shows it (`None`: usable).
/// For log tailing, a cluster that sets `wal_level` to something else than `logical`
/// is refused here, with the Cluster field to change (the server's own setting is
/// checked once connected, as for any database).
pub fn problem(
    reference: &DatabaseRef,
    seen: &ClusterSeen,
    log_tailing: bool,
) -> Option<ClusterProblem> {
    let name = &reference.name;
    let (facts, rw_service) = match seen {
        ClusterSeen::NotInstalled => {
            return Some(ClusterProblem {
                reason: "CloudNativePGNotInstalled",
                message: format!(
                    "spec.database.databaseRef names CloudNativePG Cluster {name}, but the API server does not serve {KIND}.{GROUP}/{VERSION}: install CloudNativePG, or use spec.database.postgres"
                ),
            });
        }
        ClusterSeen::Missing => {
            return Some(ClusterProblem {
                reason: "ClusterNotFound",
                message: format!(
                    "CloudNativePG Cluster {name} does not exist in the relay's namespace: create it there, or fix spec.database.databaseRef.name"
                ),
            });
        }
        ClusterSeen::Forbidden => {
            return Some(ClusterProblem {
                reason: "ClusterNotReadable",
                message: format!(
                    "the operator may not read CloudNativePG Cluster {name}: grant it get on clusters.postgresql.cnpg.io (the Helm chart's RBAC does)"
                ),
            });
        }
        ClusterSeen::Found { facts, rw_service } => (facts, *rw_service),
    };
    if !rw_service {
        return Some(ClusterProblem {
            reason: "ClusterServiceMissing",
            message: format!(
                "Service {} of CloudNativePG Cluster {name} does not exist (the cluster is still being created, or its services are managed otherwise): the relay connects through it",
                reference.rw_service()
            ),
        });
    }
    if reference.secret_name.is_none()
        && reference.user_secret_name.is_none()
        && facts.app_secret != reference.secret()
    {
        return Some(ClusterProblem {
            reason: "ClusterSecretMismatch",
            message: format!(
                "CloudNativePG Cluster {name} keeps its application user in Secret {}, not {}: set spec.database.databaseRef.secretName: {}",
                facts.app_secret,
                reference.secret(),
                facts.app_secret
            ),
        });
    }
    if reference.ca_secret_name.is_none() && facts.ca_secret != reference.ca_secret() {
        return Some(ClusterProblem {
            reason: "ClusterSecretMismatch",
            message: format!(
                "CloudNativePG Cluster {name} has its server CA in Secret {}, not {}: set spec.database.databaseRef.caSecretName: {}",
                facts.ca_secret,
                reference.ca_secret(),
                facts.ca_secret
            ),
        });
    }
    if log_tailing && let Some(level) = facts.wal_level.as_deref().filter(|l| *l != "logical") {
        return Some(ClusterProblem {
            reason: "ClusterWalLevel",
            message: format!(
                "CloudNativePG Cluster {name} sets wal_level = {level}: log tailing needs logical; remove spec.postgresql.parameters.wal_level from the Cluster (CloudNativePG's default is logical) or set it to logical"
            ),
        });
    }
    None
}

/// For log tailing on PostgreSQL 17+: why a failover of the cluster would lose the
/// relay's slot position (`None`: the cluster synchronises logical slots).
pub fn failover_gap(
    reference: &DatabaseRef,
    facts: &ClusterFacts,
) -> Option<(&'static str, String)> {
    if facts.instances <= 1 {
        return Some((
            "ClusterSingleInstance",
            format!(
                "CloudNativePG Cluster {} has one instance: there is no standby to fail over to (a restarted instance keeps the slot on its storage); with more instances, also set spec.replicationSlots.highAvailability.synchronizeLogicalDecoding: true",
                reference.name
            ),
        ));
    }
    if facts.synchronizes_logical_slots {
        return None;
    }
    Some((
        "ClusterSlotSyncOff",
        format!(
            "CloudNativePG Cluster {} does not synchronise logical slots to its standbys: after a failover the relay's slot is gone; set spec.replicationSlots.highAvailability.synchronizeLogicalDecoding: true (CloudNativePG 1.27+) with hot_standby_feedback and sync_replication_slots on in spec.postgresql.parameters",
            reference.name
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reference(name: &str) -> DatabaseRef {
        DatabaseRef {
            kind: crate::api::DatabaseRefKind::Cluster,
            name: name.into(),
            secret_name: None,
            user_secret_name: None,
            database: None,
            ca_secret_name: None,
        }
    }

    #[test]
    fn a_plain_cluster_reads_as_cloudnativepg_names_things() {
        let facts = facts_of(&json!({"metadata": {"name": "orders"}, "spec": {"instances": 3}}));
        assert_eq!(facts.app_secret, "orders-app");
        assert_eq!(facts.ca_secret, "orders-ca");
        assert_eq!(facts.instances, 3);
        assert!(!facts.synchronizes_logical_slots);
        let seen = ClusterSeen::Found {
            facts,
            rw_service: true,
        };
        assert_eq!(problem(&reference("orders"), &seen, true), None);
    }

    #[test]
    fn secrets_of_its_own_are_named_back_to_the_user() {
        let facts = facts_of(&json!({
            "metadata": {"name": "orders"},
            "spec": {"bootstrap": {"initdb": {"secret": {"name": "orders-owner"}}},
                     "certificates": {"serverCASecret": "spec-ca"}},
            "status": {"certificates": {"serverCASecret": "my-ca"}}
        }));
        assert_eq!(facts.app_secret, "orders-owner");
        assert_eq!(facts.ca_secret, "my-ca");
        let seen = ClusterSeen::Found {
            facts,
            rw_service: true,
        };
        let p = problem(&reference("orders"), &seen, false).unwrap();
        assert_eq!(p.reason, "ClusterSecretMismatch");
        assert!(
            p.message.contains("secretName: orders-owner"),
            "{}",
            p.message
        );
        let mut named = reference("orders");
        named.secret_name = Some("orders-owner".into());
        let p = problem(&named, &seen, false).unwrap();
        assert!(p.message.contains("caSecretName: my-ca"), "{}", p.message);
        named.ca_secret_name = Some("my-ca".into());
        assert_eq!(problem(&named, &seen, false), None);
    }

    #[test]
    fn missing_pieces_and_a_wal_level_are_reasons() {
        let r = reference("orders");
        assert_eq!(
            problem(&r, &ClusterSeen::NotInstalled, false)
                .unwrap()
                .reason,
            "CloudNativePGNotInstalled"
        );
        assert_eq!(
            problem(&r, &ClusterSeen::Missing, false).unwrap().reason,
            "ClusterNotFound"
        );
        assert_eq!(
            problem(&r, &ClusterSeen::Forbidden, false).unwrap().reason,
            "ClusterNotReadable"
        );
        let replica = facts_of(&json!({"metadata": {"name": "orders"},
            "spec": {"postgresql": {"parameters": {"wal_level": "replica"}}}}));
        let no_service = ClusterSeen::Found {
            facts: replica.clone(),
            rw_service: false,
        };
        assert_eq!(
            problem(&r, &no_service, false).unwrap().reason,
            "ClusterServiceMissing"
        );
        let seen = ClusterSeen::Found {
            facts: replica,
            rw_service: true,
        };
        assert_eq!(problem(&r, &seen, false), None, "polling does not care");
        assert_eq!(problem(&r, &seen, true).unwrap().reason, "ClusterWalLevel");
    }

    #[test]
    fn logical_slot_sync_is_read_from_the_high_availability_settings() {
        let on = facts_of(&json!({"metadata": {"name": "o"}, "spec": {"instances": 3,
            "replicationSlots": {"highAvailability": {"synchronizeLogicalDecoding": true}}}}));
        assert!(on.synchronizes_logical_slots);
        assert_eq!(failover_gap(&reference("o"), &on), None);
        let off = facts_of(&json!({"metadata": {"name": "o"}, "spec": {"instances": 2,
            "replicationSlots": {"highAvailability": {"enabled": false,
                                                      "synchronizeLogicalDecoding": true}}}}));
        assert!(!off.synchronizes_logical_slots);
        let (reason, message) = failover_gap(&reference("o"), &off).unwrap();
        assert_eq!(reason, "ClusterSlotSyncOff");
        assert!(
            message.contains("synchronizeLogicalDecoding: true"),
            "{message}"
        );
        let single = facts_of(&json!({"metadata": {"name": "o"}}));
        assert_eq!(
            failover_gap(&reference("o"), &single).unwrap().0,
            "ClusterSingleInstance"
        );
    }

    #[test]
    fn a_managed_role_logs_in_from_parts_with_its_password_encoded() {
        let mut r = reference("orders");
        r.user_secret_name = Some("relay-role".into());
        let login = r.login("shop").unwrap();
        assert_eq!(login.host, "orders-rw.shop");
        assert_eq!((login.port, login.dbname.as_str()), (5432, "app"));
        assert_eq!(login.password.name, "relay-role");
        let url = login.url("relay", "p@ss:w/rd% 'x'");
        let config: tokio_postgres::Config = url.parse().unwrap();
        assert_eq!(config.get_user(), Some("relay"));
        assert_eq!(config.get_password(), Some(&b"p@ss:w/rd% 'x'"[..]));
        assert_eq!(config.get_dbname(), Some("app"));
        // Its own Secret, not the app Secret: a bootstrap secret of the Cluster's own
        // does not matter then.
        let seen = ClusterSeen::Found {
            facts: facts_of(&json!({"metadata": {"name": "orders"},
                "spec": {"bootstrap": {"initdb": {"secret": {"name": "other"}}}}})),
            rw_service: true,
        };
        assert_eq!(problem(&r, &seen, true), None);
        assert_eq!(r.connection().connection_secret_ref.key, "password");
    }

    #[test]
    fn the_connection_is_the_app_uri_verified_against_the_cluster_ca() {
        let pg = reference("orders").connection();
        assert_eq!(pg.connection_secret_ref.name, "orders-app");
        assert_eq!(pg.connection_secret_ref.key, "uri");
        assert_eq!(pg.ssl_mode, crate::api::SslMode::VerifyFull);
        let ca = pg.ca_secret_ref.unwrap();
        assert_eq!((ca.name.as_str(), ca.key.as_str()), ("orders-ca", "ca.crt"));
    }
}
