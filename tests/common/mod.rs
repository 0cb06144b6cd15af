//! Shared helpers for integration tests: poll for conditions (never a fixed sleep), clusters
//! of node processes, HTTP and SSE helpers; the model, golden cases and a greedy driver over
//! the synchronous engine API. Each test binary uses a subset.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

/// Poll `cond` every 20 ms until it returns `Some`, or panic after `timeout` with `what`.
pub async fn poll_until<T, F, Fut>(timeout: Duration, what: &str, mut cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = cond().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Log to the test's output when `FLOTILLA_LOG` is set (e.g. `FLOTILLA_LOG=debug`).
pub fn init_tracing() {
    if let Ok(filter) = std::env::var("FLOTILLA_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    }
}

/// A `flotilla up` cluster on loopback for a test; stopped (SIGTERM, then SIGKILL) on drop.
pub struct Cluster {
    /// The `flotilla up` process.
    pub child: std::process::Child,
    /// Gateway base URL.
    pub gateway: String,
}

impl Cluster {
    /// Start `flotilla up --nodes N --http 127.0.0.1:0` with extra `--set` values.
    pub fn start(nodes: usize, sets: &[&str]) -> Self {
        Self::start_with(nodes, &[], sets)
    }

    /// As [`Cluster::start`], with extra `flotilla up` flags (`--no-restart`, `--chaos`).
    pub fn start_with(nodes: usize, flags: &[&str], sets: &[&str]) -> Self {
        Self::spawn(nodes, flags, sets, &[], None)
    }

    /// As [`Cluster::start_with`], with environment variables for every node (e.g.
    /// `FLOTILLA_LOG`), and every node's log (stderr) collected into the returned [`Logs`].
    pub fn start_logged(
        nodes: usize,
        flags: &[&str],
        sets: &[&str],
        env: &[(&str, &str)],
    ) -> (Self, Logs) {
        let logs = Logs::default();
        let c = Self::spawn(nodes, flags, sets, env, Some(logs.clone()));
        (c, logs)
    }

    fn spawn(
        nodes: usize,
        flags: &[&str],
        sets: &[&str],
        env: &[(&str, &str)],
        logs: Option<Logs>,
    ) -> Self {
        use std::io::BufRead;
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"));
        cmd.args(["up", "--nodes", &nodes.to_string(), "--http", "127.0.0.1:0"]);
        cmd.args(flags);
        for s in sets {
            cmd.args(["--set", s]);
        }
        cmd.envs(env.iter().copied());
        let stderr = if logs.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::inherit()
        };
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("flotilla up starts");
        if let Some(logs) = logs {
            let err = child.stderr.take().unwrap();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                    logs.0.lock().unwrap().push(strip_ansi(&line));
                }
            });
        }
        let out = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(out).lines();
        let gateway = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(j) = line.strip_prefix("FLOTILLA_UP ") {
                        let v: serde_json::Value = serde_json::from_str(j).unwrap();
                        break v["gateway"].as_str().unwrap().to_owned();
                    }
                }
                _ => panic!("flotilla up ended before the cluster was ready"),
            }
        };
        std::thread::spawn(move || for _ in lines.by_ref() {});
        Self { child, gateway }
    }

    /// `gateway` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.gateway)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        for _ in 0..200 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `line` without ANSI colour sequences (`ESC [ … letter`).
