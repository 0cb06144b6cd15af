//! One planner leads: a lease granted by a majority of the cluster's nodes, with a term that
//! fences a deposed leader's actions. Pure (times are arguments in ms, on each side's own
//! clock); the Planner actor drives a [`Candidate`] and every node's Discovery a [`Voter`].
//!
//! # The protocol
//!
//! Every node votes ([`Voter`]); nodes with the `planner` role also stand ([`Candidate`]).
//! The voters are every node the candidate's membership table lists, up, suspect or down
//! (down ones until `cluster.down_retention_ms`), so that both sides of a partition count
//! the same N and at most one side can reach a majority, `⌊N/2⌋ + 1`.
//!
//! - A candidate with no live leader in sight raises its term and asks every voter for a vote
//!   in that term ([`VoteRequest`]). A voter grants it when the term is above every term it
//!   has granted and it holds no live lease for another node; granting, it records the term
//!   and the holder and starts a lease of `lease_ms` on its own clock.
//! - With grants from a majority, the candidate leads from the moment it *sent* the round: its
//!   own lease ends `lease_ms × (1 − drift)` after that send, before any voter's (each voter
//!   started its lease on receipt, later, and the drift margin covers clocks that run at
//!   slightly different rates). The leader renews every `renew_ms` with the same term;
//!   each renewal that a majority grants moves its lease end to that round's send time plus
//!   the same span. When its lease ends without a renewal, it steps down — before any voter
//!   can grant a new term, so two leaders never act at once.
//! - A refused request tells the candidate the voter's term, its lease holder and how long the
//!   lease still runs: the candidate adopts the term and waits until that lease has run out
//!   (plus a spread by node, so standbys do not stand at once) before standing again, in a
//!   term above the highest any voter told of (the same term again if it was refused only for
//!   a live lease: terms count elections, not attempts). A
//!   voter never raises its term on a refusal, so a standby that keeps asking never disturbs a
//!   leader that keeps renewing.
//! - **Fencing.** Every decision a leader publishes carries its term; a reconciler remembers
//!   the highest term it has seen and refuses a decision with a lower one
//!   (`control::reconcile::pending`), so a deposed leader on the far side of a partition
//!   cannot act once its successor has been heard of.
//!
//! Take-over after a leader dies: at most `lease_ms` (the voters' leases run out) plus one
//! round, within `cluster.liveness_timeout_ms` with the defaults (lease = ½ of it).

use serde::{Deserialize, Serialize};

use crate::runtime::ids::NodeId;

/// Lease timing (ms).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeaseConfig {
    /// A grant lasts this long on the voter's clock.
    pub lease_ms: u64,
    /// A leader renews this often; a candidate's round is given up after it.
    pub renew_ms: u64,
    /// Fraction of the lease the leader gives up to clock-rate differences (0.1: its lease
    /// runs 90 % of a voter's).
    pub drift: f64,
}

impl LeaseConfig {
    /// From the liveness timeout: the lease half of it, renewed every sixth, 10 % drift, so a
    /// standby takes over within the liveness timeout.
    pub fn from_liveness(liveness_timeout_ms: u64) -> Self {
        let lease_ms = (liveness_timeout_ms / 2).max(10);
        Self {
            lease_ms,
            renew_ms: (lease_ms / 3).max(1),
            drift: 0.1,
        }
    }

    /// What the leader's own lease lasts from a round's send.
    fn leader_span_ms(&self) -> u64 {
        (self.lease_ms as f64 * (1.0 - self.drift.clamp(0.0, 0.9))) as u64
    }
}

/// A candidate asks for a vote (or a leader for a renewal) in `term`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VoteRequest {
    pub term: u64,
    pub candidate: NodeId,
}

/// A voter's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VoteReply {
    pub granted: bool,
    /// The voter's term after the request.
    pub term: u64,
    /// Whom its lease is held by, if any still runs.
    pub leader: Option<NodeId>,
    /// How long that lease still runs on the voter's clock (ms).
    pub lease_left_ms: u64,
}

/// A node's vote: the highest term it granted, to whom, and until when (its clock).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Voter {
    term: u64,
    holder: Option<NodeId>,
    until_ms: u64,
}

