//! Engine throughput next to the memory-bandwidth bound, measured interleaved in one run.
//!
//! `cargo run --example engine_bench [-- ROUNDS] [--llama-bench PATH]`: per round, measures
//! (1) read bandwidth of a 1 GiB buffer with all rayon threads, (2) prefill of a 512-token
//! prompt, (3) decode at batch 1, 8 and 32 (greedy, 32 steps after a 16-token prefill per
//! sequence), and, with `--llama-bench`, (4) llama.cpp's `llama-bench -t 2 -p 512 -n 128` on
//! the same GGUF file in the same round (build it as `../shared/BASELINES.md` says; it is
//! never part of CI). Prints the median of each row over the rounds as a Markdown table, then
//! the ratios to llama.cpp.

use std::sync::Arc;
use std::time::Instant;

use flotilla::cli::cuda::{decode_tps, prefill_tps};
use flotilla::model::{load_model, resolve_model_path};
use flotilla::worker::engine::{Engine, EngineConfig};
use rayon::prelude::*;

fn bandwidth_gbs(buf: &[u64]) -> f64 {
    let t = Instant::now();
    let s: u64 = buf
        .par_chunks(1 << 16)
        .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
        .reduce(|| 0, u64::wrapping_add);
    let dt = t.elapsed().as_secs_f64();
    std::hint::black_box(s);
    (buf.len() * 8) as f64 / dt / 1e9
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One `llama-bench` run: (pp512 tok/s, tg128 tok/s).
fn llama_bench(bin: &str, model: &std::path::Path) -> anyhow::Result<(f64, f64)> {
    let out = std::process::Command::new(bin)
        .args([
            "-t", "2", "-p", "512", "-n", "128", "-r", "2", "-o", "json", "-m",
        ])
        .arg(model)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "llama-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let mut pp = f64::NAN;
    let mut tg = f64::NAN;
    for r in v.as_array().into_iter().flatten() {
        let ts = r["avg_ts"].as_f64().unwrap_or(f64::NAN);
        if r["n_prompt"].as_u64() == Some(512) && r["n_gen"].as_u64() == Some(0) {
            pp = ts;
        }
        if r["n_gen"].as_u64() == Some(128) && r["n_prompt"].as_u64() == Some(0) {
            tg = ts;
        }
    }
    Ok((pp, tg))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3);
    let llama = args
        .iter()
        .position(|a| a == "--llama-bench")
        .and_then(|i| args.get(i + 1).cloned());
    let model_path = resolve_model_path(None)?;
    let model = load_model(&model_path)?;
    // The CPU kernels' crossover is measured once per process (~0.1–0.2 s), at a node's start;
    // here too, before anything is timed, and printed.
    eprintln!(
        "cpu kernels: {}",
        flotilla::kernels::cpu::matmul::crossover()
    );
    let bytes_per_step = model.weights.bytes_per_decode_step();
    let mut e = Engine::new(
        Arc::clone(&model.weights),
        EngineConfig {
            num_blocks: 32 * 4 + 40,
            ..Default::default()
        },
    )?;
    let text = "The history of the printing press begins in the fifteenth century, when movable type changed how books were made and read across Europe. ".repeat(30);
    let ids = model.tokenizer.encode(&text)?;
    let p512 = &ids[..512];
    let p16 = &ids[..16];
    let names = [
        "bandwidth GB/s",
        "decode bound tok/s",
        "prefill 512 tok/s",
        "decode b=1 tok/s",
        "decode b=8 tok/s",
        "decode b=32 tok/s",
        "llama.cpp pp512 tok/s",
        "llama.cpp tg128 tok/s",
    ];
    let mut rows: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let buf: Vec<u64> = (0..(1u64 << 27)).collect();
    for r in 0..rounds {
        let bw = bandwidth_gbs(&buf);
        rows[0].push(bw);
        rows[1].push(bw * 1e9 / bytes_per_step as f64);
        rows[2].push(prefill_tps(&mut e, p512)?);
        rows[3].push(decode_tps(&mut e, p16, 1, 32)?);
        rows[4].push(decode_tps(&mut e, p16, 8, 32)?);
        rows[5].push(decode_tps(&mut e, p16, 32, 32)?);
        if let Some(bin) = &llama {
            let (pp, tg) = llama_bench(bin, &model_path)?;
            rows[6].push(pp);
            rows[7].push(tg);
        }
        eprintln!(
            "round {r}: {:?}",
            rows.iter()
                .map(|v| v.last().copied().unwrap_or(0.0))
                .collect::<Vec<_>>()
        );
    }
    println!(
        "weights read per decode step: {:.1} MB; threads: {}; kernels: {:?}",
        bytes_per_step as f64 / 1e6,
        rayon::current_num_threads(),
        flotilla::kernels::cpu::matmul::isa()
    );
    // Per-round ratios (same round, same machine state), taken before the rows are sorted.
    let ratio = |a: usize, b: usize| {
        let mut r: Vec<f64> = rows[a].iter().zip(&rows[b]).map(|(x, y)| x / y).collect();
        if r.is_empty() {
            f64::NAN
        } else {
            median(&mut r)
        }
    };
    let ratios = [ratio(3, 7), ratio(5, 7), ratio(2, 6)];
    println!("| metric | median of {rounds} | all rounds |\n|---|---|---|");
    for (n, v) in names.iter().zip(rows.iter_mut()) {
        if v.is_empty() {
            continue;
        }
        let all: Vec<String> = v.iter().map(|x| format!("{x:.1}")).collect();
        println!("| {n} | {:.1} | {} |", median(v), all.join(", "));
    }
    if llama.is_some() {
        println!("\nratios (median of per-round ratios):");
        println!("- decode b=1 / llama.cpp tg128: {:.2}x", ratios[0]);
        println!(
            "- decode b=32 aggregate / llama.cpp tg128: {:.2}x",
            ratios[1]
        );
        println!("- prefill 512 / llama.cpp pp512: {:.2}x", ratios[2]);
    }
    Ok(())
}
