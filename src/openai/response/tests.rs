use serde_json::{Value, json};

use super::*;

fn meta(kind: RequestKind) -> ResponseMeta {
    ResponseMeta {
        id: response_id(kind, "abc"),
        created: 1_700_000_000,
        model: "m".into(),
    }
}

const USAGE: Usage = Usage {
    prompt_tokens: 7,
    completion_tokens: 5,
    cached_tokens: 2,
};

#[test]
fn ids_and_usage() {
    assert_eq!(response_id(RequestKind::Chat, 42), "chatcmpl-42");
    assert_eq!(response_id(RequestKind::Completion, "x"), "cmpl-x");
    assert_eq!(
        USAGE.to_json(),
        json!({"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
               "prompt_tokens_details": {"cached_tokens": 2}})
    );
    let big = Usage {
        prompt_tokens: u32::MAX,
        completion_tokens: u32::MAX,
        cached_tokens: 0,
    };
    assert_eq!(
        big.to_json()["total_tokens"],
        json!(2 * u64::from(u32::MAX))
    );
}

#[test]
fn non_streaming_chat() {
    let lp = TokenLogprob {
        token: "Hi".into(),
        logprob: Some(-0.5),
        top: vec![("Hi".into(), -0.5), ("Yo".into(), f32::NEG_INFINITY)],
    };
    let choices = [
        ChoiceOutput {
            text: "Hi".into(),
            finish_reason: FinishReason::Stop,
            logprobs: Some(vec![lp]),
            token_ids: None,
        },
        ChoiceOutput {
            text: "Hey".into(),
            finish_reason: FinishReason::Length,
            logprobs: None,
            token_ids: None,
        },
    ];
    let body = chat_completion(&meta(RequestKind::Chat), &choices, &USAGE);
    assert_eq!(
        body,
        json!({
            "id": "chatcmpl-abc", "object": "chat.completion", "created": 1_700_000_000, "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "Hi"},
                 "logprobs": {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                    "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                     {"token": "Yo", "logprob": -9999.0, "bytes": [89, 111]}]}]},
                 "finish_reason": "stop"},
                {"index": 1, "message": {"role": "assistant", "content": "Hey"},
                 "logprobs": null, "finish_reason": "length"},
            ],
            "usage": USAGE.to_json(),
        })
    );
}

/// `echo`: the prompt's first token has no logprob: `null` in `token_logprobs` and in
/// `top_logprobs`, as OpenAI and vLLM write it; the offsets run over prompt and completion.
#[test]
fn an_echoed_prompts_first_token_is_null() {
    let lps = [
        TokenLogprob {
            token: "Hi".into(),
            logprob: None,
            top: vec![],
        },
        TokenLogprob {
            token: " there".into(),
            logprob: Some(-3.0),
            top: vec![(" there".into(), -3.0)],
        },
    ];
    assert_eq!(
        completion_logprobs(&lps, 0),
        json!({"tokens": ["Hi", " there"], "token_logprobs": [null, -3.0],
               "top_logprobs": [null, {" there": -3.0}], "text_offset": [0, 2]})
    );
}

#[test]
fn non_streaming_text_completion() {
    let lps = vec![
        TokenLogprob {
            token: "é".into(),
            logprob: Some(-1.0),
            top: vec![("é".into(), -1.0)],
        },
        TokenLogprob {
            token: "b".into(),
            logprob: Some(-2.0),
            top: vec![],
        },
    ];
    let choices = [ChoiceOutput {
        text: "éb".into(),
        finish_reason: FinishReason::Length,
        logprobs: Some(lps),
        token_ids: None,
    }];
    let body = text_completion(&meta(RequestKind::Completion), &choices, &USAGE);
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["id"], "cmpl-abc");
    assert_eq!(body["choices"][0]["text"], "éb");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(
        body["choices"][0]["logprobs"],
        json!({"tokens": ["é", "b"], "token_logprobs": [-1.0, -2.0],
               "top_logprobs": [{"é": -1.0}, {}], "text_offset": [0, 1]})
    );
    assert_eq!(body["usage"]["total_tokens"], 12);
}

