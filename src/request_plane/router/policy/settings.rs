//! The routing policies ([`Policy`]) and the selector's settings ([`SelectorConfig`]): the
//! measured defaults (the parent module's docs say where each comes from), the tier credit
//! and peer-pull settings, and the ranges [`SelectorConfig::validate`] checks.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Tokens per KV block unless configured (the engine's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// `kv`'s weight on the tokens the cache saves unless configured (measured:
/// `docs/benchmarks.md`, "KV-aware routing").
pub const DEFAULT_OVERLAP_WEIGHT: f64 = 4.0;
/// `kv`'s weight on decode blocks against prefill blocks unless configured (measured: the
/// module docs and `docs/benchmarks.md`, "KV-aware routing").
pub const DEFAULT_DECODE_WEIGHT: f64 = 0.125;
/// `kv`'s imbalance guard unless configured: no worker takes more than 1.5 × the mean
/// requests in flight + 4 (SGLang's `cache_aware` uses the same shape, 1.5 × and 64 requests
/// against the least loaded); a hot prefix's holder should take at most 40–50 % of its
/// requests.
pub const DEFAULT_BALANCE_RATIO: f64 = 1.5;
/// See [`DEFAULT_BALANCE_RATIO`].
pub const DEFAULT_BALANCE_REQUESTS: u32 = 4;
/// Queued prefill tokens (tokens) up to which a session's worker keeps its next turns, unless
/// configured (`router.session_max_queued_tokens`): measured on an agent workload with bursts
/// of sub-requests (module docs, "Sessions that stick"; `docs/benchmarks.md`).
pub const DEFAULT_SESSION_MAX_QUEUED_TOKENS: u64 = 256;

/// How the router picks a worker.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Lowest KV cost (prefix reuse against load), see the module docs.
    #[default]
    Kv,
    /// NVIDIA Dynamo's KV cost (see the module docs), for side-by-side comparisons.
    DynamoKv,
    /// Fewest requests in flight, then fewest decode blocks.
    LeastLoaded,
    /// Each live worker in turn.
    RoundRobin,
    /// Uniformly at random (seeded).
    Random,
}

impl Policy {
    /// Every policy.
    pub const ALL: [Policy; 5] = [
        Policy::Kv,
        Policy::DynamoKv,
        Policy::LeastLoaded,
        Policy::RoundRobin,
        Policy::Random,
    ];

