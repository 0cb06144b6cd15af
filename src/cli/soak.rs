//! `flotilla chaos soak`: steady load through a gateway while the chaos API kills busy
//! workers, then proof that nothing was lost.
//!
//! 1. **Reference pass**: every request once, no faults, `temperature: 0`, at the same
//!    concurrency as the chaos pass.
//! 2. **Chaos pass**: the same requests again (streaming). Every `interval` a busy worker is
//!    killed, alternating `kill_actor` (its replica; the supervisor restarts it) and
//!    `kill_node` (its process; `flotilla up` starts it again). Before each fault the fleet
//!    must be back at full capacity (every worker of the start `ready` again), so at most one
//!    worker is down at a time; the time from a fault to full capacity is recorded.
//! 3. **Checks**: every request 200 with one id, one finish reason and `[DONE]`; every text
//!    equal to its reference byte for byte (so no token doubled or dropped at a seam);
//!    migrations counted by the gateway.
//!
//! Resume gap (last token before a loss → first token after, seen by the gateway) comes from
//! the gateway's `flotilla_migration_resume_gap_seconds` histogram, its quantiles
//! interpolated within buckets as Prometheus' `histogram_quantile` does.

use crate::cli::client::{StreamOutcome, percentile, stream_chat};
use futures::StreamExt;
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Options of a soak.
#[derive(Clone, Debug, clap::Args)]
pub struct SoakOptions {
    /// Requests per pass.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// `max_tokens` of every request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Time between faults (ms), counted from the fleet's return to full capacity.
    #[arg(long, default_value_t = 3000)]
    pub interval_ms: u64,
    /// Longest wait for the fleet to return to full capacity after a fault (ms).
    #[arg(long, default_value_t = 120_000)]
    pub recover_timeout_ms: u64,
}

/// One injected fault.
#[derive(Clone, Debug, Serialize)]
pub struct FaultEvent {
    /// `kill_actor` or `kill_node`.
    pub kind: String,
    /// Workers hit.
    pub hit: Vec<String>,
    /// Since the chaos pass started (ms).
    pub at_ms: u64,
    /// Fault → every worker ready again (ms); `None` if it did not happen in time.
    pub back_to_capacity_ms: Option<u64>,
}

/// What a soak found.
#[derive(Clone, Debug, Serialize)]
pub struct SoakReport {
    /// Requests per pass.
    pub requests: usize,
    /// Chaos-pass requests that completed soundly (200, one id, one finish, `[DONE]`).
    pub completed: usize,
    /// Chaos-pass requests that did not (the lost).
    pub lost: usize,
    /// Completed requests whose text differs from the reference.
    pub mismatched: usize,
    /// Faults injected.
    pub faults: Vec<FaultEvent>,
    /// Migrations the gateway made during the chaos pass.
    pub migrations: u64,
    /// Supervisor restarts across the fleet during the chaos pass (nodes that lived through it).
    pub restarts: u64,
    /// Resume gap quantiles from the gateway histogram (ms).
    pub resume_gap_p50_ms: Option<f64>,
    /// See `resume_gap_p50_ms`.
    pub resume_gap_p99_ms: Option<f64>,
    /// Back-to-capacity p50 / max over the faults (ms).
    pub back_to_capacity_p50_ms: Option<f64>,
    /// See `back_to_capacity_p50_ms`.
    pub back_to_capacity_max_ms: Option<f64>,
    /// Reference pass wall time (s).
    pub reference_s: f64,
    /// Chaos pass wall time (s).
    pub chaos_s: f64,
    /// Examples of what went wrong (at most 5).
    pub problems: Vec<String>,
}

impl SoakReport {
    /// Nothing lost, nothing changed, and the fleet came back after every fault.
    pub fn passed(&self) -> bool {
        self.failure().is_none()
    }