/// Check the streaming rules (`response` module doc) on a finished list of chunks; returns the joined text per index.
fn check_stream(chunks: &[Value], kind: RequestKind, n: usize, include_usage: bool) -> Vec<String> {
    let object = match kind {
        RequestKind::Chat => "chat.completion.chunk",
        RequestKind::Completion => "text_completion",
    };
    let mut text = vec![String::new(); n];
    let mut roles = vec![0; n];
    let mut finished = vec![false; n];
    let mut usage_chunks = 0;
    for (at, c) in chunks.iter().enumerate() {
        assert_eq!(c["id"], chunks[0]["id"]);
        assert_eq!(c["object"], object);
        let choices = c["choices"].as_array().unwrap();
        if choices.is_empty() {
            usage_chunks += 1;
            assert_eq!(at, chunks.len() - 1, "usage chunk must be last");
            assert!(finished.iter().all(|f| *f));
            let u = &c["usage"];
            assert_eq!(
                u["total_tokens"],
                u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
            );
            continue;
        }
        assert!(
            c.get("usage").is_none(),
            "only the usage chunk has a usage key"
        );
        for ch in choices {
            let i = ch["index"].as_u64().unwrap() as usize;
            assert!(!finished[i], "nothing after a choice's finish chunk");
            let reason = ch.get("finish_reason").expect("finish_reason key present");
            assert_ne!(reason, "");
            if kind == RequestKind::Chat {
                let delta = &ch["delta"];
                if let Some(role) = delta.get("role") {
                    assert_eq!(role, "assistant");
                    roles[i] += 1;
                }
                if delta.get("content").is_some() {
                    assert_eq!(roles[i], 1, "content before role");
                }
                text[i].push_str(delta["content"].as_str().unwrap_or(""));
            } else {
                text[i].push_str(ch["text"].as_str().unwrap());
            }
            if !reason.is_null() {
                finished[i] = true;
                if kind == RequestKind::Chat && roles[i] == 1 {
                    assert!(
                        ch["delta"].get("content").is_none() || ch["delta"]["role"] == "assistant"
                    );
                }
            }
        }
    }
    assert!(finished.iter().all(|f| *f));
    if kind == RequestKind::Chat {
        assert!(roles.iter().all(|r| *r == 1), "{roles:?}");
    }
    assert_eq!(usage_chunks, usize::from(include_usage));
    text
}

