//! Per-request results and the statistics of a run.
//!
//! Definitions (all times in ms, measured by the client from just before the request is sent):
//! - **TTFT**: send → first non-empty content chunk; successful requests only.
//! - **ITL**: every gap between consecutive content chunks of a request, pooled over all
//!   successful requests (a chunk usually carries one token; it may carry several).
//!   **ITL max**: the longest of those gaps.
//! - **Time to second token (TT2T)**: send → second content chunk (TTFT + the first gap), per
//!   successful request with at least two chunks; quantiles, mean and max. A newcomer's
//!   first decode waits behind the prefills admitted after it, so this is where prefill
//!   stalls show most (stall-free batching, Sarathi-Serve).
//! - **TPOT**: per request, `(e2e − ttft) / (output_tokens − 1)`; requests with at least 2
//!   output tokens (`output_tokens` = `usage.completion_tokens`, else the chunk count).
//! - **E2E**: send → end of the stream; successful requests only.
//! - Percentiles p50/p90/p99: [`crate::cli::client::percentile`], the sample at rank
//!   `round((n − 1)·p)` of the sorted values; NaN (`null` in JSON) without samples.
//! - **requests_per_s** = successful requests / wall time; **output_tokens_per_s** = their
//!   output tokens / wall time. Wall time = the run's start (first arrival) → last completion.
//! - A request **meets the SLOs** when it succeeded, `TTFT ≤ --slo-ttft-ms`, and its TPOT (its
//!   mean inter-token latency) `≤ --slo-itl-ms` (a request with one output token has no TPOT
//!   and is judged on TTFT alone).
//! - **goodput_rps** = requests meeting the SLOs / wall time; **slo_attainment** = requests
//!   meeting the SLOs / all requests of the run (failed and skipped ones included).
//! - **errors**: requests that did not succeed (transport error, non-200, error record, no
//!   `[DONE]`, timeout) plus later turns of a session that were skipped after one failed.
//! - **prefix_hit_rate** = Σ `usage.prompt_tokens_details.cached_tokens` / Σ
//!   `usage.prompt_tokens` over successful requests that report both; NaN when none do.
//! - **reuse split**: successful requests whose prompt an infinite cache would hit for more
//!   than [`REUSE_TOKENS`] tokens (the workload's own sharing, `workload::Workload::ideal_cached`)
//!   and the others: count and mean TTFT of each. This is where KV-aware routing pays.

use serde::{Deserialize, Serialize};

use super::workload::WorkloadInfo;
use crate::cli::client::{StreamOutcome, percentile};

/// What one request gave (a line of `requests.jsonl`, read back by `flotilla plot`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestResult {
    /// Its session (index in the workload) and turn.
    pub session: usize,
    pub turn: usize,
    /// Sent at (s from the run's start).
    pub sent_s: f64,
    /// Prompt tokens an infinite cache would have held (`workload::Workload::ideal_cached`).
    pub ideal_cached_tokens: u64,
    /// Succeeded: 200, one id, one finish reason, `[DONE]`, no error record.
    pub ok: bool,
    /// Why not, when it failed.
    pub error: Option<String>,
    /// Send → first content chunk (ms).
    pub ttft_ms: Option<f64>,
    /// Send → end of stream (ms).
    pub e2e_ms: f64,
    /// Gaps between consecutive content chunks (ms).
    pub itl_ms: Vec<f64>,
    /// Output tokens (`usage.completion_tokens`, else content chunks).
    pub output_tokens: u64,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
}

/// Session `session`'s priority class under `--classes`: `classes[h(session) mod N]`, with
/// `h` the SplitMix64 finalizer, so that the classes are mixed in arrival order the way
/// independent tenants' requests are (`session mod N` would give each of N workers taking
/// turns one class alone; the arbiter shares a replica between the classes queued there).
pub fn class_of(classes: &[String], session: usize) -> Option<&str> {
    if classes.is_empty() {
        return None;
    }
    let mut x = (session as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    Some(classes[(x % classes.len() as u64) as usize].as_str())
}

/// One priority class's figures in a run (`--classes`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassShare {
    pub class: String,
    /// Requests sent, and those that succeeded.
    pub requests: usize,
    pub ok: usize,
    /// Refused by admission: 429 (its class was shed) or 503.
    pub shed: usize,
    /// Requests whose first token came within the contention window (below).
    pub served_in_window: usize,
    /// `served_in_window` over every class's.
    pub share: f64,
    /// TTFT percentiles of its successful requests (ms).
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
}

