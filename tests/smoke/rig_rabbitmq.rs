//! Smoke test: the rig's RabbitMQ confirms a persistent message and hands it back with its message id.

use crate::common;

use lapin::BasicProperties;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions,
};

#[tokio::test]
async fn rabbitmq_confirms_and_returns_a_persistent_message() {
    let queue = common::fresh_queue().await;
    let channel = &queue.channel;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();

    let properties = BasicProperties::default()
        .with_message_id("outbox-4711".into())
        .with_delivery_mode(2)
        .with_content_type("application/json".into());
    let confirmation = channel
        .basic_publish(
            "".into(),
            queue.name.clone().into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            br#"{"orderId":17}"#,
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(
        confirmation.is_ack(),
        "broker did not ack: {confirmation:?}"
    );
    assert!(
        confirmation.take_message().is_none(),
        "the message was returned unroutable"
    );

    let got = channel
        .basic_get(queue.name.clone().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("basic_get found the queue empty");
    let props = &got.delivery.properties;
    assert_eq!(
        props.message_id().as_ref().map(|id| id.as_str()),
        Some("outbox-4711")
    );
    assert_eq!(*props.delivery_mode(), Some(2));
    assert_eq!(got.delivery.data, br#"{"orderId":17}"#);

    let _ = channel
        .queue_delete(queue.name.clone().into(), QueueDeleteOptions::default())
        .await;
    let _ = queue.connection.close(200, "done".into()).await;
}
