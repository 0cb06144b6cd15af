//! The live fleet page: `GET /` (and `/fleet`) serves one HTML page with its script and style
//! (`page/`, embedded in the binary: no CDN, works offline), which follows
//! `GET /v1/fleet/live`, an SSE stream of
//!
//! - `event: view` — the fleet view this node's Discovery publishes (pushed on each change, at
//!   most every [`VIEW_MIN_GAP`]; at least every [`VIEW_MAX_GAP`]), slimmed for the page
//!   ([`frame`]): every node's state, roles, counters and workers (role, running / waiting, KV
//!   use per tier, prefix-hit counters, pulls), the planner's last decision, and `rates`: the
//!   gateways' request rate, output tokens/s and TTFT / ITL p50 / p99 over the last window of
//!   at least [`RATE_WINDOW`] (the planner's [`ViewReader`], diffing the cumulative counts every
//!   gateway puts in its heartbeat);
//! - `event: fleet` — each fleet event on this node's bus as it happens (placements with the
//!   router's cost terms, hand-offs, migrations, give-ups, workers and nodes coming and going,
//!   and — relayed by Discovery from every node — faults and role changes).
//!
//! A page that connects first gets the recent past of both ([`PageHistory`]: up to
//! [`HISTORY_VIEWS`] frames, [`HISTORY_EVENTS`] events and, apart, [`HISTORY_PLACEMENTS`]
//! placements, recorded by [`record`] while the gateway runs, whether a page is open or not),
//! so its charts and event log start full on every load rather than empty; a page starts
//! over from it on every (re)connection.
//!
//! No actor is called: the stream reads the published view (a `watch`) and the bus (a
//! `broadcast`). The page's chaos buttons use the chaos API itself (`/chaos/faults`, with its
//! loopback / Origin / token checks); they show only when the API is on.
use super::state::GatewayShared;
use crate::control::discovery::membership::NodeView;
use crate::control::planner::signals::{FleetSignals, ViewReader};
use axum::extract::State;
use axum::http::header;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

pub mod history;
pub use history::{FeedKind, HISTORY_EVENTS, HISTORY_PLACEMENTS, HISTORY_VIEWS, PageHistory};

/// The page (HTML), its script and its style, as built into the binary.
const INDEX_HTML: &str = include_str!("page/index.html");
const PAGE_JS: &str = include_str!("page/page.js");
const PAGE_CSS: &str = include_str!("page/page.css");

/// Fewest time between two `view` frames (the view changes at every heartbeat, 250 ms).
pub const VIEW_MIN_GAP: Duration = Duration::from_millis(500);
/// Most time between two `view` frames (a quiet view is sent again, with fresh rates).
pub const VIEW_MAX_GAP: Duration = Duration::from_secs(2);
/// Shortest window the rates and percentiles cover (the page's tiles say 5 s).
pub const RATE_WINDOW: Duration = Duration::from_secs(5);
/// The page's routes (no control API here: its buttons call `/chaos/*`).
pub fn routes() -> axum::Router<Arc<GatewayShared>> {
    use axum::routing::get;
    axum::Router::new()
        .route("/", get(index))
        .route("/fleet", get(index))
        .route("/fleet/page.js", get(script))
        .route("/fleet/page.css", get(style))
        .route("/v1/fleet/live", get(live))
}

async fn index() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            // Its chaos buttons act on the fleet: no other site may frame it (clickjacking).
            (header::X_FRAME_OPTIONS, "DENY"),
            (
                header::CONTENT_SECURITY_POLICY,
                "frame-ancestors 'none'; default-src 'self'; img-src 'self' data:",
            ),
        ],
        INDEX_HTML,
    )
        .into_response()
}

async fn script() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE_JS,
    )
        .into_response()
}

async fn style() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE_CSS,
    )
        .into_response()
}

/// What the page knows about this gateway besides the view.
#[derive(Clone, Debug, Default)]
pub struct GatewayFacts {
    /// This gateway's node.
    pub node: String,
    /// Whether the chaos API is on, and whether it wants a bearer token.
    pub chaos: bool,
    pub chaos_token: bool,
    /// Whether this gateway drains.
    pub draining: bool,
    /// Requests in flight on this gateway.
    pub in_flight: usize,
}

/// Tokens the fleet's workers generated between two reads of the view: each worker's
/// cumulative `generated_tokens` diffed against the previous read (a worker seen for the
/// first time, or restarted — its count went down — counts from zero). The page's tokens/s
/// (streams count as they go, not when they finish).
#[derive(Debug, Default)]
pub struct GeneratedTokens {
    last: std::collections::HashMap<String, u64>,
}

