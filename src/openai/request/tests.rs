use serde_json::{Value, json};

use super::*;

fn chat(extra: Value) -> Result<GenerationRequest, ApiError> {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    merge(&mut body, extra);
    parse_chat(body.to_string().as_bytes())
}

fn completion(extra: Value) -> Result<GenerationRequest, ApiError> {
    let mut body = json!({"model": "m", "prompt": "hi"});
    merge(&mut body, extra);
    parse_completion(body.to_string().as_bytes())
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        for (k, v) in e {
            if v == json!("__remove__") {
                b.remove(&k);
            } else {
                b.insert(k, v);
            }
        }
    }
}

/// Assert a 400 invalid_request_error naming `param`; return the message.
fn bad(r: Result<GenerationRequest, ApiError>, param: Option<&str>) -> String {
    let e = r.expect_err("expected an error");
    assert_eq!(e.status().as_u16(), 400, "{e:?}");
    assert_eq!(e.type_str(), "invalid_request_error");
    assert_eq!(e.param.as_deref(), param, "{e:?}");
    let body = e.body();
    for key in ["message", "type", "param", "code"] {
        assert!(body["error"].get(key).is_some(), "missing {key}");
    }
    e.message
}

#[test]
fn defaults_chat() {
    let r = chat(json!({})).unwrap();
    assert_eq!(r.kind, RequestKind::Chat);
    assert_eq!(r.model, "m");
    assert_eq!(
        r.input,
        Input::Chat(vec![ChatMessage {
            role: Role::User,
            content: "hi".into()
        }])
    );
    assert_eq!(r.max_tokens, None);
    assert_eq!(r.max_tokens_param, "max_tokens");
    assert_eq!(r.sampling, Sampling::default());
    assert_eq!(r.sampling.temperature, 1.0);
    assert!(r.stop.is_empty() && !r.stream && !r.include_usage && !r.ignore_eos);
    assert_eq!((r.n, r.logprobs, r.user), (1, None, None));
}

#[test]
fn full_chat_request() {
    let r = chat(json!({
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "hi", "name": "bob"},
            {"role": "assistant", "content": null},
        ],
        "max_tokens": 10, "temperature": 0, "top_p": 0.5, "top_k": 40, "seed": -1,
        "stop": ["a", "bc"], "stream": true, "stream_options": {"include_usage": true},
        "n": 2, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": true,
        "top_logprobs": 0, "user": "u", "ignore_eos": true,
        "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto",
        "parallel_tool_calls": null, "store": false, "metadata": {}, "modalities": ["text"],
        "service_tier": "auto",
    }))
    .unwrap();
    let Input::Chat(msgs) = &r.input else {
        panic!("chat input")
    };
    assert_eq!(msgs.len(), 4);
    assert_eq!(
        msgs[1],
        ChatMessage {
            role: Role::System,
            content: "a\nb".into()
        }
    );
    assert_eq!(
        msgs[3],
        ChatMessage {
            role: Role::Assistant,
            content: String::new()
        }
    );
    assert_eq!(r.max_tokens, Some(10));
    assert_eq!(r.sampling.temperature, 0.0);
    assert_eq!(r.sampling.top_p, 0.5);
    assert_eq!(r.sampling.top_k, Some(40));
    assert_eq!(r.sampling.seed, Some(u64::MAX));
    assert_eq!(r.stop, vec!["a".to_owned(), "bc".to_owned()]);
    assert!(r.stream && r.include_usage && r.ignore_eos);
    assert_eq!(
        (r.n, r.logprobs, r.user.as_deref()),
        (2, Some(0), Some("u"))
    );
    let json = serde_json::to_value(&msgs[0]).unwrap();
    assert_eq!(json, json!({"role": "system", "content": "be brief"}));
}

