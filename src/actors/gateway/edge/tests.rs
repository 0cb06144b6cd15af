use super::*;
use axum::http::HeaderValue;

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, HeaderValue::from_str(v).unwrap());
    }
    h
}

const LOOPBACK: ControlPolicy = ControlPolicy {
    http_addr: SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 8080),
    token_set: false,
};

#[test]
fn json_content_types() {
    for ok in [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/vnd.api+json",
    ] {
        assert!(
            require_json(&headers(&[("content-type", ok)])).is_ok(),
            "{ok}"
        );
    }
    for bad in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
        "",
    ] {
        let e = require_json(&headers(&[("content-type", bad)])).unwrap_err();
        assert_eq!(e.status().as_u16(), 415, "{bad}");
        assert_eq!(e.type_str(), "invalid_request_error");
    }
    let e = require_json(&HeaderMap::new()).unwrap_err();
    assert_eq!(e.status().as_u16(), 415);
    assert!(e.message.contains("none"), "{}", e.message);
}

/// JSON is UTF-8: another declared charset would be read wrongly, so it is refused by name.
#[test]
fn json_charsets_other_than_utf8_are_refused_by_name() {
    for ok in [
        "application/json; charset=UTF-8",
        "application/json;charset=\"utf-8\"",
        "application/json; foo=bar",
    ] {
        assert!(
            require_json(&headers(&[("content-type", ok)])).is_ok(),
            "{ok}"
        );
    }
    for (bad, named) in [
        ("application/json; charset=utf-16", "'utf-16'"),
        ("application/json; Charset=\"ISO-8859-1\"", "'iso-8859-1'"),
    ] {
        let e = require_json(&headers(&[("content-type", bad)])).unwrap_err();
        assert_eq!(e.status().as_u16(), 415, "{bad}");
        assert!(e.message.contains(named), "{}", e.message);
    }
}

#[test]
fn hosts() {
    let lo = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    for h in ["localhost", "127.0.0.1", "127.1.2.3", "[::1]", "localhost."] {
        assert!(host_allowed(h, lo), "{h}");
    }
    for h in [
        "elsewhere.example",
        "10.0.0.1",
        "[::2]",
        "localhost.evil.example",
        "",
    ] {
        assert!(!host_allowed(h, lo), "{h}");
    }
    let lan: IpAddr = "10.0.0.7".parse().unwrap();
    assert!(host_allowed("10.0.0.7", lan));
    assert!(!host_allowed("0.0.0.0", "0.0.0.0".parse().unwrap()));
    assert_eq!(host_of("LocalHost:8080"), "localhost");
    assert_eq!(host_of("[::1]:80"), "[::1]");
    assert_eq!(host_of("elsewhere.example"), "elsewhere.example");
}

#[test]
fn control_api_refuses_rebinding_and_foreign_origins() {
    // A foreign Host, with or without a port (DNS rebinding).
    for host in ["elsewhere.example:8080", "elsewhere.example"] {
        let e = check_control(&headers(&[("host", host)]), LOOPBACK).unwrap_err();
        assert_eq!(e.status().as_u16(), 403);
        assert_eq!(e.code.as_deref(), Some("forbidden_host"));
    }
    // No Host at all.
    assert!(check_control(&HeaderMap::new(), LOOPBACK).is_err());
    // A foreign Origin, even with a proper Host.
    for origin in [
        "http://elsewhere.example",
        "null",
        "file://",
        "http://127.0.0.1.evil.example",
    ] {
        let h = headers(&[("host", "127.0.0.1:8080"), ("origin", origin)]);
        let e = check_control(&h, LOOPBACK).unwrap_err();
        assert_eq!(e.code.as_deref(), Some("forbidden_origin"), "{origin}");
    }
    // Own origins and hosts pass.
    for (host, origin) in [
        ("127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("localhost:8080", "http://localhost:8080"),
        ("[::1]:8080", "https://[::1]:8080/"),
    ] {
        let h = headers(&[("host", host), ("origin", origin)]);
        assert!(check_control(&h, LOOPBACK).is_ok(), "{host} {origin}");
    }
    // With a token the Host is not checked (the token is the guard); the Origin still is.
    let tok = ControlPolicy {
        token_set: true,
        ..LOOPBACK
    };
    assert!(check_control(&headers(&[("host", "gw.example:80")]), tok).is_ok());
    let h = headers(&[("host", "gw.example"), ("origin", "http://other.example")]);
    assert!(check_control(&h, tok).is_err());
}

#[test]
fn request_ids_are_bounded() {
    assert!(request_id_ok(&HeaderValue::from_static("abc-123")));
    let long = "x".repeat(MAX_REQUEST_ID_LEN);
    assert!(request_id_ok(&HeaderValue::from_str(&long).unwrap()));
    let longer = "x".repeat(MAX_REQUEST_ID_LEN + 1);
    assert!(!request_id_ok(&HeaderValue::from_str(&longer).unwrap()));
    assert!(!request_id_ok(&HeaderValue::from_static("")));
    assert!(!request_id_ok(&HeaderValue::from_static("a b")));
    assert!(!request_id_ok(
        &HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap()
    ));
}
