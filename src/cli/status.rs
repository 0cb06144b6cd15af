//! `flotilla status`: the fleet as the gateway's `GET /v1/fleet` reports it.
//!
//! Once ([`render`]: nodes, workers, KV tiers, peer pulls, the planner, every node's actors),
//! or with `--watch` ([`watch`]) a smaller frame every `--interval` seconds ([`render_watch`]):
//! health (nodes up, workers ready, requests in flight), each node's resilience counters
//! (migrations, supervisor restarts, panics, engine hangs, node restarts: `/v1/fleet`'s
//! `counters`), and per worker its role, health, running and waiting sequences and KV use.
//! On a terminal the frame is redrawn in place (cursor home, each line cleared, through the
//! `console` crate; lines cut to the terminal's width); on a pipe or file each frame is
//! printed in full and followed by a blank line, with no escape codes. A gateway that cannot
//! be reached gives a frame that says so, and the next interval tries again. Ctrl-C (SIGINT)
//! ends the watch with exit status 0.

use crate::control::discovery::membership::NodeView;
use serde::Deserialize;
use std::fmt::Write;
use std::time::Duration;

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

/// A worker's health as `--watch` shows it (`unknown` while its scheduler has published
/// nothing: just started or restarting).
fn health_name(h: crate::control::discovery::membership::WorkerHealth) -> String {
    match serde_json::to_value(h) {
        Ok(serde_json::Value::String(s)) if !s.is_empty() => s,
        _ => "unknown".to_owned(),
    }
}

/// One `--watch` frame: `header`, then a health line (nodes up, workers ready, requests in
/// flight), a table of each node's state and resilience counters, and a table of each
/// worker's role, health, running and waiting sequences and KV blocks in use. Every line
/// ends with a newline and none is blank (on a pipe a blank line ends a frame); nothing but
/// text (the caller redraws or prints it).
pub fn render_watch(fleet: &Fleet, header: &str) -> String {
    use crate::control::discovery::membership::{NodeState, WorkerHealth};
    let mut out = String::new();
    let _ = writeln!(out, "{header}");
    let up = fleet
        .nodes
        .iter()
        .filter(|n| n.state == NodeState::Up)
        .count();
    let workers: Vec<_> = fleet.nodes.iter().flat_map(|n| &n.workers).collect();
    let ready = workers
        .iter()
        .filter(|w| w.health == WorkerHealth::Ready)
        .count();
    let in_flight: usize = workers.iter().map(|w| w.in_flight).sum();
    let _ = writeln!(
        out,
        "health: {up}/{} nodes up, {ready}/{} workers ready, {in_flight} requests in flight",
        fleet.nodes.len(),
        workers.len()
    );
    let _ = writeln!(
        out,
        "{:<24} {:<8} {:<22} {:>10} {:>8} {:>6} {:>12} {:>13}",
        "NODE",
        "STATE",
        "ROLES",
        "MIGRATIONS",
        "RESTARTS",
        "PANICS",
        "ENGINE HANGS",
        "NODE RESTARTS"
    );
    for n in &fleet.nodes {
        let roles: Vec<_> = n.roles.iter().map(|r| r.as_str()).collect();
        let c = n.counters;
        let _ = writeln!(
            out,
            "{:<24} {:<8} {:<22} {:>10} {:>8} {:>6} {:>12} {:>13}",
            n.id.as_str(),
            format!("{:?}", n.state).to_lowercase(),
            roles.join(","),
            c.migrations,
            c.restarts,
            c.panics,
            c.engine_hangs,
            c.node_restarts
        );
    }
    if workers.is_empty() {
        let _ = writeln!(out, "no worker");
        return out;
    }
    let _ = writeln!(
        out,
        "{:<28} {:<10} {:<11} {:>7} {:>7}  KV USED",
        "WORKER", "ROLE", "HEALTH", "RUNNING", "WAITING"
    );
    for w in workers {
        let kv = if w.kv_blocks_total == 0 {
            "-".to_owned()
        } else {
            format!(
                "{}/{} ({:.0} %)",
                w.kv_blocks_used,
                w.kv_blocks_total,
                100.0 * w.kv_blocks_used as f64 / w.kv_blocks_total as f64
            )
        };
        let _ = writeln!(
            out,
            "{:<28} {:<10} {:<11} {:>7} {:>7}  {}",
            w.id,
            w.role.map_or("-", |r| r.as_str()),
            health_name(w.health),
            w.running,
            w.waiting,
            kv
        );
    }
    out
}

/// The first line of a `--watch` frame: gateway, interval, the time (UTC, to the second).
fn watch_header(gateway: &str, every: Duration) -> String {
    let now = jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap_or_else(|_| jiff::Timestamp::now());
    format!(
        "flotilla status --watch: {} every {} s, {now} (Ctrl-C exits)",
        base_url(gateway),
        every.as_secs_f64()
    )
}

/// `text` cut to `rows` lines of at most `cols` columns (a terminal of that size), so that a
/// redraw in place never wraps or scrolls.
fn fit(text: &str, (rows, cols): (u16, u16)) -> Vec<String> {
    text.lines()
        .take(usize::from(rows.max(1)))
        .map(|l| console::truncate_str(l, usize::from(cols.max(1)), "").into_owned())
        .collect()
}

