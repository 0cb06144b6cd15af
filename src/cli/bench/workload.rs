//! Workloads: what to send, turn by turn, independent of when.
//!
//! A workload is a list of [`Session`]s; a session is one or more [`Turn`]s sent one after
//! another (turn k only after turn k−1's answer has returned). Trace workloads have one turn
//! per session and keep the trace's timestamp.
//!
//! Prompts are either **token ids** ([`Prompt::Tokens`], posted to `/v1/completions` as
//! `prompt: [ids]`, so the prompt's tokens — and its prefix sharing — are exactly what the
//! trace says) or **chat messages** ([`Prompt::Chat`], posted to `/v1/chat/completions`; the
//! gateway applies the chat template and tokenises, so token counts are estimates).
//!
//! Ideal prefix hit rate (an infinite cache that never evicts, requests served one after
//! another in workload order):
//! - token prompts, [`ideal_hit_rate_tokens`]: exactly the server's rule — only full
//!   [`SERVER_BLOCK`]-token blocks count, a block hits when the whole prefix up to its end was
//!   a prefix of an earlier prompt, and the prompt's last token is never a hit;
//!   `ideal = Σ hit tokens / Σ prompt tokens`.
//! - chat prompts, [`ideal_hit_rate_chat`]: the same at message granularity on estimated
//!   tokens ([`estimate_tokens`]), so approximate.
//! - Mooncake traces also get the trace's own definition, [`trace_block_hit_rate`]: the
//!   fraction of 512-token blocks whose `hash_id` appeared in an earlier request (36.6 % for
//!   the whole conversation trace).

use std::collections::HashSet;
use std::sync::Arc;

use super::sharegpt::Conversation;
use super::synth::{Segment, combine, mix64, token_ids};
use super::trace::{MOONCAKE_BLOCK, TraceFormat, TraceRecord};

/// KV block size of the server (`worker.block_size_tokens`, default 16): the granularity of
/// its prefix cache.
pub const SERVER_BLOCK: usize = 16;

/// Estimated template overhead per chat message (role markers), in tokens.
pub const CHAT_MESSAGE_OVERHEAD: u32 = 4;

/// Seed tags, so the seeds of different kinds of segment never meet.
const TAG_AZURE: u64 = 0xA2;
const TAG_PAD: u64 = 0xAD;
const TAG_SYSTEM: u64 = 0x5E;
const TAG_USER: u64 = 0x05;
const TAG_ANSWER: u64 = 0xA5;

/// A chat conversation whose prefixes are the prompts of a session's turns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatConv {
    /// System message (empty: none).
    pub system: String,
    /// (user message, recorded answer) per turn.
    pub exchanges: Vec<(String, String)>,
}

impl ChatConv {
    /// The messages of turn `k` as (role, content): the system message (its content prefixed
    /// with `prefix`, when either is non-empty), every earlier exchange (user, then the
    /// *recorded* answer), then turn k's user message.
    pub fn messages(&self, k: usize, prefix: &str) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(2 * k + 2);
        let system = match (prefix.is_empty(), self.system.is_empty()) {
            (true, _) => self.system.clone(),
            (false, true) => prefix.to_owned(),
            (false, false) => format!("{prefix} {}", self.system),
        };
        if !system.is_empty() {
            out.push(("system", system));
        }
        for (u, a) in self.exchanges.iter().take(k) {
            out.push(("user", u.clone()));
            out.push(("assistant", a.clone()));
        }
        if let Some((u, _)) = self.exchanges.get(k) {
            out.push(("user", u.clone()));
        }
        out
    }
}

/// The input of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Token ids, the concatenation of these segments (see [`super::synth`]).
    Tokens(Vec<Segment>),
    /// Turn `turn` of a chat conversation.
    Chat {
        /// The conversation.
        conv: Arc<ChatConv>,
        /// Which turn.
        turn: usize,
    },
}

impl Prompt {
    /// Prompt tokens: exact for token prompts, estimated for chat.
    pub fn tokens(&self) -> u32 {
        match self {
            Prompt::Tokens(segs) => segs.iter().map(|s| s.len).sum(),
            Prompt::Chat { conv, turn } => conv
                .messages(*turn, "")
                .iter()
                .map(|(_, m)| estimate_tokens(m) + CHAT_MESSAGE_OVERHEAD)
                .sum(),
        }
    }
}

/// One request of a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turn {
    /// Its input.
    pub prompt: Prompt,
    /// `max_tokens` (with `ignore_eos`, the exact output length), ≥ 1.
    pub max_tokens: u32,
}