/// A list of prompts, each answered on its own; the bad lists are 400s naming `prompt`.
#[test]
fn completion_prompt_lists() {
    let req = completion(json!({"prompt": ["a", "b", "c"], "n": 2})).unwrap();
    assert_eq!(
        req.input,
        Input::Batch(vec![
            Input::Text("a".into()),
            Input::Text("b".into()),
            Input::Text("c".into())
        ])
    );
    assert_eq!(req.input.prompts().len(), 3);
    assert_eq!(req.n, 2);
    assert_eq!(
        completion(json!({"prompt": [[1, 2], [3]]})).unwrap().input,
        Input::Batch(vec![Input::Tokens(vec![1, 2]), Input::Tokens(vec![3])])
    );
    // A single prompt is one prompt, whatever its shape.
    assert_eq!(
        completion(json!({"prompt": "x"})).unwrap().input.prompts(),
        &[Input::Text("x".into())]
    );
    // Mixed lists, empty items, bad token ids: each names the prompt and says what is wrong.
    let m = bad(completion(json!({"prompt": ["a", [1]]})), Some("prompt"));
    assert!(m.contains("mixes strings and token-id lists"), "{m}");
    let m = bad(completion(json!({"prompt": [[1], "a"]})), Some("prompt"));
    assert!(m.contains("prompt[1]"), "{m}");
    let m = bad(completion(json!({"prompt": ["a", ""]})), Some("prompt"));
    assert_eq!(m, "prompt[1] must not be empty");
    let m = bad(completion(json!({"prompt": [[1], []]})), Some("prompt"));
    assert_eq!(m, "prompt[1] must not be empty");
    let m = bad(completion(json!({"prompt": [[1], [2.5]]})), Some("prompt"));
    assert!(m.starts_with("prompt[1]: "), "{m}");
    let m = bad(completion(json!({"prompt": [[1], ["x"]]})), Some("prompt"));
    assert!(m.contains("prompt[1]"), "{m}");
    let m = bad(completion(json!({"prompt": ["a", null]})), Some("prompt"));
    assert!(m.contains("prompt[1]"), "{m}");
    bad(completion(json!({"prompt": [[1], [-1]]})), Some("prompt"));
    // The cap: prompts × n, and the list alone.
    let at_cap: Vec<String> = (0..MAX_PROMPT_CHOICES).map(|i| format!("p{i}")).collect();
    assert!(completion(json!({"prompt": at_cap})).is_ok());
    let half: Vec<String> = (0..MAX_PROMPT_CHOICES / 2)
        .map(|i| format!("p{i}"))
        .collect();
    assert!(completion(json!({"prompt": half, "n": 2})).is_ok());
    let m = bad(completion(json!({"prompt": half, "n": 3})), Some("prompt"));
    assert!(m.contains(&format!("at most {MAX_PROMPT_CHOICES}")), "{m}");
    let over: Vec<String> = (0..=MAX_PROMPT_CHOICES).map(|i| format!("p{i}")).collect();
    let m = bad(completion(json!({"prompt": over})), Some("prompt"));
    assert!(m.contains(&format!("at most {MAX_PROMPT_CHOICES}")), "{m}");
    // n alone stays capped by MAX_N.
    bad(
        completion(json!({"prompt": "x", "n": MAX_N + 1})),
        Some("n"),
    );
}