/// Show one frame: on a terminal redrawn in place from the top-left corner, each line
/// cleared before it is written and the rest of the screen after it; elsewhere written in
/// full and followed by a blank line.
fn show(term: &console::Term, frame: &str) -> std::io::Result<()> {
    if term.is_term() {
        term.move_cursor_to(0, 0)?;
        for line in fit(frame, term.size()) {
            term.clear_line()?;
            term.write_line(&line)?;
        }
        term.clear_to_end_of_screen()?;
    } else {
        term.write_str(frame)?;
        term.write_line("")?;
    }
    term.flush()
}

/// `flotilla status --watch`: a frame ([`render_watch`]) every `every` until Ctrl-C (or
/// until stdout is closed); a gateway that cannot be reached, or answers with something
/// that is not a fleet, gives a frame saying so and is asked again at the next interval.
///
/// # Errors
/// Stdout cannot be written (other than closed), or the Ctrl-C handler cannot be set up.
pub async fn watch(gateway: &str, every: Duration) -> anyhow::Result<()> {
    let term = console::Term::buffered_stdout();
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    if term.is_term() {
        term.clear_screen()?;
        term.hide_cursor()?;
    }
    let result = async {
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                r = &mut ctrl_c => return r.map_err(anyhow::Error::from),
            }
            let header = watch_header(gateway, every);
            let frame = tokio::select! {
                r = fetch(gateway) => match r {
                    Ok((fleet, _)) => render_watch(&fleet, &header),
                    Err(e) => format!("{header}\nno fleet view: {e:#}\n"),
                },
                r = &mut ctrl_c => return r.map_err(anyhow::Error::from),
            };
            match show(&term, &frame) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }
    .await;
    if term.is_term() {
        let _ = term.show_cursor();
        let _ = term.flush();
    }
    result
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

    fn watched() -> Fleet {
        serde_json::from_value(serde_json::json!({"nodes": [
            {"id": "node-0", "addr": "127.0.0.1:1", "http_addr": "127.0.0.1:8080",
             "roles": ["gateway", "router"], "pid": 1, "state": "up", "last_seen_ms": 0,
             "actors": [], "workers": [],
             "counters": {"migrations": 7, "restarts": 2, "panics": 1, "engine_hangs": 0,
                          "node_restarts": 0}},
            {"id": "node-1", "addr": "127.0.0.1:2", "http_addr": null, "roles": ["worker"],
             "pid": 2, "state": "up", "last_seen_ms": 90, "actors": [],
             "counters": {"migrations": 0, "restarts": 1, "panics": 0, "engine_hangs": 3,
                          "node_restarts": 4},
             "workers": [
                {"id": "node-1/replica-0", "state": "running", "running": 5, "waiting": 2,
                 "in_flight": 7, "kv_blocks_used": 256, "kv_blocks_total": 1024,
                 "health": "ready", "role": "decode"},
                {"id": "node-1/replica-1", "state": "running", "health": ""}
             ]},
            {"id": "node-2", "addr": "127.0.0.1:3", "http_addr": null, "roles": ["worker"],
             "pid": 3, "state": "down", "last_seen_ms": 9000, "actors": [], "workers": []}
        ]}))
        .expect("a fleet")
    }

    /// The cells of the line that starts with `first` (split at whitespace).
    fn row<'a>(out: &'a str, first: &str) -> Vec<&'a str> {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(first))
            .unwrap_or_else(|| panic!("no row {first}:\n{out}"))
            .split_whitespace()
            .collect()
    }

    /// A watch frame: the header first, the health line, each node's counters in order
    /// (migrations, restarts, panics, engine hangs, node restarts), each worker's role,
    /// health, running, waiting and KV use; plain text only.
    #[test]
    fn watch_frame_shows_health_counters_and_each_workers_load() {
        let out = render_watch(&watched(), "HEADER");
        assert_eq!(out.lines().next(), Some("HEADER"), "{out}");
        assert!(
            out.contains("health: 2/3 nodes up, 1/2 workers ready, 7 requests in flight"),
            "{out}"
        );
        assert!(
            out.contains("MIGRATIONS") && out.contains("NODE RESTARTS"),
            "{out}"
        );
        assert_eq!(
            row(&out, "node-0"),
            ["node-0", "up", "gateway,router", "7", "2", "1", "0", "0"]
        );
        assert_eq!(
            row(&out, "node-1"),
            ["node-1", "up", "worker", "0", "1", "0", "3", "4"]
        );
        assert_eq!(row(&out, "node-2")[1], "down");
        assert_eq!(
            row(&out, "node-1/replica-0"),
            [
                "node-1/replica-0",
                "decode",
                "ready",
                "5",
                "2",
                "256/1024",
                "(25",
                "%)"
            ]
        );
        assert_eq!(
            row(&out, "node-1/replica-1"),
            ["node-1/replica-1", "-", "unknown", "0", "0", "-"]
        );
        assert!(!out.contains('\x1b'), "no escape codes: {out:?}");
        assert!(out.ends_with('\n'));
        assert!(
            !out.lines().any(|l| l.trim().is_empty()),
            "no blank line: {out}"
        );
        let empty: Fleet = serde_json::from_value(serde_json::json!({"nodes": []})).unwrap();
        let e = render_watch(&empty, "H");
        assert!(
            e.contains("health: 0/0 nodes up") && e.contains("no worker"),
            "{e}"
        );
    }

    /// A frame on a terminal is cut to its rows and columns.
    #[test]
    fn frames_fit_the_terminal() {
        let lines = fit("abcdef\nxy\nzzz\n", (2, 4));
        assert_eq!(lines, ["abcd", "xy"]);
    }
}
