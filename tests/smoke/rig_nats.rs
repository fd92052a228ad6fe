//! Smoke test: the rig's NATS server runs JetStream and drops a repeated `Nats-Msg-Id`.

use crate::common;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;

#[tokio::test]
async fn jetstream_flags_a_repeated_message_id_as_duplicate() {
    let stream = common::fresh_stream().await;
    let subject = format!("{}.orders", stream.subject_prefix);
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, "outbox-4711");

    let mut acks = Vec::new();
    for _ in 0..2 {
        let ack = stream
            .jetstream
            .publish_with_headers(subject.clone(), headers.clone(), "payload".into())
            .await
            .unwrap()
            .await
            .unwrap();
        acks.push(ack);
    }
    assert!(
        !acks[0].duplicate,
        "first publish flagged duplicate: {:?}",
        acks[0]
    );
    assert!(
        acks[1].duplicate,
        "second publish not flagged duplicate: {:?}",
        acks[1]
    );
    assert_eq!(acks[0].sequence, acks[1].sequence);
    assert_eq!(acks[0].stream, stream.name);

    let mut handle = stream.jetstream.get_stream(&stream.name).await.unwrap();
    let info = handle.info().await.unwrap();
    assert_eq!(
        info.state.messages, 1,
        "the stream stored the duplicate: {:?}",
        info.state
    );

    let _ = stream.jetstream.delete_stream(&stream.name).await;
}