impl GeneratedTokens {
    /// Tokens generated since the previous call (0 at the first, which sets the baseline).
    pub fn read(&mut self, nodes: &[NodeView]) -> u64 {
        let first = self.last.is_empty();
        let mut delta = 0;
        let mut seen = std::collections::HashMap::new();
        for w in nodes.iter().flat_map(|n| &n.workers) {
            let before = self.last.get(&w.id).copied();
            delta += match before {
                Some(b) if w.generated_tokens >= b => w.generated_tokens - b,
                Some(_) => w.generated_tokens,
                None if first => 0,
                None => w.generated_tokens,
            };
            seen.insert(w.id.clone(), w.generated_tokens);
        }
        self.last = seen;
        delta
    }
}

/// One `view` frame: `{at_ms, gateway, chaos, nodes, rates, totals}` (pure; the shapes the
/// page reads). `nodes` are the view's, without each node's actor list, KV regions and raw
/// latency histograms; `totals` sums the up nodes' counters and the gateways' shed requests;
/// `rates` is `rates` plus `generated_token_rate` (tokens/s the workers generated).
pub fn frame(
    at_ms: u64,
    nodes: &[NodeView],
    rates: &FleetSignals,
    generated_token_rate: f64,
    facts: &GatewayFacts,
) -> Value {
    use crate::control::discovery::membership::NodeState;
    let mut totals = json!({
        "migrations": 0u64, "restarts": 0u64, "panics": 0u64, "engine_hangs": 0u64,
        "node_restarts": 0u64, "shed": 0u64, "workers": 0u64, "nodes_up": 0u64,
    });
    let mut add = |k: &str, v: u64| {
        if let Some(t) = totals.get_mut(k) {
            *t = json!(t.as_u64().unwrap_or(0) + v);
        }
    };
    let slim: Vec<Value> = nodes
        .iter()
        .map(|n| {
            if n.state == NodeState::Up {
                let c = &n.counters;
                add("migrations", c.migrations);
                add("restarts", c.restarts);
                add("panics", c.panics);
                add("engine_hangs", c.engine_hangs);
                add("node_restarts", c.node_restarts);
                add("shed", n.signals.as_ref().map_or(0, |s| s.shed));
                add("workers", n.workers.len() as u64);
                add("nodes_up", 1);
            }
            let mut v = serde_json::to_value(n).unwrap_or(Value::Null);
            if let Some(o) = v.as_object_mut() {
                for k in ["actors", "regions", "signals", "addr"] {
                    o.remove(k);
                }
            }
            v
        })
        .collect();
    let mut rates = serde_json::to_value(rates).unwrap_or_else(|_| json!({}));
    rates["generated_token_rate"] = json!(generated_token_rate);
    json!({
        "at_ms": at_ms,
        "gateway": {
            "node": facts.node,
            "draining": facts.draining,
            "in_flight": facts.in_flight,
        },
        "chaos": { "enabled": facts.chaos, "token": facts.chaos_token },
        "nodes": slim,
        "rates": rates,
        "totals": totals,
    })
}

/// `GET /v1/fleet/live`: the page's stream (see the module docs): the recorded history, then
/// the live records. Ends when the gateway stops.
async fn live(State(s): State<Arc<GatewayShared>>) -> Response {
    use futures::StreamExt;
    // Subscribed before the history is read: a record may come twice, never not at all.
    let live = feed(s.clone());
    let past = futures::stream::iter(s.page_history.replay());
    let events = past
        .chain(live)
        .map(|(kind, data)| Ok::<_, Infallible>(Event::default().event(kind.name()).data(data)));
    axum::response::Sse::new(events)
        .keep_alive(crate::openai::sse::keep_alive(Duration::from_secs(15)))
        .into_response()
}

/// Records the page's stream into `shared.page_history` until `stop` is cancelled (the
/// gateway stops): started with the gateway, so a page's first load has a past too.
pub async fn record(shared: Arc<GatewayShared>, stop: tokio_util::sync::CancellationToken) {
    use futures::StreamExt;
    let history = shared.page_history.clone();
    let mut records = std::pin::pin!(feed(shared));
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            next = records.next() => match next {
                Some((kind, data)) => history.push(kind, data),
                None => break,
            },
        }
    }
}