impl Voter {
    /// A voter that has just started at `now_ms`: it grants nothing for one lease, so that a
    /// vote it granted before it restarted (votes are not kept on disk) has run out first.
    pub fn quiet(now_ms: u64, cfg: &LeaseConfig) -> Self {
        Self {
            term: 0,
            holder: None,
            until_ms: now_ms + cfg.lease_ms,
        }
    }

    /// Answers `req` at `now_ms` (see the module doc).
    pub fn on_request(&mut self, req: &VoteRequest, now_ms: u64, cfg: &LeaseConfig) -> VoteReply {
        let live = now_ms < self.until_ms;
        let same_holder = self.holder.as_ref() == Some(&req.candidate);
        let grant = if req.term < self.term {
            false
        } else if req.term == self.term {
            // A renewal by the holder, or a first vote in a term no one holds: a term has
            // one holder at most, so that it names one leader (fencing).
            same_holder || self.holder.is_none()
        } else {
            same_holder || !live
        };
        if grant {
            self.term = req.term;
            self.holder = Some(req.candidate.clone());
            self.until_ms = now_ms + cfg.lease_ms;
        }
        let live = now_ms < self.until_ms;
        VoteReply {
            granted: grant,
            term: self.term,
            leader: if live { self.holder.clone() } else { None },
            lease_left_ms: if live { self.until_ms - now_ms } else { 0 },
        }
    }

    /// The highest term granted.
    pub fn term(&self) -> u64 {
        self.term
    }
}

/// Where a candidate stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Standing {
    /// Not leading; `leader` is the node a voter last named as the lease holder.
    Standby { term: u64, leader: Option<NodeId> },
    /// Leading in `term` (every action carries it).
    Leader { term: u64 },
}

impl Standing {
    /// The term: the leader's, or the highest a standby has heard of.
    pub fn term(&self) -> u64 {
        match self {
            Self::Standby { term, .. } | Self::Leader { term } => *term,
        }
    }

    /// Whether it leads.
    pub fn leads(&self) -> bool {
        matches!(self, Self::Leader { .. })
    }
}

/// What a candidate asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseEffect {
    /// Send `request` to every voter, answers to [`Candidate::on_reply`] with `round`.
    Ask { round: u64, request: VoteRequest },
    /// It now leads in `term`.
    Elected { term: u64 },
    /// It stopped leading (its lease ran out without a majority's renewal).
    SteppedDown { term: u64 },
}

/// One open round of requests.
#[derive(Clone, Debug)]
struct Round {
    id: u64,
    term: u64,
    sent_ms: u64,
    granted: std::collections::BTreeSet<NodeId>,
    voters: usize,
}

/// A planner node's side (see the module doc). Drive it with [`Candidate::tick`] (every
/// tick of its actor, with the voters it knows) and [`Candidate::on_reply`].
#[derive(Clone, Debug)]
pub struct Candidate {
    me: NodeId,
    cfg: LeaseConfig,
    term: u64,
    /// Leading until (ms, own clock), if leading.
    lead_until_ms: Option<u64>,
    round: Option<Round>,
    next_round: u64,
    /// Do not stand before (ms): a voter's lease for another runs until then.
    wait_until_ms: u64,
    /// Next renewal (leader) or next try (standby).
    next_ask_ms: u64,
    leader_seen: Option<NodeId>,
    /// This node's place among the planner nodes, to spread their attempts.
    spread_ms: u64,
    /// The highest term a voter has answered with.
    seen_term: u64,
}

impl Candidate {
    /// A standby at term 0; `spread_ms` delays its attempts after a lease runs out (give
    /// each planner node a different one, e.g. its rank × `renew_ms`).
    pub fn new(me: NodeId, cfg: LeaseConfig, spread_ms: u64) -> Self {
        Self {
            me,
            cfg,
            term: 0,
            lead_until_ms: None,
            round: None,
            next_round: 1,
            wait_until_ms: 0,
            next_ask_ms: 0,
            leader_seen: None,
            spread_ms,
            seen_term: 0,
        }
    }

    /// Do not stand before `at_ms`: a node that has just started lets its membership table
    /// fill first, so that it counts every voter (alone, it would be its own majority).
    pub fn hold_until(&mut self, at_ms: u64) {
        self.wait_until_ms = self.wait_until_ms.max(at_ms);
    }

    /// Where it stands now.
    pub fn standing(&self) -> Standing {
        match self.lead_until_ms {
            Some(_) => Standing::Leader { term: self.term },
            None => Standing::Standby {
                term: self.term,
                leader: self.leader_seen.clone(),
            },
        }
    }

