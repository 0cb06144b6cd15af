//! Waiting for a condition by polling it (never a fixed sleep), and per-test setup.

use std::future::Future;
use std::time::Duration;

/// Poll `cond` every 20 ms until it returns `Some`, or panic after `timeout` with `what`.
pub async fn poll_until<T, F, Fut>(timeout: Duration, what: &str, mut cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = cond().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A free loopback port, outside the ephemeral range so that no `bind(:0)` takes it before
/// the node binds it (see `flotilla::runtime::ports`).
#[allow(dead_code, reason = "used by the binaries that start nodes themselves")]
pub fn free_port() -> u16 {
    flotilla::runtime::ports::free_loopback_ports(1).unwrap()[0]
}

/// Log to the test's output when `FLOTILLA_LOG` is set (e.g. `FLOTILLA_LOG=debug`).
#[allow(dead_code, reason = "used by the binaries that start nodes in-process")]
pub fn init_tracing() {
    if let Ok(filter) = std::env::var("FLOTILLA_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    }
}
