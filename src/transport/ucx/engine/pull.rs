//! Pulls on the UCX thread: the endpoint to each peer and the remote keys unpacked on it,
//! the gets each pull keeps in flight (up to [`WINDOW`]), reaping them and replying once none
//! is outstanding, and the failures (see the `ucx` module's docs, "Failures"): endpoints UCX
//! reports failed, pulls past their deadline, closing an endpoint.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::{Endpoint, Engine, status_str};
use crate::transport::ucx::sys::*;
use crate::transport::ucx::{MAX_GET_BYTES, WINDOW};
use crate::transport::{MemoryKind, Segment, TransportError};

thread_local! {
    /// Endpoints UCX reported failed during the current progress call (`on_ep_error` runs
    /// inside `ucp_worker_progress`, on the UCX thread).
    static FAILED_EPS: RefCell<Vec<(usize, ucs_status_t)>> = const { RefCell::new(Vec::new()) };
}

/// UCX's endpoint error callback: note the endpoint; the loop closes it after progress returns.
unsafe extern "C" fn on_ep_error(_arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t) {
    FAILED_EPS.with(|f| f.borrow_mut().push((ep as usize, status)));
}

/// A status pointer as UCX returns it: null = done, an error code, or a request to poll.
pub(super) enum Ptr {
    Done,
    Error(ucs_status_t),
    Request(*mut c_void),
}

pub(super) fn classify(p: ucs_status_ptr_t) -> Ptr {
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
    /// The endpoint to `peer` (created on first use) and `rkey` unpacked on it.
    pub(super) fn endpoint_rkey(
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
    pub(super) fn issue(&mut self) {
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
    pub(super) fn poll_requests(&mut self, pending: &AtomicUsize) -> bool {
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
    pub(super) fn reap_failed_endpoints(&mut self) {
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
    pub(super) fn expire(&mut self) {
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

    pub(super) fn close(&mut self, peer: &[u8], why: TransportError) {
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
}

/// A zeroed request parameter block (every optional field absent).
fn unsafe_zeroed_param() -> ucp_request_param_t {
    // SAFETY: `ucp_request_param_t` is a C struct of integers, raw pointers and unions of
    // `Option<fn>`; all-zero is its documented "no fields set" value.
    unsafe { std::mem::zeroed() }
}

/// Cuts segments longer than [`MAX_GET_BYTES`].
pub(super) fn split(segments: &[Segment]) -> Vec<Segment> {
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