    /// Why the soak failed, in words (`None`: it passed).
    pub fn failure(&self) -> Option<String> {
        let mut why = Vec::new();
        if self.lost > 0 {
            why.push(format!("{} of {} requests lost", self.lost, self.requests));
        }
        if self.mismatched > 0 {
            why.push(format!(
                "{} completed with a text other than the reference",
                self.mismatched
            ));
        }
        let never: Vec<String> = self
            .faults
            .iter()
            .filter(|f| f.back_to_capacity_ms.is_none())
            .map(|f| format!("{} of {} at {} ms", f.kind, f.hit.join(","), f.at_ms))
            .collect();
        if !never.is_empty() {
            why.push(format!(
                "the fleet never returned to full capacity after {} (a node left down: see \
                 `flotilla up`'s log, e.g. --max-restarts)",
                never.join("; ")
            ));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// A markdown summary.
    pub fn markdown(&self) -> String {
        let f = |x: Option<f64>| x.map_or("-".to_owned(), |v| format!("{v:.0}"));
        format!(
            "| requests | lost | mismatched | faults | migrations | resume gap p50 / p99 (ms) | back to capacity p50 / max (ms) | reference / chaos pass (s) |\n\
             |---|---|---|---|---|---|---|---|\n\
             | {} | {} | {} | {} | {} | {} / {} | {} / {} | {:.1} / {:.1} |\n",
            self.requests,
            self.lost,
            self.mismatched,
            self.faults.len(),
            self.migrations,
            f(self.resume_gap_p50_ms),
            f(self.resume_gap_p99_ms),
            f(self.back_to_capacity_p50_ms),
            f(self.back_to_capacity_max_ms),
            self.reference_s,
            self.chaos_s,
        )
    }
}

struct Gateway {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Gateway {
    async fn json(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        Ok(self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await?
            .json()
            .await?)
    }

    /// Worker ids and whether each is ready (its node up and its scheduler `ready`).
    async fn workers(&self) -> anyhow::Result<Vec<(String, bool)>> {
        let fleet = self.json("/v1/fleet").await?;
        let mut out = Vec::new();
        for n in fleet["nodes"].as_array().into_iter().flatten() {
            let up = n["state"] == "up";
            for w in n["workers"].as_array().into_iter().flatten() {
                let id = w["id"].as_str().unwrap_or_default().to_owned();
                out.push((id, up && w["health"] == "ready"));
            }
        }
        Ok(out)
    }

    /// Per node: `(pid, restarts, migrations)`.
    async fn nodes(&self) -> anyhow::Result<std::collections::BTreeMap<String, (u64, u64, u64)>> {
        let fleet = self.json("/v1/fleet").await?;
        Ok(fleet["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|n| {
                let c = &n["counters"];
                let id = n["id"].as_str().unwrap_or_default().to_owned();
                let get = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
                (
                    id,
                    (get(&n["pid"]), get(&c["restarts"]), get(&c["migrations"])),
                )
            })
            .collect())
    }

    /// Replicas a router may choose right now (the gateway's `/health`).
    async fn routable(&self) -> anyhow::Result<usize> {
        let h = self.json("/health").await?;
        Ok(h["routable_workers"].as_u64().unwrap_or(0) as usize)
    }

    async fn model(&self) -> anyhow::Result<String> {
        let v = self.json("/v1/models").await?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| anyhow::anyhow!("the gateway lists no model"))
    }

    async fn inject(&self, kind: &str) -> anyhow::Result<Option<Vec<String>>> {
        let body = match kind {
            "kill_actor" => {
                serde_json::json!({"kind": "kill_actor", "actor": "replica", "target": "any_busy"})
            }
            _ => serde_json::json!({"kind": "kill_node", "target": "any_busy"}),
        };
        let mut req = self
            .http
            .post(format!("{}/chaos/faults", self.base))
            .json(&body);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let v: serde_json::Value = resp.json().await.unwrap_or_default();
        match status {
            201 => Ok(Some(
                v["hit"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|x| x.as_str().map(str::to_owned))
                    .collect(),
            )),
            400 => Ok(None), // no busy worker right now
            _ => anyhow::bail!("the chaos API answered {status}: {v}"),
        }
    }

    /// The gateway's resume-gap histogram buckets.
    async fn resume_gaps(&self) -> anyhow::Result<Vec<(f64, f64)>> {
        let text = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await?
            .text()
            .await?;
        Ok(histogram_buckets(
            &text,
            "flotilla_migration_resume_gap_seconds",
        ))
    }
}

/// `(le, cumulative count)` of the Prometheus histogram `name` in the text exposition format
/// (also when its `# TYPE` line is missing); empty when the text has none.
pub fn histogram_buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    use prometheus_parse::{Scrape, Value};
    let Ok(scrape) = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))) else {
        return Vec::new();
    };
    let untyped = format!("{name}_bucket");
    let mut out: Vec<(f64, f64)> = Vec::new();
    for s in &scrape.samples {
        match &s.value {
            Value::Histogram(h) if s.metric == name => {
                out.extend(h.iter().map(|c| (c.less_than, c.count)));
            }
            Value::Untyped(n) if s.metric == untyped => {
                if let Some(le) = s.labels.get("le").and_then(|le| le.parse().ok()) {
                    out.push((le, *n));
                }
            }
            _ => {}
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// Quantile `q` of cumulative buckets, linear within the bucket (Prometheus'
/// `histogram_quantile`); `None` without observations. Above the last finite bound, that bound.
pub fn histogram_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lo, mut below) = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lo);
            }
            let inside = count - below;
            let frac = if inside > 0.0 {
                (rank - below) / inside
            } else {
                1.0
            };
            return Some(lo + (le - lo) * frac);
        }
        lo = le;
        below = count;
    }
    Some(lo)
}