#[test]
fn completion_prompts() {
    assert_eq!(
        completion(json!({})).unwrap().input,
        Input::Text("hi".into())
    );
    assert_eq!(
        completion(json!({"prompt": ["x"]})).unwrap().input,
        Input::Text("x".into())
    );
    assert_eq!(
        completion(json!({"prompt": [1, 2]})).unwrap().input,
        Input::Tokens(vec![1, 2])
    );
    assert_eq!(
        completion(json!({"prompt": [[7]]})).unwrap().input,
        Input::Tokens(vec![7])
    );
    // Alternatives: up to 5 on completions.
    assert_eq!(
        completion(json!({"logprobs": 5})).unwrap().logprobs,
        Some(5)
    );
    assert_eq!(
        completion(json!({"logprobs": 0})).unwrap().logprobs,
        Some(0)
    );
    for empty in [json!(""), json!([]), json!([[]]), json!([""])] {
        bad(completion(json!({"prompt": empty})), Some("prompt"));
    }
    for wrong in [
        json!(5),
        json!({}),
        json!([-1]),
        json!([1.5]),
        json!([1, "a"]),
        json!([null]),
        json!([4294967296_u64]),
        json!([[1, "x"]]),
        json!(true),
    ] {
        bad(completion(json!({"prompt": wrong})), Some("prompt"));
    }
    bad(completion(json!({"prompt": "__remove__"})), Some("prompt"));
    bad(completion(json!({"prompt": null})), Some("prompt"));
    bad(completion(json!({"logprobs": true})), Some("logprobs"));
    bad(completion(json!({"logprobs": 6})), Some("logprobs"));
}

#[test]
fn broken_bodies_have_null_param() {
    for body in [
        &br#"{"model":"m","messages":[{"role":"user","content":"hi"}], x}"#[..],
        b"hello",
        b"",
        b"{",
        b"\xff\xfe",
        br#"{"max_tokens": 1e999}"#,
    ] {
        let m = bad(parse_chat(body), None);
        assert!(m.starts_with("We could not parse the JSON body"), "{m}");
    }
    for body in [&b"[]"[..], b"null", b"1", b"\"s\""] {
        let m = bad(parse_completion(body), None);
        assert!(
            m.starts_with("The request body must be a JSON object"),
            "{m}"
        );
    }
    let deep = "[".repeat(100_000);
    bad(parse_chat(deep.as_bytes()), None);
}

#[test]
fn messages_errors_name_the_field() {
    bad(chat(json!({"messages": "hi"})), Some("messages"));
    bad(chat(json!({"messages": "__remove__"})), Some("messages"));
    bad(chat(json!({"messages": null})), Some("messages"));
    bad(chat(json!({"messages": []})), Some("messages"));
    bad(chat(json!({"messages": ["hi"]})), Some("messages[0]"));
    let two = |m: Value| json!({"messages": [{"role": "user", "content": "a"}, m]});
    bad(chat(two(json!({"content": "x"}))), Some("messages[1].role"));
    bad(
        chat(two(json!({"role": 1, "content": "x"}))),
        Some("messages[1].role"),
    );
    bad(
        chat(two(json!({"role": "bot", "content": "x"}))),
        Some("messages[1].role"),
    );
    let m = bad(
        chat(two(json!({"role": "tool", "content": "x"}))),
        Some("messages[1].role"),
    );
    assert!(m.contains("not supported"), "{m}");
    bad(
        chat(two(json!({"role": "user"}))),
        Some("messages[1].content"),
    );
    bad(
        chat(two(json!({"role": "user", "content": null}))),
        Some("messages[1].content"),
    );
    bad(
        chat(two(json!({"role": "user", "content": 5}))),
        Some("messages[1].content"),
    );
    bad(
        chat(two(json!({"role": "user", "content": [5]}))),
        Some("messages[1].content[0]"),
    );
    bad(
        chat(two(json!({"role": "user", "content": [{"text": "a"}]}))),
        Some("messages[1].content[0].type"),
    );
    let img =
        json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]});
    bad(chat(two(img)), Some("messages[1].content[0].type"));
    bad(
        chat(two(json!({"role": "user", "content": [{"type": "text"}]}))),
        Some("messages[1].content[0].text"),
    );
    bad(
        chat(two(
            json!({"role": "user", "content": [{"type": "text", "text": []}]}),
        )),
        Some("messages[1].content[0].text"),
    );
    let calls = json!({"role": "assistant", "tool_calls": [{"id": "1"}]});
    bad(chat(two(calls)), Some("messages[1].tool_calls"));
}

