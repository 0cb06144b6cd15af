//! What the planner reads each interval: the fleet's signals, as the published fleet view
//! carries them, and the window that gathers them from the request path.

use crate::control::discovery::membership::{NodeState, NodeView, WorkerHealth};
use crate::runtime::role::Role;
use crate::runtime::signals::GatewaySignals;
use serde::{Deserialize, Serialize};

/// Replicas of one pool as the fleet view shows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolCount {
    /// The pool: `aggregated`, `prefill` or `decode`.
    pub role: Role,
    /// Replicas routable now.
    pub ready: u32,
    /// Replicas asked for and not yet ready (process start, weight load).
    pub starting: u32,
    /// Replicas leaving (draining: no new work, finishing what they run).
    pub draining: u32,
}

impl PoolCount {
    /// An empty pool.
    pub fn new(role: Role) -> Self {
        Self {
            role,
            ready: 0,
            starting: 0,
            draining: 0,
        }
    }

    /// Replicas that count as the pool's size: ready and starting (draining ones are leaving).
    pub fn size(&self) -> u32 {
        self.ready + self.starting
    }
}

/// The fleet's signals over one planner interval.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetSignals {
    /// When the view these signals come from was published (ms since the Unix epoch).
    pub at_ms: u64,
    /// Length of the window the rates and percentiles cover (s).
    pub window_s: f64,
    /// Requests that arrived in the window.
    pub arrivals: u64,
    /// Requests refused for want of capacity in the window (shed by admission or past the
    /// cold-start wait): demand too, though not served.
    #[serde(default)]
    pub shed: u64,
    /// `(arrivals + shed) ÷ window_s` (requests/s): the demand, served or not.
    pub request_rate: f64,
    /// Mean prompt length of the window's arrivals (tokens; 0 without arrivals).
    pub prompt_tokens: f64,
    /// Requests that finished in the window.
    pub completed: u64,
    /// Mean output length of the window's finished requests (tokens).
    pub output_tokens: f64,
    /// Mean prompt tokens served from the prefix cache, per finished request.
    pub cached_tokens: f64,
    /// p99 time to first token of the window's finished requests (ms).
    pub ttft_p99_ms: Option<f64>,
    /// Median time to first token, same requests (ms).
    #[serde(default)]
    pub ttft_p50_ms: Option<f64>,
    /// Median inter-token latency, same tokens (ms).
    #[serde(default)]
    pub itl_p50_ms: Option<f64>,
    /// Output tokens of the window's finished requests per second of the window.
    #[serde(default)]
    pub output_token_rate: f64,
    /// p99 inter-token latency over the window's finished requests' tokens (ms).
    pub itl_p99_ms: Option<f64>,
    /// Requests in the fleet now (running and waiting on replicas).
    pub in_flight: u64,
    /// Requests waiting for a replica's admission now.
    pub waiting: u64,
    /// Requests waiting because a pool has no replica (scale from zero).
    pub waiting_for_capacity: u64,
    /// Mean fraction of KV blocks pinned, over ready replicas.
    pub kv_usage: f64,
    /// Each pool's replicas.
    pub pools: Vec<PoolCount>,
}

impl FleetSignals {
    /// Pool `role`'s count, if the fleet has that pool.
    pub fn pool(&self, role: Role) -> Option<&PoolCount> {
        self.pools.iter().find(|p| p.role == role)
    }
}

/// Reads [`FleetSignals`] from the published fleet view, one interval at a time: the
/// gateways' cumulative counts ([`GatewaySignals`]) diffed against the previous read, the
/// workers' views counted per pool.
#[derive(Clone, Debug, Default)]
pub struct ViewReader {
    /// Each gateway's counts at the previous read, by (node, incarnation).
    last: std::collections::HashMap<(String, u64), GatewaySignals>,
    /// Whether a read happened before (the first only sets the baseline).
    primed: bool,
    /// Pools seen so far (a pool scaled to zero stays listed).
    pools: Vec<Role>,
}

impl ViewReader {
    /// A reader that counts `pools` from the first read, seen or not (`planner.pools`).
    pub fn with_pools(pools: &[Role]) -> Self {
        let mut unique = Vec::new();
        for r in pools {
            if !unique.contains(r) {
                unique.push(*r);
            }
        }
        Self {
            pools: unique,
            ..Self::default()
        }
    }

