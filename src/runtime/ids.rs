//! Newtypes for every identifier and hash that crosses an actor boundary.
//!
//! Raw integers never travel between actors: a `BlockId` cannot be passed where a
//! `WorkerId` is expected. All ids are `serde`-serialisable so they can ride inside
//! [`crate::runtime::wire::Wire`] payloads between nodes.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! int_id {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

macro_rules! str_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
        #[serde(transparent)]
        pub struct $name(pub String);

        impl $name {
            pub fn new(s: impl Into<String>) -> Self {
                Self(s.into())
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.to_owned())
            }
        }

        // Hash and Eq are the inner string's, so maps keyed by the id can be read by `&str`.
        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }
    };
}

str_id!(
    /// A cluster node, named `node-<n>` by `flotilla up` or by `--name`; unique in a cluster.
    NodeId
);
str_id!(
    /// One replica (scheduler + KV event publisher + engine), unique in a cluster: `<node>/replica-<k>`
    /// (an external engine: `<node>/<name>`).
    WorkerId
);
int_id!(
    /// One client request, unique per gateway process.
    RequestId(u64)
);
int_id!(
    /// One sequence inside a scheduler / engine batch.
    SeqId(u64)
);
int_id!(
    /// Index of a KV block in a replica's pool (`0..num_blocks`).
    BlockId(u32)
);
int_id!(
    /// XXH3-64 of one full block's token ids (see `crate::kv::hash` for the recipe).
    BlockHash(u64)
);
int_id!(
    /// XXH3-64 chained from the parent block's sequence hash: equal values mean equal prefixes.
    SequenceHash(u64)
);
int_id!(
    /// Per-worker monotonic KV event id.
    EventId(u64)
);

/// SplitMix64 finaliser: a bijective 64-bit mix with good avalanche (Steele et al. 2014); the
/// synthetic workloads' seeds, the router's tie spread and the simulator's router choice.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
