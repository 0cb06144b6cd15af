//! CUDA kernels: NVRTC sources compiled at run time for the device's architecture, with a CPU
//! twin of each (see `docs/architecture.md`, "Engines and kernels").
//!
//! Layout:
//! - `kernels.cu`: every kernel, one translation unit that includes no header (NVRTC needs
//!   nothing but `libnvrtc`): RMSNorm, RoPE (both layouts), SwiGLU, residual and bias adds,
//!   embedding gather (f32 / Q8_0 / Q4_1), Q8_0/Q4_1 → bf16 dequantisation and f32 → bf16,
//!   decode GEMV with on-the-fly dequantisation (f32 / Q8_0 / Q4_1, up to [`twin::GEMV_MAX_M`]
//!   rows), KV slot write, block copy/gather/scatter (`copy_runs`), paged causal attention
//!   (prefill and decode, online softmax over tiles, grouped-query heads) and per-row argmax /
//!   max / log-sum-exp for sampling.
//! - `twin.rs`: the CPU twins, tested against `kernels/cpu/`.
//! - `plan.rs`: a batch flattened into the index arrays the kernels read.
//! - `pass.rs`: the operations a forward pass needs of a device, the [`pass::DeviceOps`]
//!   trait, and [`pass::HostOps`], its implementation on the CPU twins (tests run the whole
//!   pass there). The pass itself is the model's (`model/device_forward.rs`) and the engine
//!   that runs it a worker's (`worker/engine/gpu.rs`): kernels are ops; engines use them.
//! - `device.rs` (feature `cuda`): `CudaOps`, the pass's operations as kernel launches and
//!   cuBLAS calls through `cudarc`.
//! - [`probe`]: which CUDA libraries load here (without the `cuda` cargo feature: none);
//!   [`select`]: `worker.backend` (`auto` / `cpu` / `cuda`) resolved against it.
//! - [`compile_ptx`] (feature `cuda`): NVRTC compilation to PTX; [`kernels_ptx`] takes PTX
//!   compiled elsewhere from `$FLOTILLA_CUDA_PTX_DIR` when present.
//!
//! Libraries are loaded dynamically (`cudarc`'s `dynamic-loading`), so a build with the
//! feature runs on machines without CUDA. `cudarc` panics instead of returning an error when a
//! library is missing, so every entry point checks `is_culib_present` first
//! (`CRATES.md`-measured pitfall, cudarc 0.19.10).
//!
//! Sampling keeps the CPU's draws: greedy rows use `row_stats` (same argmax and tie rule as
//! [`crate::kernels::sample::argmax`]); a stochastic row's logits go to the host and the
//! sequence's own seeded generator draws there.

#[cfg(feature = "cuda")]
pub mod device;
pub mod pass;
pub mod plan;
pub mod twin;

pub use pass::GemmPrecision;

/// The kernels' source (`kernels.cu`).
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every `extern "C" __global__` entry point of [`SOURCE`].
pub const KERNELS: &[&str] = &[
    "rms_norm",
    "rope",
    "swiglu",
    "add",
    "add_bias",
    "embed_f32",
    "embed_q8_0",
    "embed_q4_1",
    "dequant_q8_0_bf16",
    "dequant_q4_1_bf16",
    "f32_to_bf16_n",
    "gemv_q4_1",
    "gemv_q8_0",
    "gemv_f32",
    "kv_write",
    "copy_runs",
    "paged_attention",
    "row_stats",
];

/// GPU architectures the kernels are compiled for in tests: Ampere (A100), Hopper (H100/H200).
pub const TEST_ARCHS: &[&str] = &["sm_80", "sm_90"];

/// What this process can use of CUDA.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Probe {
    /// Built with the `cuda` cargo feature.
    pub built: bool,
    /// `libcuda` (the driver) loads.
    pub driver: bool,
    /// `libnvrtc` loads (compiling kernels needs only this, no GPU).
    pub nvrtc: bool,
    /// `libcublas` loads.
    pub cublas: bool,
}

