//! Routing, pure: where a request should go, and what the router knows to decide it.
//!
//! - `index.rs` — [`index::PrefixIndex`]: which worker holds which prompt prefix, built from
//!   every worker's KV events (a path-compressed radix tree keyed by sequence hash; gap /
//!   duplicate / reset of a worker's event ids triggers one resync from its KV event
//!   publisher's snapshot).
//! - `load.rs` — [`load::ActiveLoad`]: per worker, prompt tokens waiting for prefill and active
//!   decode blocks of the requests this router placed.
//! - `policy.rs` — [`policy::Selector`]: `kv` (`(queued + overlap_weight × uncached) / B +
//!   decode_blocks`), `dynamo_kv` (NVIDIA Dynamo's cost), `least_loaded`, `round_robin`,
//!   `random`.
//! - `sync.rs` — [`sync::LoadChange`]: what routers tell each other of their load
//!   (`router.share_load`).
//!
//! - `config.rs` — [`config::RouterConfig`]: the `[router]` section (policy, weights,
//!   sessions, peer pulls, `external_workers`) and its checks.
//! - `core.rs` — [`core::RouterCore`]: the placement itself over all of the above (sessions,
//!   conditional disaggregation, the other routers' load), on an injected clock and list of
//!   workers.
//!
//! The actor that drives them is [`crate::actors::router`].

pub mod config;
pub mod core;
pub mod index;
pub mod load;
pub mod policy;
pub mod sync;
