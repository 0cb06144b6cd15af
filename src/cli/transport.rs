//! `flotilla transport`: a peer that serves a KV region, and the transfer benchmark.
//!
//! - `flotilla transport serve` registers a region filled with a known pattern
//!   ([`pattern_word`]), prints its [`RegionDescriptor`] as one JSON line on stdout, and serves
//!   it until stdin closes. The line `reregister` makes it register fresh memory (a new epoch,
//!   the pattern of the next seed) and print the new descriptor, as a restarted replica would.
//!   Tests and the benchmark pull from it across processes.
//! - `flotilla transport bench` starts such peers (UCX with its default transports, UCX over
//!   `tcp`, the TCP backend) and reports, for block lists of 1–64 MiB in the model's KV layout,
//!   the bandwidth of each beside a plain `memcpy` of the same bytes in the same run, and the
//!   latency of a 16-block pull.

use std::io::{BufRead, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::transport::{
    BackendChoice, KvLayout, KvMemory, PullRequest, RegionDescriptor, TransferFaults, Transport,
    TransportConfig,
};

/// `flotilla transport …`
#[derive(Debug, Args)]
pub struct TransportArgs {
    #[command(subcommand)]
    cmd: TransportCmd,
}

#[derive(Debug, Subcommand)]
enum TransportCmd {
    /// Serve a patterned KV region; print its descriptor (JSON) on stdout; stop at EOF.
    Serve(ServeArgs),
    /// Transfer bandwidth and latency: UCX, UCX over tcp, the TCP backend, memcpy.
    Bench(BenchArgs),
}

/// Geometry and backend of a served region.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Owner name of the region.
    #[arg(long, default_value = "peer/replica-0")]
    pub owner: String,
    /// Layers.
    #[arg(long, default_value_t = 4)]
    pub layers: u32,
    /// Blocks in the pool.
    #[arg(long, default_value_t = 64)]
    pub blocks: u32,
    /// Bytes of one block of one layer's K or V pool.
    #[arg(long, default_value_t = 4096)]
    pub block_bytes: u64,
    /// `auto`, `ucx` or `tcp`.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// UCX transports (`UCX_TLS`).
    #[arg(long)]
    pub ucx_tls: Option<String>,
    /// Pattern seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Address of the TCP backend's server (default: any free loopback port).
    #[arg(long)]
    pub tcp_bind: Option<String>,
}

impl ServeArgs {
    fn layout(&self) -> KvLayout {
        KvLayout {
            n_layers: self.layers,
            num_blocks: self.blocks,
            block_bytes: self.block_bytes,
        }
    }
}

/// Options of `flotilla transport bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Layers of the KV layout (default: SmolLM2-135M's 30).
    #[arg(long, default_value_t = 30)]
    layers: u32,
    /// Bytes of one block of one layer's K or V pool (default: 16 tokens × 3 KV heads × 64
    /// dims × 4 B, SmolLM2-135M's f32 cache).
    #[arg(long, default_value_t = 12288)]
    block_bytes: u64,
    /// Repetitions per size (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

/// The pattern word at `index` (u64 words from the region's start) for `seed`.
pub fn pattern_word(seed: u64, index: u64) -> u64 {
    (index ^ seed.rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed
}

/// Fills `mem` with the pattern of `seed`.
pub fn fill_pattern(mem: &KvMemory, seed: u64) {
    let words = mem.len() / 8;
    let mut buf = vec![0u8; 1 << 20];
    let per = buf.len() / 8;
    let mut w = 0;
    while w < words {
        let n = per.min(words - w);
        for i in 0..n {
            buf[i * 8..i * 8 + 8]
                .copy_from_slice(&pattern_word(seed, (w + i) as u64).to_le_bytes());
        }
        // SAFETY: `mem` is not shared with anyone yet.
        let _ = unsafe { mem.write_from(w * 8, &buf[..n * 8]) };
        w += n;
    }
}

/// Checks that `local` holds, for every `(remote block, local block)` pair, the pattern `seed`
/// had at the remote block's offsets; returns the number of bytes checked.
///
/// # Errors
/// The first mismatching offset.
pub fn verify_pull(
    remote: &KvLayout,
    local_layout: &KvLayout,
    local: &KvMemory,
    pairs: &[(u32, u32)],
    seed: u64,
) -> anyhow::Result<u64> {
    let segs = remote.segments(local_layout, pairs)?;
    let mut checked = 0;
    let mut buf = Vec::new();
    for s in segs {
        buf.resize(s.len as usize, 0);
        // SAFETY: the pull has returned; nothing else writes `local`.
        unsafe { local.read_into(s.local as usize, &mut buf)? };
        for (k, chunk) in buf.chunks_exact(8).enumerate() {
            let got = u64::from_le_bytes(chunk.try_into()?);
            let want = pattern_word(seed, s.remote / 8 + k as u64);
            if got != want {
                bail!(
                    "byte {} of the remote region: {got:#x} != {want:#x}",
                    s.remote + 8 * k as u64
                );
            }
        }
        checked += s.len;
    }
    Ok(checked)
}

fn backend(s: &str) -> anyhow::Result<BackendChoice> {
    Ok(match s {
        "auto" => BackendChoice::Auto,
        "ucx" => BackendChoice::Ucx,
        "tcp" => BackendChoice::Tcp,
        other => bail!("unknown backend {other:?} (auto, ucx or tcp)"),
    })
}

/// Runs `flotilla transport …`.
///
/// # Errors
/// Whatever stops the subcommand.
pub async fn run(args: TransportArgs) -> anyhow::Result<()> {
    match args.cmd {
        TransportCmd::Serve(a) => serve(a).await,
        TransportCmd::Bench(a) => bench(a).await,
    }
}

async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let mut config = TransportConfig {
        backend: backend(&a.backend)?,
        ucx_tls: a.ucx_tls.clone(),
        ..TransportConfig::default()
    };
    if let Some(bind) = &a.tcp_bind {
        config.tcp_bind = bind.clone();
    }
    let t = Transport::start("peer", config, TransferFaults::default()).await?;
    let layout = a.layout();
    let mut seed = a.seed;
    let mut out = tokio::io::stdout();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    loop {
        let mem = t.allocate(layout).await?;
        fill_pattern(&mem, seed);
        let d = t.register(&a.owner, layout, mem).await?;
        let line = serde_json::to_string(&d)? + "\n";
        out.write_all(line.as_bytes()).await?;
        out.flush().await?;
        match lines.next_line().await? {
            Some(l) if l.trim() == "reregister" => seed += 1,
            _ => return Ok(()),
        }
    }
}

