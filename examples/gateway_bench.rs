//! Gateway throughput on 1-token requests: how many requests per second the door (HTTP,
//! validation, admission, placement, the request actor, token delivery) turns around when the
//! engine costs next to nothing. Run it against a cluster of sim engines with a large
//! `worker.sim_speedup`, so what is measured is the gateway and the request plane, not the model.
//!
//! ```text
//! cargo run --example gateway_bench -- --gateway http://127.0.0.1:18080 \
//!     [--concurrency 32,128] [--seconds 10] [--warmup 2]
//! ```
//! Closed loop: `C` clients each send a non-streaming chat completion with `max_tokens: 1`,
//! wait for the answer and send the next. Printed per concurrency: completed requests per
//! second (200s only), shed or failed answers, and latency p50 / p99 (ms, send → full body).
//! `scripts/gateway-bench.sh` runs two builds side by side, in one run, and prints the ratio.

use flotilla::cli::client::percentile;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

struct Args {
    gateway: String,
    concurrency: Vec<usize>,
    seconds: f64,
    warmup: f64,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        gateway: "http://127.0.0.1:18080".into(),
        concurrency: vec![32, 128],
        seconds: 10.0,
        warmup: 2.0,
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
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
}

async fn client(
    http: reqwest::Client,
    url: String,
    id: usize,
    record: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> Vec<f64> {
    let mut latencies = Vec::new();
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let body = serde_json::json!({
            "model": "smollm2-135m-instruct-q4_1",
            "messages": [{"role": "user", "content": format!("client {id} request {n}: say hi")}],
            "max_tokens": 1,
        });
        let t = Instant::now();
        let ok = match http.post(&url).json(&body).send().await {
            Ok(r) => {
                let status = r.status();
                r.bytes().await.is_ok() && status.is_success()
            }
            Err(_) => false,
        };
        if !record.load(Ordering::Relaxed) {
            continue;
        }
        if ok {
            tally.ok.fetch_add(1, Ordering::Relaxed);
            latencies.push(t.elapsed().as_secs_f64() * 1e3);
        } else {
            tally.failed.fetch_add(1, Ordering::Relaxed);
            // A shed answer comes back at once; do not spin on it.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    latencies
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = parse_args()?;
    let url = format!("{}/v1/chat/completions", a.gateway.trim_end_matches('/'));
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()?;
    println!("concurrency  req/s    failed  p50_ms  p99_ms");
    for &c in &a.concurrency {
        let record = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let tasks: Vec<_> = (0..c)
            .map(|i| {
                tokio::spawn(client(
                    http.clone(),
                    url.clone(),
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
        let mut lat = Vec::new();
        for t in tasks {
            lat.extend(t.await?);
        }
        let ok = tally.ok.load(Ordering::Relaxed);
        println!(
            "{c:>11}  {:>7.1}  {:>6}  {:>6.1}  {:>6.1}",
            ok as f64 / wall,
            tally.failed.load(Ordering::Relaxed),
            percentile(&lat, 0.50),
            percentile(&lat, 0.99),
        );
    }
    Ok(())
}
