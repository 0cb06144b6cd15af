//! What a simulated run's records become: the bench's request results ([`to_result`]), the
//! per-run summary `sim.json` keeps, and the fleet-cost table (SLO attainment, replica-seconds,
//! cost per million tokens within the SLOs) that compares the runs.

use crate::cli::bench::metrics::{RequestResult, Slo};
use crate::control::planner::cost_per_million_in_slo;
use crate::runtime::role::Role;
use crate::sim::{SimOutcome, SimRecord};

/// A simulated request's record as the bench's result.
pub fn to_result(r: &SimRecord, ideal: &[Vec<(u64, u64)>]) -> RequestResult {
    RequestResult {
        session: r.session,
        turn: r.turn,
        sent_s: r.sent_s,
        ideal_cached_tokens: ideal
            .get(r.session)
            .and_then(|t| t.get(r.turn))
            .map_or(0, |x| x.0),
        ok: r.ok,
        error: r.error.clone(),
        ttft_ms: r.ttft_ms,
        e2e_ms: r.e2e_ms,
        itl_ms: r.itl_ms.clone(),
        output_tokens: r.output_tokens,
        prompt_tokens: Some(r.prompt_tokens),
        cached_tokens: r.cached_tokens,
    }
}

/// Per run: what `sim.json` keeps.
#[derive(serde::Serialize)]
pub(super) struct SimSummary<'a> {
    pub(super) label: &'a str,
    pub(super) workers: usize,
    pub(super) prefill: usize,
    pub(super) decode: usize,
    pub(super) simulated_s: f64,
    pub(super) wall_s: f64,
    pub(super) simulated_s_per_wall_s: f64,
    pub(super) counters: &'a crate::sim::SimCounters,
    pub(super) leftovers: &'a crate::sim::SimLeftovers,
    pub(super) planner: &'a PlanSummary,
}

/// What a run's fleet cost and what it served within the SLOs.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PlanSummary {
    pub label: String,
    /// Whether a planner was in the loop.
    pub planned: bool,
    /// Replica-seconds, all pools.
    pub replica_seconds: f64,
    /// Per pool.
    pub replica_seconds_by_pool: Vec<(Role, f64)>,
    /// `replica_seconds ÷` the simulated span.
    pub mean_replicas: f64,
    /// Most replicas at once, all pools.
    pub peak_replicas: u32,
    /// Planner decisions, and those that changed a pool.
    pub decisions: usize,
    pub changes: usize,
    /// Share of requests meeting the SLOs.
    pub slo_attainment: f64,
    /// Output tokens of the requests meeting the SLOs.
    pub tokens_in_slo: u64,
    /// The fleet's cost (`planner.<pool>.dollars_per_hour`) per million output tokens
    /// served within the SLOs.
    pub cost_per_million_in_slo: Option<f64>,
}

pub(super) fn plan_summary(
    label: &str,
    cfg: &crate::control::planner::PlannerConfig,
    outcome: &SimOutcome,
    results: &[RequestResult],
    slo: Slo,
    span: f64,
    planned: bool,
) -> PlanSummary {
    let replica_seconds: f64 = outcome.replica_seconds.iter().map(|(_, s)| s).sum();
    let met: Vec<&RequestResult> = results.iter().filter(|r| slo.met_by(r)).collect();
    let tokens_in_slo: u64 = met.iter().map(|r| r.output_tokens).sum();
    PlanSummary {
        label: label.to_owned(),
        planned,
        replica_seconds,
        replica_seconds_by_pool: outcome.replica_seconds.clone(),
        mean_replicas: replica_seconds / span.max(1e-9),
        peak_replicas: outcome.peak_replicas.iter().map(|(_, n)| n).sum(),
        decisions: outcome.decisions.len(),
        changes: outcome
            .decisions
            .iter()
            .filter(|d| d.pools.iter().any(|p| p.desired != p.actual))
            .count(),
        slo_attainment: if results.is_empty() {
            0.0
        } else {
            met.len() as f64 / results.len() as f64
        },
        tokens_in_slo,
        cost_per_million_in_slo: cost_per_million_in_slo(
            cfg,
            &outcome.replica_seconds,
            tokens_in_slo,
        ),
    }
}

/// The fleet-cost table: one row per run, replica-seconds also as a ratio to the first run.
pub(super) fn plan_table(plans: &[PlanSummary]) -> String {
    let mut out = String::from(
        "| run | SLO met | replica-s | ÷ first | mean replicas | peak | changes | cost / M tokens in SLO |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    let first = plans.first().map_or(0.0, |p| p.replica_seconds);
    for p in plans {
        out.push_str(&format!(
            "| {} | {:.2} % | {:.0} | {:.2} | {:.2} | {} | {} | {} |\n",
            p.label,
            p.slo_attainment * 100.0,
            p.replica_seconds,
            if first > 0.0 {
                p.replica_seconds / first
            } else {
                0.0
            },
            p.mean_replicas,
            p.peak_replicas,
            p.changes,
            p.cost_per_million_in_slo
                .map_or("-".to_string(), |c| format!("{c:.3}")),
        ));
    }
    out
}
