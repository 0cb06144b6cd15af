//! The `[router]` section: request placement (the policy and its weights, sessions, peer
//! pulls, sharing load between routers) and the engines outside Flotilla a router node
//! places on (`[[router.external_workers]]`). Read by the router (`core.rs`, `policy.rs`,
//! through the composition root) and by `flotilla sim`.

use super::policy::{self, PeerPull, Policy, SelectorConfig, TierCredit, session};
use crate::runtime::config::ConfigError;
use serde::{Deserialize, Serialize};

/// Request placement (see `request_plane/router/policy.rs` for the cost formula and its source).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// `kv` (prefix overlap against load), `least_loaded`, `round_robin` or `random`; a
    /// request may override it with the `x-flotilla-route-policy` header.
    pub policy: Policy,
    /// `kv`: weight of the prompt tokens the cache saves against load (default 4).
    pub overlap_weight: f64,
    /// `kv`: weight of a decode block against a block of prefill (default 0.125).
    pub decode_weight: f64,
    /// `kv`'s imbalance guard: a worker with more requests in flight than `balance_ratio ×`
    /// the mean `+ balance_requests` is not picked while others are below (1.5 and 4; 0: off).
    pub balance_ratio: f64,
    /// See `balance_ratio`.
    pub balance_requests: u32,
    /// `dynamo_kv`: weight of the prefill term (Dynamo's `--kv-overlap-score-weight`,
    /// default 1).
    pub dynamo_overlap_weight: f64,
    /// 0: the cheapest worker wins; above, a softmax over normalised costs is sampled.
    pub temperature: f64,
    /// Seed of the router's random choices (`random`, `temperature > 0`).
    pub seed: u64,
    /// `kv`, `dynamo_kv`: what a prefix block cached in G2 (`tier_credit_host`, default 0.75)
    /// or G3 (`tier_credit_disk`, default 0.25) is worth against one in G1 (NVIDIA Dynamo's
    /// published weights; `docs/benchmarks.md`, "KV tiers").
    pub tier_credit_host: f64,
    /// See `tier_credit_host`.
    pub tier_credit_disk: f64,
    /// `kv`, `dynamo_kv`: what a prompt block another worker holds in G1 is worth to a
    /// worker that could pull it (peer pulls, G4), in [0, 1]; default 0.75, measured
    /// (`docs/benchmarks.md`, "Peer pulls"; NVIDIA Dynamo weighs a shared remote pool at 0.5);
    /// 0 turns peer pulls off.
    pub pull_credit: f64,
    /// Fewest blocks a placement's fetch hint names beyond what the chosen worker holds
    /// (default 4).
    pub pull_min_blocks: u32,
    /// Several routers (nodes with the router role) tell each other every change to the
    /// load they put on the workers and count each other's (default true; false: each
    /// counts only its own placements, as independent routers do). The prefix index is
    /// shared either way: every router applies every worker's KV events.
    pub share_load: bool,
    /// `kv`, `dynamo_kv`: a session's turns (requests with the same session key, see
    /// `gateway.session_headers`) stay on the worker that served its last turn while that
    /// worker's queued prefill tokens are at most this many; past it the cost decides and the
    /// session moves (default 256, measured: `router/policy.rs`, "Sessions that stick";
    /// `docs/benchmarks.md`). 0: off.
    pub session_max_queued_tokens: u64,
    /// Sessions the router remembers (default 100 000); a new one past it evicts the least
    /// recently placed. Shared by every router (`router/policy/session.rs`).
    #[schemars(extend("x-unit" = "sessions"))]
    pub session_capacity: usize,
    /// A session not placed for this long is forgotten (ms, default 1 800 000: 30 minutes).
    pub session_ttl_ms: u64,
    /// Engines outside Flotilla (vLLM-compatible servers, or another fleet's `worker.http`
    /// faces) that this node's router places requests on, as workers `<node>/<name>`
    /// (`worker::external`). Read by router nodes, which need the gateway role too; other
    /// nodes ignore it.
    pub external_workers: Vec<ExternalWorkerConfig>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: Default::default(),
            overlap_weight: policy::DEFAULT_OVERLAP_WEIGHT,
            decode_weight: policy::DEFAULT_DECODE_WEIGHT,
            balance_ratio: policy::DEFAULT_BALANCE_RATIO,
            balance_requests: policy::DEFAULT_BALANCE_REQUESTS,
            dynamo_overlap_weight: 1.0,
            temperature: 0.0,
            seed: 0,
            tier_credit_host: 0.75,
            tier_credit_disk: 0.25,
            pull_credit: PeerPull::DEFAULT_CREDIT,
            pull_min_blocks: PeerPull::DEFAULT_MIN_BLOCKS,
            share_load: true,
            session_max_queued_tokens: policy::DEFAULT_SESSION_MAX_QUEUED_TOKENS,
            session_capacity: session::DEFAULT_SESSION_CAPACITY,
            session_ttl_ms: session::DEFAULT_SESSION_TTL_MS,
            external_workers: Vec::new(),
        }
    }
}

