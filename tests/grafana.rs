//! The Grafana dashboard (`deploy/grafana/flotilla.json`) against what the gateway serves: the
//! JSON is a dashboard (every panel titled, with a query, on the `DS_PROMETHEUS` datasource
//! variable), and every metric its queries name is on a live gateway's `/metrics` after a few
//! requests — a sim-engine fleet of processes (a gateway node, two worker nodes with a host KV
//! tier), since one gateway's scrape must show the fleet. A few metrics appear only once
//! something happened that a short healthy run does not do ([`CONDITIONAL`]): those must at
//! least be written somewhere in `src/`.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::{MODEL, post, wait_routable};
use crate::process::Cluster;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// The dashboard's queried metrics that a live scrape may lack for want of an event, and why.
const CONDITIONAL: &[(&str, &str)] = &[
    (
        "flotilla_planner_desired_replicas",
        "set by a node with the planner role, once it leads and decides",
    ),
    (
        "flotilla_planner_actual_replicas",
        "set by a node with the planner role, once it leads and decides",
    ),
];

fn dashboard() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/flotilla.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} is not JSON: {e}"))
}

/// Every panel, those nested in collapsed rows included.
fn panels(d: &Value) -> Vec<&Value> {
    let mut out = vec![];
    for p in d["panels"].as_array().expect("panels") {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

/// Every PromQL query of the dashboard: the panels' targets and the template variables'.
fn exprs(d: &Value) -> Vec<String> {
    let mut out: Vec<String> = panels(d)
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect();
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] == "query" {
            let q = v["query"]["query"].as_str().or(v["query"].as_str());
            out.extend(q.map(str::to_owned));
        }
    }
    out
}

/// The metric names (identifiers starting `flotilla_`) a PromQL expression names, outside
/// its string literals (label values).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '"' || c == '\'' {
            // A string literal: skip to its end (escapes included).
            while let Some(d) = chars.next() {
                if d == '\\' {
                    chars.next();
                } else if d == c {
                    break;
                }
            }
        } else if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            let mut ident = c.to_string();
            while let Some(&d) = chars.peek() {
                if !(d.is_ascii_alphanumeric() || d == '_' || d == ':') {
                    break;
                }
                ident.push(d);
                chars.next();
            }
            if ident.starts_with("flotilla_") {
                out.insert(ident);
            }
        }
    }
    out
}

/// A Prometheus text scrape: the names of its samples, and the declared type of each family.
struct Scrape {
    samples: BTreeSet<String>,
    types: BTreeMap<String, String>,
}

impl Scrape {
    fn parse(text: &str) -> Self {
        let mut samples = BTreeSet::new();
        let mut types = BTreeMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut it = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (it.next(), it.next()) {
                    types.insert(name.to_owned(), kind.to_owned());
                }
            } else if !line.starts_with('#') && !line.trim().is_empty() {
                let end = line.find(['{', ' ']).unwrap_or(line.len());
                samples.insert(line[..end].to_owned());
            }
        }
        Self { samples, types }
    }

    /// Whether the scrape serves `name`: a sample of that name, or — for a histogram's
    /// `_bucket`, `_sum` or `_count` series — a family declared a histogram with that series.
    fn serves(&self, name: &str) -> bool {
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(family) = name.strip_suffix(suffix)
                && self.types.get(family).map(String::as_str) == Some("histogram")
            {
                return self.samples.contains(name);
            }
        }
        self.samples.contains(name) && !name.ends_with("_bucket")
    }

    /// The names in `names` the scrape does not serve.
    fn missing<'a>(&self, names: impl IntoIterator<Item = &'a String>) -> Vec<String> {
        names
            .into_iter()
            .filter(|n| !self.serves(n))
            .cloned()
            .collect()
    }
}

/// The value of an unlabelled sample.
fn value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn the_dashboard_is_a_dashboard_with_a_query_in_every_panel() {
    let d = dashboard();
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(d["uid"].as_str().is_some_and(|t| !t.is_empty()));
    let vars = d["templating"]["list"].as_array().expect("templating");
    assert!(
        vars.iter()
            .any(|v| v["name"] == "DS_PROMETHEUS" && v["type"] == "datasource"),
        "a DS_PROMETHEUS datasource variable"
    );
    let mut ids = BTreeSet::new();
    let mut charts = 0;
    for p in panels(&d) {
        let title = p["title"].as_str().unwrap_or_default();
        assert!(!title.is_empty(), "a panel without a title: {p}");
        assert!(ids.insert(p["id"].as_u64().expect("id")), "id twice: {p}");
        if p["type"] == "row" {
            continue;
        }
        charts += 1;
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
        let targets = p["targets"].as_array().map_or(&[][..], Vec::as_slice);
        assert!(!targets.is_empty(), "{title}: no targets");
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or_default();
            assert!(
                !metric_names(expr).is_empty(),
                "{title}: a target without a flotilla metric: {t}"
            );
        }
    }
    assert!(charts >= 15, "{charts} panels");
}

