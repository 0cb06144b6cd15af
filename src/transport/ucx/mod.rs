//! The UCX backend: one UCP context and worker per node, on a thread of their own.
//!
//! [`Ucx::start`] loads `libucp.so.0` at run time ([`sys`], generated bindings), creates a
//! context (feature RMA) and a single-threaded worker on a dedicated OS thread, and
//! returns the worker's address. Everything UCX is then done on that thread, driven by commands:
//! register memory (`ucp_mem_map` + `ucp_rkey_pack`), unregister, and get a list of segments
//! from a peer with one-sided RMA reads (`ucp_get_nbx`), keeping up to [`WINDOW`] requests in
//! flight per pull. A pull's reply is sent only once none of its requests is outstanding, so
//! no late write can land in memory its caller already gave back.
//!
//! # Progress
//! While a pull is active the thread progresses the worker in a loop (yielding when nothing
//! moved). When idle it keeps progressing on a budget, because a peer reading from this node
//! through software-emulated RMA (the `tcp` transport) needs this side's progress: it yields
//! while progress reported events in the last 20 ms, then sleeps in `poll(2)` on a waker socket
//! (which commands write to) for 1 ms ticks during a second, then 10 ms ticks. It does not use
//! UCX's event fd: the WAKEUP feature makes UCX 1.13 drop every transport without event support,
//! shared memory and CMA included (measured: with it, two processes on one machine talked over
//! TCP loopback).
//!
//! # Failures
//! Endpoints use `UCP_ERR_HANDLING_MODE_PEER`: a dead or unreachable peer fails the endpoint's
//! requests and calls [`on_ep_error`] instead of aborting the process. The endpoint is then
//! closed (force), its remote keys destroyed, and the next pull connects anew. A pull past its
//! deadline force-closes its endpoint too (which completes its requests as cancelled) and fails
//! with [`TransportError::Timeout`].
//!
//! # Files
//! This file holds the handle ([`Ucx`]) other threads use and the commands it sends;
//! `engine.rs` the UCX thread (its state, start-up, loop, sleep and shutdown), with
//! `engine/memory.rs` (registering and allocating memory, packing remote keys) and
//! `engine/pull.rs` (endpoints, remote keys and the windowed gets of a pull, failures and
//! deadlines).

#[allow(unsafe_code)]
pub mod sys;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{KvMemory, MemoryError, Preregistered, Segment};
use super::{TransportError, UcxRemote};
use sys::*;

mod engine;

use engine::Engine;

