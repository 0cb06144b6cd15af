//! The Chaos actor: carries out the faults aimed at its node.
//!
//! One per node, in the process group [`CHAOS_GROUP`] as `<node>/chaos`. One-shot kinds
//! (`kill_actor`, `kill_node`, `panic_task`) and `partition` act here; the others go into the
//! node's [`FaultBook`] (`control/chaos.rs`, which says where each one acts).

use crate::control::chaos::{
    CHAOS_GROUP, FaultBook, FaultKind, Injection, NODE_ACTORS, actor_name,
};
use crate::runtime::ids::WorkerId;
use crate::runtime::wire::Wire;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use std::collections::HashMap;
use std::time::Duration;

/// Chaos messages (serializable: the gateway on any node sends them).
#[derive(RactorClusterMessage)]
pub enum ChaosMsg {
    /// Install a fault on this node (cast).
    Apply(Wire<Injection>),
    /// Remove a fault (cast; unknown ids ignored).
    Clear(Wire<u64>),
    /// [`ChaosMsg::Apply`], answered once the fault is in force (call).
    #[rpc]
    ApplyAck(Wire<Injection>, RpcReplyPort<Wire<bool>>),
    /// [`ChaosMsg::Clear`], answered once the fault is gone (call).
    #[rpc]
    ClearAck(Wire<u64>, RpcReplyPort<Wire<bool>>),
}

/// The Chaos actor; its arguments are the node's fault book and its cluster handle.
#[derive(Debug, Default, Clone, Copy)]
pub struct Chaos;

/// A partition in force on this node: the peers it cut (name, listen address) and one side
/// of the cut.
type ActivePartition = (Vec<(String, String)>, Vec<String>);

/// Chaos actor state.
pub struct ChaosState {
    book: FaultBook,
    cluster: crate::runtime::cluster::ClusterHandle,
    /// Active partitions by fault id.
    partitions: HashMap<u64, ActivePartition>,
}

impl ChaosState {
    async fn partition(&mut self, myself: &ActorRef<ChaosMsg>, inj: &Injection, nodes: &[String]) {
        let me = self.cluster.node_id.to_string();
        self.cluster.partition.set(&me, nodes);
        let cut = self.cluster.partition.cut(&self.cluster.server).await;
        // KV transfers stop across the cut too: regions owned by nodes on the far side.
        let mut far: Vec<String> = cut.iter().map(|(name, _)| name.clone()).collect();
        if !nodes.contains(&me) {
            far.extend(nodes.iter().cloned());
        }
        self.book.transfer.set_cut(&far);
        self.partitions.insert(inj.id, (cut, nodes.to_vec()));
        if let Some(ms) = inj.duration_ms {
            let id = inj.id;
            myself.send_after(Duration::from_millis(ms), move || {
                ChaosMsg::Clear(Wire::encode(&id))
            });
        }
    }

    async fn apply(&mut self, myself: &ActorRef<ChaosMsg>, inj: Injection) {
        tracing::warn!(fault = inj.id, kind = ?inj.kind, workers = ?inj.workers, "chaos: fault installed");
        match &inj.kind {
            FaultKind::KillActor { actor } => kill_actors(actor, &inj.node, &inj.workers),
            FaultKind::KillNode => kill_this_node(),
            FaultKind::PanicTask => {
                tokio::spawn(async { panic!("injected panic in a bare task (chaos)") });
            }
            FaultKind::Partition { nodes } => {
                let nodes = nodes.clone();
                self.partition(myself, &inj, &nodes).await;
            }
            _ => self.book.apply(inj),
        }
    }

    fn clear(&mut self, id: u64) {
        self.heal(id);
        if self.book.clear(id) {
            tracing::warn!(fault = id, "chaos: fault cleared");
        }
    }

    /// Heal partition `id`: drop the filter and dial every peer across the cut — those it
    /// cut and those the membership table knows (the far side may have cut first). Both
    /// sides dial; `ractor_cluster` elects one session when two connect at once.
    fn heal(&mut self, id: u64) {
        let Some((cut, group)) = self.partitions.remove(&id) else {
            return;
        };
        self.cluster.partition.clear();
        self.book.transfer.set_cut(&[]);
        tracing::warn!(fault = id, "chaos: partition healed");
        let me = self.cluster.node_id.to_string();
        let server = self.cluster.server.clone();
        let discovery = crate::actors::discovery::local(&format!("{me}/discovery"));
        tokio::spawn(async move {
            let inside = group.contains(&me);
            let mut addrs: Vec<(String, String)> = cut;
            if let Some(d) = discovery
                && let Ok(view) = crate::actors::discovery::fleet(&d).await
            {
                for n in view {
                    let peer = n.id.to_string();
                    if peer != me && group.contains(&peer) != inside {
                        addrs.push((peer, n.addr.clone()));
                    }
                }
            }
            addrs.sort();
            addrs.dedup();
            for (peer, addr) in addrs {
                if let Err(e) = ractor_cluster::client_connect(&server, addr.as_str()).await {
                    tracing::warn!(%peer, error = %e, "re-dial after a partition failed");
                }
            }
        });
    }
}

impl Actor for Chaos {
    type Msg = ChaosMsg;
    type State = ChaosState;
    type Arguments = (FaultBook, crate::runtime::cluster::ClusterHandle);

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        (book, cluster): (FaultBook, crate::runtime::cluster::ClusterHandle),
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(CHAOS_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(ChaosState {
            book,
            cluster,
            partitions: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ChaosMsg::Apply(w) => {
                if let Ok(inj) = w.decode() {
                    state.apply(&myself, inj).await;
                }
            }
            ChaosMsg::ApplyAck(w, reply) => {
                let ok = match w.decode() {
                    Ok(inj) => {
                        state.apply(&myself, inj).await;
                        true
                    }
                    Err(_) => false,
                };
                let _ = reply.send(Wire::encode(&ok));
            }
            ChaosMsg::Clear(w) => {
                if let Ok(id) = w.decode() {
                    state.clear(id);
                }
            }
            ChaosMsg::ClearAck(w, reply) => {
                let ok = w.decode().is_ok_and(|id| {
                    state.clear(id);
                    true
                });
                let _ = reply.send(Wire::encode(&ok));
            }
        }
        Ok(())
    }
}

fn kill_actors(actor: &str, node: &str, workers: &[WorkerId]) {
    let mut names: Vec<String> = if NODE_ACTORS.contains(&actor) {
        vec![format!("{node}/{actor}")]
    } else {
        workers
            .iter()
            .filter_map(|w| actor_name(actor, w))
            .collect()
    };
    names.dedup();
    for name in names {
        match ractor::registry::where_is(name.clone()) {
            Some(cell) => {
                tracing::warn!(actor = %name, "chaos: killing actor");
                cell.kill();
            }
            None => tracing::warn!(actor = %name, "chaos: no such actor to kill"),
        }
    }
}

fn kill_this_node() {
    tracing::warn!("chaos: killing this node process (SIGKILL)");
    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    std::process::abort();
}

/// The Chaos actor of `node`, wherever it runs.
pub fn find_chaos(node: &str) -> Option<ActorRef<ChaosMsg>> {
    crate::runtime::cluster::member_named(CHAOS_GROUP, &format!("{node}/chaos")).map(Into::into)
}