/// Which CUDA libraries load in this process. Loading is attempted once per library and
/// cached by `cudarc`.
pub fn probe() -> Probe {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: these only try to dlopen the library by name (cudarc 0.19 `is_culib_present`);
        // no symbol is called.
        unsafe {
            Probe {
                built: true,
                driver: cudarc::driver::sys::is_culib_present(),
                nvrtc: cudarc::nvrtc::sys::is_culib_present(),
                cublas: cudarc::cublas::sys::is_culib_present(),
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        Probe {
            built: false,
            driver: false,
            nvrtc: false,
            cublas: false,
        }
    }
}

/// Why kernels could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("cannot compile CUDA kernels: {0}")]
    Unavailable(String),
    #[error("NVRTC rejected the kernels for {arch}: {log}")]
    Nvrtc { arch: String, log: String },
    #[error("the PTX for {arch} lacks kernel {kernel}")]
    MissingKernel { arch: String, kernel: &'static str },
}

/// PTX of [`SOURCE`] for one architecture.
#[derive(Debug, Clone)]
pub struct CompiledKernels {
    pub arch: String,
    /// PTX assembly text.
    pub ptx: String,
}

/// Compiles [`SOURCE`] with NVRTC for `arch` (e.g. `"sm_90"`) and checks that every entry of
/// [`KERNELS`] is in the PTX. Needs `libnvrtc` only: no driver, no GPU.
///
/// # Errors
/// [`CompileError::Unavailable`] without the feature or without `libnvrtc`;
/// [`CompileError::Nvrtc`] with NVRTC's log; [`CompileError::MissingKernel`].
pub fn compile_ptx(arch: &str) -> Result<CompiledKernels, CompileError> {
    #[cfg(feature = "cuda")]
    {
        let p = probe();
        if !p.nvrtc {
            return Err(CompileError::Unavailable(
                "cannot load libnvrtc (searched by name through LD_LIBRARY_PATH; in the \
                 repository, LD_LIBRARY_PATH=$(scripts/fetch-nvrtc.sh) provides it)"
                    .into(),
            ));
        }
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(leak_arch(arch)),
            use_fast_math: Some(false),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| {
            let log = match &e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    log.to_string_lossy().into_owned()
                }
                other => format!("{other:?}"),
            };
            CompileError::Nvrtc {
                arch: arch.to_string(),
                log,
            }
        })?;
        let ptx = ptx.to_src();
        for &kernel in KERNELS {
            if !ptx.contains(&format!(".entry {kernel}(")) {
                return Err(CompileError::MissingKernel {
                    arch: arch.to_string(),
                    kernel,
                });
            }
        }
        Ok(CompiledKernels {
            arch: arch.to_string(),
            ptx,
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = arch;
        Err(CompileError::Unavailable(
            "built without the `cuda` cargo feature".into(),
        ))
    }
}

/// `CompileOptions::arch` takes `&'static str`; the few architecture names a process compiles
/// for are interned once each.
#[cfg(feature = "cuda")]
fn leak_arch(arch: &str) -> &'static str {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(&n) = names.get(arch) {
        return n;
    }
    let n: &'static str = Box::leak(arch.to_string().into_boxed_str());
    names.insert(n);
    n
}

/// Environment variable naming a folder of `flotilla-<arch>.ptx` files (written by
/// `flotilla cuda --ptx-out DIR`), used instead of NVRTC where present: a GPU machine then
/// needs only the driver (which JIT-compiles PTX) and, for prefill GEMMs, cuBLAS.
pub const PTX_DIR_ENV: &str = "FLOTILLA_CUDA_PTX_DIR";

/// `$FLOTILLA_CUDA_PTX_DIR`, when set and not empty.
fn ptx_dir() -> Option<std::path::PathBuf> {
    std::env::var_os(PTX_DIR_ENV)
        .filter(|d| !d.is_empty())
        .map(Into::into)
}

/// The kernels' PTX for `arch` (e.g. `sm_86`): from `$FLOTILLA_CUDA_PTX_DIR` when it holds a
/// `flotilla-sm_N.ptx` with `N` ≤ the architecture (the largest such: PTX for an older
/// architecture is JIT-compiled by the driver for a newer one), else compiled with NVRTC.
///
/// # Errors
/// As [`compile_ptx`] (naming the folder that had no fitting file); [`CompileError::Unavailable`]
/// when the file cannot be read or lacks a kernel.
pub fn kernels_ptx(arch: &str) -> Result<String, CompileError> {
    kernels_ptx_in(ptx_dir().as_deref(), arch)
}