pub fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Log lines of a cluster's nodes, collected as they come (see [`Cluster::start_logged`]).
#[derive(Clone, Default)]
pub struct Logs(pub std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Logs {
    /// The lines collected so far that contain `needle`.
    pub fn matching(&self, needle: &str) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .cloned()
            .collect()
    }

    /// Every line collected so far.
    pub fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// The gateway's `/v1/fleet`.
pub async fn fleet(c: &Cluster) -> serde_json::Value {
    reqwest::get(c.url("/v1/fleet"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Sum of a numeric field over every worker of the fleet view.
pub async fn workers_sum(c: &Cluster, field: &str) -> u64 {
    fleet(c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["workers"].as_array().unwrap().clone())
        .map(|w| w[field].as_u64().unwrap_or(0))
        .sum()
}

/// KV blocks in use across every worker, from the gateway's fleet view.
pub async fn kv_used(c: &Cluster) -> u64 {
    workers_sum(c, "kv_blocks_used").await
}

/// Sum of a resilience counter (`migrations`, `restarts`, `panics`, `engine_hangs`) over
/// every node.
pub async fn counter_sum(c: &Cluster, name: &str) -> u64 {
    fleet(c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["counters"][name].as_u64().unwrap_or(0))
        .sum()
}

/// The OS pid of node `node`.
pub async fn node_pid(c: &Cluster, node: &str) -> i32 {
    fleet(c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == node)
        .unwrap_or_else(|| panic!("no node {node}"))["pid"]
        .as_i64()
        .unwrap() as i32
}

/// Send `sig` to `pid`.
pub fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).unwrap();
}

/// `/health` status and body.
pub async fn health(c: &Cluster) -> (u16, serde_json::Value) {
    let r = reqwest::get(c.url("/health")).await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// Until exactly `n` workers are routable (`/health`).
pub async fn wait_routable(c: &Cluster, n: u64) {
    poll_until(Duration::from_secs(60), "workers routable", || async {
        let (_, h) = health(c).await;
        (h["routable_workers"].as_u64() == Some(n)).then_some(())
    })
    .await;
}

/// The served model's name (the default model file's stem).
pub const MODEL: &str = "smollm2-135m-instruct-q4_1";

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

/// Parse an SSE body into its data records (JSON values; `[DONE]` as the string "[DONE]"),
/// checking the framing: every record is `data: <payload>` followed by a blank line, or a
/// comment line starting with `:`.
pub fn sse_records(body: &str) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for block in body.split("\n\n") {
        if block.is_empty() {
            continue;
        }
        if block.starts_with(':') {
            continue;
        }
        let payload = block
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("record is not `data: `: {block:?}"));
        assert!(!payload.contains('\n'), "multi-line record: {block:?}");
        if payload == "[DONE]" {
            out.push(serde_json::Value::String("[DONE]".into()));
        } else {
            out.push(
                serde_json::from_str(payload)
                    .unwrap_or_else(|e| panic!("bad JSON {payload:?}: {e}")),
            );
        }
    }
    out
}

/// Joined text of a stream's chunks (chat deltas or completion texts) for choice `index`.
pub fn joined_text(records: &[serde_json::Value], index: u64) -> String {
    let mut s = String::new();
    for r in records {
        for c in r["choices"].as_array().into_iter().flatten() {
            if c["index"].as_u64() == Some(index) {
                if let Some(t) = c["delta"]["content"].as_str() {
                    s.push_str(t);
                }
                if let Some(t) = c["text"].as_str() {
                    s.push_str(t);
                }
            }
        }
    }
    s
}

// ----- engine helpers -----

use std::sync::{Arc, OnceLock};

use flotilla::model::{LoadedModel, load_model, resolve_model_path};
use flotilla::runtime::ids::{BlockId, SeqId};
use flotilla::worker::engine::{Engine, EngineConfig, SamplingParams, StepBatch, StepSeq};

/// The golden cases of the default model (provenance in `tests/data/README.md`).
pub const GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/smollm2-golden.json"
);

/// The golden file as JSON; panics naming the path when it cannot be read.
pub fn golden_json() -> serde_json::Value {
    let text =
        std::fs::read_to_string(GOLDEN).unwrap_or_else(|e| panic!("cannot read {GOLDEN}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{GOLDEN} is not JSON: {e}"))
}

#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub top5: Vec<(u32, f32)>,
}

pub fn golden() -> Vec<Case> {
    let j = golden_json();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    j["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("name").to_owned(),
            prompt: c["prompt"].as_str().expect("prompt").to_owned(),
            prompt_ids: ids(&c["prompt_ids"]),
            greedy_ids: ids(&c["greedy_ids"]),
            top5: c["step0_top5_logits"]
                .as_array()
                .expect("top5")
                .iter()
                .map(|p| {
                    (
                        p[0].as_u64().expect("id") as u32,
                        p[1].as_f64().expect("logit") as f32,
                    )
                })
                .collect(),
        })
        .collect()
}

pub fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| {
        let p = resolve_model_path(None).expect("model path (run `make model`)");
        load_model(&p).expect("load model")
    })
}

pub fn engine(m: &LoadedModel, num_blocks: usize) -> Engine {
    Engine::new(
        Arc::clone(&m.weights),
        EngineConfig {
            num_blocks,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

pub fn seq(id: u64, tokens: &[u32], start_pos: usize, table: &[BlockId], sample: bool) -> StepSeq {
    StepSeq {
        seq_id: SeqId(id),
        tokens: tokens.to_vec(),
        start_pos,
        block_table: table.to_vec(),
        sampling: SamplingParams::default(),
        sample,
    }
}

pub fn blocks(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

/// Prefills `prompt` in one chunk, returns (step-0 logits, greedy ids up to `n` or EOS).
pub fn greedy(engine: &mut Engine, prompt: &[u32], n: usize, eos: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let table = blocks(0..((prompt.len() + n) / 16 + 1) as u32);
    let batch = StepBatch {
        seqs: vec![seq(1, prompt, 0, &table, true)],
    };
    let logits = engine.logits(&batch).expect("prefill").remove(0);
    let mut out = vec![flotilla::kernels::sample::argmax(&logits)];
    let mut pos = prompt.len();
    while out.len() < n && !eos.contains(out.last().expect("nonempty")) {
        let last = *out.last().expect("nonempty");
        let b = StepBatch {
            seqs: vec![seq(1, &[last], pos, &table, true)],
        };
        let o = engine.step(&b).expect("decode");
        out.push(o.tokens[0].token);
        pos += 1;
    }
    (logits, out)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}
