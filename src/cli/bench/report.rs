//! What the bench prints and writes: a markdown table (one row per run), the ratios of each
//! run to the first, `report.json`, `requests.jsonl`, and the data of `flotilla plot`'s
//! figure ([`PlotSeries`]); the charts themselves are drawn in `charts.rs`.

use std::fmt::Write;

use super::metrics::RunStats;

/// `x` with `digits` decimals, or `–` when not finite.
fn num(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "–".to_owned()
    }
}

/// `x` as a percentage with one decimal, or `–`.
fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1} %", 100.0 * x)
    } else {
        "–".to_owned()
    }
}

/// One JSON object per request and run (`{"run": label, ...RequestResult}`), one per line,
/// for splits the tables do not make.
///
/// # Errors
/// Serialization failed (not expected).
pub fn requests_jsonl(
    runs: &[(String, Vec<super::metrics::RequestResult>)],
) -> anyhow::Result<String> {
    let mut s = String::new();
    for (label, results) in runs {
        for r in results {
            let mut v = serde_json::to_value(r)?;
            if let Some(o) = v.as_object_mut() {
                o.insert("run".into(), serde_json::Value::from(label.as_str()));
            }
            s.push_str(&serde_json::to_string(&v)?);
            s.push('\n');
        }
    }
    Ok(s)
}

/// Per run: the worker replica-seconds the fleet held and the cost per million output tokens
/// served within the SLOs (the planner's business metric), at `dollars_per_replica_hour`.
/// Empty when no run measured its fleet.
pub fn cost_lines(runs: &[RunStats], dollars_per_replica_hour: f64) -> String {
    let mut out = String::new();
    for r in runs {
        let Some(rs) = r.replica_seconds else {
            continue;
        };
        let cost = r.cost_per_million_in_slo.map_or_else(
            || "n/a (no token within the SLOs)".to_owned(),
            |c| format!("${c:.2}"),
        );
        out.push_str(&format!(
            "[{}] fleet: {:.0} replica-s (${:.4} at ${}/replica-hour); {} output tokens within \
             the SLOs; cost per million of them: {}\n",
            r.label,
            rs,
            rs / 3600.0 * dollars_per_replica_hour,
            dollars_per_replica_hour,
            r.tokens_in_slo,
            cost
        ));
    }
    out
}

/// One markdown row per run: counts, throughput, goodput, latency quantiles (ms), hit rates.
pub fn markdown_table(runs: &[RunStats]) -> String {
    let mut s = String::from(
        "| run | requests | errors | req/s | out tok/s | goodput req/s | SLO met | \
         TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | ITL max ms | 2nd token p50/p99/max ms | \
         TPOT p50/p99 ms | E2E p50/p90/p99 ms | prefix hit | ideal hit | \
         TTFT mean reuse / other ms (n reuse) |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in runs {
        let q3 = |q: &super::metrics::Quantiles| {
            format!("{} / {} / {}", num(q.p50, 0), num(q.p90, 0), num(q.p99, 0))
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} / {} | {} / {} | {} | {} | {} | {} / {} ({}) |",
            r.label,
            r.requests,
            r.errors,
            num(r.requests_per_s, 2),
            num(r.output_tokens_per_s, 1),
            num(r.goodput_rps, 2),
            pct(r.slo_attainment),
            q3(&r.ttft_ms),
            q3(&r.itl_ms),
            num(r.itl_max_ms, 0),
            num(r.tt2t_ms.p50, 0),
            num(r.tt2t_ms.p99, 0),
            num(r.tt2t_max_ms, 0),
            num(r.tpot_ms.p50, 1),
            num(r.tpot_ms.p99, 1),
            q3(&r.e2e_ms),
            pct(r.prefix_hit_rate),
            pct(r.ideal_prefix_hit_rate),
            num(r.reuse_ttft_mean_ms, 0),
            num(r.other_ttft_mean_ms, 0),
            r.reuse_requests,
        );
    }
    s
}

/// `a / b`, or NaN when `b` is 0 or either is not finite.
fn ratio(a: f64, b: f64) -> f64 {
    if a.is_finite() && b.is_finite() && b != 0.0 {
        a / b
    } else {
        f64::NAN
    }
}