/// Each class's share of service **while every class had requests to serve**: the window
/// ends at the first token of the last successful request of the class that finished
/// first (the earliest such time over the classes); within it, the requests whose first
/// token came are counted per class. With every class backlogged through the window
/// (a burst of like requests, or a closed loop), the shares follow the classes' weights
/// (`request_plane/priority.rs`); past the window the classes left are served alone, so a
/// whole run's totals only say what was offered.
pub fn class_shares(results: &[RequestResult], classes: &[String]) -> Vec<ClassShare> {
    let mut names: Vec<&str> = Vec::new();
    for c in classes {
        if !names.contains(&c.as_str()) {
            names.push(c);
        }
    }
    let first_token_s = |r: &RequestResult| r.ttft_ms.map(|t| r.sent_s + t / 1000.0);
    fn of<'a>(
        results: &'a [RequestResult],
        classes: &'a [String],
        name: &'a str,
    ) -> impl Iterator<Item = &'a RequestResult> + 'a {
        results
            .iter()
            .filter(move |r| class_of(classes, r.session) == Some(name))
    }
    let of = |name| of(results, classes, name);
    let window = names
        .iter()
        .filter_map(|n| {
            of(n)
                .filter(|r| r.ok)
                .filter_map(first_token_s)
                .max_by(f64::total_cmp)
        })
        .min_by(f64::total_cmp)
        .unwrap_or(0.0);
    let mut out: Vec<ClassShare> = names
        .iter()
        .map(|n| {
            let ttft: Vec<f64> = of(n).filter(|r| r.ok).filter_map(|r| r.ttft_ms).collect();
            ClassShare {
                class: (*n).to_owned(),
                requests: of(n).count(),
                ok: of(n).filter(|r| r.ok).count(),
                shed: of(n)
                    .filter(|r| {
                        r.error.as_deref().is_some_and(|e| {
                            e.starts_with("status 429") || e.starts_with("status 503")
                        })
                    })
                    .count(),
                served_in_window: of(n)
                    .filter(|r| r.ok && first_token_s(r).is_some_and(|t| t <= window))
                    .count(),
                share: 0.0,
                ttft_p50_ms: percentile(&ttft, 0.5),
                ttft_p99_ms: percentile(&ttft, 0.99),
            }
        })
        .collect();
    let total: usize = out.iter().map(|c| c.served_in_window).sum();
    for c in &mut out {
        c.share = if total == 0 {
            0.0
        } else {
            c.served_in_window as f64 / total as f64
        };
    }
    out
}

/// [`class_shares`] as a markdown table.
pub fn class_table(label: &str, shares: &[ClassShare]) -> String {
    let mut t = format!(
        "\n{label}: priority classes (share = first tokens served while every class had \
         requests left)\n\n| class | requests | ok | shed | served in window | share | TTFT p50 \
         (ms) | TTFT p99 (ms) |\n|---|---|---|---|---|---|---|---|\n"
    );
    for c in shares {
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} % | {:.0} | {:.0} |\n",
            c.class,
            c.requests,
            c.ok,
            c.shed,
            c.served_in_window,
            c.share * 100.0,
            c.ttft_p50_ms,
            c.ttft_p99_ms
        ));
    }
    t
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl RequestResult {
    /// The result of a finished stream.
    pub fn from_outcome(o: &StreamOutcome) -> Self {
        let ok = o.is_complete();
        let error = (!ok).then(|| match &o.error {
            Some(e) => format!("status {}: {e}", o.status),
            None => format!("status {}: incomplete stream", o.status),
        });
        Self {
            ok,
            error,
            ttft_ms: o.ttft.map(ms),
            e2e_ms: ms(o.e2e),
            itl_ms: o
                .chunk_times
                .windows(2)
                .map(|w| ms(w[1].saturating_sub(w[0])))
                .collect(),
            output_tokens: o.completion_tokens.unwrap_or(o.chunk_times.len() as u64),
            prompt_tokens: o.prompt_tokens,
            cached_tokens: o.cached_tokens,
            ..Self::default()
        }
    }

    /// A request that failed before any answer (or was skipped), with `why`.
    pub fn failed(why: impl Into<String>) -> Self {
        Self {
            error: Some(why.into()),
            ..Self::default()
        }
    }

    /// Send → second content chunk (ms), with at least two chunks.
    pub fn tt2t_ms(&self) -> Option<f64> {
        Some(self.ttft_ms? + self.itl_ms.first()?)
    }

    /// TPOT (ms): `(e2e − ttft) / (output_tokens − 1)`, with at least 2 tokens.
    pub fn tpot_ms(&self) -> Option<f64> {
        let ttft = self.ttft_ms?;
        (self.output_tokens >= 2).then(|| (self.e2e_ms - ttft) / (self.output_tokens - 1) as f64)
    }
}

