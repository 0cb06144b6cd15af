//! This node's supervision tree, as data (DESIGN.md §3). Roles select the branches.
//!
//! ```text
//! node                 one_for_one, supervision.node_max_restarts in node_period_ms → node exits non-zero
//! ├─ discovery         permanent   membership, heartbeats, liveness, pg groups per role
//! ├─ gateway_sup       (gateway)   one_for_one
//! │  ├─ http_gateway   permanent   axum server: /live /health /metrics /v1/fleet
//! │  └─ request_sup    permanent   one temporary child per in-flight request (serving path)
//! └─ worker_pool       (worker)    one_for_one
//!    └─ replica-<k>    ×worker.replicas, one_for_all: KV block manager, engine worker,
//!                      scheduler (empty until the serving path lands)
//! ```
//! Actor names are registered per node (prefixed by `NodeContext::prefix`, empty in a real
//! node process) and are what `/v1/fleet` lists.

use super::spec::{ChildSpec, Strategy, SupervisorFlags, SupervisorSpec};
use crate::actors::discovery::{Discovery, DiscoveryArgs};
use crate::actors::gateway::routes::GatewayShared;
use crate::actors::gateway::{GatewayArgs, HttpGateway};
use crate::config::Role;
use crate::node::NodeContext;
use std::sync::Arc;
use std::time::Duration;

fn flags(ctx: &NodeContext, strategy: Strategy) -> SupervisorFlags {
    let s = &ctx.config.supervision;
    SupervisorFlags::new(strategy, s.max_restarts, Duration::from_millis(s.period_ms)).with_backoff(
        Duration::from_millis(s.backoff_base_ms),
        Duration::from_millis(s.backoff_max_ms),
    )
}

fn shutdown(ctx: &NodeContext) -> super::Shutdown {
    super::Shutdown::Timeout(Duration::from_millis(
        ctx.config.supervision.shutdown_timeout_ms,
    ))
}

/// The whole tree of a node.
pub fn node_tree(ctx: &NodeContext) -> SupervisorSpec {
    let s = &ctx.config.supervision;
    let node_flags = SupervisorFlags::new(
        Strategy::OneForOne,
        s.node_max_restarts,
        Duration::from_millis(s.node_period_ms),
    )
    .with_backoff(
        Duration::from_millis(s.backoff_base_ms),
        Duration::from_millis(s.backoff_max_ms),
    );
    let mut node = SupervisorSpec::new(ctx.name("node"), node_flags).child(discovery(ctx));
    if ctx.config.has_role(Role::Gateway) {
        node = node.child(ChildSpec::supervisor(gateway(ctx)));
    }
    if ctx.config.has_role(Role::Worker) {
        node = node.child(ChildSpec::supervisor(worker_pool(ctx)));
    }
    node
}

fn discovery(ctx: &NodeContext) -> ChildSpec {
    let stop = shutdown(ctx);
    let ctx = ctx.clone();
    let name = ctx.name("discovery");
    ChildSpec::actor("discovery", Some(name), move || {
        let c = &ctx.config.cluster;
        let args = DiscoveryArgs {
            node_id: ctx.node_id.clone(),
            addr: ctx.cluster.addr.to_string(),
            roles: ctx.config.node.roles.clone(),
            incarnation: ctx.incarnation,
            http_addr: ctx.http_addr.clone(),
            leases: crate::actors::discovery::membership::Leases {
                suspect_after: Duration::from_millis(c.suspect_after_ms),
                down_after: Duration::from_millis(c.liveness_timeout_ms),
                retention: Duration::from_millis(c.down_retention_ms),
            },
            heartbeat_interval: c.heartbeat_interval(),
            seeds: ctx.config.node.join.clone(),
            server: ctx.cluster.server.clone(),
            events: ctx.membership.clone(),
            clock: ctx.clock.clone(),
            worker_pool_name: ctx.name("worker_pool"),
        };
        (Discovery, args)
    })
    .shutdown(stop)
}

fn gateway(ctx: &NodeContext) -> SupervisorSpec {
    let shared = Arc::new(GatewayShared {
        discovery_name: ctx.name("discovery"),
        metrics: crate::metrics::handle(),
        max_body_bytes: ctx.config.gateway.max_body_bytes,
    });
    let args = GatewayArgs {
        addr: ctx.config.gateway.http_addr,
        bound: ctx.http_addr.clone(),
        shared,
    };
    let http = ChildSpec::actor("http_gateway", Some(ctx.name("http_gateway")), move || {
        (HttpGateway, args.clone())
    })
    .shutdown(shutdown(ctx));
    let requests = SupervisorSpec::new(ctx.name("request_sup"), flags(ctx, Strategy::OneForOne));
    SupervisorSpec::new(ctx.name("gateway_sup"), flags(ctx, Strategy::OneForOne))
        .child(http)
        .child(ChildSpec::supervisor(requests))
}

fn worker_pool(ctx: &NodeContext) -> SupervisorSpec {
    let replicas = (0..ctx.config.worker.replicas).map(|k| {
        let replica = SupervisorSpec::new(
            ctx.name(&format!("replica-{k}")),
            flags(ctx, Strategy::OneForAll),
        );
        ChildSpec::supervisor(replica)
    });
    SupervisorSpec::new(ctx.name("worker_pool"), flags(ctx, Strategy::OneForOne)).children(replicas)
}
