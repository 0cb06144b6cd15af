//! Beyond one host: nodes in separate network namespaces, each with its own private
//! address on a bridge the test makes (a veth pair per namespace), as separate hosts on one
//! network would be. A gateway node and three worker nodes (one prefill, two decode) join over
//! the bridge; requests are routed and served, every prompt's KV moving from the prefill
//! namespace to a decode namespace over the KV transport (TCP); then the link of the decode
//! worker serving a stream is cut (`ip link set … down`): the node goes down in the gateway's
//! view and the stream migrates to the other decode worker and ends with the same text.
//!
//! Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip` (iproute2): where a namespace
//! cannot be made the test says so and is skipped.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;

use crate::http::{At, MODEL, fleet};
use crate::poll::poll_until;
use flotilla::cli::client::stream_chat;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Runs `ip ARGS`, panicking with its stderr on failure.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespaces, links and node processes of one test; all removed on drop.
struct Net {
    tag: String,
    spaces: Vec<String>,
    nodes: Vec<Child>,
}

impl Net {
    fn ns(&self, k: usize) -> &str {
        &self.spaces[k]
    }

    /// The host-side end of namespace `k`'s veth pair.
    fn veth(&self, k: usize) -> String {
        format!("{}h{k}", self.tag)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.tag)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for c in &mut self.nodes {
            let _ = c.kill();
            let _ = c.wait();
        }
        for k in 0..self.spaces.len() {
            let _ = Command::new("ip")
                .args(["link", "del", &self.veth(k)])
                .output();
        }
        for s in &self.spaces {
            let _ = Command::new("ip").args(["netns", "del", s]).output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge()])
            .output();
    }
}

