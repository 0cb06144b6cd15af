use std::convert::Infallible;
use std::time::Duration;

use axum::response::IntoResponse;
use axum::response::sse::{Event, Sse};
use serde_json::json;

use super::*;
use crate::openai::error::ErrorKind;

/// The bytes and headers axum's `Sse` writes for `events`.
async fn wire(events: Vec<Event>) -> (String, axum::http::HeaderMap) {
    let stream = futures::stream::iter(events.into_iter().map(Ok::<_, Infallible>));
    let resp = Sse::new(stream).into_response();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (String::from_utf8(body.to_vec()).unwrap(), headers)
}

#[tokio::test]
async fn data_record_is_one_line() {
    let (rec, _) = wire(vec![data(&json!({"id": "x", "text": "a\nb\r\n\n"}))]).await;
    assert_eq!(rec, "data: {\"id\":\"x\",\"text\":\"a\\nb\\r\\n\\n\"}\n\n");
    assert!(rec.starts_with("data: {"));
    assert_eq!(rec.matches('\n').count(), 2);
    let back: serde_json::Value =
        serde_json::from_str(&rec["data: ".len()..rec.len() - 2]).unwrap();
    assert_eq!(back["text"], "a\nb\r\n\n");
}

#[tokio::test]
async fn done_and_headers() {
    let (body, headers) = wire(vec![done()]).await;
    assert_eq!(body, "data: [DONE]\n\n");
    assert_eq!(headers["content-type"], "text/event-stream");
    assert_eq!(headers["cache-control"], "no-cache");
}

#[tokio::test(start_paused = true)]
async fn keep_alive_comment() {
    let stream = futures::stream::pending::<Result<Event, Infallible>>();
    let resp = Sse::new(stream)
        .keep_alive(keep_alive(Duration::from_millis(300)))
        .into_response();
    let mut body = resp.into_body().into_data_stream();
    let first = futures::StreamExt::next(&mut body).await.unwrap().unwrap();
    assert_eq!(&first[..], b": keep-alive\n\n");
    assert!(first.starts_with(b":"));
}

#[tokio::test]
async fn error_record() {
    let e = ApiError::new(ErrorKind::Internal, "engine failed").code("engine_error");
    let (rec, _) = wire(vec![error(&e)]).await;
    assert_eq!(
        rec,
        "data: {\"error\":{\"message\":\"engine failed\",\"type\":\"internal_error\",\
         \"param\":null,\"code\":\"engine_error\"}}\n\n"
    );
}
