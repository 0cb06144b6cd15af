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

#[allow(unsafe_code)]
pub mod sys;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use tokio::sync::oneshot;

use super::{KvMemory, MemoryError, MemoryKind, Preregistered, Segment};
use super::{TransportError, UcxRemote};
use sys::*;

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

// ---------------------------------------------------------------------------------------------
// The UCX thread
// ---------------------------------------------------------------------------------------------

thread_local! {
    /// Endpoints UCX reported failed during the current progress call (`on_ep_error` runs
    /// inside `ucp_worker_progress`, on the UCX thread).
    static FAILED_EPS: RefCell<Vec<(usize, ucs_status_t)>> = const { RefCell::new(Vec::new()) };
}

/// UCX's endpoint error callback: note the endpoint; the loop closes it after progress returns.
unsafe extern "C" fn on_ep_error(_arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t) {
    FAILED_EPS.with(|f| f.borrow_mut().push((ep as usize, status)));
}

struct Endpoint {
    ep: ucp_ep_h,
    /// Created with `UCP_ERR_HANDLING_MODE_PEER` (may be force-closed).
    error_handling: bool,
    rkeys: HashMap<Vec<u8>, ucp_rkey_h>,
    /// Set once the endpoint failed or is being force-closed: no new pull may use it.
    failed: Option<TransportError>,
    /// The close request while it completes.
    closing: Option<*mut c_void>,
}

struct Pull {
    peer: Vec<u8>,
    rkey: ucp_rkey_h,
    remote_base: u64,
    local: Arc<KvMemory>,
    segments: Vec<Segment>,
    next: usize,
    inflight: Vec<*mut c_void>,
    error: Option<TransportError>,
    deadline: Instant,
    reply: oneshot::Sender<Result<(), TransportError>>,
}

