//! OpenTelemetry spans of publishing (`spec.tracing`): a producer span per message,
//! from sending to the broker's acknowledgement, child of the message's `traceparent`
//! (and `tracestate`) header, exported as OTLP/HTTP JSON by the SDK's batch processor
//! (its own thread; exports never hold up publishing). The message leaves with its
//! `traceparent` set to the publish span, so consumers continue from it.

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span, SpanKind, Status, Tracer, TracerProvider};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, Span as SdkSpan};

use crate::broker::{Broker, BrokerKind, Clearance, Delivered, Message, PublishError, Step};

/// Why the span exporter cannot start.
#[derive(Debug, thiserror::Error)]
pub enum TracesError {
    /// The OTLP exporter cannot be built for the endpoint.
    #[error("OTLP exporter to {endpoint}: {error}")]
    Exporter {
        /// `spec.tracing.otlpEndpoint`.
        endpoint: String,
        /// The exporter's reason.
        error: opentelemetry_otlp::ExporterBuildError,
    },
}

/// The exporter of a relay's spans; [`Traces::shutdown`] sends what is left.
pub struct Traces {
    provider: SdkTracerProvider,
}

impl Traces {
    /// Starts exporting to `<endpoint>/v1/traces`. Blocking (the HTTP client starts a
    /// thread): call it from `spawn_blocking`.
    pub fn start(
        tracing: &crate::spec::Tracing,
        namespace: &str,
        name: &str,
    ) -> Result<(Self, SdkTracer), TracesError> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .with_endpoint(format!("{}/v1/traces", tracing.otlp_endpoint))
            .with_timeout(std::time::Duration::from_secs(5))
            .build()
            .map_err(|error| TracesError::Exporter {
                endpoint: tracing.otlp_endpoint.clone(),
                error,
            })?;
        let resource = Resource::builder()
            .with_service_name(tracing.service_name.clone())
            .with_attributes([
                KeyValue::new("k8s.namespace.name", namespace.to_owned()),
                KeyValue::new("outbox.relay", name.to_owned()),
            ])
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("outbox-operator");
        Ok((Self { provider }, tracer))
    }

    /// Sends the spans still queued and stops. Blocking.
    pub fn shutdown(self) {
        if let Err(err) = self.provider.shutdown() {
            tracing::warn!(error = %err, "sending the last spans failed");
        }
    }
}

/// A broker whose publishes are spans.
pub struct TracedBroker {
    inner: Arc<dyn Broker>,
    tracer: SdkTracer,
    system: &'static str,
}

impl TracedBroker {
    /// Wraps `inner` (a `kind` broker).
    pub fn new(inner: Arc<dyn Broker>, tracer: SdkTracer, kind: BrokerKind) -> Self {
        let system = match kind {
            BrokerKind::Kafka => "kafka",
            BrokerKind::Nats => "nats",
            BrokerKind::Amqp => "rabbitmq",
        };
        Self {
            inner,
            tracer,
            system,
        }
    }
}

/// The trace a message continues: its `traceparent` and `tracestate` headers (W3C
/// Trace Context); an empty context (a new trace) without a valid `traceparent`.
pub fn parent_context(headers: &[(String, String)]) -> Context {
    let carrier: HashMap<String, String> = headers
        .iter()
        .filter(|(k, _)| k == "traceparent" || k == "tracestate")
        .cloned()
        .collect();
    TraceContextPropagator::new().extract(&carrier)
}

impl TracedBroker {
    /// Starts `message`'s producer span, and returns it with the message to send: a
    /// copy whose `traceparent` names the span.
    fn start(&self, message: &Message) -> (SdkSpan, Message) {
        let parent = parent_context(&message.headers);
        let span = self
            .tracer
            .span_builder(format!("send {}", message.destination))
            .with_kind(SpanKind::Producer)
            .with_attributes(vec![
                KeyValue::new("messaging.system", self.system),
                KeyValue::new("messaging.operation.type", "send"),
                KeyValue::new("messaging.destination.name", message.destination.clone()),
                KeyValue::new("messaging.message.id", message.id.clone()),
            ])
            .start_with_context(&self.tracer, &parent);
        // The message carries the publish span on, as the messaging conventions say: a
        // consumer's span becomes its child (tracestate travels as it was).
        let context = span.span_context().clone();
        let traceparent = format!(
            "00-{}-{}-{:02x}",
            context.trace_id(),
            context.span_id(),
            context.trace_flags().to_u8()
        );
        let mut sent = message.clone();
        match sent.headers.iter_mut().find(|(k, _)| k == "traceparent") {
            Some((_, v)) => *v = traceparent,
            None => sent.headers.push(("traceparent".to_owned(), traceparent)),
        }
        (span, sent)
    }