#[test]
fn model_required() {
    bad(chat(json!({"model": "__remove__"})), Some("model"));
    bad(chat(json!({"model": 3})), Some("model"));
}

#[test]
fn max_tokens_edge_cases() {
    for (v, msg) in [
        (json!(0), "max_tokens must be at least 1, got 0"),
        (json!(-1), "max_tokens must be at least 1, got -1"),
        (json!("ten"), "max_tokens must be an integer, got string"),
        (json!(1.5), "max_tokens must be an integer, got 1.5"),
        (
            json!(4294967296_u64),
            "max_tokens must be at most 4294967295, got 4294967296",
        ),
        (
            json!(u64::MAX),
            "max_tokens must be at most 4294967295, got 18446744073709551615",
        ),
        (json!(-1e300), "max_tokens must be at least 1, got -1e+300"),
        (json!([1]), "max_tokens must be an integer, got array"),
    ] {
        for req in [
            chat(json!({"max_tokens": v.clone()})),
            completion(json!({"max_tokens": v.clone()})),
        ] {
            assert_eq!(bad(req, Some("max_tokens")), msg);
        }
        let m = bad(
            chat(json!({"max_completion_tokens": v.clone()})),
            Some("max_completion_tokens"),
        );
        assert_eq!(m, msg.replace("max_tokens", "max_completion_tokens"));
    }
    assert_eq!(
        chat(json!({"max_tokens": 10.0})).unwrap().max_tokens,
        Some(10)
    );
    let both = chat(json!({"max_tokens": 50, "max_completion_tokens": 10})).unwrap();
    assert_eq!(
        (both.max_tokens, both.max_tokens_param),
        (Some(10), "max_completion_tokens")
    );
    let only = completion(json!({"max_tokens": 50})).unwrap();
    assert_eq!(
        (only.max_tokens, only.max_tokens_param),
        (Some(50), "max_tokens")
    );
    // Each field is validated even when the other one wins.
    bad(
        chat(json!({"max_tokens": 0, "max_completion_tokens": 10})),
        Some("max_tokens"),
    );
}

#[test]
fn sampling_ranges() {
    for (k, v) in [
        ("temperature", json!(-1)),
        ("temperature", json!(2.01)),
        ("temperature", json!("hot")),
        ("top_p", json!(2)),
        ("top_p", json!(0)),
        ("top_p", json!(-0.5)),
        ("top_k", json!(-2)),
        ("top_k", json!(1.5)),
        ("seed", json!(1.5)),
        ("seed", json!(-1e30)),
        ("seed", json!("1")),
        ("presence_penalty", json!(-2.5)),
        ("frequency_penalty", json!(3)),
        ("n", json!(0)),
        ("n", json!(9)),
        ("stream", json!("yes")),
        ("stream", json!(1)),
        ("ignore_eos", json!("true")),
        ("user", json!(5)),
        ("logprobs", json!(1)),
        ("top_logprobs", json!(21)),
    ] {
        let mut extra = json!({k: v});
        if k == "top_logprobs" {
            extra["logprobs"] = json!(true);
        }
        bad(chat(extra), Some(k));
    }
    assert_eq!(chat(json!({"top_k": 0})).unwrap().sampling.top_k, None);
    assert_eq!(chat(json!({"top_k": -1})).unwrap().sampling.top_k, None);
    assert_eq!(
        chat(json!({"seed": u64::MAX})).unwrap().sampling.seed,
        Some(u64::MAX)
    );
    assert_eq!(chat(json!({"top_p": 1})).unwrap().sampling.top_p, 1.0);
    assert_eq!(
        chat(json!({"temperature": 2}))
            .unwrap()
            .sampling
            .temperature,
        2.0
    );
    assert_eq!(chat(json!({"n": 8})).unwrap().n, 8);
    assert_eq!(
        chat(json!({"temperature": null}))
            .unwrap()
            .sampling
            .temperature,
        1.0
    );
    let m = bad(chat(json!({"temperature": -1})), Some("temperature"));
    assert_eq!(m, "temperature must be between 0 and 2, got -1");
    let m = bad(chat(json!({"top_logprobs": 2})), Some("top_logprobs"));
    assert_eq!(m, "top_logprobs requires logprobs to be true");
    assert_eq!(chat(json!({"logprobs": true})).unwrap().logprobs, Some(0));
    assert_eq!(chat(json!({"logprobs": false})).unwrap().logprobs, None);
}

