//! `flotilla cuda`: what this machine can use of CUDA, the kernels compiled with NVRTC, and on
//! a GPU the device check (`--check`) and the throughput table (`--bench`).
//!
//! Prints which libraries load (`libcuda`, `libnvrtc`, `libcublas`, found by name through
//! `LD_LIBRARY_PATH`), then compiles `src/kernels/cuda/kernels.cu` for each `--arch` and lists
//! the PTX size. Compiling needs only `libnvrtc` (no driver, no GPU): `make test` fetches it
//! from the `nvidia-cuda-nvrtc-cu12` wheel (`scripts/fetch-nvrtc.sh`). `--ptx-out DIR` writes
//! the PTX, which a GPU machine without NVRTC loads through `$FLOTILLA_CUDA_PTX_DIR`.
//!
//! `--check` (needs a GPU): the golden cases on the GPU engine (greedy ids exact, step 0's
//! top-5 logits within 2e-2, f32 products; the bf16 error is reported), and a 64-sequence
//! batch whose every sequence gets the tokens it gets alone. `--bench`: device-to-device copy
//! bandwidth, prefill of 512 tokens and decode at batch 1, 8, 32 and 128 (tokens/s), on the GPU
//! (f32 and bf16 products) and on this machine's CPU engine, in the same run.
//! `scripts/gpu-check.sh` runs all of it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;

use crate::kernels::Device;
use crate::kernels::cuda::{self, GemmPrecision};
use crate::model::{LoadedModel, load_model, resolve_model_path};
use crate::runtime::ids::{BlockId, SeqId};
use crate::worker::engine::{Engine, EngineConfig, SamplingParams, StepBatch, StepSeq};

/// Options of `flotilla cuda`.
#[derive(clap::Args, Debug, Clone)]
pub struct CudaArgs {
    /// GPU architectures to compile the kernels for (repeatable).
    #[arg(long = "arch", default_values_t = cuda::TEST_ARCHS.iter().map(|s| s.to_string()))]
    pub archs: Vec<String>,
    /// Write each architecture's PTX to `DIR/flotilla-<arch>.ptx`.
    #[arg(long)]
    pub ptx_out: Option<PathBuf>,
    /// Run the device check on GPU 0 (golden cases, batch against solo runs).
    #[arg(long)]
    pub check: bool,
    /// Print the throughput table (GPU and CPU engines, copy bandwidth).
    #[arg(long)]
    pub bench: bool,
    /// Golden cases for `--check` (default: the repository's fixture,
    /// `tests/data/smollm2-golden.json` under the current directory or the source tree).
    #[arg(long)]
    pub golden: Option<PathBuf>,
    /// Model (default: `FLOTILLA_MODEL`, else the default model).
    #[arg(long, env = "FLOTILLA_MODEL")]
    pub model: Option<PathBuf>,
}

/// Runs `flotilla cuda`.
///
/// # Errors
/// When a kernel does not compile, NVRTC is missing, or a requested check fails; the library
/// report is printed first.
pub fn run(a: CudaArgs) -> anyhow::Result<()> {
    let p = cuda::probe();
    println!("cuda feature built: {}", p.built);
    println!("libcuda (driver):   {}", p.driver);
    println!("libnvrtc:           {}", p.nvrtc);
    println!("libcublas:          {}", p.cublas);
    println!("GPUs:               {}", cuda::device_count());
    if let Some(dir) = std::env::var_os(cuda::PTX_DIR_ENV).filter(|d| !d.is_empty()) {
        println!("{}: {}", cuda::PTX_DIR_ENV, PathBuf::from(dir).display());
    }
    match cuda::select(cuda::BackendChoice::Auto) {
        Ok(s) => println!("engine backend:     {}", s.reason),
        Err(e) => println!("engine backend:     {e}"),
    }
    if !p.nvrtc && a.ptx_out.is_none() {
        println!(
            "kernels: not compiled (libnvrtc does not load; in the repository, \
             LD_LIBRARY_PATH=$(scripts/fetch-nvrtc.sh) provides it)"
        );
    } else {
        for arch in &a.archs {
            let k = cuda::compile_ptx(arch)?;
            println!(
                "{arch}: {} kernels compiled, {} bytes of PTX",
                cuda::KERNELS.len(),
                k.ptx.len()
            );
            if let Some(dir) = &a.ptx_out {
                let path = dir.join(format!("flotilla-{arch}.ptx"));
                std::fs::create_dir_all(dir)
                    .and_then(|()| std::fs::write(&path, &k.ptx))
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("  wrote {}", path.display());
            }
        }
    }
    if !(a.check || a.bench) {
        return Ok(());
    }
    // The GPU first: without one there is nothing to check or time.
    cuda::select(cuda::BackendChoice::Cuda)
        .map_err(|e| anyhow::anyhow!("--check and --bench need a GPU: {e}"))?;
    let path = resolve_model_path(a.model.as_deref())?;
    let model = load_model(&path).with_context(|| format!("loading {}", path.display()))?;
    let mut failed = 0;
    if a.check {
        let golden = a.golden.clone().unwrap_or_else(|| {
            let rel = Path::new("tests/data/smollm2-golden.json");
            [
                rel.to_path_buf(),
                Path::new(env!("CARGO_MANIFEST_DIR")).join(rel),
            ]
            .into_iter()
            .find(|p| p.exists())
            .unwrap_or_else(|| rel.to_path_buf())
        });
        failed += check(&model, &golden)?;
    }
    if a.bench {
        bench(&model)?;
    }
    anyhow::ensure!(failed == 0, "{failed} device check(s) failed");
    Ok(())
}

