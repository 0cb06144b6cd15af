//! `flotilla generate`: run the engine in-process on one prompt and print the completion.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;

use crate::model::kv_cache::DEFAULT_BLOCK_SIZE;
use crate::model::{load_model, resolve_model_path};
use crate::runtime::ids::{BlockId, SeqId};
use crate::worker::engine::{Engine, EngineConfig, SamplingParams, StepBatch, StepSeq};

/// Flags of `flotilla generate`.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// GGUF file or Hugging Face directory (default: models/smollm2-135m-instruct-q4_1.gguf).
    #[arg(long, env = "FLOTILLA_MODEL")]
    pub model: Option<PathBuf>,
    /// Prompt text. Without --chat it is tokenized as-is (special tokens such as
    /// `<|im_start|>` written in the text are recognised).
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as one user message in the model's chat template (with the
    /// generation prompt appended).
    #[arg(long)]
    pub chat: bool,
    /// Maximum number of tokens to generate (the end-of-sequence token counts).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy decoding, deterministic.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampler (random when absent).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print one JSON object `{"prompt_ids", "output_ids", "text"}` instead of the text.
    #[arg(long)]
    pub json: bool,
    /// Where the engine runs: auto (a GPU when CUDA loads and one exists, else the CPU),
    /// cpu, or cuda (an error naming what is missing when it cannot).
    #[arg(long, default_value = "auto")]
    pub backend: crate::kernels::cuda::BackendChoice,
    /// GPU prefill matrix products: f32 (the CPU's numbers) or bf16 (tensor cores).
    #[arg(long, default_value = "f32")]
    pub cuda_gemm: crate::kernels::cuda::GemmPrecision,
}

/// The engine device `--backend` asks for, with the reason on stderr.
///
/// # Errors
/// `--backend cuda` where CUDA cannot be used; `--cuda-gemm bf16` with `--backend cpu` (it
/// would do nothing; the configuration refuses the same pair).
pub fn device_for(
    backend: crate::kernels::cuda::BackendChoice,
    precision: crate::kernels::cuda::GemmPrecision,
) -> anyhow::Result<crate::kernels::Device> {
    anyhow::ensure!(
        !(backend == crate::kernels::cuda::BackendChoice::Cpu
            && precision != crate::kernels::cuda::GemmPrecision::F32),
        "--cuda-gemm bf16 has no effect with --backend cpu; use --backend auto or cuda"
    );
    let sel = crate::kernels::cuda::select(backend).map_err(anyhow::Error::msg)?;
    eprintln!("engine backend: {}", sel.reason);
    Ok(sel.device(0, precision))
}

/// Result of a generation.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    /// Generated ids, including the end-of-sequence token if one was produced.
    pub output_ids: Vec<u32>,
    /// Decoded output without end-of-sequence tokens.
    pub text: String,
}

/// Loads the model and generates (used by [`run`]; callable from tests and tools).
///
/// # Errors
/// See [`generate_streaming`].
pub fn generate(args: &GenerateArgs) -> anyhow::Result<Generation> {
    generate_streaming(args, |_| {})
}

/// Like [`generate`], calling `on_text` with each new piece of decoded text as it is produced
/// (end-of-sequence tokens are not shown).
///
/// # Errors
/// The model cannot be found or loaded, the prompt cannot be rendered or encodes
/// to no tokens, or an engine step or the decoder fails.
pub fn generate_streaming(
    args: &GenerateArgs,
    mut on_text: impl FnMut(&str),
) -> anyhow::Result<Generation> {
    let path = resolve_model_path(args.model.as_deref())?;
    let model = load_model(&path).with_context(|| format!("loading {}", path.display()))?;
    let text = if args.chat {
        model.render_user_prompt(&args.prompt)?
    } else {
        args.prompt.clone()
    };
    let tok = &model.tokenizer;
    let prompt_ids = tok.encode(&text)?;
    anyhow::ensure!(!prompt_ids.is_empty(), "the prompt encodes to zero tokens");
    let total = prompt_ids.len() + args.max_tokens;
    let num_blocks = total.div_ceil(DEFAULT_BLOCK_SIZE) + 1;
    let device = device_for(args.backend, args.cuda_gemm)?;
    let mut engine = Engine::new(
        Arc::clone(&model.weights),
        EngineConfig {
            num_blocks,
            block_size: DEFAULT_BLOCK_SIZE,
            device,
        },
    )?;
    let block_table: Vec<BlockId> = (0..num_blocks as u32).map(BlockId).collect();
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        offset: 0,
        logprobs: false,
        top_logprobs: 0,
        echo_tokens: 0,
    };
    let mut output_ids = Vec::new();
    let mut stream = tok.inner().decode_stream(false);
    let mut next = prompt_ids.clone();
    let mut pos = 0;
    while output_ids.len() < args.max_tokens {
        let batch = StepBatch {
            seqs: vec![StepSeq {
                seq_id: SeqId(0),
                tokens: next.clone(),
                start_pos: pos,
                block_table: block_table.clone(),
                sampling: sampling.clone(),
                sample: true,
                score: Vec::new(),
            }],
        };
        let out = engine.step(&batch)?;
        let t = out
            .tokens
            .first()
            .context("engine returned no token")?
            .token;
        pos += next.len();
        output_ids.push(t);
        if tok.is_eos(t) {
            break;
        }
        if let Some(piece) = stream
            .step(t)
            .map_err(|e| anyhow::anyhow!("decoding: {e}"))?
        {
            on_text(&piece);
        }
        next = vec![t];
    }
    let visible: Vec<u32> = output_ids
        .iter()
        .copied()
        .filter(|&t| !tok.is_eos(t))
        .collect();
    let text = tok.decode(&visible, false)?;
    Ok(Generation {
        prompt_ids,
        output_ids,
        text,
    })
}

/// Runs `flotilla generate`: prints the completion text, or with `--json` one JSON object.
/// Plain mode streams the text to stdout as it is generated.
///
/// # Errors
/// See [`generate_streaming`]; writing to stdout fails.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    use std::io::Write;
    if args.json {
        let g = generate(&args)?;
        println!("{}", serde_json::to_string(&g)?);
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    generate_streaming(&args, |piece| {
        // A closed stdout (e.g. `| head`) must not abort generation with a panic.
        let _ = out.write_all(piece.as_bytes()).and_then(|()| out.flush());
    })?;
    writeln!(out)?;
    Ok(())
}