    /// The name used in configuration: `kv`, `dynamo_kv`, `least_loaded`, `round_robin`,
    /// `random`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::DynamoKv => "dynamo_kv",
            Policy::LeastLoaded => "least_loaded",
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name that is none of [`Policy::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown routing policy {0:?}: expected kv, dynamo_kv, least_loaded, round_robin or random"
)]
pub struct UnknownPolicy(pub String);

impl FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Policy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// Selector settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectorConfig {
    pub policy: Policy,
    /// Tokens per KV block (must match the workers'), > 0.
    pub block_size: u32,
    /// `kv`: weight of the request's uncached prompt tokens against load, finite and ≥ 0.
    pub overlap_weight: f64,
    /// `kv`: weight of a decode block against a block of prefill, finite and ≥ 0.
    pub decode_weight: f64,
    /// `kv`'s imbalance guard: a worker with more requests in flight than `balance_ratio ×`
    /// the live workers' mean `+ balance_requests` is not picked (0: off), finite and ≥ 0.
    pub balance_ratio: f64,
    /// See `balance_ratio`.
    pub balance_requests: u32,
    /// `dynamo_kv`: weight of the prefill term (Dynamo's `--kv-overlap-score-weight`), finite
    /// and ≥ 0.
    pub dynamo_overlap_weight: f64,
    /// 0: lowest cost wins; > 0: softmax sampling (kv policy only), finite.
    pub temperature: f64,
    /// Seed of the random generator (temperature sampling, `random`).
    pub seed: u64,
    /// Both kv policies: what a cached block is worth in each tier below G1, against 1 for a
    /// block in G1 (see the module docs, "Tier credit").
    pub tier_credit: TierCredit,
    /// Both kv policies: what a prompt block another worker holds in G1, and this worker
    /// could pull from it, is worth (see the module docs, "Peer pulls").
    pub peer_pull: PeerPull,
    /// Both kv policies: a session's worker keeps its turns while its queued prefill tokens
    /// are at most this many (tokens; 0: sessions never stick). Module docs, "Sessions that
    /// stick"; default [`DEFAULT_SESSION_MAX_QUEUED_TOKENS`].
    pub session_max_queued_tokens: u64,
}

/// Peer pulls (G4): a worker short of a prompt's leading blocks that another worker holds in
/// G1 may pull them through the KV transport instead of recomputing them. The router counts
/// such blocks at `credit` of a G1 block and names the holder in the placement
/// ([`Decision::fetch`](super::Decision::fetch)) when the chosen worker lacks at least
/// `min_blocks` of them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeerPull {
    /// A pullable block against 1 for a G1 block, in [0, 1]; 0 turns peer pulls off.
    pub credit: f64,
    /// Fewest blocks worth a pull (a pull costs a round trip to the holder first); at least 1.
    pub min_blocks: u32,
}

impl PeerPull {
    /// Default floor: 4 blocks (64 tokens at the default block size).
    pub const DEFAULT_MIN_BLOCKS: u32 = 4;

    /// Default credit, measured (`docs/benchmarks.md`, "Peer pulls"): on a fork-heavy agent
    /// workload 0.75 cut TTFT p50 1.9–4.8× where NVIDIA Dynamo's 0.5 for a shared remote pool
    /// cut it 1.2–4.1×, and 1 added little while raising TTFT p90 on one load; on the
    /// Mooncake conversation trace every credit from 0.5 to 1 is within 2 % of no pulls.
    pub const DEFAULT_CREDIT: f64 = 0.75;

    /// Whether the router looks for holders at all.
    pub fn is_on(&self) -> bool {
        self.credit > 0.0
    }
}

/// On, at the measured [`PeerPull::DEFAULT_CREDIT`]; a worker without a KV transport (or
/// with `worker.peer_pulls=false`) ignores the hints and prefills.
impl Default for PeerPull {
    fn default() -> Self {
        PeerPull {
            credit: Self::DEFAULT_CREDIT,
            min_blocks: Self::DEFAULT_MIN_BLOCKS,
        }
    }
}

/// What a prefix block cached below G1 is worth to the kv costs, against 1 for a G1 block: it
/// saves its prefill but must be copied in first. Defaults: NVIDIA Dynamo's published weights
/// (host 0.75, disk 0.25; `docs/benchmarks.md`, "KV tiers", measures ours against them).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierCredit {
    /// A block in G2 (host memory), in [0, 1].
    pub host: f64,
    /// A block in G3 (local disk), in [0, 1].
    pub disk: f64,
}

impl Default for TierCredit {
    fn default() -> Self {
        TierCredit {
            host: 0.75,
            disk: 0.25,
        }
    }
}

impl Default for SelectorConfig {
    fn default() -> Self {
        SelectorConfig {
            policy: Policy::Kv,
            block_size: DEFAULT_BLOCK_SIZE,
            overlap_weight: DEFAULT_OVERLAP_WEIGHT,
            decode_weight: DEFAULT_DECODE_WEIGHT,
            balance_ratio: DEFAULT_BALANCE_RATIO,
            balance_requests: DEFAULT_BALANCE_REQUESTS,
            dynamo_overlap_weight: 1.0,
            temperature: 0.0,
            seed: 0,
            tier_credit: TierCredit::default(),
            peer_pull: PeerPull::default(),
            session_max_queued_tokens: DEFAULT_SESSION_MAX_QUEUED_TOKENS,
        }
    }
}

/// An invalid [`SelectorConfig`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectorConfigError {
    #[error("block_size must be > 0")]
    ZeroBlockSize,
    #[error(
        "overlap_weight, decode_weight, dynamo_overlap_weight and balance_ratio must be finite and >= 0, got {0}"
    )]
    OverlapWeight(f64),
    #[error("temperature must be finite and >= 0, got {0}")]
    Temperature(f64),
    #[error(
        "the tier credits (router.tier_credit_host, router.tier_credit_disk) must be in [0, 1], got {0}"
    )]
    TierCredit(f64),
    #[error("router.pull_credit must be in [0, 1], got {0}")]
    PullCredit(f64),
    #[error("router.pull_min_blocks must be at least 1 (a pull moves whole blocks)")]
    PullMinBlocks,
}

impl SelectorConfig {
    /// Checks the ranges documented on the fields.
    ///
    /// # Errors
    /// The first field out of its range.
    pub fn validate(&self) -> Result<(), SelectorConfigError> {
        if self.block_size == 0 {
            return Err(SelectorConfigError::ZeroBlockSize);
        }
        for w in [
            self.overlap_weight,
            self.decode_weight,
            self.dynamo_overlap_weight,
            self.balance_ratio,
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(SelectorConfigError::OverlapWeight(w));
            }
        }
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(SelectorConfigError::Temperature(t));
        }
        if !(0.0..=1.0).contains(&self.peer_pull.credit) {
            return Err(SelectorConfigError::PullCredit(self.peer_pull.credit));
        }
        if self.peer_pull.min_blocks == 0 {
            return Err(SelectorConfigError::PullMinBlocks);
        }
        for c in [self.tier_credit.host, self.tier_credit.disk] {
            if !(0.0..=1.0).contains(&c) {
                return Err(SelectorConfigError::TierCredit(c));
            }
        }
        Ok(())
    }
}
