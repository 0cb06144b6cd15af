use super::*;
use crate::runtime::clock::{Clock, ManualClock};

fn policy() -> MigrationPolicy {
    MigrationPolicy {
        limit: 3,
        deadline: Duration::from_secs(10),
        backoff_base: Duration::from_millis(50),
        backoff_max: Duration::from_secs(1),
    }
}

fn w(name: &str) -> Option<WorkerId> {
    Some(WorkerId::new(name))
}

/// The `k`-th backoff step's bounds: between half and all of `min(max, base · 2^k)`.
fn step_bounds(p: &MigrationPolicy, k: u32) -> (Duration, Duration) {
    let step = p
        .backoff_base
        .saturating_mul(1 << k.min(16))
        .min(p.backoff_max);
    (step / 2, step)
}

#[test]
fn a_request_that_keeps_making_progress_is_never_given_up() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 1);
    // A burst of 200 losses over 100 s, each after one more token: always placed at once.
    for delivered in 1..=200 {
        clock.advance(Duration::from_millis(500));
        assert_eq!(
            m.on_loss(clock.now(), delivered, true, w("a")),
            Decision::Place
        );
        assert!(m.on_resumed());
    }
    assert_eq!(m.total(), 200);
    assert_eq!(m.stalled(), 0);
}

#[test]
fn fast_losses_without_progress_cost_time_not_the_request() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 1);
    assert_eq!(m.on_loss(clock.now(), 5, true, w("a")), Decision::Place);
    // A burst: 20 losses without a new token, one every 300 ms (6 s < the 10 s deadline):
    // each is placed again at once, none gives the request up.
    for k in 0..20u32 {
        clock.advance(Duration::from_millis(300));
        assert_eq!(
            m.on_loss(clock.now(), 5, true, w("b")),
            Decision::Place,
            "loss {k} without progress within the deadline"
        );
    }
    assert_eq!(m.stalled(), 20);
    // Past the deadline of stall (from its first loss), with more than `limit` losses in it:
    // given up.
    clock.advance(Duration::from_secs(5));
    assert!(matches!(
        m.on_loss(clock.now(), 5, true, w("a")),
        Decision::Fail(GiveUp::NoProgress { losses: 21, .. })
    ));
}

#[test]
fn a_few_slow_losses_without_progress_never_give_up() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 1);
    // Three losses without progress (the limit), spread over a minute: still migrating.
    clock.advance(Duration::from_secs(1));
    for _ in 0..3 {
        clock.advance(Duration::from_secs(20));
        assert_eq!(m.on_loss(clock.now(), 0, true, w("a")), Decision::Place);
    }
    // The fourth, past the deadline: given up.
    clock.advance(Duration::from_secs(20));
    assert!(matches!(
        m.on_loss(clock.now(), 0, true, w("a")),
        Decision::Fail(GiveUp::NoProgress { losses: 4, .. })
    ));
}

#[test]
fn progress_resets_the_stall() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 1);
    for _ in 0..5 {
        clock.advance(Duration::from_secs(1));
        assert_eq!(m.on_loss(clock.now(), 0, true, w("a")), Decision::Place);
    }
    assert_eq!(m.stalled(), 5);
    // One token, then a loss: placed at once, and the stall starts over.
    clock.advance(Duration::from_secs(3));
    assert_eq!(m.on_loss(clock.now(), 1, true, w("a")), Decision::Place);
    assert_eq!(m.stalled(), 0);
    for _ in 0..5 {
        clock.advance(Duration::from_millis(1_900));
        assert_eq!(m.on_loss(clock.now(), 1, true, w("a")), Decision::Place);
    }
}

#[test]
fn no_worker_for_two_seconds_then_one_waits_with_growing_jittered_backoff() {
    let clock = ManualClock::new();
    let p = policy();
    let mut m = Migration::new(p, 7);
    assert_eq!(m.on_loss(clock.now(), 10, true, w("a")), Decision::Place);
    let start = clock.now();
    let mut waits = Vec::new();
    // No worker is routable for 2 s: every try waits, never past the deadline.
    while clock.now() - start < Duration::from_secs(2) {
        let now = clock.now();
        let Decision::Wait { until } = m.on_place_failed(now, true) else {
            panic!("a migration within its deadline waits");
        };
        assert!(until > now);
        waits.push(until - now);
        clock.advance(until - now);
    }
    for (k, wait) in waits.iter().enumerate() {
        let (lo, hi) = step_bounds(&p, k as u32);
        assert!(*wait >= lo && *wait <= hi, "try {k}: {wait:?}");
    }
    assert!(waits.len() >= 4, "{waits:?}");
    // Then a worker is back: the placement succeeds and its first token ends the migration.
    assert!(
        m.on_resumed(),
        "the first token ends the migration under way"
    );
    assert!(!m.on_resumed(), "only once");
}

#[test]
fn the_wait_for_a_worker_stops_at_the_deadline() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 3);
    assert_eq!(m.on_loss(clock.now(), 1, true, w("a")), Decision::Place);
    let deadline = clock.now() + policy().deadline;
    loop {
        match m.on_place_failed(clock.now(), true) {
            Decision::Wait { until } => {
                assert!(until <= deadline, "never waits past the deadline");
                clock.advance(until - clock.now());
            }
            Decision::Fail(why) => {
                assert_eq!(
                    why,
                    GiveUp::Deadline {
                        deadline: policy().deadline
                    }
                );
                assert!(clock.now() >= deadline);
                break;
            }
            Decision::Place => panic!("placement is the caller's"),
        }
    }
}

