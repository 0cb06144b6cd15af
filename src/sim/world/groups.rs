//! The sets of workers the simulated router reads ([`WorkerSource`]): the live fleet's
//! process groups (routable, alive, prefill, decode), which workers join and leave through
//! their cores' effects.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::request_plane::router::core::WorkerSource;
use crate::runtime::ids::WorkerId;
use crate::runtime::role::{Role, role_group};
use crate::worker::scheduler::{ROUTABLE_GROUP, SCHEDULER_GROUP};

/// The sets of workers the router reads (the live fleet's process groups): each a list in
/// the order workers joined, with a set beside it for membership.
#[derive(Default)]
pub(super) struct Groups {
    routable: Mutex<Members>,
    alive: Mutex<Members>,
    prefill: Mutex<Members>,
    decode: Mutex<Members>,
}

#[derive(Default)]
struct Members {
    list: Vec<WorkerId>,
    set: HashSet<WorkerId>,
}

impl Members {
    fn join(&mut self, w: &WorkerId) {
        if self.set.insert(w.clone()) {
            self.list.push(w.clone());
        }
    }

    fn leave(&mut self, w: &WorkerId) {
        if self.set.remove(w) {
            self.list.retain(|x| x != w);
        }
    }
}

fn lock(m: &Mutex<Members>) -> std::sync::MutexGuard<'_, Members> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Groups {
    fn set(&self, group: &str) -> Option<&Mutex<Members>> {
        if group == ROUTABLE_GROUP {
            Some(&self.routable)
        } else if group == SCHEDULER_GROUP {
            Some(&self.alive)
        } else if Some(group) == role_group(Role::Prefill) {
            Some(&self.prefill)
        } else if Some(group) == role_group(Role::Decode) {
            Some(&self.decode)
        } else {
            None
        }
    }

    pub(super) fn join(&self, group: &str, w: &WorkerId) {
        if let Some(set) = self.set(group) {
            lock(set).join(w);
        }
    }

    pub(super) fn leave(&self, group: &str, w: &WorkerId) {
        if let Some(set) = self.set(group) {
            lock(set).leave(w);
        }
    }

    pub(super) fn leave_all(&self, w: &WorkerId) {
        for set in [&self.routable, &self.alive, &self.prefill, &self.decode] {
            lock(set).leave(w);
        }
    }
}

impl WorkerSource for Groups {
    fn routable(&self) -> Vec<WorkerId> {
        lock(&self.routable).list.clone()
    }
    fn alive(&self) -> Vec<WorkerId> {
        lock(&self.alive).list.clone()
    }
    fn in_role(&self, role: Role) -> Vec<WorkerId> {
        match role {
            Role::Prefill => lock(&self.prefill).list.clone(),
            Role::Decode => lock(&self.decode).list.clone(),
            Role::Aggregated => Vec::new(),
        }
    }
}
