//! `flotilla up` fails fast and plainly when the cluster cannot start: a missing model is
//! found before any node starts; a node that dies during start-up (its HTTP port taken) ends
//! `up` at once with a non-zero exit, not after the 90 s formation timeout.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Far below `launcher::FORM_TIMEOUT` (90 s), with room for a busy 2-core machine.
const FAST: Duration = Duration::from_secs(15);

/// Run `flotilla up ARGS` until it exits (killed after 60 s): exit status, its stderr, and
/// how long it ran.
fn up(args: &[&str]) -> (std::process::ExitStatus, String, Duration) {
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("up")
        .args(args)
        .env_remove("FLOTILLA_MODEL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("flotilla up starts");
    let mut err = child.stderr.take().expect("stderr piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("flotilla up {args:?} still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = t0.elapsed();
    (status, reader.join().expect("stderr reader"), took)
}

#[test]
fn a_missing_model_fails_at_once_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("no-such-model.gguf");
    let m = model.to_str().unwrap();
    let (status, stderr, took) = up(&["--nodes", "3", "--http", "127.0.0.1:0", "--model", m]);
    assert!(!status.success(), "{status}\n{stderr}");
    assert!(took < FAST, "took {took:?}\n{stderr}");
    assert_eq!(stderr.matches(m).count(), 1, "the error, once:\n{stderr}");
    assert!(
        !stderr.contains("make model"),
        "a user's own path gets no `make model` hint:\n{stderr}"
    );
}

#[test]
fn a_taken_http_port_fails_fast_naming_the_port() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (status, stderr, took) = up(&["--nodes", "2", "--http", &addr]);
    assert!(!status.success(), "{status}\n{stderr}");
    assert!(took < FAST, "took {took:?}\n{stderr}");
    assert!(stderr.contains(&addr), "the error names {addr}:\n{stderr}");
    assert!(!stderr.contains("panicked"), "no panic happened:\n{stderr}");
    assert!(
        stderr.contains("node-0 exited during start-up"),
        "up says which node died:\n{stderr}"
    );
    drop(taken);
}

/// `worker.backend = "cuda"` where CUDA cannot be used: the worker nodes refuse to start and
/// say what is missing (here, no driver); `up` exits non-zero.
#[test]
fn a_cuda_backend_without_cuda_fails_naming_what_is_missing() {
    if flotilla::kernels::cuda::probe().driver {
        eprintln!("skipped: a CUDA driver loads here");
        return;
    }
    let (status, stderr, _) = up(&[
        "--nodes",
        "2",
        "--http",
        "127.0.0.1:0",
        "--set",
        "worker.backend=cuda",
    ]);
    assert!(!status.success(), "{status}\n{stderr}");
    assert!(
        stderr.contains("worker.backend: backend cuda asked for, but cannot load libcuda"),
        "the error says why:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "no panic happened:\n{stderr}");
}

/// A node whose KV transport port is taken exits with the "port taken" status, and `up`
/// starts the cluster again on other ports: here the port is forced (`--set` wins over the
/// picked one), so every start fails the same way and `up` gives up after its last start,
/// saying so.
#[test]
fn a_taken_node_port_starts_the_cluster_again_then_gives_up() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let bind = format!("transport.tcp_bind={addr}");
    let (status, stderr, took) = up(&["--nodes", "2", "--http", "127.0.0.1:0", "--set", &bind]);
    assert!(!status.success(), "{status}\n{stderr}");
    assert!(took < FAST * 3, "took {took:?}\n{stderr}");
    assert!(
        stderr.contains(&format!("tcp transport: cannot listen on {addr}")),
        "the node names the port:\n{stderr}"
    );
    let again = flotilla::cli::up::PORT_ATTEMPTS - 1;
    assert_eq!(
        stderr
            .matches("starting the cluster again on other ports")
            .count(),
        again,
        "{again} more starts:\n{stderr}"
    );
    assert!(
        stderr.contains(&format!("in {} starts", flotilla::cli::up::PORT_ATTEMPTS)),
        "up says it gave up:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "no panic happened:\n{stderr}");
    drop(taken);
}