/// A `flotilla transport serve` child process.
pub struct Peer {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    /// Its current descriptor.
    pub descriptor: RegionDescriptor,
}

impl Peer {
    /// Starts `exe transport serve` with `args` and reads its first descriptor.
    ///
    /// # Errors
    /// When the process does not start or prints no descriptor.
    pub fn spawn(exe: &std::path::Path, args: &ServeArgs) -> anyhow::Result<Self> {
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["transport", "serve", "--owner", &args.owner])
            .args(["--layers", &args.layers.to_string()])
            .args(["--blocks", &args.blocks.to_string()])
            .args(["--block-bytes", &args.block_bytes.to_string()])
            .args(["--backend", &args.backend])
            .args(["--seed", &args.seed.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if std::env::var_os("UCX_LOG_FILE").is_none() {
            // UCX logs to stdout by default, where the peer's descriptors go.
            cmd.env("UCX_LOG_FILE", "/dev/stderr");
        }
        if let Some(tls) = &args.ucx_tls {
            cmd.args(["--ucx-tls", tls]);
        }
        if let Some(bind) = &args.tcp_bind {
            cmd.args(["--tcp-bind", bind]);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", exe.display()))?;
        let stdin = child.stdin.take();
        let stdout = std::io::BufReader::new(child.stdout.take().context("no stdout")?);
        let mut p = Self {
            child,
            stdin,
            stdout,
            descriptor: RegionDescriptor {
                id: crate::transport::RegionId {
                    owner: String::new(),
                    epoch: 0,
                },
                layout: args.layout(),
                tcp: String::new(),
                ucx: None,
                memory: Default::default(),
            },
        };
        p.descriptor = p.read_descriptor()?;
        Ok(p)
    }

    fn read_descriptor(&mut self) -> anyhow::Result<RegionDescriptor> {
        // UCX may log to stdout too (`UCX_LOG_LEVEL`): the descriptor is the line that is JSON.
        loop {
            let mut line = String::new();
            if self.stdout.read_line(&mut line)? == 0 {
                bail!("the peer exited before printing its descriptor");
            }
            if line.starts_with('{') {
                return serde_json::from_str(line.trim())
                    .with_context(|| format!("peer printed {line:?}"));
            }
        }
    }

    /// Makes the peer register fresh memory (next seed, new epoch); returns the new descriptor.
    ///
    /// # Errors
    /// When the peer is gone.
    pub fn reregister(&mut self) -> anyhow::Result<RegionDescriptor> {
        let stdin = self.stdin.as_mut().context("stdin closed")?;
        stdin.write_all(b"reregister\n")?;
        stdin.flush()?;
        self.descriptor = self.read_descriptor()?;
        Ok(self.descriptor.clone())
    }

    /// The peer's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILLs the peer and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stdin.take();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn bench(a: BenchArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let per_block = 2 * a.layers as u64 * a.block_bytes;
    let sizes_mib = [1u64, 4, 16, 64];
    let max_blocks = (64u64 << 20).div_ceil(per_block) as u32;
    let layout = KvLayout {
        n_layers: a.layers,
        num_blocks: max_blocks + 16,
        block_bytes: a.block_bytes,
    };
    let serve = |backend: &str, tls: Option<&str>| ServeArgs {
        owner: "peer/replica-0".into(),
        layers: a.layers,
        blocks: layout.num_blocks,
        block_bytes: a.block_bytes,
        backend: backend.into(),
        ucx_tls: tls.map(str::to_owned),
        seed: 1,
        tcp_bind: None,
    };
    let configs: [(&str, &str, Option<&str>); 3] = [
        ("ucx (default transports)", "ucx", None),
        ("ucx (UCX_TLS=tcp)", "ucx", Some("tcp")),
        ("tcp backend", "tcp", None),
    ];
    println!(
        "KV layout: {} layers × K,V × {} B per block = {:.0} KiB per block; {} reps, median",
        a.layers,
        a.block_bytes,
        per_block as f64 / 1024.0,
        a.reps
    );
    let mut table: Vec<(String, Vec<f64>, f64)> = Vec::new();
    // memcpy baseline: the same runs copied between two local regions.
    {
        let src = KvMemory::zeroed(layout.region_bytes() as usize)?;
        fill_pattern(&src, 1);
        let dst = KvMemory::zeroed(layout.region_bytes() as usize)?;
        let mut row = Vec::new();
        let mut buf = Vec::new();
        for mib in sizes_mib {
            let n = (mib << 20).div_ceil(per_block) as u32;
            let pairs: Vec<(u32, u32)> = (0..n).map(|b| (b, b + 1)).collect();
            let segs = layout.segments(&layout, &pairs)?;
            let bytes: u64 = segs.iter().map(|s| s.len).sum();
            let mut times = Vec::new();
            for _ in 0..a.reps {
                let t0 = Instant::now();
                for s in &segs {
                    buf.resize(s.len as usize, 0);
                    // SAFETY: both regions are private to this loop. (Through a bounce buffer
                    // costs a second copy; a direct copy is what a memcpy baseline means:)
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr().add(s.remote as usize),
                            dst.as_ptr().add(s.local as usize),
                            s.len as usize,
                        )
                    };
                }
                times.push(t0.elapsed().as_secs_f64());
            }
            row.push(bytes as f64 / median(times) / 1e9);
        }
        table.push(("memcpy (same process)".into(), row, f64::NAN));
    }
    for (name, backend_name, tls) in configs {
        let args = serve(backend_name, tls);
        let mut peer = match Peer::spawn(&exe, &args) {
            Ok(p) => p,
            Err(e) => {
                println!("{name}: skipped ({e:#})");
                continue;
            }
        };
        let config = TransportConfig {
            backend: backend(backend_name)?,
            ucx_tls: tls.map(str::to_owned),
            ..TransportConfig::default()
        };
        let t = match Transport::start("bench", config, TransferFaults::default()).await {
            Ok(t) => t,
            Err(e) => {
                println!("{name}: skipped ({e})");
                continue;
            }
        };
        let local = t.allocate(layout).await?;
        t.register("bench/replica-0", layout, local.clone()).await?;
        let pull = |pairs: Vec<(u32, u32)>| PullRequest {
            from: peer.descriptor.clone(),
            into: "bench/replica-0".into(),
            blocks: pairs,
            deadline: Instant::now() + Duration::from_secs(60),
        };
        let mut row = Vec::new();
        for mib in sizes_mib {
            let n = (mib << 20).div_ceil(per_block) as u32;
            let pairs: Vec<(u32, u32)> = (0..n).map(|b| (b, b + 1)).collect();
            let mut times = Vec::new();
            let mut bytes = 0;
            for _ in 0..a.reps {
                let s = t.pull(pull(pairs.clone())).await?;
                bytes = s.bytes;
                times.push(s.elapsed.as_secs_f64());
            }
            verify_pull(&layout, &layout, &local, &pairs, 1)?;
            row.push(bytes as f64 / median(times) / 1e9);
        }
        let pairs: Vec<(u32, u32)> = (0..16).map(|b| (b, b + 1)).collect();
        let mut lat = Vec::new();
        for _ in 0..(a.reps * 4).max(20) {
            lat.push(t.pull(pull(pairs.clone())).await?.elapsed.as_secs_f64());
        }
        table.push((name.into(), row, median(lat) * 1e3));
        peer.kill();
    }
    let base = table[0].1.clone();
    print!("{:<26}", "GB/s (× memcpy)");
    for mib in sizes_mib {
        print!(" {:>16}", format!("{mib} MiB"));
    }
    println!(" {:>14}", "16 blocks, ms");
    for (name, row, lat) in &table {
        print!("{name:<26}");
        for (i, v) in row.iter().enumerate() {
            print!(" {:>16}", format!("{v:.2} ({:.2}×)", v / base[i]));
        }
        if lat.is_nan() {
            println!(" {:>14}", "-");
        } else {
            println!(" {lat:>14.2}");
        }
    }
    Ok(())
}
