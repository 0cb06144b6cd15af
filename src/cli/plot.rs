//! `flotilla plot`: runs side by side on one figure — a live run (`flotilla bench --out`) and a
//! simulated one (`flotilla sim --out`) of the same trace, say: the CDFs of TTFT and of
//! inter-token latency, and the requests in flight over time
//! ([`side_by_side_panels`](crate::cli::bench::charts::side_by_side_panels), drawn with
//! plotters). `--out` ending in `.png` writes a PNG, anything else an SVG.
//!
//! ```text
//! flotilla plot /tmp/fid/live=live /tmp/fid/sim=sim --out live-vs-sim.svg
//! ```
//!
//! Each argument is an output folder, optionally `=LABEL` (default: the folder's name); every
//! run in its `requests.jsonl` (a `--compare` writes several) becomes one series, labelled
//! `LABEL` (one run) or `LABEL: run` (several).
//!
//! **Errors**: a folder without `requests.jsonl`, or a line of it that is not a request record,
//! named with its line number.

use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};

use crate::cli::bench::charts;
use crate::cli::bench::metrics::RequestResult;
use crate::cli::bench::report::PlotSeries;

/// Options of `flotilla plot`.
#[derive(Clone, Debug, clap::Args)]
pub struct PlotArgs {
    /// Output folders of `flotilla bench --out` or `flotilla sim --out`, each optionally
    /// `DIR=LABEL` (split at the last `=`; default label: the folder's name).
    #[arg(required = true, value_name = "DIR[=LABEL]")]
    pub runs: Vec<String>,
    /// The figure to write: a PNG when the name ends in `.png`, else an SVG.
    #[arg(long, default_value = "plot.svg")]
    pub out: PathBuf,
}

/// The runs of one `requests.jsonl`, in the order they first appear: (run label, requests).
///
/// # Errors
/// A line that is not a request record (named).
pub fn read_requests(text: &str) -> anyhow::Result<Vec<(String, Vec<RequestResult>)>> {
    #[derive(serde::Deserialize)]
    struct Line {
        #[serde(default)]
        run: String,
        #[serde(flatten)]
        result: RequestResult,
    }
    let mut runs: Vec<(String, Vec<RequestResult>)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(line)
            .with_context(|| format!("line {}: not a request record", i + 1))?;
        match runs.iter_mut().find(|(r, _)| *r == l.run) {
            Some((_, v)) => v.push(l.result),
            None => runs.push((l.run, vec![l.result])),
        }
    }
    Ok(runs)
}

fn label_of(arg: &str) -> (PathBuf, String) {
    match arg.rsplit_once('=') {
        Some((dir, label)) if !label.is_empty() => (PathBuf::from(dir), label.to_owned()),
        _ => {
            let dir = PathBuf::from(arg);
            let label = dir
                .file_name()
                .map_or_else(|| arg.to_owned(), |n| n.to_string_lossy().into_owned());
            (dir, label)
        }
    }
}

fn series_of(dir: &Path, label: &str) -> anyhow::Result<Vec<(String, PlotSeries)>> {
    let path = dir.join("requests.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "cannot read {} (an --out folder of flotilla bench or flotilla sim)",
            path.display()
        )
    })?;
    let runs = read_requests(&text).with_context(|| path.display().to_string())?;
    ensure!(!runs.is_empty(), "{}: no request", path.display());
    let one = runs.len() == 1;
    Ok(runs
        .into_iter()
        .map(|(run, results)| {
            let name = if one {
                label.to_owned()
            } else {
                format!("{label}: {run}")
            };
            (name, PlotSeries::of(&results))
        })
        .collect())
}

/// Run `flotilla plot`.
///
/// # Errors
/// An unreadable folder or record, or a figure that cannot be written.
pub fn run(a: PlotArgs) -> anyhow::Result<()> {
    let mut all = Vec::new();
    for arg in &a.runs {
        let (dir, label) = label_of(arg);
        all.extend(series_of(&dir, &label)?);
    }
    let panels = charts::side_by_side_panels(&all);
    let png = a
        .out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    let bytes = if png {
        charts::png(&panels)?
    } else {
        charts::svg(&panels)?.into_bytes()
    };
    std::fs::write(&a.out, bytes).with_context(|| format!("cannot write {}", a.out.display()))?;
    eprintln!("wrote {} ({} runs)", a.out.display(), all.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_grouped_by_run_and_bad_lines_named() {
        let text = r#"{"run":"a","session":0,"turn":0,"sent_s":0.0,"ideal_cached_tokens":0,"ok":true,"error":null,"ttft_ms":10.0,"e2e_ms":2000.0,"itl_ms":[5.0,6.0],"output_tokens":3,"prompt_tokens":9,"cached_tokens":0}
{"run":"b","session":0,"turn":0,"sent_s":0.5,"ideal_cached_tokens":0,"ok":true,"error":null,"ttft_ms":12.0,"e2e_ms":1000.0,"itl_ms":[7.0],"output_tokens":2,"prompt_tokens":9,"cached_tokens":0}
{"run":"a","session":1,"turn":0,"sent_s":1.0,"ideal_cached_tokens":0,"ok":false,"error":"503","ttft_ms":null,"e2e_ms":10.0,"itl_ms":[],"output_tokens":0,"prompt_tokens":null,"cached_tokens":null}
"#;
        let runs = read_requests(text).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0].0, "a");
        assert_eq!(runs[0].1.len(), 2);
        let s = PlotSeries::of(&runs[0].1);
        assert_eq!(s.ttft_ms, vec![10.0]);
        assert_eq!(s.itl_ms, vec![5.0, 6.0]);
        // Two requests overlap from 1.0 s to 1.01 s: the peak shows in the samples.
        let peak = s.in_flight.iter().map(|p| p.1).fold(0.0, f64::max);
        assert_eq!(peak, 2.0, "{:?}", &s.in_flight[..5]);
        assert!(
            s.in_flight.last().unwrap().1 <= 1.0,
            "{:?}",
            s.in_flight.last()
        );
        assert_eq!(s.in_flight.len(), 401);
        let panels = charts::side_by_side_panels(&[("live".into(), s.clone()), ("sim".into(), s)]);
        let svg = charts::svg(&panels).unwrap();
        assert!(svg.contains(">\nRequests in flight\n</text>") && svg.contains(">\nsim\n</text>"));
        assert!(charts::png(&panels).unwrap().starts_with(b"\x89PNG"));
        let err = read_requests("{\"run\":\"a\"}\n").unwrap_err();
        assert!(format!("{err:#}").starts_with("line 1:"), "{err:#}");
        assert_eq!(label_of("/x/live=Live").1, "Live");
        assert_eq!(label_of("/x/sim").1, "sim");
    }
}