#[test]
fn chat_stream_rules() {
    let mut s = StreamState::new(RequestKind::Chat, meta(RequestKind::Chat), 2, true);
    let mut out = Vec::new();
    out.extend(s.delta(0, "Hel", None).as_ref().map(Chunk::to_value));
    out.extend(s.delta(1, "", None).as_ref().map(Chunk::to_value)); // nothing to send
    out.extend(s.delta(0, "lo", None).as_ref().map(Chunk::to_value));
    assert!(
        s.usage(&USAGE).is_none(),
        "not before every choice finished"
    );
    out.extend(
        s.finish(0, FinishReason::Length)
            .as_ref()
            .map(Chunk::to_value),
    );
    assert!(s.delta(0, "late", None).is_none());
    assert!(s.finish(0, FinishReason::Stop).is_none());
    out.extend(
        s.finish(1, FinishReason::Stop)
            .as_ref()
            .map(Chunk::to_value),
    ); // finished before any content
    assert!(s.all_finished());
    out.extend(s.usage(&USAGE).as_ref().map(Chunk::to_value));
    assert!(s.usage(&USAGE).is_none(), "once");
    assert_eq!(out.len(), 5);
    assert_eq!(
        check_stream(&out, RequestKind::Chat, 2, true),
        vec!["Hello".to_owned(), String::new()]
    );
    assert_eq!(
        out[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": "Hel"})
    );
    assert_eq!(out[1]["choices"][0]["delta"], json!({"content": "lo"}));
    assert_eq!(out[2]["choices"][0]["delta"], json!({}));
    assert_eq!(out[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(
        out[3]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(out[4]["choices"], json!([]));
    assert_eq!(out[4]["usage"], USAGE.to_json());
    assert_eq!(out[0]["choices"][0]["finish_reason"], Value::Null);
    assert_eq!(s.id(), "chatcmpl-abc");
}

#[test]
fn role_chunk_then_content() {
    let mut s = StreamState::new(RequestKind::Chat, meta(RequestKind::Chat), 1, false);
    let mut out: Vec<Value> = s.role_chunk(0).iter().map(Chunk::to_value).collect();
    assert!(s.role_chunk(0).is_none());
    out.extend(s.delta(0, "a", None).as_ref().map(Chunk::to_value));
    out.extend(
        s.finish(0, FinishReason::Stop)
            .as_ref()
            .map(Chunk::to_value),
    );
    assert!(
        s.usage(&USAGE).is_none(),
        "no usage chunk without include_usage"
    );
    assert_eq!(
        check_stream(&out, RequestKind::Chat, 1, false),
        vec!["a".to_owned()]
    );
    assert!(s.delta(5, "x", None).is_none(), "unknown index");
    assert!(s.finish(u32::MAX, FinishReason::Stop).is_none());
}

#[test]
fn completion_stream_rules() {
    let mut s = StreamState::new(
        RequestKind::Completion,
        meta(RequestKind::Completion),
        1,
        true,
    );
    assert!(s.role_chunk(0).is_none());
    let lp = [TokenLogprob {
        token: "b".into(),
        logprob: Some(-1.0),
        top: vec![],
    }];
    let mut out = Vec::new();
    out.extend(s.delta(0, "日本", None).as_ref().map(Chunk::to_value));
    out.extend(s.delta(0, "b", Some(&lp)).as_ref().map(Chunk::to_value));
    out.extend(
        s.finish(0, FinishReason::Stop)
            .as_ref()
            .map(Chunk::to_value),
    );
    out.extend(s.usage(&USAGE).as_ref().map(Chunk::to_value));
    assert_eq!(
        check_stream(&out, RequestKind::Completion, 1, true),
        vec!["日本b".to_owned()]
    );
    assert_eq!(out[1]["choices"][0]["logprobs"]["text_offset"], json!([2]));
    assert_eq!(
        out[2]["choices"][0],
        json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "stop"})
    );
    assert_eq!(out[0]["object"], "text_completion");
}

#[test]
fn zero_choices_is_one() {
    let mut s = StreamState::new(RequestKind::Chat, meta(RequestKind::Chat), 0, false);
    assert!(s.finish(0, FinishReason::Stop).is_some());
    assert!(s.all_finished());
}

#[test]
fn token_ids_ride_on_every_choice_when_asked() {
    let choices = [ChoiceOutput {
        text: "Hi".into(),
        finish_reason: FinishReason::Stop,
        logprobs: None,
        token_ids: Some(vec![7, 2]),
    }];
    let body = text_completion(&meta(RequestKind::Completion), &choices, &USAGE);
    assert_eq!(body["choices"][0]["token_ids"], json!([7, 2]));
    let plain = StreamState::new(
        RequestKind::Completion,
        meta(RequestKind::Completion),
        1,
        false,
    )
    .delta_with_ids(0, "", None, &[2]);
    assert!(plain.is_none(), "ids are not sent unless asked");
    let mut s = StreamState::new(
        RequestKind::Completion,
        meta(RequestKind::Completion),
        1,
        false,
    )
    .with_token_ids();
    let a = s.delta_with_ids(0, "Hi", None, &[7]).unwrap().to_value();
    assert_eq!(a["choices"][0]["token_ids"], json!([7]));
    // The end-of-sequence token has no text but still gets its chunk.
    let eos = s.delta_with_ids(0, "", None, &[2]).unwrap().to_value();
    assert_eq!(eos["choices"][0]["token_ids"], json!([2]));
    assert_eq!(eos["choices"][0]["text"], "");
    let fin = s.finish(0, FinishReason::Stop).unwrap().to_value();
    assert_eq!(fin["choices"][0]["token_ids"], json!([]));
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
}

#[test]
fn chunks_are_written_in_the_reference_key_order() {
    let mut s = StreamState::new(RequestKind::Chat, meta(RequestKind::Chat), 1, false);
    let m = meta(RequestKind::Chat);
    let head = format!(
        r#"{{"id":"{}","object":"chat.completion.chunk","created":{},"model":"{}","choices":"#,
        m.id, m.created, m.model
    );
    let first = s.delta(0, "a\n\"b", None).unwrap();
    assert_eq!(
        first.as_str(),
        format!(
            r#"{head}[{{"index":0,"delta":{{"role":"assistant","content":"a\n\"b"}},"logprobs":null,"finish_reason":null}}]}}"#
        )
    );
    assert!(!first.as_str().contains('\n'), "one SSE data line");
    let next = s.delta(0, "c", None).unwrap();
    assert_eq!(
        next.as_str(),
        format!(
            r#"{head}[{{"index":0,"delta":{{"content":"c"}},"logprobs":null,"finish_reason":null}}]}}"#
        )
    );
    let fin = s.finish(0, FinishReason::Stop).unwrap();
    assert_eq!(
        fin.as_str(),
        format!(r#"{head}[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"stop"}}]}}"#)
    );
}
