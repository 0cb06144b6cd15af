//! The fleet page stream's recent past ([`PageHistory`]), replayed to a page when it
//! connects; and the kinds of records of that stream ([`FeedKind`]). Filled by
//! [`super::record`]; kept in the gateway's shared state.

use std::sync::Arc;

/// `view` frames a page gets when it connects: as many as its charts keep (`page.js`,
/// `HISTORY`), 2–5 minutes at a frame every 0.5–2 s.
pub const HISTORY_VIEWS: usize = 150;
/// `fleet` events a page gets when it connects, placements aside: as many as its event log
/// keeps (`page.js`, `MAX_EVENTS`; the log leaves placements out).
pub const HISTORY_EVENTS: usize = 200;
/// `placed` events a page gets when it connects (its decisions table and its heat strip over
/// 30 s); kept apart, so that a busy fleet's placements do not push the faults, migrations
/// and give-ups out of the history.
pub const HISTORY_PLACEMENTS: usize = 200;

/// The page stream's recent past (see the module doc); shared by the gateway's routes.
#[derive(Clone, Debug, Default)]
pub struct PageHistory(Arc<std::sync::Mutex<History>>);

#[derive(Debug, Default)]
struct History {
    views: std::collections::VecDeque<String>,
    events: std::collections::VecDeque<String>,
    placements: std::collections::VecDeque<String>,
}

impl PageHistory {
    fn lock(&self) -> std::sync::MutexGuard<'_, History> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keep one record of the stream, dropping the oldest of its kind past the bound. A
    /// `lagged` record is the recorder's own, not the fleet's: not kept.
    pub fn push(&self, kind: FeedKind, data: String) {
        let mut h = self.lock();
        let (q, bound) = match kind {
            FeedKind::View => (&mut h.views, HISTORY_VIEWS),
            FeedKind::Fleet => (&mut h.events, HISTORY_EVENTS),
            FeedKind::Placed => (&mut h.placements, HISTORY_PLACEMENTS),
            FeedKind::Lagged => return,
        };
        q.push_back(data);
        while q.len() > bound {
            q.pop_front();
        }
    }

    /// What a connecting page gets first: the frames, the events, then the placements, each
    /// oldest first.
    pub fn replay(&self) -> Vec<(FeedKind, String)> {
        let h = self.lock();
        h.views
            .iter()
            .map(|d| (FeedKind::View, d.clone()))
            .chain(h.events.iter().map(|d| (FeedKind::Fleet, d.clone())))
            .chain(h.placements.iter().map(|d| (FeedKind::Placed, d.clone())))
            .collect()
    }
}

/// The kinds of records of the page's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedKind {
    /// A fleet view frame ([`super::frame`]; SSE `event: view`).
    View,
    /// A fleet event other than a placement (`event: fleet`).
    Fleet,
    /// A `placed` fleet event (`event: fleet`).
    Placed,
    /// `{"event":"lagged"}`: this stream fell behind the bus (`event: fleet`).
    Lagged,
}

impl FeedKind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::View => "view",
            Self::Fleet | Self::Placed | Self::Lagged => "fleet",
        }
    }
}
