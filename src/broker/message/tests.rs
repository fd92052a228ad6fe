use super::*;

fn row() -> OutboxRow {
    OutboxRow {
        id: 42.into(),
        aggregate_type: "Order".into(),
        aggregate_id: Some("o-1".into()),
        event_type: Some("OrderCreated".into()),
        payload: Some(bytes::Bytes::from_static(br#"{"a":1}"#)),
        extra: vec![ColumnValue::new(
            "traceparent",
            "00-abc-01".into(),
            ValueKind::Text,
        )],
        partition: 1,
        created_at: None,
        timestamp: None,
    }
}

/// A shape placing `traceparent` as a header, as `table.headers: [traceparent]`.
fn traced(kind: BrokerKind, template: &str) -> Shape {
    Shape {
        placed: vec![super::Placed {
            column: "traceparent".into(),
            placement: Placement::Header,
            name: "traceparent".into(),
        }],
        ..Shape::new(kind, template)
    }
}

#[test]
fn a_row_becomes_a_message_with_id_key_and_headers() {
    let m = traced(BrokerKind::Kafka, "outbox.event.{aggregateType}")
        .build(&row())
        .unwrap();
    assert_eq!(m.destination, "outbox.event.Order");
    assert_eq!(m.key.as_deref(), Some("o-1"));
    assert_eq!(m.id, "42");
    assert_eq!(m.payload.as_deref(), Some(&br#"{"a":1}"#[..]));
    assert_eq!(m.timestamp_ms, None);
    assert_eq!(
        m.headers,
        vec![
            ("id".into(), "42".into()),
            ("type".into(), "OrderCreated".into()),
            ("aggregateType".into(), "Order".into()),
            ("traceparent".into(), "00-abc-01".into()),
        ]
    );
}

#[test]
fn names_the_broker_refuses_are_row_faults() {
    let mut r = row();
    r.aggregate_type = "has space".into();
    let err = Shape::new(BrokerKind::Kafka, "{aggregateType}")
        .build(&r)
        .unwrap_err();
    assert!(
        err.is_refused() && err.message().contains("row 42"),
        "{err}"
    );
    let err = Shape::new(BrokerKind::Nats, "outbox.{aggregateType}")
        .build(&r)
        .unwrap_err();
    assert!(err.is_refused(), "{err}");
    r.aggregate_type = String::new();
    assert!(
        Shape::new(BrokerKind::Nats, "outbox.{aggregateType}")
            .build(&r)
            .is_err()
    );
    assert!(
        Shape::new(BrokerKind::Amqp, "{aggregateType}")
            .build(&r)
            .is_ok()
    );
    r.aggregate_type = "x".repeat(300);
    assert!(
        Shape::new(BrokerKind::Amqp, "{aggregateType}")
            .build(&r)
            .is_err()
    );
}

#[test]
fn nats_headers_cannot_break_lines() {
    let mut r = row();
    r.extra = vec![ColumnValue::new(
        "traceparent",
        "a\r\nb".into(),
        ValueKind::Text,
    )];
    assert!(
        traced(BrokerKind::Nats, "o.{aggregateType}")
            .build(&r)
            .is_err()
    );
    assert!(
        traced(BrokerKind::Kafka, "o.{aggregateType}")
            .build(&r)
            .is_ok()
    );
    // A column not placed as a header is not checked.
    assert!(
        Shape::new(BrokerKind::Nats, "o.{aggregateType}")
            .build(&r)
            .is_ok()
    );
}

/// `spec.message`'s options: tombstones, timestamps, placed columns and CloudEvents.
mod shape {
    use super::super::*;

    fn row(payload: Option<&'static [u8]>) -> OutboxRow {
        OutboxRow {
            id: 7.into(),
            aggregate_type: "Order".into(),
            aggregate_id: Some("o-1".into()),
            event_type: None,
            payload: payload.map(bytes::Bytes::from_static),
            extra: Vec::new(),
            partition: 0,
            created_at: Some(1_700_000_000.123_9),
            timestamp: None,
        }
    }

    #[test]
    fn a_null_payload_is_a_tombstone_and_a_blank_one_only_when_asked() {
        let plain = Shape::new(BrokerKind::Kafka, "t");
        let asked = Shape {
            tombstone_on_empty_payload: true,
            ..plain.clone()
        };
        assert_eq!(plain.build(&row(None)).unwrap().payload, None);
        assert_eq!(asked.build(&row(None)).unwrap().payload, None);
        for blank in [&b""[..], b"  ", b"\n\t "] {
            assert_eq!(
                plain.build(&row(Some(blank))).unwrap().payload.as_deref(),
                Some(blank),
                "{blank:?} is sent as stored by default"
            );
            assert_eq!(asked.build(&row(Some(blank))).unwrap().payload, None);
        }
        assert_eq!(
            asked.build(&row(Some(b" {} "))).unwrap().payload.as_deref(),
            Some(&b" {} "[..])
        );
    }

    #[test]
    fn the_timestamp_is_the_event_time_else_the_created_or_commit_time() {
        let shape = Shape::new(BrokerKind::Kafka, "t");
        let mut r = row(Some(b"{}"));
        assert_eq!(
            shape.build(&r).unwrap().timestamp_ms,
            Some(1_700_000_000_123)
        );
        r.timestamp = Some(1_600_000_000.5);
        assert_eq!(
            shape.build(&r).unwrap().timestamp_ms,
            Some(1_600_000_000_500)
        );
        // Kafka has no time before 1970: falls back like NULL.
        r.timestamp = Some(-0.0005);
        assert_eq!(
            shape.build(&r).unwrap().timestamp_ms,
            Some(1_700_000_000_123)
        );
        r.created_at = Some(-1.0);
        assert_eq!(shape.build(&r).unwrap().timestamp_ms, None);
        // Year 10000 and later: no RFC 3339 form, falls back like NULL.
        r.timestamp = Some(253_402_300_800.0);
        r.created_at = Some(253_402_300_799.5);
        assert_eq!(
            shape.build(&r).unwrap().timestamp_ms,
            Some(253_402_300_799_500)
        );
        r.created_at = Some(1e15);
        assert_eq!(shape.build(&r).unwrap().timestamp_ms, None);
        r.timestamp = None;
        r.created_at = None;
        assert_eq!(shape.build(&r).unwrap().timestamp_ms, None);
    }

    fn placed(column: &str, placement: Placement, name: &str) -> super::Placed {
        super::Placed {
            column: column.into(),
            placement,
            name: name.into(),
        }
    }

    fn with_extra(payload: Option<&'static [u8]>) -> OutboxRow {
        OutboxRow {
            extra: vec![
                ColumnValue::new("event_type", "OrderCreated".into(), ValueKind::Text),
                ColumnValue::new("version", "3".into(), ValueKind::Number),
                ColumnValue::new("urgent", "t".into(), ValueKind::Boolean),
                ColumnValue::new("ratio", "NaN".into(), ValueKind::Number),
                ColumnValue::new("quote", "say \"hi\"\n".into(), ValueKind::Text),
                ColumnValue::new("part", "2".into(), ValueKind::Number),
            ],
            ..row(payload)
        }
    }

    #[test]
    fn placed_columns_go_to_headers_under_their_alias() {
        let shape = Shape {
            placed: vec![
                placed("event_type", Placement::Header, "eventType"),
                placed("urgent", Placement::Header, "urgent"),
                placed("missing", Placement::Header, "absent"),
            ],
            ..Shape::new(BrokerKind::Kafka, "t")
        };
        let m = shape.build(&with_extra(Some(b"{}"))).unwrap();
        assert_eq!(
            &m.headers[1..],
            &[
                ("aggregateType".to_owned(), "Order".to_owned()),
                ("eventType".to_owned(), "OrderCreated".to_owned()),
                // Booleans read the same in both modes (`t` from the stream).
                ("urgent".to_owned(), "true".to_owned()),
            ]
        );
        assert_eq!(m.payload.as_deref(), Some(&b"{}"[..]));
    }

    #[test]
    fn envelope_fields_wrap_the_payload_as_the_router_does() {
        let mut shape = Shape {
            placed: vec![
                placed("event_type", Placement::Envelope, "type"),
                placed("version", Placement::Envelope, "version"),
                placed("urgent", Placement::Envelope, "urgent"),
                placed("ratio", Placement::Envelope, "ratio"),
                placed("quote", Placement::Envelope, "quote"),
                placed("missing", Placement::Envelope, "gone"),
            ],
            ..Shape::new(BrokerKind::Kafka, "t")
        };
        let value = |shape: &Shape, payload| {
            let m = shape.build(&with_extra(payload)).unwrap();
            m.payload.map(|p| String::from_utf8(p.to_vec()).unwrap())
        };
        let fields = r#""type":"OrderCreated","version":3,"urgent":true,"ratio":"NaN","quote":"say \"hi\"\n","gone":null}"#;
        assert_eq!(
            value(&shape, Some(br#"{"a": 1}"#)).unwrap(),
            format!(r#"{{"payload":"{{\"a\": 1}}",{fields}"#)
        );
        // A NULL payload is a null field, not a tombstone.
        assert_eq!(
            value(&shape, None).unwrap(),
            format!(r#"{{"payload":null,{fields}"#)
        );
        shape.expand_json_payload = true;
        assert_eq!(
            value(&shape, Some(br#"{"a": 1}"#)).unwrap(),
            format!(r#"{{"payload":{{"a": 1}},{fields}"#)
        );
        // Not JSON, or not starting with `{` or `[`: stays a string.
        assert_eq!(
            value(&shape, Some(b"{oops")).unwrap(),
            format!(r#"{{"payload":"{{oops",{fields}"#)
        );
        assert_eq!(
            value(&shape, Some(b" {}")).unwrap(),
            format!(r#"{{"payload":" {{}}",{fields}"#)
        );
        for v in [value(&shape, Some(br#"{"a": 1}"#)), value(&shape, None)] {
            let parsed: serde_json::Value = serde_json::from_str(&v.unwrap()).unwrap();
            assert_eq!(parsed["version"], 3);
        }
        // With the option, an empty payload is a tombstone even with an envelope.
        shape.tombstone_on_empty_payload = true;
        assert_eq!(value(&shape, None), None);
        assert_eq!(value(&shape, Some(b" ")), None);
    }

    #[test]
    fn a_partition_column_chooses_the_kafka_partition() {
        let shape = Shape {
            placed: vec![placed("part", Placement::Partition, "part")],
            ..Shape::new(BrokerKind::Kafka, "t")
        };
        assert_eq!(shape.build(&with_extra(None)).unwrap().partition, Some(2));
        assert_eq!(shape.build(&row(None)).unwrap().partition, None);
        let mut r = with_extra(None);
        r.extra[5].text = "-1".into();
        let err = shape.build(&r).unwrap_err();
        assert!(
            err.is_refused() && err.message().contains("partition column part"),
            "{err}"
        );
    }

    fn cloud(mode: crate::api::CloudEventsMode, kind: BrokerKind) -> Shape {
        Shape {
            cloud_events: Some(CloudEvents {
                mode,
                source: "/outboxrelays/shop/orders".into(),
                data_content_type: "application/json".into(),
            }),
            ..Shape::new(kind, "t")
        }
    }

    fn typed(payload: Option<&'static [u8]>) -> OutboxRow {
        OutboxRow {
            event_type: Some("OrderCreated".into()),
            ..row(payload)
        }
    }

    #[test]
    fn binary_cloud_events_use_each_bindings_header_names() {
        use crate::api::CloudEventsMode::Binary;
        for (kind, prefix) in [
            (BrokerKind::Kafka, "ce_"),
            (BrokerKind::Nats, "ce-"),
            (BrokerKind::Amqp, "cloudEvents_"),
        ] {
            let m = cloud(Binary, kind).build(&typed(Some(b"{}"))).unwrap();
            let header = |n: &str| {
                m.headers
                    .iter()
                    .find(|(k, _)| *k == format!("{prefix}{n}"))
                    .map(|(_, v)| v.as_str())
            };
            assert_eq!(header("specversion"), Some("1.0"));
            assert_eq!(header("id"), Some("7"));
            assert_eq!(header("source"), Some("/outboxrelays/shop/orders"));
            assert_eq!(header("type"), Some("OrderCreated"));
            assert_eq!(header("subject"), Some("o-1"));
            assert_eq!(header("time"), Some("2023-11-14T22:13:20.123Z"));
            assert_eq!(m.content_type.as_deref(), Some("application/json"));
            // Kafka and NATS carry the media type as a header; AMQP as its property.
            let content_header = m.headers.iter().any(|(k, _)| k == "content-type");
            assert_eq!(content_header, kind != BrokerKind::Amqp, "{kind:?}");
            assert_eq!(m.payload.as_deref(), Some(&b"{}"[..]));
        }
    }

    #[test]
    fn structured_cloud_events_embed_json_data_and_encode_the_rest() {
        use crate::api::CloudEventsMode::Structured;
        let shape = cloud(Structured, BrokerKind::Kafka);
        let event = |payload| {
            let m = shape.build(&typed(payload)).unwrap();
            assert_eq!(m.content_type.as_deref(), Some(CLOUDEVENTS_JSON));
            let body = m.payload.unwrap();
            serde_json::from_slice::<serde_json::Value>(&body).unwrap()
        };
        let e = event(Some(br#"{"a": [1, 2]}"#));
        assert_eq!(e["specversion"], "1.0");
        assert_eq!(e["id"], "7");
        assert_eq!(e["type"], "OrderCreated");
        assert_eq!(e["datacontenttype"], "application/json");
        assert_eq!(e["data"], serde_json::json!({"a": [1, 2]}));
        assert_eq!(event(Some(b"not json"))["data"], "not json");
        assert_eq!(event(Some(&[0xff, 0x00]))["data_base64"], "/wA=");
        let none = event(None);
        assert!(none.get("data").is_none() && none.get("data_base64").is_none());
    }

    #[test]
    fn an_event_without_a_type_is_a_refused_row() {
        let shape = cloud(crate::api::CloudEventsMode::Binary, BrokerKind::Nats);
        let err = shape.build(&row(Some(b"{}"))).unwrap_err();
        assert!(
            err.is_refused() && err.message().contains("needs a type"),
            "{err}"
        );
    }
}
