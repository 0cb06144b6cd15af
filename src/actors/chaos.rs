//! The Chaos actor: carries out the faults aimed at its node.
//!
//! One per node, in the process group [`CHAOS_GROUP`] as `<node>/chaos`. One-shot kinds
//! (`kill_actor`, `kill_node`, `panic_task`) and `partition` act here; the others go into the
//! node's [`FaultBook`] (`control/chaos.rs`, which says where each one acts).

use crate::control::chaos::{
    ActorKind, CHAOS_GROUP, CHAOS_KILL_EXIT, FaultBook, FaultKind, Injection, actor_name,
};
use crate::kv::faults::KvEventFaults;
use crate::request_plane::events::{EventBus, FleetEventKind};
use crate::runtime::ids::WorkerId;
use crate::runtime::wire::Wire;
use crate::worker::faults::{ReplicaFault, WorkerFaults};
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
    /// Local, every [`EXPIRY_TICK`]: end the timed faults whose time is up.
    Tick(Wire<()>),
}

/// How often the Chaos actor ends timed faults: their resolution.
pub const EXPIRY_TICK: Duration = Duration::from_millis(100);

/// The Chaos actor; its arguments are the node's fault book, the boundaries' fault filters,
/// its cluster handle, its clock and its event bus.
/// Timed faults end here, on the node that holds them, whoever created them and whether or
/// not this actor restarted meanwhile: their end is in the book ([`FaultBook::apply_at`]),
/// and every tick clears those whose time is up.
#[derive(Debug, Default, Clone, Copy)]
pub struct Chaos;

/// The filters of the boundaries where lasting faults act, each owned by its boundary: the
/// replicas' ([`WorkerFaults`]: `slow`, `hang`, `fail_engine`, `panic`, `fill_kv`, read by
/// their engines and schedulers) and the KV event publishers' ([`KvEventFaults`]:
/// `drop_kv_events`). The Chaos actor writes a fault into them when it is installed and
/// clears it when it is cleared or ends (the transport's filter is kept by the book).
#[derive(Clone, Default, Debug)]
pub struct FaultFilters {
    /// The replicas' filter.
    pub workers: WorkerFaults,
    /// The KV event publishers' filter.
    pub kv_events: KvEventFaults,
}

impl FaultFilters {
    /// Write `inj` into the filter of the boundary where it acts (kinds that act elsewhere
    /// are left alone).
    pub fn install(&self, inj: &Injection) {
        let seed = inj.seed.unwrap_or(inj.id);
        for w in &inj.workers {
            let fault = match inj.kind {
                FaultKind::Slow { delay_ms } => ReplicaFault::Slow(Duration::from_millis(delay_ms)),
                FaultKind::Hang => ReplicaFault::Hang,
                FaultKind::FailEngine { after_steps } => ReplicaFault::FailAfter(after_steps),
                FaultKind::Panic => ReplicaFault::Panic,
                FaultKind::FillKv { fraction } => ReplicaFault::FillKv(fraction),
                FaultKind::DropKvEvents { rate } => {
                    self.kv_events.set(inj.id, w, rate, seed);
                    continue;
                }
                _ => continue,
            };
            self.workers.set(inj.id, w, fault);
        }
    }

    /// Fault `id` ends everywhere.
    pub fn clear(&self, id: u64) {
        self.workers.clear(id);
        self.kv_events.clear(id);
    }
}

/// A partition in force on this node: the peers it cut (name, listen address) and one side
/// of the cut.
type ActivePartition = (Vec<(String, String)>, Vec<String>);

/// Chaos actor state.
pub struct ChaosState {
    book: FaultBook,
    filters: FaultFilters,
    bus: EventBus,
    clock: crate::runtime::clock::SharedClock,
    cluster: crate::runtime::cluster::ClusterHandle,
    /// Active partitions by fault id.
    partitions: HashMap<u64, ActivePartition>,
}

impl ChaosState {
    async fn partition(&mut self, inj: &Injection, nodes: &[String]) {
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
        // In the book too, with its end: it heals on time even if this actor restarts.
        self.book.apply_at(inj.clone(), self.clock.now());
    }

