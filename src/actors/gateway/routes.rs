//! HTTP routes: the OpenAI routes and Anthropic's `/v1/messages` (`serve.rs`), `/live`, `/health`, `/metrics`, `/v1/fleet`,
//! `/v1/messages/count_tokens`, the control API (`edge::control_routes`); everything else is a
//! 404 in the OpenAI error shape (under `/v1/messages`, Anthropic's; a wrong method there is a
//! 405 in Anthropic's shape too). Every response carries `x-request-id` (`edge.rs`).

use super::edge::{control_guard, live, method_not_allowed, not_found, readiness};
#[doc(no_inline)]
pub use super::state::GatewayShared;
use crate::control::discovery::membership::{NodeState, NodeView, WorkerView};
use crate::openai::error::ApiError;
use crate::runtime::role::NodeRole;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use std::sync::Arc;

/// The gateway's router (no socket: tests drive it with `tower::ServiceExt::oneshot`).
pub fn app(shared: Arc<GatewayShared>) -> Router {
    use super::serve;
    if shared.face.is_some() {
        return super::face::app(shared);
    }
    let app = Router::new()
        .route("/v1/chat/completions", axum::routing::post(serve::chat))
        .route("/v1/completions", axum::routing::post(serve::completions))
        .route("/v1/messages", axum::routing::post(serve::messages))
        .route(
            "/v1/messages/count_tokens",
            axum::routing::post(serve::messages_count_tokens),
        )
        .route("/v1/models", get(serve::models))
        .route("/v1/models/{id}", get(serve::model))
        .merge(control_routes(shared.clone()))
        .route("/live", get(live))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/fleet", get(fleet))
        .route("/v1/fleet/events", get(fleet_events))
        .merge(super::page::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared);
    super::edge::with_request_ids(app)
}

