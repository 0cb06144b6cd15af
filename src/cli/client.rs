//! A small client of Flotilla's own OpenAI routes, for the tools that drive load at a gateway
//! (`flotilla chaos soak`, `flotilla bench`): sends one chat completion or completion with
//! `stream: true` and reads the SSE stream record by record, keeping what a checker needs — the
//! response ids, the joined text, the finish reason, whether `[DONE]` came, an error record if
//! any, the usage counts, and when each content chunk arrived.

use futures::StreamExt;
use std::time::{Duration, Instant};

/// What one streamed request produced.
#[derive(Debug, Clone, Default)]
pub struct StreamOutcome {
    /// HTTP status.
    pub status: u16,
    /// Distinct `id`s seen across chunks (one for a sound stream).
    pub ids: Vec<String>,
    /// Joined `delta.content`.
    pub text: String,
    /// Role deltas seen.
    pub role_deltas: usize,
    /// Finish reasons seen (one for a sound stream).
    pub finish_reasons: Vec<String>,
    /// `data: [DONE]` arrived.
    pub done: bool,
    /// The `error` object of an error record, or the body of a non-200 answer.
    pub error: Option<serde_json::Value>,
    /// `usage.completion_tokens` of the final chunk, if usage was asked for.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens` of the final chunk, if usage was asked for.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens` of the final chunk (prompt tokens served
    /// from a prefix cache), if usage was asked for and the server reports it.
    pub cached_tokens: Option<u64>,
    /// Time from send to the first content chunk.
    pub ttft: Option<Duration>,
    /// Arrival time of every content chunk, from send.
    pub chunk_times: Vec<Duration>,
    /// Send → end of stream.
    pub e2e: Duration,
}

impl StreamOutcome {
    /// 200, one id, one finish reason, `[DONE]`, no error record.
    pub fn is_complete(&self) -> bool {
        self.status == 200
            && self.ids.len() == 1
            && self.finish_reasons.len() == 1
            && self.done
            && self.error.is_none()
    }

    /// The longest gap between consecutive content chunks.
    pub fn max_gap(&self) -> Duration {
        self.chunk_times
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .max()
            .unwrap_or_default()
    }
}

/// Which OpenAI route a streamed request goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/chat/completions` (`messages`; content in `choices[].delta.content`).
    Chat,
    /// `POST /v1/completions` (`prompt`, a string or token ids; content in `choices[].text`).
    Completions,
}

impl Route {
    /// The route's path.
    pub fn path(self) -> &'static str {
        match self {
            Route::Chat => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
        }
    }
}

/// POST `body` (a chat completion request; `stream` is forced on, usage asked for) to
/// `{base}/v1/chat/completions` and read the whole stream.
///
/// # Errors
/// See [`stream_request`].
pub async fn stream_chat(
    client: &reqwest::Client,
    base: &str,
    body: serde_json::Value,
) -> anyhow::Result<StreamOutcome> {
    stream_request(client, base, Route::Chat, body, &[]).await
}

/// POST `body` (a completions request, e.g. `prompt` as an array of token ids; `stream` is
/// forced on, usage asked for) to `{base}/v1/completions` and read the whole stream.
///
/// # Errors
/// See [`stream_request`].
pub async fn stream_completion(
    client: &reqwest::Client,
    base: &str,
    body: serde_json::Value,
) -> anyhow::Result<StreamOutcome> {
    stream_request(client, base, Route::Completions, body, &[]).await
}

