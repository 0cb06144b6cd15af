use std::sync::Arc;

use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::*;

const SPECIAL: &str = "<|im_end|>";

/// A byte-level BPE with all 256 bytes, merges that build `é` whole and split `日`, `本` and
/// `🎉` into multi-byte pieces, and one special token.
fn tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut merges = Vec::new();
    let mut merge = |a: &[u8], b: &[u8]| {
        let (a, b): (String, String) = (
            a.iter().map(|&x| byte_char(x)).collect(),
            b.iter().map(|&x| byte_char(x)).collect(),
        );
        tokens.push(format!("{a}{b}"));
        merges.push((a, b));
    };
    let e = "é".as_bytes();
    merge(&e[..1], &e[1..]);
    for s in ["日", "本", "🎉"] {
        let b = s.as_bytes();
        merge(&b[..1], &b[1..2]);
    }
    merge(b"h", b"e");
    merge(b"l", b"l");
    let vocab: Vocab = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .unwrap();
    let mut tk = Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(ByteLevel::default()));
    tk.with_decoder(Some(ByteLevel::default()));
    tk.add_special_tokens(&[AddedToken::from(SPECIAL, true)]);
    tk
}

fn special_id(tk: &Tokenizer) -> u32 {
    tk.token_to_id(SPECIAL).unwrap()
}

/// Stream `ids` and check every delta; return the joined text.
fn stream(tk: &Tokenizer, ids: &[u32]) -> String {
    let mut d = IncrementalDetokenizer::new(tk);
    let mut out = String::new();
    for &id in ids {
        let delta = d.step(id).unwrap();
        assert!(!delta.contains('\u{FFFD}'), "broken UTF-8 in {delta:?}");
        for frag in ["<|", "|>", "im_end"] {
            assert!(!delta.contains(frag), "special token text in {delta:?}");
        }
        out.push_str(&delta);
    }
    out.push_str(&d.finish().unwrap());
    out
}

#[test]
fn multibyte_text_streams_exactly() {
    let tk = tokenizer();
    let sp = special_id(&tk);
    for s in [
        "héllo",
        "日本",
        "🎉 party",
        "a é 日本 🎉 mix",
        "hello world",
        "é",
        "🎉🎉🎉",
    ] {
        let ids = tk.encode(s, false).unwrap().get_ids().to_vec();
        assert!(ids.len() > s.chars().count() / 2, "{s}: {ids:?}");
        let expect = tk.decode(&ids, true).unwrap();
        assert_eq!(expect.trim_start(), s);
        assert_eq!(stream(&tk, &ids), expect, "{s}");
        // Special tokens anywhere, even inside a multi-byte char's pieces, vanish.
        for at in 0..=ids.len() {
            let mut with = ids.clone();
            with.insert(at, sp);
            assert_eq!(stream(&tk, &with), expect, "{s} with special at {at}");
        }
        let mut ended = ids.clone();
        ended.extend([sp, sp]);
        assert_eq!(stream(&tk, &ended), expect);
    }
}

#[test]
fn special_token_is_really_special() {
    let tk = tokenizer();
    let ids = tk
        .encode(format!("hi{SPECIAL}"), false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids.last(), Some(&special_id(&tk)));
    assert!(tk.decode(&ids, false).unwrap().contains(SPECIAL));
    assert_eq!(stream(&tk, &ids), tk.decode(&ids, true).unwrap());
}

#[test]
fn partial_char_is_held_until_complete() {
    let tk = tokenizer();
    let ids = tk.encode("日", false).unwrap().get_ids().to_vec();
    // " " then the two pieces of 日.
    let mut d = IncrementalDetokenizer::new(Arc::new(tk));
    let mut deltas: Vec<String> = ids.iter().map(|&id| d.step(id).unwrap()).collect();
    deltas.push(d.finish().unwrap());
    assert_eq!(deltas.concat(), " 日");
    assert!(deltas.iter().any(String::is_empty), "{deltas:?}");
    assert_eq!(d.ids(), &ids[..]);
}

#[test]
fn finish_flushes_incomplete_bytes_lossily() {
    let tk = tokenizer();
    let ids = tk.encode("日", false).unwrap().get_ids().to_vec();
    let mut d = IncrementalDetokenizer::new(&tk);
    let cut = &ids[..ids.len() - 1];
    let streamed: String = cut.iter().map(|&id| d.step(id).unwrap()).collect();
    assert_eq!(streamed, " ");
    assert_eq!(d.finish().unwrap(), "\u{FFFD}");
    assert_eq!(d.finish().unwrap(), "");
}

#[test]
fn context_from_prompt_is_not_emitted() {
    let tk = tokenizer();
    let prompt = tk.encode("hello 日本", false).unwrap().get_ids().to_vec();
    let generated = tk.encode("é 🎉", false).unwrap().get_ids().to_vec();
    let mut d = IncrementalDetokenizer::with_context(&tk, &prompt);
    let mut out: String = generated.iter().map(|&id| d.step(id).unwrap()).collect();
    out.push_str(&d.finish().unwrap());
    assert_eq!(out, tk.decode(&generated, true).unwrap());
    assert_eq!(d.ids().len(), CONTEXT_TOKENS + generated.len());
}

#[test]
fn out_of_vocab_id_does_not_panic() {
    let tk = tokenizer();
    let mut d = IncrementalDetokenizer::new(&tk);
    let _ = d.step(u32::MAX);
    let _ = d.finish();
    let e: ApiError = DetokError("x".into()).into();
    assert_eq!(e.status().as_u16(), 500);
    assert!(!e.message.contains('x'));
}