/// Service-level objectives (ms); `None` = no bound.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Slo {
    /// Largest TTFT.
    pub ttft_ms: Option<f64>,
    /// Largest TPOT (mean inter-token latency of a request).
    pub itl_ms: Option<f64>,
}

impl Slo {
    /// Whether `r` meets both objectives (module doc).
    pub fn met_by(&self, r: &RequestResult) -> bool {
        let Some(ttft) = r.ttft_ms.filter(|_| r.ok) else {
            return false;
        };
        let ttft_ok = self.ttft_ms.is_none_or(|t| ttft <= t);
        let itl_ok = match (self.itl_ms, r.tpot_ms()) {
            (Some(limit), Some(tpot)) => tpot <= limit,
            _ => true,
        };
        ttft_ok && itl_ok
    }
}

/// p50 / p90 / p99 of a metric (ms).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Quantiles {
    /// The quantiles of `v` (NaN when empty).
    pub fn of(v: &[f64]) -> Self {
        Self {
            p50: percentile(v, 0.50),
            p90: percentile(v, 0.90),
            p99: percentile(v, 0.99),
        }
    }
}

/// One run's entry of `report.json` (definitions in the module doc).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunStats {
    /// `policy=round_robin`, or the workload's name without `--compare`.
    pub label: String,
    /// TTFT quantiles.
    pub ttft_ms: Quantiles,
    /// ITL quantiles.
    pub itl_ms: Quantiles,
    /// The longest inter-token gap of the run.
    pub itl_max_ms: f64,
    /// Time-to-second-token quantiles.
    pub tt2t_ms: Quantiles,
    /// Mean time to second token.
    pub tt2t_mean_ms: f64,
    /// Longest time to second token.
    pub tt2t_max_ms: f64,
    /// TPOT quantiles.
    pub tpot_ms: Quantiles,
    /// End-to-end quantiles.
    pub e2e_ms: Quantiles,
    /// Successful requests per second.
    pub requests_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Requests meeting the SLOs per second.
    pub goodput_rps: f64,
    /// Fraction of requests meeting the SLOs.
    pub slo_attainment: f64,
    /// Measured prefix-cache hit rate.
    pub prefix_hit_rate: f64,
    /// The workload's ideal hit rate (see `workload`).
    pub ideal_prefix_hit_rate: f64,
    /// Requests of the run.
    pub requests: usize,
    /// Requests that did not succeed.
    pub errors: usize,
    /// Successful requests that could reuse more than the first 512-token block of an earlier
    /// prompt (ideal cached tokens > 512), and their mean TTFT (ms).
    pub reuse_requests: usize,
    pub reuse_ttft_mean_ms: f64,
    /// The other successful requests' mean TTFT (ms).
    pub other_ttft_mean_ms: f64,
    /// Wall time of the run (s).
    pub wall_s: f64,
    /// The run's prefix salt (see `bench` module doc).
    pub salt: u64,
    /// The workload: name, sessions, what the caps changed, Mooncake's own hit rate.
    pub workload: WorkloadInfo,
    /// Worker replica-seconds the fleet held during the run (`None`: not measured).
    pub replica_seconds: Option<f64>,
    /// Output tokens of the requests that met the SLOs.
    pub tokens_in_slo: u64,
    /// The fleet's cost per million output tokens served within the SLOs ($; `None`: not
    /// measured, or no token within them).
    pub cost_per_million_in_slo: Option<f64>,
}

/// The raw samples a CDF plot needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Samples {
    /// TTFT of each successful request (ms).
    pub ttft_ms: Vec<f64>,
    /// E2E of each successful request (ms).
    pub e2e_ms: Vec<f64>,
}

/// Everything the bench needs to know about how a run went, besides its results.
#[derive(Clone, Copy, Debug)]
pub struct RunContext<'a> {
    /// Label.
    pub label: &'a str,
    /// Wall time (s).
    pub wall_s: f64,
    /// Objectives.
    pub slo: Slo,
    /// Ideal hit rate of the workload.
    pub ideal_hit_rate: f64,
    /// Prefix salt.
    pub salt: u64,
    /// The workload.
    pub workload: &'a WorkloadInfo,
    /// What the fleet held during the run, when it was measured.
    pub fleet: Option<FleetUse>,
}

