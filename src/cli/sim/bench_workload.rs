//! A `flotilla bench` workload as the simulator reads it ([`BenchWorkload`]): the bench's
//! sessions and turns behind [`SimWorkload`], token-id prompts under one salt and chat
//! prompts rendered once, before the run, through the gateway's own frontend.

use anyhow::Context;

use crate::cli::bench::driver::chat_salt_prefix;
use crate::cli::bench::metrics;
use crate::cli::bench::synth;
use crate::cli::bench::workload::{Prompt, Workload};
use crate::model::chat_template::ChatMessage;
use crate::request_plane::frontend::Frontend;
use crate::sim::{SimTurn, SimWorkload};

/// A `flotilla bench` workload as the simulator reads it: token-id prompts under one salt;
/// chat prompts (ShareGPT) rendered once, before the run, through the gateway's own
/// [`Frontend::chat_ids`] (the model's chat template and tokenizer), with the same salted
/// system message `flotilla bench` sends.
pub struct BenchWorkload<'a> {
    pub workload: &'a Workload,
    pub salt: u64,
    /// Chat turns' token ids, `[session][turn]` (empty for a token-id workload).
    pub(super) chat: Vec<Vec<Vec<u32>>>,
    /// `--classes`: session `i`'s priority class (`metrics::class_of`).
    pub classes: Vec<String>,
}

impl<'a> BenchWorkload<'a> {
    /// The workload under `salt`; a chat workload needs the model's `frontend`.
    ///
    /// # Errors
    /// A chat workload without a frontend, or a conversation the chat template rejects
    /// (named).
    pub fn new(
        workload: &'a Workload,
        salt: u64,
        frontend: Option<&Frontend>,
    ) -> anyhow::Result<Self> {
        let chat_turns = workload
            .sessions
            .iter()
            .flat_map(|s| &s.turns)
            .any(|t| matches!(t.prompt, Prompt::Chat { .. }));
        let mut chat = Vec::new();
        if chat_turns {
            let frontend = frontend.context("a chat workload needs the model's chat template")?;
            let prefix = chat_salt_prefix(salt);
            for (i, s) in workload.sessions.iter().enumerate() {
                let mut turns = Vec::with_capacity(s.turns.len());
                for (k, t) in s.turns.iter().enumerate() {
                    let ids = match &t.prompt {
                        Prompt::Chat { conv, turn } => {
                            let msgs: Vec<ChatMessage> = conv
                                .messages(*turn, &prefix)
                                .into_iter()
                                .map(|(role, content)| ChatMessage {
                                    role: role.to_owned(),
                                    content,
                                })
                                .collect();
                            frontend.chat_ids(&msgs).map_err(|e| {
                                anyhow::anyhow!("session {i}, turn {k}: {}", e.message)
                            })?
                        }
                        Prompt::Tokens(segs) => synth::token_ids(segs, salt),
                    };
                    turns.push(ids);
                }
                chat.push(turns);
            }
        }
        Ok(Self {
            workload,
            salt,
            chat,
            classes: Vec::new(),
        })
    }
}

impl SimWorkload for BenchWorkload<'_> {
    fn sessions(&self) -> usize {
        self.workload.sessions.len()
    }

    fn turns(&self, i: usize) -> usize {
        self.workload.sessions.get(i).map_or(0, |s| s.turns.len())
    }

    fn class(&self, i: usize) -> Option<&str> {
        metrics::class_of(&self.classes, i)
    }

    fn turn(&self, i: usize, k: usize) -> SimTurn {
        let t = &self.workload.sessions[i].turns[k];
        let prompt = match (&t.prompt, self.chat.get(i).and_then(|s| s.get(k))) {
            (_, Some(ids)) => ids.clone(),
            (Prompt::Tokens(segs), None) => synth::token_ids(segs, self.salt),
            // `new` renders every chat turn.
            (Prompt::Chat { .. }, None) => Vec::new(),
        };
        SimTurn {
            prompt,
            max_tokens: t.max_tokens,
        }
    }

    fn session_key(&self, i: usize) -> Option<String> {
        self.workload.sessions.get(i).and_then(|s| s.key.clone())
    }
}
