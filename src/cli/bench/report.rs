//! What the bench prints and writes: a markdown table (one row per run), the ratios of each
//! run to the first, `report.json`, and an SVG of the latency CDFs.

use std::fmt::Write;

use super::metrics::{RunStats, Samples};

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

/// Line colours, cycled.
const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Panel size and margins (px).
const PANEL_W: f64 = 420.0;
const PANEL_H: f64 = 300.0;
const MARGIN_L: f64 = 55.0;
const MARGIN_T: f64 = 30.0;
const MARGIN_B: f64 = 45.0;
const PLOT_W: f64 = PANEL_W - MARGIN_L - 15.0;
const PLOT_H: f64 = PANEL_H - MARGIN_T - MARGIN_B;
/// Most points drawn per line.
const MAX_POINTS: usize = 400;

/// Escape `&`, `<`, `>`, `"` for SVG text and attributes.
fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Points `(value, cumulative fraction)` of the empirical CDF of `v`, at most [`MAX_POINTS`].
fn cdf_points(v: &[f64]) -> Vec<(f64, f64)> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let step = n.div_ceil(MAX_POINTS).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (s[i], (i + 1) as f64 / n as f64))
        .collect();
    if let (Some(&last), Some(p)) = (s.last(), pts.last())
        && p.1 < 1.0
    {
        pts.push((last, 1.0));
    }
    pts
}

/// One panel: axes, ticks, and one polyline per series, at horizontal offset `x0`.
fn panel(out: &mut String, x0: f64, title: &str, series: &[(&str, &[f64])]) {
    cdf_panel(out, x0, 0.0, title, series);
}

/// A CDF panel at (`x0`, `y0`): x in ms, y the fraction of samples at or below it.
fn cdf_panel(out: &mut String, x0: f64, y0: f64, title: &str, series: &[(&str, &[f64])]) {
    let curves: Vec<Vec<(f64, f64)>> = series.iter().map(|(_, v)| cdf_points(v)).collect();
    let lines: Vec<(&str, &[(f64, f64)])> = series
        .iter()
        .zip(&curves)
        .map(|((label, _), c)| (*label, c.as_slice()))
        .collect();
    line_panel(out, (x0, y0), title, ("ms", ""), true, &lines);
}

/// One run of a side-by-side plot ([`side_by_side_svg`]): its successful requests' TTFTs and
/// inter-token latencies (ms), and the requests in flight over time (s from the run's first
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

/// A line panel at (`x0`, `y0`): `(x, y)` series from 0 to their largest values.
///
/// `fraction`: y is a fraction (axis 0 to 1, two decimals) rather than a count.
fn line_panel(
    out: &mut String,
    (x0, y0): (f64, f64),
    title: &str,
    (x_unit, y_unit): (&str, &str),
    fraction: bool,
    series: &[(&str, &[(f64, f64)])],
) {
    let max = |f: fn(&(f64, f64)) -> f64| {
        series
            .iter()
            .flat_map(|(_, v)| v.iter().map(f))
            .filter(|x| x.is_finite())
            .fold(0.0_f64, f64::max)
            .max(1.0)
    };
    let xmax = max(|p| p.0);
    let ymax = if fraction { 1.0 } else { max(|p| p.1) };
    let y_digits = if fraction { 2 } else { 0 };
    let (left, top) = (x0 + MARGIN_L, y0 + MARGIN_T);
    let bottom = top + PLOT_H;
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" font-size="13" text-anchor="middle">{}</text>"#,
        left + PLOT_W / 2.0,
        y0 + 18.0,
        xml_escape(title)
    );
    let _ = writeln!(
        out,
        r##"<rect x="{left:.1}" y="{top:.1}" width="{PLOT_W:.1}" height="{PLOT_H:.1}" fill="none" stroke="#888"/>"##
    );
    for i in 0..=4 {
        let f = f64::from(i) / 4.0;
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end">{:.*}</text>"#,
            left - 4.0,
            bottom - f * PLOT_H + 3.0,
            y_digits,
            f * ymax
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" font-size="10" text-anchor="middle">{:.0}</text>"#,
            left + f * PLOT_W,
            bottom + 14.0,
            f * xmax
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
        left + PLOT_W / 2.0,
        bottom + 32.0,
        xml_escape(x_unit)
    );
    if !y_unit.is_empty() {
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="start">{}</text>"#,
            left + 4.0,
            top + 12.0,
            xml_escape(y_unit)
        );
    }
    for (k, (label, v)) in series.iter().enumerate() {
        let pts: Vec<String> = v
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| {
                format!(
                    "{:.1},{:.1}",
                    left + x / xmax * PLOT_W,
                    bottom - y / ymax * PLOT_H
                )
            })
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"><title>{}</title></polyline>"#,
            COLOURS[k % COLOURS.len()],
            pts.join(" "),
            xml_escape(label)
        );
    }
}

