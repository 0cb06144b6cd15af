//! Text prompts for gateways that take no token ids (`flotilla bench --text-prompts`).
//!
//! Trace workloads give prompts as token-id segments (`synth.rs`), sent as `prompt: [ids]` on
//! `/v1/completions`. Some peers (SGLang's and vLLM's routers) accept only text there. This
//! writes each id as one word of the model's own vocabulary that is a single token with a
//! leading space (`" cat"`): concatenated, such words tokenize back to one token each, so a
//! text prompt has the trace's length and its shared prefixes stay shared token for token
//! (a word never merges with its neighbours across a space in a GPT-2-style BPE).

use std::path::Path;

/// The id → word map.
#[derive(Debug)]
pub struct TextPrompts {
    words: Vec<String>,
}

/// Words of at least this many letters (short ones are more likely to be stop words that
/// some templates or tokenizers treat specially).
const MIN_LETTERS: usize = 3;
/// …and at most this many.
const MAX_LETTERS: usize = 10;

impl TextPrompts {
    /// From the model at `path` (GGUF or Hugging Face folder): its single-token words.
    ///
    /// # Errors
    /// The tokenizer cannot be loaded, or has fewer than 1 000 such words.
    pub fn from_model(path: &Path) -> anyhow::Result<Self> {
        let fe = crate::request_plane::frontend::Frontend::load(path, usize::MAX)?;
        let tok = &fe.tokenizer;
        let mut words = Vec::new();
        for id in 0..fe.vocab_size as u32 {
            let Ok(s) = tok.decode(&[id], false) else {
                continue;
            };
            let Some(rest) = s.strip_prefix(' ') else {
                continue;
            };
            if !(MIN_LETTERS..=MAX_LETTERS).contains(&rest.len())
                || !rest.bytes().all(|b| b.is_ascii_lowercase())
            {
                continue;
            }
            if tok.encode(&s).ok().as_deref() == Some(&[id][..]) {
                words.push(s);
            }
        }
        anyhow::ensure!(
            words.len() >= 1_000,
            "the tokenizer of {} has only {} single-token words",
            path.display(),
            words.len()
        );
        Ok(Self { words })
    }

    /// Words available.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Never empty (see [`TextPrompts::from_model`]).
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// The text of `ids`: one word per id.
    pub fn text(&self, ids: &[u32]) -> String {
        let mut out = String::with_capacity(ids.len() * 8);
        for &id in ids {
            out.push_str(&self.words[id as usize % self.words.len()]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_id_is_one_token_and_prefixes_stay_shared() {
        let path = crate::model::resolve_model_path(None).expect("the default model");
        let t = TextPrompts::from_model(&path).unwrap();
        assert!(t.len() >= 1_000, "{}", t.len());
        let tok = crate::request_plane::frontend::Frontend::load(&path, usize::MAX)
            .unwrap()
            .tokenizer;
        let a: Vec<u32> = (0..600u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let mut b = a[..400].to_vec();
        b.extend((0..200u32).map(|i| i.wrapping_mul(40_503) + 7));
        let ta = tok.encode(&t.text(&a)).unwrap();
        let tb = tok.encode(&t.text(&b)).unwrap();
        assert_eq!(ta.len(), a.len());
        assert_eq!(tb.len(), b.len());
        assert_eq!(
            ta[..400],
            tb[..400],
            "the shared 400 ids are 400 shared tokens"
        );
        assert_ne!(ta[400], tb[400]);
    }
}
