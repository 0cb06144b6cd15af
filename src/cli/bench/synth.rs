//! Deterministic synthetic token ids.
//!
//! A prompt of a token-id workload is a list of [`Segment`]s; each segment is `len` token ids
//! drawn from `seed` (and the run's salt) by a counter-based generator, so the same segment
//! always gives the same ids and a segment can be cut (its first `k` ids are the first `k` ids
//! of the longer one). Ids lie in [`TOKEN_MIN`, `TOKEN_MAX`): above the special and byte tokens
//! of common vocabularies and below their size (SmolLM2: 49,152), so the gateway accepts them
//! as they are.

/// Smallest synthetic token id (inclusive).
pub const TOKEN_MIN: u32 = 1000;
/// Largest synthetic token id (exclusive).
pub const TOKEN_MAX: u32 = 30_000;

pub use crate::runtime::ids::mix64;

/// Combine two 64-bit values into one seed (order matters).
pub fn combine(a: u64, b: u64) -> u64 {
    mix64(a ^ mix64(b).rotate_left(17))
}

/// `len` token ids seeded by `seed`, deterministic; distinct seeds give unrelated ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// What the ids are drawn from (e.g. a Mooncake `hash_id`).
    pub seed: u64,
    /// Number of token ids.
    pub len: u32,
}

/// Append the ids of `seg`, under run salt `salt`, to `out`.
pub fn push_segment(out: &mut Vec<u32>, seg: Segment, salt: u64) {
    let base = combine(salt, seg.seed);
    let span = u64::from(TOKEN_MAX - TOKEN_MIN);
    out.extend((0..u64::from(seg.len)).map(|i| {
        // `% span` < 29_000, so the cast cannot truncate.
        TOKEN_MIN + (mix64(base.wrapping_add(i)) % span) as u32
    }));
}

/// All ids of a prompt made of `segments`, under run salt `salt`.
pub fn token_ids(segments: &[Segment], salt: u64) -> Vec<u32> {
    let total: usize = segments.iter().map(|s| s.len as usize).sum();
    let mut out = Vec::with_capacity(total);
    for &s in segments {
        push_segment(&mut out, s, salt);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_ids_and_in_range() {
        let a = token_ids(&[Segment { seed: 7, len: 512 }], 0);
        let b = token_ids(&[Segment { seed: 7, len: 512 }], 0);
        assert_eq!(a, b);
        assert_eq!(a.len(), 512);
        assert!(a.iter().all(|&t| (TOKEN_MIN..TOKEN_MAX).contains(&t)));
    }

    #[test]
    fn different_seeds_or_salts_differ() {
        let a = token_ids(&[Segment { seed: 7, len: 512 }], 0);
        let b = token_ids(&[Segment { seed: 8, len: 512 }], 0);
        let c = token_ids(&[Segment { seed: 7, len: 512 }], 1);
        let same = |x: &[u32], y: &[u32]| x.iter().zip(y).filter(|(p, q)| p == q).count();
        // Unrelated streams agree on about 1 position in 29,000.
        assert!(same(&a, &b) < 5, "{}", same(&a, &b));
        assert!(same(&a, &c) < 5, "{}", same(&a, &c));
    }

    #[test]
    fn cut_segment_is_a_prefix() {
        let full = token_ids(&[Segment { seed: 3, len: 512 }], 9);
        let cut = token_ids(&[Segment { seed: 3, len: 100 }], 9);
        assert_eq!(&full[..100], &cut[..]);
    }
}
