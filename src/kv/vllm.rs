//! vLLM's KV event wire format: what a vLLM engine started with `--kv-events-config
//! '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'` publishes, so that routers
//! built for vLLM (vLLM's own `vllm-router` `kv_aware`, NVIDIA Dynamo, llm-d's KV-cache
//! indexer) can follow a Flotilla worker's cache, and Flotilla can follow theirs.
//!
//! # Wire (source: `vllm/distributed/kv_events.py`, `ZmqEventPublisher`)
//! - **Socket:** ZMQ PUB. Each message has three frames: the topic (empty by default), the
//!   batch's sequence number as 8 bytes big-endian (0, 1, 2, … per publisher), the payload.
//! - **Payload:** MessagePack `[ts, [event, …], data_parallel_rank]` (`ts` float seconds
//!   since the Unix epoch; the rank is 0 here).
//! - **Event:** a MessagePack map tagged by `"type"`:
//!   - `BlockStored {block_hashes: [u64], parent_block_hash: u64 | nil, token_ids: [u32],
//!     block_size, lora_id: nil, medium: "GPU", lora_name: nil}` — one chain of full blocks,
//!     `token_ids` holding `block_size` ids per block, in order;
//!   - `BlockRemoved {block_hashes: [u64], medium}`;
//!   - `AllBlocksCleared {}`.
//!
//! vLLM has encoded the batch both as this positional array (`EventBatch` with
//! `array_like=True`, which `vllm-router` 0.1.17 requires) and as a map, and the events both
//! as maps and as positional arrays whose first element is the tag; [`decode_batch`] reads all
//! four, [`encode_batch`] writes the array batch with map events (what `vllm-router` and
//! Dynamo's ZMQ relay both read), [`encode_batch_as`] either event layout
//! (`worker.kv_events_layout = "array"`: vLLM's own).
//!
//! # Hashes
//! A Flotilla worker publishes its sequence hashes (`kv/hash.rs`) as `block_hashes`: like
//! vLLM's, each one covers the block's tokens and every block before it. A consumer must not
//! assume it can recompute them: vLLM-aware routers hash `token_ids` themselves and use the
//! engine's hashes only as keys for parents and removals. [`Translator`] does the same in the
//! other direction: it turns an external engine's events into Flotilla [`KvEvent`]s by hashing
//! the token ids with Flotilla's recipe, so a prompt tokenized by the gateway matches blocks an
//! external engine of the same model holds.

use std::collections::HashMap;

use rmpv::Value;

use super::events::{KvEvent, KvEventData, StoredBlock, Tier};
use super::hash::{block_hash, sequence_hash};
use crate::runtime::ids::{EventId, SequenceHash, WorkerId};

/// One KV cache event in vLLM's vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmEvent {
    /// A chain of full blocks was stored: `block_hashes[i]` holds
    /// `token_ids[i·block_size..(i+1)·block_size]`; the first block's parent is
    /// `parent_block_hash`.
    BlockStored {
        /// The blocks' hashes, in chain order.
        block_hashes: Vec<u64>,
        /// The first block's parent (`None`: the chain starts the sequence).
        parent_block_hash: Option<u64>,
        /// Every block's tokens, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Where the blocks live (`"GPU"`, `"CPU"`, …).
        medium: Option<String>,
    },
    /// Blocks were evicted.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
        /// Where they lived.
        medium: Option<String>,
    },
    /// Every block was dropped.
    AllBlocksCleared,
}

/// One published batch.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmBatch {
    /// Seconds since the Unix epoch.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<VllmEvent>,
    /// Data-parallel rank of the publisher (Flotilla: 0).
    pub data_parallel_rank: Option<i64>,
}

/// A payload that is not a vLLM KV event batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a vLLM KV event batch: {0}")]
pub struct WireError(String);

fn err<T>(why: impl Into<String>) -> Result<T, WireError> {
    Err(WireError(why.into()))
}

/// vLLM's name for a Flotilla tier.
pub fn medium_of(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "GPU",
        Tier::Host => "CPU",
        Tier::Disk => "DISK",
        Tier::Remote => "REMOTE",
    }
}

fn opt_str(s: &Option<String>) -> Value {
    s.as_ref().map_or(Value::Nil, |s| Value::from(s.as_str()))
}

fn u64s(v: &[u64]) -> Value {
    Value::Array(v.iter().map(|&h| Value::from(h)).collect())
}