    /// Time passes: steps down when its lease has run out, opens a round (stand or renew)
    /// when one is due. `voters`: how many nodes vote (its membership table, itself included).
    pub fn tick(&mut self, now_ms: u64, voters: usize) -> Vec<LeaseEffect> {
        let mut out = Vec::new();
        if let Some(until) = self.lead_until_ms
            && now_ms >= until
        {
            self.lead_until_ms = None;
            self.round = None;
            // Stand again only once every voter's lease for it has run out too.
            self.wait_until_ms = now_ms + self.cfg.lease_ms - self.cfg.leader_span_ms();
            self.next_ask_ms = self.wait_until_ms;
            out.push(LeaseEffect::SteppedDown { term: self.term });
        }
        // A round not answered by a majority within `renew_ms` is given up.
        if let Some(r) = &self.round
            && now_ms >= r.sent_ms + self.cfg.renew_ms
        {
            self.round = None;
        }
        // A leader renews on time; a standby also waits out the leases voters hold for others.
        let leading = self.lead_until_ms.is_some();
        let due = now_ms >= self.next_ask_ms && (leading || now_ms >= self.wait_until_ms);
        if self.round.is_none() && due && voters > 0 {
            if self.lead_until_ms.is_none() {
                // Stand in a term above every term a voter has told of; an attempt refused
                // only for a live lease is made again in the same term, so terms count
                // elections, not attempts.
                self.term = self.term.max(self.seen_term + 1);
            }
            let id = self.next_round;
            self.next_round += 1;
            self.round = Some(Round {
                id,
                term: self.term,
                sent_ms: now_ms,
                granted: Default::default(),
                voters,
            });
            self.next_ask_ms = now_ms + self.cfg.renew_ms;
            out.push(LeaseEffect::Ask {
                round: id,
                request: VoteRequest {
                    term: self.term,
                    candidate: self.me.clone(),
                },
            });
        }
        out
    }

