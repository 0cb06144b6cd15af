//! [`CudaOps`]: [`DeviceOps`] on an NVIDIA GPU through `cudarc` (feature `cuda`): the kernels
//! of `kernels.cu` (PTX from NVRTC, or from a file compiled elsewhere), cuBLAS for matrix
//! products with more rows than a decode GEMV takes, one stream per engine.
//!
//! Everything runs on one stream in order, so `cudarc`'s per-buffer event tracking is turned
//! off; the host waits only where it reads results (`download`, `row_stats`). The CUDA
//! context is made current on the calling thread at the start of each step
//! ([`DeviceOps::bind`]): steps run on tokio's blocking pool, a different thread each time, and
//! cuBLAS uses the thread's current context.
//!
//! Without cuBLAS (`libcublas` missing), products of more than [`twin::GEMV_MAX_M`] rows run
//! as GEMVs over chunks of that many rows: slower prefill, the same numbers as decode.

use std::sync::Arc;

use cudarc::cublas::{self, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError,
    LaunchConfig, PushKernelArg,
};

use super::pass::{DeviceOps, GemmPrecision, LayerPools};
use super::plan::StepPlan;
use super::twin;
use crate::kernels::quant::{MatrixData, WeightMatrix};
use crate::kernels::{AttnGeometry, RopeLayout};
use crate::kv::memory::{DeviceAccess, MemoryKind, MemoryLease};

/// A KV pool on the device as the transport reaches it: synchronous `cuMemcpyDtoH` /
/// `cuMemcpyHtoD` on the engine's context (made current on the calling thread), each under the
/// engine's lease. They do not wait for the engine's stream: by the pinning contract
/// (`kv/memory.rs`) the blocks moved were written by steps that have finished (every
/// step ends by reading its logits back) and no kernel touches them meanwhile.
struct CudaAccess {
    ctx: Arc<CudaContext>,
    base: cudarc::driver::sys::CUdeviceptr,
    lease: Arc<MemoryLease>,
}

impl DeviceAccess for CudaAccess {
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), String> {
        let _held = self.lease.hold()?;
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: `base + offset .. + out.len()` lies in the pool (bounds checked by
        // `KvMemory`), which lives while the lease is held.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(out, self.base + offset as u64) }
            .map_err(|e| e.to_string())
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<(), String> {
        let _held = self.lease.hold()?;
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: as in `read`.
        unsafe { cudarc::driver::result::memcpy_htod_sync(self.base + offset as u64, data) }
            .map_err(|e| e.to_string())
    }
}

/// What went wrong on the device. The causes are part of the message, not error sources,
/// so a chain printed with `{:#}` says each once.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA driver: {0}")]
    Driver(DriverError),
    #[error("cuBLAS: {0}")]
    Blas(cublas::result::CublasError),
    #[error("{0}")]
    Compile(super::CompileError),
    #[error("CUDA: {0}")]
    Other(String),
}

impl From<DriverError> for CudaError {
    fn from(e: DriverError) -> Self {
        Self::Driver(e)
    }
}

impl From<cublas::result::CublasError> for CudaError {
    fn from(e: cublas::result::CublasError) -> Self {
        Self::Blas(e)
    }
}

impl From<super::CompileError> for CudaError {
    fn from(e: super::CompileError) -> Self {
        Self::Compile(e)
    }
}

/// Every kernel of [`super::SOURCE`], loaded from one module.
#[derive(Debug)]
struct Kernels {
    rms_norm: CudaFunction,
    rope: CudaFunction,
    swiglu: CudaFunction,
    add: CudaFunction,
    add_bias: CudaFunction,
    embed_f32: CudaFunction,
    embed_q8_0: CudaFunction,
    embed_q4_1: CudaFunction,
    dequant_q8_0_bf16: CudaFunction,
    dequant_q4_1_bf16: CudaFunction,
    f32_to_bf16_n: CudaFunction,
    gemv_q4_1: CudaFunction,
    gemv_q8_0: CudaFunction,
    gemv_f32: CudaFunction,
    kv_write: CudaFunction,
    copy_runs: CudaFunction,
    paged_attention: CudaFunction,
    row_stats: CudaFunction,
}

