//! Transport: KV blocks moved between nodes out of band, by one-sided reads.
//!
//! A node registers each KV pool it owns ([`Transport::register`]: one region per replica, laid
//! out by [`KvLayout`]) and publishes a [`RegionDescriptor`] for it: the region's identity and
//! epoch, its layout, and how to reach it — the node's TCP address and, when UCX runs, its UCX
//! worker address, the region's base address and packed remote key. A node that needs blocks
//! calls [`Transport::pull`] with the owner's descriptor and `(remote block, local block)` pairs;
//! the blocks are read straight into its own registered pool, and the call returns when every
//! byte has landed or the pull has failed.
//!
//! Files:
//! - `actor.rs` — [`TransportActor`], the node tree's supervised face of the node's transport.
//! - the memory it moves is the KV plane's (`kv/memory.rs`, re-exported here): [`KvMemory`]
//!   (registrable memory), [`RegionId`] and epochs, [`KvLayout`] and the byte runs
//!   ([`Segment`]) a block list becomes.
//! - `ucx/` — the UCX backend (`ucx/sys.rs`: generated bindings, loaded at run time).
//! - `tcp.rs` — the TCP backend: a server per node, windowed pipelined reads.
//! - `faults.rs` — the chaos filters a pull passes: delay, drop, partition.
//!
//! # Backends
//! `transport.backend` = `auto` (UCX when `libucp.so.0` loads, else TCP; the log says which),
//! `ucx` (fail to start without it) or `tcp`. Every node also serves its regions over TCP, so
//! a UCX node can pull from a TCP-only peer and back: a pull uses UCX only when both ends have
//! it.
//!
//! # Stale memory is never read
//! A region is registered under a fresh epoch ([`next_epoch`]). The newest epoch heard
//! for each owner (from descriptors learned through Discovery or pulls) is kept; a pull that
//! names an older one fails with [`TransportError::Stale`] before any byte moves, and a TCP
//! server refuses any epoch but the one it holds.

mod actor;
pub mod faults;
pub mod tcp;
pub mod ucx;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use crate::kv::memory::{
    DeviceAccess, KvLayout, KvMemory, MemoryError, MemoryKind, MemoryLease, Preregistered,
    RegionId, Segment, next_epoch,
};
pub use actor::{TransportActor, TransportMsg, local};
pub use faults::{TransferFaults, TransferVerdict};

/// Why a transfer did not happen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The region's owner has registered newer memory since this descriptor was made.
    #[error("stale region: {0}")]
    Stale(String),
    /// The peer refused the read (unknown region, bad range).
    #[error("refused: {0}")]
    Refused(String),
    /// The peer failed, closed the connection or cannot be reached.
    #[error("peer failed: {0}")]
    Peer(String),
    /// The pull's deadline passed.
    #[error("timed out")]
    Timeout,
    /// Chaos dropped the transfer (`drop_kv_transfer`) or a partition cuts the peer off.
    #[error("injected fault: {0}")]
    Injected(String),
    /// The memory refused: the two pools' geometries differ, a block or a byte range is out
    /// of its region, or a staged copy failed ([`MemoryError`]).
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The local region named is not registered here.
    #[error("no local region {0}")]
    UnknownLocal(String),
    /// The backend is missing or stopped.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The backend failed.
    #[error("backend: {0}")]
    Backend(String),
    /// The TCP server cannot listen on its address (`transport.tcp_bind`).
    #[error("tcp transport: cannot listen on {addr}: {reason}")]
    Bind {
        /// Address asked for.
        addr: String,
        /// What the OS said.
        reason: String,
        /// Its kind (`AddrInUse`: the port is taken).
        kind: std::io::ErrorKind,
    },
}

/// Which backend moves the bytes.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum BackendChoice {
    /// UCX when it loads, else TCP.
    #[default]
    Auto,
    /// UCX only (starting fails without it).
    Ucx,
    /// TCP only.
    Tcp,
}

