//! Memory on the UCX thread: registering a region (`ucp_mem_map`; host memory, or CUDA device
//! memory checked to be mapped as such), allocating shared memory through UCX
//! (`UCP_MEM_MAP_ALLOCATE`), and packing the remote key peers read it with.

use std::ffi::c_void;
use std::sync::Arc;

use super::{Engine, status_str};
use crate::transport::ucx::Registration;
use crate::transport::ucx::sys::*;
use crate::transport::{KvMemory, MemoryKind, TransportError};

impl Engine {
    pub(super) fn allocate(&mut self, len: usize) -> Result<(usize, Registration), TransportError> {
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

    pub(super) fn register(
        &mut self,
        memory: Arc<KvMemory>,
    ) -> Result<Registration, TransportError> {
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
}
