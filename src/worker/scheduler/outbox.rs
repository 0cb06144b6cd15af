//! [`Outbox`]: token events queued per owner until they are delivered, and when an owner that
//! cannot be reached counts as gone. Pure: delivery and the owner's status come from the
//! caller, time from an injected [`Clock`](crate::runtime::clock::Clock).
//!
//! # The rule
//! - Events are delivered in one batch per owner, in the order they were queued.
//! - A batch that cannot be delivered (the owner's token sink is away, e.g. restarting) stays
//!   queued, in order, ahead of whatever comes next, and is retried on the next flush.
//! - An owner is gone when its node runs a newer incarnation ([`OwnerStatus::Replaced`]), or
//!   when it has been missing ([`OwnerStatus::Missing`]) for the grace period, counted from
//!   the first time it was seen missing; being seen present again resets that. A gone owner's
//!   queued events are dropped and the caller aborts its sequences.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

use crate::request_plane::protocol::OwnerStatus;
use crate::runtime::clock::{Instant, SharedClock};

/// Events per owner, and since when each unreachable owner has been missing.
#[derive(Debug)]
pub struct Outbox<K, E> {
    clock: SharedClock,
    grace: Duration,
    queued: HashMap<K, Vec<E>>,
    /// Owners whose token sink could not be found, since when.
    missing_since: HashMap<K, Instant>,
}

impl<K: Eq + Hash + Clone, E> Outbox<K, E> {
    /// An empty outbox whose missing owners count as gone after `grace`.
    pub fn new(clock: SharedClock, grace: Duration) -> Self {
        Self {
            clock,
            grace,
            queued: HashMap::new(),
            missing_since: HashMap::new(),
        }
    }

