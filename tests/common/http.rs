//! Talking to a gateway over HTTP: JSON posts, `/health`, the fleet view and its counters.
//! Works with any cluster that has a gateway ([`Gateway`]: node processes or in-process).
//! Needs `poll`.
#![allow(dead_code, reason = "each binary that talks HTTP uses a subset")]

use super::poll::poll_until;
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