/// One external engine (`[[router.external_workers]]`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExternalWorkerConfig {
    /// Name, unique among this node's external workers: the worker id is `<node>/<name>`.
    pub name: String,
    /// The engine's OpenAI-compatible base URL, `http://` only, e.g. `http://10.0.0.7:8000`
    /// (it must serve
    /// `POST /v1/completions` with token-id prompts and vLLM's `return_token_ids`, and
    /// `GET /health`).
    pub url: String,
    /// Its vLLM-format KV event socket (ZMQ PUB), e.g. `tcp://10.0.0.7:5557`; without one
    /// the router places on this engine by load only.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// The model name to send; default: the first id of the engine's `GET /v1/models`.
    #[serde(default)]
    pub model: Option<String>,
}

impl RouterConfig {
    /// The router's placement settings (`router.*`), with the workers' block size
    /// (`worker.block_size_tokens`, tokens).
    pub fn selector_config(&self, block_size_tokens: usize) -> SelectorConfig {
        SelectorConfig {
            policy: self.policy,
            block_size: u32::try_from(block_size_tokens).unwrap_or(u32::MAX),
            overlap_weight: self.overlap_weight,
            decode_weight: self.decode_weight,
            balance_ratio: self.balance_ratio,
            balance_requests: self.balance_requests,
            dynamo_overlap_weight: self.dynamo_overlap_weight,
            temperature: self.temperature,
            seed: self.seed,
            tier_credit: TierCredit {
                host: self.tier_credit_host,
                disk: self.tier_credit_disk,
            },
            peer_pull: PeerPull {
                credit: self.pull_credit,
                min_blocks: self.pull_min_blocks,
            },
            session_max_queued_tokens: self.session_max_queued_tokens,
        }
    }

    /// The router's session table, empty, with its bounds (`router.session_capacity`,
    /// `router.session_ttl_ms`).
    pub fn session_table(&self) -> session::SessionTable {
        session::SessionTable::new(self.session_capacity, self.session_ttl_ms)
    }

    /// Check the external workers (names, URLs) and the placement weights, with the same
    /// rules the router applies when it starts (the block size is `worker`'s, checked
    /// there). Whether this node may start external workers at all depends on its roles: a
    /// rule across sections, checked by the node's configuration.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `router.external_workers`, or `router` with the weight
    /// that is out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_external_workers()?;
        self.selector_config(1)
            .validate()
            .map_err(|e| ConfigError::invalid("router", e.to_string()))
    }

    /// `router.external_workers`: names, URLs.
    fn validate_external_workers(&self) -> Result<(), ConfigError> {
        const F: &str = "router.external_workers";
        let mut names = std::collections::BTreeSet::new();
        for e in &self.external_workers {
            let ok_name = !e.name.is_empty()
                && e.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !ok_name {
                return Err(ConfigError::invalid(
                    F,
                    format!("name {:?}: use letters, digits, '-' and '_'", e.name),
                ));
            }
            if e.name.starts_with("replica-") {
                return Err(ConfigError::invalid(
                    F,
                    format!(
                        "name {:?}: replica-<k> names this node's own replicas",
                        e.name
                    ),
                ));
            }
            if !names.insert(e.name.as_str()) {
                return Err(ConfigError::invalid(
                    F,
                    format!("name {:?} appears twice", e.name),
                ));
            }
            if !e.url.starts_with("http://") {
                return Err(ConfigError::invalid(
                    F,
                    format!(
                        "{}: url {:?} must start with http:// (the engine client speaks plain \
                         HTTP; put a TLS proxy on the engine's side)",
                        e.name, e.url
                    ),
                ));
            }
            if let Some(k) = &e.kv_events
                && !k.starts_with("tcp://")
            {
                return Err(ConfigError::invalid(
                    F,
                    format!("{}: kv_events {k:?} must be a tcp:// endpoint", e.name),
                ));
            }
        }
        Ok(())
    }
}
