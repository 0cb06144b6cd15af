//! A node's holders: the workers holding its blocks, each packed with its tiers into one `u32`
//! (`slot << 4 | tiers`, sorted by slot), up to three inline and more spilled to a boxed list
//! with a bitset of their slots, so the overlap walk compares large sets a word (64 workers)
//! at a time (see the parent module's docs, "Structure").

const TIER_BITS: u32 = 4;
pub(super) const TIER_MASK: u32 = (1 << TIER_BITS) - 1;
/// Slots must fit in the 28 bits above the tier bits.
pub(super) const MAX_SLOTS: usize = 1 << (32 - TIER_BITS);
const INLINE_HOLDERS: usize = 3;

#[inline]
pub(super) const fn pack(slot: u32, tiers: u8) -> u32 {
    (slot << TIER_BITS) | tiers as u32
}

#[inline]
pub(super) const fn slot_of(holder: u32) -> u32 {
    holder >> TIER_BITS
}

#[derive(Debug, Clone)]
pub(super) enum Holders {
    Inline {
        len: u8,
        items: [u32; INLINE_HOLDERS],
    },
    Spilled(Box<Spilled>),
}

/// More than [`INLINE_HOLDERS`] holders: the sorted list, plus a bitset of their slots so the
/// walk compares large sets a word (64 workers) at a time.
#[derive(Debug, Clone, Default)]
pub(super) struct Spilled {
    list: Vec<u32>,
    bits: Vec<u64>,
}

impl Spilled {
    fn set_bit(&mut self, slot: u32, on: bool) {
        let (word, bit) = (slot as usize / 64, slot % 64);
        if on {
            if self.bits.len() <= word {
                self.bits.resize(word + 1, 0);
            }
            self.bits[word] |= 1 << bit;
        } else if let Some(x) = self.bits.get_mut(word) {
            *x &= !(1 << bit);
        }
    }

    #[inline]
    pub(super) fn has(&self, slot: u32) -> bool {
        let word = self.bits.get(slot as usize / 64).copied().unwrap_or(0);
        word & (1 << (slot % 64)) != 0
    }

    /// Whether every slot here is set in `bits` (a bitset at least as long).
    #[inline]
    pub(super) fn subset_of(&self, bits: &[u64]) -> bool {
        debug_assert!(self.bits.len() <= bits.len());
        let outside = self
            .bits
            .iter()
            .zip(bits)
            .fold(0, |acc, (n, a)| acc | (n & !a));
        outside == 0
    }
}

impl Holders {
    pub(super) const fn new() -> Self {
        Holders::Inline {
            len: 0,
            items: [0; INLINE_HOLDERS],
        }
    }

    #[inline]
    pub(super) fn as_slice(&self) -> &[u32] {
        match self {
            Holders::Inline { len, items } => &items[..usize::from(*len)],
            Holders::Spilled(s) => &s.list,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// Position of `slot`, or where it would be inserted.
    pub(super) fn find(&self, slot: u32) -> Result<usize, usize> {
        self.as_slice().binary_search_by_key(&slot, |h| slot_of(*h))
    }

    /// Replaces the holder at `i` by one with the same slot (other tiers).
    pub(super) fn set_at(&mut self, i: usize, holder: u32) {
        match self {
            Holders::Inline { items, .. } => items[i] = holder,
            Holders::Spilled(s) => s.list[i] = holder,
        }
    }

    pub(super) fn insert_at(&mut self, i: usize, holder: u32) {
        match self {
            Holders::Inline { len, items } if usize::from(*len) < INLINE_HOLDERS => {
                let n = usize::from(*len);
                items.copy_within(i..n, i + 1);
                items[i] = holder;
                *len += 1;
            }
            Holders::Inline { items, .. } => {
                let mut list = Vec::with_capacity(INLINE_HOLDERS * 2);
                list.extend_from_slice(items);
                list.insert(i, holder);
                let mut spilled = Spilled {
                    list,
                    bits: Vec::new(),
                };
                for k in 0..spilled.list.len() {
                    spilled.set_bit(slot_of(spilled.list[k]), true);
                }
                *self = Holders::Spilled(Box::new(spilled));
            }
            Holders::Spilled(s) => {
                s.list.insert(i, holder);
                s.set_bit(slot_of(holder), true);
            }
        }
    }

    pub(super) fn remove_at(&mut self, i: usize) {
        match self {
            Holders::Inline { len, items } => {
                let n = usize::from(*len);
                items.copy_within(i + 1..n, i);
                *len -= 1;
            }
            Holders::Spilled(s) => {
                let holder = s.list.remove(i);
                s.set_bit(slot_of(holder), false);
                // Back inline once well below the threshold (one of slack against flapping).
                if s.list.len() < INLINE_HOLDERS {
                    let mut items = [0; INLINE_HOLDERS];
                    items[..s.list.len()].copy_from_slice(&s.list);
                    let len = s.list.len() as u8;
                    *self = Holders::Inline { len, items };
                }
            }
        }
    }

    /// Union of the holders' tier bits.
    pub(super) fn tier_union(&self) -> u8 {
        let slice = self.as_slice();
        let bits = slice.iter().fold(0, |acc, h| acc | (h & TIER_MASK));
        bits as u8
    }
}