/// Turns sent one after another.
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    /// Trace arrival (ms from the trace start), when the workload has timestamps.
    pub timestamp_ms: Option<f64>,
    /// Turns in order (at least one).
    pub turns: Vec<Turn>,
    /// Session key sent with every turn (`x-session-id`; the simulator passes it to the router
    /// as the gateway does); `None`: none.
    pub key: Option<String>,
}

/// What building the workload changed to fit the caps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Adjustments {
    /// Requests whose prompt was cut to `--max-input-tokens`.
    pub truncated_inputs: usize,
    /// Requests whose output was capped at `--max-output-tokens`.
    pub capped_outputs: usize,
    /// Session turns dropped because their prompt would exceed `--max-input-tokens`.
    pub dropped_turns: usize,
    /// Malformed trace lines skipped (`--skip-bad-lines`).
    pub skipped_lines: usize,
}

/// A workload ready to send.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Short name (trace file stem or dataset name).
    pub name: String,
    /// Sessions in arrival order.
    pub sessions: Vec<Session>,
    /// What the caps changed.
    pub adjustments: Adjustments,
    /// Mooncake's own hit-rate definition on the records used, before the caps (module doc).
    pub trace_block_hit_rate: Option<f64>,
}

/// What `report.json` says about the workload of a run.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct WorkloadInfo {
    /// Workload name.
    pub name: String,
    /// Sessions.
    pub sessions: usize,
    /// What the caps changed.
    #[serde(flatten)]
    pub adjustments: Adjustments,
    /// Mooncake's own definition on the records used, before the caps (`null` otherwise).
    pub trace_block_hit_rate: Option<f64>,
}

impl Workload {
    /// Its entry in `report.json`.
    pub fn info(&self) -> WorkloadInfo {
        WorkloadInfo {
            name: self.name.clone(),
            sessions: self.sessions.len(),
            adjustments: self.adjustments,
            trace_block_hit_rate: self.trace_block_hit_rate,
        }
    }

    /// Requests (turns) in all.
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    /// Whether every session has a trace timestamp.
    pub fn has_timestamps(&self) -> bool {
        !self.sessions.is_empty() && self.sessions.iter().all(|s| s.timestamp_ms.is_some())
    }

    /// The ideal prefix hit rate of the workload (see the module doc), its sessions in the
    /// workload's order; NaN when empty.
    pub fn ideal_hit_rate(&self) -> f64 {
        let order: Vec<usize> = (0..self.sessions.len()).collect();
        ideal_rate(&self.ideal_cached_in(&order))
    }

    /// Per session (indexed as in the workload), per turn: `(ideal cached tokens, prompt
    /// tokens)` (see the module doc; estimated tokens for chat prompts) when the sessions are
    /// sent in `order` (session indices; turns in order within each session). Sessions not in
    /// `order` get no entries.
    pub fn ideal_cached_in(&self, order: &[usize]) -> Vec<Vec<(u64, u64)>> {
        let sessions: Vec<&Session> = order.iter().filter_map(|&i| self.sessions.get(i)).collect();
        let turns = sessions.iter().flat_map(|s| &s.turns);
        let chat = turns
            .clone()
            .any(|t| matches!(t.prompt, Prompt::Chat { .. }));
        let flat = if chat {
            ideal_cached_chat(turns.map(|t| &t.prompt))
        } else {
            ideal_cached_tokens(turns.map(|t| match &t.prompt {
                Prompt::Tokens(segs) => token_ids(segs, 0),
                Prompt::Chat { .. } => Vec::new(),
            }))
        };
        let turns = |i: usize| self.sessions.get(i).map_or(0, |s| s.turns.len());
        per_session(order, turns, self.sessions.len(), flat)
    }
}

/// A flat per-turn list (sessions in `order`, turns in order) back into a table indexed
/// `[session][turn]` of `sessions` sessions; sessions not in `order` get no entries.
pub fn per_session<T: Clone>(
    order: &[usize],
    turns: impl Fn(usize) -> usize,
    sessions: usize,
    flat: Vec<T>,
) -> Vec<Vec<T>> {
    let mut flat = flat.into_iter();
    let mut out = vec![Vec::new(); sessions];
    for &i in order {
        out[i] = flat.by_ref().take(turns(i)).collect();
    }
    out
}

/// Length caps, in tokens.
#[derive(Clone, Copy, Debug)]
pub struct Caps {
    /// Longest prompt.
    pub max_input: u32,
    /// Largest `max_tokens`.
    pub max_output: u32,
}