/// Each run against the first, every ratio oriented so that **> 1 is better than the first**:
/// latencies as first/this (TTFT p50 and p99, TPOT p50, E2E p50), rates as this/first
/// (goodput, output tokens/s, prefix hit rate).
pub fn compare_table(runs: &[RunStats]) -> String {
    let Some(first) = runs.first() else {
        return String::new();
    };
    let mut s = format!(
        "Ratios to `{}` (> 1 = better than it):\n\n\
         | run | TTFT p50 | TTFT p99 | TPOT p50 | E2E p50 | goodput | out tok/s | prefix hit |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
        first.label
    );
    for r in runs {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.label,
            num(ratio(first.ttft_ms.p50, r.ttft_ms.p50), 2),
            num(ratio(first.ttft_ms.p99, r.ttft_ms.p99), 2),
            num(ratio(first.tpot_ms.p50, r.tpot_ms.p50), 2),
            num(ratio(first.e2e_ms.p50, r.e2e_ms.p50), 2),
            num(ratio(r.goodput_rps, first.goodput_rps), 2),
            num(ratio(r.output_tokens_per_s, first.output_tokens_per_s), 2),
            num(ratio(r.prefix_hit_rate, first.prefix_hit_rate), 2),
        );
    }
    s
}

/// `report.json`: an array with one [`RunStats`] object per run (non-finite numbers as `null`).
///
/// # Errors
/// Serialization fails (it does not for these types).
pub fn report_json(runs: &[RunStats]) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(runs)?)
}

/// Most points per run of a sampled step function (and per CDF line in `charts.rs`).
pub const MAX_POINTS: usize = 400;

/// One run of `flotilla plot`'s figure (drawn by `side_by_side_panels` in `charts.rs`): its
/// successful requests' TTFTs and inter-token latencies (ms), and the requests in flight over time (s from the run's first
/// send, count), a step function sampled at most [`MAX_POINTS`] times.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlotSeries {
    pub ttft_ms: Vec<f64>,
    pub itl_ms: Vec<f64>,
    pub in_flight: Vec<(f64, f64)>,
}

