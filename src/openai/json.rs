//! Typed reads of JSON request fields that fail with an OpenAI-shaped [`ApiError`] naming the
//! offending field (`param`). `null` is read as "absent" everywhere, as the OpenAI API does.
//!
//! Message style (pinned by the request tests): `"<param> must be <what>, got <found>"`, for
//! example `"max_tokens must be at least 1, got 0"` or `"max_tokens must be an integer, got string"`.

use serde_json::{Map, Value};

use crate::openai::error::{ApiError, ErrorKind};

/// A JSON object.
pub(crate) type Obj = Map<String, Value>;

/// Longest user-supplied string echoed back inside an error message, in chars.
const ECHO_MAX_CHARS: usize = 256;

/// A 400 `invalid_request_error` naming `param`.
pub(crate) fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, message).param(param)
}

/// `s` cut to a length that is safe to echo in an error message.
pub(crate) fn clip(s: &str) -> String {
    match s.char_indices().nth(ECHO_MAX_CHARS) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_owned(),
    }
}

/// JSON type name of `v`, for messages.
pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// How a value is described after "got": numbers and booleans verbatim, others by type.
pub(crate) fn describe(v: &Value) -> String {
    match v {
        Value::Number(_) | Value::Bool(_) => clip(&v.to_string()),
        _ => type_name(v).to_owned(),
    }
}

/// `key` of `obj`, with `null` read as absent.
pub(crate) fn field<'a>(obj: &'a Obj, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// Whether `v` is the "not set" value of an optional feature: null, false, "", [] or {}.
pub(crate) fn is_unset(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Bool(true) | Value::Number(_) => false,
    }
}

/// `v` as a boolean.
pub(crate) fn as_bool(v: &Value, param: &str) -> Result<bool, ApiError> {
    v.as_bool().ok_or_else(|| {
        invalid(
            param,
            format!("{param} must be a boolean, got {}", describe(v)),
        )
    })
}

/// `v` as a string.
pub(crate) fn as_str<'a>(v: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    v.as_str().ok_or_else(|| {
        invalid(
            param,
            format!("{param} must be a string, got {}", describe(v)),
        )
    })
}

/// `v` as an integer in `min..=max`. Integral floats (`10.0`) are accepted, `10.5` is not.
pub(crate) fn as_int(v: &Value, param: &str, min: i128, max: i128) -> Result<i128, ApiError> {
    let n = if let Some(i) = v.as_i64() {
        i128::from(i)
    } else if let Some(u) = v.as_u64() {
        i128::from(u)
    } else {
        match v.as_f64() {
            // `as` saturates; anything that large fails the range check below anyway.
            Some(f) if f.fract() == 0.0 => f as i128,
            _ => {
                let msg = format!("{param} must be an integer, got {}", describe(v));
                return Err(invalid(param, msg));
            }
        }
    };
    if n < min {
        return Err(invalid(
            param,
            format!("{param} must be at least {min}, got {}", describe(v)),
        ));
    }
    if n > max {
        return Err(invalid(
            param,
            format!("{param} must be at most {max}, got {}", describe(v)),
        ));
    }
    Ok(n)
}

/// `v` as a number in `min..=max`.
pub(crate) fn as_number(v: &Value, param: &str, min: f64, max: f64) -> Result<f64, ApiError> {
    let x = v.as_f64().ok_or_else(|| {
        invalid(
            param,
            format!("{param} must be a number, got {}", describe(v)),
        )
    })?;
    if !(min..=max).contains(&x) {
        let msg = format!(
            "{param} must be between {min} and {max}, got {}",
            describe(v)
        );
        return Err(invalid(param, msg));
    }
    Ok(x)
}

/// Optional boolean field `key`.
pub(crate) fn get_bool(obj: &Obj, key: &str) -> Result<Option<bool>, ApiError> {
    field(obj, key).map(|v| as_bool(v, key)).transpose()
}

/// Optional string field `key`.
pub(crate) fn get_str<'a>(obj: &'a Obj, key: &str) -> Result<Option<&'a str>, ApiError> {
    field(obj, key).map(|v| as_str(v, key)).transpose()
}

/// Optional integer field `key` in `min..=max`.
pub(crate) fn get_int(
    obj: &Obj,
    key: &str,
    min: i128,
    max: i128,
) -> Result<Option<i128>, ApiError> {
    field(obj, key)
        .map(|v| as_int(v, key, min, max))
        .transpose()
}

/// Optional number field `key` in `min..=max`.
pub(crate) fn get_number(
    obj: &Obj,
    key: &str,
    min: f64,
    max: f64,
) -> Result<Option<f64>, ApiError> {
    field(obj, key)
        .map(|v| as_number(v, key, min, max))
        .transpose()
}
