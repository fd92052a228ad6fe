//! Smoke test: the rig's PostgreSQL decodes inserts through a `pgoutput` logical replication slot.

use crate::common;

/// One decoded pgoutput message, as far as this test needs it.
#[derive(Debug, PartialEq)]
enum PgOutput {
    Relation {
        relid: u32,
        namespace: String,
        name: String,
    },
    Insert {
        relid: u32,
    },
    Other(u8),
}

/// Decodes the first bytes of a pgoutput (protocol version 1) message.
fn decode(data: &[u8]) -> PgOutput {
    let relid = |bytes: &[u8]| u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
    match data.first() {
        Some(b'R') => {
            // 'R', relid, namespace\0, relname\0, replica identity, columns...
            let mut strings = data[5..].split(|b| *b == 0);
            let mut next =
                || String::from_utf8_lossy(strings.next().unwrap_or_default()).into_owned();
            let namespace = next();
            let name = next();
            PgOutput::Relation {
                relid: relid(data),
                namespace,
                name,
            }
        }
        Some(b'I') => PgOutput::Insert { relid: relid(data) },
        Some(other) => PgOutput::Other(*other),
        None => PgOutput::Other(0),
    }
}

#[tokio::test]
async fn postgres_streams_inserts_through_a_pgoutput_slot() {
    let db = common::fresh_database().await;
    let client = &db.client;

    let wal_level: String = client
        .query_one("SHOW wal_level", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(wal_level, "logical");

    client
        .batch_execute(
            "CREATE TABLE outbox (id bigserial PRIMARY KEY, aggregateid text NOT NULL, payload bytea);
             CREATE PUBLICATION smoke_pub FOR TABLE outbox WITH (publish = 'insert');",
        )
        .await
        .unwrap();

    // Slot names are cluster-wide; the database name is unique. The slot is created on
    // its own statement: PostgreSQL refuses it in a transaction that already wrote.
    let slot = db.name.clone();
    let created: String = client
        .query_one(
            "SELECT slot_name::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(created, slot);

    // Two transactions (a multi-statement simple query is one implicit transaction),
    // and an update that the publication must leave out.
    for sql in [
        "INSERT INTO outbox (aggregateid, payload) VALUES ('a-1', 'one'), ('a-2', 'two')",
        "INSERT INTO outbox (aggregateid, payload) VALUES ('a-1', 'three')",
        "UPDATE outbox SET payload = 'ignored' WHERE id = 1",
    ] {
        client.batch_execute(sql).await.unwrap();
    }

    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                 'proto_version', '1', 'publication_names', 'smoke_pub')",
            &[&slot],
        )
        .await
        .unwrap();
    let messages: Vec<PgOutput> = rows
        .iter()
        .map(|row| decode(&bytes::Bytes::copy_from_slice(row.get::<_, &[u8]>(0))))
        .collect();

    let outbox_relid = messages
        .iter()
        .find_map(|m| match m {
            PgOutput::Relation {
                relid,
                namespace,
                name,
            } if namespace == "public" && name == "outbox" => Some(*relid),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no Relation message for public.outbox in {messages:?}"));
    let inserts = messages
        .iter()
        .filter(|m| {
            **m == PgOutput::Insert {
                relid: outbox_relid,
            }
        })
        .count();
    assert_eq!(
        inserts, 3,
        "expected 3 inserts (updates not published): {messages:?}"
    );
    let commits = messages
        .iter()
        .filter(|m| **m == PgOutput::Other(b'C'))
        .count();
    assert_eq!(
        commits, 2,
        "expected one Commit per inserting transaction: {messages:?}"
    );

    client
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .unwrap();
    let remaining: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        remaining, 0,
        "slot {slot} still listed after pg_drop_replication_slot"
    );

    db.drop_database().await;
}