/// Estimated tokens of `text`: ⌈chars / 4⌉, at least 1 (≈ English with a BPE vocabulary).
pub fn estimate_tokens(text: &str) -> u32 {
    let chars = u32::try_from(text.chars().count()).unwrap_or(u32::MAX);
    chars.div_ceil(4).max(1)
}

/// `max_tokens` for a wanted output of `want` tokens: in 1..=cap; counts a cap.
fn cap_output(want: u32, caps: Caps, adj: &mut Adjustments) -> u32 {
    if want > caps.max_output {
        adj.capped_outputs += 1;
    }
    want.clamp(1, caps.max_output.max(1))
}

/// The segments of a Mooncake prompt: one 512-token segment per `hash_id` (seeded by it), the
/// last cut so the total is `len`; if the ids cover fewer than `len` tokens, a segment unique
/// to request `index` fills the rest.
pub fn mooncake_segments(hash_ids: &[u64], len: u32, index: usize) -> Vec<Segment> {
    let mut segs = Vec::with_capacity(hash_ids.len());
    let mut left = len;
    for &id in hash_ids {
        if left == 0 {
            break;
        }
        let n = left.min(MOONCAKE_BLOCK);
        segs.push(Segment { seed: id, len: n });
        left -= n;
    }
    if left > 0 {
        segs.push(Segment {
            seed: combine(TAG_PAD, index as u64),
            len: left,
        });
    }
    segs
}

/// One single-turn session per trace record (the first `max_requests`). Mooncake prompts are
/// built from `hash_ids`; Azure prompts are random ids unique to each request.
pub fn from_trace(
    name: &str,
    format: TraceFormat,
    records: &[TraceRecord],
    caps: Caps,
    max_requests: usize,
) -> Workload {
    let records = &records[..records.len().min(max_requests)];
    let mut adj = Adjustments::default();
    let mut sessions = Vec::with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        let want = r.input_tokens.max(1);
        if want > caps.max_input {
            adj.truncated_inputs += 1;
        }
        let len = want.min(caps.max_input.max(1));
        let segs = match format {
            TraceFormat::Mooncake => mooncake_segments(&r.hash_ids, len, i),
            TraceFormat::Azure => vec![Segment {
                seed: combine(TAG_AZURE, i as u64),
                len,
            }],
        };
        let max_tokens = cap_output(r.output_tokens, caps, &mut adj);
        sessions.push(Session {
            timestamp_ms: Some(r.timestamp_ms),
            key: None,
            turns: vec![Turn {
                prompt: Prompt::Tokens(segs),
                max_tokens,
            }],
        });
    }
    sessions.sort_by(|a, b| {
        a.timestamp_ms
            .unwrap_or(0.0)
            .total_cmp(&b.timestamp_ms.unwrap_or(0.0))
    });
    let trace_block_hit_rate =
        (format == TraceFormat::Mooncake).then(|| trace_block_hit_rate(records));
    Workload {
        name: name.to_owned(),
        sessions,
        adjustments: adj,
        trace_block_hit_rate,
    }
}

/// Cut `text` to at most `max_chars` characters.
fn cut_chars(text: &str, max_chars: usize) -> String {
    text.chars().take(max_chars).collect()
}

/// One session per ShareGPT conversation, one turn per exchange, at most `max_requests`
/// turns in all. A turn whose estimated prompt exceeds the input cap ends its session (it and
/// later turns are dropped); a first turn that alone exceeds it has its user message cut.
/// `max_tokens` = the recorded answer's estimated tokens, capped.
pub fn from_sharegpt(convs: &[Conversation], caps: Caps, max_requests: usize) -> Workload {
    let mut adj = Adjustments::default();
    let mut sessions = Vec::new();
    let mut budget = max_requests;
    for c in convs {
        if budget == 0 {
            break;
        }
        let mut conv = ChatConv {
            system: c.system.clone(),
            exchanges: c
                .exchanges
                .iter()
                .map(|e| (e.user.clone(), e.answer.clone()))
                .collect(),
        };
        fit_first_turn(&mut conv, caps, &mut adj);
        let conv = Arc::new(conv);
        let n = conv.exchanges.len();
        let mut turns = Vec::new();
        for k in 0..n {
            if turns.len() == budget {
                break;
            }
            let prompt = Prompt::Chat {
                conv: Arc::clone(&conv),
                turn: k,
            };
            if prompt.tokens() > caps.max_input {
                adj.dropped_turns += n - k;
                break;
            }
            let max_tokens = cap_output(estimate_tokens(&conv.exchanges[k].1), caps, &mut adj);
            turns.push(Turn { prompt, max_tokens });
        }
        budget -= turns.len();
        push_untimed(&mut sessions, turns);
    }
    Workload {
        name: "sharegpt".to_owned(),
        sessions,
        adjustments: adj,
        trace_block_hit_rate: None,
    }
}

