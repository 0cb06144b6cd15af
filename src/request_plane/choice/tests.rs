use std::sync::Arc;

use tokenizers::Tokenizer;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use super::*;
use crate::openai::detok::byte_char;
use crate::runtime::ids::WorkerId;

/// A byte-level tokenizer without merges: token id = byte.
fn tokenizer() -> TokRef {
    let vocab: Vocab = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), u32::from(b)))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .unwrap();
    let mut tk = Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(ByteLevel::default()));
    tk.with_decoder(Some(ByteLevel::default()));
    TokRef(Arc::new(crate::model::tokenizer::Tokenizer::new(
        tk,
        None,
        Vec::new(),
        false,
    )))
}

fn ids(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

fn spec<'a>(prompt: &'a [u32], stop: &'a [String]) -> ChoiceSpec<'a> {
    ChoiceSpec {
        prompt_ids: prompt,
        prompt: 0,
        echo: None,
        stop,
        logprobs: false,
        token_ids: false,
        prompt_only: false,
    }
}

fn token(id: u32, finish: Option<FinishReason>) -> TokenEventKind {
    TokenEventKind::Token {
        id,
        logprob: -0.5,
        finish,
        index: 0,
        top: Vec::new(),
    }
}

/// Streams `text` as one token per byte, the last one finishing with `finish`; returns the
/// text the client was sent.
fn stream(c: &mut ChoiceText, text: &str, finish: FinishReason) -> String {
    let n = text.len();
    let mut out = String::new();
    for (k, id) in ids(text).into_iter().enumerate() {
        let p = c
            .on_event(token(id, (k + 1 == n).then_some(finish)))
            .unwrap();
        assert!(p.counted, "every generated token is counted");
        out.push_str(&p.text);
    }
    out
}

/// The text goes out as it comes; every token is counted; the first admission's cached
/// tokens are kept and each new worker is listed once.
#[test]
fn tokens_become_text_and_admissions_name_the_workers() {
    let prompt = ids("Q:");
    let mut c = ChoiceText::new(tokenizer(), spec(&prompt, &[]));
    for (w, cached) in [("a/replica-0", 16), ("a/replica-0", 0), ("b/replica-1", 0)] {
        let p = c
            .on_event(TokenEventKind::Admitted {
                worker: WorkerId::new(w),
                cached_tokens: cached,
            })
            .unwrap();
        assert_eq!(p, Produced::default());
    }
    assert_eq!(stream(&mut c, "Paris.", FinishReason::Stop), "Paris.");
    assert_eq!(c.completion_tokens, 6);
    assert_eq!(c.cached_tokens, 16, "the first admission's");
    assert_eq!(c.workers, ["a/replica-0", "b/replica-1"]);
    assert_eq!(c.finish, Some(FinishReason::Stop));
    // After the end, nothing more goes out.
    assert_eq!(
        c.on_event(token(b'x'.into(), None)).unwrap(),
        Produced::default()
    );
}

/// Text that might start a stop string is held back; a match ends the choice with `stop`,
/// names the stop string, and neither its text nor its tokens' logprobs are ever sent.
#[test]
fn a_stop_string_is_never_sent_nor_its_logprobs() {
    let prompt = ids("Q:");
    let stops = vec!["END".to_owned()];
    let mut c = ChoiceText::new(
        tokenizer(),
        ChoiceSpec {
            logprobs: true,
            ..spec(&prompt, &stops)
        },
    );
    let mut sent = String::new();
    let mut logprobs = 0;
    for id in ids("okEN") {
        let p = c.on_event(token(id, None)).unwrap();
        sent.push_str(&p.text);
        logprobs += p.logprobs.len();
    }
    assert_eq!(sent, "ok", "`EN` may start the stop string: held back");
    assert_eq!(logprobs, 2, "only the sent tokens' logprobs");
    let p = c.on_event(token(b'D'.into(), None)).unwrap();
    assert_eq!((p.text.as_str(), p.logprobs.len()), ("", 0));
    assert_eq!(c.finish, Some(FinishReason::Stop));
    assert_eq!(c.stop_sequence.as_deref(), Some("END"));
    assert_eq!(c.completion_tokens, 5, "the stop match's tokens count");
}

/// A held-back prefix that turns out not to be a stop string goes out with its logprobs;
/// at the end, what is held goes out too.
#[test]
fn held_text_goes_out_when_it_is_not_a_stop_string() {
    let prompt = ids("Q:");
    let stops = vec!["END".to_owned()];
    let mut c = ChoiceText::new(
        tokenizer(),
        ChoiceSpec {
            logprobs: true,
            token_ids: true,
            ..spec(&prompt, &stops)
        },
    );
    let held = c.on_event(token(b'E'.into(), None)).unwrap();
    assert_eq!((held.text.as_str(), held.logprobs.len()), ("", 0));
    assert_eq!(
        held.token_ids,
        [u32::from(b'E')],
        "ids go out with the event"
    );
    let p = c.on_event(token(b'x'.into(), None)).unwrap();
    assert_eq!(p.text, "Ex");
    assert_eq!(
        p.logprobs.len(),
        2,
        "the held token's logprob with its text"
    );
    c.on_event(token(b'E'.into(), None)).unwrap();
    let last = c
        .on_event(token(b'N'.into(), Some(FinishReason::Length)))
        .unwrap();
    assert_eq!(last.text, "EN", "the end releases what was held");
    assert_eq!(c.finish, Some(FinishReason::Length));
    assert_eq!(c.stop_sequence, None);
}

/// `echo`: the prompt goes out first — at once without logprobs, and with them only once
/// the worker has scored every prompt token (the first one has none); `max_tokens: 0`
/// (`prompt_only`) drops the sampled token and ends with `length`.
#[test]
fn echo_sends_the_prompt_first_with_its_logprobs_once_scored() {
    let prompt = ids("Hi!");
    let mut c = ChoiceText::new(
        tokenizer(),
        ChoiceSpec {
            echo: Some(Some("Hi!")),
            logprobs: true,
            prompt_only: true,
            ..spec(&prompt, &[])
        },
    );
    let part = c
        .on_event(TokenEventKind::Prompt {
            first: 1,
            logprobs: vec![(-1.0, vec![])],
        })
        .unwrap();
    assert_eq!(part, Produced::default(), "one of two scores: not yet");
    let all = c
        .on_event(TokenEventKind::Prompt {
            first: 2,
            logprobs: vec![(-2.0, vec![(7, -0.1)])],
        })
        .unwrap();
    assert_eq!(all.text, "Hi!");
    let lps: Vec<Option<f32>> = all.logprobs.iter().map(|l| l.logprob).collect();
    assert_eq!(lps, [None, Some(-1.0), Some(-2.0)]);
    let t = c.on_event(token(b'x'.into(), None)).unwrap();
    assert_eq!(t, Produced::default(), "the sampled token is dropped");
    assert_eq!(c.finish, Some(FinishReason::Length));
    assert_eq!(c.completion_tokens, 0);

    // Without logprobs, a token-id prompt is echoed decoded, just before the first token.
    let mut c = ChoiceText::new(
        tokenizer(),
        ChoiceSpec {
            echo: Some(None),
            ..spec(&prompt, &[])
        },
    );
    let p = c
        .on_event(token(b'?'.into(), Some(FinishReason::Stop)))
        .unwrap();
    assert_eq!(p.text, "Hi!?");
    assert!(p.counted);
}

/// A failed or lost request is an error of the choice.
#[test]
fn a_failed_or_lost_request_is_an_error() {
    let prompt = ids("Q:");
    let mut c = ChoiceText::new(tokenizer(), spec(&prompt, &[]));
    let e = c
        .on_event(TokenEventKind::Failed {
            message: "no worker".into(),
            status: 503,
        })
        .unwrap_err();
    assert_eq!(e.status().as_u16(), 503, "{e:?}");
}
