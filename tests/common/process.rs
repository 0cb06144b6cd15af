//! Clusters of node processes (`flotilla up`), their logs, and signals to single nodes.
//! Needs `http`.
#![allow(dead_code, reason = "each binary that starts processes uses a subset")]

use super::http::{Gateway, fleet};
use std::time::Duration;

/// A `flotilla up` cluster on loopback for a test; stopped (SIGTERM, then SIGKILL) on drop.
pub struct Cluster {
    /// The `flotilla up` process.
    pub child: std::process::Child,
    /// Gateway base URL.
    pub gateway: String,
}

impl Gateway for Cluster {
    fn gateway(&self) -> &str {
        &self.gateway
    }
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
        Gateway::url(self, path)
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

/// Run `tests/<client>_client/check.py` (the official `<client>` Python client, installed in
/// `.venv` by `make venv`) against a 2-node cluster serving `model`; it must exit 0 and print
/// `<client> client checks passed`.
pub fn run_client_check(client: &str, model: &str) {
    let root = env!("CARGO_MANIFEST_DIR");
    let python = format!("{root}/.venv/bin/python");
    assert!(
        std::path::Path::new(&python).exists(),
        "{python} is missing: run `make venv` (make test does it) to install the {client} client"
    );
    let c = Cluster::start(2, &["worker.kv_blocks=128"]);
    let out = std::process::Command::new(&python)
        .arg(format!("{root}/tests/{client}_client/check.py"))
        .args([&c.gateway, model])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{client} client checks failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("{client} client checks passed")),
        "{stdout}"
    );
}