/// Cut the system and first user message so turn 0's estimated prompt fits the input cap.
fn fit_first_turn(conv: &mut ChatConv, caps: Caps, adj: &mut Adjustments) {
    let first = Prompt::Chat {
        conv: Arc::new(ChatConv {
            system: conv.system.clone(),
            exchanges: conv.exchanges.iter().take(1).cloned().collect(),
        }),
        turn: 0,
    };
    if first.tokens() <= caps.max_input {
        return;
    }
    adj.truncated_inputs += 1;
    // Room for the two texts; ⌈4n chars / 4⌉ = n tokens, so cutting to 4n chars gives n.
    let room = caps
        .max_input
        .saturating_sub(2 * CHAT_MESSAGE_OVERHEAD)
        .max(2) as usize;
    if !conv.system.is_empty() {
        conv.system = cut_chars(&conv.system, 4 * (room / 2));
    }
    let used = if conv.system.is_empty() {
        0
    } else {
        estimate_tokens(&conv.system) as usize
    };
    if let Some((u, _)) = conv.exchanges.first_mut() {
        *u = cut_chars(u, 4 * room.saturating_sub(used).max(1));
    }
}

/// Shape of `--dataset synthetic-sessions`.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticSpec {
    /// Sessions.
    pub sessions: usize,
    /// Turns per session.
    pub turns: usize,
    /// Tokens of the system prefix all sessions share.
    pub system_tokens: u32,
    /// Tokens of each user message.
    pub user_tokens: u32,
    /// Tokens of each answer (its `max_tokens` and its length in later turns' history).
    pub output_tokens: u32,
}

/// `sessions` sessions of `turns` turns: turn k's prompt = the shared system prefix, then for
/// every earlier turn its user message and a synthetic answer of `output_tokens` ids, then turn
/// k's user message — all token ids, deterministic. Turns whose prompt would exceed the input
/// cap end their session; at most `max_requests` turns in all.
pub fn synthetic_sessions(spec: SyntheticSpec, caps: Caps, max_requests: usize) -> Workload {
    let mut adj = Adjustments::default();
    let system = Segment {
        seed: combine(TAG_SYSTEM, 0),
        len: spec.system_tokens,
    };
    let mut sessions = Vec::with_capacity(spec.sessions);
    let mut budget = max_requests;
    for s in 0..spec.sessions as u64 {
        if budget == 0 {
            break;
        }
        let mut history = if spec.system_tokens > 0 {
            vec![system]
        } else {
            Vec::new()
        };
        let mut turns = Vec::new();
        for k in 0..spec.turns {
            if turns.len() == budget {
                break;
            }
            let Some(turn) = next_turn(&mut history, &spec, (s, k), caps, &mut adj) else {
                adj.dropped_turns += spec.turns - k;
                break;
            };
            turns.push(turn);
        }
        budget -= turns.len();
        push_untimed(&mut sessions, turns);
    }
    Workload {
        name: "synthetic-sessions".to_owned(),
        sessions,
        adjustments: adj,
        trace_block_hit_rate: None,
    }
}

/// Shape of `--dataset agent-sessions` (`agent_sessions`).
#[derive(Clone, Copy, Debug)]
pub struct AgentSpec {
    /// Agents (`sessions`), their turns and token lengths, as synthetic-sessions.
    pub base: SyntheticSpec,
    /// Sub-requests per burst (0: none).
    pub fanout: usize,
    /// A burst after every this many turns (≥ 1).
    pub fanout_every: usize,
    /// Agent `a` starts at `a × agent_gap_ms` (trace ms).
    pub agent_gap_ms: f64,
    /// The burst after turn `k` of an agent is sent `(k + 1) × turn_gap_ms` after it starts.
    pub turn_gap_ms: f64,
}