#[test]
fn a_request_fault_is_not_retried_and_a_first_placement_does_not_wait() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 3);
    assert_eq!(
        m.on_place_failed(clock.now(), true),
        Decision::Fail(GiveUp::FirstPlacement)
    );
    assert_eq!(m.on_loss(clock.now(), 1, true, w("a")), Decision::Place);
    assert!(matches!(
        m.on_place_failed(clock.now(), false),
        Decision::Fail(GiveUp::Deadline { .. })
    ));
}

#[test]
fn the_same_worker_failing_twice_is_remembered_once_and_most_recent_last() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 3);
    m.on_loss(clock.now(), 1, true, w("a"));
    m.on_loss(clock.now(), 2, true, w("b"));
    m.on_loss(clock.now(), 3, true, w("a"));
    assert_eq!(m.avoid(), &[WorkerId::new("b"), WorkerId::new("a")]);
    for i in 0..20 {
        m.on_loss(clock.now(), 4 + i, true, w(&format!("w{i}")));
    }
    assert_eq!(m.avoid().len(), AVOID_MAX);
    assert_eq!(m.avoid().last(), Some(&WorkerId::new("w19")));
}

#[test]
fn a_new_loss_restarts_the_wait_deadline() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 3);
    m.on_loss(clock.now(), 1, true, w("a"));
    clock.advance(Duration::from_secs(9));
    assert!(matches!(
        m.on_place_failed(clock.now(), true),
        Decision::Wait { .. }
    ));
    // Placed, then lost again before a token: a fresh deadline from this loss.
    m.on_loss(clock.now(), 1, true, w("b"));
    clock.advance(Duration::from_secs(5));
    assert!(matches!(
        m.on_place_failed(clock.now(), true),
        Decision::Wait { .. }
    ));
}

#[test]
fn the_jitter_is_a_function_of_the_seed() {
    let run = |seed| {
        let clock = ManualClock::new();
        let mut m = Migration::new(policy(), seed);
        m.on_loss(clock.now(), 0, true, w("a"));
        (0..5)
            .map(|_| match m.on_place_failed(clock.now(), true) {
                Decision::Wait { until } => until - clock.now(),
                d => panic!("{d:?}"),
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(9), run(9));
    assert_ne!(run(9), run(10));
}

#[test]
fn losses_while_only_queued_never_count_against_the_request() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 1);
    // A minute of faults, every one while the request waited in its worker's queue.
    for _ in 0..60 {
        clock.advance(Duration::from_secs(1));
        assert_eq!(m.on_loss(clock.now(), 4, false, w("a")), Decision::Place);
    }
    assert_eq!(m.stalled(), 0);
    // Running attempts lost without a token do count; the stall starts at the first of them.
    for _ in 0..4 {
        clock.advance(Duration::from_secs(1));
        assert_eq!(m.on_loss(clock.now(), 4, true, w("a")), Decision::Place);
    }
    assert_eq!(m.stalled(), 4);
    clock.advance(Duration::from_secs(10));
    assert!(matches!(
        m.on_loss(clock.now(), 4, true, w("a")),
        Decision::Fail(GiveUp::NoProgress { losses: 5, .. })
    ));
}

#[test]
fn a_hand_off_placement_waits_for_a_worker_without_counting_a_migration() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 1);
    // Before any hand-off, a failed first placement fails at once.
    assert_eq!(
        m.on_place_failed(clock.now(), true),
        Decision::Fail(GiveUp::FirstPlacement)
    );
    m.on_hand_off(clock.now());
    assert!(matches!(
        m.on_place_failed(clock.now(), true),
        Decision::Wait { .. }
    ));
    assert_eq!(m.total(), 0, "not a migration");
    assert!(m.avoid().is_empty());
    assert!(!m.on_resumed(), "its first token ends no migration");
    m.on_hand_off(clock.now());
    clock.advance(policy().deadline);
    assert!(matches!(
        m.on_place_failed(clock.now(), true),
        Decision::Fail(GiveUp::Deadline { .. })
    ));
}

#[test]
fn a_failed_router_retries_even_a_first_placement_without_counting_a_migration() {
    let clock = ManualClock::new();
    let mut m = Migration::new(policy(), 1);
    assert!(matches!(
        m.on_router_failed(clock.now()),
        Decision::Wait { .. }
    ));
    assert!(matches!(
        m.on_router_failed(clock.now()),
        Decision::Wait { .. }
    ));
    assert_eq!(m.total(), 0, "not a migration");
    assert!(!m.on_resumed(), "its first token ends no migration");
    // Routers failing for the whole deadline: given up.
    m.on_router_failed(clock.now());
    clock.advance(policy().deadline);
    assert!(matches!(
        m.on_router_failed(clock.now()),
        Decision::Fail(GiveUp::Deadline { .. })
    ));
    // A later loss is a migration as before.
    assert_eq!(m.on_loss(clock.now(), 1, true, None), Decision::Place);
    assert!(m.on_resumed());
}

#[test]
fn an_avoided_worker_is_remembered_once_and_most_recent_last() {
    let mut m = Migration::new(policy(), 1);
    m.avoid_worker(WorkerId::new("a"));
    m.avoid_worker(WorkerId::new("b"));
    m.avoid_worker(WorkerId::new("a"));
    assert_eq!(m.avoid(), &[WorkerId::new("b"), WorkerId::new("a")]);
    for i in 0..AVOID_MAX + 2 {
        m.avoid_worker(WorkerId::new(format!("w{i}")));
    }
    assert_eq!(m.avoid().len(), AVOID_MAX);
    assert_eq!(
        m.avoid().last(),
        Some(&WorkerId::new(format!("w{}", AVOID_MAX + 1)))
    );
}
