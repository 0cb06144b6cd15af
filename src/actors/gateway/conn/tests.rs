use super::*;

#[test]
fn the_over_cap_answer_is_a_well_formed_503_in_the_openai_shape() {
    let r = over_cap();
    let (head, body) = r.split_once("\r\n\r\n").expect("head and body");
    assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
    assert!(head.contains("\r\nconnection: close"), "{head}");
    assert!(head.contains("\r\nretry-after: 1"), "{head}");
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.parse().ok())
        .expect("content-length");
    assert_eq!(len, body.len());
    let v: serde_json::Value = serde_json::from_str(body).expect("JSON body");
    assert_eq!(v["error"]["code"], "too_many_connections");
    assert_eq!(v["error"]["type"], "service_unavailable");
}

#[test]
fn limits_come_from_the_gateway_config() {
    let g = crate::request_plane::gateway::GatewayConfig {
        request_header_timeout_ms: 1_500,
        idle_timeout_ms: 2_500,
        max_connections: 7,
        ..Default::default()
    };
    let l = ConnLimits::from(&g);
    assert_eq!(l.header_timeout, Duration::from_millis(1_500));
    assert_eq!(l.idle_timeout, Duration::from_millis(2_500));
    assert_eq!(l.max_connections, 7);
    let d = crate::request_plane::gateway::GatewayConfig::default();
    for ms in [
        d.request_header_timeout_ms,
        d.request_body_timeout_ms,
        d.idle_timeout_ms,
    ] {
        assert!((1..=60_000).contains(&ms), "defaults are at most 60 s");
    }
}
