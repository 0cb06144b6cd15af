//! Gateway throughput: how many requests per second the door (HTTP, validation, admission,
//! placement, the request actor, token delivery) turns around when the engine costs next to
//! nothing. Run it against a cluster of sim engines with a large `worker.sim_speedup`, so what
//! is measured is the gateway and the request plane, not the model — or against any other
//! OpenAI-compatible gateway (`--model`), e.g. NVIDIA Dynamo's frontend over its mocker.
//!
//! ```text
//! cargo run --example gateway_bench -- --gateway http://127.0.0.1:18080 \
//!     [--concurrency 32,128] [--seconds 10] [--warmup 2] \
//!     [--stream --max-tokens 64 --prompt-tokens 512] [--fresh-connections] [--model NAME]
//! ```
//! `--gateway URL1,URL2,…` spreads the clients over several gateways (client `i` to gateway
//! `i mod N`; `flotilla up --gateways N` serves them on consecutive ports).
//!
//! Closed loop: `C` clients each send a request, wait for the whole answer and send the next.
//! - Default: a non-streaming chat completion with `max_tokens: 1`.
//! - `--stream`: a streamed `/v1/completions` request with a token-id prompt of
//!   `--prompt-tokens` ids (distinct per request from its first id, so no prefix is shared)
//!   and `--max-tokens` tokens (`ignore_eos`).
//!
//! Printed per concurrency: completed requests per second (200s with a sound stream only),
//! streamed tokens per second (`--stream`), shed or failed answers, TTFT p50 / p99 (ms,
//! `--stream`) and latency p50 / p99 (ms, send → end of the answer). `--fresh-connections`
//! opens a connection per request (a server without TCP_NODELAY can stall a reused one on a
//! delayed ACK). `scripts/gateway-bench.sh` runs builds side by side, in one run.

use flotilla::cli::client::{Route, percentile, stream_request};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone)]
struct Args {
    gateway: String,
    concurrency: Vec<usize>,
    seconds: f64,
    warmup: f64,
    model: String,
    stream: bool,
    max_tokens: u32,
    prompt_tokens: u32,
    fresh_connections: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        gateway: "http://127.0.0.1:18080".into(),
        concurrency: vec![32, 128],
        seconds: 10.0,
        warmup: 2.0,
        model: "smollm2-135m-instruct-q4_1".into(),
        stream: false,
        max_tokens: 1,
        prompt_tokens: 512,
        fresh_connections: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--gateway" => a.gateway = value()?,
            "--concurrency" => {
                a.concurrency = value()?
                    .split(',')
                    .map(|c| c.trim().parse())
                    .collect::<Result<_, _>>()?
            }
            "--seconds" => a.seconds = value()?.parse()?,
            "--warmup" => a.warmup = value()?.parse()?,
            "--model" => a.model = value()?,
            "--max-tokens" => a.max_tokens = value()?.parse()?,
            "--prompt-tokens" => a.prompt_tokens = value()?.parse()?,
            "--stream" => a.stream = true,
            "--fresh-connections" => a.fresh_connections = true,
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    tokens: AtomicU64,
}

/// Latencies of one client's recorded requests (ms).
#[derive(Default)]
struct Samples {
    latency: Vec<f64>,
    ttft: Vec<f64>,
}

/// Client `id`'s gateway: the `id mod N`-th of the comma-separated `--gateway` list.
fn gateway(a: &Args, id: usize) -> &str {
    let list: Vec<&str> = a.gateway.split(',').map(str::trim).collect();
    list[id % list.len()].trim_end_matches('/')
}

/// Sends one request; `Some((ttft ms, tokens))` when it succeeded.
async fn one(http: &reqwest::Client, a: &Args, id: usize, n: usize) -> Option<(Option<f64>, u64)> {
    if a.stream {
        // Distinct first id per request: nothing is shared, every prompt is prefilled.
        let first = 1000 + ((id * 7919 + n) % 40_000) as u32;
        let prompt: Vec<u32> = (0..a.prompt_tokens).map(|i| first + i % 97).collect();
        let body = serde_json::json!({
            "model": a.model,
            "prompt": prompt,
            "max_tokens": a.max_tokens,
            "ignore_eos": true,
        });
        let base = gateway(a, id);
        let o = stream_request(http, base, Route::Completions, body, &[])
            .await
            .ok()?;
        o.is_complete().then(|| {
            let ttft = o.ttft.map(|t| t.as_secs_f64() * 1e3);
            (
                ttft,
                o.completion_tokens.unwrap_or(o.chunk_times.len() as u64),
            )
        })
    } else {
        let body = serde_json::json!({
            "model": a.model,
            "messages": [{"role": "user", "content": format!("client {id} request {n}: say hi")}],
            "max_tokens": 1,
        });
        let url = format!("{}/v1/chat/completions", gateway(a, id));
        let r = http.post(&url).json(&body).send().await.ok()?;
        let status = r.status();
        (r.bytes().await.is_ok() && status.is_success()).then_some((None, 1))
    }
}

async fn client(
    http: reqwest::Client,
    a: Arc<Args>,
    id: usize,
    record: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> Samples {
    let mut out = Samples::default();
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let t = Instant::now();
        let answer = one(&http, &a, id, n).await;
        if !record.load(Ordering::Relaxed) {
            continue;
        }
        match answer {
            Some((ttft, tokens)) => {
                tally.ok.fetch_add(1, Ordering::Relaxed);
                tally.tokens.fetch_add(tokens, Ordering::Relaxed);
                out.latency.push(t.elapsed().as_secs_f64() * 1e3);
                out.ttft.extend(ttft);
            }
            None => {
                tally.failed.fetch_add(1, Ordering::Relaxed);
                // A shed answer comes back at once; do not spin on it.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    out
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Arc::new(parse_args()?);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(if a.fresh_connections { 0 } else { 1024 })
        .tcp_nodelay(true)
        .build()?;
    println!("concurrency  req/s    tok/s     failed  ttft_p50  ttft_p99  p50_ms  p99_ms");
    for &c in &a.concurrency {
        let record = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let tasks: Vec<_> = (0..c)
            .map(|i| {
                tokio::spawn(client(
                    http.clone(),
                    a.clone(),
                    i,
                    record.clone(),
                    stop.clone(),
                    tally.clone(),
                ))
            })
            .collect();
        tokio::time::sleep(Duration::from_secs_f64(a.warmup)).await;
        record.store(true, Ordering::Relaxed);
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs_f64(a.seconds)).await;
        record.store(false, Ordering::Relaxed);
        let wall = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        let (mut lat, mut ttft) = (Vec::new(), Vec::new());
        for t in tasks {
            let s = t.await?;
            lat.extend(s.latency);
            ttft.extend(s.ttft);
        }
        let ok = tally.ok.load(Ordering::Relaxed);
        println!(
            "{c:>11}  {:>7.1}  {:>8.0}  {:>6}  {:>8.1}  {:>8.1}  {:>6.1}  {:>6.1}",
            ok as f64 / wall,
            tally.tokens.load(Ordering::Relaxed) as f64 / wall,
            tally.failed.load(Ordering::Relaxed),
            percentile(&ttft, 0.50),
            percentile(&ttft, 0.99),
            percentile(&lat, 0.50),
            percentile(&lat, 0.99),
        );
    }
    Ok(())
}