/// Turn `k` of session `s` over its `history` (system prefix and earlier turns): the history
/// plus turn k's user message, `None` when that passes `caps.max_input`; else the history
/// grows by the message and its synthetic answer (`output_tokens`, capped).
fn next_turn(
    history: &mut Vec<Segment>,
    spec: &SyntheticSpec,
    (s, k): (u64, usize),
    caps: Caps,
    adj: &mut Adjustments,
) -> Option<Turn> {
    let mut segs = history.clone();
    segs.push(Segment {
        seed: combine(combine(TAG_USER, s), k as u64),
        len: spec.user_tokens.max(1),
    });
    let len: u32 = segs.iter().map(|x| x.len).sum();
    if len > caps.max_input {
        return None;
    }
    let max_tokens = cap_output(spec.output_tokens, caps, adj);
    let turn = Turn {
        prompt: Prompt::Tokens(segs.clone()),
        max_tokens,
    };
    *history = segs;
    history.push(Segment {
        seed: combine(combine(TAG_ANSWER, s), k as u64),
        len: max_tokens,
    });
    Some(turn)
}

/// A multi-turn agent workload with session keys: agent `a` is a session keyed `agent-<a>`
/// (sent as `x-session-id`) starting at `a × agent_gap_ms`, whose turn k's prompt is the shared
/// system prefix, every earlier turn (user message + recorded answer) and turn k's message
/// (as [`synthetic_sessions`]: long shared histories). After every `fanout_every`-th turn k,
/// a **burst** of `fanout` sub-requests (sub-agents, tool calls) is sent at once, at
/// `(k + 1) × turn_gap_ms` after the agent started: each one a one-turn session under the
/// same key whose prompt is the agent's history through turn k's answer plus its own task
/// message (`user_tokens`). Workload order: each agent, then its bursts; timestamps order the
/// arrivals (`--arrival trace` by default). Turns past `max_input` tokens are dropped (and
/// counted), as are the bursts after them.
pub fn agent_sessions(spec: AgentSpec, caps: Caps, max_requests: usize) -> Workload {
    const TAG_TASK: u64 = 0x7A;
    let b = spec.base;
    let mut adj = Adjustments::default();
    let system = Segment {
        seed: combine(TAG_SYSTEM, 0),
        len: b.system_tokens,
    };
    let mut sessions = Vec::new();
    let mut budget = max_requests;
    for s in 0..b.sessions as u64 {
        if budget == 0 {
            break;
        }
        let key = format!("agent-{s}");
        let start = s as f64 * spec.agent_gap_ms;
        let mut history = if b.system_tokens > 0 {
            vec![system]
        } else {
            Vec::new()
        };
        let mut turns = Vec::new();
        let mut bursts = Vec::new();
        for k in 0..b.turns {
            if turns.len() + bursts.len() >= budget {
                break;
            }
            let Some(turn) = next_turn(&mut history, &b, (s, k), caps, &mut adj) else {
                adj.dropped_turns += b.turns - k;
                break;
            };
            turns.push(turn);
            if (k + 1) % spec.fanout_every != 0 {
                continue;
            }
            for j in 0..spec.fanout {
                if turns.len() + bursts.len() >= budget {
                    break;
                }
                let mut segs = history.clone();
                segs.push(Segment {
                    seed: combine(combine(combine(TAG_TASK, s), k as u64), j as u64),
                    len: b.user_tokens.max(1),
                });
                let len: u32 = segs.iter().map(|x| x.len).sum();
                if len > caps.max_input {
                    adj.dropped_turns += 1;
                    continue;
                }
                let max_tokens = cap_output(b.output_tokens, caps, &mut adj);
                bursts.push(Session {
                    timestamp_ms: Some(start + (k + 1) as f64 * spec.turn_gap_ms),
                    turns: vec![Turn {
                        prompt: Prompt::Tokens(segs),
                        max_tokens,
                    }],
                    key: Some(key.clone()),
                });
            }
        }
        budget -= turns.len() + bursts.len();
        if !turns.is_empty() {
            sessions.push(Session {
                timestamp_ms: Some(start),
                turns,
                key: Some(key),
            });
        }
        sessions.extend(bursts);
    }
    Workload {
        name: "agent-sessions".to_owned(),
        sessions,
        adjustments: adj,
        trace_block_hit_rate: None,
    }
}

/// Mooncake's definition: fraction of `hash_ids` (512-token blocks) that appeared in an earlier
/// record, over all records in order; NaN when there are none.
pub fn trace_block_hit_rate(records: &[TraceRecord]) -> f64 {
    let mut seen = HashSet::new();
    let (mut hit, mut total) = (0usize, 0usize);
    for r in records {
        total += r.hash_ids.len();
        hit += r.hash_ids.iter().filter(|h| seen.contains(*h)).count();
        seen.extend(r.hash_ids.iter().copied());
    }
    hit as f64 / total as f64
}

/// Chained hash of one block after `parent` (0 for the first block).
fn chain(parent: u64, block: &[u32]) -> u64 {
    let h = block.iter().fold(0x51_7C_C1_B7_27_22_0A_95, |acc, &t| {
        mix64(acc ^ u64::from(t))
    });
    combine(parent, h)
}

