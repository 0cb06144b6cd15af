use super::*;
use crate::openai::request::parse_completion;

fn placement() -> Placement {
    Placement {
        reply_to: NodeId::new("gw"),
        owner_incarnation: 3,
        waiting_since_ms: 1_000,
        first_id: 100,
        trace_id: Some("req-1".into()),
        traceparent: None,
        class: None,
        session: Some("s".into()),
    }
}

#[test]
fn choices_are_prompt_major_and_choice_j_samples_with_seed_plus_j() {
    let req = parse_completion(
        br#"{"model":"m","prompt":[[1,2,3],[4,5]],"n":2,"seed":7,"max_tokens":4}"#,
    )
    .expect("parsed");
    let tok = Tokenized {
        prompts: vec![vec![1, 2, 3], vec![4, 5]],
        max_tokens: vec![4, 4],
    };
    let plans = submissions(&req, &tok, &placement());
    let seen: Vec<(u32, usize, u64, Option<u64>, usize)> = plans
        .iter()
        .map(|c| {
            let s = &c.submit;
            (
                c.index,
                c.prompt,
                s.request.0,
                s.sampling.seed,
                s.prompt.len(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (0, 0, 100, Some(7), 3),
            (1, 0, 101, Some(8), 3),
            (2, 1, 102, Some(7), 2),
            (3, 1, 103, Some(8), 2),
        ]
    );
    let s = &plans[3].submit;
    assert_eq!(
        (s.reply_to.clone(), s.owner_incarnation),
        (NodeId::new("gw"), 3)
    );
    assert_eq!(
        (s.trace_id.as_deref(), s.session.as_deref()),
        (Some("req-1"), Some("s"))
    );
    assert_eq!((s.max_tokens, s.waiting_since_ms), (4, 1_000));
    assert!(s.remote_kv.is_none() && s.fetch.is_none() && !s.hand_off);
    assert_eq!(tok.prompt_tokens(), [3, 2]);
}

#[test]
fn the_worker_scores_the_prompt_only_for_echo_with_logprobs() {
    let tok = Tokenized {
        prompts: vec![vec![1, 2, 3, 4]],
        max_tokens: vec![2],
    };
    let echo = |body: &[u8]| {
        let req = parse_completion(body).expect("parsed");
        let s = submissions(&req, &tok, &placement())
            .remove(0)
            .submit
            .sampling;
        (s.echo_tokens, s.logprobs, s.top_logprobs)
    };
    assert_eq!(
        echo(br#"{"model":"m","prompt":"x","echo":true,"logprobs":2}"#),
        (4, true, 2)
    );
    assert_eq!(
        echo(br#"{"model":"m","prompt":"x","echo":true}"#),
        (0, false, 0)
    );
    assert_eq!(
        echo(br#"{"model":"m","prompt":"x","logprobs":1}"#),
        (0, true, 1)
    );
}

#[test]
fn a_prompt_past_the_context_is_refused_naming_it_in_a_batch() {
    let req =
        parse_completion(br#"{"model":"m","prompt":[[1],[2]],"max_tokens":8}"#).expect("parsed");
    let prompts = vec![vec![1; 4], vec![2; 12]];
    assert_eq!(fit_context(&req, &prompts[..1], 16).expect("fits"), [8]);
    let e = fit_context(&req, &prompts, 16).expect_err("the second does not fit");
    assert!(e.message.starts_with("prompt[1]: "), "{}", e.message);
    // Alone, a prompt is not named.
    let e = fit_context(&req, &prompts[1..], 16).expect_err("does not fit");
    assert!(!e.message.starts_with("prompt["), "{}", e.message);
}
