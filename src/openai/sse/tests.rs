use serde_json::json;

use super::*;
use crate::openai::error::ErrorKind;

#[test]
fn data_record_is_one_line() {
    let rec = data(&json!({"id": "x", "text": "a\nb\r\n\n"}));
    assert_eq!(rec, "data: {\"id\":\"x\",\"text\":\"a\\nb\\r\\n\\n\"}\n\n");
    assert!(rec.starts_with("data: {"));
    assert_eq!(rec.matches('\n').count(), 2);
    let back: serde_json::Value =
        serde_json::from_str(&rec["data: ".len()..rec.len() - 2]).unwrap();
    assert_eq!(back["text"], "a\nb\r\n\n");
}

#[test]
fn constants() {
    assert_eq!(DONE, "data: [DONE]\n\n");
    assert_eq!(KEEP_ALIVE, ": keep-alive\n\n");
    assert!(KEEP_ALIVE.starts_with(':'));
    assert_eq!(CONTENT_TYPE, "text/event-stream");
}

#[test]
fn error_record() {
    let e = ApiError::new(ErrorKind::Internal, "engine failed").code("engine_error");
    assert_eq!(
        error(&e),
        "data: {\"error\":{\"message\":\"engine failed\",\"type\":\"internal_error\",\
         \"param\":null,\"code\":\"engine_error\"}}\n\n"
    );
}