/// Ideal hit rate of token prompts at the server's block granularity (module doc); NaN when
/// there are no prompt tokens.
pub fn ideal_hit_rate_tokens(prompts: impl Iterator<Item = Vec<u32>>) -> f64 {
    rate(&ideal_cached_tokens(prompts))
}

/// `Σ hit / Σ total` over every turn of a [`Workload::ideal_cached_in`] table; NaN when empty.
pub fn ideal_rate(table: &[Vec<(u64, u64)>]) -> f64 {
    rate(&table.concat())
}

/// `Σ hit / Σ total` of `(hit, total)` pairs; NaN when the total is 0.
fn rate(per_prompt: &[(u64, u64)]) -> f64 {
    let (hit, total) = per_prompt
        .iter()
        .fold((0, 0), |(h, t), (ph, pt)| (h + ph, t + pt));
    hit as f64 / total as f64
}

/// Per token prompt, in order: `(ideal cached tokens, prompt tokens)` under the server's rule
/// (module doc).
pub fn ideal_cached_tokens(prompts: impl Iterator<Item = Vec<u32>>) -> Vec<(u64, u64)> {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Vec::new();
    for p in prompts {
        let mut hit = 0u64;
        let mut parent = 0;
        let mut hitting = true;
        let last = p.len().saturating_sub(1);
        for (i, block) in p.chunks_exact(SERVER_BLOCK).enumerate() {
            parent = chain(parent, block);
            let fits = (i + 1) * SERVER_BLOCK <= last;
            hitting = hitting && fits && seen.contains(&parent);
            if hitting {
                hit += SERVER_BLOCK as u64;
            }
            seen.insert(parent);
        }
        out.push((hit, p.len() as u64));
    }
    out
}

/// Ideal hit rate of chat prompts at message granularity on estimated tokens (module doc);
/// NaN when there are none.
pub fn ideal_hit_rate_chat<'a>(prompts: impl Iterator<Item = &'a Prompt>) -> f64 {
    rate(&ideal_cached_chat(prompts))
}

/// Per chat prompt, in order (other prompts give `(0, 0)`): `(ideal cached, estimated
/// prompt tokens)` at message granularity (module doc).
pub fn ideal_cached_chat<'a>(prompts: impl Iterator<Item = &'a Prompt>) -> Vec<(u64, u64)> {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Vec::new();
    for p in prompts {
        let (mut hit, mut total) = (0u64, 0u64);
        let Prompt::Chat { conv, turn } = p else {
            out.push((0, 0));
            continue;
        };
        let msgs = conv.messages(*turn, "");
        let mut parent = 0;
        let mut hitting = true;
        for (i, (role, text)) in msgs.iter().enumerate() {
            let tokens = u64::from(estimate_tokens(text) + CHAT_MESSAGE_OVERHEAD);
            total += tokens;
            parent = combine(parent, text_hash(role, text));
            hitting = hitting && i + 1 < msgs.len() && seen.contains(&parent);
            if hitting {
                hit += tokens;
            }
            seen.insert(parent);
        }
        out.push((hit, total));
    }
    out
}

fn text_hash(role: &str, text: &str) -> u64 {
    role.bytes()
        .chain([0])
        .chain(text.bytes())
        .fold(0xCB_F2_9C_E4_84_22_23_25, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3)
        })
}