/// `ev`'s tag and its fields in vLLM's order (`vllm/distributed/kv_events.py`), from which
/// both layouts are written.
fn event_fields(ev: &VllmEvent) -> (&'static str, Vec<(&'static str, Value)>) {
    match ev {
        VllmEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
        } => (
            "BlockStored",
            vec![
                ("block_hashes", u64s(block_hashes)),
                (
                    "parent_block_hash",
                    parent_block_hash.map_or(Value::Nil, Value::from),
                ),
                (
                    "token_ids",
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(*block_size)),
                ("lora_id", Value::Nil),
                ("medium", opt_str(medium)),
                ("lora_name", Value::Nil),
            ],
        ),
        VllmEvent::BlockRemoved {
            block_hashes,
            medium,
        } => (
            "BlockRemoved",
            vec![
                ("block_hashes", u64s(block_hashes)),
                ("medium", opt_str(medium)),
            ],
        ),
        VllmEvent::AllBlocksCleared => ("AllBlocksCleared", vec![]),
    }
}

/// `ev` in `layout`: a map led by `"type"`, or an array led by the tag.
fn event_value(ev: &VllmEvent, layout: EventLayout) -> Value {
    let (tag, fields) = event_fields(ev);
    match layout {
        EventLayout::Map => Value::Map(
            std::iter::once(("type", Value::from(tag)))
                .chain(fields)
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        ),
        EventLayout::Array => Value::Array(
            std::iter::once(Value::from(tag))
                .chain(fields.into_iter().map(|(_, v)| v))
                .collect(),
        ),
    }
}

/// How events are laid out in a published batch (`worker.kv_events_layout`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum EventLayout {
    /// Each event a map tagged by `"type"` (what `vllm-router` 0.1.17 and Dynamo's ZMQ
    /// relay read; the default).
    #[default]
    Map,
    /// Each event a positional array whose first element is the tag, as vLLM's own
    /// publisher writes them (`msgspec.Struct(array_like=True, tag=True)` in
    /// `vllm/distributed/kv_events.py`): `["BlockStored", block_hashes, parent_block_hash,
    /// token_ids, block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes,
    /// medium]`, `["AllBlocksCleared"]`.
    Array,
}

/// The payload frame of one batch: `[ts, [event map, …], rank]`.
pub fn encode_batch(batch: &VllmBatch) -> Vec<u8> {
    encode_batch_as(batch, EventLayout::Map)
}

/// The payload frame of one batch, `[ts, [event, …], rank]`, with events in `layout`.
pub fn encode_batch_as(batch: &VllmBatch, layout: EventLayout) -> Vec<u8> {
    let v = Value::Array(vec![
        Value::F64(batch.ts),
        Value::Array(
            batch
                .events
                .iter()
                .map(|e| event_value(e, layout))
                .collect(),
        ),
        batch.data_parallel_rank.map_or(Value::Nil, Value::from),
    ]);
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &v);
    out
}

fn as_u64(v: &Value, what: &str) -> Result<u64, WireError> {
    match v {
        Value::Integer(i) => match i.as_u64() {
            Some(x) => Ok(x),
            None => err(format!("{what}: negative integer")),
        },
        // Some engines send hashes as bytes: keep the first 8 (big-endian) as the key.
        Value::Binary(b) if !b.is_empty() => {
            let mut k = [0u8; 8];
            let n = b.len().min(8);
            k[8 - n..].copy_from_slice(&b[..n]);
            Ok(u64::from_be_bytes(k))
        }
        _ => err(format!("{what}: expected an integer")),
    }
}

fn as_u64s(v: &Value, what: &str) -> Result<Vec<u64>, WireError> {
    match v {
        Value::Array(a) => a.iter().map(|x| as_u64(x, what)).collect(),
        _ => err(format!("{what}: expected an array")),
    }
}

fn as_u32s(v: &Value, what: &str) -> Result<Vec<u32>, WireError> {
    as_u64s(v, what)?
        .into_iter()
        .map(|x| u32::try_from(x).or_else(|_| err(format!("{what}: {x} is not a token id"))))
        .collect()
}

fn as_opt_u64(v: Option<&Value>, what: &str) -> Result<Option<u64>, WireError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(x) => as_u64(x, what).map(Some),
    }
}

