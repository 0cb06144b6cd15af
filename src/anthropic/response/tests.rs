use super::*;

fn usage(prompt: u32, cached: u32, completion: u32) -> Usage {
    Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
    }
}

#[test]
fn stop_reasons_follow_the_finish_and_the_matched_sequence() {
    let of = |f, s| Ending::of(f, s);
    assert_eq!(of(FinishReason::Stop, None).reason, StopReason::EndTurn);
    let e = of(FinishReason::Stop, Some("\n\n"));
    assert_eq!(
        (e.reason.as_str(), e.stop_sequence.as_deref()),
        ("stop_sequence", Some("\n\n"))
    );
    let e = of(FinishReason::Length, Some("x"));
    assert_eq!((e.reason.as_str(), e.stop_sequence), ("max_tokens", None));
    assert_eq!(
        of(FinishReason::ContextLimit, None).reason.as_str(),
        "model_context_window_exceeded"
    );
}

#[test]
fn usage_splits_the_prompt_into_uncached_and_cache_read() {
    let u = MessageUsage::from(&usage(40, 32, 7));
    assert_eq!(
        u.to_json(),
        json!({"input_tokens": 8, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": 32, "output_tokens": 7})
    );
    // Never more cached than the prompt.
    assert_eq!(MessageUsage::from(&usage(4, 9, 0)).input_tokens, 0);
}

#[test]
fn a_message_has_one_text_block_and_its_ending() {
    let ending = Ending::of(FinishReason::Stop, Some("END"));
    let v = message_body(
        "msg_1",
        "m",
        "hi",
        &ending,
        MessageUsage::from(&usage(5, 0, 3)),
    );
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["content"], json!([{"type": "text", "text": "hi"}]));
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], "END");
    assert_eq!(v["usage"]["input_tokens"], 5);
    assert_eq!(v["usage"]["output_tokens"], 3);
    let v = message_body(
        "msg_1",
        "m",
        "",
        &Ending::of(FinishReason::Stop, None),
        MessageUsage::from(&usage(5, 0, 1)),
    );
    assert_eq!(v["stop_sequence"], Value::Null);
    assert_eq!(v["stop_reason"], "end_turn");
}

#[test]
fn a_stream_opens_deltas_and_closes_in_anthropics_order() {
    let mut s = MessageStream::new(message_id("x-1"), "m".into());
    let mut events = s.start(MessageUsage::from(&usage(10, 4, 0)));
    assert!(s.start(MessageUsage::from(&usage(10, 4, 0))).is_empty());
    assert!(s.delta("").is_none());
    events.extend(s.delta("Hel"));
    events.extend(s.delta("lo"));
    events.extend(s.finish(&Ending::of(FinishReason::Length, None), 2));
    let names: Vec<&str> = events.iter().map(|e| e.name).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for e in &events {
        assert_eq!(e.data["type"], e.name, "the data names its event");
    }
    let start = &events[0].data["message"];
    assert_eq!(start["id"], "msg_x-1");
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert_eq!(start["usage"]["input_tokens"], 6);
    assert_eq!(start["usage"]["cache_read_input_tokens"], 4);
    assert_eq!(start["usage"]["output_tokens"], 0);
    assert_eq!(
        events[1].data["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert_eq!(
        events[3].data["delta"],
        json!({"type": "text_delta", "text": "Hel"})
    );
    assert_eq!(events[3].data["index"], 0);
    assert_eq!(
        events[6].data["delta"],
        json!({"stop_reason": "max_tokens", "stop_sequence": null})
    );
    assert_eq!(events[6].data["usage"], json!({"output_tokens": 2}));
}
