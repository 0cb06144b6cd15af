//! Chaos filters on the transport: every pull passes them before any byte moves.
//!
//! Installed by the node's Chaos actor: `delay_kv_transfer {delay_ms}` holds each pull back,
//! `drop_kv_transfer {rate, seed}` fails a seeded fraction of pulls, and a `partition` cuts
//! pulls from the nodes on the far side (their regions' owners are `<node>/…`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::{Rng, SeedableRng};

/// What the filters decided for one pull.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferVerdict {
    /// Go ahead.
    Pass,
    /// Go ahead after this delay.
    Delay(Duration),
    /// Fail with this reason.
    Drop(String),
}

#[derive(Debug, Default)]
struct Filters {
    delay: Option<Duration>,
    drop: Option<(f64, rand::rngs::StdRng)>,
    cut: HashSet<String>,
}

/// The transport's fault filters, shared between the transport and the Chaos actor.
#[derive(Clone, Debug, Default)]
pub struct TransferFaults(Arc<Mutex<Filters>>);

impl TransferFaults {
    fn with<T>(&self, f: impl FnOnce(&mut Filters) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Delays every pull by `delay` (`None` clears it).
    pub fn set_delay(&self, delay: Option<Duration>) {
        self.with(|f| f.delay = delay);
    }

    /// Fails a fraction `rate` (0–1) of pulls, drawn from a generator seeded with `seed`
    /// (`None` clears it).
    pub fn set_drop(&self, drop: Option<(f64, u64)>) {
        self.with(|f| {
            f.drop = drop.map(|(rate, seed)| {
                (
                    rate.clamp(0.0, 1.0),
                    rand::rngs::StdRng::seed_from_u64(seed),
                )
            })
        });
    }

    /// Cuts pulls from regions owned on `nodes` (replacing any earlier cut; empty heals).
    pub fn set_cut(&self, nodes: &[String]) {
        self.with(|f| f.cut = nodes.iter().cloned().collect());
    }

    /// The verdict for a pull from a region owned by `owner` (`<node>/<replica>` or a node
    /// name).
    pub fn verdict(&self, owner: &str) -> TransferVerdict {
        self.with(|f| {
            let node = owner.split('/').next().unwrap_or(owner);
            if f.cut.contains(node) {
                return TransferVerdict::Drop(format!("partition: {node} is cut off"));
            }
            if let Some((rate, rng)) = &mut f.drop
                && rng.random_bool(*rate)
            {
                return TransferVerdict::Drop("drop_kv_transfer".into());
            }
            f.delay
                .map_or(TransferVerdict::Pass, TransferVerdict::Delay)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_apply_in_order_and_clear() {
        let f = TransferFaults::default();
        assert_eq!(f.verdict("n1/replica-0"), TransferVerdict::Pass);
        f.set_delay(Some(Duration::from_millis(5)));
        assert_eq!(
            f.verdict("n1/replica-0"),
            TransferVerdict::Delay(Duration::from_millis(5))
        );
        f.set_cut(&["n1".into()]);
        assert!(matches!(
            f.verdict("n1/replica-0"),
            TransferVerdict::Drop(_)
        ));
        assert!(matches!(
            f.verdict("n2/replica-0"),
            TransferVerdict::Delay(_)
        ));
        f.set_cut(&[]);
        f.set_delay(None);
        assert_eq!(f.verdict("n1/replica-0"), TransferVerdict::Pass);
    }

    #[test]
    fn drops_are_seeded_and_near_their_rate() {
        let draw = |seed| {
            let f = TransferFaults::default();
            f.set_drop(Some((0.25, seed)));
            (0..2000)
                .map(|_| matches!(f.verdict("n/r"), TransferVerdict::Drop(_)))
                .collect::<Vec<_>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        let n = a.iter().filter(|&&d| d).count();
        assert!((400..600).contains(&n), "{n} of 2000 dropped at rate 0.25");
    }
}