#[test]
fn the_extractor_finds_the_names_and_the_check_misses_what_is_not_served() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (le) (rate(flotilla_ttft_seconds_bucket{instance=~"flotilla_x", a='flotilla_y\'z'}[$__rate_interval]))) / max by (worker) (flotilla_worker_running) + notflotilla_z"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["flotilla_ttft_seconds_bucket", "flotilla_worker_running"]
    );
    let scrape = Scrape::parse(
        "# TYPE flotilla_ttft_seconds histogram\n\
         flotilla_ttft_seconds_bucket{le=\"0.1\"} 1\n\
         flotilla_ttft_seconds_sum 0.05\n\
         flotilla_ttft_seconds_count 1\n\
         # TYPE flotilla_worker_running gauge\n\
         flotilla_worker_running{worker=\"a\"} 0\n\
         flotilla_fake_bucket 3\n",
    );
    let asked: Vec<String> = [
        "flotilla_ttft_seconds_bucket",
        "flotilla_ttft_seconds_count",
        "flotilla_worker_running",
        "flotilla_worker_waiting",
        "flotilla_itl_seconds_bucket",
        "flotilla_fake_bucket",
    ]
    .map(String::from)
    .into();
    assert_eq!(
        scrape.missing(&asked),
        [
            "flotilla_worker_waiting",
            "flotilla_itl_seconds_bucket",
            "flotilla_fake_bucket"
        ]
    );
}

/// Each [`CONDITIONAL`] metric is one the dashboard queries, and is written in `src/`.
#[test]
fn the_conditional_metrics_are_queried_and_written_somewhere() {
    let queried: BTreeSet<String> = exprs(&dashboard())
        .iter()
        .flat_map(|e| metric_names(e))
        .collect();
    let mut src = String::new();
    let mut dirs = vec![std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/src"
    ))];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                src.push_str(&std::fs::read_to_string(&path).expect("source"));
            }
        }
    }
    for (name, why) in CONDITIONAL {
        assert!(queried.contains(*name), "{name} ({why}) is not queried");
        assert!(src.contains(name), "{name} ({why}) is not written in src/");
    }
}

async fn scrape(c: &Cluster) -> String {
    reqwest::get(c.url("/metrics"))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("scrape text")
}

/// A plain completion, a plain chat and a streamed chat, each answered.
async fn requests(c: &Cluster) {
    let (s, _, body) = post(
        &c.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": "The fleet", "max_tokens": 6}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6});
    let (s, _, body) = post(&c.url("/v1/chat/completions"), &chat).await;
    assert_eq!(s, 200, "{body}");
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let (s, ctype, body) = post(&c.url("/v1/chat/completions"), &streamed).await;
    assert_eq!(s, 200, "{body}");
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    assert!(body.contains("data: [DONE]"), "{body}");
}

/// Every metric the dashboard queries is on a live gateway's `/metrics` (but the
/// [`CONDITIONAL`] ones), and the gateway's own rates show the requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_queries_is_on_a_live_gateways_metrics() {
    let queried: BTreeSet<String> = exprs(&dashboard())
        .iter()
        .flat_map(|e| metric_names(e))
        .filter(|n| !CONDITIONAL.iter().any(|(c, _)| c == n))
        .collect();
    assert!(queried.len() >= 20, "{queried:?}");
    let c = Cluster::start(
        3,
        &[
            "worker.engine=sim",
            "worker.kv_blocks=128",
            "worker.kv_host_blocks=64",
        ],
    );
    wait_routable(&c, 2).await;
    // Until every queried metric is served and the rates count the requests (a request per
    // round: the window moves on), or a minute has passed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let (missing, text) = loop {
        requests(&c).await;
        let text = scrape(&c).await;
        let missing = Scrape::parse(&text).missing(&queried);
        let counting = ["flotilla_request_rate", "flotilla_output_token_rate"]
            .iter()
            .all(|n| value(&text, n).is_some_and(|v| v > 0.0));
        if (missing.is_empty() && counting) || tokio::time::Instant::now() > deadline {
            break (missing, text);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics the gateway does not serve: {missing:?}\n{text}"
    );
    for n in ["flotilla_request_rate", "flotilla_output_token_rate"] {
        let v = value(&text, n);
        assert!(v.is_some_and(|v| v > 0.0), "{n} = {v:?}\n{text}");
        assert!(
            text.contains(&format!("# HELP {n} ")) && text.contains("last 10 s"),
            "{n}: HELP with the window"
        );
    }
    // One gateway's scrape shows every worker and every node.
    for w in ["node-1/replica-0", "node-2/replica-0"] {
        assert!(
            text.contains(&format!(
                "flotilla_worker_kv_blocks_total{{worker=\"{w}\"}} 128"
            )),
            "{w}\n{text}"
        );
    }
    for n in ["node-0", "node-1", "node-2"] {
        assert!(
            text.contains(&format!("flotilla_node_restarts_total{{node=\"{n}\"}}")),
            "{n}\n{text}"
        );
    }
}