    /// Queue `event` for `to`.
    pub fn push(&mut self, to: &K, event: E) {
        self.queued.entry(to.clone()).or_default().push(event);
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// The events queued for `owner`, oldest first.
    pub fn queued(&self, owner: &K) -> &[E] {
        self.queued.get(owner).map_or(&[], Vec::as_slice)
    }

    /// Hands each owner's queued events to `deliver`, which gives them back when they could
    /// not be delivered; those stay queued unless `status` shows the owner gone. Returns the
    /// owners found gone (their events dropped), whose sequences the caller aborts.
    pub fn flush(
        &mut self,
        mut deliver: impl FnMut(&K, Vec<E>) -> Result<(), Vec<E>>,
        mut status: impl FnMut(&K) -> OwnerStatus,
    ) -> Vec<K> {
        let mut gone = Vec::new();
        for (owner, events) in std::mem::take(&mut self.queued) {
            match deliver(&owner, events) {
                Ok(()) => {
                    self.missing_since.remove(&owner);
                }
                Err(events) => {
                    if self.is_gone(&owner, status(&owner)) {
                        self.forget(&owner);
                        gone.push(owner);
                    } else {
                        self.queued.insert(owner, events);
                    }
                }
            }
        }
        gone
    }

    /// Whether `owner`, whose status is `status`, is gone (see the module doc). Records when a
    /// missing owner was first seen missing.
    pub fn is_gone(&mut self, owner: &K, status: OwnerStatus) -> bool {
        match status {
            OwnerStatus::Present => {
                self.missing_since.remove(owner);
                false
            }
            OwnerStatus::Replaced => true,
            OwnerStatus::Missing => {
                let now = self.clock.now();
                let since = *self.missing_since.entry(owner.clone()).or_insert(now);
                now.duration_since(since) >= self.grace
            }
        }
    }

    /// Drop `owner`'s queued events and its missing-since record.
    pub fn forget(&mut self, owner: &K) {
        self.queued.remove(owner);
        self.missing_since.remove(owner);
    }

    /// Keep the missing-since records of the owners `keep` accepts only (those that still
    /// own sequences).
    pub fn retain_missing(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.missing_since.retain(|o, _| keep(o));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::runtime::clock::ManualClock;

    const GRACE: Duration = Duration::from_millis(500);

    fn outbox() -> (ManualClock, Outbox<&'static str, u32>) {
        let clock = ManualClock::new();
        (clock.clone(), Outbox::new(Arc::new(clock), GRACE))
    }

    /// Delivers to `to` only, recording what arrived.
    fn deliver_to<'a>(
        to: &'a str,
        got: &'a mut Vec<(&'static str, Vec<u32>)>,
    ) -> impl FnMut(&&'static str, Vec<u32>) -> Result<(), Vec<u32>> + 'a {
        move |o, events| {
            if *o == to {
                got.push((*o, events));
                Ok(())
            } else {
                Err(events)
            }
        }
    }

    #[test]
    fn events_go_out_in_one_batch_per_owner_in_order() {
        let (_, mut ob) = outbox();
        for e in [1, 2, 3] {
            ob.push(&"a", e);
        }
        let mut got = Vec::new();
        let gone = ob.flush(deliver_to("a", &mut got), |_| OwnerStatus::Present);
        assert!(gone.is_empty());
        assert_eq!(got, vec![("a", vec![1, 2, 3])]);
        assert!(ob.is_empty());
    }

    #[test]
    fn undelivered_events_stay_in_order_ahead_of_later_ones() {
        let (_, mut ob) = outbox();
        ob.push(&"a", 1);
        ob.push(&"a", 2);
        let mut got = Vec::new();
        assert!(
            ob.flush(deliver_to("b", &mut got), |_| OwnerStatus::Missing)
                .is_empty()
        );
        ob.push(&"a", 3);
        assert_eq!(ob.queued(&"a"), &[1, 2, 3]);
        assert!(got.is_empty());
        let gone = ob.flush(deliver_to("a", &mut got), |_| OwnerStatus::Missing);
        assert!(gone.is_empty());
        assert_eq!(got, vec![("a", vec![1, 2, 3])]);
    }

    #[test]
    fn a_missing_owner_is_gone_after_the_grace_counted_from_first_seen() {
        let (clock, mut ob) = outbox();
        ob.push(&"a", 1);
        let mut got = Vec::new();
        assert!(
            ob.flush(deliver_to("none", &mut got), |_| OwnerStatus::Missing)
                .is_empty()
        );
        clock.advance(GRACE - Duration::from_millis(1));
        assert!(
            ob.flush(deliver_to("none", &mut got), |_| OwnerStatus::Missing)
                .is_empty(),
            "still within the grace"
        );
        clock.advance(Duration::from_millis(1));
        let gone = ob.flush(deliver_to("none", &mut got), |_| OwnerStatus::Missing);
        assert_eq!(gone, vec!["a"]);
        assert!(ob.is_empty(), "a gone owner's events are dropped");
        assert!(got.is_empty());
    }

    #[test]
    fn being_seen_present_or_delivered_to_resets_the_grace() {
        let (clock, mut ob) = outbox();
        assert!(!ob.is_gone(&"a", OwnerStatus::Missing));
        clock.advance(GRACE - Duration::from_millis(1));
        assert!(!ob.is_gone(&"a", OwnerStatus::Present));
        clock.advance(Duration::from_millis(1));
        assert!(
            !ob.is_gone(&"a", OwnerStatus::Missing),
            "missing again: the grace starts over"
        );
        // A delivery also proves the owner is there.
        ob.push(&"a", 1);
        let mut got = Vec::new();
        assert!(
            ob.flush(deliver_to("a", &mut got), |_| OwnerStatus::Missing)
                .is_empty()
        );
        clock.advance(GRACE - Duration::from_millis(1));
        assert!(!ob.is_gone(&"a", OwnerStatus::Missing));
        clock.advance(GRACE);
        assert!(ob.is_gone(&"a", OwnerStatus::Missing));
    }

    #[test]
    fn a_replaced_owner_is_gone_at_once() {
        let (_, mut ob) = outbox();
        ob.push(&"a", 1);
        ob.push(&"b", 2);
        let mut got = Vec::new();
        let gone = ob.flush(deliver_to("b", &mut got), |_| OwnerStatus::Replaced);
        assert_eq!(gone, vec!["a"]);
        assert_eq!(got, vec![("b", vec![2])]);
        assert!(ob.is_gone(&"c", OwnerStatus::Replaced));
    }

    #[test]
    fn forgotten_and_unkept_owners_start_their_grace_over() {
        let (clock, mut ob) = outbox();
        assert!(!ob.is_gone(&"a", OwnerStatus::Missing));
        assert!(!ob.is_gone(&"b", OwnerStatus::Missing));
        clock.advance(GRACE);
        ob.retain_missing(|o| *o == "b");
        assert!(
            !ob.is_gone(&"a", OwnerStatus::Missing),
            "a's record was dropped"
        );
        assert!(ob.is_gone(&"b", OwnerStatus::Missing));
        ob.push(&"b", 1);
        ob.forget(&"b");
        assert!(ob.is_empty());
        assert!(!ob.is_gone(&"b", OwnerStatus::Missing));
    }
}
