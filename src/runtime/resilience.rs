//! Counters of the resilience loop, per node, and panic accounting.
//!
//! Every node owns one [`NodeStats`] (made by `node::start`, handed down through the actors'
//! arguments), so two nodes in one process (as the in-process tests run them) never share
//! their counters or their draining flag. Each node reports them in its heartbeat
//! (`/v1/fleet` → `counters`); the same events are Prometheus counters on `/metrics`
//! (`flotilla_supervisor_restarts_total`, `flotilla_panics_total`,
//! `flotilla_engine_hangs_total`, `flotilla_migrations_total`), and every gateway renders each
//! up node's heartbeat counters as `flotilla_node_*_total{node}` (`actors/gateway/routes.rs`).
//!
//! A panic anywhere in the process — in an actor's handler (ractor catches it and reports
//! the actor failed to its supervisor) or in a bare task no supervisor watches (tokio catches
//! it at the task boundary) — passes through the hook [`install_panic_hook`] sets, which
//! counts and logs it before the default hook runs. So no panic goes unseen.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What the resilience loop did on one node: every counter counts since the node's process
/// started (its `incarnation`, shown beside them in `/v1/fleet`) and goes back to 0 when the
/// node restarts, except `node_restarts`, which the launcher carries across restarts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCounters {
    /// Requests this gateway migrated to another worker.
    pub migrations: u64,
    /// Children restarted by this node's supervisors.
    pub restarts: u64,
    /// Panics caught anywhere in the process (actors and bare tasks).
    pub panics: u64,
    /// Engine hangs its schedulers' watchdogs detected.
    pub engine_hangs: u64,
    /// Times `flotilla up` started this node again after it died (across incarnations).
    #[serde(default)]
    pub node_restarts: u64,
}

/// Panics seen by the panic hook. Process-wide: the hook runs on whatever thread panicked
/// and cannot tell which node (if any) the panicking code belonged to, so every node of the
/// process reports the same count.
static PANICS: AtomicU64 = AtomicU64::new(0);

/// The variable through which `flotilla up` tells a node how often it was restarted.
pub const NODE_RESTARTS_ENV: &str = "FLOTILLA_NODE_RESTARTS";

/// One node's resilience state: its draining flag and its counters since it started.
#[derive(Debug, Default)]
pub struct NodeStats {
    /// Set once this node drains: its gateway refuses new requests and reports not ready.
    draining: AtomicBool,
    /// Requests (choices) in flight on this node's gateway.
    gateway_in_flight: AtomicU64,
    /// Children restarted by this node's supervisors.
    restarts: AtomicU64,
    /// Requests this node's gateway migrated to another worker.
    migrations: AtomicU64,
    /// Engine hangs detected by this node's step watchdogs or canaries.
    engine_hangs: AtomicU64,
    /// Times `flotilla up` restarted this node before this incarnation.
    node_restarts: AtomicU64,
    /// What this node's gateway counts for the planner.
    signals: crate::runtime::signals::GatewayCounters,
}

impl NodeStats {
    /// Fresh counters; `node_restarts` from [`NODE_RESTARTS_ENV`] when set (by the launcher).
    pub fn from_env() -> Self {
        let stats = Self::default();
        if let Some(n) = std::env::var(NODE_RESTARTS_ENV)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            stats.node_restarts.store(n, Ordering::Relaxed);
        }
        stats
    }

    /// Whether this node is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Mark this node as draining (for good).
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// A Request actor started on this node's gateway.
    pub fn request_started(&self) {
        self.gateway_in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A Request actor stopped.
    pub fn request_ended(&self) {
        // Saturating: never wraps below zero, whatever the order of events.
        let _ = self
            .gateway_in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(1))
            });
    }

    /// Requests (choices) in flight on this node's gateway.
    pub fn gateway_in_flight(&self) -> u64 {
        self.gateway_in_flight.load(Ordering::Relaxed)
    }

    /// A supervisor of this node restarted a child.
    pub fn count_restart(&self) {
        self.restarts.fetch_add(1, Ordering::Relaxed);
    }

    /// A request of this node's gateway migrated.
    pub fn count_migration(&self) {
        self.migrations.fetch_add(1, Ordering::Relaxed);
    }

    /// A watchdog of this node found its engine hung.
    pub fn count_engine_hang(&self) {
        self.engine_hangs.fetch_add(1, Ordering::Relaxed);
    }

    /// This node's gateway's planner signals (see `runtime/signals.rs`).
    pub fn signals(&self) -> &crate::runtime::signals::GatewayCounters {
        &self.signals
    }

    /// The counters as reported in a heartbeat (`panics` is the process's count).
    pub fn counters(&self) -> NodeCounters {
        NodeCounters {
            migrations: self.migrations.load(Ordering::Relaxed),
            restarts: self.restarts.load(Ordering::Relaxed),
            panics: PANICS.load(Ordering::Relaxed),
            engine_hangs: self.engine_hangs.load(Ordering::Relaxed),
            node_restarts: self.node_restarts.load(Ordering::Relaxed),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_nodes_never_share_their_counters() {
        let (a, b) = (NodeStats::default(), NodeStats::default());
        a.set_draining();
        a.count_restart();
        a.count_migration();
        a.count_migration();
        a.count_engine_hang();
        a.request_started();
        assert!(a.draining() && !b.draining());
        assert_eq!(a.gateway_in_flight(), 1);
        assert_eq!(b.gateway_in_flight(), 0);
        let (ca, cb) = (a.counters(), b.counters());
        assert_eq!((ca.restarts, ca.migrations, ca.engine_hangs), (1, 2, 1));
        assert_eq!((cb.restarts, cb.migrations, cb.engine_hangs), (0, 0, 0));
        a.request_ended();
        a.request_ended();
        assert_eq!(a.gateway_in_flight(), 0, "never below zero");
    }
}