fn as_opt_string(v: Option<&Value>) -> Option<String> {
    v.and_then(|x| x.as_str()).map(str::to_owned)
}

/// Field accessor over either layout: a map by name, or a positional array (after the tag).
struct Fields<'a> {
    map: Option<&'a [(Value, Value)]>,
    arr: &'a [Value],
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str, pos: usize) -> Option<&'a Value> {
        match self.map {
            Some(m) => m
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
            None => self.arr.get(pos),
        }
    }

    fn need(&self, name: &str, pos: usize) -> Result<&'a Value, WireError> {
        self.get(name, pos)
            .map_or_else(|| err(format!("missing field {name}")), Ok)
    }
}

fn decode_event(v: &Value) -> Result<VllmEvent, WireError> {
    let (tag, fields) = match v {
        Value::Map(m) => {
            let tag = m
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, t)| t.as_str());
            (
                tag,
                Fields {
                    map: Some(m.as_slice()),
                    arr: &[],
                },
            )
        }
        Value::Array(a) if !a.is_empty() => (
            a[0].as_str(),
            Fields {
                map: None,
                arr: &a[1..],
            },
        ),
        _ => return err("an event is neither a map nor a tagged array"),
    };
    match tag {
        Some("BlockStored") => {
            let block_size = as_u64(fields.need("block_size", 3)?, "block_size")?;
            Ok(VllmEvent::BlockStored {
                block_hashes: as_u64s(fields.need("block_hashes", 0)?, "block_hashes")?,
                parent_block_hash: as_opt_u64(
                    fields.get("parent_block_hash", 1),
                    "parent_block_hash",
                )?,
                token_ids: as_u32s(fields.need("token_ids", 2)?, "token_ids")?,
                block_size: u32::try_from(block_size)
                    .or_else(|_| err("block_size out of range"))?,
                medium: as_opt_string(fields.get("medium", 5)),
            })
        }
        Some("BlockRemoved") => Ok(VllmEvent::BlockRemoved {
            block_hashes: as_u64s(fields.need("block_hashes", 0)?, "block_hashes")?,
            medium: as_opt_string(fields.get("medium", 1)),
        }),
        Some("AllBlocksCleared") => Ok(VllmEvent::AllBlocksCleared),
        Some(other) => err(format!("unknown event type {other}")),
        None => err("an event has no type tag"),
    }
}

/// Read a payload frame (either batch layout, either event layout).
///
/// # Errors
/// [`WireError`] naming what does not fit.
pub fn decode_batch(bytes: &[u8]) -> Result<VllmBatch, WireError> {
    let v = rmpv::decode::read_value(&mut &bytes[..]).or_else(|e| err(e.to_string()))?;
    let (ts, events, rank) = match &v {
        Value::Array(a) if a.len() >= 2 => (Some(&a[0]), &a[1], a.get(2)),
        Value::Map(m) => {
            let get = |k: &str| {
                m.iter()
                    .find(|(x, _)| x.as_str() == Some(k))
                    .map(|(_, v)| v)
            };
            (
                get("ts"),
                get("events").map_or_else(|| err("missing events"), Ok)?,
                get("data_parallel_rank"),
            )
        }
        _ => return err("expected [ts, events, rank] or a map"),
    };
    let ts = ts.and_then(Value::as_f64).unwrap_or(0.0);
    let Value::Array(events) = events else {
        return err("events: expected an array");
    };
    Ok(VllmBatch {
        ts,
        events: events.iter().map(decode_event).collect::<Result<_, _>>()?,
        data_parallel_rank: rank.and_then(Value::as_i64),
    })
}

/// A Flotilla event in vLLM's vocabulary. `tokens` must hold the tokens of a `Stored` event's
/// blocks (`block_size` per block, in order); `None` when they are not known, which vLLM's
/// format cannot express (the caller skips the event).
pub fn from_flotilla(ev: &KvEvent, tokens: Option<&[u32]>, block_size: u32) -> Option<VllmEvent> {
    let medium = Some(medium_of(ev.tier).to_owned());
    Some(match &ev.data {
        KvEventData::Stored { parent, blocks } => {
            let token_ids = tokens?.to_vec();
            if token_ids.len() != blocks.len() * block_size as usize {
                return None;
            }
            VllmEvent::BlockStored {
                block_hashes: blocks.iter().map(|b| b.seq_hash.0).collect(),
                parent_block_hash: parent.map(|p| p.0),
                token_ids,
                block_size,
                medium,
            }
        }
        KvEventData::Removed { blocks } => VllmEvent::BlockRemoved {
            block_hashes: blocks.iter().map(|h| h.0).collect(),
            medium,
        },
        KvEventData::Cleared => VllmEvent::AllBlocksCleared,
    })
}

