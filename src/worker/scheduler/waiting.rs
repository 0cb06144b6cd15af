//! [`Waiting`]: a replica's waiting queue — one first-come-first-served lane per priority
//! class, served by deficit round robin on uncached prompt tokens
//! (`request_plane/priority.rs`), and the preempted sequences, resumed before any lane.
//!
//! "First come" is since when the client has waited for the sequence's next token (its
//! arrival, or its last token before a migration: `SeqRequest::waiting_since`). With no class
//! configured every sequence is in the one unclassed lane.

use std::collections::{HashMap, VecDeque};

use crate::request_plane::priority::{ClassTag, Drr};
use crate::runtime::ids::SeqId;

/// Where a sequence waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// In lane `l` (charged when admitted).
    Lane(usize),
    /// Preempted: resumed first, not charged again.
    Resume,
}

/// The next sequence to admit, as [`Waiting::peek`] gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Head {
    pub seq: SeqId,
    place: Place,
}

/// The waiting queue (module docs).
#[derive(Debug, Default)]
pub(super) struct Waiting {
    /// Per lane: `(waiting since, seq)`, longest waiting first (stable for equal times).
    lanes: Vec<VecDeque<(u64, SeqId)>>,
    resume: VecDeque<SeqId>,
    drr: Drr,
    place: HashMap<SeqId, Place>,
}

impl Waiting {
    /// Queue `seq` in its class's lane after every sequence that has waited at least as long
    /// (`since`: ms since the Unix epoch).
    pub fn insert(&mut self, seq: SeqId, class: Option<&ClassTag>, since: u64) {
        let l = self.drr.lane(class);
        if self.lanes.len() <= l {
            self.lanes.resize_with(l + 1, VecDeque::new);
        }
        let lane = &mut self.lanes[l];
        let at = lane.partition_point(|&(a, _)| a <= since);
        lane.insert(at, (since, seq));
        self.drr.activate(l);
        self.place.insert(seq, Place::Lane(l));
    }

    /// Queue a preempted sequence: resumed before any lane, newest preemption first.
    pub fn push_resume(&mut self, seq: SeqId) {
        self.resume.push_front(seq);
        self.place.insert(seq, Place::Resume);
    }

    /// The sequence to admit next (the arbiter's turn moves only when it is admitted or its
    /// lane empties).
    pub fn peek(&mut self) -> Option<Head> {
        if let Some(&seq) = self.resume.front() {
            return Some(Head {
                seq,
                place: Place::Resume,
            });
        }
        let lanes = &self.lanes;
        let l = self
            .drr
            .next(|l| lanes.get(l).is_some_and(|q| !q.is_empty()))?;
        let &(_, seq) = self.lanes[l].front()?;
        Some(Head {
            seq,
            place: Place::Lane(l),
        })
    }

    /// `head` was admitted, computing `cost` uncached prompt tokens: it leaves the queue and
    /// its lane is charged.
    pub fn admitted(&mut self, head: Head, cost: u64) {
        match head.place {
            Place::Resume => {
                self.resume.pop_front();
            }
            Place::Lane(l) => {
                self.lanes[l].pop_front();
                self.drr.charge(l, cost);
            }
        }
        self.place.remove(&head.seq);
    }

    /// Removes `seq` wherever it waits (cancelled). False if it does not wait.
    pub fn remove(&mut self, seq: SeqId) -> bool {
        match self.place.remove(&seq) {
            Some(Place::Resume) => self.resume.retain(|&s| s != seq),
            Some(Place::Lane(l)) => self.lanes[l].retain(|&(_, s)| s != seq),
            None => return false,
        }
        true
    }

    /// Sequences waiting.
    pub fn len(&self) -> usize {
        self.place.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(name: &str, quantum: u32) -> ClassTag {
        ClassTag {
            name: name.into(),
            quantum,
        }
    }

    #[test]
    fn one_lane_serves_the_longest_waiting_first() {
        let mut w = Waiting::default();
        w.insert(SeqId(1), None, 10);
        w.insert(SeqId(2), None, 5);
        w.insert(SeqId(3), None, 10);
        let mut order = Vec::new();
        while let Some(h) = w.peek() {
            order.push(h.seq.0);
            w.admitted(h, 1_000);
        }
        assert_eq!(order, [2, 1, 3]);
        assert_eq!(w.len(), 0);
    }

    #[test]
    fn preempted_resume_first_and_cancels_leave() {
        let mut w = Waiting::default();
        let a = tag("a", 512);
        w.insert(SeqId(1), Some(&a), 1);
        w.insert(SeqId(2), Some(&a), 2);
        w.push_resume(SeqId(9));
        assert_eq!(w.peek().unwrap().seq, SeqId(9));
        assert!(w.remove(SeqId(9)));
        assert!(w.remove(SeqId(1)));
        assert!(!w.remove(SeqId(1)));
        assert_eq!(w.peek().unwrap().seq, SeqId(2));
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn classes_alternate_by_quantum() {
        let mut w = Waiting::default();
        let (hi, lo) = (tag("hi", 512), tag("lo", 128));
        for i in 0..200 {
            w.insert(SeqId(i), Some(&hi), i);
            w.insert(SeqId(1_000 + i), Some(&lo), i);
        }
        // 100 admissions of 128 tokens each: 4 of hi for every 1 of lo.
        let mut hi_n = 0;
        for _ in 0..100 {
            let h = w.peek().unwrap();
            hi_n += usize::from(h.seq.0 < 1_000);
            w.admitted(h, 128);
        }
        assert!((78..=82).contains(&hi_n), "{hi_n}");
    }
}
