//! A TCP proxy on loopback for fault tests: it forwards to one server until told to cut
//! the network (every open connection is closed and new ones are refused, as when a
//! link drops and the peers' resets arrive) or to hold it (connections stay open and
//! nothing passes either way, as behind a dead router: no reset ever comes), then to
//! heal. Written here because the fault it plays is the test's own; a few dozen lines
//! of tokio.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const FORWARD: u8 = 0;
const CUT: u8 = 1;
const HOLD: u8 = 2;

/// A running proxy; stops (closing every connection) when dropped.
pub struct TcpProxy {
    /// Where clients connect: `127.0.0.1:<port>`.
    pub addr: SocketAddr,
    state: Arc<AtomicU8>,
    /// Bumped by [`TcpProxy::cut`]: connections of an older generation close.
    generation: watch::Sender<u64>,
    accepted: Arc<AtomicU64>,
    /// Where new connections go (see [`TcpProxy::retarget`]).
    target: Arc<std::sync::Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards to `target` (`host:port`).
    pub async fn start(target: &str) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|err| panic!("proxy: bind: {err}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|err| panic!("proxy: local_addr: {err}"));
        let state = Arc::new(AtomicU8::new(FORWARD));
        let (generation, _) = watch::channel(0u64);
        let accepted = Arc::new(AtomicU64::new(0));
        let target = Arc::new(std::sync::Mutex::new(target.to_owned()));
        let task = {
            let (state, generation, accepted, target) = (
                state.clone(),
                generation.clone(),
                accepted.clone(),
                target.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    if state.load(Ordering::SeqCst) == CUT {
                        drop(client);
                        continue;
                    }
                    accepted.fetch_add(1, Ordering::Relaxed);
                    let state = state.clone();
                    let target = target
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .clone();
                    let closing = generation.subscribe();
                    tokio::spawn(async move {
                        if let Ok(server) = TcpStream::connect(&target).await {
                            pipe(client, server, state, closing).await;
                        }
                    });
                }
            })
        };
        TcpProxy {
            addr,
            state,
            generation,
            accepted,
            target,
            task,
        }
    }

    /// Closes every open connection and refuses new ones until [`TcpProxy::heal`].
    pub fn cut(&self) {
        self.state.store(CUT, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Lets nothing through on open or new connections, and closes none.
    pub fn hold(&self) {
        self.state.store(HOLD, Ordering::SeqCst);
    }

    /// Forwards again (held connections resume; cut ones are gone).
    pub fn heal(&self) {
        self.state.store(FORWARD, Ordering::SeqCst);
    }

    /// Sends new connections to `target` from now on, as a DNS name or a virtual IP
    /// moved to another server would (open connections stay where they are; cut them
    /// to move them).
    pub fn retarget(&self, target: &str) {
        *self
            .target
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = target.to_owned();
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

/// Copies both ways until either side closes or the generation changes (a cut). While
/// held, bytes already read wait in the buffer and nothing more is read.
async fn pipe(
    client: TcpStream,
    server: TcpStream,
    state: Arc<AtomicU8>,
    mut closing: watch::Receiver<u64>,
) {
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = one_way(cr, sw, state.clone());
    let down = one_way(sr, cw, state);
    tokio::select! {
        () = up => {}
        () = down => {}
        _ = closing.changed() => {}
    }
}

async fn one_way(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<AtomicU8>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        while state.load(Ordering::SeqCst) == HOLD {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while state.load(Ordering::SeqCst) == HOLD {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
