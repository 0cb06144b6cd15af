//! Case B24 through the official `anthropic` Python client, against a real cluster.
//! `make test` installs the client into `.venv` (`make venv`); without it this test fails and
//! says so.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{http::MODEL, process::run_client_check};

#[test]
fn the_official_anthropic_client_is_happy() {
    run_client_check("anthropic", MODEL);
}