fn gpu(precision: GemmPrecision) -> Device {
    Device::Cuda {
        ordinal: 0,
        precision,
        cpu_fallback: false,
    }
}

fn engine(model: &LoadedModel, num_blocks: usize, device: Device) -> anyhow::Result<Engine> {
    Ok(Engine::new(
        Arc::clone(&model.weights),
        EngineConfig {
            num_blocks,
            device,
            ..EngineConfig::default()
        },
    )?)
}

fn seq(id: u64, tokens: Vec<u32>, start_pos: usize, table: &[BlockId]) -> StepSeq {
    StepSeq {
        seq_id: SeqId(id),
        tokens,
        start_pos,
        block_table: table.to_vec(),
        sampling: SamplingParams::default(),
        sample: true,
    }
}

/// Greedy: prefill `prompt` in one step, then `n - 1` decode steps. Returns (step-0 logits,
/// ids).
fn greedy(e: &mut Engine, prompt: &[u32], n: usize) -> anyhow::Result<(Vec<f32>, Vec<u32>)> {
    let table: Vec<BlockId> = (0..((prompt.len() + n) / 16 + 1) as u32)
        .map(BlockId)
        .collect();
    let logits = e
        .logits(&StepBatch {
            seqs: vec![seq(1, prompt.to_vec(), 0, &table)],
        })?
        .remove(0);
    let mut ids = vec![crate::kernels::sample::argmax(&logits)];
    while ids.len() < n {
        let pos = prompt.len() + ids.len() - 1;
        let last = *ids.last().unwrap_or(&0);
        let o = e.step(&StepBatch {
            seqs: vec![seq(1, vec![last], pos, &table)],
        })?;
        ids.push(o.tokens.first().map_or(0, |t| t.token));
    }
    Ok((logits, ids))
}

/// The device check; returns how many checks failed.
fn check(model: &LoadedModel, golden: &Path) -> anyhow::Result<usize> {
    let text =
        std::fs::read_to_string(golden).with_context(|| format!("reading {}", golden.display()))?;
    let j: serde_json::Value = serde_json::from_str(&text)?;
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect()
    };
    let mut failed = 0;
    for precision in [GemmPrecision::F32, GemmPrecision::Bf16] {
        let mut e = engine(model, 64, gpu(precision))?;
        for c in j["cases"].as_array().into_iter().flatten() {
            let name = c["name"].as_str().unwrap_or("?");
            let (prompt, want) = (ids(&c["prompt_ids"]), ids(&c["greedy_ids"]));
            let (logits, got) = greedy(&mut e, &prompt, want.len())?;
            let worst = c["step0_top5_logits"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| Some((p[0].as_u64()? as usize, p[1].as_f64()? as f32)))
                .map(|(id, l)| (logits[id] - l).abs())
                .fold(0f32, f32::max);
            let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            let ok = precision == GemmPrecision::Bf16 || (same == want.len() && worst < 2e-2);
            failed += usize::from(!ok);
            println!(
                "{} golden {name} ({precision:?}): {same}/{} greedy ids equal, top-5 logit error {worst:.4}",
                if ok { "PASS" } else { "FAIL" },
                want.len()
            );
        }
    }
    // 64 sequences of different lengths in one batch, each equal to its solo run.
    let base = ids(&j["cases"][0]["prompt_ids"]);
    let steps = 8;
    let prompts: Vec<Vec<u32>> = (0..64)
        .map(|i| {
            (0..8 + i % 23)
                .map(|k| base[(k + i) % base.len()])
                .collect()
        })
        .collect();
    let per = (prompts.iter().map(Vec::len).max().unwrap_or(0) + steps) / 16 + 1;
    let tables: Vec<Vec<BlockId>> = (0..64)
        .map(|i| (0..per).map(|b| BlockId((i * per + b) as u32)).collect())
        .collect();
    let mut batched = engine(model, 64 * per, gpu(GemmPrecision::F32))?;
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); 64];
    let mut next: Vec<StepSeq> = (0..64)
        .map(|i| seq(i as u64, prompts[i].clone(), 0, &tables[i]))
        .collect();
    for _ in 0..steps {
        let o = batched.step(&StepBatch { seqs: next })?;
        for (i, t) in o.tokens.iter().enumerate() {
            outs[i].push(t.token);
        }
        next = (0..64)
            .map(|i| {
                let pos = prompts[i].len() + outs[i].len() - 1;
                seq(i as u64, vec![outs[i][outs[i].len() - 1]], pos, &tables[i])
            })
            .collect();
    }
    let mut solo = engine(model, per, gpu(GemmPrecision::F32))?;
    let mut equal = 0;
    for (i, p) in prompts.iter().enumerate() {
        let (_, ids) = greedy(&mut solo, p, steps)?;
        equal += usize::from(ids == outs[i]);
    }
    let ok = equal == 64;
    failed += usize::from(!ok);
    println!(
        "{} batch of 64 (prompts of 8-30 tokens, {steps} tokens each): {equal}/64 equal to solo runs",
        if ok { "PASS" } else { "FAIL" }
    );
    Ok(failed)
}

