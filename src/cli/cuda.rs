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
//! batch whose every sequence gets the tokens it gets alone, and a KV handoff through the
//! transport ([`kv_handoff`]: device pools staged through host memory, GPU → GPU and GPU →
//! CPU, greedy continuations equal). `--bench`: device-to-device copy
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
        score: Vec::new(),
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
    // KV pools in device memory through the transport: GPU → GPU and GPU → CPU.
    let dsts = [gpu(GemmPrecision::F32), Device::Cpu];
    match kv_handoff(model, gpu(GemmPrecision::F32), &dsts, &base, 16) {
        Ok(handoffs) => {
            for h in handoffs {
                let ok = h.equal == h.n;
                failed += usize::from(!ok);
                println!("{} kv handoff {h}", if ok { "PASS" } else { "FAIL" });
            }
        }
        Err(e) => {
            failed += 1;
            println!("FAIL kv handoff: {e:#}");
        }
    }
    Ok(failed)
}

/// What [`kv_handoff`] saw for one destination.
#[derive(Debug, Clone)]
pub struct Handoff {
    /// The source and destination engines (`EngineInfo::device`).
    pub src: String,
    pub dst: String,
    /// Where each pool lives, as the transport described it.
    pub src_memory: crate::transport::MemoryKind,
    pub dst_memory: crate::transport::MemoryKind,
    /// Whether UCX registered the source region (else it is served over TCP).
    pub src_ucx: bool,
    /// Bytes the pull moved.
    pub bytes: u64,
    /// Greedy tokens decoded at the destination equal to the source's own, of `n`.
    pub equal: usize,
    pub n: usize,
}

impl std::fmt::Display for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}{}) -> {} ({}): {} bytes over tcp, {}/{} greedy tokens equal",
            self.src,
            self.src_memory,
            if self.src_ucx { ", ucx-registered" } else { "" },
            self.dst,
            self.dst_memory,
            self.bytes,
            self.equal,
            self.n
        )
    }
}

/// KV blocks handed between engines through the node transport: prefills `prompt` on an engine
/// on `src`, pulls its blocks (to other block ids) over the TCP backend into an engine on each
/// of `dsts` (device pools are staged through host memory: `kv/memory.rs`, "Memory
/// kinds"), then decodes `n` greedy tokens there from the pulled KV alone and compares them
/// with the source's own continuation. Finally drops the source engine and checks that a pull
/// from its still-registered region fails instead of reading freed memory.
///
/// # Errors
/// An engine or the transport fails, or the pull from the dropped engine succeeds.
pub fn kv_handoff(
    model: &LoadedModel,
    src: Device,
    dsts: &[Device],
    prompt: &[u32],
    n: usize,
) -> anyhow::Result<Vec<Handoff>> {
    use crate::transport::{
        BackendChoice, PullRequest, TransferFaults, Transport, TransportConfig,
    };
    anyhow::ensure!(
        !prompt.is_empty() && n > 0 && !dsts.is_empty(),
        "an empty prompt, no tokens or no destination"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let tcp_only = TransportConfig {
        backend: BackendChoice::Tcp,
        ..TransportConfig::default()
    };
    let transport = rt.block_on(Transport::start(
        "check",
        tcp_only,
        TransferFaults::default(),
    ))?;
    let bs = crate::model::kv_cache::DEFAULT_BLOCK_SIZE;
    let per = (prompt.len() + n).div_ceil(bs);
    let config = |device| EngineConfig {
        num_blocks: 2 * per,
        device,
        ..EngineConfig::default()
    };
    let register = |e: &Engine, owner: &str| {
        let memory = e
            .kv_memory()
            .ok_or_else(|| anyhow::anyhow!("{} offers no KV memory", e.info().device))?;
        let layout = Engine::layout(e.weights(), config(Device::Cpu));
        anyhow::Ok(rt.block_on(transport.register(owner, layout, memory))?)
    };
    let table =
        |from: usize| -> Vec<BlockId> { (from..from + per).map(|b| BlockId(b as u32)).collect() };
    let decode = |e: &mut Engine, first: u32, table: &[BlockId]| -> anyhow::Result<Vec<u32>> {
        let mut ids = vec![first];
        while ids.len() < n {
            let pos = prompt.len() + ids.len() - 1;
            let last = ids[ids.len() - 1];
            let o = e.step(&StepBatch {
                seqs: vec![seq(1, vec![last], pos, table)],
            })?;
            ids.push(o.tokens.first().map_or(0, |t| t.token));
        }
        Ok(ids)
    };
    let mut source = Engine::new(Arc::clone(&model.weights), config(src))?;
    let logits = source
        .logits(&StepBatch {
            seqs: vec![seq(1, prompt.to_vec(), 0, &table(0))],
        })?
        .remove(0);
    let first = crate::kernels::sample::argmax(&logits);
    let from = register(&source, "check/src")?;
    let prompt_blocks = prompt.len().div_ceil(bs) as u32;
    let pairs: Vec<(u32, u32)> = (0..prompt_blocks).map(|b| (b, per as u32 + b)).collect();
    let pull = |into: &str, from: &crate::transport::RegionDescriptor| {
        rt.block_on(transport.pull(PullRequest {
            from: from.clone(),
            into: into.to_owned(),
            blocks: pairs.clone(),
            deadline: Instant::now() + std::time::Duration::from_secs(30),
        }))
    };
    let mut dst_engines = Vec::new();
    let mut out = Vec::new();
    for (i, &device) in dsts.iter().enumerate() {
        let owner = format!("check/dst-{i}");
        let e = Engine::new(Arc::clone(&model.weights), config(device))?;
        let d = register(&e, &owner)?;
        let stats = pull(&owner, &from)?;
        out.push(Handoff {
            src: source.info().device.to_string(),
            dst: e.info().device.to_string(),
            src_memory: from.memory,
            dst_memory: d.memory,
            src_ucx: from.ucx.is_some(),
            bytes: stats.bytes,
            equal: 0,
            n,
        });
        dst_engines.push(e);
    }
    // The source's own continuation, after the pulls (decoding writes its blocks).
    let want = decode(&mut source, first, &table(0))?;
    for (h, e) in out.iter_mut().zip(&mut dst_engines) {
        let got = decode(e, first, &table(per))?;
        h.equal = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
    }
    drop(source);
    anyhow::ensure!(
        pull("check/dst-0", &from).is_err(),
        "a pull from a dropped engine's region succeeded"
    );
    Ok(out)
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