struct Engine {
    lib: &'static UcpLib,
    context: ucp_context_h,
    worker: ucp_worker_h,
    waker: UnixStream,
    /// When progress last reported an event.
    last_event: Instant,
    /// Whether the configured transports include shared memory (`UCX_TLS` unset, `all`, or
    /// naming `shm`, `sysv`, `posix` or `mm`).
    shm_allowed: bool,
    address: Vec<u8>,
    version: String,
    transports: String,
    /// Mappings by handle; `None` memory: allocated by UCX (freed by the unmap).
    regs: HashMap<u64, (ucp_mem_h, Option<Arc<KvMemory>>)>,
    next_handle: u64,
    endpoints: HashMap<Vec<u8>, Endpoint>,
    pulls: Vec<Pull>,
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

/// A status pointer as UCX returns it: null = done, an error code, or a request to poll.
enum Ptr {
    Done,
    Error(ucs_status_t),
    Request(*mut c_void),
}

fn classify(p: ucs_status_ptr_t) -> Ptr {
    let v = p as isize;
    if p.is_null() {
        Ptr::Done
    } else if v < 0 && v >= UCS_ERR_LAST as isize {
        // UCS_PTR_IS_ERR: the pointer encodes a negative status.
        Ptr::Error(v as ucs_status_t)
    } else {
        Ptr::Request(p)
    }
}

impl Engine {
    fn new(tls: Option<&str>, waker: UnixStream) -> Result<Self, TransportError> {
        let unavailable = |what: &str| TransportError::Unavailable(format!("ucx: {what}"));
        let lib = library()?;
        let (mut major, mut minor, mut release) = (0, 0, 0);
        // SAFETY: plain out-parameters.
        unsafe { lib.ucp_get_version(&mut major, &mut minor, &mut release) };
        let version = format!("{major}.{minor}.{release}");
        if major != UCP_API_MAJOR || minor < 10 {
            return Err(unavailable(&format!(
                "UCX {version} is not ABI-compatible with these bindings (1.13)"
            )));
        }
        let mut config: *mut ucp_config_t = std::ptr::null_mut();
        // SAFETY: null prefix and file name read the environment only; `config` is an out
        // parameter released below.
        let status =
            unsafe { lib.ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config) };
        if status != UCS_OK {
            return Err(unavailable(&format!(
                "config_read: {}",
                status_str(lib, status)
            )));
        }
        if let Some(tls) = tls {
            let (name, value) = (
                c"TLS",
                CString::new(tls).map_err(|_| unavailable("bad TLS"))?,
            );
            // SAFETY: `config` is live; both strings are NUL-terminated and outlive the call.
            let status = unsafe { lib.ucp_config_modify(config, name.as_ptr(), value.as_ptr()) };
            if status != UCS_OK {
                // SAFETY: releasing the config read above.
                unsafe { lib.ucp_config_release(config) };
                return Err(unavailable(&format!(
                    "TLS={tls}: {}",
                    status_str(lib, status)
                )));
            }
        }
        let mut context: ucp_context_h = std::ptr::null_mut();
        // RMA only. Not WAKEUP: UCX 1.13 then drops every transport without event support —
        // shared memory and CMA among them — and falls back to TCP even on one machine.
        let params = ucp_params_t {
            field_mask: UCP_PARAM_FIELD_FEATURES as u64,
            features: UCP_FEATURE_RMA as u64,
            ..Default::default()
        };
        // SAFETY: `params` and `config` are valid for the call; `context` is an out param.
        let status = unsafe {
            lib.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut context)
        };
        // SAFETY: the context copied what it needed from the config.
        unsafe { lib.ucp_config_release(config) };
        if status != UCS_OK {
            return Err(unavailable(&format!("init: {}", status_str(lib, status))));
        }
        let wparams = ucp_worker_params_t {
            field_mask: UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut worker: ucp_worker_h = std::ptr::null_mut();
        // SAFETY: live context, valid params; the worker is only ever used on this thread
        // (UCS_THREAD_MODE_SINGLE).
        let status = unsafe { lib.ucp_worker_create(context, &wparams, &mut worker) };
        if status != UCS_OK {
            // SAFETY: no worker exists on the context.
            unsafe { lib.ucp_cleanup(context) };
            return Err(unavailable(&format!(
                "worker_create: {}",
                status_str(lib, status)
            )));
        }
        let mut addr_ptr: *mut ucp_address_t = std::ptr::null_mut();
        let mut addr_len: usize = 0;
        // SAFETY: live worker; out parameters released right after copying.
        let status = unsafe { lib.ucp_worker_get_address(worker, &mut addr_ptr, &mut addr_len) };
        if status != UCS_OK {
            // SAFETY: tear down what was created above, in reverse order.
            unsafe {
                lib.ucp_worker_destroy(worker);
                lib.ucp_cleanup(context);
            }
            return Err(unavailable(&format!(
                "get_address: {}",
                status_str(lib, status)
            )));
        }
        // SAFETY: UCX returned `addr_len` readable bytes at `addr_ptr`.
        let address =
            unsafe { std::slice::from_raw_parts(addr_ptr as *const u8, addr_len) }.to_vec();
        // SAFETY: releasing the buffer returned above.
        unsafe { lib.ucp_worker_release_address(worker, addr_ptr) };
        let _ = waker.set_nonblocking(true);
        Ok(Self {
            lib,
            context,
            worker,
            waker,
            last_event: Instant::now(),
            shm_allowed: shm_in(tls),
            address,
            version,
            transports: tls.unwrap_or("all").to_owned(),
            regs: HashMap::new(),
            next_handle: 1,
            endpoints: HashMap::new(),
            pulls: Vec::new(),
        })
    }

    fn run(&mut self, rx: mpsc::Receiver<Cmd>, pending: &AtomicUsize) {
        let mut idle_spins = 0u32;
        loop {
            let mut stop = false;
            while let Ok(cmd) = rx.try_recv() {
                match cmd {
                    Cmd::Stop => stop = true,
                    cmd => self.handle(cmd, pending),
                }
            }
            if stop {
                break;
            }
            self.issue();
            let mut moved = 0;
            // SAFETY: live worker, used on its own thread only.
            while unsafe { self.lib.ucp_worker_progress(self.worker) } != 0 && moved < 256 {
                moved += 1;
            }
            self.reap_failed_endpoints();
            let finished = self.poll_requests(pending);
            self.expire();
            let busy =
                !self.pulls.is_empty() || self.endpoints.values().any(|e| e.closing.is_some());
            if busy {
                self.last_event = Instant::now();
                if moved == 0 && !finished {
                    idle_spins += 1;
                    if idle_spins > 64 {
                        std::thread::yield_now();
                    }
                } else {
                    idle_spins = 0;
                }
                continue;
            }
            idle_spins = 0;
            self.sleep(moved > 0);
        }
        self.shutdown(pending);
    }

