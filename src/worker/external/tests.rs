use super::*;
use crate::runtime::ids::{NodeId, RequestId};
use crate::worker::engine::SamplingParams;

fn job(max_tokens: u32, ignore_eos: bool) -> SubmitRequest {
    SubmitRequest {
        request: RequestId(7),
        reply_to: NodeId::new("gw"),
        prompt: vec![1, 2, 3],
        max_tokens,
        sampling: SamplingParams::default(),
        stop_token_ids: vec![],
        ignore_eos,
        owner_incarnation: 1,
        waiting_since_ms: 0,
        trace_id: None,
        traceparent: None,
        hand_off: false,
        remote_kv: None,
        fetch: None,
        class: None,
        session: None,
    }
}

fn chunk(ids: &[u32], finish: Option<&str>) -> Value {
    json!({"object": "text_completion",
           "choices": [{"index": 0, "text": "x", "token_ids": ids, "finish_reason": finish}]})
}

fn tokens(evs: &[TokenEventKind]) -> Vec<(u32, Option<FinishReason>, u32)> {
    evs.iter()
        .filter_map(|e| match e {
            TokenEventKind::Token {
                id, finish, index, ..
            } => Some((*id, *finish, *index)),
            _ => None,
        })
        .collect()
}

const EOS: u32 = 2;

#[test]
fn vllms_layout_finishes_on_the_chunk_that_carries_the_last_token() {
    let mut d = StreamDecoder::new(WorkerId::new("n/e"), &job(16, false), &[EOS]);
    let first = d.on_chunk(&chunk(&[10], None));
    assert!(matches!(
        first[0],
        TokenEventKind::Admitted {
            cached_tokens: 0,
            ..
        }
    ));
    assert_eq!(tokens(&first), vec![(10, None, 0)]);
    // An EOS the engine stops on, finish on the same chunk.
    let last = d.on_chunk(&chunk(&[11, EOS], Some("stop")));
    assert_eq!(
        tokens(&last),
        vec![(11, None, 1), (EOS, Some(FinishReason::Stop), 2)]
    );
    assert!(d.is_done());
    assert!(d.on_chunk(&chunk(&[], Some("stop"))).is_empty());
    assert!(
        d.on_end("eof").is_none(),
        "a finished request is not handed back"
    );
}

#[test]
fn openais_layout_is_finished_here_by_length_and_by_eos() {
    // max_tokens reached: the second token is the last, before the engine's finish chunk.
    let mut d = StreamDecoder::new(WorkerId::new("n/e"), &job(2, false), &[EOS]);
    d.on_chunk(&chunk(&[10], None));
    let ev = d.on_chunk(&chunk(&[11], None));
    assert_eq!(tokens(&ev), vec![(11, Some(FinishReason::Length), 1)]);
    assert!(d.is_done());
    // EOS without a finish on its chunk.
    let mut d = StreamDecoder::new(WorkerId::new("n/e"), &job(9, false), &[EOS]);
    let ev = d.on_chunk(&chunk(&[EOS], None));
    assert_eq!(tokens(&ev), vec![(EOS, Some(FinishReason::Stop), 0)]);
    // ignore_eos: EOS is a token like any other.
    let mut d = StreamDecoder::new(WorkerId::new("n/e"), &job(9, true), &[EOS]);
    let ev = d.on_chunk(&chunk(&[EOS], None));
    assert_eq!(tokens(&ev), vec![(EOS, None, 0)]);
    assert!(!d.is_done());
}

#[test]
fn a_broken_stream_is_handed_back_and_a_tokenless_finish_fails_clearly() {
    let mut d = StreamDecoder::new(WorkerId::new("n/e"), &job(9, false), &[EOS]);
    d.on_chunk(&chunk(&[10], None));
    match d.on_end("reset") {
        Some(TokenEventKind::Lost { reason }) => assert!(reason.contains("n/e"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let mut d = StreamDecoder::new(WorkerId::new("n/e"), &job(9, false), &[EOS]);
    d.on_chunk(&chunk(&[10], None));
    let ev = d.on_chunk(&chunk(&[], Some("length")));
    match ev.last() {
        Some(TokenEventKind::Failed { message, status }) => {
            assert_eq!(*status, 500);
            assert!(message.contains("max_model_len"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(d.on_end("eof").is_none());
}

#[test]
fn the_usage_chunk_and_logprobs_are_read() {
    let mut j = job(9, false);
    j.sampling.logprobs = true;
    let mut d = StreamDecoder::new(WorkerId::new("n/e"), &j, &[EOS]);
    let c = json!({"choices": [{"index": 0, "text": "a", "token_ids": [5],
                   "logprobs": {"token_logprobs": [-0.25]}, "finish_reason": null}]});
    match &d.on_chunk(&c)[1] {
        TokenEventKind::Token { logprob, .. } => assert_eq!(*logprob, -0.25),
        other => panic!("{other:?}"),
    }
    assert!(d.on_chunk(&json!({"choices": [], "usage": {}})).is_empty());
}

#[test]
fn the_body_carries_the_prompt_ids_and_the_sampling() {
    let mut j = job(5, true);
    j.sampling.temperature = 0.7;
    j.sampling.top_k = 40;
    j.sampling.seed = Some(u64::MAX);
    let b = completion_body(&j, "m");
    assert_eq!(b["prompt"], json!([1, 2, 3]));
    assert_eq!(b["model"], "m");
    assert_eq!(b["max_tokens"], 5);
    assert_eq!(b["stream"], true);
    assert_eq!(b["return_token_ids"], true);
    assert_eq!(b["ignore_eos"], true);
    assert_eq!(b["top_k"], 40);
    assert_eq!(b["seed"], -1);
    assert!(b.get("logprobs").is_none());
    assert!(b.get("stop_token_ids").is_none());
}

#[test]
fn vllm_metric_names_give_the_engines_load() {
    let text = "# HELP vllm:num_requests_running x\n\
                vllm:num_requests_running{model_name=\"m\"} 3\n\
                vllm:num_requests_waiting{model_name=\"m\"} 2.0\n\
                vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n\
                other 9\n";
    assert_eq!(
        parse_metrics(text),
        EngineLoad {
            running: 3,
            waiting: 2,
            kv_usage: 0.25
        }
    );
}