fn request_body(model: &str, i: usize, max_tokens: u32) -> serde_json::Value {
    const TOPICS: [&str; 8] = [
        "lighthouses",
        "honeybees",
        "volcanoes",
        "the moon",
        "glaciers",
        "owls",
        "bridges",
        "tea",
    ];
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": format!(
            "Request {i}. Tell me three facts about {}.", TOPICS[i % TOPICS.len()])}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

async fn pass(gw: &Gateway, model: &str, opts: &SoakOptions) -> anyhow::Result<Vec<StreamOutcome>> {
    let results: Vec<(usize, anyhow::Result<StreamOutcome>)> =
        futures::stream::iter(0..opts.requests)
            .map(|i| async move {
                (
                    i,
                    stream_chat(&gw.http, &gw.base, request_body(model, i, opts.max_tokens)).await,
                )
            })
            .buffer_unordered(opts.concurrency.max(1))
            .collect()
            .await;
    let mut out = vec![StreamOutcome::default(); opts.requests];
    for (i, r) in results {
        out[i] = r.unwrap_or_else(|e| StreamOutcome {
            error: Some(serde_json::json!({"message": e.to_string()})),
            ..StreamOutcome::default()
        });
    }
    Ok(out)
}

/// Wait until the fault has visibly acted on `node` (its process was replaced or one of its
/// supervisors restarted something, compared with `before`), then until every worker in
/// `expected` is ready and routable again; the time since `since`, or `None` on timeout.
async fn back_to_capacity(
    gw: &Gateway,
    expected: &[String],
    node: &str,
    before: (u64, u64, u64),
    since: Instant,
    timeout: Duration,
) -> Option<u64> {
    let mut acted = false;
    while since.elapsed() < timeout {
        if !acted && let Ok(nodes) = gw.nodes().await {
            acted = nodes
                .get(node)
                .is_some_and(|&(pid, restarts, _)| pid != before.0 || restarts > before.1);
        }
        if acted && let (Ok(ws), Ok(routable)) = (gw.workers().await, gw.routable().await) {
            let ready = expected
                .iter()
                .all(|e| ws.iter().any(|(id, ok)| id == e && *ok));
            if ready && routable >= expected.len() {
                return Some(since.elapsed().as_millis() as u64);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Fleet-wide migrations and restarts between two snapshots (a replaced process counts
/// from zero).
fn deltas(
    a: &std::collections::BTreeMap<String, (u64, u64, u64)>,
    b: &std::collections::BTreeMap<String, (u64, u64, u64)>,
) -> (u64, u64) {
    let (mut m, mut r) = (0, 0);
    for (id, &(pid, restarts, migrations)) in b {
        match a.get(id) {
            Some(&(p0, r0, m0)) if p0 == pid => {
                r += restarts.saturating_sub(r0);
                m += migrations.saturating_sub(m0);
            }
            _ => {
                r += restarts;
                m += migrations;
            }
        }
    }
    (m, r)
}

/// Run a soak against the gateway at `base` (chaos API enabled there).
///
/// # Errors
/// The gateway cannot be reached, lists no model or fewer than two workers, or a
/// reference request fails before any fault.
pub async fn run(
    base: &str,
    token: Option<String>,
    opts: &SoakOptions,
) -> anyhow::Result<SoakReport> {
    let gw = Gateway {
        base: crate::cli::status::base_url(base),
        token,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            .build()?,
    };
    let model = gw.model().await?;
    // A fleet that just started may not list every worker yet: give it a moment.
    let mut expected: Vec<String> = Vec::new();
    for _ in 0..100 {
        expected = gw
            .workers()
            .await?
            .into_iter()
            .filter(|(_, ready)| *ready)
            .map(|(id, _)| id)
            .collect();
        if expected.len() >= 2 && gw.routable().await? >= expected.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::ensure!(
        expected.len() >= 2,
        "a soak needs at least two workers (found {}) so that requests have somewhere to migrate",
        expected.len()
    );
    let t = Instant::now();
    let reference = pass(&gw, &model, opts).await?;
    let reference_s = t.elapsed().as_secs_f64();
    if let Some((i, r)) = reference.iter().enumerate().find(|(_, r)| !r.is_complete()) {
        anyhow::bail!(
            "reference request {i} failed before any fault: {:?}",
            r.error
        );
    }
    let nodes0 = gw.nodes().await?;
    let gaps0 = gw.resume_gaps().await.unwrap_or_default();

    let running = Arc::new(AtomicBool::new(true));
    let t = Instant::now();
    let chaos = {
        let running = running.clone();
        let (gw, expected, opts) = (&gw, &expected, opts);
        async move {
            let mut faults: Vec<FaultEvent> = Vec::new();
            let mut k = 0usize;
            loop {
                tokio::time::sleep(Duration::from_millis(opts.interval_ms)).await;
                if !running.load(Ordering::Relaxed) {
                    break;
                }
                let kind = if k.is_multiple_of(2) {
                    "kill_actor"
                } else {
                    "kill_node"
                };
                let Ok(before) = gw.nodes().await else {
                    continue;
                };
                let at = Instant::now();
                let Ok(Some(hit)) = gw.inject(kind).await else {
                    continue;
                };
                k += 1;
                let node = hit
                    .first()
                    .and_then(|w| w.split('/').next())
                    .unwrap_or_default()
                    .to_owned();
                let back = back_to_capacity(
                    gw,
                    expected,
                    &node,
                    before.get(&node).copied().unwrap_or_default(),
                    at,
                    Duration::from_millis(opts.recover_timeout_ms),
                )
                .await;
                faults.push(FaultEvent {
                    kind: kind.into(),
                    hit,
                    at_ms: (at - t).as_millis() as u64,
                    back_to_capacity_ms: back,
                });
                if back.is_none() {
                    break;
                }
            }
            faults
        }
    };
    let load = async {
        let r = pass(&gw, &model, opts).await;
        running.store(false, Ordering::Relaxed);
        r
    };
    let (outcomes, faults) = tokio::join!(load, chaos);
    let outcomes = outcomes?;
    let chaos_s = t.elapsed().as_secs_f64();
    let (migrations, restarts) = deltas(&nodes0, &gw.nodes().await?);
    // Only this pass's observations: the bucket counts minus those before it.
    let gaps: Vec<(f64, f64)> = gw
        .resume_gaps()
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|(le, n)| {
            let before = gaps0.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, n - before)
        })
        .collect();
    let q = |p| histogram_quantile(&gaps, p).map(|s| s * 1000.0);
    let (gap50, gap99) = (q(0.5), q(0.99));

    let mut problems = Vec::new();
    let (mut lost, mut mismatched) = (0, 0);
    for (i, (got, want)) in outcomes.iter().zip(&reference).enumerate() {
        if !got.is_complete() {
            lost += 1;
            if problems.len() < 5 {
                problems.push(format!(
                    "request {i}: status {}, ids {:?}, finish {:?}, done {}, error {:?}",
                    got.status, got.ids, got.finish_reasons, got.done, got.error
                ));
            }
        } else if got.text != want.text {
            mismatched += 1;
            if problems.len() < 5 {
                problems.push(format!(
                    "request {i}: text differs\n  want {:?}\n  got  {:?}",
                    want.text, got.text
                ));
            }
        }
    }
    let backs: Vec<f64> = faults
        .iter()
        .filter_map(|f| f.back_to_capacity_ms.map(|x| x as f64))
        .collect();
    let shown = problems.len();
    if lost + mismatched > shown {
        problems.push(format!(
            "… and {} more lost or changed request(s) (the first {shown} are shown)",
            lost + mismatched - shown
        ));
    }
    Ok(SoakReport {
        requests: opts.requests,
        completed: opts.requests - lost,
        lost,
        mismatched,
        migrations,
        restarts,
        resume_gap_p50_ms: gap50,
        resume_gap_p99_ms: gap99,
        back_to_capacity_p50_ms: (!backs.is_empty()).then(|| percentile(&backs, 0.5)),
        back_to_capacity_max_ms: backs.iter().copied().reduce(f64::max),
        faults,
        reference_s,
        chaos_s,
        problems,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let text = "x_bucket{le=\"0.1\"} 0\nx_bucket{le=\"0.2\"} 50\nx_bucket{le=\"0.4\"} 100\nx_bucket{le=\"+Inf\"} 100\n";
        let b = histogram_buckets(text, "x");
        assert_eq!(b.len(), 4);
        let p50 = histogram_quantile(&b, 0.5).unwrap();
        assert!((p50 - 0.2).abs() < 1e-9, "{p50}");
        let p75 = histogram_quantile(&b, 0.75).unwrap();
        assert!((p75 - 0.3).abs() < 1e-9, "{p75}");
        // As the exporter writes it: with a `# TYPE` line, `_sum` and `_count`.
        let typed = format!("# TYPE x histogram\n{text}x_sum 12.5\nx_count 100\n");
        assert_eq!(histogram_buckets(&typed, "x"), b);
        assert_eq!(histogram_quantile(&[], 0.5), None);
        assert_eq!(histogram_quantile(&[(1.0, 0.0)], 0.5), None);
    }

    #[test]
    fn a_failed_soak_says_what_failed() {
        let fault = |back| FaultEvent {
            kind: "kill_node".into(),
            hit: vec!["node-1/replica-0".into()],
            at_ms: 46_000,
            back_to_capacity_ms: back,
        };
        let mut r = SoakReport {
            requests: 64,
            completed: 64,
            lost: 0,
            mismatched: 0,
            faults: vec![fault(Some(900))],
            migrations: 3,
            restarts: 0,
            resume_gap_p50_ms: None,
            resume_gap_p99_ms: None,
            back_to_capacity_p50_ms: None,
            back_to_capacity_max_ms: None,
            reference_s: 1.0,
            chaos_s: 1.0,
            problems: vec![],
        };
        assert!(r.passed() && r.failure().is_none());
        // Nothing lost, but a node never came back: the message says so, not "lost".
        r.faults.push(fault(None));
        let why = r.failure().expect("failed");
        assert!(
            why.contains(
                "never returned to full capacity after kill_node of node-1/replica-0 at 46000 ms"
            ) && !why.contains("lost"),
            "{why}"
        );
        r.lost = 2;
        assert!(r.failure().unwrap().starts_with("2 of 64 requests lost; "));
    }
}
