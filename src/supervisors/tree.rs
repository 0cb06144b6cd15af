//! This node's supervision tree, as data. Roles select the branches.
//!
//! ```text
//! node                 one_for_one  supervision.node_max_restarts in node_period_ms → node exits non-zero
//! ├─ discovery         membership, heartbeats, liveness, pg groups per role
//! ├─ chaos             installs and clears injected faults on this node
//! ├─ router_sup        (router)  one_for_all  10 in 60 s: the relay is useless without its router
//! │  ├─ router         placement: KV-aware (prefix index + load)
//! │  └─ kv_event_relay joins the KV-events group, hands every batch to the router
//! ├─ external_workers  (router.external_workers) one_for_one  supervision.max_restarts in period_ms
//! │  └─ <name>         one per external engine, one_for_all, 5 in 10 s (worker `<node>/<name>`)
//! │     ├─ kv_publisher  the engine's KV events (translated from vLLM's) out to the routers
//! │     └─ scheduler   the engine seen as a scheduler: requests over HTTP, health polled
//! ├─ gateway_sup       (gateway, or a worker with worker.http) one_for_one
//! │  │                 supervision.max_restarts in period_ms
//! │  ├─ token_sink     receives this node's requests' tokens, one message per step
//! │  ├─ request_sup    one_for_one  one temporary Request child per in-flight request
//! │  ├─ http_gateway   (gateway) axum: OpenAI API, /live /health /metrics /v1/fleet
//! │  │                 (starts last, stops first)
//! │  └─ face-<k>       (worker.http) replica k's own OpenAI face, pinned to it
//! ├─ planner           (planner) sizes the pools every planner.interval_s from the fleet
//! │                    view; publishes its decisions in this node's heartbeat
//! ├─ transport         (worker)  KV pulls between nodes; a handle on the node's transport
//! │                    (made before the tree: engines allocate their KV through it)
//! └─ worker_pool       (worker)  one_for_one  supervision.max_restarts in period_ms
//!    └─ replica-<k>    ×worker.replicas, one_for_all (the parts share device memory), 5 in 10 s
//!       ├─ kv_publisher  KV events out to subscribers, snapshots
//!       ├─ engine      weights (shared per process) + this replica's KV pools
//!       └─ scheduler   continuous batching over the block pool; drives the engine
//! ```
//! Every child is permanent. Actor names are registered per node (prefixed by
//! `NodeContext::prefix`) and are what `/v1/fleet` lists.
//!
//! This file holds the shape only: each supervisor's flags and its ordered children.
//! `args.rs` builds what the children are started with from the configuration; `spawn.rs`
//! turns each into a child spec (the one place that names the actor types).
//!
//! # Restart budgets
//! Budgets multiply across levels: a replica that spends its budget costs the worker pool
//! one restart, a pool that spends its own costs the node one, so a crash loop deep in the
//! tree gets the product of the budgets on its path before the node gives up. Each level's
//! budget is therefore sized for the failures that reach it rather than copied:
//! - the node (`supervision.node_max_restarts` in `node_period_ms`, 3 in 60 s) has the last
//!   word and the smallest budget;
//! - the gateway and the worker pool (`supervision.max_restarts` in `period_ms`, 10 in 60 s)
//!   restart whole services or whole replicas, rarely and at some cost;
//! - a replica ([`REPLICA_BUDGET`]) is where engines hang and fail: a short window makes a
//!   crash loop escalate to the pool within seconds, while faults spread over time (one every
//!   two seconds or slower) never escalate;
//! - the router and its relay ([`ROUTER_BUDGET`]) restart together and cheaply (the index
//!   resyncs from snapshots); their own budget keeps a flapping router off the node's;
//! - `request_sup` ([`REQUEST_BUDGET`]) never restarts anything (every request is
//!   temporary): a restart there would be a bug, so the first one escalates.

mod args;
mod spawn;

pub use args::{ReplicaParams, first_request_id};

use crate::node::context::NodeContext;
use crate::runtime::role::NodeRole;
use crate::runtime::supervision::{ChildSpec, Strategy, SupervisorFlags, SupervisorSpec};
use std::time::Duration;