/// The backend a pull used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// UCX one-sided gets.
    Ucx,
    /// The TCP server's windowed reads.
    Tcp,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Ucx => "ucx",
            Backend::Tcp => "tcp",
        })
    }
}

/// `[transport]` configuration.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TransportConfig {
    /// `auto`, `ucx` or `tcp`.
    pub backend: BackendChoice,
    /// UCX transports (`UCX_TLS`), e.g. `tcp` or `shm,cma,self`; unset: UCX's own choice.
    pub ucx_tls: Option<String>,
    /// Address the TCP backend's server binds (port 0: any free port).
    pub tcp_bind: String,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            backend: BackendChoice::Auto,
            ucx_tls: None,
            tcp_bind: "127.0.0.1:0".into(),
        }
    }
}

/// How a peer reaches a region through UCX.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UcxRemote {
    /// The owner node's UCX worker address.
    pub worker: Vec<u8>,
    /// Packed remote key of the region.
    pub rkey: Vec<u8>,
    /// Base virtual address of the region in the owner's process.
    pub base: u64,
    /// The owner's machine ([`host_id`]): peers on the same one read its shared memory.
    #[serde(default)]
    pub host: String,
}

/// This machine's identity: the kernel's boot id (`/proc/sys/kernel/random/boot_id`), else
/// the host name; the same for every process on one machine (and its network namespaces).
pub fn host_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .or_else(|_| std::fs::read_to_string("/etc/hostname"))
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    })
}

/// What a node publishes about one registered region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDescriptor {
    /// Owner and epoch.
    pub id: RegionId,
    /// Pool geometry.
    pub layout: KvLayout,
    /// The owner node's TCP transport address.
    pub tcp: String,
    /// UCX access, when the owner node runs UCX and UCX registered the memory.
    pub ucx: Option<UcxRemote>,
    /// Where the region's bytes live (informational: pulls work whatever the kinds).
    #[serde(default)]
    pub memory: MemoryKind,
}

/// One pull: these blocks of `from` into these blocks of the local region `into`.
#[derive(Clone, Debug)]
pub struct PullRequest {
    /// The source region as its owner described it.
    pub from: RegionDescriptor,
    /// Owner name of the local destination region.
    pub into: String,
    /// `(source block, destination block)` pairs.
    pub blocks: Vec<(u32, u32)>,
    /// When to give up.
    pub deadline: Instant,
}

/// What a successful pull moved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PullStats {
    /// Bytes moved.
    pub bytes: u64,
    /// Contiguous runs read.
    pub segments: usize,
    /// Backend used.
    pub backend: Backend,
    /// Wall time, including any injected delay.
    pub elapsed: Duration,
}

struct LocalRegion {
    id: RegionId,
    layout: KvLayout,
    memory: Arc<KvMemory>,
    /// The UCX registration, and whether this transport made it (else it came with the memory).
    ucx: Option<(ucx::Registration, bool)>,
}

/// Counters of one node's transport (for `/metrics` and tests).
#[derive(Debug, Default)]
pub struct TransportCounters {
    /// Pulls that completed.
    pub pulls_ok: AtomicU64,
    /// Pulls that failed (any reason).
    pub pulls_failed: AtomicU64,
    /// Bytes pulled.
    pub bytes: AtomicU64,
}

/// One node's transport: its backends and registered regions.
pub struct Transport {
    node: String,
    config: TransportConfig,
    ucx: Option<ucx::Ucx>,
    tcp_server: tcp::TcpServer,
    tcp_client: tcp::TcpClient,
    served: tcp::ServedRegions,
    regions: Mutex<HashMap<String, LocalRegion>>,
    /// Newest epoch heard per owner.
    newest: RwLock<HashMap<String, u64>>,
    faults: TransferFaults,
    pending: AtomicUsize,
    /// Counters.
    pub counters: TransportCounters,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("node", &self.node)
            .field("ucx", &self.ucx.is_some())
            .field("tcp", &self.tcp_server.addr())
            .finish()
    }
}