/// POST `body` to `{base}{route}` with `headers` added (name, value), `stream` forced on and
/// usage asked for, and read the whole stream. Chat and completions chunks are read alike.
///
/// # Errors
/// The request cannot be sent or the stream breaks off in transport. An HTTP
/// error status or an error record is not an error: it is reported in the outcome.
pub async fn stream_request(
    client: &reqwest::Client,
    base: &str,
    route: Route,
    mut body: serde_json::Value,
    headers: &[(String, String)],
) -> anyhow::Result<StreamOutcome> {
    body["stream"] = serde_json::json!(true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let mut req = client.post(format!("{base}{}", route.path())).json(&body);
    for (name, value) in headers {
        req = req.header(name.as_str(), value.as_str());
    }
    let t0 = Instant::now();
    let resp = req.send().await?;
    let mut out = StreamOutcome {
        status: resp.status().as_u16(),
        ..StreamOutcome::default()
    };
    if out.status != 200 {
        out.error = Some(resp.json().await.unwrap_or(serde_json::Value::Null));
        out.e2e = t0.elapsed();
        return Ok(out);
    }
    read_stream(resp.bytes_stream(), &mut out, t0).await?;
    out.e2e = t0.elapsed();
    Ok(out)
}

/// Read an SSE body (`chunks`, as the network delivers them) into `out`, timing each record
/// from `t0`. The SSE parser keeps bytes across chunks, so a character or a line split between
/// two chunks arrives whole; it accepts LF, CRLF and CR line ends and skips comments (`: ping`).
async fn read_stream<S, B, E>(chunks: S, out: &mut StreamOutcome, t0: Instant) -> anyhow::Result<()>
where
    S: futures::Stream<Item = Result<B, E>>,
    B: AsRef<[u8]>,
    E: std::error::Error + Send + Sync + 'static,
{
    use eventsource_stream::{EventStreamError, Eventsource};
    let mut events = std::pin::pin!(chunks.eventsource());
    while let Some(event) = events.next().await {
        match event {
            Ok(e) => on_data(out, &e.data, t0.elapsed()),
            Err(EventStreamError::Transport(e)) => return Err(e.into()),
            Err(e @ (EventStreamError::Utf8(_) | EventStreamError::Parser(_))) => {
                anyhow::bail!("bad SSE stream: {e}")
            }
        }
    }
    Ok(())
}

fn on_data(out: &mut StreamOutcome, data: &str, at: Duration) {
    if data.trim() == "[DONE]" {
        out.done = true;
        return;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
        out.error = Some(serde_json::json!({"message": format!("unparsable record: {data}")}));
        return;
    };
    if let Some(e) = v.get("error") {
        out.error = Some(e.clone());
        return;
    }
    if let Some(id) = v["id"].as_str()
        && !out.ids.iter().any(|x| x == id)
    {
        out.ids.push(id.to_owned());
    }
    let usage = &v["usage"];
    if let Some(n) = usage["completion_tokens"].as_u64() {
        out.completion_tokens = Some(n);
    }
    if let Some(n) = usage["prompt_tokens"].as_u64() {
        out.prompt_tokens = Some(n);
    }
    if let Some(n) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
        out.cached_tokens = Some(n);
    }
    for c in v["choices"].as_array().into_iter().flatten() {
        let delta = &c["delta"];
        if delta.get("role").is_some() {
            out.role_deltas += 1;
        }
        // Chat chunks carry `delta.content`, completions chunks `text`.
        let content = delta["content"].as_str().or_else(|| c["text"].as_str());
        if let Some(t) = content
            && !t.is_empty()
        {
            out.text.push_str(t);
            out.ttft.get_or_insert(at);
            out.chunk_times.push(at);
        }
        if let Some(f) = c["finish_reason"].as_str() {
            out.finish_reasons.push(f.to_owned());
        }
    }
}

/// Percentile `p` (0..=1) of `v` by nearest rank; NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_chunks_and_usage() {
        let mut out = StreamOutcome::default();
        let at = Duration::from_millis(5);
        on_data(
            &mut out,
            r#"{"id":"cmpl-1","choices":[{"index":0,"text":"Hi","logprobs":null,"finish_reason":null}]}"#,
            at,
        );
        on_data(
            &mut out,
            r#"{"id":"cmpl-1","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}"#,
            at * 2,
        );
        on_data(
            &mut out,
            r#"{"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":32,"completion_tokens":2,"total_tokens":34,"prompt_tokens_details":{"cached_tokens":16}}}"#,
            at * 3,
        );
        on_data(&mut out, "[DONE]", at * 4);
        out.status = 200;
        assert!(out.is_complete());
        assert_eq!(out.text, "Hi");
        assert_eq!(out.ttft, Some(at));
        assert_eq!(
            out.chunk_times,
            vec![at],
            "the empty finish chunk is no content"
        );
        assert_eq!(
            (out.completion_tokens, out.prompt_tokens, out.cached_tokens),
            (Some(2), Some(32), Some(16))
        );
    }

    /// Network chunks cut anywhere: inside a multi-byte character, between CR and LF, inside
    /// `data:`. The text comes out whole (no U+FFFD), CRLF records parse, comments are skipped.
    #[tokio::test]
    async fn sse_split_across_chunks_with_crlf() {
        let body = concat!(
            ": ping\r\n\r\n",
            "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Caf\u{e9} \"}}]}\r\n\r\n",
            "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"\u{1F600}!\"},\"finish_reason\":\"stop\"}]}\r\n\r\n",
            "data: [DONE]\r\n\r\n",
        )
        .as_bytes();
        // Split inside "é" (2 bytes), inside the emoji (4 bytes), and between every \r and \n.
        let e_at = body.windows(2).position(|w| w == "é".as_bytes()).unwrap() + 1;
        let emoji = "\u{1F600}".as_bytes();
        let smile_at = body.windows(4).position(|w| w == emoji).unwrap() + 2;
        let mut cuts = vec![e_at, smile_at];
        cuts.extend(
            body.windows(2)
                .enumerate()
                .filter(|(_, w)| w == b"\r\n")
                .map(|(i, _)| i + 1),
        );
        cuts.sort_unstable();
        let mut chunks: Vec<Result<Vec<u8>, std::io::Error>> = Vec::new();
        let mut from = 0;
        for c in cuts {
            chunks.push(Ok(body[from..c].to_vec()));
            from = c;
        }
        chunks.push(Ok(body[from..].to_vec()));
        let mut out = StreamOutcome {
            status: 200,
            ..StreamOutcome::default()
        };
        read_stream(futures::stream::iter(chunks), &mut out, Instant::now())
            .await
            .unwrap();
        assert_eq!(out.text, "Café \u{1F600}!");
        assert!(!out.text.contains('\u{FFFD}'));
        assert_eq!(out.role_deltas, 1);
        assert!(out.is_complete(), "{out:?}");
    }

    #[test]
    fn route_paths() {
        assert_eq!(Route::Chat.path(), "/v1/chat/completions");
        assert_eq!(Route::Completions.path(), "/v1/completions");
    }
}