    async fn apply(&mut self, inj: Injection) {
        tracing::warn!(fault = inj.id, kind = ?inj.kind, workers = ?inj.workers, "chaos: fault installed");
        self.bus.emit(FleetEventKind::FaultInstalled {
            id: inj.id,
            kind: inj.kind.clone(),
            workers: inj.workers.clone(),
        });
        match &inj.kind {
            FaultKind::KillActor { actor } => kill_actors(*actor, &inj.node, &inj.workers),
            FaultKind::KillNode => kill_this_node(),
            FaultKind::PanicTask => {
                tokio::spawn(async { panic!("injected panic in a bare task (chaos)") });
            }
            FaultKind::Partition { nodes } => {
                let nodes = nodes.clone();
                self.partition(&inj, &nodes).await;
            }
            _ => {
                self.filters.install(&inj);
                self.book.apply_at(inj, self.clock.now());
            }
        }
    }

    fn clear(&mut self, id: u64) {
        let healed = self.heal(id);
        self.filters.clear(id);
        if self.book.clear(id) || healed {
            tracing::warn!(fault = id, "chaos: fault cleared");
            self.bus
                .emit(FleetEventKind::FaultCleared { id, expired: false });
        }
    }

    /// End the timed faults whose time is up.
    fn expire(&mut self) {
        for (id, kind) in self.book.expire(self.clock.now()) {
            tracing::warn!(fault = id, "chaos: fault expired");
            self.filters.clear(id);
            self.bus
                .emit(FleetEventKind::FaultCleared { id, expired: true });
            if matches!(kind, FaultKind::Partition { .. }) && !self.partitions.contains_key(&id) {
                // Installed by an earlier incarnation of this actor: its cut list is gone,
                // but the filters are the node's; lift them (peers re-dial on their side).
                self.cluster.partition.clear();
                self.book.transfer.set_cut(&[]);
            }
            self.heal(id);
        }
    }

