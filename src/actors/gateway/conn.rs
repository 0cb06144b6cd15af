//! The gateway's accept loop: HTTP/1.1 through hyper's connection builder, so that the
//! deadlines are hyper's own settings rather than timers of ours.
//!
//! - **Connection cap**: at most `gateway.max_connections` open; one more gets a `503` with an
//!   OpenAI error body and `Connection: close`, written without waiting, and is closed.
//!   `flotilla_http_connections_open` (gauge) and `flotilla_http_connections_refused_total`
//!   (counter) say so.
//! - **Idle**: a new connection must send its first byte within `gateway.idle_timeout_ms`.
//! - **Head**: then its request line and headers must be complete within
//!   `gateway.request_header_timeout_ms` (hyper `http1::Builder::header_read_timeout`; on a
//!   kept-alive connection hyper counts it from the end of the previous response).
//! - **Body**: read by the routes under `gateway.request_body_timeout_ms` (`serve::read_body`,
//!   408).
//!
//! None of these applies while a response is being written, so a long stream is never cut.
//! Stopping: `stop` ends the accept loop (the listener is dropped at once), then open
//! connections finish their in-flight responses (hyper graceful shutdown); aborting the task
//! aborts every connection.

use crate::request_plane::gateway::GatewayConfig;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

#[cfg(test)]
mod tests;

/// The connection limits (from `gateway.*`).
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// `gateway.request_header_timeout_ms`.
    pub header_timeout: Duration,
    /// `gateway.idle_timeout_ms`.
    pub idle_timeout: Duration,
    /// `gateway.max_connections`.
    pub max_connections: usize,
}

impl From<&GatewayConfig> for ConnLimits {
    fn from(g: &GatewayConfig) -> Self {
        Self {
            header_timeout: Duration::from_millis(g.request_header_timeout_ms),
            idle_timeout: Duration::from_millis(g.idle_timeout_ms),
            max_connections: g.max_connections,
        }
    }
}

/// Keeps `flotilla_http_connections_open` up to date for one connection.
struct OpenConn;

impl OpenConn {
    fn new() -> Self {
        metrics::gauge!("flotilla_http_connections_open").increment(1.0);
        Self
    }
}

impl Drop for OpenConn {
    fn drop(&mut self) {
        metrics::gauge!("flotilla_http_connections_open").decrement(1.0);
    }
}

/// The answer to a connection over the cap: a 503 in the OpenAI error shape.
fn over_cap() -> String {
    let body = crate::openai::error::ApiError::new(
        crate::openai::error::ErrorKind::Unavailable,
        "the gateway is at its connection limit; retry shortly",
    )
    .code("too_many_connections")
    .body()
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Serve `app` on `listener` until `stop`; see the module doc.
///
/// # Errors
/// None in practice: failed accepts are logged and retried, failed connections end alone.
/// The `io::Result` is the server task's contract with the gateway actor, which fails (and
/// is restarted) when the task ends in any way other than `stop`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // Out of file descriptors and the like: wait a little, as hyper's examples do.
                tracing::error!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics::counter!("flotilla_http_connections_refused_total").increment(1);
            let _ = stream.try_write(over_cap().as_bytes());
            continue;
        };
        let _ = stream.set_nodelay(true);
        let watcher = graceful.watcher();
        let http = http.clone();
        let app = app.clone();
        let stop = stop.clone();
        conns.spawn(async move {
            let _permit = permit;
            let _open = OpenConn::new();
            tokio::select! {
                () = stop.cancelled() => return,
                first = tokio::time::timeout(limits.idle_timeout, first_byte(&stream)) => {
                    if !matches!(first, Ok(true)) {
                        return;
                    }
                }
            }
            let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    conns.shutdown().await;
    Ok(())
}

/// Whether the peer sent a byte (false: closed or failed).
async fn first_byte(stream: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(stream.peek(&mut b).await, Ok(n) if n > 0)
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}