#[test]
fn stop_forms() {
    assert_eq!(
        chat(json!({"stop": "x"})).unwrap().stop,
        vec!["x".to_owned()]
    );
    assert_eq!(
        chat(json!({"stop": []})).unwrap().stop,
        Vec::<String>::new()
    );
    assert_eq!(
        chat(json!({"stop": null})).unwrap().stop,
        Vec::<String>::new()
    );
    for wrong in [
        json!(""),
        json!([""]),
        json!(["a", "b", "c", "d", "e"]),
        json!([1]),
        json!(5),
        json!({}),
    ] {
        bad(chat(json!({"stop": wrong})), Some("stop"));
    }
}

#[test]
fn stream_options_needs_stream() {
    let m = bad(
        chat(json!({"stream_options": {"include_usage": true}})),
        Some("stream_options"),
    );
    assert_eq!(m, "stream_options is only allowed when stream is true");
    bad(
        completion(json!({"stream": false, "stream_options": {}})),
        Some("stream_options"),
    );
    bad(
        chat(json!({"stream": true, "stream_options": 1})),
        Some("stream_options"),
    );
    let so = json!({"stream": true, "stream_options": {"include_usage": "y"}});
    bad(chat(so), Some("stream_options.include_usage"));
    let off = chat(json!({"stream": true, "stream_options": {"include_usage": false}})).unwrap();
    assert!(off.stream && !off.include_usage);
    let none = completion(json!({"stream": true, "stream_options": null})).unwrap();
    assert!(!none.include_usage);
    assert!(
        completion(json!({"stream": true, "stream_options": {"include_usage": true}}))
            .unwrap()
            .include_usage
    );
}

#[test]
fn response_format_and_unsupported() {
    assert!(chat(json!({"response_format": {"type": "text"}})).is_ok());
    for t in ["json_object", "json_schema"] {
        let m = bad(
            chat(json!({"response_format": {"type": t}})),
            Some("response_format"),
        );
        assert_eq!(
            m,
            format!("response_format type '{t}' is not supported; only 'text' is")
        );
    }
    bad(
        chat(json!({"response_format": "json"})),
        Some("response_format"),
    );
    bad(
        chat(json!({"response_format": {}})),
        Some("response_format.type"),
    );
    bad(
        chat(json!({"response_format": {"type": "xml"}})),
        Some("response_format.type"),
    );
    bad(
        chat(json!({"tools": [{"type": "function"}]})),
        Some("tools"),
    );
    bad(
        completion(json!({"echo": true, "best_of": 2})),
        Some("best_of"),
    );
    bad(
        completion(json!({"echo": true, "suffix": "x"})),
        Some("suffix"),
    );
    bad(completion(json!({"best_of": 2})), Some("best_of"));
    bad(chat(json!({"logit_bias": {"1": 5}})), Some("logit_bias"));
}

