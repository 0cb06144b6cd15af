//! The HTTP gateway actor: the only door for clients.
//!
//! It binds its listener in `pre_start` (so a bind failure is a start failure its supervisor
//! sees), serves the axum app from [`routes::app`] on a task through its own accept loop
//! ([`conn::serve`]: connection cap, idle and header deadlines), and stops the server in
//! `post_stop`: graceful shutdown first, aborted after [`SERVER_STOP_GRACE`]; a killed actor
//! (no `post_stop`) still releases its listener, through a drop guard in its state. If the server
//! task ends on its own, the actor fails so its supervisor restarts it; a restart re-binds the
//! same port (the first bind's port when configured as 0). A serving gateway also samples its
//! node's completed requests and output tokens every second until it stops (the windows behind
//! `/metrics`' `flotilla_request_rate` and `flotilla_output_token_rate`, `runtime/signals.rs`).
//!
//! Files, each importing only those above it:
//! - `state.rs` — [`state::GatewayShared`], the routes' shared state, and the data it holds.
//! - `edge.rs` — what every request goes through: request ids, JSON bodies, the control API's
//!   guard; the shared answers (`/live`, readiness, 404, 405). `edge/encoding.rs`: the headers
//!   that change how a body is read (`Content-Encoding` decoded, other codings refused by name).
//! - `serve.rs` — the generation routes, OpenAI's and Anthropic's `/v1/messages` (admission,
//!   body, validation, streaming); `serve/wire.rs` — each API's parser, records and error shape.
//! - `session.rs` — a request's session key (`x-session-id` and the other configured headers,
//!   or the body's `user`), bounded.
//! - `chaos_routes.rs`, `worker_routes.rs` — the control API: faults, a replica's role.
//! - `face.rs` — a replica's own OpenAI face (`worker.http`).
//! - `routes.rs` — the apps: the gateway's routes (and `/health`, `/metrics`, `/v1/fleet`,
//!   `/v1/fleet/events`), or a face's.
//! - `conn.rs` — the accept loop: connection cap, idle and header deadlines.

pub mod chaos_routes;
pub mod conn;
pub mod edge;
pub mod face;
pub mod page;
pub mod routes;
pub mod serve;
pub mod session;
pub mod state;
pub mod worker_routes;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use routes::GatewayShared;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long open connections get to finish when the gateway stops.
pub const SERVER_STOP_GRACE: Duration = Duration::from_secs(2);

/// Gateway messages (local).
#[derive(Debug)]
pub enum GatewayMsg {
    /// The HTTP server task ended by itself (with the error, if any).
    ServerExited(String),
}

impl ractor::Message for GatewayMsg {}

/// What the gateway needs to start.
#[derive(Clone)]
pub struct GatewayArgs {
    /// Configured listen address (port 0: any; the chosen port is kept for restarts).
    pub addr: SocketAddr,
    /// Where the bound address is published (for the node's ready line and heartbeats).
    pub bound: Arc<Mutex<Option<String>>>,
    /// Route state.
    pub shared: Arc<GatewayShared>,
    /// Connection cap and deadlines.
    pub limits: conn::ConnLimits,
}

/// The gateway actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct HttpGateway;

/// Gateway state.
pub struct GatewayState {
    cancel: CancellationToken,
    /// Cancels the server when the state is dropped — also when the actor is killed and
    /// `post_stop` does not run — so the listener is released for the restarted actor.
    _stop_on_drop: tokio_util::sync::DropGuard,
    server: Option<JoinHandle<()>>,
    /// The bound address.
    pub addr: SocketAddr,
}

impl Actor for HttpGateway {
    type Msg = GatewayMsg;
    type State = GatewayState;
    type Arguments = GatewayArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: GatewayArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let previous = args
            .bound
            .lock()
            .map(|g| g.clone())
            .unwrap_or_else(|p| p.into_inner().clone());
        let addr = match previous.and_then(|p| p.parse::<SocketAddr>().ok()) {
            Some(prev) if args.addr.port() == 0 => prev,
            _ => args.addr,
        };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("gateway cannot listen on {addr}: {e}"))?;
        let addr = listener.local_addr()?;
        if let Ok(mut g) = args.bound.lock() {
            *g = Some(addr.to_string());
        }
        if args.shared.serving.is_some() {
            // Every shed reason's series from the start, at 0: a dashboard's rate() sees the
            // first shed request, and its query finds the series before anything was shed.
            for reason in crate::request_plane::error::ShedReason::LABELS {
                metrics::counter!("flotilla_shed_total", "reason" => reason).increment(0);
            }
        }
        if let Some(serving) = &args.shared.serving {
            for c in &serving.priority.classes {
                metrics::counter!("flotilla_class_shed_total", "class" => c.name.clone())
                    .increment(0);
            }
        }
        let cancel = CancellationToken::new();
        if let Some(serving) = args
            .shared
            .serving
            .as_ref()
            .filter(|_| args.shared.face.is_none())
        {
            // The samples behind `flotilla_request_rate` and `flotilla_output_token_rate`.
            let (stats, clock, token) = (
                args.shared.stats.clone(),
                serving.clock.clone(),
                cancel.clone(),
            );
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(crate::runtime::signals::RATE_SAMPLE_EVERY);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        () = token.cancelled() => break,
                        _ = tick.tick() => stats.signals().sample_rates(clock.now()),
                    }
                }
            });
        }
        if args.shared.face.is_none() {
            // The fleet page's history, kept from the start (page.rs).
            tokio::spawn(page::record(args.shared.clone(), cancel.clone()));
        }
        let app = routes::app(args.shared.clone());
        let token = cancel.clone();
        let limits = args.limits;
        let me = myself.clone();
        let server = tokio::spawn(async move {
            let result = conn::serve(listener, app, limits, token).await;
            if !me.get_status().eq(&ractor::ActorStatus::Stopping) {
                let why = match result {
                    Ok(()) => "server ended".to_owned(),
                    Err(e) => e.to_string(),
                };
                let _ = me.cast(GatewayMsg::ServerExited(why));
            }
        });
        tracing::info!(%addr, "gateway listening");
        Ok(GatewayState {
            _stop_on_drop: cancel.clone().drop_guard(),
            cancel,
            server: Some(server),
            addr,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.cancel.cancel();
        if let Some(mut server) = state.server.take()
            && tokio::time::timeout(SERVER_STOP_GRACE, &mut server)
                .await
                .is_err()
        {
            server.abort();
            let _ = server.await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            GatewayMsg::ServerExited(why) => {
                if state.cancel.is_cancelled() {
                    return Ok(());
                }
                Err(format!("HTTP server on {} exited: {why}", state.addr).into())
            }
        }
    }
}
