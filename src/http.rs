//! The small HTTP server every long-running role (controller, relay) serves:
//! `/metrics` (OpenMetrics), `/healthz` (the role's work loop turns) and `/readyz` (the
//! role's own notion of ready). Written on hyper, which kube already brings, since three fixed
//! routes need no router.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::debug;

/// How a relay's `/readyz` begins when the broker is the reason it is not ready: the
/// controller, which asks unready relay pods why, reports `BrokerUnavailable` then.
pub const BROKER_DOWN_PREFIX: &str = "the broker takes no message: ";

/// What a role exposes over HTTP.
pub trait Probe: Send + Sync + 'static {
    /// Current metrics, OpenMetrics text.
    fn metrics(&self) -> String;
    /// `Ok` when ready for traffic/work; otherwise why not, as the `/readyz` body.
    fn readiness(&self) -> Result<(), String>;
    /// `Ok` while the role's work loop turns; otherwise why not, as the `/healthz` body
    /// (a failing liveness probe has the kubelet restart the container).
    fn liveness(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Binds `addr` (so a port clash fails the start, not a background task) and serves
/// until `stop` resolves. Returns the bound address (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    probe: Arc<dyn Probe>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        tokio::pin!(stop);
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    let probe = probe.clone();
                    tokio::spawn(async move {
                        let service = service_fn(move |req| {
                            let probe = probe.clone();
                            async move { Ok::<_, Infallible>(route(&req, probe.as_ref())) }
                        });
                        if let Err(err) = http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await
                        {
                            debug!(error = %err, "HTTP connection ended with an error");
                        }
                    });
                }
                () = &mut stop => break,
            }
        }
    });
    Ok(bound)
}

fn route(req: &Request<Incoming>, probe: &dyn Probe) -> Response<Full<Bytes>> {
    let text = "text/plain; charset=utf-8";
    let (status, content_type, body) = match req.uri().path() {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            probe.metrics(),
        ),
        "/healthz" => match probe.liveness() {
            Ok(()) => (StatusCode::OK, text, "ok\n".to_owned()),
            Err(why) => (StatusCode::SERVICE_UNAVAILABLE, text, format!("{why}\n")),
        },
        "/readyz" => match probe.readiness() {
            Ok(()) => (StatusCode::OK, text, "ready\n".to_owned()),
            Err(why) => (StatusCode::SERVICE_UNAVAILABLE, text, format!("{why}\n")),
        },
        _ => (StatusCode::NOT_FOUND, text, "not found\n".to_owned()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}