/// Requests in flight per pull.
pub const WINDOW: usize = 32;
/// Largest single get; longer segments are cut so that the window has work to overlap.
pub const MAX_GET_BYTES: u64 = 1 << 20;
/// How long after the last progress event the idle thread keeps yielding instead of sleeping.
const HOT: Duration = Duration::from_millis(20);
/// The shared object loaded at run time.
pub const LIBRARY: &str = "libucp.so.0";

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// A handle on the node's UCX thread.
#[derive(Debug)]
pub struct Ucx {
    instance: u64,
    tx: mpsc::Sender<Cmd>,
    waker: UnixStream,
    address: Vec<u8>,
    version: String,
    transports: String,
    pending: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What a registration gives back: a handle to unregister it and the packed remote key.
#[derive(Debug, Clone)]
pub struct Registration {
    /// Local handle.
    pub handle: u64,
    /// Packed remote key (`ucp_rkey_pack`), for peers to unpack.
    pub rkey: Vec<u8>,
}

enum Cmd {
    Register {
        memory: Arc<KvMemory>,
        reply: oneshot::Sender<Result<Registration, TransportError>>,
    },
    Allocate {
        len: usize,
        reply: oneshot::Sender<Result<(usize, Registration), TransportError>>,
    },
    Unregister(u64),
    Get {
        peer: Vec<u8>,
        same_host: bool,
        rkey: Vec<u8>,
        remote_base: u64,
        local: Arc<KvMemory>,
        segments: Vec<Segment>,
        deadline: Instant,
        reply: oneshot::Sender<Result<(), TransportError>>,
    },
    Stop,
}

impl Ucx {
    /// Loads UCX and starts the node's UCX thread. `tls`, when given, restricts UCX's
    /// transports (the `UCX_TLS` setting, e.g. `"tcp"` or `"shm,cma,self"`).
    ///
    /// # Errors
    /// [`TransportError::Unavailable`] when `libucp.so.0` cannot be loaded or a context or
    /// worker cannot be created.
    pub fn start(tls: Option<&str>) -> Result<Self, TransportError> {
        let (tx, rx) = mpsc::channel();
        let (waker, wake_rx) = UnixStream::pair()
            .map_err(|e| TransportError::Unavailable(format!("ucx waker: {e}")))?;
        waker
            .set_nonblocking(true)
            .map_err(|e| TransportError::Unavailable(format!("ucx waker: {e}")))?;
        let pending = Arc::new(AtomicUsize::new(0));
        let (ready_tx, ready_rx) = mpsc::channel();
        let tls = tls.map(str::to_owned);
        let thread_pending = pending.clone();
        let thread = std::thread::Builder::new()
            .name("flotilla-ucx".into())
            .spawn(move || match Engine::new(tls.as_deref(), wake_rx) {
                Ok(mut engine) => {
                    let facts = (
                        engine.address.clone(),
                        engine.version.clone(),
                        engine.transports.clone(),
                    );
                    let _ = ready_tx.send(Ok(facts));
                    engine.run(rx, &thread_pending);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| TransportError::Unavailable(format!("ucx thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok((address, version, transports))) => Ok(Self {
                instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
                tx,
                waker,
                address,
                version,
                transports,
                pending,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(TransportError::Unavailable(
                "the ucx thread died while starting".into(),
            )),
        }
    }

    /// This worker's address (`ucp_worker_get_address`), for peers to connect to.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// The UCX library's version string.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The transports UCX was told to use (`UCX_TLS`; `all` when unrestricted).
    pub fn transports(&self) -> &str {
        &self.transports
    }

    /// Pulls whose reply has not been sent yet.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    fn send(&self, cmd: Cmd) -> Result<(), TransportError> {
        self.tx
            .send(cmd)
            .map_err(|_| TransportError::Unavailable("the ucx thread is gone".into()))?;
        // A full socket buffer already holds a wake-up: nothing is lost by a failed write.
        let _ = (&self.waker).write(&[1]);
        Ok(())
    }

    /// Registers `memory` (`ucp_mem_map`) and packs its remote key.
    ///
    /// # Errors
    /// [`TransportError::Backend`] when UCX refuses; [`TransportError::Unavailable`] when the
    /// thread is gone.
    pub async fn register(&self, memory: Arc<KvMemory>) -> Result<Registration, TransportError> {
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Register { memory, reply })?;
        rx.await
            .map_err(|_| TransportError::Unavailable("the ucx thread is gone".into()))?
    }

    /// This backend instance's id (memory it allocated carries it).
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// Allocates and registers `len` bytes through UCX (`ucp_mem_map` with
    /// `UCP_MEM_MAP_ALLOCATE`): shared memory that peers on this machine map and copy from
    /// directly (UCX's `sysv` / `posix` RMA), where memory allocated elsewhere can only be read
    /// through emulation. Dropping the returned memory unmaps it.
    ///
    /// # Errors
    /// [`TransportError::Backend`] when UCX refuses; [`TransportError::Unavailable`] when the
    /// thread is gone.
    pub async fn allocate(&self, len: usize) -> Result<KvMemory, TransportError> {
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Allocate { len, reply })?;
        let (addr, reg) = rx
            .await
            .map_err(|_| TransportError::Unavailable("the ucx thread is gone".into()))??;
        let ptr = std::ptr::NonNull::new(addr as *mut u8)
            .ok_or_else(|| TransportError::Backend("ucp_mem_map returned a null address".into()))?;
        let (tx, waker) = (self.tx.clone(), self.waker.try_clone());
        let handle = reg.handle;
        let release = Box::new(move || {
            if tx.send(Cmd::Unregister(handle)).is_ok()
                && let Ok(w) = &waker
            {
                let _ = (&*w).write(&[1]);
            }
        });
        let pre = Preregistered {
            instance: self.instance,
            rkey: reg.rkey,
        };
        // SAFETY: UCX mapped `len` bytes at `addr` for this process; they stay mapped until
        // the release sends `Unregister(handle)` (the thread never unmaps them otherwise), and
        // nothing else in this process knows the address.
        Ok(unsafe { KvMemory::external(ptr, len, Some(pre), release) })
    }

    /// Unregisters (`ucp_mem_unmap`); the memory itself stays alive while others hold it.
    pub fn unregister(&self, handle: u64) {
        let _ = self.send(Cmd::Unregister(handle));
    }

    /// Reads `segments` of the region `remote` describes (the owner's worker address, base
    /// address and packed key) into `local`; `same_host` when the owner runs on this machine.
    ///
    /// # Errors
    /// [`TransportError::Peer`] when the peer fails or is unreachable;
    /// [`TransportError::Timeout`] past `deadline`; [`MemoryError::OutOfRange`] when a
    /// segment leaves `local`.
    pub async fn get(
        &self,
        remote: &UcxRemote,
        same_host: bool,
        local: Arc<KvMemory>,
        segments: Vec<Segment>,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        if let Some(s) = segments.iter().find(|s| {
            s.local
                .checked_add(s.len)
                .is_none_or(|e| e > local.len() as u64)
        }) {
            return Err(MemoryError::OutOfRange {
                offset: s.local,
                len: s.len,
                region: local.len() as u64,
            }
            .into());
        }
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Get {
            peer: remote.worker.clone(),
            same_host,
            rkey: remote.rkey.clone(),
            remote_base: remote.base,
            local,
            segments,
            deadline,
            reply,
        })?;
        rx.await
            .map_err(|_| TransportError::Unavailable("the ucx thread is gone".into()))?
    }
}

impl Drop for Ucx {
    fn drop(&mut self) {
        let _ = self.send(Cmd::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// libucp, loaded once per process and never unloaded: UCX installs memory hooks and signal
/// handlers that must outlive every use (unloading it crashes the process at exit).
fn library() -> Result<&'static UcpLib, TransportError> {
    static LIB: std::sync::OnceLock<Result<UcpLib, String>> = std::sync::OnceLock::new();
    LIB.get_or_init(|| {
        // SAFETY: loading a shared library runs its initialisers; libucp's are UCX's own
        // global set-up, run once per process (the OnceLock) and never undone.
        unsafe { UcpLib::new(LIBRARY) }.map_err(|e| format!("cannot load {LIBRARY}: {e}"))
    })
    .as_ref()
    .map_err(|e| TransportError::Unavailable(format!("ucx: {e}")))
}

/// Whether libucp loads on this machine.
pub fn available() -> bool {
    library().is_ok()
}
