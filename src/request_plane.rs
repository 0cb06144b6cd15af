//! The request plane (milliseconds; what users feel), pure: gateway → request → router → a
//! worker's scheduler → tokens back to the request's node. The actors that carry requests
//! (gateway, request, router, token sink) are in [`crate::actors`]; this module holds what
//! they speak and decide.
//! - `protocol.rs` — the plane's messages, imported by both ends: submit, route request,
//!   token events and deliveries, finish, owners and how a worker reaches its owner's sink.
//! - `error.rs` — [`error::RequestError`]: the closed set of ways a request is refused or
//!   fails, with one mapping to HTTP status and the OpenAI error body.
//! - `events.rs` — [`events::EventBus`]: the fleet's event bus (placements, hand-offs,
//!   migrations, faults, role changes, workers and nodes coming and going).
//! - `gateway.rs` — [`gateway::GatewayConfig`]: the `[gateway]` section (HTTP edge,
//!   admission, migration bounds, the wait for capacity, session keys) and its checks.
//! - `admission.rs` — [`admission::Admission`]: whether the gateway sheds a request before
//!   any work is done (busy workers, predicted TTFT, in-flight cap).
//! - `frontend.rs` — the model's face: tokenizer, chat template, context length.
//! - `choice.rs` — [`choice::ChoiceText`]: one choice's token events turned into the text,
//!   logprobs and ids its client sees (detokenizer, stop strings, echo).
//! - `migration.rs` — [`migration::Migration`]: when a request whose worker was lost
//!   migrates again, waits for a worker or is given up.
//! - `request.rs` — [`request::RequestCore`]: one request from placement to its last token
//!   (route, submit, cancel, release, deliver, wait, migrate), as effects for the Request
//!   actor to carry out.
//! - `priority.rs` — priority classes: the configured ones, a request's class, and
//!   [`priority::Drr`], the deficit round robin the schedulers serve classes by.
//! - `router.rs` — KV-aware placement (`router/index.rs`: prefix index fed by KV events;
//!   `router/load.rs`: the active load the router placed; `router/policy.rs`: cost and
//!   selection).
//! - `token_sink.rs` — [`token_sink::SinkRegistry`]: a node's in-flight requests' receivers.

pub mod admission;
pub mod choice;
pub mod error;
pub mod events;
pub mod frontend;
pub mod gateway;
pub mod intake;
pub mod migration;
pub mod priority;
pub mod protocol;
pub mod request;
pub mod router;
pub mod token_sink;