/// The worker replicas a run held, and what they cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FleetUse {
    /// Worker replicas × seconds, over the run.
    pub replica_seconds: f64,
    /// Their cost ($).
    pub dollars: f64,
}

/// Statistics and CDF samples of one run.
pub fn summarize(ctx: RunContext<'_>, results: &[RequestResult]) -> (RunStats, Samples) {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.ok).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
    let tpot: Vec<f64> = ok.iter().filter_map(|r| r.tpot_ms()).collect();
    let tt2t: Vec<f64> = ok.iter().filter_map(|r| r.tt2t_ms()).collect();
    let tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let met = results.iter().filter(|r| ctx.slo.met_by(r)).count();
    let tokens_in_slo: u64 = results
        .iter()
        .filter(|r| r.ok && ctx.slo.met_by(r))
        .map(|r| r.output_tokens)
        .sum();
    let (reuse, other): (Vec<&&RequestResult>, Vec<&&RequestResult>) = ok
        .iter()
        .partition(|r| r.ideal_cached_tokens > REUSE_TOKENS);
    let mean_ttft = |v: &[&&RequestResult]| {
        let t: Vec<f64> = v.iter().filter_map(|r| r.ttft_ms).collect();
        if t.is_empty() {
            f64::NAN
        } else {
            t.iter().sum::<f64>() / t.len() as f64
        }
    };
    let per_s = |x: f64| {
        if ctx.wall_s > 0.0 {
            x / ctx.wall_s
        } else {
            f64::NAN
        }
    };
    let stats = RunStats {
        label: ctx.label.to_owned(),
        ttft_ms: Quantiles::of(&ttft),
        itl_ms: Quantiles::of(&itl),
        itl_max_ms: max(&itl),
        tt2t_ms: Quantiles::of(&tt2t),
        tt2t_mean_ms: if tt2t.is_empty() {
            f64::NAN
        } else {
            tt2t.iter().sum::<f64>() / tt2t.len() as f64
        },
        tt2t_max_ms: max(&tt2t),
        tpot_ms: Quantiles::of(&tpot),
        e2e_ms: Quantiles::of(&e2e),
        requests_per_s: per_s(ok.len() as f64),
        output_tokens_per_s: per_s(tokens as f64),
        goodput_rps: per_s(met as f64),
        slo_attainment: met as f64 / results.len() as f64,
        prefix_hit_rate: measured_hit_rate(&ok),
        ideal_prefix_hit_rate: ctx.ideal_hit_rate,
        requests: results.len(),
        errors: results.len() - ok.len(),
        reuse_requests: reuse.len(),
        reuse_ttft_mean_ms: mean_ttft(&reuse),
        other_ttft_mean_ms: mean_ttft(&other),
        wall_s: ctx.wall_s,
        salt: ctx.salt,
        workload: ctx.workload.clone(),
        replica_seconds: ctx.fleet.map(|f| f.replica_seconds),
        tokens_in_slo,
        cost_per_million_in_slo: ctx
            .fleet
            .filter(|_| tokens_in_slo > 0)
            .map(|f| f.dollars / (tokens_in_slo as f64 / 1e6)),
    };
    (
        stats,
        Samples {
            ttft_ms: ttft,
            e2e_ms: e2e,
        },
    )
}

/// Requests whose ideal cached tokens exceed this reuse more than a first shared block (a
/// Mooncake `hash_id` covers 512 tokens: a common system prompt).
pub const REUSE_TOKENS: u64 = 512;

/// The largest of `v`; NaN when empty.
fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

