use super::*;
use serde_json::json;

fn parse(v: Value) -> Result<MessagesRequest, ApiError> {
    parse_messages_request(v.to_string().as_bytes())
}

fn ok(v: Value) -> MessagesRequest {
    parse(v).expect("valid")
}

/// The 400's `param` and message (which must name the field).
fn err(v: Value) -> (String, String) {
    let e = parse(v).expect_err("refused");
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    let param = e.param.clone().unwrap_or_default();
    assert!(
        e.message.contains(&param),
        "the message names {param}: {}",
        e.message
    );
    (param, e.message)
}

fn base() -> Value {
    json!({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]})
}

fn with(key: &str, v: Value) -> Value {
    let mut b = base();
    b[key] = v;
    b
}

#[test]
fn a_conversation_becomes_the_chat_routes_messages() {
    let r = ok(json!({
        "model": "m", "max_tokens": 16,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "c"}
        ],
        "stop_sequences": ["\n\n", "END"], "temperature": 0, "top_p": 0.5, "top_k": 3,
        "metadata": {"user_id": "u-1"}, "stream": true
    }));
    let g = &r.generation;
    let msg = |role, content: &str| ChatMessage {
        role,
        content: content.into(),
    };
    assert_eq!(
        g.input,
        Input::Chat(vec![
            msg(Role::System, "Be brief."),
            msg(Role::User, "a\nb"),
            msg(Role::Assistant, "ok"),
            msg(Role::User, "c"),
        ])
    );
    assert_eq!(g.kind, RequestKind::Chat);
    assert_eq!((g.max_tokens, g.n, g.stream), (Some(16), 1, true));
    assert_eq!(g.stop, ["\n\n", "END"]);
    assert_eq!(g.sampling.temperature, 0.0);
    assert_eq!(g.sampling.top_p, 0.5);
    assert_eq!(g.sampling.top_k, Some(3));
    assert_eq!(r.user_id.as_deref(), Some("u-1"));
    // The same request through the chat parser gives the same messages.
    let chat = crate::openai::request::parse_chat(
        json!({"model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "c"}]})
        .to_string()
        .as_bytes(),
    )
    .expect("chat");
    assert_eq!(chat.input, g.input);
    let plain = ok(with("system", json!("S")));
    assert_eq!(
        plain.generation.input,
        Input::Chat(vec![msg(Role::System, "S"), msg(Role::User, "Hi")])
    );
    assert_eq!(ok(base()).generation.sampling, Sampling::default());
}

#[test]
fn required_fields_are_named() {
    let mut b = base();
    b.as_object_mut().unwrap().remove("max_tokens");
    assert_eq!(err(b).0, "max_tokens");
    let mut b = base();
    b.as_object_mut().unwrap().remove("model");
    assert_eq!(err(b).0, "model");
    let mut b = base();
    b.as_object_mut().unwrap().remove("messages");
    assert_eq!(err(b).0, "messages");
    assert_eq!(err(with("messages", json!([]))).0, "messages");
    assert!(parse_messages_request(b"{not json").is_err());
    assert!(parse_messages_request(b"[1]").is_err());
}

#[test]
fn wrong_types_and_ranges_are_named() {
    for (key, v) in [
        ("max_tokens", json!("16")),
        ("max_tokens", json!(0)),
        ("temperature", json!(1.5)),
        ("temperature", json!("hot")),
        ("top_p", json!(0)),
        ("top_k", json!(-1)),
        ("stream", json!("yes")),
        ("system", json!(5)),
        ("stop_sequences", json!("END")),
        ("metadata", json!("u")),
        ("service_tier", json!("priority")),
    ] {
        assert_eq!(err(with(key, v.clone())).0, key, "{key} = {v}");
    }
    assert_eq!(
        err(with("stop_sequences", json!(["a", 1]))).0,
        "stop_sequences[1]"
    );
    assert_eq!(
        err(with("stop_sequences", json!(["a", ""]))).0,
        "stop_sequences[1]"
    );
    let many: Vec<String> = (0..=MAX_STOP_SEQUENCES).map(|i| i.to_string()).collect();
    assert_eq!(err(with("stop_sequences", json!(many))).0, "stop_sequences");
    assert_eq!(
        err(with("metadata", json!({"user_id": 7}))).0,
        "metadata.user_id"
    );
    assert_eq!(
        err(with("metadata", json!({"tenant": "a"}))).0,
        "metadata.tenant"
    );
    assert_eq!(
        err(with("messages", json!([{"role": "user", "content": 3}]))).0,
        "messages[0].content"
    );
    assert_eq!(
        err(with(
            "messages",
            json!([{"role": "system", "content": "x"}])
        ))
        .0,
        "messages[0].role"
    );
    assert_eq!(
        err(with("messages", json!([{"role": "user", "content": []}]))).0,
        "messages[0].content"
    );
    assert_eq!(
        err(with(
            "messages",
            json!([{"role": "user", "content": [{"type": "text"}]}])
        ))
        .0,
        "messages[0].content[0].text"
    );
}

#[test]
fn content_the_server_cannot_handle_is_refused_by_name() {
    for ty in [
        "image",
        "document",
        "tool_use",
        "tool_result",
        "thinking",
        "redacted_thinking",
        "search_result",
    ] {
        let b = with(
            "messages",
            json!([{"role": "user", "content": [
                {"type": "text", "text": "look"}, {"type": ty, "source": {}}]}]),
        );
        let (param, message) = err(b);
        assert_eq!(param, "messages[0].content[1].type");
        assert!(message.contains(ty), "{message}");
    }
    let (param, _) = err(with("system", json!([{"type": "image", "source": {}}])));
    assert_eq!(param, "system[0].type");
    let (param, _) = err(with(
        "messages",
        json!([{"role": "user", "content": [{"type": "text", "text": "x",
                 "citations": [{"type": "char_location"}]}]}]),
    ));
    assert_eq!(param, "messages[0].content[0].citations");
}

#[test]
fn tools_thinking_and_prefill_are_refused_unless_they_ask_for_nothing() {
    for (key, v) in [
        (
            "tools",
            json!([{"name": "get_weather", "input_schema": {}}]),
        ),
        ("tool_choice", json!({"type": "any"})),
        ("tool_choice", json!({"type": "tool", "name": "x"})),
        (
            "thinking",
            json!({"type": "enabled", "budget_tokens": 1024}),
        ),
        ("thinking", json!({"type": "adaptive"})),
        ("mcp_servers", json!([{"type": "url"}])),
        ("output_config", json!({"format": {"type": "json_schema"}})),
        ("inference_geo", json!("us")),
        ("speed", json!("fast")),
        ("cache_control", json!("ephemeral")),
        ("workspace_id", json!(5)),
        ("frequency_penalty", json!(0)),
    ] {
        assert_eq!(err(with(key, v.clone())).0, key, "{key} = {v}");
    }
    for (key, v) in [
        ("tools", json!([])),
        ("tool_choice", json!({"type": "none"})),
        ("tool_choice", json!({"type": "auto"})),
        ("thinking", json!({"type": "disabled"})),
        ("service_tier", json!("auto")),
        ("metadata", json!({"user_id": null})),
        ("speed", json!("standard")),
        ("cache_control", json!({"type": "ephemeral"})),
        ("output_config", json!({})),
        ("workspace_id", json!("w-1")),
    ] {
        ok(with(key, v));
    }
    let (param, message) = err(with(
        "messages",
        json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}]),
    ));
    assert_eq!(param, "messages[1].role");
    assert!(message.contains("prefill"), "{message}");
}