    /// Ends `message`'s span with its outcome (`None`: not sent).
    fn finish(
        mut span: SdkSpan,
        message: &Message,
        outcome: Option<&Result<Delivered, PublishError>>,
    ) {
        match outcome {
            Some(Ok(_)) => {}
            Some(Err(err)) => {
                span.set_status(Status::error(err.message().into_owned()));
                let context = span.span_context();
                tracing::warn!(
                    trace_id = %context.trace_id(),
                    span_id = %context.span_id(),
                    message_id = %message.id,
                    destination = %message.destination,
                    error = %err,
                    "publish failed"
                );
            }
            // Its failed predecessor was logged.
            None => span.set_status(Status::error(format!(
                "not sent: {}",
                crate::relay::chains::BEHIND_A_FAILURE
            ))),
        }
        span.end();
    }

    /// Publishes `message` in a producer span, through the inner broker's `publish`, or
    /// its `publish_next` for a chain's next message.
    fn traced<'a>(
        &'a self,
        message: &'a Message,
        after: Option<Step>,
    ) -> BoxFuture<'a, Result<Delivered, PublishError>> {
        Box::pin(async move {
            let (span, sent) = self.start(message);
            let result = match after {
                Some(step) => self.inner.publish_next(&sent, step).await,
                None => self.inner.publish(&sent).await,
            };
            Self::finish(span, message, Some(&result));
            result
        })
    }
}

impl Broker for TracedBroker {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
    ) -> BoxFuture<'a, Result<Delivered, PublishError>> {
        self.traced(message, None)
    }

    fn publish_next<'a>(
        &'a self,
        message: &'a Message,
        step: Step,
    ) -> BoxFuture<'a, Result<Delivered, PublishError>> {
        self.traced(message, Some(step))
    }

    /// Each message in a span of its own, the rest sent together as the inner broker
    /// sends it.
    fn publish_rest<'a>(
        &'a self,
        messages: &'a [Message],
        after: Delivered,
        crowded: bool,
        clearance: &'a dyn Clearance,
    ) -> BoxFuture<'a, Vec<Result<Delivered, PublishError>>> {
        Box::pin(async move {
            let (spans, sent): (Vec<SdkSpan>, Vec<Message>) =
                messages.iter().map(|m| self.start(m)).unzip();
            let outcomes = self
                .inner
                .publish_rest(&sent, after, crowded, clearance)
                .await;
            for (i, (span, message)) in spans.into_iter().zip(messages).enumerate() {
                Self::finish(span, message, outcomes.get(i));
            }
            outcomes
        })
    }

    fn broken(&self) -> Option<String> {
        self.inner.broken()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceContextExt;

    #[tokio::test]
    async fn a_chains_next_messages_keep_their_way_through_the_span() {
        use opentelemetry::trace::TracerProvider as _;
        let inner = Arc::new(crate::relay::chains::recording::Recorder::default());
        let tracer = SdkTracerProvider::builder().build().tracer("test");
        let traced = TracedBroker::new(inner.clone(), tracer, BrokerKind::Kafka);
        let message = |id: &str| Message {
            destination: "t".to_owned(),
            key: None,
            id: id.to_owned(),
            headers: Vec::new(),
            payload: None,
            timestamp_ms: None,
            partition: None,
            content_type: None,
        };
        traced.publish(&message("1")).await.unwrap();
        traced
            .publish_next(&message("2"), Step::default())
            .await
            .unwrap();
        // The rest of a chain reaches the inner broker together, as it was given.
        let rest = [message("3"), message("4")];
        let outcomes = traced
            .publish_rest(&rest, Delivered::default(), false, &crate::broker::Clear)
            .await;
        assert_eq!(outcomes.len(), 2);
        assert_eq!(*inner.rests.lock().unwrap(), vec![2]);
        assert_eq!(
            *inner.sent.lock().unwrap(),
            vec![
                ("1".to_owned(), false),
                ("2".to_owned(), true),
                ("3".to_owned(), true),
                ("4".to_owned(), true)
            ]
        );
    }

    #[test]
    fn the_parent_is_the_messages_traceparent() {
        let headers = vec![
            ("id".to_owned(), "1".to_owned()),
            (
                "traceparent".to_owned(),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
            ),
            ("tracestate".to_owned(), "vendor=x".to_owned()),
        ];
        let cx = parent_context(&headers);
        let parent = cx.span().span_context().clone();
        assert!(parent.is_valid() && parent.is_remote() && parent.is_sampled());
        assert_eq!(
            parent.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(parent.span_id().to_string(), "00f067aa0ba902b7");
        assert_eq!(parent.trace_state().get("vendor"), Some("x"));
        for broken in ["", "garbage", "00-0000-00f067aa0ba902b7-01"] {
            let cx = parent_context(&[("traceparent".to_owned(), broken.to_owned())]);
            assert!(!cx.span().span_context().is_valid(), "{broken}");
        }
    }
}
