//! Sessions that stick on a simulated fleet (`flotilla up --engine sim`):
//! two gateway + router nodes over four workers. The turns of a session keyed by
//! `x-session-id` land on one worker whichever gateway (and so router replica) places them,
//! where requests without a key spread; a session whose worker saturates (its queued prefill
//! tokens past `router.session_max_queued_tokens`, here while a slowed engine holds a long
//! turn) is released to another worker and sticks there; bad session keys (headers, and the
//! body's `user` / `metadata.user_id` with `gateway.session_from_user`) are refused with a 400
//! naming them on all three generation routes, and reach no router. Workers are read from the
//! routers' `placed` lines (JSON logs), which say `session=kept|released|none`.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::{Gateway, MODEL, fleet};
use crate::poll::poll_until;
use crate::process::{Cluster, Logs};
use serde_json::{Value, json};
use std::time::Duration;

/// A session's worker keeps it while fewer prompt tokens than this wait there: short turns
/// (~20 tokens) never reach it, the long turn (~600) does.
const MAX_QUEUED: u64 = 200;

/// The `placed` line of request `id`: (worker, session field).
fn placed(logs: &Logs, id: &str) -> Option<(String, Option<String>)> {
    logs.all()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| {
            v["target"] == "flotilla::placement"
                && v["fields"]["message"] == "placed"
                && v["fields"]["request_id"] == id
        })
        .map(|v| {
            (
                v["fields"]["worker"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                v["fields"]["session"].as_str().map(str::to_owned),
            )
        })
}

async fn placed_soon(logs: &Logs, id: &str) -> (String, Option<String>) {
    poll_until(Duration::from_secs(30), "the placed line", || async {
        placed(logs, id)
    })
    .await
}

/// A completion of `prompt` through `base`, with `x-request-id: id` and the session header.
async fn complete(
    base: &str,
    id: &str,
    session: Option<&str>,
    prompt: &str,
    max_tokens: u32,
) -> u16 {
    let mut r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("x-request-id", id)
        .timeout(Duration::from_secs(120));
    if let Some(s) = session {
        r = r.header("x-session-id", s);
    }
    let r = r
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let _ = r.text().await;
    status
}