/// `echo` (completions): a boolean; with it `max_tokens` (or `max_completion_tokens`) may be 0
/// (the prompt alone), without it 0 is refused naming the field; chat has no such field.
#[test]
fn echo_and_zero_max_tokens() {
    let r = completion(json!({"echo": true, "max_tokens": 0, "logprobs": 1})).unwrap();
    assert!(r.echo && r.prompt_only());
    assert_eq!(
        r.check_context(10, 100).unwrap(),
        1,
        "one token is sampled, then dropped"
    );
    let r = completion(json!({"echo": true, "max_completion_tokens": 0})).unwrap();
    assert!(r.prompt_only());
    let r = completion(json!({"echo": true, "max_tokens": 3})).unwrap();
    assert!(r.echo && !r.prompt_only());
    assert_eq!(r.check_context(10, 100).unwrap(), 3);
    let r = completion(json!({"echo": false, "max_tokens": 3})).unwrap();
    assert!(!r.echo);
    let m = bad(completion(json!({"max_tokens": 0})), Some("max_tokens"));
    assert!(m.contains("at least 1"), "{m}");
    bad(
        completion(json!({"echo": false, "max_tokens": 0})),
        Some("max_tokens"),
    );
    bad(completion(json!({"echo": "yes"})), Some("echo"));
    bad(
        completion(json!({"echo": true, "max_tokens": -1})),
        Some("max_tokens"),
    );
    let m = bad(chat(json!({"echo": true})), Some("echo"));
    assert!(m.contains("Unrecognized request argument"), "{m}");
}

#[test]
fn odd_values_never_panic() {
    let odd = [
        json!(null),
        json!(true),
        json!(-1),
        json!(0),
        json!(1e308),
        json!(-1e308),
        json!(0.5),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(""),
        json!("x"),
        json!([]),
        json!([null]),
        json!({}),
        json!({"a": {"b": [1, {"c": null}]}}),
        json!([[[]]]),
    ];
    let keys = [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "top_logprobs",
        "user",
        "ignore_eos",
        "response_format",
        "tools",
        "best_of",
        "echo",
    ];
    for key in keys {
        for v in &odd {
            for r in [
                chat(json!({key: v.clone()})),
                completion(json!({key: v.clone()})),
            ] {
                if let Err(e) = r {
                    assert_eq!(e.status().as_u16(), 400);
                    assert!(e.param.is_some(), "{key}={v}: {e:?}");
                }
            }
        }
    }
}

#[test]
fn request_check_context_names_fields() {
    let r = chat(json!({})).unwrap();
    assert_eq!(
        r.check_context(5000, 4096).unwrap_err().param.as_deref(),
        Some("messages")
    );
    let r = completion(json!({"max_completion_tokens": 4050, "max_tokens": 1})).unwrap();
    assert_eq!(
        r.check_context(5000, 4096).unwrap_err().param.as_deref(),
        Some("prompt")
    );
    assert_eq!(
        r.check_context(100, 4096).unwrap_err().param.as_deref(),
        Some("max_completion_tokens")
    );
    assert_eq!(r.check_context(46, 4096).unwrap(), 4050);
}

#[test]
fn tool_choice_that_forces_a_tool_is_refused() {
    // Every way of forcing a tool, and the legacy `function_call`.
    let forced = json!({"type": "function", "function": {"name": "f"}});
    for extra in [
        json!({"tool_choice": "required"}),
        json!({"tool_choice": "required", "tools": []}),
        json!({"tool_choice": forced}),
        json!({"tool_choice": "required", "stream": true}),
    ] {
        let m = bad(chat(extra), Some("tool_choice"));
        assert!(m.contains("no tool calling"), "{m}");
    }
    bad(
        chat(json!({"function_call": {"name": "f"}})),
        Some("function_call"),
    );
    bad(
        chat(json!({"tool_choice": "sometimes"})),
        Some("tool_choice"),
    );
    bad(chat(json!({"tool_choice": 1})), Some("tool_choice"));
    // Values that need no tool are accepted, with or without an empty tool list.
    for v in ["none", "auto"] {
        assert!(chat(json!({"tool_choice": v})).is_ok());
        assert!(chat(json!({"tool_choice": v, "tools": []})).is_ok());
        assert!(chat(json!({"function_call": v})).is_ok());
    }
    assert!(chat(json!({"tool_choice": null})).is_ok());
}

