//! Cases B01–B05 and B23 (a list of prompts) through the official `openai` Python client,
//! against a real cluster.
//! `make test` installs the client into `.venv` (`make venv`); without it this test fails and
//! says so.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{http::MODEL, process::Cluster};

#[test]
fn the_official_openai_client_is_happy() {
    let root = env!("CARGO_MANIFEST_DIR");
    let python = format!("{root}/.venv/bin/python");
    assert!(
        std::path::Path::new(&python).exists(),
        "{python} is missing: run `make venv` (make test does it) to install the openai client"
    );
    let c = Cluster::start(2, &["worker.kv_blocks=128"]);
    let out = std::process::Command::new(&python)
        .arg(format!("{root}/tests/openai_client/check.py"))
        .args([&c.gateway, MODEL])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client checks failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("openai client checks passed"), "{stdout}");
}