/// What [`Translator::apply`] could not take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    /// A stored chain whose parent was never stored (or already removed): its blocks cannot be
    /// placed in a prefix tree. vLLM-aware routers drop such chains too.
    #[error("stored chain under unknown parent {0:#x}")]
    UnknownParent(u64),
    /// `token_ids` do not hold `block_size` tokens per block.
    #[error("{tokens} token ids for {blocks} blocks of {block_size}")]
    TokenCount {
        /// Token ids in the event.
        tokens: usize,
        /// Blocks in the event.
        blocks: usize,
        /// The event's block size.
        block_size: u32,
    },
    /// The engine's blocks are not the router's size, so no prompt hash can match them.
    #[error("block size {got} differs from the router's {want}")]
    BlockSize {
        /// The event's.
        got: u32,
        /// The router's.
        want: u32,
    },
}

/// Turns one external engine's vLLM-format events into Flotilla [`KvEvent`]s for `worker`:
/// each stored block's Flotilla sequence hash is computed from its token ids (Flotilla's
/// recipe and salt), and the engine's own hashes are kept only as keys (parents, removals).
/// Event ids start at 1 and increase by 1 per event produced, as a Flotilla pool's do.
#[derive(Debug)]
pub struct Translator {
    worker: WorkerId,
    block_size: u32,
    salt: u64,
    /// The engine's block hash → Flotilla's sequence hash of the same block.
    ours: HashMap<u64, SequenceHash>,
    next_event: u64,
}

impl Translator {
    /// A translator for `worker`, whose blocks hold `block_size` tokens, hashing with `salt`
    /// (the model's, `ModelConfig::block_hash_salt`).
    pub fn new(worker: WorkerId, block_size: u32, salt: u64) -> Self {
        Self {
            worker,
            block_size,
            salt,
            ours: HashMap::new(),
            next_event: 1,
        }
    }

    /// Blocks the engine holds, as far as its events said.
    pub fn num_blocks(&self) -> usize {
        self.ours.len()
    }

    fn event(&mut self, tier: Tier, data: KvEventData) -> KvEvent {
        let event_id = EventId(self.next_event);
        self.next_event += 1;
        KvEvent {
            worker: self.worker.clone(),
            event_id,
            tier,
            data,
        }
    }

