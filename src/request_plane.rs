//! The request plane (milliseconds; what users feel): gateway → request → router → a worker's
//! scheduler → tokens back to the request's node.
//! - `gateway.rs` — the HTTP gateway actor: the only door for clients (`gateway/`: routes,
//!   admission, the accept loop, the chaos API routes).
//! - `request.rs` — one actor per in-flight request: placement, submission, stream, cancel,
//!   migration (`request/migration.rs`: the pure migration rule).
//! - `router.rs` — KV-aware placement (`router/index.rs`: prefix index fed by KV events;
//!   `router/load.rs`: active load; `router/policy.rs`: cost and selection).
//! - `token_sink.rs` — where a node receives its requests' tokens, one message per step.

pub mod gateway;
pub mod request;
pub mod router;
pub mod token_sink;