#[test]
fn fields_that_cannot_be_honoured_are_refused() {
    for (k, v) in [
        ("presence_penalty", json!(0.5)),
        ("frequency_penalty", json!(-1)),
        ("parallel_tool_calls", json!(true)),
        ("store", json!(true)),
        ("metadata", json!({"k": "v"})),
        ("modalities", json!(["text", "audio"])),
        ("modalities", json!("text")),
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("reasoning_effort", json!("low")),
        ("web_search_options", json!({})),
        ("service_tier", json!("flex")),
        ("service_tier", json!(1)),
        ("functions", json!([{"name": "f"}])),
    ] {
        let r = chat(json!({k: v}));
        if k == "web_search_options" {
            // `{}` is its unset value.
            assert!(r.is_ok(), "{k}");
            continue;
        }
        bad(r, Some(k));
    }
    // Alternatives are served: chat up to 20, completions up to 5.
    assert_eq!(
        chat(json!({"logprobs": true, "top_logprobs": 2}))
            .unwrap()
            .logprobs,
        Some(2)
    );
    bad(
        chat(json!({"logprobs": true, "top_logprobs": 21})),
        Some("top_logprobs"),
    );
    assert_eq!(
        completion(json!({"logprobs": 1})).unwrap().logprobs,
        Some(1)
    );
    bad(completion(json!({"logprobs": 6})), Some("logprobs"));
    assert_eq!(
        completion(json!({"logprobs": 0})).unwrap().logprobs,
        Some(0)
    );
    bad(completion(json!({"suffix": "x"})), Some("suffix"));
    for k in ["presence_penalty", "frequency_penalty"] {
        assert!(chat(json!({k: 0})).is_ok());
        assert!(completion(json!({k: 0.0})).is_ok());
    }
    assert!(chat(json!({"service_tier": "default", "modalities": null})).is_ok());
}

#[test]
fn unknown_fields_are_refused_on_both_routes() {
    let m = bad(chat(json!({"unknown_field": 1})), Some("unknown_field"));
    assert_eq!(m, "Unrecognized request argument supplied: unknown_field");
    bad(completion(json!({"min_p": 0.1})), Some("min_p"));
    // Each route's own fields are unknown to the other.
    bad(
        completion(json!({"tool_choice": "auto"})),
        Some("tool_choice"),
    );
    bad(completion(json!({"top_logprobs": 0})), Some("top_logprobs"));
    bad(chat(json!({"echo": false})), Some("echo"));
    bad(chat(json!({"best_of": 1})), Some("best_of"));
    // A null unknown field is still a field the server does not know.
    bad(chat(json!({"foo": null})), Some("foo"));
    // Every known field is known on its route.
    for k in fields::ONLY_UNSET {
        assert!(
            fields::known(RequestKind::Chat, k) || fields::known(RequestKind::Completion, k),
            "{k}"
        );
    }
}

#[test]
fn what_sglang_and_vllm_routers_add_is_accepted_at_its_default_only() {
    // sglang-router 0.3.2 adds these to a chat request it forwards; vllm-router 0.1.17 also
    // `include_reasoning`.
    let extras = json!({"no_stop_trim": false, "continue_final_message": false,
        "skip_special_tokens": true, "return_hidden_states": false,
        "separate_reasoning": true, "stream_reasoning": true, "include_reasoning": true,
        "ignore_eos": false, "logprobs": false});
    assert!(chat(extras.clone()).is_ok());
    let completion_extras = json!({"no_stop_trim": false, "skip_special_tokens": true,
        "return_hidden_states": false, "echo": false});
    assert!(completion(completion_extras).is_ok());
    // At a value that asks for something else: refused, naming the field.
    let m = bad(chat(json!({"no_stop_trim": true})), Some("no_stop_trim"));
    assert_eq!(m, "no_stop_trim is only supported as false");
    bad(
        completion(json!({"skip_special_tokens": false})),
        Some("skip_special_tokens"),
    );
    bad(
        chat(json!({"separate_reasoning": "yes"})),
        Some("separate_reasoning"),
    );
}