/// Prefill of `prompt` in one step, tokens/s.
///
/// # Errors
/// The engine's.
pub fn prefill_tps(e: &mut Engine, prompt: &[u32]) -> anyhow::Result<f64> {
    let table: Vec<BlockId> = (0..(prompt.len() / 16 + 1) as u32).map(BlockId).collect();
    let t = Instant::now();
    e.step(&StepBatch {
        seqs: vec![seq(0, prompt.to_vec(), 0, &table)],
    })?;
    Ok(prompt.len() as f64 / t.elapsed().as_secs_f64())
}

/// Greedy decode of `batch` sequences for `steps` steps after prefilling `prompt` in each,
/// tokens/s over the decode steps. Needs `batch · ((prompt + steps) / 16 + 1)` blocks.
///
/// # Errors
/// The engine's.
pub fn decode_tps(
    e: &mut Engine,
    prompt: &[u32],
    batch: usize,
    steps: usize,
) -> anyhow::Result<f64> {
    let per = (prompt.len() + steps) / 16 + 1;
    let tables: Vec<Vec<BlockId>> = (0..batch)
        .map(|i| (0..per).map(|b| BlockId((i * per + b) as u32)).collect())
        .collect();
    let pre: Vec<StepSeq> = (0..batch)
        .map(|i| seq(i as u64, prompt.to_vec(), 0, &tables[i]))
        .collect();
    let tokens = |o: crate::worker::engine::StepOutput| -> Vec<u32> {
        o.tokens.iter().map(|t| t.token).collect()
    };
    let mut last = tokens(e.step(&StepBatch { seqs: pre })?);
    let t = Instant::now();
    for s in 0..steps {
        let seqs = (0..batch)
            .map(|i| seq(i as u64, vec![last[i]], prompt.len() + s, &tables[i]))
            .collect();
        last = tokens(e.step(&StepBatch { seqs })?);
    }
    Ok((batch * steps) as f64 / t.elapsed().as_secs_f64())
}

/// The throughput table: one row per engine, the device copy bandwidth beside it.
fn bench(model: &LoadedModel) -> anyhow::Result<()> {
    let text = "The history of the printing press begins in the fifteenth century, when movable \
                type changed how books were made and read across Europe. "
        .repeat(30);
    let ids = model.tokenizer.encode(&text)?;
    anyhow::ensure!(ids.len() >= 512, "bench prompt too short");
    let (p512, p16) = (&ids[..512], &ids[..16]);
    let batches = [1usize, 8, 32, 128];
    let steps = 32;
    let blocks = 128 * ((16 + steps) / 16 + 1) + 40;
    #[cfg(feature = "cuda")]
    {
        let ops = crate::kernels::cuda::device::CudaOps::new(0)?;
        let bw = ops.copy_bandwidth_gbs(1 << 30, 10)?;
        println!(
            "device: {} ({}); device-to-device copy of 1 GiB: {bw:.0} GB/s (read + write)",
            ops.name, ops.arch
        );
        let bytes = model.weights.bytes_per_decode_step() as f64;
        println!(
            "weights read per decode step: {:.1} MB, so decode at batch 1 is bounded by {:.0} steps/s",
            bytes / 1e6,
            bw / 2.0 * 1e9 / bytes
        );
    }
    println!(
        "\n| engine | prefill 512 tok/s | decode b=1 | b=8 | b=32 | b=128 tok/s |\n|---|---:|---:|---:|---:|---:|"
    );
    let engines = [
        ("GPU, f32 products", gpu(GemmPrecision::F32)),
        ("GPU, bf16 products", gpu(GemmPrecision::Bf16)),
        ("CPU", Device::Cpu),
    ];
    for (name, device) in engines {
        let mut e = engine(model, blocks, device)?;
        // One warm-up of each shape (kernel loading, cuBLAS heuristics, allocations).
        prefill_tps(&mut e, p512)?;
        let pre = prefill_tps(&mut e, p512)?;
        let mut row = format!("| {name} | {pre:.0} |");
        for &b in &batches {
            decode_tps(&mut e, p16, b, 2)?;
            row += &format!(" {:.0} |", decode_tps(&mut e, p16, b, steps)?);
        }
        println!("{row}");
    }
    Ok(())
}