/// `N` of a `flotilla-sm_N.ptx` file name.
fn ptx_file_sm(name: &str) -> Option<u32> {
    name.strip_prefix("flotilla-sm_")?
        .strip_suffix(".ptx")?
        .parse()
        .ok()
}

/// [`kernels_ptx`] with the PTX folder given.
fn kernels_ptx_in(dir: Option<&std::path::Path>, arch: &str) -> Result<String, CompileError> {
    let want = arch.strip_prefix("sm_").and_then(|n| n.parse::<u32>().ok());
    let best = dir
        .and_then(|d| std::fs::read_dir(d).ok())
        .into_iter()
        .flatten()
        .filter_map(|e| ptx_file_sm(&e.ok()?.file_name().to_string_lossy()))
        .filter(|&n| want.is_some_and(|w| n <= w))
        .max();
    let (Some(dir), Some(n)) = (dir, best) else {
        return compile_ptx(arch)
            .map(|k| k.ptx)
            .map_err(|e| match (e, dir) {
                (CompileError::Unavailable(why), Some(d)) => CompileError::Unavailable(format!(
                    "{why}, and {} holds no flotilla-sm_N.ptx with N <= {}",
                    d.display(),
                    arch.trim_start_matches("sm_")
                )),
                (e, _) => e,
            });
    };
    let path = dir.join(format!("flotilla-sm_{n}.ptx"));
    let ptx = std::fs::read_to_string(&path)
        .map_err(|e| CompileError::Unavailable(format!("reading {}: {e}", path.display())))?;
    match KERNELS
        .iter()
        .find(|k| !ptx.contains(&format!(".entry {k}(")))
    {
        Some(k) => Err(CompileError::Unavailable(format!(
            "{} lacks kernel {k}",
            path.display()
        ))),
        None => Ok(ptx),
    }
}

/// Whether `dir` holds PTX for some architecture (then NVRTC is not needed).
fn has_ptx_files(dir: Option<&std::path::Path>) -> bool {
    dir.and_then(|d| std::fs::read_dir(d).ok())
        .into_iter()
        .flatten()
        .any(|e| e.is_ok_and(|e| ptx_file_sm(&e.file_name().to_string_lossy()).is_some()))
}

/// GPUs the driver sees (0 when the driver does not load or has none).
pub fn device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        if probe().driver {
            return cudarc::driver::CudaContext::device_count()
                .map_or(0, |n| usize::try_from(n).unwrap_or(0));
        }
        0
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// `worker.backend`: where the real engine runs.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum BackendChoice {
    /// CUDA when the driver and a way to get the kernels (NVRTC, or PTX in
    /// `$FLOTILLA_CUDA_PTX_DIR`) load and a GPU exists, else the CPU (the log says why); a
    /// GPU engine that then cannot start falls back to the CPU as well. cuBLAS is optional.
    #[default]
    Auto,
    Cpu,
    /// CUDA or an error at start naming what is missing.
    Cuda,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            other => Err(format!("unknown backend {other:?} (auto, cpu or cuda)")),
        }
    }
}

/// What [`select`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Run on CUDA (else the CPU).
    pub cuda: bool,
    /// GPUs the driver sees (asked only once the libraries load; 0 on the CPU).
    pub gpus: usize,
    /// `auto` chose: a GPU engine that cannot start falls back to the CPU.
    pub cpu_fallback: bool,
    /// Why, in words (for the log line).
    pub reason: String,
}

impl Selection {
    /// The engine device this selection means: GPU `ordinal` with `precision`, or the CPU.
    pub fn device(&self, ordinal: usize, precision: GemmPrecision) -> crate::kernels::Device {
        if self.cuda {
            crate::kernels::Device::Cuda {
                ordinal,
                precision,
                cpu_fallback: self.cpu_fallback,
            }
        } else {
            crate::kernels::Device::Cpu
        }
    }
}

