//! An in-process fleet: one node with every role (gateway, router, `N` worker replicas),
//! started with `node::start` in this test's process on loopback ports, its replicas on the
//! simulated engine by default. No processes: the fleet is up in well under a second. Needs
//! `http` and `poll`.
//!
//! One node, not several: process groups are process-wide, and every cluster session adds a
//! proxy of each remote member, so `k` nodes in one process would list every worker `k` times
//! (in the router's candidates, `/health`'s `routable_workers`, the KV-event broadcast). The
//! router, schedulers, block managers and KV events are the same as on a fleet of processes;
//! what a single process cannot show (the wire between nodes, a node's process killed or cut
//! off) stays with the tests on `process::Cluster`. The actor registry, the metrics recorder
//! and the resilience counters are process-wide too, so only one fleet lives in a process at a
//! time ([`Fleet::start`] waits for the previous one to stop), and tests assert on deltas of
//! metrics, since an earlier test of the same binary may have counted.
#![allow(dead_code, reason = "each binary that starts a fleet uses a subset")]

use super::http::Gateway;
use super::poll::{free_port, poll_until};
use figment::Figment;
use figment::providers::Serialized;
use flotilla::cli::up::set_override;
use flotilla::node::config::{Config, NodeRole};
use flotilla::node::{self, RunningNode};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::{Mutex, OwnedMutexGuard};

/// One fleet per process at a time.
fn turn() -> Arc<Mutex<()>> {
    static TURN: OnceLock<Arc<Mutex<()>>> = OnceLock::new();
    TURN.get_or_init(|| Arc::new(Mutex::new(()))).clone()
}

/// How to start a [`Fleet`].
#[derive(Clone, Debug)]
pub struct FleetOptions {
    sets: Vec<String>,
}

/// The node's name: its workers are `node-0/replica-<k>`.
pub const NODE: &str = "node-0";

impl FleetOptions {
    /// `workers` replicas on simulated engines, chaos API off.
    pub fn new(workers: usize) -> Self {
        Self {
            sets: vec![
                "worker.engine=sim".into(),
                format!("worker.replicas={workers}"),
            ],
        }
    }

    /// Serve the chaos API on the gateway (`flotilla up --chaos`).
    pub fn chaos(self) -> Self {
        self.set("chaos.enabled=true")
    }

    /// `--set key=value`.
    pub fn set(mut self, kv: &str) -> Self {
        self.sets.push(kv.to_owned());
        self
    }

    /// Start the fleet and wait until its gateway sees the node up.
    pub async fn start(self) -> Fleet {
        Fleet::start(self).await
    }
}

/// A fleet running in this process; stopped on drop.
pub struct Fleet {
    node: Option<RunningNode>,
    gateway: String,
    _turn: OwnedMutexGuard<()>,
}

impl Gateway for Fleet {
    fn gateway(&self) -> &str {
        &self.gateway
    }
}

fn config(opts: &FleetOptions) -> Config {
    let base = serde_json::json!({
        "node": {
            "name": NODE,
            "listen_addr": format!("127.0.0.1:{}", free_port()),
            "roles": [NodeRole::Gateway, NodeRole::Router, NodeRole::Worker],
            "cookie": format!("inproc-{}", std::process::id()),
        },
        "gateway": {"http_addr": "127.0.0.1:0"},
    });
    let mut o = Figment::from(Serialized::defaults(base));
    for kv in &opts.sets {
        o = o.merge(set_override(kv).unwrap_or_else(|e| panic!("--set {kv}: {e}")));
    }
    Config::load_with(None, o).unwrap_or_else(|e| panic!("config: {e}"))
}

impl Fleet {
    /// Start the node once the previous fleet of this process has stopped.
    pub async fn start(opts: FleetOptions) -> Self {
        let turn = turn().lock_owned().await;
        let node = node::start(config(&opts))
            .await
            .unwrap_or_else(|e| panic!("{NODE} did not start: {e}"));
        let http = node
            .ready_line()
            .http_addr
            .expect("the node runs a gateway");
        let fleet = Self {
            node: Some(node),
            gateway: format!("http://{http}"),
            _turn: turn,
        };
        poll_until(Duration::from_secs(30), "the node up", || async {
            let f = reqwest::get(fleet.url("/v1/fleet"))
                .await
                .ok()?
                .json::<serde_json::Value>()
                .await
                .ok()?;
            (f["nodes"][0]["state"] == "up").then_some(())
        })
        .await;
        fleet
    }

    /// `gateway` + `path`.
    pub fn url(&self, path: &str) -> String {
        Gateway::url(self, path)
    }

    /// Stop the node (its tree in reverse start order, then its cluster server).
    pub async fn stop(mut self) {
        if let Some(n) = self.node.take() {
            n.stop().await;
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // A test that ends without `stop` (or panics): stop the node before the next fleet of
        // this process starts (it reuses the names). Tests run on a multi-thread runtime.
        if let Some(n) = self.node.take()
            && let Ok(handle) = tokio::runtime::Handle::try_current()
        {
            tokio::task::block_in_place(|| handle.block_on(n.stop()));
        }
    }
}