/// Append a session without a timestamp unless it has no turns.
fn push_untimed(sessions: &mut Vec<Session>, turns: Vec<Turn>) {
    if !turns.is_empty() {
        sessions.push(Session {
            timestamp_ms: None,
            turns,
            key: None,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::bench::sharegpt::Exchange;

    const CAPS: Caps = Caps {
        max_input: 4096,
        max_output: 256,
    };

    fn rec(t: f64, input: u32, output: u32, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp_ms: t,
            input_tokens: input,
            output_tokens: output,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn mooncake_prompt_synthesis() {
        let segs = mooncake_segments(&[5, 9, 7], 1100, 0);
        assert_eq!(
            segs,
            vec![
                Segment { seed: 5, len: 512 },
                Segment { seed: 9, len: 512 },
                Segment { seed: 7, len: 76 },
            ]
        );
        let a = token_ids(&segs, 0);
        let b = token_ids(&mooncake_segments(&[5, 9, 8], 1100, 1), 0);
        assert_eq!(a.len(), 1100);
        assert_eq!(a[..1024], b[..1024], "same hash_ids, same ids");
        assert_ne!(a[1024..], b[1024..], "different hash_id, different ids");
        let full7 = token_ids(&[Segment { seed: 7, len: 512 }], 0);
        assert_eq!(
            a[1024..],
            full7[..76],
            "last block is a cut of the full block"
        );
        // Cap: 3 blocks cut to 600 tokens keep 2.
        assert_eq!(mooncake_segments(&[5, 9, 7], 600, 0).len(), 2);
        // Too few ids: a request-unique pad fills the rest.
        let padded = mooncake_segments(&[5], 600, 3);
        assert_eq!(padded[1].len, 88);
        assert_ne!(padded, mooncake_segments(&[5], 600, 4));
    }

    #[test]
    fn trace_workload_caps_and_order() {
        let recs = [
            rec(3000.0, 5000, 300, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
            rec(0.0, 100, 0, &[0]),
            rec(6000.0, 10, 10, &[11]),
        ];
        let w = from_trace("t", TraceFormat::Mooncake, &recs, CAPS, 2);
        assert_eq!(w.requests(), 2);
        assert_eq!(w.sessions[0].timestamp_ms, Some(0.0), "sorted by time");
        assert_eq!(w.sessions[1].turns[0].prompt.tokens(), 4096);
        assert_eq!(w.sessions[1].turns[0].max_tokens, 256);
        assert_eq!(w.sessions[0].turns[0].max_tokens, 1, "at least one token");
        assert_eq!(
            w.adjustments,
            Adjustments {
                truncated_inputs: 1,
                capped_outputs: 1,
                dropped_turns: 0,
                skipped_lines: 0,
            }
        );
        assert!(w.has_timestamps());
        let az = from_trace("a", TraceFormat::Azure, &recs, CAPS, 10);
        assert_eq!(az.trace_block_hit_rate, None);
        let Prompt::Tokens(s0) = &az.sessions[0].turns[0].prompt else {
            panic!()
        };
        let Prompt::Tokens(s1) = &az.sessions[1].turns[0].prompt else {
            panic!()
        };
        assert_ne!(s0[0].seed, s1[0].seed, "no sharing between Azure requests");
    }

    #[test]
    fn ideal_hit_rate_on_tiny_trace() {
        // Mooncake definition: blocks [0,1], [0,2], [0,1,3] → hits: 0 (2nd), 0 and 1 (3rd).
        let recs = [
            rec(0.0, 1024, 1, &[0, 1]),
            rec(1.0, 1024, 1, &[0, 2]),
            rec(2.0, 1536, 1, &[0, 1, 3]),
        ];
        assert!((trace_block_hit_rate(&recs) - 3.0 / 7.0).abs() < 1e-12);
        // Server granularity: 2nd request hits block 0 (512 tokens), 3rd hits 1024 tokens.
        let w = from_trace("t", TraceFormat::Mooncake, &recs, CAPS, 10);
        let want = (512.0 + 1024.0) / (1024.0 + 1024.0 + 1536.0);
        assert!(
            (w.ideal_hit_rate() - want).abs() < 1e-12,
            "{}",
            w.ideal_hit_rate()
        );
        // The last token is never a hit: a repeated 32-token prompt hits one block, not two.
        let p: Vec<u32> = (0..32).collect();
        let r = ideal_hit_rate_tokens([p.clone(), p].into_iter());
        assert!((r - 16.0 / 64.0).abs() < 1e-12, "{r}");
        // A partial block never hits; a divergence stops the chain.
        let q: Vec<u32> = (0..40).collect();
        let mut q2 = q.clone();
        q2[0] = 99;
        assert_eq!(ideal_hit_rate_tokens([q, q2].into_iter()), 0.0);
    }

    #[test]
    fn agent_sessions_are_keyed_and_bursts_share_the_history() {
        let spec = AgentSpec {
            base: SyntheticSpec {
                sessions: 2,
                turns: 4,
                system_tokens: 64,
                user_tokens: 16,
                output_tokens: 8,
            },
            fanout: 3,
            fanout_every: 2,
            agent_gap_ms: 1000.0,
            turn_gap_ms: 100.0,
        };
        let w = agent_sessions(spec, CAPS, usize::MAX);
        // Per agent: its session of 4 turns, then 2 bursts of 3.
        assert_eq!(w.sessions.len(), 2 * (1 + 6));
        assert_eq!(w.requests(), 2 * (4 + 6));
        let agent = &w.sessions[0];
        assert_eq!(agent.key.as_deref(), Some("agent-0"));
        let sub = &w.sessions[1];
        assert_eq!(sub.key.as_deref(), Some("agent-0"));
        assert_eq!(
            sub.timestamp_ms,
            Some(200.0),
            "after turn 1: (1 + 1) × 100 ms"
        );
        assert_eq!(w.sessions[7].key.as_deref(), Some("agent-1"));
        assert_eq!(w.sessions[7].timestamp_ms, Some(1000.0));
        // A burst's prompt is turn 2's prompt without its message: the history through turn 1.
        let (Prompt::Tokens(turn2), Prompt::Tokens(burst)) =
            (&agent.turns[2].prompt, &sub.turns[0].prompt)
        else {
            panic!("token prompts")
        };
        assert_eq!(turn2[..turn2.len() - 1], burst[..burst.len() - 1]);
        assert_ne!(turn2.last(), burst.last());
    }

    #[test]
    fn synthetic_sessions_share_prefix() {
        let spec = SyntheticSpec {
            sessions: 3,
            turns: 3,
            system_tokens: 1024,
            user_tokens: 64,
            output_tokens: 32,
        };
        let w = synthetic_sessions(spec, CAPS, usize::MAX);
        assert_eq!(w.requests(), 9);
        let ids = |s: usize, k: usize| match &w.sessions[s].turns[k].prompt {
            Prompt::Tokens(segs) => token_ids(segs, 0),
            Prompt::Chat { .. } => panic!(),
        };
        assert_eq!(ids(0, 0).len(), 1024 + 64);
        assert_eq!(ids(0, 1).len(), 1024 + 64 + 32 + 64);
        assert_eq!(ids(0, 0)[..1024], ids(2, 0)[..1024], "shared system prefix");
        assert_ne!(ids(0, 0)[1024..], ids(1, 0)[1024..]);
        assert_eq!(ids(0, 1)[..1088], ids(0, 0)[..], "turn k extends turn k-1");
        let same = synthetic_sessions(spec, CAPS, usize::MAX);
        assert_eq!(same.sessions, w.sessions, "deterministic");
        assert!(w.ideal_hit_rate() > 0.5);
        // Caps: a 1200-token input cap keeps 2 turns per session (turn 2 dropped); with
        // max_requests 4 the second session stops at the budget, which is not a drop.
        let small = Caps {
            max_input: 1200,
            max_output: 256,
        };
        let c = synthetic_sessions(spec, small, 4);
        assert_eq!(
            c.sessions.iter().map(|s| s.turns.len()).collect::<Vec<_>>(),
            [2, 2]
        );
        assert_eq!(c.adjustments.dropped_turns, 1);
    }

    #[test]
    fn sharegpt_sessions() {
        let conv = Conversation {
            system: String::new(),
            exchanges: vec![
                Exchange {
                    user: "a".repeat(40),
                    answer: "b".repeat(4000),
                },
                Exchange {
                    user: "c".repeat(40),
                    answer: "d".repeat(8),
                },
                Exchange {
                    user: "e".repeat(40),
                    answer: "f".repeat(8),
                },
            ],
        };
        let w = from_sharegpt(&[conv.clone(), conv.clone()], CAPS, 5);
        assert_eq!(w.requests(), 5);
        assert_eq!(w.sessions[0].turns[0].max_tokens, 256);
        assert_eq!(w.sessions[0].turns[1].max_tokens, 2);
        let Prompt::Chat { conv: c, turn } = &w.sessions[0].turns[2].prompt else {
            panic!()
        };
        let msgs = c.messages(*turn, "Run 1.");
        assert_eq!(msgs.len(), 6);
        assert_eq!(msgs[0], ("system", "Run 1.".to_owned()));
        assert_eq!(msgs[2].0, "assistant");
        assert!(w.ideal_hit_rate() > 0.0);
        // A 1000-token cap drops turn 1 onwards (the 4000-char answer is ~1000 tokens).
        let small = Caps {
            max_input: 1000,
            max_output: 256,
        };
        let w = from_sharegpt(&[conv], small, 10);
        assert_eq!(w.requests(), 1);
        assert_eq!(w.adjustments.dropped_turns, 2);
        // A first turn longer than the cap is cut.
        let long = Conversation {
            system: "s".repeat(10_000),
            exchanges: vec![Exchange {
                user: "u".repeat(10_000),
                answer: "x".into(),
            }],
        };
        let w = from_sharegpt(&[long], small, 10);
        assert_eq!(w.requests(), 1);
        assert_eq!(w.adjustments.truncated_inputs, 1);
        assert!(w.sessions[0].turns[0].prompt.tokens() <= 1000);
    }
}
