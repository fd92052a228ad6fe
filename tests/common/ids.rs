//! The tests' outbox table with uuid message ids, and how a message is matched to the
//! application writer's ledger whatever the id.

use std::collections::HashMap;

use super::create_outbox_table;

/// The number the writer's ledger knows a message by: its integer `id` header; on the
/// uuid table ([`OutboxIds::Uuid`]), the `seq` the table stamped into the payload,
/// once the payload's `event_id` is seen to be the message's id.
pub fn ledger_number(headers: &HashMap<String, String>, payload: &[u8], broker: &str) -> i64 {
    let header = headers
        .get("id")
        .unwrap_or_else(|| panic!("{broker} message without an id header"));
    if let Ok(id) = header.parse() {
        return id;
    }
    let body: serde_json::Value = serde_json::from_slice(payload).unwrap_or_default();
    assert_eq!(
        body["event_id"].as_str(),
        Some(header.as_str()),
        "{broker} message {header}: not the row its payload was stamped by"
    );
    body["seq"]
        .as_i64()
        .unwrap_or_else(|| panic!("{broker} message {header}: no integer id and no seq"))
}

/// The id column of the tests' outbox table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutboxIds {
    /// `id bigserial`: the message id.
    Bigint,
    /// `event_id uuid DEFAULT gen_random_uuid()` is the message id (`table.columns.id`);
    /// `id bigserial` stays as the number the writer's ledger counts by, stamped into
    /// each payload as `seq` with the row's `event_id` (see [`ledger_number`]).
    Uuid,
}

impl OutboxIds {
    /// `spec.table` of a relay on the table.
    pub fn table_spec(self) -> serde_json::Value {
        match self {
            OutboxIds::Bigint => serde_json::json!({}),
            OutboxIds::Uuid => serde_json::json!({"columns": {"id": "event_id"}}),
        }
    }
}

/// [`create_outbox_table`] with ids of `ids`: for [`OutboxIds::Uuid`], a random uuid
/// message id, `created_at DEFAULT clock_timestamp()` (what the poller orders uuid rows
/// by) and its index.
pub async fn create_outbox_table_with(
    client: &tokio_postgres::Client,
    partitions: i32,
    ids: OutboxIds,
) {
    if ids == OutboxIds::Bigint {
        return create_outbox_table(client, partitions).await;
    }
    client
        .batch_execute(&format!(
            "CREATE TABLE public.outbox (
                id bigserial NOT NULL UNIQUE,
                event_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
                aggregatetype text NOT NULL,
                aggregateid text NOT NULL,
                type text NOT NULL,
                payload jsonb,
                traceparent text,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                published_at timestamptz);
             CREATE FUNCTION public.outbox_stamp() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                NEW.payload := coalesce(NEW.payload, '{{}}'::jsonb)
                    || jsonb_build_object('seq', NEW.id, 'event_id', NEW.event_id::text);
                RETURN NEW;
             END $$;
             CREATE TRIGGER outbox_stamp BEFORE INSERT ON public.outbox
                FOR EACH ROW EXECUTE FUNCTION public.outbox_stamp();
             CREATE INDEX outbox_unpublished_p{partitions} ON public.outbox
                (((hashtextextended(coalesce(\"aggregateid\"::text, ''), 0) & 9223372036854775807) % {partitions}), \"created_at\", \"event_id\")
                WHERE \"published_at\" IS NULL;"
        ))
        .await
        .unwrap_or_else(|err| panic!("PostgreSQL: creating the uuid outbox table failed: {err}"));
}
