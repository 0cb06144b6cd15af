use super::*;

#[test]
fn each_kind_has_anthropics_status_and_type() {
    let cases = [
        (ErrorKind::InvalidRequest, 400, "invalid_request_error"),
        (ErrorKind::NotFound, 404, "not_found_error"),
        (ErrorKind::PayloadTooLarge, 413, "request_too_large"),
        (ErrorKind::RateLimited, 429, "rate_limit_error"),
        (ErrorKind::Unavailable, 529, "overloaded_error"),
        (ErrorKind::Internal, 500, "api_error"),
        (
            ErrorKind::UnsupportedMediaType,
            415,
            "invalid_request_error",
        ),
    ];
    for (kind, code, ty) in cases {
        let e = ApiError::new(kind, "m");
        assert_eq!(status(&e).as_u16(), code, "{kind:?}");
        assert_eq!(error_type(&e), ty, "{kind:?}");
    }
}

#[test]
fn the_body_is_anthropics_error_object_with_retry_after() {
    let mut e = ApiError::new(
        ErrorKind::Unavailable,
        "every worker is busy; retry shortly",
    );
    e.retry_after_s = Some(2);
    assert_eq!(
        body(&e),
        json!({"type": "error", "error": {"type": "overloaded_error",
               "message": "every worker is busy; retry shortly"}})
    );
    let r = response(&e);
    assert_eq!(r.status().as_u16(), 529);
    assert_eq!(r.headers()["retry-after"], "2");
}