/// Readiness: 200 `ready` when at least one worker in the cluster is routable (alive,
/// healthy, not draining) and this gateway is not draining; else 503 (`not_ready` or
/// `draining`). `live_worker_nodes` counts worker nodes up; `routable_workers` the replicas a
/// router may choose.
async fn health(State(s): State<Arc<GatewayShared>>) -> Response {
    match s.published_fleet() {
        Ok(nodes) => {
            let worker_nodes = nodes
                .iter()
                .filter(|n| n.state == NodeState::Up && n.roles.contains(&NodeRole::Worker))
                .count();
            let routable = crate::actors::router::live_workers().len();
            let word = if s.stats.draining() {
                "draining"
            } else if routable > 0 {
                "ready"
            } else {
                "not_ready"
            };
            readiness(
                word,
                json!({"live_worker_nodes": worker_nodes, "routable_workers": routable}),
            )
        }
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(s): State<Arc<GatewayShared>>) -> Response {
    if let Some(serving) = &s.serving {
        metrics::gauge!("flotilla_requests_in_flight").set(serving.registry.len() as f64);
        let (requests, output_tokens) = s.stats.signals().rates();
        metrics::gauge!("flotilla_request_rate").set(requests);
        metrics::gauge!("flotilla_output_token_rate").set(output_tokens);
    }
    s.metrics.run_upkeep();
    let mut text = s.metrics.render();
    // Per-worker gauges straight from the fleet view, not kept in the recorder: a worker that
    // left (or a node that is not up) has no lines, and a restarted one shows its new values.
    if let Ok(nodes) = s.published_fleet() {
        text.push_str(&worker_gauges(&nodes));
        text.push_str(&node_counters(&nodes));
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
        .into_response()
}

/// The per-worker gauges of the workers of `nodes` that are up, in Prometheus' text format.
fn worker_gauges(nodes: &[NodeView]) -> String {
    use std::fmt::Write;
    type Gauge = (&'static str, &'static str, fn(&WorkerView) -> usize);
    const GAUGES: [Gauge; 4] = [
        (
            "flotilla_worker_waiting",
            "Sequences waiting for admission (queue depth), per worker",
            |w| w.waiting,
        ),
        (
            "flotilla_worker_running",
            "Sequences running, per worker",
            |w| w.running,
        ),
        (
            "flotilla_worker_kv_blocks_used",
            "KV blocks pinned by live sequences, per worker",
            |w| w.kv_blocks_used,
        ),
        (
            "flotilla_worker_kv_blocks_total",
            "KV blocks in the pool, per worker",
            |w| w.kv_blocks_total,
        ),
    ];
    let workers: Vec<&WorkerView> = nodes
        .iter()
        .filter(|n| n.state == NodeState::Up)
        .flat_map(|n| &n.workers)
        .collect();
    let mut out = String::new();
    if workers.is_empty() {
        return out;
    }
    for (name, help, value) in GAUGES {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for w in &workers {
            let id = escape(&w.id);
            let _ = writeln!(out, "{name}{{worker=\"{id}\"}} {}", value(w));
        }
    }
    out.push_str(&tier_metrics(&workers));
    out.push_str(&peer_pull_metrics(&workers));
    out.push_str(&transfer_metrics(&workers));
    out
}

/// Bytes of KV each worker pulled over the KV transport since it started, from the fleet view:
/// what `flotilla_kv_transfer_bytes_total` counts on the worker nodes, which serve no
/// `/metrics`. Every worker has a line, from 0, so that `rate` sees its first pull.
fn transfer_metrics(workers: &[&WorkerView]) -> String {
    use std::fmt::Write;
    let name = "flotilla_worker_kv_transfer_bytes_total";
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP {name} Bytes of KV the worker pulled over the KV transport since it started \
         (disaggregated prefill's pulls and peer pulls; none on the sim engine, whose transfers \
         are modelled), per worker\n# TYPE {name} counter"
    );
    for w in workers {
        let _ = writeln!(
            out,
            "{name}{{worker=\"{}\"}} {}",
            escape(&w.id),
            w.kv_transfer_bytes
        );
    }
    out
}

/// Every up node's resilience counters (`NodeCounters`, from its heartbeat), so that one
/// gateway's scrape covers the fleet: this process's own `flotilla_supervisor_restarts_total`,
/// `flotilla_panics_total` and `flotilla_migrations_total` count this process only. Each counts
/// since the node's process started (Prometheus' `rate` and `increase` take the reset), except
/// `flotilla_node_process_restarts_total`, which the launcher carries across restarts.
fn node_counters(nodes: &[NodeView]) -> String {
    use crate::runtime::resilience::NodeCounters;
    use std::fmt::Write;
    type Counter = (&'static str, &'static str, fn(&NodeCounters) -> u64);
    const COUNTERS: [Counter; 5] = [
        (
            "flotilla_node_migrations_total",
            "Requests the node's gateway migrated to another worker since the node started, per node",
            |c| c.migrations,
        ),
        (
            "flotilla_node_restarts_total",
            "Children the node's supervisors restarted since the node started, per node",
            |c| c.restarts,
        ),
        (
            "flotilla_node_panics_total",
            "Panics caught in the node's process since it started, per node",
            |c| c.panics,
        ),
        (
            "flotilla_node_engine_hangs_total",
            "Engine hangs the node's watchdogs detected since the node started, per node",
            |c| c.engine_hangs,
        ),
        (
            "flotilla_node_process_restarts_total",
            "Times the launcher started the node's process again after it died, per node",
            |c| c.node_restarts,
        ),
    ];
    let up: Vec<(String, NodeCounters)> = nodes
        .iter()
        .filter(|n| n.state == NodeState::Up)
        .map(|n| (escape(n.id.as_str()), n.counters))
        .collect();
    let mut out = String::new();
    if up.is_empty() {
        return out;
    }
    for (name, help, value) in COUNTERS {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (id, c) in &up {
            let _ = writeln!(out, "{name}{{node=\"{id}\"}} {}", value(c));
        }
    }
    out
}

/// Peer pulls (G4) of the workers that have any, from the fleet view (the worker nodes serve
/// no `/metrics`): requests per outcome, and blocks pulled, since each worker's start.
fn peer_pull_metrics(workers: &[&WorkerView]) -> String {
    use std::fmt::Write;
    type Outcome = (&'static str, fn(&crate::kv::PeerPullCounters) -> u64);
    const OUTCOMES: [Outcome; 6] = [
        ("asked", |c| c.asked),
        ("declined", |c| c.declined),
        ("pulled", |c| c.pulled),
        ("failed", |c| c.failed),
        ("moot", |c| c.moot),
        ("exported", |c| c.exported),
    ];
    // Every worker's series, at 0 before its first pull: a dashboard shows 0, not "no data".
    let pulling: Vec<(String, crate::kv::PeerPullCounters)> = workers
        .iter()
        .map(|w| (escape(&w.id), w.kv_peer_pulls))
        .collect();
    let mut out = String::new();
    if pulling.is_empty() {
        return out;
    }
    let name = "flotilla_worker_kv_peer_pulls_total";
    let _ = writeln!(
        out,
        "# HELP {name} Peer pulls (G4) since the worker started, in requests per outcome: as the \
         puller declined (the cost rule preferred prefill; never asked), asked (the holder was \
         asked to pin), then pulled, failed (recomputed) or moot (cached here by admission) — \
         asked = pulled + failed + moot once settled; as the holder exported, per worker\n\
         # TYPE {name} counter"
    );
    for (id, c) in &pulling {
        for (outcome, value) in OUTCOMES {
            let _ = writeln!(
                out,
                "{name}{{worker=\"{id}\",outcome=\"{outcome}\"}} {}",
                value(c)
            );
        }
    }
    let name = "flotilla_worker_kv_peer_pull_blocks_total";
    let _ = writeln!(
        out,
        "# HELP {name} KV blocks pulled from peers since the worker started, per worker\n\
         # TYPE {name} counter"
    );
    for (id, c) in &pulling {
        let _ = writeln!(out, "{name}{{worker=\"{id}\"}} {}", c.blocks);
    }
    out
}

/// The lower KV tiers of the workers that have them: blocks held per tier (gauge) and the
/// copy counters (blocks, since each worker's start).
fn tier_metrics(workers: &[&WorkerView]) -> String {
    use std::fmt::Write;
    type Counter = (&'static str, fn(&crate::kv::TierCounters) -> u64);
    // Every worker's series (0 on a worker without lower tiers, or before its first copy): a
    // dashboard shows 0, not "no data".
    let tiered: Vec<(String, crate::kv::TierUsage)> = workers
        .iter()
        .map(|w| (escape(&w.id), w.kv_tiers.unwrap_or_default()))
        .collect();
    let mut out = String::new();
    if tiered.is_empty() {
        return out;
    }
    let name = "flotilla_worker_kv_tier_blocks";
    let _ = writeln!(
        out,
        "# HELP {name} KV blocks held in a lower tier (host = G2, disk = G3), per worker\n# TYPE {name} gauge"
    );
    for (id, t) in &tiered {
        let _ = writeln!(
            out,
            "{name}{{worker=\"{id}\",tier=\"host\"}} {}",
            t.host_blocks
        );
        let _ = writeln!(
            out,
            "{name}{{worker=\"{id}\",tier=\"disk\"}} {}",
            t.disk_blocks
        );
    }
    const COUNTERS: [Counter; 7] = [
        ("offload", |c| c.offloads),
        ("offload_drop", |c| c.offload_drops),
        ("demotion", |c| c.demotions),
        ("onboard_host", |c| c.onboards_host),
        ("onboard_disk", |c| c.onboards_disk),
        ("failure", |c| c.copy_failures),
        ("corrupt", |c| c.corrupt),
    ];
    let name = "flotilla_worker_kv_tier_copies_total";
    let _ = writeln!(
        out,
        "# HELP {name} KV blocks moved between tiers since the worker started, per kind \
         (offload G1→G2, offload_drop not offloaded, demotion G2→G3, onboard_host/onboard_disk \
         into G1, failure, corrupt: a G3 block refused), per worker\n# TYPE {name} counter"
    );
    for (id, t) in &tiered {
        for (kind, value) in COUNTERS {
            let _ = writeln!(
                out,
                "{name}{{worker=\"{id}\",kind=\"{kind}\"}} {}",
                value(&t.counters)
            );
        }
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `GET /v1/fleet`: every node (`nodes`, this one first), and for clients and load balancers
/// the gateways (`gateways`: node, `url`, state — any live one serves any request) and the
/// routers (`routers`: node, state).
async fn fleet(State(s): State<Arc<GatewayShared>>) -> Result<Json<serde_json::Value>, ApiError> {
    let nodes = s.fresh_fleet().await?;
    let gateways = fleet_members(&nodes, NodeRole::Gateway);
    let routers = fleet_members(&nodes, NodeRole::Router);
    Ok(Json(
        json!({ "nodes": nodes, "gateways": gateways, "routers": routers }),
    ))
}

/// The nodes with `role`: `{"node", "state", "url"?}` (`url` for a gateway with an HTTP
/// address).
fn fleet_members(nodes: &[NodeView], role: NodeRole) -> Vec<serde_json::Value> {
    nodes
        .iter()
        .filter(|n| n.roles.contains(&role))
        .map(|n| {
            let mut v = json!({ "node": n.id, "state": n.state });
            if role == NodeRole::Gateway
                && let Some(h) = &n.http_addr
            {
                v["url"] = json!(format!("http://{h}"));
            }
            v
        })
        .collect()
}

/// `GET /v1/fleet/events`: this node's fleet events as they happen, one SSE record each
/// (`data: {"at_ms":…,"node":…,"event":"placed",…}`; shapes in `request_plane/events.rs`),
/// with a `: keep-alive` comment every 15 s of quiet. A reader too slow for the bus gets one
/// record `{"event":"lagged","missed":N}` and goes on from the oldest event still held. The
/// stream ends when the gateway stops.
async fn fleet_events(State(s): State<Arc<GatewayShared>>) -> Response {
    use crate::openai::sse;
    use tokio::sync::broadcast::error::RecvError;
    let mut rx = s.bus.subscribe();
    let events = async_stream::stream! {
        loop {
            match rx.recv().await {
                Ok(ev) => match serde_json::to_value(&ev) {
                    Ok(v) => yield Ok::<_, std::convert::Infallible>(sse::data(&v)),
                    Err(e) => tracing::warn!(error = %e, "fleet event not encodable"),
                },
                Err(RecvError::Lagged(missed)) => {
                    yield Ok(sse::data(&json!({"event": "lagged", "missed": missed})));
                }
                Err(RecvError::Closed) => break,
            }
        }
    };
    axum::response::Sse::new(events)
        .keep_alive(sse::keep_alive(std::time::Duration::from_secs(15)))
        .into_response()
}

/// The control API's routes (`/chaos/*`, `/v1/workers/role`), behind [`control_guard`].
pub fn control_routes(shared: Arc<GatewayShared>) -> axum::Router<Arc<GatewayShared>> {
    use super::chaos_routes;
    axum::Router::new()
        .route(
            "/chaos/faults",
            axum::routing::get(chaos_routes::list).post(chaos_routes::create),
        )
        .route(
            "/chaos/faults/{id}",
            axum::routing::delete(chaos_routes::delete),
        )
        .route(
            "/v1/workers/role",
            axum::routing::post(super::worker_routes::set_role),
        )
        .route_layer(axum::middleware::from_fn_with_state(shared, control_guard))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::ids::NodeId;

    fn node(id: &str, state: NodeState, workers: &[(&str, usize)]) -> NodeView {
        NodeView {
            id: NodeId::new(id),
            addr: String::new(),
            http_addr: None,
            roles: vec![],
            pid: 0,
            incarnation: 0,
            state,
            last_seen_ms: 0,
            workers: workers
                .iter()
                .map(|(w, waiting)| WorkerView {
                    id: (*w).into(),
                    waiting: *waiting,
                    kv_blocks_total: 128,
                    ..WorkerView::default()
                })
                .collect(),
            actors: vec![],
            counters: Default::default(),
            signals: None,
            planner: None,
            regions: vec![],
        }
    }

    /// A scrape shows the workers of the view it reads and no others: a worker that left (or a
    /// node that is down) loses its lines at the next scrape instead of keeping its last values.
    #[test]
    fn worker_gauges_follow_the_fleet_view() {
        let before = [
            node(
                "a",
                NodeState::Up,
                &[("a/replica-0", 3), ("a/replica-1", 1)],
            ),
            node("b", NodeState::Up, &[("b/replica-0", 2)]),
        ];
        let text = worker_gauges(&before);
        assert!(text.contains("flotilla_worker_waiting{worker=\"a/replica-0\"} 3"));
        assert!(text.contains("flotilla_worker_kv_blocks_total{worker=\"b/replica-0\"} 128"));
        assert_eq!(
            text.matches("# TYPE flotilla_worker_running gauge").count(),
            1
        );

        let after = [
            node("a", NodeState::Up, &[("a/replica-0", 0)]),
            node("b", NodeState::Down, &[("b/replica-0", 2)]),
        ];
        let text = worker_gauges(&after);
        assert!(text.contains("flotilla_worker_waiting{worker=\"a/replica-0\"} 0"));
        assert!(!text.contains("a/replica-1"), "{text}");
        assert!(!text.contains("b/replica-0"), "{text}");
        assert!(worker_gauges(&[]).is_empty());
        assert!(
            text.contains("flotilla_worker_kv_tier_blocks{worker=\"a/replica-0\",tier=\"disk\"} 0"),
            "no tiers: the tier series at 0, {text}"
        );
    }

    #[test]
    fn transfer_bytes_follow_each_workers_counter() {
        let mut nodes = [
            node(
                "a",
                NodeState::Up,
                &[("a/replica-0", 0), ("a/replica-1", 0)],
            ),
            node("b", NodeState::Down, &[("b/replica-0", 0)]),
        ];
        nodes[0].workers[1].kv_transfer_bytes = 1 << 20;
        nodes[1].workers[0].kv_transfer_bytes = 7;
        let text = worker_gauges(&nodes);
        for line in [
            "flotilla_worker_kv_transfer_bytes_total{worker=\"a/replica-1\"} 1048576",
            "flotilla_worker_kv_transfer_bytes_total{worker=\"a/replica-0\"} 0",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(
            !text.contains("b/replica-0"),
            "a down node's workers: {text}"
        );
        assert_eq!(
            text.matches("# TYPE flotilla_worker_kv_transfer_bytes_total counter")
                .count(),
            1
        );
        // From the scheduler's stats, through the fleet view's JSON, to the line.
        let st = crate::worker::scheduler::SchedulerStats {
            kv_transfer_bytes: 4096,
            ..Default::default()
        };
        st.apply_to(&mut nodes[0].workers[0]);
        let json = serde_json::to_string(&nodes[0]).expect("json");
        nodes[0] = serde_json::from_str(&json).expect("view");
        assert!(
            worker_gauges(&nodes)
                .contains("flotilla_worker_kv_transfer_bytes_total{worker=\"a/replica-0\"} 4096")
        );
        // A view from a node that does not send the field yet reads 0.
        let old: WorkerView =
            serde_json::from_str(r#"{"id":"c/replica-0","state":"running"}"#).expect("old view");
        assert_eq!(old.kv_transfer_bytes, 0);
    }

    #[test]
    fn node_counters_follow_each_up_nodes_heartbeat() {
        let mut nodes = [
            node("a", NodeState::Up, &[]),
            node("b", NodeState::Up, &[]),
            node("c", NodeState::Down, &[]),
        ];
        nodes[1].counters.restarts = 4;
        nodes[1].counters.panics = 1;
        nodes[0].counters.migrations = 2;
        nodes[2].counters.restarts = 9;
        let text = node_counters(&nodes);
        for line in [
            "flotilla_node_restarts_total{node=\"b\"} 4",
            "flotilla_node_panics_total{node=\"b\"} 1",
            "flotilla_node_migrations_total{node=\"a\"} 2",
            "flotilla_node_restarts_total{node=\"a\"} 0",
            "flotilla_node_engine_hangs_total{node=\"a\"} 0",
            "flotilla_node_process_restarts_total{node=\"b\"} 0",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(
            !text.contains("node=\"c\""),
            "a down node has no lines: {text}"
        );
        assert_eq!(
            text.matches("# TYPE flotilla_node_restarts_total counter")
                .count(),
            1
        );
        assert!(node_counters(&[]).is_empty());
    }

    #[test]
    fn tier_metrics_follow_each_workers_tiers() {
        let mut nodes = [node(
            "a",
            NodeState::Up,
            &[("a/replica-0", 0), ("a/replica-1", 0)],
        )];
        nodes[0].workers[1].kv_tiers = Some(crate::kv::TierUsage {
            host_blocks: 7,
            disk_blocks: 3,
            counters: crate::kv::TierCounters {
                offloads: 11,
                corrupt: 2,
                ..Default::default()
            },
            ..Default::default()
        });
        let text = worker_gauges(&nodes);
        for line in [
            "flotilla_worker_kv_tier_blocks{worker=\"a/replica-1\",tier=\"host\"} 7",
            "flotilla_worker_kv_tier_blocks{worker=\"a/replica-1\",tier=\"disk\"} 3",
            "flotilla_worker_kv_tier_copies_total{worker=\"a/replica-1\",kind=\"offload\"} 11",
            "flotilla_worker_kv_tier_copies_total{worker=\"a/replica-1\",kind=\"corrupt\"} 2",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(
            text.contains("flotilla_worker_kv_tier_blocks{worker=\"a/replica-0\",tier=\"host\"} 0"),
            "a worker without tiers at 0: {text}"
        );
    }

    #[test]
    fn peer_pull_metrics_follow_each_workers_counters() {
        let mut nodes = [node(
            "a",
            NodeState::Up,
            &[("a/replica-0", 0), ("a/replica-1", 0)],
        )];
        assert!(
            worker_gauges(&nodes).contains(
                "flotilla_worker_kv_peer_pulls_total{worker=\"a/replica-0\",outcome=\"asked\"} 0"
            ),
            "no pull yet: the series at 0"
        );
        nodes[0].workers[1].kv_peer_pulls = crate::kv::PeerPullCounters {
            asked: 3,
            pulled: 2,
            blocks: 38,
            moot: 1,
            ..Default::default()
        };
        let text = worker_gauges(&nodes);
        for line in [
            "flotilla_worker_kv_peer_pulls_total{worker=\"a/replica-1\",outcome=\"asked\"} 3",
            "flotilla_worker_kv_peer_pulls_total{worker=\"a/replica-1\",outcome=\"pulled\"} 2",
            "flotilla_worker_kv_peer_pulls_total{worker=\"a/replica-1\",outcome=\"moot\"} 1",
            "flotilla_worker_kv_peer_pulls_total{worker=\"a/replica-1\",outcome=\"failed\"} 0",
            "flotilla_worker_kv_peer_pull_blocks_total{worker=\"a/replica-1\"} 38",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(text.contains(
            "flotilla_worker_kv_peer_pulls_total{worker=\"a/replica-0\",outcome=\"pulled\"} 0"
        ));
        assert_eq!(
            text.matches("# TYPE flotilla_worker_kv_peer_pulls_total counter")
                .count(),
            1
        );
    }
}