    /// Waits for the next progress tick, or a command. Serving a peer's software-emulated RMA
    /// (the `tcp` transport) needs this side's progress, and `ucp_worker_progress` reports
    /// such work as events: while events came within [`HOT`], it only yields the core; within a
    /// second, it sleeps 1 ms; after that, 10 ms.
    fn sleep(&mut self, moved: bool) {
        let now = Instant::now();
        if moved {
            self.last_event = now;
        }
        let quiet = now.duration_since(self.last_event);
        if quiet < HOT {
            std::thread::yield_now();
            return;
        }
        let tick: u16 = if quiet < Duration::from_secs(1) {
            1
        } else {
            10
        };
        let mut fds = [PollFd::new(self.waker.as_fd(), PollFlags::POLLIN)];
        let _ = poll(&mut fds, PollTimeout::from(tick));
        let mut buf = [0u8; 256];
        while matches!((&self.waker).read(&mut buf), Ok(n) if n > 0) {}
    }

    fn handle(&mut self, cmd: Cmd, pending: &AtomicUsize) {
        match cmd {
            Cmd::Register { memory, reply } => {
                let _ = reply.send(self.register(memory));
            }
            Cmd::Allocate { len, reply } => {
                let _ = reply.send(self.allocate(len));
            }
            Cmd::Unregister(handle) => {
                if let Some((memh, _memory)) = self.regs.remove(&handle) {
                    // SAFETY: `memh` came from `ucp_mem_map` on this context and is unmapped
                    // once; `_memory` keeps the bytes alive until after the call.
                    unsafe { self.lib.ucp_mem_unmap(self.context, memh) };
                }
            }
            Cmd::Get {
                peer,
                same_host,
                rkey,
                remote_base,
                local,
                segments,
                deadline,
                reply,
            } => {
                // Error handling off only where shared memory can carry the reads (see
                // `endpoint_rkey`); over TCP a dead peer must fail requests, not hang them.
                let shm = self.shm_allowed && same_host;
                let rkey_h = match self.endpoint_rkey(&peer, shm, &rkey) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                };
                let segments = split(&segments);
                pending.fetch_add(1, Ordering::Relaxed);
                self.pulls.push(Pull {
                    peer,
                    rkey: rkey_h,
                    remote_base,
                    local,
                    segments,
                    next: 0,
                    inflight: Vec::new(),
                    error: None,
                    deadline,
                    reply,
                });
            }
            Cmd::Stop => {}
        }
    }

    fn allocate(&mut self, len: usize) -> Result<(usize, Registration), TransportError> {
        let params = ucp_mem_map_params_t {
            field_mask: (UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: std::ptr::null_mut(),
            length: len,
            flags: UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut memh: ucp_mem_h = std::ptr::null_mut();
        // SAFETY: UCX allocates `len` bytes itself (ALLOCATE with a null address).
        let status = unsafe { self.lib.ucp_mem_map(self.context, &params, &mut memh) };
        if status != UCS_OK {
            return Err(TransportError::Backend(format!(
                "ucp_mem_map (allocate {len} bytes): {}",
                status_str(self.lib, status)
            )));
        }
        let mut attr = ucp_mem_attr_t {
            field_mask: (UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            address: std::ptr::null_mut(),
            length: 0,
            mem_type: 0,
        };
        // SAFETY: live memory handle; `attr` is an out parameter.
        let status = unsafe { self.lib.ucp_mem_query(memh, &mut attr) };
        if status != UCS_OK || attr.address.is_null() || attr.length < len {
            // SAFETY: unmapping the handle mapped above, once.
            unsafe { self.lib.ucp_mem_unmap(self.context, memh) };
            return Err(TransportError::Backend(format!(
                "ucp_mem_query: {}",
                status_str(self.lib, status)
            )));
        }
        let reg = self.pack(memh, None)?;
        Ok((attr.address as usize, reg))
    }

    fn register(&mut self, memory: Arc<KvMemory>) -> Result<Registration, TransportError> {
        let cuda = match (memory.kind(), memory.is_staged()) {
            (MemoryKind::Host, false) => false,
            (MemoryKind::Cuda { .. }, true) => true,
            (kind, _) => {
                return Err(TransportError::Backend(format!(
                    "UCX registers host memory and CUDA device memory, not staged {kind} memory"
                )));
            }
        };
        let mut params = ucp_mem_map_params_t {
            field_mask: (UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64,
            address: memory.as_ptr() as *mut c_void,
            length: memory.len(),
            ..Default::default()
        };
        if cuda {
            params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE as u64;
            params.memory_type = UCS_MEMORY_TYPE_CUDA;
        }
        let mut memh: ucp_mem_h = std::ptr::null_mut();
        // SAFETY: the range is one live allocation, kept alive by `memory` (stored with the
        // handle) until it is unmapped (device memory: its owner unregisters the region before
        // freeing it); UCX reads device memory only through its CUDA transports.
        let status = unsafe { self.lib.ucp_mem_map(self.context, &params, &mut memh) };
        if status != UCS_OK {
            return Err(TransportError::Backend(format!(
                "ucp_mem_map of {} bytes of {} memory: {}",
                memory.len(),
                memory.kind(),
                status_str(self.lib, status)
            )));
        }
        if cuda {
            // A UCX without CUDA support may map the range as host memory: refuse that, or
            // its transports would dereference a device address.
            let mut attr = ucp_mem_attr_t {
                field_mask: UCP_MEM_ATTR_FIELD_MEM_TYPE as u64,
                address: std::ptr::null_mut(),
                length: 0,
                mem_type: 0,
            };
            // SAFETY: live memory handle; `attr` is an out parameter.
            let status = unsafe { self.lib.ucp_mem_query(memh, &mut attr) };
            if status != UCS_OK || attr.mem_type != UCS_MEMORY_TYPE_CUDA {
                // SAFETY: unmapping the handle mapped above, once.
                unsafe { self.lib.ucp_mem_unmap(self.context, memh) };
                return Err(TransportError::Backend(format!(
                    "this UCX does not map CUDA memory (memory type {}, status {})",
                    attr.mem_type,
                    status_str(self.lib, status)
                )));
            }
        }
        self.pack(memh, Some(memory))
    }

    /// Packs `memh`'s remote key and records the mapping.
    fn pack(
        &mut self,
        memh: ucp_mem_h,
        memory: Option<Arc<KvMemory>>,
    ) -> Result<Registration, TransportError> {
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: live context and memory handle; `buf` is released right after copying.
        let status = unsafe {
            self.lib
                .ucp_rkey_pack(self.context, memh, &mut buf, &mut size)
        };
        if status != UCS_OK {
            // SAFETY: unmapping the handle mapped above.
            unsafe { self.lib.ucp_mem_unmap(self.context, memh) };
            return Err(TransportError::Backend(format!(
                "ucp_rkey_pack: {}",
                status_str(self.lib, status)
            )));
        }
        // SAFETY: UCX returned `size` readable bytes at `buf`.
        let rkey = unsafe { std::slice::from_raw_parts(buf as *const u8, size) }.to_vec();
        // SAFETY: releasing the packed buffer returned above.
        unsafe { self.lib.ucp_rkey_buffer_release(buf) };
        let handle = self.next_handle;
        self.next_handle += 1;
        self.regs.insert(handle, (memh, memory));
        Ok(Registration { handle, rkey })
    }

    /// The endpoint to `peer` (created on first use) and `rkey` unpacked on it.
    fn endpoint_rkey(
        &mut self,
        peer: &[u8],
        same_host: bool,
        rkey: &[u8],
    ) -> Result<ucp_rkey_h, TransportError> {
        if let Some(e) = self.endpoints.get(peer)
            && let Some(err) = &e.failed
        {
            return Err(err.clone());
        }
        if !self.endpoints.contains_key(peer) {
            // Same host: no error handling, so that UCX may read the peer's shared memory
            // directly (with `PEER` mode UCX 1.13 drops every transport without peer-failure
            // support — sysv and posix shared memory — and emulates RMA over TCP loopback at a
            // twentieth of the speed). A dead peer's segments stay mapped, so such a read never
            // fails halfway. Other hosts: `PEER`, so a dead peer fails requests, not the process.
            let params = ucp_ep_params_t {
                field_mask: (UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
                address: peer.as_ptr() as *const ucp_address_t,
                err_mode: if same_host {
                    UCP_ERR_HANDLING_MODE_NONE
                } else {
                    UCP_ERR_HANDLING_MODE_PEER
                },
                err_handler: ucp_err_handler_t {
                    cb: Some(on_ep_error),
                    arg: std::ptr::null_mut(),
                },
                ..Default::default()
            };
            let mut ep: ucp_ep_h = std::ptr::null_mut();
            // SAFETY: `peer` is a worker address a peer published (UCX copies what it needs
            // during the call); the handler is a plain function valid for the program's life.
            let status = unsafe { self.lib.ucp_ep_create(self.worker, &params, &mut ep) };
            if status != UCS_OK {
                return Err(TransportError::Peer(format!(
                    "ucp_ep_create: {}",
                    status_str(self.lib, status)
                )));
            }
            self.endpoints.insert(
                peer.to_vec(),
                Endpoint {
                    ep,
                    error_handling: !same_host,
                    rkeys: HashMap::new(),
                    failed: None,
                    closing: None,
                },
            );
        }
        let lib = &self.lib;
        let Some(e) = self.endpoints.get_mut(peer) else {
            return Err(TransportError::Peer("endpoint vanished".into()));
        };
        if let Some(&h) = e.rkeys.get(rkey) {
            return Ok(h);
        }
        let mut h: ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: live endpoint; UCX parses `rkey` (a buffer packed by a peer's
        // `ucp_rkey_pack`) during the call and returns its own handle.
        let status =
            unsafe { lib.ucp_ep_rkey_unpack(e.ep, rkey.as_ptr() as *const c_void, &mut h) };
        if status != UCS_OK {
            return Err(TransportError::Refused(format!(
                "ucp_ep_rkey_unpack: {}",
                status_str(lib, status)
            )));
        }
        e.rkeys.insert(rkey.to_vec(), h);
        Ok(h)
    }

    /// Posts gets until every active pull has [`WINDOW`] in flight.
    fn issue(&mut self) {
        let lib = &self.lib;
        for p in &mut self.pulls {
            if p.error.is_some() {
                continue;
            }
            let Some(ep) = self.endpoints.get(&p.peer) else {
                p.error = Some(TransportError::Peer("endpoint closed".into()));
                continue;
            };
            if let Some(err) = &ep.failed {
                p.error = Some(err.clone());
                continue;
            }
            while p.inflight.len() < WINDOW && p.next < p.segments.len() {
                let s = p.segments[p.next];
                p.next += 1;
                let mut param = ucp_request_param_t {
                    op_attr_mask: 0,
                    ..unsafe_zeroed_param()
                };
                if matches!(p.local.kind(), MemoryKind::Cuda { .. }) {
                    param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
                    param.memory_type = UCS_MEMORY_TYPE_CUDA;
                }
                // SAFETY: the local range was bounds-checked in `Ucx::get` and `p.local` keeps
                // it alive until the request completes (the pull is replied only when nothing
                // is in flight); the remote range belongs to the peer's registered region
                // described by `p.rkey`; `param` lives through the call.
                let ptr = unsafe {
                    lib.ucp_get_nbx(
                        ep.ep,
                        p.local.as_ptr().add(s.local as usize) as *mut c_void,
                        s.len as usize,
                        p.remote_base + s.remote,
                        p.rkey,
                        &param,
                    )
                };
                match classify(ptr) {
                    Ptr::Done => {}
                    Ptr::Request(r) => p.inflight.push(r),
                    Ptr::Error(st) => {
                        p.error = Some(TransportError::Peer(format!(
                            "ucp_get_nbx: {}",
                            status_str(lib, st)
                        )));
                        break;
                    }
                }
            }
        }
    }

    /// Reaps finished requests and replies to finished pulls; true if anything finished.
    fn poll_requests(&mut self, pending: &AtomicUsize) -> bool {
        let lib = &self.lib;
        let mut any = false;
        for p in &mut self.pulls {
            p.inflight.retain(|&r| {
                // SAFETY: `r` is a live request returned by `ucp_get_nbx`, freed exactly once
                // (here, once complete).
                let st = unsafe { lib.ucp_request_check_status(r) };
                if st == UCS_INPROGRESS {
                    return true;
                }
                // SAFETY: as above.
                unsafe { lib.ucp_request_free(r) };
                any = true;
                if st != UCS_OK && p.error.is_none() {
                    p.error = Some(TransportError::Peer(format!(
                        "get: {}",
                        status_str(lib, st)
                    )));
                }
                false
            });
        }
        let mut i = 0;
        while i < self.pulls.len() {
            let p = &self.pulls[i];
            let done = p.inflight.is_empty() && (p.error.is_some() || p.next == p.segments.len());
            if done {
                let p = self.pulls.swap_remove(i);
                pending.fetch_sub(1, Ordering::Relaxed);
                let _ = p.reply.send(p.error.map_or(Ok(()), Err));
                any = true;
            } else {
                i += 1;
            }
        }
        // Finish closes whose requests completed; drop endpoints no pull uses any more.
        let pulls = &self.pulls;
        self.endpoints.retain(|peer, e| {
            if let Some(r) = e.closing {
                // SAFETY: the close request from `ucp_ep_close_nbx`, freed once, when done.
                let st = unsafe { lib.ucp_request_check_status(r) };
                if st == UCS_INPROGRESS {
                    return true;
                }
                // SAFETY: as above.
                unsafe { lib.ucp_request_free(r) };
                e.closing = None;
            }
            if e.failed.is_some() && !pulls.iter().any(|p| &p.peer == peer) {
                for (_, rk) in e.rkeys.drain() {
                    // SAFETY: unpacked on this endpoint, destroyed once, after every request
                    // that used it completed.
                    unsafe { lib.ucp_rkey_destroy(rk) };
                }
                return false;
            }
            true
        });
        any
    }

    /// Force-closes endpoints UCX reported failed; their pulls fail.
    fn reap_failed_endpoints(&mut self) {
        let failed: Vec<(usize, ucs_status_t)> =
            FAILED_EPS.with(|f| f.borrow_mut().drain(..).collect());
        for (ep, st) in failed {
            let why = format!("peer failed: {}", status_str(self.lib, st));
            let key = self
                .endpoints
                .iter()
                .find(|(_, e)| e.ep as usize == ep)
                .map(|(k, _)| k.clone());
            if let Some(k) = key {
                self.close(&k, TransportError::Peer(why));
            }
        }
    }

    /// Fails pulls past their deadline: force-closes their endpoints where that is allowed
    /// (error-handling endpoints); on a same-host endpoint the pull stops issuing and fails once
    /// its outstanding reads (local copies, which always finish) complete.
    fn expire(&mut self) {
        let now = Instant::now();
        let mut late: Vec<Vec<u8>> = Vec::new();
        for p in self
            .pulls
            .iter_mut()
            .filter(|p| p.error.is_none() && now >= p.deadline)
        {
            let closable = self
                .endpoints
                .get(&p.peer)
                .is_some_and(|e| e.error_handling);
            if closable {
                late.push(p.peer.clone());
            } else {
                p.error = Some(TransportError::Timeout);
            }
        }
        for peer in late {
            self.close(&peer, TransportError::Timeout);
        }
    }

    fn close(&mut self, peer: &[u8], why: TransportError) {
        for p in self.pulls.iter_mut().filter(|p| p.peer == peer) {
            if p.error.is_none() {
                p.error = Some(why.clone());
            }
        }
        let lib = &self.lib;
        let Some(e) = self.endpoints.get_mut(peer) else {
            return;
        };
        if e.failed.is_some() {
            return;
        }
        tracing::warn!(error = %why, "ucx: closing an endpoint");
        e.failed = Some(why);
        // Force mode needs error handling; a same-host endpoint closes gracefully (flush).
        let param = ucp_request_param_t {
            op_attr_mask: UCP_OP_ATTR_FIELD_FLAGS,
            flags: if e.error_handling {
                UCP_EP_CLOSE_FLAG_FORCE
            } else {
                0
            },
            ..unsafe_zeroed_param()
        };
        // SAFETY: live endpoint, closed once (guarded by `failed`); force mode completes its
        // outstanding requests with an error, which `poll_requests` then reaps.
        let ptr = unsafe { lib.ucp_ep_close_nbx(e.ep, &param) };
        if let Ptr::Request(r) = classify(ptr) {
            e.closing = Some(r);
        }
    }

    fn shutdown(&mut self, pending: &AtomicUsize) {
        let peers: Vec<Vec<u8>> = self.endpoints.keys().cloned().collect();
        for p in &peers {
            self.close(p, TransportError::Unavailable("transport stopped".into()));
        }
        let until = Instant::now() + Duration::from_secs(2);
        while (!self.pulls.is_empty() || !self.endpoints.is_empty()) && Instant::now() < until {
            // SAFETY: live worker on its own thread.
            unsafe { self.lib.ucp_worker_progress(self.worker) };
            self.poll_requests(pending);
        }
        // Memory UCX allocated may still be in use (an engine computing in it): unmapping it
        // would pull it from under its user, and destroying the context would too.
        let allocated_in_use = self.regs.values().any(|(_, m)| m.is_none());
        for (_, (memh, m)) in self.regs.iter() {
            if m.is_some() {
                // SAFETY: registered (not allocated) on this context, unmapped once; the
                // memory itself belongs to its `KvMemory`.
                unsafe { self.lib.ucp_mem_unmap(self.context, *memh) };
            }
        }
        self.regs.retain(|_, (_, m)| m.is_none());
        if allocated_in_use {
            tracing::debug!("ucx: memory it allocated is still in use; keeping the context");
        } else if self.pulls.is_empty() && self.endpoints.is_empty() {
            // SAFETY: no endpoint, request or mapping is left on the worker and context.
            unsafe {
                self.lib.ucp_worker_destroy(self.worker);
                self.lib.ucp_cleanup(self.context);
            }
        } else {
            // Requests still outstanding may still write into memory we no longer track:
            // leak the worker rather than free it under them.
            tracing::warn!("ucx: requests still outstanding at shutdown; leaking the worker");
            for p in self.pulls.drain(..) {
                pending.fetch_sub(1, Ordering::Relaxed);
                let _ = p
                    .reply
                    .send(Err(TransportError::Unavailable("transport stopped".into())));
            }
        }
    }
}

/// Whether a `UCX_TLS` value lets UCX use shared memory (unset, `all`, a list naming `shm`,
/// `mm`, `sysv` or `posix`, or an exclusion `^…` that names neither `shm` nor `mm`).
fn shm_in(tls: Option<&str>) -> bool {
    let Some(t) = tls.map(str::trim) else {
        return true;
    };
    let names = |s: &str, set: &[&str]| s.split(',').map(str::trim).any(|x| set.contains(&x));
    match t.strip_prefix('^') {
        Some(excluded) => !names(excluded, &["shm", "mm"]),
        None => names(t, &["all", "shm", "mm", "sysv", "posix"]),
    }
}

/// A zeroed request parameter block (every optional field absent).
fn unsafe_zeroed_param() -> ucp_request_param_t {
    // SAFETY: `ucp_request_param_t` is a C struct of integers, raw pointers and unions of
    // `Option<fn>`; all-zero is its documented "no fields set" value.
    unsafe { std::mem::zeroed() }
}

fn status_str(lib: &UcpLib, status: ucs_status_t) -> String {
    // SAFETY: `ucs_status_string` returns a pointer to a static NUL-terminated string.
    let p = unsafe { lib.ucs_status_string(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null static C string (above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Cuts segments longer than [`MAX_GET_BYTES`].
fn split(segments: &[Segment]) -> Vec<Segment> {
    let mut out = Vec::with_capacity(segments.len());
    for s in segments {
        let mut s = *s;
        while s.len > MAX_GET_BYTES {
            out.push(Segment {
                len: MAX_GET_BYTES,
                ..s
            });
            s.remote += MAX_GET_BYTES;
            s.local += MAX_GET_BYTES;
            s.len -= MAX_GET_BYTES;
        }
        if s.len > 0 {
            out.push(s);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_pointers_classify_like_ucs_ptr_is_err() {
        assert!(matches!(classify(std::ptr::null_mut()), Ptr::Done));
        assert!(matches!(
            classify(UCS_ERR_CANCELED as isize as *mut c_void),
            Ptr::Error(UCS_ERR_CANCELED)
        ));
        assert!(matches!(classify(0x1000 as *mut c_void), Ptr::Request(_)));
        assert!(matches!(
            classify(-200isize as *mut c_void),
            Ptr::Request(_)
        ));
    }

    #[test]
    fn shared_memory_follows_ucx_tls() {
        assert!(shm_in(None));
        assert!(shm_in(Some("all")));
        assert!(shm_in(Some("shm,cma,self")));
        assert!(shm_in(Some("^tcp")));
        assert!(!shm_in(Some("tcp")));
        assert!(!shm_in(Some("^shm")));
    }

    #[test]
    fn long_segments_are_cut() {
        let s = split(&[Segment {
            remote: 10,
            local: 20,
            len: 2 * MAX_GET_BYTES + 1,
        }]);
        assert_eq!(s.len(), 3);
        assert_eq!(s[2].remote, 10 + 2 * MAX_GET_BYTES);
        assert_eq!(s[2].len, 1);
    }
}