impl PlotSeries {
    /// From a run's requests (`requests.jsonl` lines): each one in flight from its send to its
    /// end (`sent_s` + `e2e_ms`), failed ones too.
    pub fn of(results: &[super::metrics::RequestResult]) -> Self {
        let ok = results.iter().filter(|r| r.ok);
        let ttft_ms = ok.clone().filter_map(|r| r.ttft_ms).collect();
        let itl_ms = ok.flat_map(|r| r.itl_ms.iter().copied()).collect();
        // +1 at each send, −1 at each end; ends before sends at equal times.
        let mut edges: Vec<(f64, i64)> = results
            .iter()
            .flat_map(|r| [(r.sent_s, 1), (r.sent_s + r.e2e_ms / 1000.0, -1)])
            .filter(|(t, _)| t.is_finite())
            .collect();
        edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let (Some(first), Some(last)) = (edges.first(), edges.last()) else {
            return Self {
                ttft_ms,
                itl_ms,
                in_flight: Vec::new(),
            };
        };
        let (t0, t1) = (first.0, last.0);
        let mut in_flight = Vec::with_capacity(MAX_POINTS + 1);
        let (mut n, mut k) = (0i64, 0usize);
        for i in 0..=MAX_POINTS {
            let t = t0 + (t1 - t0) * i as f64 / MAX_POINTS as f64;
            // The most in flight since the previous sample, so that short peaks show.
            let mut peak = n;
            while k < edges.len() && edges[k].0 <= t {
                n += edges[k].1;
                peak = peak.max(n);
                k += 1;
            }
            in_flight.push((t - t0, peak as f64));
        }
        Self {
            ttft_ms,
            itl_ms,
            in_flight,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::bench::metrics::Quantiles;

    fn stats(label: &str, ttft50: f64, goodput: f64) -> RunStats {
        let q = Quantiles {
            p50: ttft50,
            p90: 2.0 * ttft50,
            p99: 3.0 * ttft50,
        };
        RunStats {
            label: label.into(),
            ttft_ms: q,
            itl_ms: q,
            itl_max_ms: 4.0 * ttft50,
            tt2t_ms: q,
            tt2t_mean_ms: ttft50,
            tt2t_max_ms: 4.0 * ttft50,
            tpot_ms: q,
            e2e_ms: q,
            requests_per_s: 1.0,
            output_tokens_per_s: 10.0,
            goodput_rps: goodput,
            slo_attainment: 0.5,
            prefix_hit_rate: f64::NAN,
            ideal_prefix_hit_rate: 0.366,
            requests: 10,
            reuse_requests: 3,
            reuse_ttft_mean_ms: ttft50,
            other_ttft_mean_ms: 2.0 * ttft50,
            errors: 0,
            wall_s: 10.0,
            salt: 1,
            workload: crate::cli::bench::workload::WorkloadInfo {
                name: "w".into(),
                sessions: 10,
                trace_block_hit_rate: Some(0.366),
                ..Default::default()
            },
            replica_seconds: None,
            tokens_in_slo: 0,
            cost_per_million_in_slo: None,
        }
    }

    #[test]
    fn cost_lines_report_the_fleet_and_its_cost_per_million_in_slo() {
        assert_eq!(cost_lines(&[stats("a", 1.0, 1.0)], 1.0), "", "not measured");
        let mut r = stats("a", 1.0, 1.0);
        r.replica_seconds = Some(7200.0);
        r.tokens_in_slo = 2_000_000;
        r.cost_per_million_in_slo = Some(1.0);
        let mut none = r.clone();
        none.label = "b".into();
        none.tokens_in_slo = 0;
        none.cost_per_million_in_slo = None;
        let s = cost_lines(&[r, none], 1.0);
        assert!(s.contains("[a] fleet: 7200 replica-s ($2.0000 at $1/replica-hour); 2000000 output tokens within the SLOs; cost per million of them: $1.00"), "{s}");
        assert!(s.contains("[b]") && s.contains("n/a"), "{s}");
    }

    #[test]
    fn report_json_shape() {
        let runs = [stats("policy=a", 100.0, 1.0), stats("policy=b", 50.0, 2.0)];
        let v: serde_json::Value = serde_json::from_str(&report_json(&runs).unwrap()).unwrap();
        let arr = v.as_array().unwrap();
        assert_eq!(arr.len(), 2);
        let e = &arr[0];
        for key in [
            "label",
            "ttft_ms",
            "itl_ms",
            "tpot_ms",
            "e2e_ms",
            "requests_per_s",
            "output_tokens_per_s",
            "goodput_rps",
            "slo_attainment",
            "prefix_hit_rate",
            "ideal_prefix_hit_rate",
            "requests",
            "errors",
        ] {
            assert!(e.get(key).is_some(), "missing {key}");
        }
        for key in ["itl_max_ms", "tt2t_mean_ms", "tt2t_max_ms"] {
            assert!(e[key].is_number(), "{key}");
        }
        for q in ["ttft_ms", "itl_ms", "tt2t_ms", "tpot_ms", "e2e_ms"] {
            for p in ["p50", "p90", "p99"] {
                assert!(e[q][p].is_number(), "{q}.{p}");
            }
        }
        assert_eq!(e["label"], "policy=a");
        assert!(e["prefix_hit_rate"].is_null(), "NaN is written as null");
        assert_eq!(e["requests"], 10);
        assert_eq!(
            e["workload"]["truncated_inputs"], 0,
            "adjustments are flattened"
        );
        assert_eq!(e["workload"]["trace_block_hit_rate"], 0.366);
    }

    #[test]
    fn tables() {
        let runs = [stats("policy=a", 100.0, 1.0), stats("policy=b", 50.0, 2.0)];
        let t = markdown_table(&runs);
        assert_eq!(t.lines().count(), 4);
        assert!(
            t.lines()
                .nth(3)
                .unwrap()
                .starts_with("| policy=b | 10 | 0 |")
        );
        let c = compare_table(&runs);
        let row = c.lines().find(|l| l.starts_with("| policy=b")).unwrap();
        // TTFT p50: first/this = 100/50 = 2; goodput: this/first = 2; hit rate unknown.
        assert_eq!(
            row,
            "| policy=b | 2.00 | 2.00 | 2.00 | 2.00 | 2.00 | 1.00 | – |"
        );
    }
}
