//! Talking to a gateway over HTTP: JSON posts, `/health`, the fleet view and its counters,
//! `/metrics` counters and router placements.
//! Works with any cluster that has a gateway ([`Gateway`]: node processes or in-process).
//! Needs `poll`.
#![allow(dead_code, reason = "each binary that talks HTTP uses a subset")]

use super::poll::poll_until;
use std::collections::BTreeMap;
use std::time::Duration;

/// The served model's name (the default model file's stem).
pub const MODEL: &str = "smollm2-135m-instruct-q4_1";

/// A cluster with a gateway.
pub trait Gateway {
    /// Gateway base URL (`http://127.0.0.1:PORT`).
    fn gateway(&self) -> &str;

    /// `gateway` + `path`.
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.gateway())
    }
}

/// A gateway at a base URL, for nodes a test starts itself.
#[allow(dead_code, reason = "used by the binaries that start nodes themselves")]
pub struct At(pub String);

impl Gateway for At {
    fn gateway(&self) -> &str {
        &self.0
    }
}

/// Worker replicas `/v1/fleet` lists as ready, on nodes that are up.
#[allow(dead_code, reason = "used by the planner and reconciler tests")]
pub async fn ready_workers(c: &impl Gateway) -> usize {
    let f = fleet(c).await;
    f["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["state"] == "up")
        .flat_map(|n| n["workers"].as_array().cloned().unwrap_or_default())
        .filter(|w| w["health"] == "ready")
        .count()
}

/// The gateway's `/v1/fleet`.
pub async fn fleet(c: &impl Gateway) -> serde_json::Value {
    reqwest::get(c.url("/v1/fleet"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Sum of a numeric field over every worker of the fleet view.
pub async fn workers_sum(c: &impl Gateway, field: &str) -> u64 {
    fleet(c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["workers"].as_array().unwrap().clone())
        .map(|w| w[field].as_u64().unwrap_or(0))
        .sum()
}

/// KV blocks in use across every worker, from the gateway's fleet view.
pub async fn kv_used(c: &impl Gateway) -> u64 {
    workers_sum(c, "kv_blocks_used").await
}

/// Sum of a resilience counter (`migrations`, `restarts`, `panics`, `engine_hangs`) over
/// every node.
pub async fn counter_sum(c: &impl Gateway, name: &str) -> u64 {
    fleet(c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["counters"][name].as_u64().unwrap_or(0))
        .sum()
}

/// The sum of a Prometheus counter's series on the gateway node's `/metrics`.
pub async fn metric_sum(c: &impl Gateway, name: &str) -> u64 {
    metric_sum_with(c, name, &[]).await
}

/// [`metric_sum`] over the series whose labels contain every one of `labels`
/// (`route="messages"`).
pub async fn metric_sum_with(c: &impl Gateway, name: &str, labels: &[&str]) -> u64 {
    let text = reqwest::get(c.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

/// Router placements per worker (`flotilla_router_placements_total`, summed over policies),
/// from the gateway node's `/metrics`.
pub async fn placements(c: &impl Gateway) -> BTreeMap<String, u64> {
    let text = reqwest::get(c.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("flotilla_router_placements_total{") else {
            continue;
        };
        let worker = rest
            .split("worker=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        let n: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        *out.entry(worker.to_owned()).or_default() += n as u64;
    }
    out
}

/// What grew between two [`placements`] reads, per worker (workers that got none left out).
pub fn delta(
    after: &BTreeMap<String, u64>,
    before: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(w, n)| (w.clone(), n - before.get(w).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// `/health` status and body.
pub async fn health(c: &impl Gateway) -> (u16, serde_json::Value) {
    let r = reqwest::get(c.url("/health")).await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// Until exactly `n` workers are routable (`/health`).
pub async fn wait_routable(c: &impl Gateway, n: u64) {
    poll_until(Duration::from_secs(60), "workers routable", || async {
        let (_, h) = health(c).await;
        (h["routable_workers"].as_u64() == Some(n)).then_some(())
    })
    .await;
}

/// POST JSON, returning status, content type and body text.
pub async fn post(url: &str, body: &serde_json::Value) -> (u16, String, String) {
    post_raw(url, serde_json::to_vec(body).unwrap()).await
}

/// POST raw bytes as JSON.
pub async fn post_raw(url: &str, body: Vec<u8>) -> (u16, String, String) {
    let r = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let ctype = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, ctype, r.text().await.unwrap())
}
