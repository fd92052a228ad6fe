//! Asking a relay pod why it is not ready: `GET /readyz` on its HTTP port, whose body
//! says why (the broker takes no message, the publication gate holds, the standbys
//! lag, …). The operator holds no broker credentials, so this is how it learns what the
//! relay sees. Best effort: a pod that does not answer within [`ASK_TIMEOUT`] (a
//! NetworkPolicy, a pod just starting) leaves the condition as the pod status tells it.
//! hyper's own client connection, because one request to a known address needs no
//! connection pool.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// How long one pod may take to answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// The most of an answer that is read.
const MAX_ANSWER: usize = 2048;

/// What `/readyz` at `ip:port` answers when it is not ready (its first line); `None`
/// when it is ready or does not answer.
pub(super) async fn why_not_ready(ip: &str, port: u16) -> Option<String> {
    let address = SocketAddr::new(ip.parse::<IpAddr>().ok()?, port);
    let ask = async {
        let stream = TcpStream::connect(address).await.ok()?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .ok()?;
        let driver = tokio::spawn(connection);
        let request = hyper::Request::get("/readyz")
            .header(hyper::header::HOST, address.to_string())
            .body(Empty::<Bytes>::new())
            .ok()?;
        let response = sender.send_request(request).await.ok()?;
        let ready = response.status().is_success();
        let body = Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .ok()?
            .to_bytes();
        driver.abort();
        let text = String::from_utf8_lossy(&body);
        let first = text.lines().next().unwrap_or_default().trim().to_owned();
        (!ready && !first.is_empty()).then_some(first)
    };
    tokio::time::timeout(ASK_TIMEOUT, ask).await.ok().flatten()
}