/// Decrements a counter when dropped (a pull's future may be dropped mid-way).
struct PendingGuard<'a>(&'a AtomicUsize);

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Transport {
    /// Starts the backends `config` asks for, on behalf of `node`.
    ///
    /// # Errors
    /// [`TransportError::Unavailable`] when `backend = "ucx"` and UCX does not start;
    /// [`TransportError::Backend`] when the TCP server cannot bind.
    pub async fn start(
        node: &str,
        config: TransportConfig,
        faults: TransferFaults,
    ) -> Result<Self, TransportError> {
        let ucx = match config.backend {
            BackendChoice::Tcp => None,
            BackendChoice::Ucx => Some(ucx::Ucx::start(config.ucx_tls.as_deref())?),
            BackendChoice::Auto => match ucx::Ucx::start(config.ucx_tls.as_deref()) {
                Ok(u) => Some(u),
                Err(e) => {
                    tracing::info!(error = %e, "transport: UCX unavailable; using the TCP backend");
                    None
                }
            },
        };
        if let Some(u) = &ucx {
            tracing::info!(
                version = u.version(),
                tls = u.transports(),
                "transport: UCX backend"
            );
        }
        let served: tcp::ServedRegions = Arc::default();
        let tcp_server = tcp::TcpServer::start(&config.tcp_bind, served.clone()).await?;
        Ok(Self {
            node: node.to_owned(),
            config,
            ucx,
            tcp_server,
            tcp_client: tcp::TcpClient::default(),
            served,
            regions: Mutex::default(),
            newest: RwLock::default(),
            faults,
            pending: AtomicUsize::new(0),
            counters: TransportCounters::default(),
        })
    }

    /// The backend this node prefers for its own pulls.
    pub fn backend(&self) -> Backend {
        if self.ucx.is_some() {
            Backend::Ucx
        } else {
            Backend::Tcp
        }
    }

    /// The TCP server's address.
    pub fn tcp_addr(&self) -> std::net::SocketAddr {
        self.tcp_server.addr()
    }

    /// The configuration it started with.
    pub fn config(&self) -> &TransportConfig {
        &self.config
    }

    /// The node this transport belongs to (its actor is `<node>/transport`).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Pulls not finished.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// The chaos filters.
    pub fn faults(&self) -> &TransferFaults {
        &self.faults
    }

    /// Memory for a KV pool laid out as `layout`: allocated by UCX when it runs (shared
    /// memory peers on this machine read at memcpy speed; registered already), else zeroed heap
    /// memory. Give it to the engine, then [`Transport::register`] it.
    ///
    /// # Errors
    /// [`MemoryError::Layout`] (as [`TransportError::Memory`]) when it cannot be allocated.
    pub async fn allocate(&self, layout: KvLayout) -> Result<Arc<KvMemory>, TransportError> {
        let len = usize::try_from(layout.region_bytes())
            .map_err(|_| MemoryError::Layout("region too large".into()))?;
        if let Some(u) = &self.ucx {
            match u.allocate(len).await {
                Ok(m) => return Ok(Arc::new(m)),
                Err(e) => {
                    tracing::warn!(error = %e, "transport: UCX could not allocate; heap memory instead")
                }
            }
        }
        Ok(Arc::new(KvMemory::zeroed(len)?))
    }

    /// Registers `memory` (laid out as `layout`) as `owner`'s region under a fresh epoch,
    /// replacing (and unregistering) any earlier region of that owner, and returns its
    /// descriptor.
    ///
    /// # Errors
    /// [`MemoryError::Layout`] (as [`TransportError::Memory`]) when `memory` is smaller than
    /// `layout` says;
    /// [`TransportError::Backend`] when UCX refuses the registration.
    pub async fn register(
        &self,
        owner: &str,
        layout: KvLayout,
        memory: Arc<KvMemory>,
    ) -> Result<RegionDescriptor, TransportError> {
        if (memory.len() as u64) < layout.region_bytes() {
            return Err(MemoryError::Layout(format!(
                "{owner}: {} bytes registered for a {}-byte layout",
                memory.len(),
                layout.region_bytes()
            ))
            .into());
        }
        let ucx = match (&self.ucx, memory.preregistered()) {
            (Some(u), Some(pre)) if pre.instance == u.instance() => Some((
                ucx::Registration {
                    handle: 0,
                    rkey: pre.rkey.clone(),
                },
                false,
            )),
            // Staged host memory (the GPU pass's CPU twins) is reached through copies only.
            (Some(_), None) if memory.is_staged() && memory.kind() == MemoryKind::Host => None,
            // Device memory that this UCX cannot map is served over TCP, staged through host
            // buffers (see `kv/memory.rs`, "Memory kinds").
            (Some(u), None) if memory.is_staged() => match u.register(memory.clone()).await {
                Ok(r) => Some((r, true)),
                Err(e) => {
                    tracing::info!(
                        owner, kind = %memory.kind(), error = %e,
                        "transport: UCX cannot read this region in place; peers read it over TCP, staged through host memory"
                    );
                    None
                }
            },
            (Some(u), _) => Some((u.register(memory.clone()).await?, true)),
            (None, _) => None,
        };
        let id = RegionId {
            owner: owner.to_owned(),
            epoch: next_epoch(),
        };
        self.unregister(owner);
        self.served
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(owner.to_owned(), (id.epoch, memory.clone()));
        self.note_epoch(&id);
        let region = LocalRegion {
            id,
            layout,
            memory,
            ucx,
        };
        let d = self.describe(&region);
        self.regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(owner.to_owned(), region);
        Ok(d)
    }

    /// Unregisters `owner`'s region (no-op when none): peers can no longer read it.
    pub fn unregister(&self, owner: &str) {
        let old = self
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(owner);
        self.served
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(owner);
        if let (Some(old), Some(u)) = (old, &self.ucx)
            && let Some((reg, true)) = old.ucx
        {
            u.unregister(reg.handle);
        }
    }

    /// Unregisters `id.owner`'s region if it is still epoch `id.epoch`.
    pub fn unregister_epoch(&self, id: &RegionId) {
        let current = self
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id.owner)
            .map(|r| r.id.epoch);
        if current == Some(id.epoch) {
            self.unregister(&id.owner);
        }
    }

    fn describe(&self, r: &LocalRegion) -> RegionDescriptor {
        RegionDescriptor {
            id: r.id.clone(),
            layout: r.layout,
            tcp: self.tcp_server.addr().to_string(),
            ucx: match (&self.ucx, &r.ucx) {
                (Some(u), Some((reg, _))) => Some(UcxRemote {
                    worker: u.address().to_vec(),
                    rkey: reg.rkey.clone(),
                    base: r.memory.as_ptr() as u64,
                    host: host_id().to_owned(),
                }),
                _ => None,
            },
            memory: r.memory.kind(),
        }
    }

    /// Descriptors of every region registered here.
    pub fn descriptors(&self) -> Vec<RegionDescriptor> {
        let regions = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<RegionDescriptor> = regions.values().map(|r| self.describe(r)).collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Notes a descriptor heard from a peer: pulls naming older epochs of its owner are
    /// refused from now on.
    pub fn learn(&self, d: &RegionDescriptor) {
        self.note_epoch(&d.id);
    }

    fn note_epoch(&self, id: &RegionId) {
        let mut newest = self.newest.write().unwrap_or_else(|p| p.into_inner());
        let e = newest.entry(id.owner.clone()).or_insert(id.epoch);
        *e = (*e).max(id.epoch);
    }

    /// Reads `req.blocks` of `req.from` into the local region `req.into`, by `req.deadline`.
    ///
    /// Keep the destination blocks until this returns: a UCX read already posted goes on
    /// (until it completes or the deadline force-closes its endpoint) even if the future is
    /// dropped, so run a pull to its end (e.g. in a task) rather than dropping it.
    ///
    /// # Errors
    /// [`TransportError::Stale`] when a newer epoch of the source is known;
    /// [`TransportError::UnknownLocal`], [`TransportError::Memory`] for a bad request;
    /// [`TransportError::Injected`] for a chaos drop or partition; the backend's errors
    /// ([`TransportError::Peer`], [`TransportError::Timeout`], …) otherwise.
    pub async fn pull(&self, req: PullRequest) -> Result<PullStats, TransportError> {
        self.pending.fetch_add(1, Ordering::Relaxed);
        let _guard = PendingGuard(&self.pending);
        let out = self.pull_inner(&req).await;
        match &out {
            Ok(s) => {
                self.counters.pulls_ok.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes.fetch_add(s.bytes, Ordering::Relaxed);
                metrics::counter!("flotilla_kv_transfer_bytes_total", "backend" => s.backend.to_string())
                    .increment(s.bytes);
                metrics::histogram!("flotilla_kv_transfer_seconds").record(s.elapsed.as_secs_f64());
            }
            Err(e) => {
                self.counters.pulls_failed.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("flotilla_kv_transfer_failures_total").increment(1);
                tracing::debug!(from = %req.from.id, error = %e, "transport: pull failed");
            }
        }
        out
    }

    /// [`TransportError::Stale`] when a newer epoch of `id`'s owner is known.
    fn check_fresh(&self, id: &RegionId) -> Result<(), TransportError> {
        let newest = self
            .newest
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id.owner)
            .copied();
        match newest {
            Some(n) if n > id.epoch => Err(TransportError::Stale(format!(
                "{id} is older than epoch {n} of its owner"
            ))),
            _ => Ok(()),
        }
    }

    async fn pull_inner(&self, req: &PullRequest) -> Result<PullStats, TransportError> {
        let start = Instant::now();
        self.check_fresh(&req.from.id)?;
        self.note_epoch(&req.from.id);
        let (local_layout, local, local_ucx) = {
            let regions = self.regions.lock().unwrap_or_else(|p| p.into_inner());
            let r = regions
                .get(&req.into)
                .ok_or_else(|| TransportError::UnknownLocal(req.into.clone()))?;
            (r.layout, r.memory.clone(), r.ucx.is_some())
        };
        let segments = req.from.layout.segments(&local_layout, &req.blocks)?;
        let bytes: u64 = segments.iter().map(|s| s.len).sum();
        let deadline = tokio::time::Instant::from_std(req.deadline);
        match self.faults.verdict(&req.from.id.owner) {
            TransferVerdict::Pass => {}
            TransferVerdict::Delay(d) => {
                tokio::time::timeout_at(deadline, tokio::time::sleep(d))
                    .await
                    .map_err(|_| TransportError::Timeout)?;
                // The owner may have restarted meanwhile (its new epoch heard).
                self.check_fresh(&req.from.id)?;
            }
            TransferVerdict::Drop(why) => return Err(TransportError::Injected(why)),
        }
        // UCX writes into staged memory only where it mapped it (as CUDA memory) itself.
        let ucx_local = !local.is_staged() || local_ucx;
        let backend = match (&self.ucx, &req.from.ucx) {
            (Some(u), Some(remote)) if ucx_local => {
                u.get(
                    remote,
                    remote.host == host_id(),
                    local,
                    segments.clone(),
                    req.deadline,
                )
                .await?;
                Backend::Ucx
            }
            _ => {
                // Dropping the TCP read stops it: every byte is written by this future.
                tokio::time::timeout_at(
                    deadline,
                    self.tcp_client
                        .pull(&req.from.tcp, &req.from.id, &segments, &local),
                )
                .await
                .map_err(|_| TransportError::Timeout)??;
                Backend::Tcp
            }
        };
        Ok(PullStats {
            bytes,
            segments: segments.len(),
            backend,
            elapsed: start.elapsed(),
        })
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        let owners: Vec<String> = self
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        for o in owners {
            self.unregister(&o);
        }
    }
}