/// Restart budget of each replica: at most this many restarts within this window.
pub const REPLICA_BUDGET: (u32, Duration) = (5, Duration::from_secs(10));
/// Restart budget of the router's supervisor (router and KV-event relay, one_for_all).
pub const ROUTER_BUDGET: (u32, Duration) = (10, Duration::from_secs(60));
/// Restart budget of `request_sup`, whose children are all temporary.
pub const REQUEST_BUDGET: (u32, Duration) = (0, Duration::from_secs(60));

/// The whole tree of a node.
pub fn node_tree(ctx: &NodeContext) -> SupervisorSpec {
    let s = &ctx.config.supervision;
    let node_budget = (s.node_max_restarts, Duration::from_millis(s.node_period_ms));
    let mut node = SupervisorSpec::new(
        ctx.name("node"),
        flags(ctx, Strategy::OneForOne, node_budget),
    )
    .counting(ctx.stats.clone())
    .child(spawn::discovery(ctx))
    .child(spawn::chaos(ctx));
    if ctx.config.has_role(NodeRole::Router) {
        node = node.child(ChildSpec::supervisor(router_sup(ctx)));
    }
    if let Some(pool) = external_workers(ctx) {
        node = node.child(ChildSpec::supervisor(pool));
    }
    let faces = ctx.config.has_role(NodeRole::Worker) && ctx.config.worker.http.is_some();
    if ctx.config.has_role(NodeRole::Gateway) || faces {
        node = node.child(ChildSpec::supervisor(gateway_sup(ctx)));
    }
    if let Some(t) = &ctx.transport {
        node = node.child(spawn::transport(ctx, t.clone()));
    }
    if ctx.config.has_role(NodeRole::Worker) {
        node = node.child(ChildSpec::supervisor(worker_pool(ctx)));
    }
    if let Some(planner) = spawn::planner(ctx) {
        node = node.child(planner);
    }
    node
}

/// The router and the relay that feeds it KV events: either exiting restarts both.
fn router_sup(ctx: &NodeContext) -> SupervisorSpec {
    SupervisorSpec::new(
        ctx.name("router_sup"),
        flags(ctx, Strategy::OneForAll, ROUTER_BUDGET),
    )
    .counting(ctx.stats.clone())
    .child(spawn::router(ctx))
    .child(spawn::kv_event_relay(ctx))
}

/// The external engines of `router.external_workers`, each as a worker of this node (`None`
/// without any, or without the gateway's model to hash and stop with).
fn external_workers(ctx: &NodeContext) -> Option<SupervisorSpec> {
    let ext = &ctx.config.router.external_workers;
    if ext.is_empty() || !ctx.config.has_role(NodeRole::Router) {
        return None;
    }
    let Some(frontend) = &ctx.frontend else {
        tracing::error!(
            "router.external_workers: no model on this node; external engines not started"
        );
        return None;
    };
    let pair_flags = flags(ctx, Strategy::OneForAll, REPLICA_BUDGET);
    let engines = ext.iter().map(|e| {
        let worker = crate::runtime::ids::WorkerId::new(format!("{}{}", ctx.prefix, e.name));
        let args = crate::worker::external::ExternalArgs {
            kv_publisher_name: format!("{worker}/kv_publisher"),
            worker: worker.clone(),
            config: e.clone(),
            block_size: ctx.config.worker.block_size_tokens as u32,
            salt: frontend.salt,
            eos_ids: frontend.tokenizer.eos_ids.clone(),
            board: ctx.worker_stats.clone(),
        };
        ChildSpec::supervisor(
            SupervisorSpec::new(worker.to_string(), pair_flags)
                .counting(ctx.stats.clone())
                .children([
                    spawn::external_kv_publisher(ctx, &args),
                    spawn::external_engine(ctx, &args),
                ]),
        )
    });
    Some(
        SupervisorSpec::new(
            ctx.name("external_workers"),
            flags(ctx, Strategy::OneForOne, inner_budget(ctx)),
        )
        .counting(ctx.stats.clone())
        .children(engines),
    )
}

