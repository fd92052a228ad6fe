use super::*;

/// Settings of a relay whose broker is a closed local port: the clients fail to
/// connect at once, with no name to resolve.
fn unreachable(properties: &[(&str, &str)]) -> KafkaSettings {
    KafkaSettings {
        bootstrap_servers: "127.0.0.1:9".to_owned(),
        topic: "outbox".to_owned(),
        tls: false,
        tls_files: Default::default(),
        sasl: None,
        properties: properties
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

#[tokio::test]
async fn the_chain_steps_producer_comes_with_the_first_chain_step() {
    let broker = KafkaBroker::new(&unreachable(&[])).expect("a producer");
    assert!(broker.batching.existing().is_some());
    // Chains of one message never need it, nor its connections.
    assert!(broker.eager.existing().is_none());
    broker.eager.get().expect("made");
    assert!(broker.eager.existing().is_some());
}

#[tokio::test]
async fn only_three_fatal_producers_of_one_kind_in_a_row_break_the_client() {
    let broker = KafkaBroker::new(&unreachable(&[])).expect("a producer");
    let stop = |slot: &Slot, code| slot.stopped_fatally(code);
    // One cause stopping both kinds' producers, round after round: two rounds are
    // two producers of each kind in a row, not four.
    for _ in 0..2 {
        stop(&broker.batching, RDKafkaErrorCode::InvalidProducerEpoch);
        stop(&broker.eager, RDKafkaErrorCode::InvalidProducerEpoch);
    }
    assert_eq!(broker.broken(), None);
    // A record the broker refused is the row's fault, not the client's.
    broker
        .eager
        .stopped_fatally(RDKafkaErrorCode::GaplessGuarantee);
    assert_eq!(broker.broken(), None, "a gap-less stop counted");
    stop(&broker.eager, RDKafkaErrorCode::ClusterAuthorizationFailed);
    // The reason given is the last producer's, not the refused record's.
    assert_eq!(
        broker.broken().as_deref(),
        Some(
            "3 Kafka producers in a row stopped on a fatal error, the last: \
             ClusterAuthorizationFailed (Broker: Cluster authorization failed)"
        ),
        "the third chain-step producer in a row"
    );
    // An acknowledgement clears both counts (batching stood at 2).
    broker.clear_fatal_counts();
    assert_eq!(broker.broken(), None);
    stop(&broker.batching, RDKafkaErrorCode::InvalidProducerEpoch);
    assert_eq!(
        broker.broken(),
        None,
        "the acknowledgement left the batching count"
    );
    stop(&broker.batching, RDKafkaErrorCode::InvalidProducerEpoch);
    stop(&broker.batching, RDKafkaErrorCode::InvalidProducerEpoch);
    assert!(
        broker
            .broken()
            .is_some_and(|why| why.ends_with("the last: InvalidProducerEpoch (Broker: Producer attempted an operation with an old epoch)")),
        "three batching producers in a row"
    );
}

fn message(payload: &'static [u8]) -> Message {
    Message {
        destination: "orders".to_owned(),
        key: Some("order-1".to_owned()),
        id: "1".to_owned(),
        headers: Vec::new(),
        payload: Some(bytes::Bytes::from_static(payload)),
        timestamp_ms: None,
        partition: None,
        content_type: None,
    }
}

#[tokio::test]
async fn a_producer_whose_message_timed_out_is_replaced_by_the_next_send() {
    let broker = KafkaBroker::new(&unreachable(&[
        ("message.timeout.ms", "200"),
        ("message.max.bytes", "1000"),
    ]))
    .expect("a producer");
    let broker = &broker;
    for (slot, next) in [(&broker.batching, false), (&broker.eager, true)] {
        let send = |payload| {
            let message = message(payload);
            async move {
                if next {
                    broker.publish_next(&message, Step::default()).await
                } else {
                    broker.publish(&message).await
                }
            }
        };
        let before = slot.get().expect("made");
        // Refused at once (larger than message.max.bytes): the producer is fine.
        let err = send(&[b'x'; 2000]).await.expect_err("too large");
        assert!(err.is_refused(), "{err:?}");
        assert!(Arc::ptr_eq(&before, &slot.get().expect("kept")));

        let err = send(b"{}").await.expect_err("nothing listens on port 9");
        assert!(
            !err.is_refused(),
            "an outage, retried without counting: {err:?}"
        );
        assert!(err.message().contains("timed out"), "{}", err.message());
        let after = slot.get().expect("made again");
        assert!(
            !Arc::ptr_eq(&before, &after),
            "the {} producer was kept after a timeout",
            slot.name
        );
        // A send that fails late, on a producer already retired, leaves the new one.
        assert!(!slot.retire(&before));
        assert!(Arc::ptr_eq(&after, &slot.existing().expect("kept")));
        // The retired producer is closed once nothing uses it.
        let retired = Arc::downgrade(&before);
        drop(before);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while retired.upgrade().is_some() {
            assert!(
                std::time::Instant::now() < deadline,
                "the retired {} producer is still open",
                slot.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn nothing_is_queued_on_a_withdrawn_producer() {
    let broker = KafkaBroker::new(&unreachable(&[])).expect("a producer");
    let old = broker.batching.get().expect("made");
    let room_by = tokio::time::Instant::now() + ROOM_WAIT;
    let message = message(b"{}");
    enqueue(&old, record(&message, Some(0)), room_by)
        .await
        .expect("queued");
    assert!(broker.withdraw(&broker.batching, &old));
    // A rest that took the producer before it was withdrawn queues no more on it.
    let refused = enqueue(&old, record(&message, Some(0)), room_by).await;
    assert!(matches!(refused, Err(Failure::Closed)));
    // The next send goes through a new one.
    let new = broker.batching.get().expect("made again");
    assert!(!Arc::ptr_eq(&old, &new));
    enqueue(&new, record(&message, Some(0)), room_by)
        .await
        .expect("queued on the new one");
}

#[tokio::test]
async fn a_chains_rest_stops_at_its_first_unacknowledged_message_and_withdraws_the_producer() {
    let broker = KafkaBroker::new(&unreachable(&[
        ("message.timeout.ms", "300"),
        ("message.max.bytes", "1000"),
    ]))
    .expect("a producer");
    let before = broker.batching.get().expect("made");
    let rest: Vec<Message> = (0..5).map(|_| message(b"{}")).collect();
    let outcomes = broker
        .publish_rest(&rest, Delivered::default(), false, &crate::broker::Clear)
        .await;
    assert_eq!(outcomes.len(), 1, "the rest ends with its first failure");
    let err = outcomes[0].as_ref().expect_err("nothing listens on port 9");
    assert!(
        !err.is_refused() && err.message().contains("timed out"),
        "{err:?}"
    );
    let after = broker.batching.get().expect("made again");
    assert!(!Arc::ptr_eq(&before, &after), "the producer was kept");
    // A rest whose first message is too large for the producer fails at once
    // (tests/relay/relay_partitioning.rs sends one refused in the middle to Kafka).
    let rest = [message(&[b'x'; 2000]), message(b"{}")];
    let outcomes = broker
        .publish_rest(&rest, Delivered::default(), false, &crate::broker::Clear)
        .await;
    assert_eq!(outcomes.len(), 1, "{outcomes:?}");
    let err = outcomes[0].as_ref().expect_err("too large");
    assert!(err.is_refused(), "{err:?}");
}

#[test]
fn the_clusters_configuration_is_no_rows_fault() {
    for code in [
        RDKafkaErrorCode::TopicAuthorizationFailed,
        RDKafkaErrorCode::UnknownTopicOrPartition,
        RDKafkaErrorCode::UnknownTopic,
        RDKafkaErrorCode::UnknownPartition,
        RDKafkaErrorCode::ClusterAuthorizationFailed,
    ] {
        assert!(!is_row_fault(code), "{code:?}");
    }
    for code in [
        RDKafkaErrorCode::MessageSizeTooLarge,
        RDKafkaErrorCode::InvalidTopic,
        RDKafkaErrorCode::InvalidTimestamp,
    ] {
        assert!(is_row_fault(code), "{code:?}");
    }
}