/// A bridge and `n` namespaces on it, namespace k at `10.213.<net>.<k+1>/24`, the host at
/// `.254`; `None` (with the reason) where namespaces cannot be made.
fn make_net(n: usize, net: u8) -> Result<Net, String> {
    let tag = format!("fl{}", std::process::id() % 100_000);
    let probe = format!("{tag}probe");
    let out = Command::new("ip")
        .args(["netns", "add", &probe])
        .output()
        .map_err(|e| format!("`ip` cannot run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cannot make a network namespace: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    ip(&["netns", "del", &probe]);
    let mut net_ = Net {
        tag: tag.clone(),
        spaces: Vec::new(),
        nodes: Vec::new(),
    };
    let br = net_.bridge();
    ip(&["link", "add", &br, "type", "bridge"]);
    ip(&["addr", "add", &format!("10.213.{net}.254/24"), "dev", &br]);
    ip(&["link", "set", &br, "up"]);
    for k in 0..n {
        let ns = format!("{tag}n{k}");
        ip(&["netns", "add", &ns]);
        net_.spaces.push(ns.clone());
        let (host, inner) = (net_.veth(k), format!("{tag}i{k}"));
        ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner]);
        ip(&["link", "set", &inner, "netns", &ns]);
        ip(&["link", "set", &host, "master", &br]);
        ip(&["link", "set", &host, "up"]);
        let addr = format!("10.213.{net}.{}/24", k + 1);
        ip(&["-n", &ns, "addr", "add", &addr, "dev", &inner]);
        ip(&["-n", &ns, "link", "set", &inner, "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
    }
    Ok(net_)
}

/// Starts `flotilla node` in namespace `k` of `net`.
fn start_node(net: &mut Net, k: usize, args: &[String]) {
    let ns = net.ns(k).to_owned();
    let child = Command::new("ip")
        .args(["netns", "exec", &ns, env!("CARGO_BIN_EXE_flotilla"), "node"])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("FLOTILLA_NODE__COOKIE", "netns-test-cookie")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("flotilla node starts");
    net.nodes.push(child);
}

fn body(max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content":
            "Across the network, tell me a long story about a lighthouse keeper and the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_in_separate_network_namespaces_join_route_pull_kv_and_migrate() {
    let octet = (std::process::id() % 200 + 20) as u8;
    let mut net = match make_net(4, octet) {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIPPED: {why} (run as root, or with CAP_NET_ADMIN and CAP_SYS_ADMIN)");
            return;
        }
    };
    let addr = |k: usize| format!("10.213.{octet}.{}", k + 1);
    let seed = format!("{}:7070", addr(0));
    let common = |k: usize| {
        vec![
            "--name".to_owned(),
            format!("node-{k}"),
            "--listen".to_owned(),
            format!("{}:7070", addr(k)),
            "--set".to_owned(),
            "worker.kv_blocks=256".to_owned(),
            "--set".to_owned(),
            format!("transport.tcp_bind={}:7071", addr(k)),
            "--set".to_owned(),
            "transport.backend=tcp".to_owned(),
            "--set".to_owned(),
            "disagg.min_prefill_tokens=8".to_owned(),
        ]
    };
    let mut gw = common(0);
    gw.extend(["--roles", "gateway,router", "--http"].map(String::from));
    gw.push(format!("{}:8080", addr(0)));
    start_node(&mut net, 0, &gw);
    for (k, role) in [(1, "prefill"), (2, "decode"), (3, "decode")] {
        let mut a = common(k);
        a.extend(["--roles", "worker", "--join"].map(String::from));
        a.push(seed.clone());
        a.extend(["--set".to_owned(), format!("worker.role={role}")]);
        start_node(&mut net, k, &a);
    }
    let base = format!("http://{}:8080", addr(0));
    let gwy = At(base.clone());
    // Joined over the bridge: every worker routable.
    poll_until(
        Duration::from_secs(90),
        "three routable workers",
        || async {
            let r = reqwest::get(format!("{base}/health")).await.ok()?;
            let h: serde_json::Value = r.json().await.ok()?;
            let f: serde_json::Value = reqwest::get(format!("{base}/v1/fleet"))
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            let up = f["nodes"]
                .as_array()?
                .iter()
                .filter(|n| n["state"] == "up")
                .count();
            (h["routable_workers"].as_u64() == Some(3) && up == 4).then_some(())
        },
    )
    .await;
    let f = fleet(&gwy).await;
    for k in 1..4 {
        let node = f["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["id"] == format!("node-{k}").as_str())
            .unwrap_or_else(|| panic!("node-{k} in the view: {f}"));
        assert_eq!(node["addr"], format!("{}:7070", addr(k)), "its own address");
        assert_eq!(node["state"], "up");
    }

    // Routed and served, the prompt prefilled in one namespace and decoded in another.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap();
    let reference = stream_chat(&client, &base, body(96)).await.expect("served");
    assert!(reference.is_complete(), "{reference:?}");
    let pulled = crate::http::workers_sum(&gwy, "kv_blocks_pulled").await;
    assert!(pulled > 0, "KV blocks moved between namespaces: {pulled}");

    // Cut the decode worker serving a stream off the network: the stream migrates.
    let stream = {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move { stream_chat(&client, &base, body(96)).await })
    };
    let serving = poll_until(Duration::from_secs(60), "a decode worker busy", || async {
        let f = fleet(&gwy).await;
        f["nodes"].as_array()?.iter().find_map(|n| {
            let busy = n["workers"]
                .as_array()?
                .iter()
                .any(|w| w["role"] == "decode" && w["running"].as_u64().unwrap_or(0) > 0);
            busy.then(|| n["id"].as_str().unwrap().to_owned())
        })
    })
    .await;
    let k: usize = serving.trim_start_matches("node-").parse().unwrap();
    ip(&["link", "set", &net.veth(k), "down"]);
    let cut = std::time::Instant::now();
    poll_until(Duration::from_secs(30), "the cut node down", || async {
        let f = fleet(&gwy).await;
        let down = f["nodes"]
            .as_array()?
            .iter()
            .any(|n| n["id"] == serving.as_str() && n["state"] == "down");
        down.then_some(())
    })
    .await;
    eprintln!(
        "{serving} seen down {} ms after its link was cut",
        cut.elapsed().as_millis()
    );
    let s = stream.await.unwrap().expect("the stream ends");
    assert!(s.is_complete(), "{s:?}");
    assert_eq!(
        s.text, reference.text,
        "the migrated stream gives the same text"
    );
    assert!(
        crate::http::counter_sum(&gwy, "migrations").await >= 1,
        "the stream migrated"
    );
}