/// The page's live records: `view` frames of the published fleet view and `fleet` events of
/// the bus, as `(kind, JSON)`. Subscribes at once; ends when the view or the bus closes.
fn feed(s: Arc<GatewayShared>) -> impl futures::Stream<Item = (FeedKind, String)> {
    use tokio::sync::broadcast::error::RecvError;
    let mut view = s.fleet.subscribe();
    let mut bus = s.bus.subscribe();
    let shared = s;
    async_stream::stream! {
        let mut reader = ViewReader::default();
        let mut rates = FleetSignals::default();
        let mut generated = GeneratedTokens::default();
        let mut token_rate = 0.0;
        let mut last_read: Option<tokio::time::Instant> = None;
        let mut last_sent: Option<tokio::time::Instant> = None;
        let mut dirty = true;
        let mut tick = tokio::time::interval(VIEW_MIN_GAP);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                changed = view.changed() => {
                    if changed.is_err() {
                        break; // Discovery's view is gone: the node stops
                    }
                    dirty = true;
                }
                ev = bus.recv() => match ev {
                    Ok(ev) => match serde_json::to_string(&ev) {
                        Ok(data) => {
                            let placed = matches!(ev.kind, crate::request_plane::events::FleetEventKind::Placed { .. });
                            yield (if placed { FeedKind::Placed } else { FeedKind::Fleet }, data);
                        }
                        Err(e) => tracing::warn!(error = %e, "fleet event not encodable"),
                    },
                    Err(RecvError::Lagged(missed)) => {
                        yield (FeedKind::Lagged, json!({"event": "lagged", "missed": missed}).to_string());
                    }
                    Err(RecvError::Closed) => break,
                },
                _ = tick.tick() => {}
            }
            let now = tokio::time::Instant::now();
            let due = last_sent.is_none_or(|t| {
                let gap = now.saturating_duration_since(t);
                (dirty && gap >= VIEW_MIN_GAP) || gap >= VIEW_MAX_GAP
            });
            if !due {
                continue;
            }
            let Some(nodes) = shared.fleet.latest() else {
                continue;
            };
            let at_ms = crate::runtime::clock::unix_ms();
            match last_read {
                None => {
                    reader.read(&nodes, at_ms, 0.0); // the baseline
                    generated.read(&nodes);
                    last_read = Some(now);
                }
                Some(t) if now.saturating_duration_since(t) >= RATE_WINDOW => {
                    let window = now.saturating_duration_since(t).as_secs_f64();
                    rates = reader.read(&nodes, at_ms, window);
                    token_rate = generated.read(&nodes) as f64 / window;
                    last_read = Some(now);
                }
                Some(_) => {}
            }
            let facts = GatewayFacts {
                node: shared
                    .discovery_name
                    .rsplit_once('/')
                    .map_or("", |(node, _)| node)
                    .to_owned(),
                chaos: shared.chaos.is_some(),
                chaos_token: shared.chaos.as_ref().is_some_and(|c| c.has_token()),
                draining: shared.stats.draining(),
                in_flight: shared.serving.as_ref().map_or(0, |v| v.registry.len()),
            };
            let data = frame(at_ms, &nodes, &rates, token_rate, &facts).to_string();
            yield (FeedKind::View, data);
            last_sent = Some(now);
            dirty = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::discovery::membership::{NodeState, WorkerView};
    use crate::runtime::ids::NodeId;
    use crate::runtime::resilience::NodeCounters;

    fn node(id: &str, state: NodeState, migrations: u64, workers: usize) -> NodeView {
        NodeView {
            id: NodeId::new(id),
            addr: "127.0.0.1:1".into(),
            http_addr: None,
            roles: vec![],
            pid: 7,
            incarnation: 1,
            state,
            last_seen_ms: 0,
            workers: (0..workers)
                .map(|k| WorkerView {
                    id: format!("{id}/replica-{k}"),
                    prompt_tokens: 100,
                    cached_tokens: 40,
                    ..WorkerView::default()
                })
                .collect(),
            actors: vec![],
            counters: NodeCounters {
                migrations,
                node_restarts: 1,
                ..Default::default()
            },
            signals: Some(crate::runtime::signals::GatewaySignals {
                shed: 3,
                ..Default::default()
            }),
            planner: None,
            regions: vec![],
        }
    }

    /// A frame carries what the page reads, sums only the up nodes, and leaves out what it
    /// does not need (actors, regions, raw histograms).
    #[test]
    fn a_frame_has_the_pages_shapes_and_sums_the_up_nodes() {
        let nodes = [
            node("gw", NodeState::Up, 2, 0),
            node("w1", NodeState::Up, 1, 2),
            node("w2", NodeState::Down, 5, 1),
        ];
        let rates = FleetSignals {
            request_rate: 12.5,
            ttft_p99_ms: Some(80.0),
            ..Default::default()
        };
        let facts = GatewayFacts {
            node: "gw".into(),
            chaos: true,
            ..Default::default()
        };
        let f = frame(42, &nodes, &rates, 7.5, &facts);
        assert_eq!(f["at_ms"], 42);
        assert_eq!(f["gateway"]["node"], "gw");
        assert_eq!(f["chaos"]["enabled"], true);
        assert_eq!(f["chaos"]["token"], false);
        assert_eq!(f["nodes"].as_array().map(Vec::len), Some(3));
        assert_eq!(
            f["totals"]["migrations"], 3,
            "the down node's 5 are not summed"
        );
        assert_eq!(f["totals"]["shed"], 6);
        assert_eq!(
            f["totals"]["node_restarts"], 2,
            "the page's restarts card adds them"
        );
        assert_eq!(f["totals"]["workers"], 2);
        assert_eq!(f["totals"]["nodes_up"], 2);
        assert_eq!(f["rates"]["request_rate"], 12.5);
        assert_eq!(f["rates"]["ttft_p99_ms"], 80.0);
        assert_eq!(f["rates"]["generated_token_rate"], 7.5);
        let w1 = &f["nodes"][1];
        assert_eq!(w1["state"], "up");
        assert_eq!(w1["workers"][1]["id"], "w1/replica-1");
        assert_eq!(w1["workers"][1]["cached_tokens"], 40);
        for gone in ["actors", "regions", "signals", "addr"] {
            assert!(w1.get(gone).is_none(), "{gone} left out");
        }
    }

    /// Tokens per read: diffs of each worker's count; a new worker after the first read counts
    /// all it has, a restarted one (its count went down) counts from zero.
    #[test]
    fn generated_tokens_are_diffed_per_worker_across_restarts() {
        let with = |counts: &[(&str, u64)]| {
            let mut n = node("w", NodeState::Up, 0, 0);
            n.workers = counts
                .iter()
                .map(|(id, c)| WorkerView {
                    id: (*id).into(),
                    generated_tokens: *c,
                    ..WorkerView::default()
                })
                .collect();
            [n]
        };
        let mut g = GeneratedTokens::default();
        assert_eq!(g.read(&with(&[("a", 100)])), 0, "the baseline");
        assert_eq!(g.read(&with(&[("a", 130)])), 30);
        assert_eq!(g.read(&with(&[("a", 130), ("b", 5)])), 5, "a new worker");
        assert_eq!(
            g.read(&with(&[("a", 4), ("b", 5)])),
            4,
            "a restarted worker"
        );
        assert_eq!(g.read(&with(&[("b", 9)])), 4, "a worker gone");
    }

    /// The history keeps the newest frames and events up to their bounds and replays the
    /// frames first, each kind oldest first.
    #[test]
    fn the_history_keeps_the_newest_records_up_to_its_bounds() {
        let h = PageHistory::default();
        for k in 0..HISTORY_VIEWS + 3 {
            h.push(FeedKind::View, format!("v{k}"));
        }
        h.push(FeedKind::Fleet, "e0".into());
        h.push(FeedKind::Placed, "p0".into());
        h.push(FeedKind::Lagged, "lagged".into());
        h.push(FeedKind::Fleet, "e1".into());
        let r = h.replay();
        assert_eq!(r.len(), HISTORY_VIEWS + 3, "a lagged record is not kept");
        assert_eq!(
            r[0],
            (FeedKind::View, "v3".to_owned()),
            "the oldest three dropped"
        );
        assert_eq!(
            r[HISTORY_VIEWS - 1],
            (FeedKind::View, format!("v{}", HISTORY_VIEWS + 2))
        );
        assert_eq!(r[HISTORY_VIEWS], (FeedKind::Fleet, "e0".to_owned()));
        assert_eq!(r[HISTORY_VIEWS + 1], (FeedKind::Fleet, "e1".to_owned()));
        assert_eq!(r[HISTORY_VIEWS + 2], (FeedKind::Placed, "p0".to_owned()));
        // Placements have their own bound: however many come, the other events stay.
        for k in 0..HISTORY_PLACEMENTS + 5 {
            h.push(FeedKind::Placed, format!("p{k}"));
        }
        let r = h.replay();
        assert_eq!(r.len(), HISTORY_VIEWS + 2 + HISTORY_PLACEMENTS);
        assert!(r.contains(&(FeedKind::Fleet, "e0".to_owned())));
    }

    /// The assets are the ones built in, each with its type; the page names its script.
    #[tokio::test]
    async fn the_page_and_its_assets_are_served_with_their_types() {
        let page = index().await;
        assert_eq!(
            page.headers()[header::CONTENT_TYPE],
            "text/html; charset=utf-8"
        );
        assert_eq!(page.headers()[header::X_FRAME_OPTIONS], "DENY");
        assert!(INDEX_HTML.contains("/fleet/page.js") && INDEX_HTML.contains("/fleet/page.css"));
        assert!(PAGE_JS.contains("/v1/fleet/live"));
        assert_eq!(
            script().await.headers()[header::CONTENT_TYPE],
            "text/javascript; charset=utf-8"
        );
        assert_eq!(
            style().await.headers()[header::CONTENT_TYPE],
            "text/css; charset=utf-8"
        );
    }
}