/// One GPU with the kernels loaded.
#[derive(Debug)]
pub struct CudaOps {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// `None` when `libcublas` does not load (chunked GEMVs instead).
    blas: Option<CudaBlas>,
    k: Kernels,
    /// `sm_XY` of the device.
    pub arch: String,
    /// The device's name (driver).
    pub name: String,
}

// SAFETY: the context, stream and functions are `Send + Sync` in cudarc; `CudaBlas` is too. All
// work goes to one stream from one caller at a time (the engine is `&mut` per step).
unsafe impl Send for CudaOps {}
unsafe impl Sync for CudaOps {}

/// Threads per block of the reducing kernels, and grid size for grid-stride loops.
const THREADS: u32 = twin::THREADS as u32;
const ATT_THREADS: u32 = twin::ATT_THREADS as u32;

fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn elems_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The device copies of one weight matrix.
#[derive(Debug)]
pub struct CudaMat {
    rows: usize,
    cols: usize,
    /// Quantised blocks (Q8_0 / Q4_1), read by the GEMV and the embedding gather.
    blocks: Option<(CudaSlice<u8>, Quant)>,
    /// f32 values: the matrix itself when stored f32, else the GEMM copy at `F32` precision.
    f32: Option<CudaSlice<f32>>,
    /// bf16 GEMM copy at `Bf16` precision.
    bf16: Option<CudaSlice<u16>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quant {
    Q8_0,
    Q4_1,
}

/// A step's plan on the device (every array holds at least one element).
#[derive(Debug)]
pub struct CudaPlan {
    tokens: CudaSlice<u32>,
    positions: CudaSlice<i32>,
    slots: CudaSlice<i64>,
    table_start: CudaSlice<i32>,
    block_tables: CudaSlice<i32>,
    /// Element offsets of the wanted rows in the residual stream, and where they go.
    logit_src: CudaSlice<i64>,
    logit_dst: CudaSlice<i64>,
}

/// Bytes of a quantised matrix's blocks as the kernels read them (34- / 20-byte ggml blocks).
fn block_bytes(w: &WeightMatrix) -> Option<(&[u8], Quant)> {
    // SAFETY: `BlockQ8_0` / `BlockQ4_1` are `repr(C)` of f16 and byte arrays with no padding
    // (34 and 20 bytes, checked in tests), so their memory is exactly ggml's packed blocks.
    unsafe {
        match &w.data {
            MatrixData::F32(_) => None,
            MatrixData::Q8_0(b) => Some((
                std::slice::from_raw_parts(b.as_ptr().cast(), std::mem::size_of_val(&b[..])),
                Quant::Q8_0,
            )),
            MatrixData::Q4_1(b) => Some((
                std::slice::from_raw_parts(b.as_ptr().cast(), std::mem::size_of_val(&b[..])),
                Quant::Q4_1,
            )),
        }
    }
}

impl CudaOps {
    /// Opens device `ordinal` and loads the kernels for its architecture
    /// ([`super::kernels_ptx`]: PTX from `$FLOTILLA_CUDA_PTX_DIR`, else NVRTC).
    ///
    /// # Errors
    /// [`CudaError`] when a library is missing (checked before any call that would panic),
    /// there is no such device, or the kernels do not compile or load.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        let p = super::probe();
        if !p.driver {
            return Err(CudaError::Other(
                "cannot load libcuda (the NVIDIA driver)".into(),
            ));
        }
        let count = CudaContext::device_count()?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::Other(format!(
                "device {ordinal} requested, the driver sees {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: one stream carries every operation of this engine in order, so no buffer is
        // read or written by two streams; tracking per-buffer events would only cost time.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        let name = ctx.name()?;
        let ptx = super::kernels_ptx(&arch)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?;
        let f = |n: &str| module.load_function(n);
        let k = Kernels {
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            swiglu: f("swiglu")?,
            add: f("add")?,
            add_bias: f("add_bias")?,
            embed_f32: f("embed_f32")?,
            embed_q8_0: f("embed_q8_0")?,
            embed_q4_1: f("embed_q4_1")?,
            dequant_q8_0_bf16: f("dequant_q8_0_bf16")?,
            dequant_q4_1_bf16: f("dequant_q4_1_bf16")?,
            f32_to_bf16_n: f("f32_to_bf16_n")?,
            gemv_q4_1: f("gemv_q4_1")?,
            gemv_q8_0: f("gemv_q8_0")?,
            gemv_f32: f("gemv_f32")?,
            kv_write: f("kv_write")?,
            copy_runs: f("copy_runs")?,
            paged_attention: f("paged_attention")?,
            row_stats: f("row_stats")?,
        };
        // A stream of its own (not the legacy default stream), so replicas sharing a GPU do
        // not serialise on one queue or wait for each other's work when they synchronise.
        let stream = ctx.new_stream()?;
        let blas = if p.cublas {
            Some(CudaBlas::new(stream.clone())?)
        } else {
            tracing::warn!("cuda: libcublas does not load; prefill products run as GEMVs");
            None
        };
        Ok(Self {
            ctx,
            stream,
            blas,
            k,
            arch,
            name,
        })
    }

    /// Device-to-device copy bandwidth: `reps` copies of `bytes`, counted as bytes read plus
    /// bytes written per second (GB/s), the figure a memory-bound kernel can reach.
    ///
    /// # Errors
    /// The driver's.
    pub fn copy_bandwidth_gbs(&self, bytes: usize, reps: usize) -> Result<f64, CudaError> {
        self.ctx.bind_to_thread()?;
        let src = self.stream.alloc_zeros::<u8>(bytes)?;
        let mut dst = self.stream.alloc_zeros::<u8>(bytes)?;
        self.stream.memcpy_dtod(&src, &mut dst)?;
        self.stream.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            self.stream.memcpy_dtod(&src, &mut dst)?;
        }
        self.stream.synchronize()?;
        Ok((2 * bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9)
    }

    fn upload_t<T: cudarc::driver::DeviceRepr + Copy + Default>(
        &self,
        v: &[T],
    ) -> Result<CudaSlice<T>, CudaError> {
        if v.is_empty() {
            return Ok(self.stream.clone_htod(&[T::default()])?);
        }
        Ok(self.stream.clone_htod(v)?)
    }

    /// `y[m, rows] = x[m, cols] · Wᵀ` by GEMV launches of at most `GEMV_MAX_M` rows each.
    fn gemv(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        w: &CudaMat,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (rows, cols) = (w.rows as i32, w.cols as i32);
        let cfg = LaunchConfig {
            grid_dim: ((w.rows as u32).div_ceil(THREADS / 32), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (func, wbuf): (&CudaFunction, WeightRef<'_>) = match (&w.blocks, &w.f32) {
            (Some((b, Quant::Q4_1)), _) => (&self.k.gemv_q4_1, WeightRef::U8(b)),
            (Some((b, Quant::Q8_0)), _) => (&self.k.gemv_q8_0, WeightRef::U8(b)),
            (None, Some(f)) => (&self.k.gemv_f32, WeightRef::F32(f)),
            (None, None) => return Err(CudaError::Other("matrix without GEMV weights".into())),
        };
        let mut r0 = 0;
        while r0 < m {
            let mc = (m - r0).min(twin::GEMV_MAX_M);
            let xv = x.slice(r0 * w.cols..(r0 + mc) * w.cols);
            let mut yv = y.slice_mut(r0 * w.rows..(r0 + mc) * w.rows);
            let mi = mc as i32;
            let mut b = self.stream.launch_builder(func);
            match wbuf {
                WeightRef::U8(s) => b.arg(s),
                WeightRef::F32(s) => b.arg(s),
            };
            b.arg(&xv).arg(&mut yv).arg(&rows).arg(&cols).arg(&mi);
            // SAFETY: `gemv_*(w, x, y, rows, cols, m)` of kernels.cu; x holds mc·cols, y
            // mc·rows, w rows·cols (blocks) elements; one warp per output row.
            unsafe { b.launch(cfg) }?;
            r0 += mc;
        }
        Ok(())
    }

    /// An element-wise kernel `f(x, y, n)` that updates `x` in place from `y` (`add`,
    /// `swiglu`), grid-stride over `n` elements.
    fn in_place(
        &self,
        f: &CudaFunction,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        let nn = n as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(y).arg(&nn);
        // SAFETY: `add(x, y, n)` / `swiglu(gate, up, n)`: both buffers hold n elements.
        unsafe { b.launch(elems_cfg(n)) }?;
        Ok(())
    }

    /// `y = x · Wᵀ` by cuBLAS (row-major `y[m, R] = x[m, C] · W[R, C]ᵀ` is column-major
    /// `Yᵀ = op_T(W) · Xᵀ`: A = W with lda = C transposed, B = X with ldb = C, ldc = R).
    fn gemm(
        &self,
        blas: &CudaBlas,
        x: &CudaSlice<f32>,
        m: usize,
        w: &CudaMat,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (r, c) = (w.rows as i32, w.cols as i32);
        let op_t = cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        let op_n = cublas::sys::cublasOperation_t::CUBLAS_OP_N;
        if let Some(wb) = &w.bf16 {
            let n = m * w.cols;
            // SAFETY: every element is written by `f32_to_bf16_n` before cuBLAS reads it.
            let mut xb = unsafe { self.stream.alloc::<u16>(n) }?;
            let nn = n as i64;
            let mut b = self.stream.launch_builder(&self.k.f32_to_bf16_n);
            b.arg(x).arg(&mut xb).arg(&nn);
            // SAFETY: `f32_to_bf16_n(x, out, n)`, both n long.
            unsafe { b.launch(elems_cfg(n)) }?;
            let (alpha, beta) = (1f32, 0f32);
            let (pa, _ra) = wb.device_ptr(&self.stream);
            let (pb, _rb) = xb.device_ptr(&self.stream);
            let (pc, _rc) = y.device_ptr_mut(&self.stream);
            // SAFETY: A is R×C bf16 (lda C, transposed), B is C×m bf16 (ldb C), C is R×m f32
            // (ldc R); all live on this stream's device for the call.
            unsafe {
                cublas::result::gemm_ex(
                    *blas.handle(),
                    op_t,
                    op_n,
                    r,
                    m as i32,
                    c,
                    (&alpha as *const f32).cast(),
                    pa as *const _,
                    cublas::sys::cudaDataType_t::CUDA_R_16BF,
                    c,
                    pb as *const _,
                    cublas::sys::cudaDataType_t::CUDA_R_16BF,
                    c,
                    (&beta as *const f32).cast(),
                    pc as *mut _,
                    cublas::sys::cudaDataType_t::CUDA_R_32F,
                    r,
                    cublas::sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }?;
            return Ok(());
        }
        let Some(wf) = &w.f32 else {
            return Err(CudaError::Other("matrix without GEMM weights".into()));
        };
        let cfg = GemmConfig {
            transa: op_t,
            transb: op_n,
            m: r,
            n: m as i32,
            k: c,
            alpha: 1f32,
            lda: c,
            ldb: c,
            beta: 0f32,
            ldc: r,
        };
        // SAFETY: as above, all f32; `y` holds at least m·R values.
        unsafe { blas.gemm(cfg, wf, x, y) }?;
        Ok(())
    }
}

enum WeightRef<'a> {
    U8(&'a CudaSlice<u8>),
    F32(&'a CudaSlice<f32>),
}

impl DeviceOps for CudaOps {
    type Buf = CudaSlice<f32>;
    type Mat = CudaMat;
    type Plan = CudaPlan;
    type RopeTable = CudaSlice<f64>;
    type Error = CudaError;

    fn bind(&self) -> Result<(), CudaError> {
        Ok(self.ctx.bind_to_thread()?)
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    fn transport_access(
        &self,
        pools: &CudaSlice<f32>,
        lease: &Arc<MemoryLease>,
    ) -> Option<(std::ptr::NonNull<u8>, MemoryKind, Box<dyn DeviceAccess>)> {
        let (base, _sync) = pools.device_ptr(&self.stream);
        let addr = std::ptr::NonNull::new(base as usize as *mut u8)?;
        let kind = MemoryKind::Cuda {
            device: self.ctx.ordinal() as u32,
        };
        let access = CudaAccess {
            ctx: self.ctx.clone(),
            base,
            lease: lease.clone(),
        };
        Some((addr, kind, Box::new(access)))
    }

    fn upload(&self, v: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        self.upload_t(v)
    }

    fn upload_matrix(
        &self,
        w: &WeightMatrix,
        precision: GemmPrecision,
    ) -> Result<CudaMat, CudaError> {
        let n = w.rows * w.cols;
        let mut m = CudaMat {
            rows: w.rows,
            cols: w.cols,
            blocks: None,
            f32: None,
            bf16: None,
        };
        match block_bytes(w) {
            None => {
                if let MatrixData::F32(v) = &w.data {
                    m.f32 = Some(self.upload_t(v)?);
                }
            }
            Some((bytes, q)) => {
                m.blocks = Some((self.upload_t(bytes)?, q));
                if precision == GemmPrecision::F32 && self.blas.is_some() {
                    m.f32 = Some(self.upload_t(&w.to_f32())?);
                }
            }
        }
        if precision == GemmPrecision::Bf16 && self.blas.is_some() {
            // SAFETY: every element is written by the conversion below before any read.
            let mut out = unsafe { self.stream.alloc::<u16>(n) }?;
            let nn = n as i64;
            match (&m.blocks, &m.f32) {
                (Some((b, q)), _) => {
                    let func = match q {
                        Quant::Q8_0 => &self.k.dequant_q8_0_bf16,
                        Quant::Q4_1 => &self.k.dequant_q4_1_bf16,
                    };
                    let mut l = self.stream.launch_builder(func);
                    l.arg(b).arg(&mut out).arg(&nn);
                    // SAFETY: `dequant_*_bf16(w, out, n)`: n elements of blocks, n outputs.
                    unsafe { l.launch(elems_cfg(n)) }?;
                }
                (None, Some(f)) => {
                    let mut l = self.stream.launch_builder(&self.k.f32_to_bf16_n);
                    l.arg(f).arg(&mut out).arg(&nn);
                    // SAFETY: `f32_to_bf16_n(x, out, n)`.
                    unsafe { l.launch(elems_cfg(n)) }?;
                }
                (None, None) => return Err(CudaError::Other("matrix without weights".into())),
            }
            m.bf16 = Some(out);
        }
        Ok(m)
    }

    fn upload_rope(&self, inv_freq: &[f64]) -> Result<CudaSlice<f64>, CudaError> {
        self.upload_t(inv_freq)
    }

    fn upload_plan(&self, p: &StepPlan, width: usize) -> Result<CudaPlan, CudaError> {
        let w = width as i64;
        let src: Vec<i64> = p.logit_rows.iter().map(|&r| r as i64 * w).collect();
        let dst: Vec<i64> = (0..p.logit_rows.len() as i64).map(|i| i * w).collect();
        Ok(CudaPlan {
            tokens: self.upload_t(&p.tokens)?,
            positions: self.upload_t(&p.positions)?,
            slots: self.upload_t(&p.slots)?,
            table_start: self.upload_t(&p.table_start)?,
            block_tables: self.upload_t(&p.block_tables)?,
            logit_src: self.upload_t(&src)?,
            logit_dst: self.upload_t(&dst)?,
        })
    }

    fn download(
        &self,
        b: &CudaSlice<f32>,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, CudaError> {
        self.bind()?;
        let view = b
            .try_slice(range.clone())
            .ok_or_else(|| CudaError::Other(format!("download of {range:?} from {}", b.len())))?;
        let v = self.stream.clone_dtoh(&view)?;
        self.stream.synchronize()?;
        Ok(v)
    }

    fn embed(
        &self,
        table: &CudaMat,
        plan: &CudaPlan,
        n: usize,
        cols: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let ci = cols as i32;
        let mut b;
        match (&table.blocks, &table.f32) {
            (Some((blk, q)), _) => {
                let func = match q {
                    Quant::Q8_0 => &self.k.embed_q8_0,
                    Quant::Q4_1 => &self.k.embed_q4_1,
                };
                b = self.stream.launch_builder(func);
                b.arg(blk);
            }
            (None, Some(f)) => {
                b = self.stream.launch_builder(&self.k.embed_f32);
                b.arg(f);
            }
            (None, None) => return Err(CudaError::Other("embedding without weights".into())),
        }
        b.arg(&plan.tokens).arg(out).arg(&ci);
        // SAFETY: `embed_*(table, tokens, out, cols)`: n tokens (validated ids), out n·cols.
        unsafe { b.launch(rows_cfg(n, THREADS)) }?;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        (rows, d): (usize, usize),
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let di = d as i32;
        let mut b = self.stream.launch_builder(&self.k.rms_norm);
        b.arg(x).arg(w).arg(out).arg(&di).arg(&eps);
        // SAFETY: `rms_norm(x, w, out, d, eps)`, one block per row of d.
        unsafe { b.launch(rows_cfg(rows, THREADS)) }?;
        Ok(())
    }

    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        w: &CudaMat,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        match &self.blas {
            Some(blas) if m > twin::GEMV_MAX_M && (w.f32.is_some() || w.bf16.is_some()) => {
                self.gemm(blas, x, m, w, y)
            }
            _ => self.gemv(x, m, w, y),
        }
    }

    fn add_bias(
        &self,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let (nn, di) = (n as i64, d as i32);
        let mut b = self.stream.launch_builder(&self.k.add_bias);
        b.arg(x).arg(bias).arg(&nn).arg(&di);
        // SAFETY: `add_bias(x, b, n, d)`.
        unsafe { b.launch(elems_cfg(n)) }?;
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        table: &CudaSlice<f64>,
        plan: &CudaPlan,
        n: usize,
        heads: usize,
        head_dim: usize,
        layout: RopeLayout,
    ) -> Result<(), CudaError> {
        let half = table.len() as i32;
        let (hi, hdi) = (heads as i32, head_dim as i32);
        let inter = i32::from(layout == RopeLayout::Interleaved);
        let mut b = self.stream.launch_builder(&self.k.rope);
        b.arg(x)
            .arg(&plan.positions)
            .arg(table)
            .arg(&hi)
            .arg(&hdi)
            .arg(&half)
            .arg(&inter);
        // SAFETY: `rope(x, positions, inv_freq, heads, head_dim, half, interleaved)`, one
        // block per token; inv_freq holds `half` values.
        unsafe { b.launch(rows_cfg(n, THREADS)) }?;
        Ok(())
    }

    fn kv_write(
        &self,
        pools: &mut CudaSlice<f32>,
        at: LayerPools,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        plan: &CudaPlan,
        n: usize,
        kvd: usize,
    ) -> Result<(), CudaError> {
        let kvi = kvd as i32;
        let (lo, mut vp) = pools.split_at_mut(at.v);
        let mut lo = lo;
        let mut kp = lo.slice_mut(at.k..);
        let mut b = self.stream.launch_builder(&self.k.kv_write);
        b.arg(&mut kp)
            .arg(&mut vp)
            .arg(k)
            .arg(v)
            .arg(&plan.slots)
            .arg(&kvi);
        // SAFETY: `kv_write(k_pool, v_pool, k, v, slots, kvd)`: slots are validated offsets
        // inside one pool; the K and V views do not overlap (V starts where K's pool ends).
        unsafe { b.launch(rows_cfg(n, THREADS)) }?;
        Ok(())
    }

    fn attention(
        &self,
        q: &CudaSlice<f32>,
        pools: &CudaSlice<f32>,
        at: LayerPools,
        plan: &CudaPlan,
        n: usize,
        g: AttnGeometry,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let kp = pools.slice(at.k..);
        let vp = pools.slice(at.v..);
        let (nh, nkv, hd, bs) = (
            g.n_heads as i32,
            g.n_kv_heads as i32,
            g.head_dim as i32,
            g.block_size as i32,
        );
        let scale = 1.0 / (g.head_dim as f32).sqrt();
        let mut b = self.stream.launch_builder(&self.k.paged_attention);
        b.arg(q)
            .arg(&kp)
            .arg(&vp)
            .arg(&plan.positions)
            .arg(&plan.table_start)
            .arg(&plan.block_tables)
            .arg(out)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&bs)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, g.n_heads as u32, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `paged_attention(q, k_pool, v_pool, positions, table_start, block_tables,
        // out, n_heads, n_kv_heads, head_dim, block_size, scale)`; head_dim ≤
        // ATT_MAX_HEAD_DIM (checked when the engine starts), block tables validated.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        self.in_place(&self.k.add, x, y, n)
    }

    fn swiglu(
        &self,
        gate: &mut CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        self.in_place(&self.k.swiglu, gate, up, n)
    }

    fn gather_logit_rows(
        &self,
        src: &CudaSlice<f32>,
        plan: &CudaPlan,
        rows: usize,
        d: usize,
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let len = d as i64;
        let mut b = self.stream.launch_builder(&self.k.copy_runs);
        b.arg(src)
            .arg(dst)
            .arg(&plan.logit_src)
            .arg(&plan.logit_dst)
            .arg(&len);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `copy_runs(src, dst, src_off, dst_off, run_len)`: `rows` runs of d inside
        // both buffers.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn row_stats(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<Vec<(u32, f32, f32)>, CudaError> {
        if rows == 0 {
            return Ok(Vec::new());
        }
        self.bind()?;
        // SAFETY: `row_stats` writes every row's entry before they are read.
        let (mut am, mut mx, mut lse) = unsafe {
            (
                self.stream.alloc::<i32>(rows)?,
                self.stream.alloc::<f32>(rows)?,
                self.stream.alloc::<f32>(rows)?,
            )
        };
        let vi = vocab as i32;
        let mut b = self.stream.launch_builder(&self.k.row_stats);
        b.arg(logits)
            .arg(&vi)
            .arg(&mut am)
            .arg(&mut mx)
            .arg(&mut lse);
        // SAFETY: `row_stats(logits, vocab, argmax, max, lse)`, one block per row.
        unsafe { b.launch(rows_cfg(rows, THREADS)) }?;
        let (am, mx, lse) = (
            self.stream.clone_dtoh(&am)?,
            self.stream.clone_dtoh(&mx)?,
            self.stream.clone_dtoh(&lse)?,
        );
        self.stream.synchronize()?;
        Ok(am
            .into_iter()
            .zip(mx)
            .zip(lse)
            .map(|((a, m), l)| (a as u32, m, l))
            .collect())
    }
}