/// Runs side by side (a live run and a simulated one, say), one SVG of four panels: the CDFs
/// of TTFT and of inter-token latency (x: ms, linear from 0 to the largest sample; y:
/// fraction), the requests in flight over time (x: s from each run's first send), and a
/// legend. `flotilla plot` draws it from `--out` folders.
pub fn side_by_side_svg(runs: &[(String, PlotSeries)]) -> String {
    // The legend fills the fourth quadrant (and below it, for many runs).
    let legend_top = PANEL_H + MARGIN_T + 10.0;
    let (w, h) = (
        2.0 * PANEL_W,
        (2.0 * PANEL_H).max(legend_top + 18.0 * runs.len() as f64 + 10.0),
    );
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif">"#
    );
    out.push('\n');
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let ttft: Vec<(&str, &[f64])> = runs
        .iter()
        .map(|(l, s)| (l.as_str(), s.ttft_ms.as_slice()))
        .collect();
    let itl: Vec<(&str, &[f64])> = runs
        .iter()
        .map(|(l, s)| (l.as_str(), s.itl_ms.as_slice()))
        .collect();
    let flight: Vec<(&str, &[(f64, f64)])> = runs
        .iter()
        .map(|(l, s)| (l.as_str(), s.in_flight.as_slice()))
        .collect();
    cdf_panel(&mut out, 0.0, 0.0, "TTFT CDF", &ttft);
    cdf_panel(&mut out, PANEL_W, 0.0, "Inter-token latency CDF", &itl);
    line_panel(
        &mut out,
        (0.0, PANEL_H),
        "Requests in flight",
        ("s from the first request", "requests"),
        false,
        &flight,
    );
    for (k, (label, _)) in runs.iter().enumerate() {
        let y = legend_top + 18.0 * k as f64;
        let colour = COLOURS[k % COLOURS.len()];
        let _ = writeln!(
            out,
            r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="3"/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            PANEL_W + MARGIN_L,
            PANEL_W + MARGIN_L + 24.0,
            PANEL_W + MARGIN_L + 30.0,
            y + 4.0,
            xml_escape(label)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// An SVG with two panels, the CDFs of TTFT and of end-to-end latency (x: ms, linear from 0
/// to the largest sample; y: fraction of successful requests), one polyline per run in each,
/// and a legend.
pub fn latency_cdf_svg(runs: &[(String, Samples)]) -> String {
    let legend_h = 18.0 * runs.len() as f64 + 10.0;
    let (w, h) = (2.0 * PANEL_W, PANEL_H + legend_h);
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif">"#
    );
    out.push('\n');
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let ttft: Vec<(&str, &[f64])> = runs
        .iter()
        .map(|(l, s)| (l.as_str(), s.ttft_ms.as_slice()))
        .collect();
    let e2e: Vec<(&str, &[f64])> = runs
        .iter()
        .map(|(l, s)| (l.as_str(), s.e2e_ms.as_slice()))
        .collect();
    panel(&mut out, 0.0, "TTFT CDF", &ttft);
    panel(&mut out, PANEL_W, "End-to-end latency CDF", &e2e);
    for (k, (label, _)) in runs.iter().enumerate() {
        let y = PANEL_H + 10.0 + 18.0 * k as f64;
        let colour = COLOURS[k % COLOURS.len()];
        let _ = writeln!(
            out,
            r#"<line x1="{MARGIN_L}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="3"/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            MARGIN_L + 24.0,
            MARGIN_L + 30.0,
            y + 4.0,
            xml_escape(label)
        );
    }
    out.push_str("</svg>\n");
    out
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

    #[test]
    fn svg_well_formed_one_polyline_per_run_per_panel() {
        let runs: Vec<(String, Samples)> = (0..3)
            .map(|k| {
                let v: Vec<f64> = (1..=1000).map(|i| f64::from(i * (k + 1))).collect();
                (
                    format!("policy=<{k}>"),
                    Samples {
                        ttft_ms: v.clone(),
                        e2e_ms: v,
                    },
                )
            })
            .collect();
        let svg = latency_cdf_svg(&runs);
        assert!(svg.starts_with("<svg "));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2 * runs.len());
        assert_eq!(
            svg.matches("<polyline").count(),
            svg.matches("</polyline>").count()
        );
        assert!(svg.contains("policy=&lt;2&gt;") && !svg.contains("policy=<"));
        // Every polyline has at most MAX_POINTS + 1 points and ends at fraction 1.
        for line in svg.lines().filter(|l| l.starts_with("<polyline")) {
            let pts = line
                .split("points=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            let n = pts.split(' ').count();
            assert!(n <= MAX_POINTS + 1, "{n}");
            let last_y: f64 = pts
                .rsplit(' ')
                .next()
                .unwrap()
                .split(',')
                .nth(1)
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(last_y, MARGIN_T);
        }
        // Empty runs still give a valid document.
        let empty = latency_cdf_svg(&[("x".into(), Samples::default())]);
        assert_eq!(empty.matches("<polyline").count(), 2);
    }
}
