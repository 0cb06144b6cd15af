//! `flotilla sim`: the fleet's own decision code on a virtual clock — an offline,
//! discrete-event simulator in one process, with no actor, socket or sleep.
//!
//! **The same code as the live fleet.** Every decision is made by the functions the live
//! actors drive ([`world::SimFleet`] only carries their effects out): gateway admission
//! ([`Admission`](crate::request_plane::admission::Admission), on a fleet view refreshed once
//! per heartbeat as Discovery publishes it), the request core
//! ([`RequestCore`](crate::request_plane::request::RequestCore): placement, migration,
//! hand-off, give-up), the router's state
//! ([`RouterCore`](crate::request_plane::router::core::RouterCore): prefix index fed by the workers' KV
//! events, active load, policy), the worker core
//! ([`WorkerCore`](crate::worker::scheduler::WorkerCore) with its batch former and
//! [`BlockPool`](crate::kv::BlockPool)) and the sim engine's step model
//! ([`model_step`](crate::worker::engine::sim::model_step), the profile the live
//! `--engine sim` fleet runs). The configuration is the live one (`--set key=value`): the
//! planes' own sections ([`SimConfig`]), read through the same section methods the live
//! composition root uses (`admission`, `migration_policy`, `scheduler_config`,
//! `selector_config`, `sim_transfer`).
//!
//! **What is modelled, and what is not.** Time passes only in engine steps (the profile's
//! time ÷ `worker.sim_speedup`), KV pulls (the modelled transfer), the delay of token events
//! from a worker to the gateway (`net_delay`) and of KV events to the router
//! (`kv_event_delay`), restarts and the clients' arrivals. Not modelled: HTTP and
//! tokenization at the gateway (the live gateway's own time, well under a millisecond per
//! request on this machine), actor mailboxes and message encoding, the clock jitter of a busy
//! host, and the stall checks of a request (no token event is ever lost here unless a fault
//! says so). Idle workers do not tick, so an idle worker's canary never runs: a hung engine is
//! found by the watchdog of the first step it is given (the live fleet may find it sooner, by
//! its canary). One gateway, one router; each worker is its own node.
//!
//! **Faults** ([`world::SimFault`]): kills (the replica restarts after a delay), hangs and
//! slow engines (through the worker core's own `InjectedFaults`, as the chaos filters set
//! them: the watchdog decides), and windows in which KV events are dropped — at given times,
//! or drawn at rates from a seed ([`faults::FaultRates`]).
//!
//! **The planner** ([`world::SimPlannerSpec`]): with one, each pool has spare slots up to
//! `planner.<pool>.max`; every `planner.interval_s` the live planner's policy
//! ([`Planner`](crate::control::planner::Planner)) reads the fleet's signals (the view as
//! last published, the gateway's window of arrivals and completions) and its decisions start
//! spare replicas (taking requests after the cold start) or drain running ones
//! (`WorkerCore::drain`). An oracle variant replaces the forecast with the workload's true
//! coming load. Replica-seconds per pool are counted from each start to each retirement.
//! A pool at zero scales from zero as the live one does: an admitted request that finds no
//! worker while the planner acts waits at the gateway
//! ([`waits_for_capacity`](crate::request_plane::admission::waits_for_capacity), counted in the
//! gateway's `waiting_for_capacity`, which the planner reads) until a replica is up, or is
//! refused (503, `cold_start`) after `gateway.cold_start_timeout_ms`; the wait is looked at
//! once per heartbeat (the live gateway wakes on each published view).
//!
//! **Deterministic.** Events are handled in (time, order of scheduling); the clock starts at a
//! fixed wall time ([`world::START_WALL_MS`]); nothing iterates a hash map where the order
//! reaches a decision. The same inputs give the same records, byte for byte.
//!
//! **Proportional.** A step costs O(its batch); only workers with work tick; the fleet view
//! is refreshed only for workers whose stats changed. A router's placement still scores every
//! routable worker (as the live router does), and admission reads every worker's view.
//!
//! **Conservation.** Every request ends exactly once (finished, failed, shed or skipped);
//! at the end [`world::SimLeftovers`] counts what is left placed, live, pinned or listened
//! for (all 0 in a correct run; the tests hold it).

pub mod config;
pub mod faults;
pub mod world;

#[cfg(test)]
mod tests;

pub use config::SimConfig;
pub use faults::FaultRates;
pub use world::{
    Arrivals, ModelFacts, SimCounters, SimFault, SimFleet, SimLeftovers, SimOutcome, SimRecord,
    SimSpec, SimTurn, SimWorkload,
};
