//! The operator's small HTTP server: `/metrics` (OpenMetrics), `/healthz` and `/readyz`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::debug;

use super::{Error, Metrics};

/// Binds `addr` and serves until `stop` turns true; returns the bound address (useful
/// with port 0).
pub(super) async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) -> Result<SocketAddr, Error> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Listen { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| Error::Listen { addr, source })?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    let metrics = metrics.clone();
                    tokio::spawn(async move {
                        let service = service_fn(move |req| respond(req, metrics.clone()));
                        if let Err(err) = http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await
                        {
                            debug!(error = %err, "metrics connection ended with an error");
                        }
                    });
                }
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    });
    Ok(bound)
}

async fn respond(
    req: Request<Incoming>,
    metrics: Arc<Metrics>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, content_type, body) = match req.uri().path() {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        // The process answers, so it is alive; readiness does not depend on leadership
        // (standbys are healthy replicas too).
        "/healthz" | "/readyz" => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found\n".to_owned(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    Ok(response)
}
