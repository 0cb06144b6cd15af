//! Incremental detokenization: turn generated token ids into text deltas that
//! are always whole UTF-8 chars and never contain a special token's text.
//!
//! The method of vLLM's `detokenize_incrementally` and TGI's `decode_token`: keep every id;
//! on each new id decode the window `ids[prefix_offset..read_offset]` (already emitted) and
//! `ids[prefix_offset..]`, both with `skip_special_tokens = true`, and emit the difference once
//! it does not end in U+FFFD (an incomplete byte sequence). Then the window slides:
//! `prefix_offset = read_offset`, `read_offset = ids.len()`. Decoding a short window instead of
//! the whole text keeps each step O(window) and still lets decoders that depend on the previous
//! token (leading spaces of SentencePiece, byte fallback) see it.
//!
//! [`IncrementalDetokenizer::with_context`] seeds the window with the last prompt tokens, as
//! vLLM does, so the first generated token is decoded in context. [`IncrementalDetokenizer::finish`]
//! flushes what is still pending; at that point an incomplete byte sequence is emitted as
//! U+FFFD (the tokenizer's lossy decoding), since no more bytes can complete it.
//!
//! Without context, the concatenation of all deltas and `finish()` equals
//! `tokenizer.decode(all ids, true)` for byte-level BPE tokenizers (pinned by the tests).

use std::borrow::Borrow;

use tokenizers::Tokenizer;

use crate::openai::error::{ApiError, ErrorKind};

#[cfg(test)]
mod tests;

/// GPT-2's byte-to-char map, as the byte-level pre-tokenizer uses it: the vocabulary of the
/// byte-level tokenizers the tests build.
#[cfg(test)]
pub(crate) fn byte_char(b: u8) -> char {
    let printable = |b: u8| {
        (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    if printable(b) {
        char::from(b)
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).expect("a char")
    }
}

/// Prompt tokens used as decoding context by [`IncrementalDetokenizer::with_context`].
pub const CONTEXT_TOKENS: usize = 5;

/// Decoding failed inside the tokenizer.
#[derive(Debug, thiserror::Error)]
#[error("detokenization failed: {0}")]
pub struct DetokError(String);

impl From<DetokError> for ApiError {
    /// Internal: the detail stays in logs, the client gets a generic message.
    fn from(_: DetokError) -> Self {
        ApiError::new(
            ErrorKind::Internal,
            "internal error while decoding generated tokens",
        )
    }
}

/// Streaming detokenizer of one choice. `T` is any owner or borrower of a
/// [`Tokenizer`]: `&Tokenizer`, `Arc<Tokenizer>`, `Tokenizer`.
#[derive(Clone, Debug)]
pub struct IncrementalDetokenizer<T> {
    tokenizer: T,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl<T: Borrow<Tokenizer>> IncrementalDetokenizer<T> {
    /// A detokenizer with no context.
    pub fn new(tokenizer: T) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// A detokenizer whose window starts with the last [`CONTEXT_TOKENS`] ids of `prompt`
    /// (never emitted themselves).
    pub fn with_context(tokenizer: T, prompt: &[u32]) -> Self {
        let tail = &prompt[prompt.len().saturating_sub(CONTEXT_TOKENS)..];
        Self {
            tokenizer,
            ids: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
        }
    }

    fn decode(&self, from: usize, to: usize) -> Result<String, DetokError> {
        let ids = self.ids.get(from..to).unwrap_or_default();
        self.tokenizer
            .borrow()
            .decode(ids, true)
            .map_err(|e| DetokError(e.to_string()))
    }

    /// The text newly emitted between `read_offset` and the end, if it is complete.
    fn pending(&self) -> Result<Option<String>, DetokError> {
        let before = self.decode(self.prefix_offset, self.read_offset)?;
        let now = self.decode(self.prefix_offset, self.ids.len())?;
        if now.len() <= before.len() {
            return Ok(None);
        }
        // `before` is normally a prefix of `now`; if a decoder rewrote the window, fall back to
        // the bytes past `before`'s length, at a char boundary.
        let mut cut = before.len();
        while !now.is_char_boundary(cut) {
            cut += 1;
        }
        Ok(Some(now[cut..].to_owned()))
    }

    /// Add one generated id and return the text that is now final (possibly empty).
    ///
    /// # Errors
    /// The tokenizer cannot decode the ids.
    pub fn step(&mut self, id: u32) -> Result<String, DetokError> {
        self.ids.push(id);
        match self.pending()? {
            Some(delta) if !delta.ends_with('\u{FFFD}') => {
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                Ok(delta)
            }
            _ => Ok(String::new()),
        }
    }

    /// Generation ended: return whatever is still pending.
    ///
    /// # Errors
    /// The tokenizer cannot decode the ids.
    pub fn finish(&mut self) -> Result<String, DetokError> {
        let delta = self.pending()?.unwrap_or_default();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// Generated ids so far (context ids included when seeded with a prompt).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
