//! `flotilla status`: the fleet as the gateway's `GET /v1/fleet` reports it.

use crate::control::discovery::membership::NodeView;
use serde::Deserialize;
use std::fmt::Write;

/// The `/v1/fleet` body.
#[derive(Debug, Deserialize)]
pub struct Fleet {
    /// Nodes, the gateway's own first.
    pub nodes: Vec<NodeView>,
}

/// A gateway base URL from a URL or a bare `host:port` (http assumed), without a trailing `/`.
pub fn base_url(gateway: &str) -> String {
    let g = gateway.trim_end_matches('/');
    if g.contains("://") {
        g.to_owned()
    } else {
        format!("http://{g}")
    }
}

/// Fetch `/v1/fleet` from `gateway` (a base URL such as `http://127.0.0.1:8080`).
///
/// # Errors
/// The gateway cannot be reached, answers with an error status, or its answer is
/// not a fleet.
pub async fn fetch(gateway: &str) -> anyhow::Result<(Fleet, serde_json::Value)> {
    let url = format!("{}/v1/fleet", base_url(gateway));
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()?;
    let resp = client
        .get(&url)
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the gateway at {gateway}: {e}"))?;
    let status = resp.status();
    let text = resp
        .text()
        .await
        .map_err(|e| anyhow::anyhow!("{url}: the answer broke off: {e}"))?;
    let snippet = || {
        let t = text.trim();
        let cut: String = t.chars().take(200).collect();
        if cut.len() < t.len() {
            format!("{cut}…")
        } else {
            cut
        }
    };
    if !status.is_success() {
        anyhow::bail!("{url} answered {status}: {}", snippet());
    }
    let body: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        anyhow::anyhow!(
            "{url} answered {status} with a body that is not JSON ({e}): {}",
            snippet()
        )
    })?;
    let fleet: Fleet = serde_json::from_value(body.clone())
        .map_err(|e| anyhow::anyhow!("{url}: not a fleet view ({e})"))?;
    Ok((fleet, body))
}

/// A one-screen table: nodes, roles, state, workers, then each node's actors.
pub fn render(fleet: &Fleet) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:<18} {:<22} {:<8} WORKERS",
        "NODE", "ADDR", "ROLES", "STATE"
    );
    for n in &fleet.nodes {
        let roles: Vec<_> = n.roles.iter().map(|r| r.as_str()).collect();
        let workers: Vec<_> = n.workers.iter().map(|w| w.id.as_str()).collect();
        let state = format!("{:?}", n.state).to_lowercase();
        let _ = writeln!(
            out,
            "{:<24} {:<18} {:<22} {:<8} {}",
            n.id.as_str(),
            n.addr,
            roles.join(","),
            state,
            if workers.is_empty() {
                "-".to_owned()
            } else {
                workers.join(",")
            }
        );
    }
    let tiered: Vec<_> = fleet
        .nodes
        .iter()
        .flat_map(|n| &n.workers)
        .filter_map(|w| w.kv_tiers.map(|t| (w.id.as_str(), t)))
        .collect();
    if !tiered.is_empty() {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<28} {:>13} {:>13} {:>9} {:>9} {:>9} {:>7} {:>8} {:>7}",
            "KV TIERS",
            "HOST",
            "DISK",
            "OFFLOADS",
            "ONBOARDS",
            "DEMOTED",
            "DROPS",
            "FAILURES",
            "CORRUPT"
        );
        for (id, t) in tiered {
            let c = t.counters;
            let _ = writeln!(
                out,
                "{:<28} {:>13} {:>13} {:>9} {:>9} {:>9} {:>7} {:>8} {:>7}",
                id,
                format!("{}/{}", t.host_blocks, t.host_capacity),
                if t.disk_capacity == 0 {
                    "off".to_owned()
                } else {
                    format!("{}/{}", t.disk_blocks, t.disk_capacity)
                },
                c.offloads,
                c.onboards_host + c.onboards_disk,
                c.demotions,
                c.offload_drops,
                c.copy_failures,
                c.corrupt
            );
        }
    }
    let pulling: Vec<_> = fleet
        .nodes
        .iter()
        .flat_map(|n| &n.workers)
        .filter(|w| !w.kv_peer_pulls.is_zero())
        .map(|w| (w.id.as_str(), w.kv_peer_pulls))
        .collect();
    if !pulling.is_empty() {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<28} {:>7} {:>8} {:>7} {:>8} {:>7} {:>6} {:>9}",
            "PEER PULLS", "ASKED", "DECLINED", "PULLED", "BLOCKS", "FAILED", "MOOT", "EXPORTED"
        );
        for (id, p) in pulling {
            let _ = writeln!(
                out,
                "{:<28} {:>7} {:>8} {:>7} {:>8} {:>7} {:>6} {:>9}",
                id, p.asked, p.declined, p.pulled, p.blocks, p.failed, p.moot, p.exported
            );
        }
    }
    let _ = writeln!(out);
    for n in &fleet.nodes {
        if let Some(p) = &n.planner {
            out.push_str(&render_planner(n.id.as_str(), p));
            let _ = writeln!(out);
        }
    }
    for n in &fleet.nodes {
        let _ = writeln!(out, "{} actors:", n.id);
        for a in &n.actors {
            let depth = a.path.matches('/').count();
            let name = a.path.rsplit('/').next().unwrap_or(&a.path);
            let _ = writeln!(out, "  {}{:<28} {}", "  ".repeat(depth), name, a.state);
        }
    }
    out
}

