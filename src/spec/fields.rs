//! Rules of the spec's lists of names: the extra columns a message carries
//! (`table.additionalFields`), the archive table and the standby slots log tailing
//! waits for.

use super::Problems;
use crate::rules::{RESERVED_HEADERS, check_identifier, check_slot_name};

/// The rules of `table.additionalFields` (Debezium's
/// `table.fields.additional.placement`), with the headers beside them.
pub(super) fn check_additional_fields(
    p: &mut Problems,
    t: &crate::api::TableSpec,
    broker: Option<crate::api::Broker<'_>>,
) {
    use crate::api::Placement;
    let field_name = regex_like_field_name;
    let mut headers: Vec<&str> = t.headers.iter().map(String::as_str).collect();
    let mut envelope: Vec<&str> = Vec::new();
    let mut partitions = 0;
    for (i, f) in t.additional_fields.iter().enumerate() {
        let at = format!("spec.table.additionalFields[{i}]");
        identifier(p, &format!("{at}.column"), &f.column);
        let name = f.alias.as_deref().unwrap_or(&f.column);
        if let Some(alias) = &f.alias
            && !field_name(alias)
        {
            p.push(
                format!("{at}.as"),
                format!("`{alias}` is not a header or field name"),
                "use letters, digits, '_', '.' and '-' (at most 100), starting with a letter, digit or '_'",
            );
        }
        match f.placement {
            Placement::Header => {
                let lower = name.to_ascii_lowercase();
                let bound = lower == "content-type"
                    || ["ce_", "ce-", "cloudevents_"]
                        .iter()
                        .any(|p| lower.starts_with(p));
                if bound {
                    p.push(
                        &at,
                        format!("`{name}` is a header the CloudEvents bindings define"),
                        "give the header another name with `as`",
                    );
                } else if RESERVED_HEADERS.contains(&name) {
                    p.push(
                        &at,
                        format!("`{name}` is a header the relay sets itself"),
                        "give the header another name with `as`",
                    );
                } else if headers.contains(&name) {
                    p.push(
                        &at,
                        format!("header `{name}` is placed twice"),
                        "give one of them another name with `as`",
                    );
                }
                headers.push(name);
            }
            Placement::Envelope => {
                if name == "payload" {
                    p.push(
                        &at,
                        "`payload` is the envelope's field for the payload itself",
                        "give the field another name with `as`",
                    );
                } else if envelope.contains(&name) {
                    p.push(
                        &at,
                        format!("envelope field `{name}` is placed twice"),
                        "give one of them another name with `as`",
                    );
                }
                envelope.push(name);
            }
            Placement::Partition => {
                partitions += 1;
                if f.alias.is_some() {
                    p.push(
                        format!("{at}.as"),
                        "a partition placement takes no alias",
                        "remove `as`",
                    );
                }
                if partitions > 1 {
                    p.push(&at, "a second partition placement", "keep one");
                }
                if broker.is_some_and(|b| !matches!(b, crate::api::Broker::Kafka(_))) {
                    p.push(
                        &at,
                        "only Kafka has partitions",
                        "remove it, or place the column as a header",
                    );
                }
            }
        }
    }
    if t.headers.len() + t.additional_fields.len() > 32 {
        p.push(
            "spec.table.additionalFields",
            format!(
                "{} extra columns with spec.table.headers; at most 32",
                t.headers.len() + t.additional_fields.len()
            ),
            "place fewer columns",
        );
    }
}

/// Whether `name` matches [`crate::api::FIELD_NAME_PATTERN`].
fn regex_like_field_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_');
    first_ok
        && name.len() <= 100
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

pub(super) fn identifier(p: &mut Problems, field: &str, value: &str) {
    if let Err(message) = check_identifier(value) {
        p.push(
            field,
            message,
            "use letters, digits and _ (the name is quoted in SQL exactly as written)",
        );
    }
}

/// `spec.table.archive`, its names defaulted, where the mode moves published rows
/// there: polling with `afterPublish: archive` (archive or not defaulted) and log tailing
/// with `deleteAfterPublish`. Anywhere else the archive would never be written: said.
pub(super) fn archive(
    spec: &crate::api::OutboxRelaySpec,
    mode: Option<&super::ValidMode>,
    p: &mut Problems,
) -> Option<super::Archive> {
    use super::ValidMode;
    use crate::api::AfterPublish;
    let t = &spec.table;
    let archives = match mode? {
        ValidMode::Polling(poll) => poll.after_publish == AfterPublish::Archive,
        ValidMode::LogTailing(lt) => t.archive.is_some() && lt.delete_after_publish,
    };
    if !archives {
        if t.archive.is_some() {
            let (why, fix) = match mode? {
                ValidMode::Polling(_) => (
                    "polling moves published rows to the archive only with afterPublish: archive",
                    "set spec.mode.polling.afterPublish: archive, or remove spec.table.archive",
                ),
                ValidMode::LogTailing(_) => (
                    "log tailing keeps published rows in the table (deleteAfterPublish: false), so none is archived",
                    "set deleteAfterPublish: true, or remove spec.table.archive",
                ),
            };
            p.push("spec.table.archive", why, fix);
        }
        return None;
    }
    let given = t.archive.clone().unwrap_or_default();
    let archive = super::Archive {
        schema: given.schema.unwrap_or_else(|| t.schema.clone()),
        name: given.name.unwrap_or_else(|| format!("{}_archive", t.name)),
    };
    identifier(p, "spec.table.archive.schema", &archive.schema);
    identifier(p, "spec.table.archive.name", &archive.name);
    if (archive.schema.as_str(), archive.name.as_str()) == (t.schema.as_str(), t.name.as_str()) {
        p.push(
            "spec.table.archive",
            "names the outbox table itself",
            "name another table (by default <table>_archive)",
        );
    }
    Some(archive)
}

/// `synchronizedStandbySlots`: physical slot names, each once.
pub(super) fn standby_slots(p: &mut Problems, names: &[String]) -> Vec<String> {
    for (i, name) in names.iter().enumerate() {
        let at = format!("spec.mode.logTailing.synchronizedStandbySlots[{i}]");
        if let Err(message) = check_slot_name(name) {
            p.push(
                &at,
                message,
                "name the standby's physical replication slot (pg_replication_slots.slot_name on the primary)",
            );
        } else if names[..i].contains(name) {
            p.push(&at, format!("`{name}` is named twice"), "name it once");
        }
    }
    names.to_vec()
}
