//! Process-wide counters of the resilience loop, and panic accounting.
//!
//! Every node reports these in its heartbeat (`/v1/fleet` → `counters`); the same events are
//! Prometheus counters on `/metrics` (`flotilla_supervisor_restarts_total`,
//! `flotilla_panics_total`, `flotilla_engine_hangs_total`, `flotilla_migrations_total`).
//!
//! A panic anywhere in the process — in an actor's handler (ractor catches it and reports
//! the actor failed to its supervisor) or in a bare task no supervisor watches (tokio catches
//! it at the task boundary) — passes through the hook [`install_panic_hook`] sets, which
//! counts and logs it before the default hook runs. So no panic goes unseen.

use crate::control::discovery::membership::NodeCounters;
use std::sync::atomic::{AtomicU64, Ordering};

/// Children restarted by any supervisor of this process.
pub static RESTARTS: AtomicU64 = AtomicU64::new(0);
/// Panics seen by the panic hook.
pub static PANICS: AtomicU64 = AtomicU64::new(0);
/// Engine hangs detected by step watchdogs or canaries.
pub static ENGINE_HANGS: AtomicU64 = AtomicU64::new(0);
/// Requests (choices) in flight on this process's gateway.
pub static GATEWAY_IN_FLIGHT: AtomicU64 = AtomicU64::new(0);
/// Times `flotilla up` restarted this node before this incarnation (from the environment
/// variable [`NODE_RESTARTS_ENV`], set by the launcher).
pub static NODE_RESTARTS: AtomicU64 = AtomicU64::new(0);
/// The variable through which `flotilla up` tells a node how often it was restarted.
pub const NODE_RESTARTS_ENV: &str = "FLOTILLA_NODE_RESTARTS";
/// Set once this node drains: its gateway refuses new requests and reports not ready.
pub static DRAINING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this node is draining.
pub fn draining() -> bool {
    DRAINING.load(Ordering::Relaxed)
}

/// The counters as reported in a heartbeat.
pub fn counters() -> NodeCounters {
    NodeCounters {
        migrations: crate::request_plane::request::MIGRATIONS.load(Ordering::Relaxed),
        restarts: RESTARTS.load(Ordering::Relaxed),
        panics: PANICS.load(Ordering::Relaxed),
        engine_hangs: ENGINE_HANGS.load(Ordering::Relaxed),
        node_restarts: NODE_RESTARTS.load(Ordering::Relaxed),
    }
}

/// Count and log every panic of the process, then run the previous hook. Idempotent enough:
/// calling it twice chains two counting hooks, so call it once per process (`node::start`
/// does, guarded by a `Once`).
pub fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("flotilla_panics_total").increment(1);
            let thread = std::thread::current();
            tracing::error!(thread = thread.name().unwrap_or("?"), panic = %info, "panic");
            previous(info);
        }));
    });
}
