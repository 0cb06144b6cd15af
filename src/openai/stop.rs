//! Incremental stop-string matching.
//!
//! Semantics (the same for one-shot [`apply_stop`] and streaming [`StopMatcher`], whatever the
//! split into deltas): generation stops at the first position in the text where some stop
//! string has been completely seen, i.e. the match with the smallest end; among matches ending
//! there, the longest. The output is the text before that match; the match and everything
//! after it are never released. Stop strings are matched on exact bytes, which are whole chars
//! because both sides are `str`.
//!
//! While streaming, the longest suffix of the unreleased text that is a proper prefix of some
//! stop string is held back: no match can start before it, so everything before it is final.
//! [`StopMatcher::finish`] releases what is held back when generation ends for another reason
//! (`length`, end-of-sequence), so no text is dropped.

#[cfg(test)]
mod tests;

/// What one fed delta produced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopStep {
    /// Text that is final and may be sent now.
    pub release: String,
    /// The stop string that matched, if this delta completed a match.
    pub stopped: Option<String>,
}

/// The earliest-ending match in `text`: `(start, stop index)`.
fn earliest_match(stops: &[String], text: &str) -> Option<(usize, usize)> {
    // Key: smallest end, then smallest start (the longest match ending there).
    stops
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            text.find(s.as_str())
                .map(|start| (start + s.len(), start, i))
        })
        .min()
        .map(|(_, start, i)| (start, i))
}

/// Stop strings with the empty ones removed (an empty stop string would match everywhere;
/// request validation rejects them, this is belt and braces).
fn clean(stops: &[String]) -> Vec<String> {
    stops.iter().filter(|s| !s.is_empty()).cloned().collect()
}

/// One-shot reference: the released text of a whole generation and the stop that matched.
pub fn apply_stop(stops: &[String], text: &str) -> (String, Option<String>) {
    let stops = clean(stops);
    match earliest_match(&stops, text) {
        Some((start, i)) => (text[..start].to_owned(), Some(stops[i].clone())),
        None => (text.to_owned(), None),
    }
}

/// Streaming stop-string matcher for one choice.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Bytes of the longest stop string.
    max_len: usize,
    /// Unreleased text: a proper prefix of some stop string.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        let stops = clean(stops);
        let max_len = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            max_len,
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// The text currently held back.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Feed the next text delta. After a stop, everything fed is discarded.
    pub fn feed(&mut self, delta: &str) -> StopStep {
        if self.stopped {
            return StopStep::default();
        }
        let mut text = std::mem::take(&mut self.held);
        text.push_str(delta);
        if let Some((start, i)) = earliest_match(&self.stops, &text) {
            self.stopped = true;
            text.truncate(start);
            return StopStep {
                release: text,
                stopped: Some(self.stops[i].clone()),
            };
        }
        let keep_from = self.hold_from(&text);
        self.held = text.split_off(keep_from);
        StopStep {
            release: text,
            stopped: None,
        }
    }

    /// Generation ended without a stop string: release what is held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Start of the longest suffix of `text` that is a proper prefix of some stop string
    /// (`text.len()` when there is none). Only char boundaries are tried: a suffix starting
    /// inside a char cannot be a prefix of a valid string.
    fn hold_from(&self, text: &str) -> usize {
        let earliest = text.len().saturating_sub(self.max_len.saturating_sub(1));
        text.char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= earliest)
            .find(|&i| {
                let suffix = &text[i..];
                self.stops
                    .iter()
                    .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            })
            .unwrap_or(text.len())
    }
}
