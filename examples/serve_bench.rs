//! Streams from a running gateway at fixed concurrency and reports TTFT, ITL, end-to-end
//! latency and output throughput, next to a single-stream run measured in the same process
//! (the baseline), so the batching gain is a ratio rather than a number from another day.
//!
//! ```text
//! cargo run --release --example serve_bench -- --gateway http://127.0.0.1:8080 \
//!     [--concurrency 32] [--max-tokens 128] [--rounds 1]
//! ```
//! Every request is a chat prompt of about 40 tokens with `ignore_eos`, so each produces
//! exactly `--max-tokens` tokens. TTFT = send → first content chunk; ITL = gaps between
//! content chunks; throughput = all output tokens ÷ wall time of the batch.

use futures::StreamExt;
use std::time::{Duration, Instant};

struct Run {
    ttft: Vec<f64>,
    itl: Vec<f64>,
    e2e: Vec<f64>,
    tokens: usize,
    wall: f64,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

async fn one(
    client: &reqwest::Client,
    url: &str,
    i: usize,
    max_tokens: usize,
) -> anyhow::Result<(f64, Vec<f64>, f64, usize)> {
    let body = serde_json::json!({
        "model": "smollm2-135m-instruct-q4_1",
        "messages": [{"role": "user", "content": format!("Request {i}: write a short story about a lighthouse keeper who finds a message in a bottle.")}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true,
    });
    let t0 = Instant::now();
    let resp = client.post(url).json(&body).send().await?;
    anyhow::ensure!(resp.status().is_success(), "status {}", resp.status());
    let mut stream = resp.bytes_stream();
    let (mut ttft, mut last, mut gaps, mut n) = (None, t0, Vec::new(), 0usize);
    let mut buf = String::new();
    while let Some(b) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&b?));
        while let Some(pos) = buf.find("\n\n") {
            let rec: String = buf.drain(..pos + 2).collect();
            if rec.contains("\"content\"") && !rec.contains("\"content\":\"\"") {
                let now = Instant::now();
                match ttft {
                    None => ttft = Some((now - t0).as_secs_f64()),
                    Some(_) => gaps.push((now - last).as_secs_f64()),
                }
                last = now;
                n += 1;
            }
        }
    }
    Ok((
        ttft.unwrap_or(f64::NAN),
        gaps,
        t0.elapsed().as_secs_f64(),
        n,
    ))
}

async fn run(gateway: &str, concurrency: usize, max_tokens: usize) -> anyhow::Result<Run> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()?;
    let url = format!("{gateway}/v1/chat/completions");
    let t0 = Instant::now();
    let results =
        futures::future::join_all((0..concurrency).map(|i| one(&client, &url, i, max_tokens)))
            .await;
    let wall = t0.elapsed().as_secs_f64();
    let mut r = Run {
        ttft: vec![],
        itl: vec![],
        e2e: vec![],
        tokens: 0,
        wall,
    };
    for x in results {
        let (t, gaps, e, n) = x?;
        r.ttft.push(t);
        r.itl.extend(gaps);
        r.e2e.push(e);
        r.tokens += n;
    }
    Ok(r)
}

fn row(label: &str, r: &mut Run) {
    println!(
        "| {label} | {:.0} / {:.0} | {:.1} / {:.1} | {:.2} | {:.1} |",
        pct(&mut r.ttft, 0.5) * 1e3,
        pct(&mut r.ttft, 0.99) * 1e3,
        pct(&mut r.itl, 0.5) * 1e3,
        pct(&mut r.itl, 0.99) * 1e3,
        pct(&mut r.e2e, 0.5),
        r.tokens as f64 / r.wall,
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let get = |k: &str, d: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| d.to_owned())
    };
    let gateway = get("--gateway", "http://127.0.0.1:8080");
    let conc: usize = get("--concurrency", "32").parse()?;
    let max_tokens: usize = get("--max-tokens", "128").parse()?;
    let rounds: usize = get("--rounds", "1").parse()?;
    // Warm up (prefix cache of the template, allocator).
    run(&gateway, 2, 4).await?;
    println!("| run | TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 s | output tok/s |");
    println!("|---|---|---|---|---|");
    let mut ratios = Vec::new();
    for k in 0..rounds {
        let mut single = run(&gateway, 1, max_tokens).await?;
        let mut many = run(&gateway, conc, max_tokens).await?;
        ratios.push((many.tokens as f64 / many.wall) / (single.tokens as f64 / single.wall));
        row(&format!("1 stream (round {})", k + 1), &mut single);
        row(&format!("{conc} streams (round {})", k + 1), &mut many);
    }
    ratios.sort_by(|a, b| a.total_cmp(b));
    println!(
        "\n{conc}-stream / 1-stream output throughput: {:.2}x (median of {rounds})",
        ratios[ratios.len() / 2]
    );
    Ok(())
}
