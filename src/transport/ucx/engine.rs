//! The UCX thread: its state ([`Engine`]: context, worker, mappings, endpoints, pulls), its
//! start-up (library version, config, context and worker), the loop that takes commands,
//! issues gets and progresses the worker, the idle sleep (see the parent module's docs,
//! "Progress") and shutdown. Memory registration is in `memory.rs`, the pulls in `pull.rs`.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use tokio::sync::oneshot;

use super::sys::*;
use super::{Cmd, HOT, library};
use crate::transport::{KvMemory, Segment, TransportError};

mod memory;
mod pull;

use pull::split;

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

pub(super) struct Engine {
    lib: &'static UcpLib,
    context: ucp_context_h,
    worker: ucp_worker_h,
    waker: UnixStream,
    /// When progress last reported an event.
    last_event: Instant,
    /// Whether the configured transports include shared memory (`UCX_TLS` unset, `all`, or
    /// naming `shm`, `sysv`, `posix` or `mm`).
    shm_allowed: bool,
    pub(super) address: Vec<u8>,
    pub(super) version: String,
    pub(super) transports: String,
    /// Mappings by handle; `None` memory: allocated by UCX (freed by the unmap).
    regs: HashMap<u64, (ucp_mem_h, Option<Arc<KvMemory>>)>,
    next_handle: u64,
    endpoints: HashMap<Vec<u8>, Endpoint>,
    pulls: Vec<Pull>,
}

impl Engine {
    pub(super) fn new(tls: Option<&str>, waker: UnixStream) -> Result<Self, TransportError> {
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

    pub(super) fn run(&mut self, rx: mpsc::Receiver<Cmd>, pending: &AtomicUsize) {
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

fn status_str(lib: &UcpLib, status: ucs_status_t) -> String {
    // SAFETY: `ucs_status_string` returns a pointer to a static NUL-terminated string.
    let p = unsafe { lib.ucs_status_string(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null static C string (above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests;