    /// A reader whose gateways are known to have counted from zero when it starts (a
    /// simulated fleet, born with its planner): the first read counts everything since,
    /// instead of only setting the baseline (a live planner joins gateways that may have
    /// counted for hours).
    pub fn counting_from_zero(mut self) -> Self {
        self.primed = true;
        self
    }

    /// The signals of the interval since the previous read, `window_s` long, as of `at_ms`
    /// (when the view was last refreshed).
    pub fn read(&mut self, nodes: &[NodeView], at_ms: u64, window_s: f64) -> FleetSignals {
        let mut sum = GatewaySignals::default();
        let mut seen = std::collections::HashMap::new();
        for n in nodes.iter().filter(|n| n.state != NodeState::Down) {
            let Some(now) = &n.signals else {
                continue;
            };
            let key = (n.id.to_string(), n.incarnation);
            if self.primed {
                let before = self.last.get(&key).cloned().unwrap_or_default();
                let restarted = now.arrivals < before.arrivals;
                let base = if restarted {
                    GatewaySignals::default()
                } else {
                    before
                };
                sum.arrivals += now.arrivals - base.arrivals;
                sum.prompt_tokens += now.prompt_tokens.saturating_sub(base.prompt_tokens);
                sum.completed += now.completed.saturating_sub(base.completed);
                sum.output_tokens += now.output_tokens.saturating_sub(base.output_tokens);
                sum.cached_tokens += now.cached_tokens.saturating_sub(base.cached_tokens);
                sum.shed += now.shed.saturating_sub(base.shed);
                sum.ttft.add(&now.ttft.since(&base.ttft));
                sum.itl.add(&now.itl.since(&base.itl));
            }
            sum.waiting_for_capacity += now.waiting_for_capacity;
            seen.insert(key, now.clone());
        }
        self.last = seen;
        self.primed = true;
        let mut pools: Vec<PoolCount> = self.pools.iter().map(|r| PoolCount::new(*r)).collect();
        let (mut in_flight, mut waiting, mut used, mut total) = (0u64, 0u64, 0usize, 0usize);
        for n in nodes.iter().filter(|n| n.state != NodeState::Down) {
            for w in &n.workers {
                let role = w.role.unwrap_or_default();
                let i = match pools.iter().position(|p| p.role == role) {
                    Some(i) => i,
                    None => {
                        self.pools.push(role);
                        pools.push(PoolCount::new(role));
                        pools.len() - 1
                    }
                };
                let p = &mut pools[i];
                match w.health {
                    WorkerHealth::Ready => p.ready += 1,
                    WorkerHealth::Draining => p.draining += 1,
                    WorkerHealth::Unknown | WorkerHealth::Unhealthy => p.starting += 1,
                    WorkerHealth::Unreachable => {}
                }
                in_flight += w.in_flight as u64;
                waiting += w.waiting as u64;
                if w.health == WorkerHealth::Ready {
                    used += w.kv_blocks_used;
                    total += w.kv_blocks_total;
                }
            }
        }
        let mean = |s: u64, n: u64| if n == 0 { 0.0 } else { s as f64 / n as f64 };
        FleetSignals {
            at_ms,
            window_s,
            arrivals: sum.arrivals,
            shed: sum.shed,
            request_rate: if window_s > 0.0 {
                (sum.arrivals + sum.shed) as f64 / window_s
            } else {
                0.0
            },
            prompt_tokens: mean(sum.prompt_tokens, sum.arrivals),
            completed: sum.completed,
            output_tokens: mean(sum.output_tokens, sum.completed),
            cached_tokens: mean(sum.cached_tokens, sum.completed),
            ttft_p99_ms: sum.ttft.quantile_ms(0.99),
            itl_p99_ms: sum.itl.quantile_ms(0.99),
            ttft_p50_ms: sum.ttft.quantile_ms(0.5),
            itl_p50_ms: sum.itl.quantile_ms(0.5),
            output_token_rate: if window_s > 0.0 {
                sum.output_tokens as f64 / window_s
            } else {
                0.0
            },
            in_flight,
            waiting,
            waiting_for_capacity: sum.waiting_for_capacity,
            kv_usage: if total > 0 {
                used as f64 / total as f64
            } else {
                0.0
            },
            pools,
        }
    }
}
