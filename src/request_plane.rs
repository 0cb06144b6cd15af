//! The request plane (milliseconds; what users feel): gateway → request → router → a worker's
//! scheduler → tokens back to the request's node.
//! - `protocol.rs` — the plane's messages, imported by both ends: submit, route request,
//!   token events and deliveries, finish, owners and how a worker reaches its owner's sink.
//! - `error.rs` — [`error::RequestError`]: the closed set of ways a request is refused or
//!   fails, with one mapping to HTTP status and the OpenAI error body.
//! - `gateway.rs` — the HTTP gateway actor: the only door for clients (`gateway/`: routes,
//!   admission control, the accept loop, the chaos API routes).
//! - `request.rs` — one actor per in-flight request: placement, submission, stream, cancel,
//!   migration (`request/migration.rs`: the pure migration rule).
//! - `router.rs` — KV-aware placement (`router/index.rs`: prefix index fed by KV events;
//!   `router/load.rs`: the active load the router placed; `router/policy.rs`: cost and
//!   selection).
//! - `token_sink.rs` — where a node receives its requests' tokens, one message per step.

pub mod error;
pub mod gateway;
pub mod protocol;
pub mod request;
pub mod router;
pub mod token_sink;