    /// `from`'s answer to round `round`, received at `now_ms`.
    pub fn on_reply(
        &mut self,
        round: u64,
        from: NodeId,
        reply: &VoteReply,
        now_ms: u64,
    ) -> Vec<LeaseEffect> {
        let mut out = Vec::new();
        if !reply.granted {
            // A standby adopts a higher term (it stands above it next); a leader keeps the
            // term it leads in — its decisions carry it — and steps down only when its lease
            // runs out.
            self.seen_term = self.seen_term.max(reply.term);
            if reply.term > self.term && self.lead_until_ms.is_none() {
                self.term = reply.term;
            }
            if let Some(l) = &reply.leader
                && *l != self.me
            {
                self.leader_seen = Some(l.clone());
                if self.lead_until_ms.is_none() {
                    // Wait the lease out, then stand, spread by node.
                    let until = now_ms + reply.lease_left_ms + self.spread_ms;
                    self.wait_until_ms = self.wait_until_ms.max(until);
                }
            }
            return out;
        }
        self.seen_term = self.seen_term.max(reply.term);
        let Some(r) = self.round.as_mut().filter(|r| r.id == round) else {
            return out; // a late answer to a round given up
        };
        r.granted.insert(from);
        if r.granted.len() > r.voters / 2 {
            let (term, sent) = (r.term, r.sent_ms);
            self.round = None;
            let until = sent + self.cfg.leader_span_ms();
            if until <= now_ms {
                return out; // answered too late to lead on
            }
            if self.lead_until_ms.is_none() {
                // It leads in the term the majority granted, even if it heard of a higher
                // one meanwhile (from a voter a rival holds): that is the term its actions
                // carry and its renewals ask for.
                self.term = term;
                self.wait_until_ms = 0;
                self.leader_seen = Some(self.me.clone());
                out.push(LeaseEffect::Elected { term });
            }
            self.lead_until_ms = Some(self.lead_until_ms.unwrap_or(0).max(until));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LeaseConfig {
        LeaseConfig::from_liveness(3_000)
    }

    fn n(s: &str) -> NodeId {
        NodeId::new(s)
    }

    /// A cluster of voters and candidates on one simulated clock, where some voters may be
    /// cut off from some candidates.
    struct World {
        voters: Vec<(NodeId, Voter)>,
        candidates: Vec<Candidate>,
        cut: Vec<(NodeId, NodeId)>,
        now: u64,
        /// (time, candidate) of every moment a candidate led.
        leading: Vec<(u64, usize, u64)>,
    }

    impl World {
        fn new(voters: usize, candidates: usize) -> Self {
            let names: Vec<NodeId> = (0..voters).map(|i| n(&format!("node-{i}"))).collect();
            Self {
                voters: names
                    .iter()
                    .map(|v| (v.clone(), Voter::default()))
                    .collect(),
                candidates: (0..candidates)
                    .map(|i| Candidate::new(names[i].clone(), cfg(), i as u64 * cfg().renew_ms))
                    .collect(),
                cut: Vec::new(),
                now: 0,
                leading: Vec::new(),
            }
        }

        fn reachable(&self, a: &NodeId, b: &NodeId) -> bool {
            !self
                .cut
                .iter()
                .any(|(x, y)| (x == a && y == b) || (x == b && y == a))
        }

        /// Runs `ms` in steps of 50 ms; dead candidates (`dead`) do nothing.
        fn run(&mut self, ms: u64, dead: &[usize]) {
            let end = self.now + ms;
            while self.now < end {
                self.now += 50;
                let total = self.voters.len();
                for c in 0..self.candidates.len() {
                    if dead.contains(&c) {
                        continue;
                    }
                    let effects = self.candidates[c].tick(self.now, total);
                    for e in effects {
                        if let LeaseEffect::Ask { round, request } = e {
                            let me = self.candidates[c].me.clone();
                            for v in 0..self.voters.len() {
                                let id = self.voters[v].0.clone();
                                if !self.reachable(&me, &id) {
                                    continue;
                                }
                                let reply = self.voters[v].1.on_request(&request, self.now, &cfg());
                                self.candidates[c].on_reply(round, id, &reply, self.now);
                            }
                        }
                    }
                    if self.candidates[c].standing().leads() {
                        let term = self.candidates[c].standing().term();
                        self.leading.push((self.now, c, term));
                    }
                }
            }
        }

        fn leaders_at(&self, t: u64) -> Vec<usize> {
            self.leading
                .iter()
                .filter(|(at, _, _)| *at == t)
                .map(|(_, c, _)| *c)
                .collect()
        }

        fn never_two_leaders(&self) {
            let mut t = 0;
            while t <= self.now {
                assert!(self.leaders_at(t).len() <= 1, "two leaders at {t} ms");
                t += 50;
            }
        }
    }

    #[test]
    fn one_of_three_planners_leads_and_keeps_leading() {
        let mut w = World::new(5, 3);
        w.run(1_000, &[]);
        let leaders = w.leaders_at(w.now);
        assert_eq!(leaders.len(), 1, "one leader within a second");
        let first = leaders[0];
        w.run(20_000, &[]);
        assert_eq!(w.leaders_at(w.now), vec![first], "renewals keep it leading");
        let terms: std::collections::BTreeSet<u64> = w
            .leading
            .iter()
            .filter(|(_, c, _)| *c == first)
            .map(|(_, _, t)| *t)
            .collect();
        assert_eq!(terms.len(), 1, "one term while it leads: {terms:?}");
        let term = *terms.iter().next().unwrap();
        for c in &w.candidates {
            assert!(
                c.standing().term() <= term + 1,
                "a standby's term stays within one of the leader's: {:?}",
                c.standing()
            );
        }
        w.never_two_leaders();
    }

    #[test]
    fn a_standby_takes_over_within_the_liveness_timeout_with_a_higher_term() {
        let mut w = World::new(5, 3);
        w.run(1_000, &[]);
        let old = w.leaders_at(w.now)[0];
        let old_term = w.candidates[old].standing().term();
        let died = w.now;
        w.run(3_000, &[old]);
        let new = w.leaders_at(w.now);
        assert_eq!(
            new.len(),
            1,
            "a standby leads 3 s (the liveness timeout) after"
        );
        assert_ne!(new[0], old);
        let took = w
            .leading
            .iter()
            .find(|(at, c, _)| *at > died && *c == new[0])
            .map(|(at, _, _)| at - died)
            .unwrap();
        assert!(took <= 3_000, "took over in {took} ms");
        assert!(
            w.candidates[new[0]].standing().term() > old_term,
            "a new term fences the old"
        );
        w.never_two_leaders();
    }

    #[test]
    fn a_leader_cut_off_from_the_majority_steps_down_before_another_leads() {
        let mut w = World::new(5, 2);
        w.run(1_000, &[]);
        let old = w.leaders_at(w.now)[0];
        let old_term = w.candidates[old].standing().term();
        // The leader can reach only itself and one other node; the other candidate reaches
        // everyone else.
        let me = w.candidates[old].me.clone();
        let keep = n(if me.as_str() == "node-0" {
            "node-2"
        } else {
            "node-3"
        });
        for (id, _) in w.voters.clone() {
            if id != me && id != keep {
                w.cut.push((me.clone(), id));
            }
        }
        let cut_at = w.now;
        w.run(5_000, &[]);
        // The old leader stopped leading within its lease; the other leads in a higher term,
        // and never while the old one still did.
        let old_last = w
            .leading
            .iter()
            .filter(|(_, c, _)| *c == old)
            .map(|(at, _, _)| *at)
            .max()
            .unwrap();
        assert!(
            old_last < cut_at + cfg().lease_ms,
            "stepped down at {old_last}"
        );
        let other = 1 - old;
        let new_first = w
            .leading
            .iter()
            .filter(|(at, c, _)| *c == other && *at > cut_at)
            .map(|(at, _, _)| *at)
            .min()
            .expect("the majority side elects the other");
        assert!(
            new_first > old_last,
            "no overlap: old until {old_last}, new from {new_first}"
        );
        assert!(w.candidates[other].standing().term() > old_term);
        w.never_two_leaders();
        // The cut heals: the leader keeps leading (the voters' leases are its), and the old
        // one stays a standby that names it.
        w.cut.clear();
        w.run(3_000, &[]);
        assert_eq!(w.leaders_at(w.now), vec![other]);
        match w.candidates[old].standing() {
            Standing::Standby { leader, .. } => {
                assert_eq!(leader, Some(w.candidates[other].me.clone()));
            }
            s => panic!("the old leader leads again: {s:?}"),
        }
        w.never_two_leaders();
    }

    #[test]
    fn random_cuts_and_deaths_never_make_two_leaders() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut led = 0;
        for _ in 0..40 {
            let mut w = World::new(5, 3);
            for _ in 0..12 {
                w.cut.clear();
                for _ in 0..next(4) {
                    let (a, b) = (next(5), next(5));
                    w.cut
                        .push((n(&format!("node-{a}")), n(&format!("node-{b}"))));
                }
                let dead: Vec<usize> = (0..3).filter(|_| next(4) == 0).collect();
                w.run(250 + 50 * next(40), &dead);
            }
            w.never_two_leaders();
            led += usize::from(!w.leading.is_empty());
        }
        assert!(led > 30, "leaders were elected in most runs ({led} of 40)");
    }

    #[test]
    fn without_a_majority_no_one_leads() {
        // 5 voters, the one candidate reaches only 2 of them (itself included).
        let mut w = World::new(5, 1);
        for v in ["node-2", "node-3", "node-4"] {
            w.cut.push((n("node-0"), n(v)));
        }
        w.run(5_000, &[]);
        assert!(w.leading.is_empty());
    }

    #[test]
    fn voters_grant_one_holder_per_live_lease() {
        let c = cfg();
        let mut v = Voter::default();
        let a = |term| VoteRequest {
            term,
            candidate: n("a"),
        };
        let b = |term| VoteRequest {
            term,
            candidate: n("b"),
        };
        assert!(v.on_request(&a(1), 0, &c).granted);
        // b cannot take a live lease, even with a higher term, and the term stays.
        let r = v.on_request(&b(5), 100, &c);
        assert!(!r.granted);
        assert_eq!(
            (r.term, r.leader.clone(), r.lease_left_ms),
            (1, Some(n("a")), c.lease_ms - 100)
        );
        // a renews in its term.
        assert!(v.on_request(&a(1), 200, &c).granted);
        // A stale term is refused.
        assert!(!v.on_request(&b(0), 300, &c).granted);
        // After the lease runs out, b takes it in a higher term; a's old term is refused.
        let later = 200 + c.lease_ms;
        assert!(v.on_request(&b(2), later, &c).granted);
        assert!(!v.on_request(&a(1), later + 1, &c).granted);
        assert_eq!(v.term(), 2);
    }
}