/// Resolves a [`BackendChoice`] against what loads here ([`probe`], [`device_count`]).
///
/// # Errors
/// For [`BackendChoice::Cuda`] when CUDA cannot be used: the message names what is missing.
pub fn select(choice: BackendChoice) -> Result<Selection, String> {
    select_with(
        choice,
        &probe(),
        has_ptx_files(ptx_dir().as_deref()),
        device_count,
    )
}

/// [`select`] over given facts (`devices` is asked only once the libraries load).
///
/// # Errors
/// As [`select`].
pub fn select_with(
    choice: BackendChoice,
    p: &Probe,
    ptx_files: bool,
    devices: impl FnOnce() -> usize,
) -> Result<Selection, String> {
    if choice == BackendChoice::Cpu {
        return Ok(Selection {
            cuda: false,
            gpus: 0,
            cpu_fallback: false,
            reason: "worker.backend = cpu".into(),
        });
    }
    let mut gpus = 0;
    let missing = if !p.built {
        Some("built without the `cuda` cargo feature".to_string())
    } else if !p.driver {
        Some("cannot load libcuda (the NVIDIA driver)".to_string())
    } else if !p.nvrtc && !ptx_files {
        Some(format!(
            "cannot load libnvrtc and ${PTX_DIR_ENV} holds no flotilla-sm_*.ptx"
        ))
    } else {
        gpus = devices();
        (gpus == 0).then(|| "the driver sees no GPU".to_string())
    };
    match (missing, choice) {
        (None, _) => Ok(Selection {
            cuda: true,
            gpus,
            cpu_fallback: choice == BackendChoice::Auto,
            reason: if p.cublas {
                "CUDA: driver, kernels and cuBLAS load, a GPU is present".into()
            } else {
                "CUDA without cuBLAS (prefill products as GEMVs)".into()
            },
        }),
        (Some(why), BackendChoice::Cuda) => Err(format!("backend cuda asked for, but {why}")),
        (Some(why), _) => Ok(Selection {
            cuda: false,
            gpus,
            cpu_fallback: false,
            reason: format!("auto: CPU, because {why}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(built: bool, driver: bool, nvrtc: bool, cublas: bool) -> Probe {
        Probe {
            built,
            driver,
            nvrtc,
            cublas,
        }
    }

    #[test]
    fn selection_follows_what_loads() {
        let none = all(true, false, false, false);
        let full = all(true, true, true, true);
        let never = || -> usize { panic!("devices asked without a driver") };
        // cpu is cpu, whatever loads.
        let s = select_with(BackendChoice::Cpu, &full, false, || 1).expect("cpu");
        assert!(!s.cuda);
        // auto falls back with the reason; cuda refuses with it.
        let s = select_with(BackendChoice::Auto, &none, false, never).expect("auto");
        assert!(!s.cuda && s.reason.contains("libcuda"), "{}", s.reason);
        let e = select_with(BackendChoice::Cuda, &none, false, never).expect_err("cuda");
        assert!(e.contains("libcuda"), "{e}");
        let e = select_with(
            BackendChoice::Cuda,
            &all(false, false, false, false),
            false,
            never,
        )
        .expect_err("not built");
        assert!(e.contains("cargo feature"), "{e}");
        // no NVRTC: PTX files stand in; neither: refused.
        let no_nvrtc = all(true, true, false, true);
        assert!(
            select_with(BackendChoice::Cuda, &no_nvrtc, true, || 1)
                .expect("ptx")
                .cuda
        );
        let e = select_with(BackendChoice::Cuda, &no_nvrtc, false, || 1).expect_err("no ptx");
        assert!(e.contains("libnvrtc"), "{e}");
        // libraries but no GPU.
        let s = select_with(BackendChoice::Auto, &full, false, || 0).expect("auto");
        assert!(!s.cuda && s.reason.contains("no GPU"), "{}", s.reason);
        assert!(
            select_with(BackendChoice::Auto, &full, false, || 1)
                .expect("gpu")
                .cuda
        );
        // no cuBLAS still runs, and says so.
        let s = select_with(
            BackendChoice::Auto,
            &all(true, true, true, false),
            false,
            || 2,
        )
        .expect("no blas");
        assert!(s.cuda && s.reason.contains("cuBLAS"), "{}", s.reason);
        assert_eq!("cuda".parse::<BackendChoice>(), Ok(BackendChoice::Cuda));
        assert!("gpu".parse::<BackendChoice>().is_err());
    }

    /// On this machine (no driver) auto picks the CPU and an explicit cuda says why not.
    #[test]
    fn this_machine_without_a_driver_falls_back() {
        if probe().driver {
            eprintln!("skipped: a CUDA driver loads here");
            return;
        }
        assert_eq!(device_count(), 0);
        assert!(!select(BackendChoice::Auto).expect("auto").cuda);
        assert!(select(BackendChoice::Cuda).is_err());
    }

    #[test]
    fn ptx_from_a_folder_is_checked_and_the_newest_fitting_one_taken() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = Some(dir.path());
        assert!(!has_ptx_files(d));
        let full = |tag: &str| -> String {
            KERNELS
                .iter()
                .map(|k| format!(".entry {k}(\n// {tag}\n"))
                .collect()
        };
        std::fs::write(dir.path().join("flotilla-sm_80.ptx"), full("80")).expect("write");
        std::fs::write(dir.path().join("flotilla-sm_90.ptx"), full("90")).expect("write");
        std::fs::write(dir.path().join("notes.txt"), "x").expect("write");
        assert!(has_ptx_files(d));
        // An sm_86 device takes sm_80's PTX, an sm_100 one sm_90's.
        assert_eq!(kernels_ptx_in(d, "sm_86").expect("86"), full("80"));
        assert_eq!(kernels_ptx_in(d, "sm_100").expect("100"), full("90"));
        // Nothing fits an sm_75: NVRTC then, and without it the error names the folder.
        if !probe().nvrtc {
            let e = kernels_ptx_in(d, "sm_75").expect_err("no fitting file");
            assert!(
                e.to_string()
                    .contains("holds no flotilla-sm_N.ptx with N <= 75"),
                "{e}"
            );
        }
        std::fs::write(dir.path().join("flotilla-sm_90.ptx"), ".entry rms_norm(").expect("write");
        let e = kernels_ptx_in(d, "sm_90").expect_err("incomplete ptx");
        assert!(e.to_string().contains("lacks kernel rope"), "{e}");
    }

    #[test]
    fn every_entry_point_is_listed() {
        let found: Vec<&str> = SOURCE
            .split("extern \"C\" __global__ void ")
            .skip(1)
            .filter_map(|s| s.split('(').next())
            .collect();
        assert_eq!(found, KERNELS);
    }

    #[test]
    fn twin_constants_match_the_source() {
        for (name, v) in [
            ("THREADS", twin::THREADS),
            ("ATT_THREADS", twin::ATT_THREADS),
            ("ATT_MAX_HEAD_DIM", twin::ATT_MAX_HEAD_DIM),
            ("GEMV_MAX_M", twin::GEMV_MAX_M),
        ] {
            assert!(
                SOURCE.contains(&format!("#define {name} {v}\n")),
                "{name} = {v} in twin.rs, not in kernels.cu"
            );
        }
    }

    /// NVRTC compiles every kernel for Ampere and Hopper. `make test` installs libnvrtc (the
    /// `nvidia-cuda-nvrtc-cu12` wheel) and sets `FLOTILLA_REQUIRE_NVRTC=1`, so there a missing
    /// library fails the test; elsewhere it is reported and skipped.
    #[test]
    fn kernels_compile_to_ptx_with_nvrtc() {
        let p = probe();
        if !p.nvrtc {
            let required = std::env::var_os("FLOTILLA_REQUIRE_NVRTC").is_some_and(|v| v == "1");
            assert!(
                !required,
                "FLOTILLA_REQUIRE_NVRTC=1 but libnvrtc does not load: {p:?}"
            );
            eprintln!("skipped: libnvrtc does not load ({p:?})");
            return;
        }
        for arch in TEST_ARCHS {
            let k = compile_ptx(arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(k.ptx.contains(&format!(".target {arch}")), "{arch}");
        }
        assert!(matches!(
            compile_ptx("sm_1"),
            Err(CompileError::Nvrtc { .. })
        ));
    }
}