    /// The Flotilla event for one engine event; `Ok(None)` when it changes nothing (removal
    /// of blocks never stored, an empty chain).
    ///
    /// # Errors
    /// [`TranslateError`]: the event cannot be placed (nothing is changed).
    pub fn apply(&mut self, ev: &VllmEvent) -> Result<Option<KvEvent>, TranslateError> {
        let tier = |m: &Option<String>| match m.as_deref().map(str::to_ascii_uppercase) {
            Some(s) if s == "CPU" || s == "HOST" => Tier::Host,
            Some(s) if s == "DISK" => Tier::Disk,
            _ => Tier::Device,
        };
        match ev {
            VllmEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
            } => {
                if *block_size != self.block_size {
                    return Err(TranslateError::BlockSize {
                        got: *block_size,
                        want: self.block_size,
                    });
                }
                let bs = *block_size as usize;
                if token_ids.len() != block_hashes.len() * bs {
                    return Err(TranslateError::TokenCount {
                        tokens: token_ids.len(),
                        blocks: block_hashes.len(),
                        block_size: *block_size,
                    });
                }
                let parent = match parent_block_hash {
                    None => None,
                    Some(p) => Some(*self.ours.get(p).ok_or(TranslateError::UnknownParent(*p))?),
                };
                if block_hashes.is_empty() {
                    return Ok(None);
                }
                let mut last = parent;
                let mut blocks = Vec::with_capacity(block_hashes.len());
                for (ext, toks) in block_hashes.iter().zip(token_ids.chunks_exact(bs)) {
                    let bh = block_hash(toks, self.salt);
                    let sh = sequence_hash(last, bh, self.salt);
                    self.ours.insert(*ext, sh);
                    blocks.push(StoredBlock {
                        seq_hash: sh,
                        block_hash: bh,
                    });
                    last = Some(sh);
                }
                Ok(Some(self.event(
                    tier(medium),
                    KvEventData::Stored { parent, blocks },
                )))
            }
            VllmEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                let blocks: Vec<SequenceHash> = block_hashes
                    .iter()
                    .filter_map(|h| self.ours.remove(h))
                    .collect();
                if blocks.is_empty() {
                    return Ok(None);
                }
                Ok(Some(
                    self.event(tier(medium), KvEventData::Removed { blocks }),
                ))
            }
            VllmEvent::AllBlocksCleared => {
                self.ours.clear();
                Ok(Some(self.event(Tier::Device, KvEventData::Cleared)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> VllmEvent {
        VllmEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: 2,
            medium: Some("GPU".into()),
        }
    }

    #[test]
    fn a_batch_round_trips_and_keeps_vllm_routers_layout() {
        let batch = VllmBatch {
            ts: 1.5,
            events: vec![
                stored(&[u64::MAX, 7], None, vec![1, 2, 3, 4]),
                VllmEvent::BlockRemoved {
                    block_hashes: vec![7],
                    medium: Some("GPU".into()),
                },
                VllmEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        };
        let bytes = encode_batch(&batch);
        assert_eq!(decode_batch(&bytes), Ok(batch));
        // The layout itself: a 3-array whose events are maps tagged by "type".
        let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let a = v.as_array().unwrap();
        assert_eq!(a.len(), 3);
        let ev = a[1].as_array().unwrap()[0].as_map().unwrap();
        assert_eq!(ev[0].0.as_str(), Some("type"));
        assert_eq!(ev[0].1.as_str(), Some("BlockStored"));
        let keys: Vec<_> = ev.iter().map(|(k, _)| k.as_str().unwrap()).collect();
        assert_eq!(
            keys,
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name"
            ]
        );
    }

    /// `worker.kv_events_layout = "array"`: vLLM's own layout, each event a positional array
    /// led by its tag, in vLLM's field order; it decodes to the same batch.
    #[test]
    fn the_array_layout_is_vllms_positional_one_and_round_trips() {
        let batch = VllmBatch {
            ts: 3.0,
            events: vec![
                stored(&[11, 12], Some(10), vec![1, 2, 3, 4]),
                VllmEvent::BlockRemoved {
                    block_hashes: vec![12],
                    medium: Some("GPU".into()),
                },
                VllmEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        };
        let bytes = encode_batch_as(&batch, EventLayout::Array);
        assert_eq!(decode_batch(&bytes), Ok(batch.clone()));
        assert_ne!(bytes, encode_batch(&batch), "a different layout");
        let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let events = v.as_array().unwrap()[1].as_array().unwrap().clone();
        let st = events[0].as_array().unwrap();
        assert_eq!(st.len(), 8);
        assert_eq!(st[0].as_str(), Some("BlockStored"));
        assert_eq!(
            st[1],
            Value::Array(vec![Value::from(11u64), Value::from(12u64)])
        );
        assert_eq!(st[2].as_u64(), Some(10), "parent_block_hash");
        assert_eq!(st[3].as_array().unwrap().len(), 4, "token_ids");
        assert_eq!(st[4].as_u64(), Some(2), "block_size");
        assert!(st[5].is_nil(), "lora_id");
        assert_eq!(st[6].as_str(), Some("GPU"), "medium");
        assert!(st[7].is_nil(), "lora_name");
        let rm = events[1].as_array().unwrap();
        assert_eq!((rm[0].as_str(), rm.len()), (Some("BlockRemoved"), 3));
        assert_eq!(
            events[2],
            Value::Array(vec![Value::from("AllBlocksCleared")])
        );
        // The setting's spelling.
        let l: EventLayout = serde_json::from_str("\"array\"").unwrap();
        assert_eq!(l, EventLayout::Array);
        assert_eq!(EventLayout::default(), EventLayout::Map);
    }

    #[test]
    fn positional_events_and_map_batches_decode_too() {
        // msgspec's array_like tagged structs: [tag, fields…]; a batch as a map.
        let ev = Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::from(5u64)]),
            Value::Nil,
            Value::Array(vec![Value::from(9u32), Value::from(8u32)]),
            Value::from(2u32),
            Value::Nil,
            Value::from("GPU"),
        ]);
        let batch = Value::Map(vec![
            (Value::from("ts"), Value::F64(2.0)),
            (Value::from("events"), Value::Array(vec![ev])),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &batch).unwrap();
        let b = decode_batch(&bytes).unwrap();
        assert_eq!(b.events, vec![stored(&[5], None, vec![9, 8])]);
        assert_eq!(b.data_parallel_rank, None);
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        for bad in [
            &b""[..],
            &[0xc1],
            &[0x92, 0x01, 0x02], // events not an array
            &[0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x01], // an event that is an int
        ] {
            assert!(decode_batch(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn translated_events_carry_flotilla_hashes_of_the_tokens() {
        let salt = 99;
        let w = WorkerId::new("ext/a");
        let mut t = Translator::new(w.clone(), 2, salt);
        let e1 = t
            .apply(&stored(&[100, 101], None, vec![1, 2, 3, 4]))
            .unwrap()
            .unwrap();
        let e2 = t
            .apply(&stored(&[102], Some(101), vec![5, 6]))
            .unwrap()
            .unwrap();
        let want = crate::kv::block_hashes(&[1, 2, 3, 4, 5, 6], 2, salt);
        let KvEventData::Stored { parent, blocks } = &e1.data else {
            panic!("{e1:?}")
        };
        assert_eq!(*parent, None);
        assert_eq!(blocks[0].seq_hash, want[0].1);
        assert_eq!(blocks[1].seq_hash, want[1].1);
        let KvEventData::Stored { parent, blocks } = &e2.data else {
            panic!("{e2:?}")
        };
        assert_eq!(*parent, Some(want[1].1));
        assert_eq!(blocks[0].seq_hash, want[2].1);
        assert_eq!((e1.event_id, e2.event_id), (EventId(1), EventId(2)));
        assert_eq!(e1.worker, w);
        // Removal by the engine's hash; unknown hashes change nothing.
        let r = t
            .apply(&VllmEvent::BlockRemoved {
                block_hashes: vec![102, 555],
                medium: None,
            })
            .unwrap()
            .unwrap();
        assert_eq!(
            r.data,
            KvEventData::Removed {
                blocks: vec![want[2].1]
            }
        );
        assert_eq!(
            t.apply(&VllmEvent::BlockRemoved {
                block_hashes: vec![555],
                medium: None
            }),
            Ok(None)
        );
        assert_eq!(t.num_blocks(), 2);
    }

    #[test]
    fn chains_that_cannot_be_placed_are_refused_without_change() {
        let mut t = Translator::new(WorkerId::new("ext/a"), 2, 1);
        assert_eq!(
            t.apply(&stored(&[1], Some(77), vec![1, 2])),
            Err(TranslateError::UnknownParent(77))
        );
        assert!(matches!(
            t.apply(&stored(&[1, 2], None, vec![1, 2, 3])),
            Err(TranslateError::TokenCount { .. })
        ));
        let mut wrong = stored(&[1], None, vec![1, 2, 3, 4]);
        if let VllmEvent::BlockStored { block_size, .. } = &mut wrong {
            *block_size = 4;
        }
        assert_eq!(
            t.apply(&wrong),
            Err(TranslateError::BlockSize { got: 4, want: 2 })
        );
        assert_eq!(t.num_blocks(), 0);
        assert_eq!(
            t.apply(&VllmEvent::AllBlocksCleared)
                .unwrap()
                .unwrap()
                .event_id,
            EventId(1)
        );
    }

    #[test]
    fn flotilla_events_become_vllm_events_only_with_their_tokens() {
        let ev = KvEvent {
            worker: WorkerId::new("w"),
            event_id: EventId(1),
            tier: Tier::Device,
            data: KvEventData::Stored {
                parent: Some(SequenceHash(3)),
                blocks: vec![StoredBlock {
                    seq_hash: SequenceHash(4),
                    block_hash: crate::runtime::ids::BlockHash(5),
                }],
            },
        };
        assert_eq!(from_flotilla(&ev, None, 2), None);
        assert_eq!(from_flotilla(&ev, Some(&[1]), 2), None);
        assert_eq!(
            from_flotilla(&ev, Some(&[1, 2]), 2),
            Some(stored(&[4], Some(3), vec![1, 2]))
        );
    }
}