    /// Heal partition `id`: drop the filter and dial every peer across the cut — those it
    /// cut and those the membership table knows (the far side may have cut first). Both
    /// sides dial; `ractor_cluster` elects one session when two connect at once.
    /// Returns whether `id` was a partition of this node's.
    fn heal(&mut self, id: u64) -> bool {
        let Some((cut, group)) = self.partitions.remove(&id) else {
            return false;
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
        true
    }
}

impl Actor for Chaos {
    type Msg = ChaosMsg;
    type State = ChaosState;
    type Arguments = (
        FaultBook,
        FaultFilters,
        crate::runtime::cluster::ClusterHandle,
        crate::runtime::clock::SharedClock,
        EventBus,
    );

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        (book, filters, cluster, clock, bus): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(CHAOS_GROUP.to_owned(), vec![myself.get_cell()]);
        myself.send_interval(EXPIRY_TICK, || ChaosMsg::Tick(Wire::encode(&())));
        Ok(ChaosState {
            book,
            filters,
            bus,
            clock,
            cluster,
            partitions: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ChaosMsg::Apply(w) => {
                if let Ok(inj) = w.decode() {
                    state.apply(inj).await;
                }
            }
            ChaosMsg::ApplyAck(w, reply) => {
                let ok = match w.decode() {
                    Ok(inj) => {
                        state.apply(inj).await;
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
            ChaosMsg::Tick(_) => state.expire(),
        }
        Ok(())
    }
}

fn kill_actors(actor: ActorKind, node: &str, workers: &[WorkerId]) {
    let mut names: Vec<String> = if actor.is_node_wide() {
        vec![format!("{node}/{actor}")]
    } else {
        workers.iter().map(|w| actor_name(actor, w)).collect()
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
    tracing::warn!(
        "chaos: killing this node process (exit {CHAOS_KILL_EXIT}, abrupt as a SIGKILL)"
    );
    // No destructor runs, no actor stops, no connection is shut down in order: the kernel
    // closes them as it would after a SIGKILL; only the exit status says it was injected.
    std::process::exit(CHAOS_KILL_EXIT);
}

/// The Chaos actor of `node`, wherever it runs.
pub fn find_chaos(node: &str) -> Option<ActorRef<ChaosMsg>> {
    crate::runtime::cluster::member_named(CHAOS_GROUP, &format!("{node}/chaos")).map(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::clock::ManualClock;
    use std::sync::Arc;

    /// A timed fault ends on the node that holds it, at its time on the node's clock, even when
    /// the Chaos actor that installed it died meanwhile (its timers with it) and nobody else
    /// (the gateway that created it) is left to clear it.
    #[tokio::test]
    async fn a_timed_fault_ends_on_its_node_even_after_the_chaos_actor_restarts() {
        let cluster = crate::runtime::cluster::start_node_server(
            crate::runtime::ids::NodeId::new("chaos-expiry-test"),
            "127.0.0.1:0".parse().expect("addr"),
            "cookie".into(),
            1 << 20,
        )
        .await
        .expect("node server");
        let book = FaultBook::default();
        let filters = FaultFilters::default();
        let clock = ManualClock::new();
        let bus = EventBus::new(crate::runtime::ids::NodeId::new("chaos-expiry-test"));
        let mut events = bus.subscribe();
        let args = || {
            let clock: crate::runtime::clock::SharedClock = Arc::new(clock.clone());
            (
                book.clone(),
                filters.clone(),
                cluster.clone(),
                clock,
                bus.clone(),
            )
        };
        let w = WorkerId::new("chaos-expiry-test/replica-0");
        let (first, h) = Actor::spawn(None, Chaos, args()).await.expect("chaos");
        let inj = Injection {
            node: "chaos-expiry-test".into(),
            id: 7,
            kind: FaultKind::Slow { delay_ms: 50 },
            workers: vec![w.clone()],
            seed: None,
            duration_ms: Some(1_000),
        };
        let ok = ractor::call_t!(first, ChaosMsg::ApplyAck, 2_000, Wire::encode(&inj))
            .expect("ack")
            .decode()
            .expect("decode");
        assert!(ok);
        assert_eq!(filters.workers.step_delay(&w), Duration::from_millis(50));
        first.kill();
        h.await.expect("stopped");

        let (second, h2) = Actor::spawn(None, Chaos, args())
            .await
            .expect("chaos again");
        clock.advance(Duration::from_millis(999));
        tokio::time::sleep(EXPIRY_TICK * 3).await;
        assert_eq!(
            filters.workers.step_delay(&w),
            Duration::from_millis(50),
            "not before its time"
        );
        clock.advance(Duration::from_millis(1));
        let mut left = 100;
        while filters.workers.step_delay(&w) != Duration::ZERO {
            left -= 1;
            assert!(
                left > 0,
                "the fault outlived its duration: {:?}",
                book.active()
            );
            tokio::time::sleep(EXPIRY_TICK).await;
        }
        assert!(book.active().is_empty());
        // Said on the node's event bus: installed, then expired.
        let kinds: Vec<FleetEventKind> = std::iter::from_fn(|| events.try_recv().ok())
            .map(|e| e.kind)
            .collect();
        assert!(
            matches!(
                kinds.as_slice(),
                [
                    FleetEventKind::FaultInstalled { id: 7, .. },
                    FleetEventKind::FaultCleared {
                        id: 7,
                        expired: true
                    }
                ]
            ),
            "{kinds:?}"
        );
        second.stop(None);
        h2.await.expect("stopped");
        cluster.server.stop(None);
    }

    #[test]
    fn each_fault_is_written_into_its_boundarys_filter_and_cleared_there() {
        let f = FaultFilters::default();
        let (a, b) = (WorkerId::new("n/a"), WorkerId::new("n/b"));
        let inj = |id, kind, workers: Vec<WorkerId>| Injection {
            node: "n".into(),
            id,
            kind,
            workers,
            seed: Some(1),
            duration_ms: None,
        };
        f.install(&inj(1, FaultKind::Slow { delay_ms: 5 }, vec![a.clone()]));
        f.install(&inj(
            2,
            FaultKind::FailEngine { after_steps: 0 },
            vec![b.clone()],
        ));
        f.install(&inj(
            3,
            FaultKind::DropKvEvents { rate: 1.0 },
            vec![a.clone()],
        ));
        f.install(&inj(
            4,
            FaultKind::FillKv { fraction: 0.5 },
            vec![a.clone(), b.clone()],
        ));
        assert_eq!(f.workers.step_delay(&a), Duration::from_millis(5));
        assert!(f.workers.step_fails(&b) && !f.workers.step_fails(&a));
        assert!(f.kv_events.drop_event(&a) && !f.kv_events.drop_event(&b));
        assert_eq!(f.workers.fill_kv(&b), Some(0.5));
        for id in 1..=4 {
            f.clear(id);
        }
        assert_eq!(f.workers.injected(&a), Default::default());
        assert!(!f.workers.step_fails(&b));
        assert!(!f.kv_events.drop_event(&a));
    }
}