/// A request with a bad session key: route, body, headers, the header or field its 400 names.
type BadKey = (
    &'static str,
    Value,
    Vec<(&'static str, Vec<u8>)>,
    &'static str,
);

/// The up gateways' URLs.
async fn gateways(c: &impl Gateway) -> Vec<String> {
    fleet(c).await["gateways"]
        .as_array()
        .expect("/v1/fleet lists its gateways")
        .iter()
        .filter(|g| g["state"] == "up")
        .map(|g| g["url"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_turns_stick_until_its_worker_saturates_and_bad_keys_are_refused() {
    let max = format!("router.session_max_queued_tokens={MAX_QUEUED}");
    let (c, logs) = Cluster::start_logged(
        3,
        &[
            "--engine",
            "sim",
            "--gateways",
            "2",
            "--chaos",
            "--log-format",
            "json",
        ],
        &[&max, "worker.replicas=2", "gateway.session_from_user=true"],
        &[("FLOTILLA_LOG", "info,ractor_cluster=error,ractor=warn")],
    );
    http::wait_routable(&c, 4).await;
    let gws = gateways(&c).await;
    assert_eq!(gws.len(), 2, "{gws:?}");

    // 1. Eight turns of one session, alternating gateways (so router replicas), each prompt
    // unrelated to the others (no shared prefix for the KV cost to follow): one worker.
    let mut workers = Vec::new();
    for t in 0..8 {
        let id = format!("sticky-{t}");
        let prompt = format!(
            "turn {t}: {} tell me about topic number {}",
            t * 7919,
            t * 31
        );
        assert_eq!(
            complete(&gws[t % 2], &id, Some("sess-a"), &prompt, 4).await,
            200
        );
        let (w, session) = placed_soon(&logs, &id).await;
        let want = if t == 0 { "none" } else { "kept" };
        assert_eq!(session.as_deref(), Some(want), "turn {t}");
        workers.push(w);
    }
    assert!(
        workers.iter().all(|w| *w == workers[0]),
        "every turn on one worker: {workers:?}"
    );
    // Requests like them without a key (other texts: the session's worker caches those) are
    // spread by the cost's rotating ties.
    let mut spread = std::collections::BTreeSet::new();
    for t in 0..8 {
        let id = format!("plain-{t}");
        let prompt = format!(
            "plain {t}: {} write about subject number {}",
            t * 7919,
            t * 31
        );
        assert_eq!(complete(&gws[t % 2], &id, None, &prompt, 4).await, 200);
        let (w, session) = placed_soon(&logs, &id).await;
        assert_eq!(session, None, "no key, no session field");
        spread.insert(w);
    }
    assert!(spread.len() >= 2, "without a key: {spread:?}");

    // 2. Saturation: the session's worker is slowed (3 s a step) and given a long turn of the
    // session (~600 prompt tokens, more than MAX_QUEUED), which waits there for its first
    // token; the next turn, placed by the other router replica, is released to another
    // worker, and the session then sticks to that one.
    let home = workers[0].clone();
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "slow", "delay_ms": 3000, "target": {"worker": home}, "duration_ms": 15000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let long: String = (0..300).map(|i| format!("w{i} ")).collect();
    let (a, b) = (gws[0].clone(), gws[1].clone());
    let long_turn =
        tokio::spawn(async move { complete(&a, "long-turn", Some("sess-a"), &long, 1).await });
    let (w, session) = placed_soon(&logs, "long-turn").await;
    assert_eq!(
        (w.as_str(), session.as_deref()),
        (home.as_str(), Some("kept"))
    );
    // Router b counts the long turn's queued tokens once router a tells it (one hop).
    let mut released = None;
    for k in 0..20 {
        let id = format!("after-{k}");
        assert_eq!(
            complete(&b, &id, Some("sess-a"), "a short turn", 2).await,
            200
        );
        let (w, session) = placed_soon(&logs, &id).await;
        if session.as_deref() == Some("released") {
            assert_ne!(w, home);
            released = Some((k, w));
            break;
        }
        // Not heard yet: it stuck (the slowed worker serves it, 3 s a step).
        assert_eq!(
            (w.as_str(), session.as_deref()),
            (home.as_str(), Some("kept"))
        );
    }
    let (k, moved_to) = released.expect("the saturated worker released the session");
    let id = format!("after-{}", k + 1);
    assert_eq!(
        complete(&gws[0], &id, Some("sess-a"), "another short turn", 2).await,
        200
    );
    assert_eq!(
        placed_soon(&logs, &id).await,
        (moved_to, Some("kept".into()))
    );
    assert_eq!(long_turn.await.unwrap(), 200);

    // 3. Bad keys: 400 naming the header or field, in each route's error shape; no placement.
    let client = reqwest::Client::new();
    let long_key = "k".repeat(257);
    let bad: Vec<BadKey> = vec![
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "hi", "max_tokens": 1}),
            vec![("x-session-id", long_key.clone().into_bytes())],
            "x-session-id",
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
            vec![("x-claude-code-session-id", b"has space".to_vec())],
            "x-claude-code-session-id",
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
            vec![("session_id", "é".as_bytes().to_vec())],
            "session_id",
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
            vec![("x-session-id", long_key.clone().into_bytes())],
            "x-session-id",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": long_key}),
            vec![],
            "user",
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": "with space"}}),
            vec![],
            "metadata.user_id",
        ),
    ];
    for (i, (path, body, headers, named)) in bad.into_iter().enumerate() {
        let id = format!("bad-{i}");
        let mut r = client
            .post(c.url(path))
            .header("x-request-id", &id)
            .json(&body);
        for (h, v) in headers {
            r = r.header(h, reqwest::header::HeaderValue::from_bytes(&v).unwrap());
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 400, "{path} {named}");
        let v: Value = r.json().await.unwrap();
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(named), "{path}: {v}");
        if path == "/v1/messages" {
            assert_eq!(v["type"], "error", "Anthropic's shape: {v}");
            assert_eq!(v["error"]["type"], "invalid_request_error");
        } else {
            assert_eq!(v["error"]["param"], named, "OpenAI's shape: {v}");
        }
    }
    // A good key through `user` is a session key too.
    let r = client
        .post(c.url("/v1/completions"))
        .header("x-request-id", "by-user")
        .json(&json!({"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": "user-7"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        placed_soon(&logs, "by-user").await.1.as_deref(),
        Some("none")
    );
    for i in 0..6 {
        assert_eq!(
            placed(&logs, &format!("bad-{i}")),
            None,
            "bad-{i} reached a router"
        );
    }
}