/// The planner's latest decision: mode, forecast, per pool actual → desired and why.
pub fn render_planner(node: &str, p: &crate::control::planner::PlannerView) -> String {
    let mut out = String::new();
    let mode = format!("{:?}", p.mode).to_lowercase();
    let lead = match &p.leadership {
        None => String::new(),
        Some(crate::control::leadership::Standing::Leader { term }) => {
            format!("; LEADER, term {term}")
        }
        Some(crate::control::leadership::Standing::Standby { term, .. }) => {
            format!("; standby, term {term}")
        }
    };
    let _ = writeln!(
        out,
        "planner on {node} ({mode}, every {} s; capacity: {}{lead})",
        p.interval_s, p.capacity
    );
    let Some(d) = p.latest() else {
        let _ = writeln!(out, "  no decision yet");
        return out;
    };
    if d.stale {
        let _ = writeln!(
            out,
            "  signals stale ({} ms old): holding the last decision",
            d.signals_age_ms
        );
    }
    if let Some(f) = &d.forecast {
        let _ = writeln!(
            out,
            "  forecast: {:.2} req/s, {:.0} prompt / {:.0} output tokens; desired fleet {:.2}/h",
            f.request_rate, f.prompt_tokens, f.output_tokens, d.cost_per_hour
        );
    }
    for pd in &d.pools {
        let _ = writeln!(
            out,
            "  {:<10} {} -> {} ({:?}): {}",
            pd.role.as_str(),
            pd.actual,
            pd.desired,
            pd.action,
            pd.reason
        );
    }
    for m in &d.manual {
        let _ = writeln!(out, "  manual change: {m}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(pulls: serde_json::Value) -> Fleet {
        serde_json::from_value(serde_json::json!({"nodes": [{
            "id": "node-1", "addr": "127.0.0.1:1", "http_addr": null, "roles": ["worker"],
            "pid": 1, "state": "up", "last_seen_ms": 0, "actors": [],
            "workers": [
                {"id": "node-1/replica-0", "state": "running", "kv_peer_pulls": pulls},
                {"id": "node-1/replica-1", "state": "running"}
            ]
        }]}))
        .expect("a fleet")
    }

    /// Peer pull counters get a table, one row per worker that has any; none without.
    #[test]
    fn peer_pulls_are_listed_per_worker_that_has_any() {
        let out = render(&fleet(serde_json::json!({
            "asked": 3, "declined": 1, "pulled": 2, "blocks": 36, "failed": 1, "moot": 0,
            "exported": 4
        })));
        let row = out
            .lines()
            .find(|l| l.starts_with("node-1/replica-0") && l.contains("36"))
            .unwrap_or_else(|| panic!("no pulls row:\n{out}"));
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[1..], ["3", "1", "2", "36", "1", "0", "4"], "{out}");
        assert!(out.contains("PEER PULLS"), "{out}");
        assert!(!out.lines().any(|l| l.starts_with("node-1/replica-1 ")));
        let zero = serde_json::to_value(crate::kv::PeerPullCounters::default()).expect("json");
        let quiet = render(&fleet(zero));
        assert!(!quiet.contains("PEER PULLS"), "{quiet}");
    }
}