/// The request plane's doors: the gateway's listener and the replicas' own faces
/// (`worker.http`), over one token sink and one request supervisor. The listeners start last
/// and stop first.
fn gateway_sup(ctx: &NodeContext) -> SupervisorSpec {
    let parts = args::gateway(ctx);
    let requests = SupervisorSpec::new(
        ctx.name("request_sup"),
        flags(ctx, Strategy::OneForOne, REQUEST_BUDGET),
    )
    .counting(ctx.stats.clone());
    let mut sup = SupervisorSpec::new(
        ctx.name("gateway_sup"),
        flags(ctx, Strategy::OneForOne, inner_budget(ctx)),
    )
    .counting(ctx.stats.clone())
    .child(spawn::token_sink(ctx, &parts))
    .child(ChildSpec::supervisor(requests));
    if let Some(http) = &parts.http {
        sup = sup.child(spawn::http_gateway(ctx, http));
    }
    for (k, face) in &parts.faces {
        sup = sup.child(spawn::face(ctx, *k, face));
    }
    sup
}

/// `worker.replicas` replicas, each under its own one_for_all supervisor.
fn worker_pool(ctx: &NodeContext) -> SupervisorSpec {
    let replica_flags = flags(ctx, Strategy::OneForAll, REPLICA_BUDGET);
    let replicas = (0..ctx.config.worker.replicas).map(|k| {
        let spec = match args::replica(ctx, k, replica_flags) {
            Some(p) => replica(p),
            // No model loaded: an empty replica (nothing to serve with).
            None => SupervisorSpec::new(ctx.name(&format!("replica-{k}")), replica_flags)
                .counting(ctx.stats.clone()),
        };
        ChildSpec::supervisor(spec)
    });
    SupervisorSpec::new(
        ctx.name("worker_pool"),
        flags(ctx, Strategy::OneForOne, inner_budget(ctx)),
    )
    .counting(ctx.stats.clone())
    .children(replicas)
}

/// A replica: KV event publisher, engine worker, scheduler, under a one_for_all supervisor
/// with `p.flags`, registered as `p.worker`.
pub fn replica(p: ReplicaParams) -> SupervisorSpec {
    SupervisorSpec::new(p.worker.to_string(), p.flags)
        .counting(p.stats.clone())
        .children([
            spawn::kv_publisher(&p),
            spawn::engine(&p),
            spawn::scheduler(&p),
        ])
}

/// `supervision.max_restarts` in `supervision.period_ms`.
fn inner_budget(ctx: &NodeContext) -> (u32, Duration) {
    let s = &ctx.config.supervision;
    (s.max_restarts, Duration::from_millis(s.period_ms))
}

/// Flags with `strategy`, the budget `(max restarts, window)` and the configured backoff.
fn flags(ctx: &NodeContext, strategy: Strategy, (max, period): (u32, Duration)) -> SupervisorFlags {
    let s = &ctx.config.supervision;
    SupervisorFlags::new(strategy, max, period).with_backoff(
        Duration::from_millis(s.backoff_base_ms),
        Duration::from_millis(s.backoff_max_ms),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_level_has_its_own_budget_and_a_crash_loop_escalates_sooner() {
        let s = crate::node::config::Config::default().supervision;
        let node = (s.node_max_restarts, Duration::from_millis(s.node_period_ms));
        let inner = (s.max_restarts, Duration::from_millis(s.period_ms));
        for b in [inner, REPLICA_BUDGET, ROUTER_BUDGET, REQUEST_BUDGET] {
            assert_ne!(b, node);
        }
        assert_ne!(REPLICA_BUDGET, inner);
        // Engine restarts a crash-looping replica gets before its node gives up: the product
        // of the budgets (plus one each: the restart past a budget escalates) on its path.
        let path = |replica: u32| (replica + 1) * (inner.0 + 1) * (node.0 + 1);
        assert!(path(REPLICA_BUDGET.0) < path(inner.0));
    }
}
