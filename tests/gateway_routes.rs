//! The gateway's routes without a socket (`routes::app` driven by `tower::ServiceExt`).

use axum::body::Body;
use axum::http::{Request, StatusCode};
use flotilla::actors::gateway::routes::{GatewayShared, app};
use std::sync::Arc;
use tower::ServiceExt;

fn shared(discovery_name: &str) -> Arc<GatewayShared> {
    Arc::new(GatewayShared {
        discovery_name: discovery_name.into(),
        metrics: flotilla::runtime::metrics::handle(),
        max_body_bytes: 4096,
        request_body_timeout: std::time::Duration::from_secs(5),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        serving: None,
        chaos: None,
        stats: Default::default(),
        fleet: Default::default(),
        prefill_queues: Default::default(),
        face: None,
        bus: Default::default(),
        page_history: Default::default(),
    })
}

async fn call(app: axum::Router, req: Request<Body>) -> (StatusCode, String, Option<String>) {
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status();
    let ctype = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap(), ctype)
}

#[tokio::test]
async fn live_is_always_ok() {
    let (s, body, _) = call(
        app(shared("x")),
        Request::get("/live").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert!(body.contains("alive"));
}

#[tokio::test]
async fn unknown_routes_get_an_openai_404() {
    let (s, body, ctype) = call(
        app(shared("x")),
        Request::get("/nope").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(ctype.as_deref(), Some("application/json"));
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("/nope"));
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"].get("param").is_some() && v["error"].get("code").is_some());
}

#[tokio::test]
async fn health_and_fleet_are_503_without_membership() {
    // No Discovery actor of that name runs in this process.
    let (s, body, _) = call(
        app(shared("ghost/discovery")),
        Request::get("/health").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "service_unavailable");
    let (s, _, _) = call(
        app(shared("ghost/discovery")),
        Request::get("/v1/fleet").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn metrics_render_prometheus_text() {
    let s = shared("x");
    metrics::counter!("flotilla_test_probe_total").increment(1);
    let (s, body, ctype) = call(
        app(s),
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert!(ctype.unwrap().starts_with("text/plain"));
    assert!(body.contains("flotilla_test_probe_total 1"), "{body}");
}

/// `GET /v1/fleet/events` streams what the node's actors say on its event bus, one SSE record
/// per event, from the moment the client subscribed.
#[tokio::test]
async fn fleet_events_stream_what_the_bus_says() {
    use flotilla::request_plane::events::FleetEventKind;
    use flotilla::runtime::ids::WorkerId;
    use http_body_util::BodyExt;
    let s = shared("no-discovery");
    let bus = s.bus.clone();
    let resp = app(s)
        .oneshot(
            Request::get("/v1/fleet/events")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    bus.emit(FleetEventKind::WorkerUp {
        worker: WorkerId::new("n/replica-0"),
    });
    let mut body = resp.into_body();
    let frame = tokio::time::timeout(std::time::Duration::from_secs(5), body.frame())
        .await
        .expect("an event within 5 s")
        .expect("a frame")
        .expect("no error");
    let text = String::from_utf8(frame.into_data().expect("data").to_vec()).unwrap();
    assert!(text.starts_with("data: {"), "{text}");
    let v: serde_json::Value =
        serde_json::from_str(text.trim().trim_start_matches("data: ")).unwrap();
    assert_eq!(v["event"], "worker_up");
    assert_eq!(v["worker"], "n/replica-0");
    assert!(v["at_ms"].as_u64().is_some_and(|t| t > 0));
}