/// Σ cached / Σ prompt tokens over requests reporting both; NaN when none does.
fn measured_hit_rate(ok: &[&RequestResult]) -> f64 {
    let (cached, prompt) = ok
        .iter()
        .filter_map(|r| Some((r.cached_tokens?, r.prompt_tokens?)))
        .fold((0u64, 0u64), |(c, p), (rc, rp)| (c + rc, p + rp));
    if prompt == 0 {
        f64::NAN
    } else {
        cached as f64 / prompt as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn req(ttft: f64, e2e: f64, tokens: u64, cached: u64, prompt: u64) -> RequestResult {
        RequestResult {
            ok: true,
            ttft_ms: Some(ttft),
            e2e_ms: e2e,
            itl_ms: vec![
                (e2e - ttft) / (tokens.max(2) - 1) as f64;
                tokens.saturating_sub(1) as usize
            ],
            output_tokens: tokens,
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            error: None,
            ..RequestResult::default()
        }
    }

    #[test]
    fn percentiles_on_hand_made_samples() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let q = Quantiles::of(&v);
        // round(99·p): p50 → index 50 (51), p90 → 89 (90), p99 → 98 (99).
        assert_eq!((q.p50, q.p90, q.p99), (51.0, 90.0, 99.0));
        assert_eq!(Quantiles::of(&[7.0]).p99, 7.0);
        assert!(Quantiles::of(&[]).p50.is_nan());
    }

    #[test]
    fn tpot_and_outcome() {
        let r = req(100.0, 1100.0, 11, 0, 10);
        assert_eq!(r.tpot_ms(), Some(100.0));
        assert_eq!(req(100.0, 100.0, 1, 0, 10).tpot_ms(), None);
        let o = StreamOutcome {
            status: 200,
            ids: vec!["x".into()],
            finish_reasons: vec!["length".into()],
            done: true,
            completion_tokens: Some(3),
            prompt_tokens: Some(32),
            cached_tokens: Some(16),
            ttft: Some(Duration::from_millis(50)),
            chunk_times: vec![
                Duration::from_millis(50),
                Duration::from_millis(60),
                Duration::from_millis(80),
            ],
            e2e: Duration::from_millis(90),
            ..StreamOutcome::default()
        };
        let r = RequestResult::from_outcome(&o);
        assert!(r.ok && r.error.is_none());
        assert_eq!(r.itl_ms, vec![10.0, 20.0]);
        assert_eq!(r.tpot_ms(), Some(20.0));
        assert_eq!(r.tt2t_ms(), Some(60.0));
        let bad = RequestResult::from_outcome(&StreamOutcome {
            status: 503,
            ..StreamOutcome::default()
        });
        assert!(!bad.ok && bad.error.unwrap().contains("503"));
    }

    #[test]
    fn goodput_and_slo_definitions() {
        let results = vec![
            req(100.0, 1100.0, 11, 8, 16),  // TPOT 100: meets both
            req(300.0, 1300.0, 11, 0, 16),  // TTFT 300 > 200: misses
            req(100.0, 2100.0, 11, 16, 32), // TPOT 200 > 150: misses
            req(150.0, 150.0, 1, 0, 0),     // one token: TTFT only, meets
            RequestResult::failed("connection refused"),
        ];
        let ctx = RunContext {
            label: "x",
            wall_s: 2.0,
            slo: Slo {
                ttft_ms: Some(200.0),
                itl_ms: Some(150.0),
            },
            ideal_hit_rate: 0.5,
            salt: 3,
            workload: &WorkloadInfo::default(),
            fleet: Some(FleetUse {
                replica_seconds: 7200.0,
                dollars: 2.0,
            }),
        };
        let (s, samples) = summarize(ctx, &results);
        // Tokens within the SLOs: the two requests that met them (11 + 1 tokens).
        assert_eq!(s.tokens_in_slo, 12);
        assert_eq!(s.replica_seconds, Some(7200.0));
        let cost = s.cost_per_million_in_slo.unwrap();
        assert!((cost - 2.0 / 12e-6).abs() < 1e-6, "{cost}");
        assert_eq!((s.requests, s.errors), (5, 1));
        assert_eq!(s.goodput_rps, 1.0, "2 met / 2 s");
        assert_eq!(s.slo_attainment, 0.4, "2 of 5");
        assert_eq!(s.requests_per_s, 2.0);
        assert_eq!(s.output_tokens_per_s, 17.0);
        assert_eq!(s.prefix_hit_rate, 24.0 / 64.0);
        assert_eq!(samples.ttft_ms.len(), 4);
        assert_eq!(s.ttft_ms.p50, 150.0);
        // Second tokens: 100+100, 300+100, 100+200 (the one-token request has none).
        assert_eq!((s.tt2t_ms.p50, s.tt2t_max_ms), (300.0, 400.0));
        assert_eq!(s.tt2t_mean_ms, 300.0);
        assert_eq!(s.itl_max_ms, 200.0);
        // Without SLOs every success counts.
        let open = RunContext {
            slo: Slo::default(),
            ..ctx
        };
        assert_eq!(summarize(open, &results).0.slo_attainment, 0.8);
        // No usage at all: hit rate unknown.
        let none = [RequestResult {
            prompt_tokens: None,
            ..req(1.0, 2.0, 2, 0, 0)
        }];
        assert!(summarize(ctx, &none).0.prefix_hit_rate.is_nan());
    }
}
