//! Reading server-sent event bodies.
#![allow(dead_code, reason = "each binary that reads SSE uses a subset")]

/// Parse an SSE body into its data records (JSON values; `[DONE]` as the string "[DONE]"),
/// checking the framing: every record is `data: <payload>` followed by a blank line, or a
/// comment line starting with `:`.
pub fn sse_records(body: &str) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for block in body.split("\n\n") {
        if block.is_empty() {
            continue;
        }
        if block.starts_with(':') {
            continue;
        }
        let payload = block
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("record is not `data: `: {block:?}"));
        assert!(!payload.contains('\n'), "multi-line record: {block:?}");
        if payload == "[DONE]" {
            out.push(serde_json::Value::String("[DONE]".into()));
        } else {
            out.push(
                serde_json::from_str(payload)
                    .unwrap_or_else(|e| panic!("bad JSON {payload:?}: {e}")),
            );
        }
    }
    out
}

/// Joined text of a stream's chunks (chat deltas or completion texts) for choice `index`.
pub fn joined_text(records: &[serde_json::Value], index: u64) -> String {
    let mut s = String::new();
    for r in records {
        for c in r["choices"].as_array().into_iter().flatten() {
            if c["index"].as_u64() == Some(index) {
                if let Some(t) = c["delta"]["content"].as_str() {
                    s.push_str(t);
                }
                if let Some(t) = c["text"].as_str() {
                    s.push_str(t);
                }
            }
        }
    }
    s
}