/// Consecutive turns of one role are one turn, their texts joined with "\n" (as one turn's
/// text blocks are); a final assistant turn after combining is still a prefill, refused naming
/// the last message.
#[test]
fn consecutive_turns_of_one_role_are_combined() {
    let r = ok(with(
        "messages",
        json!([{"role": "user", "content": "a"},
               {"role": "user", "content": [{"type": "text", "text": "b"},
                                            {"type": "text", "text": "c"}]},
               {"role": "assistant", "content": "d"},
               {"role": "assistant", "content": "e"},
               {"role": "user", "content": "f"}]),
    ));
    let Input::Chat(m) = r.generation.input else {
        panic!("chat input")
    };
    let got: Vec<(Role, &str)> = m.iter().map(|m| (m.role, m.content.as_str())).collect();
    assert_eq!(
        got,
        [
            (Role::User, "a\nb\nc"),
            (Role::Assistant, "d\ne"),
            (Role::User, "f")
        ]
    );
    let (param, _) = err(with(
        "messages",
        json!([{"role": "user", "content": "a"},
               {"role": "assistant", "content": "b"},
               {"role": "assistant", "content": "c"}]),
    ));
    assert_eq!(param, "messages[2].role");
}

/// count_tokens takes a Messages body without the generation fields: the same messages and
/// system; `max_tokens` and friends are extra inputs, named.
#[test]
fn a_count_tokens_body_is_a_messages_body_without_generation_fields() {
    let count = |v: Value| parse_count_tokens_request(v.to_string().as_bytes());
    let g = count(json!({"model": "m", "system": "S",
                         "messages": [{"role": "user", "content": "Hi"}], "tools": []}))
    .expect("valid");
    assert_eq!(g.model, "m");
    assert_eq!(g.max_tokens, None);
    let Input::Chat(m) = &g.input else {
        panic!("chat input")
    };
    assert_eq!(m.len(), 2);
    assert_eq!((m[0].role, m[0].content.as_str()), (Role::System, "S"));
    for (body, param) in [
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}),
            "max_tokens",
        ),
        (
            json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "Hi"}]}),
            "stream",
        ),
        (json!({"model": "m"}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": "Hi"}]}),
            "model",
        ),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                   "thinking": {"type": "enabled", "budget_tokens": 1024}}),
            "thinking",
        ),
    ] {
        let e = count(body).expect_err("refused");
        assert_eq!(e.param.as_deref(), Some(param), "{e:?}");
        assert!(e.message.contains(param), "{e:?}");
    }
    assert!(count(json!([1])).is_err());
    assert!(parse_count_tokens_request(b"{").is_err(), "not JSON");
}
