//! The transport across real processes: `flotilla transport serve` owns a patterned region; this
//! process pulls blocks of it into its own registered region and checks every byte. Each case
//! runs over UCX with its default transports (shared memory), UCX over `tcp`, and the TCP
//! backend. UCX cases are skipped, saying so, where `libucp.so.0` does not load (`make test`
//! installs it through `scripts/deps.sh`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla::cli::transport::{Peer, ServeArgs, verify_pull};
use flotilla::transport::{
    BackendChoice, KvLayout, PullRequest, TransferFaults, Transport, TransportConfig,
    TransportError, ucx,
};

const EXE: &str = env!("CARGO_BIN_EXE_flotilla");

/// (name, backend, UCX_TLS)
const BACKENDS: [(&str, &str, Option<&str>); 3] = [
    ("ucx", "ucx", None),
    ("ucx-tcp", "ucx", Some("tcp")),
    ("tcp", "tcp", None),
];

fn serve_args(backend: &str, tls: Option<&str>, blocks: u32) -> ServeArgs {
    ServeArgs {
        owner: "peer/replica-0".into(),
        layers: 2,
        blocks,
        block_bytes: 4096,
        backend: backend.into(),
        ucx_tls: tls.map(str::to_owned),
        seed: 11,
        tcp_bind: None,
    }
}

async fn local(
    backend: &str,
    tls: Option<&str>,
    layout: KvLayout,
) -> (Transport, Arc<flotilla::transport::KvMemory>) {
    let config = TransportConfig {
        backend: match backend {
            "ucx" => BackendChoice::Ucx,
            _ => BackendChoice::Tcp,
        },
        ucx_tls: tls.map(str::to_owned),
        ..TransportConfig::default()
    };
    let t = Transport::start("me", config, TransferFaults::default())
        .await
        .expect("transport starts");
    let mem = t.allocate(layout).await.expect("allocate");
    t.register("me/replica-0", layout, mem.clone())
        .await
        .expect("register");
    (t, mem)
}

fn skip(backend: &str) -> bool {
    if backend == "ucx" && !ucx::available() {
        eprintln!("SKIPPED: libucp.so.0 does not load here (scripts/deps.sh installs libucx-dev)");
        return true;
    }
    false
}

fn request(peer: &Peer, pairs: Vec<(u32, u32)>, within: Duration) -> PullRequest {
    PullRequest {
        from: peer.descriptor.clone(),
        into: "me/replica-0".into(),
        blocks: pairs,
        deadline: Instant::now() + within,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_of_1_64_and_4096_blocks_arrive_intact_over_every_backend() {
    for (name, backend, tls) in BACKENDS {
        if skip(backend) {
            continue;
        }
        let args = serve_args(backend, tls, 4096);
        let peer = Peer::spawn(Path::new(EXE), &args).expect("peer starts");
        let layout = KvLayout {
            num_blocks: 4100,
            ..peer.descriptor.layout
        };
        let (t, mem) = local(backend, tls, layout).await;
        assert_eq!(peer.descriptor.ucx.is_some(), backend == "ucx", "{name}");
        for n in [1u32, 64, 4096] {
            // Scattered destinations: block b lands at (b·7 + 3) mod 4099 (a bijection).
            let pairs: Vec<(u32, u32)> = (0..n).map(|b| (b, (b * 7 + 3) % 4099)).collect();
            let stats = t
                .pull(request(&peer, pairs.clone(), Duration::from_secs(60)))
                .await
                .unwrap_or_else(|e| panic!("{name}: pull of {n} blocks: {e}"));
            assert_eq!(
                stats.bytes,
                n as u64 * peer.descriptor.layout.bytes_per_block()
            );
            assert_eq!(stats.backend.to_string(), backend, "{name}");
            let checked = verify_pull(&peer.descriptor.layout, &layout, &mem, &pairs, 11)
                .unwrap_or_else(|e| panic!("{name}: {n} blocks: {e:#}"));
            assert_eq!(checked, stats.bytes);
            eprintln!(
                "{name}: {n} blocks, {} B in {:?}",
                stats.bytes, stats.elapsed
            );
        }
        assert_eq!(t.pending(), 0, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_pull_fails_the_pull_without_hang_or_leak() {
    for (name, backend, tls) in BACKENDS {
        if skip(backend) {
            continue;
        }
        let args = serve_args(backend, tls, 4096);
        let mut peer = Peer::spawn(Path::new(EXE), &args).expect("peer starts");
        let layout = peer.descriptor.layout;
        let (t, mem) = local(backend, tls, layout).await;
        let t = Arc::new(t);
        let pairs: Vec<(u32, u32)> = (0..4096).map(|b| (b, b)).collect();
        let deadline = Duration::from_secs(20);
        let started = Instant::now();
        let pull = tokio::spawn({
            let (t, req) = (t.clone(), request(&peer, pairs.clone(), deadline));
            async move { t.pull(req).await }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        peer.kill();
        let out = pull.await.expect("pull task");
        assert!(
            started.elapsed() < deadline + Duration::from_secs(5),
            "{name}: hung"
        );
        match out {
            // Over shared memory the dead peer's segments stay mapped: the read may finish,
            // and then every byte must be right.
            Ok(_) if name == "ucx" => {
                verify_pull(&layout, &layout, &mem, &pairs, 11).expect("intact");
            }
            // The pull may also have finished before the kill landed.
            Ok(_) => eprintln!("{name}: the pull finished before the peer died"),
            Err(e) => eprintln!("{name}: pull failed as expected: {e}"),
        }
        // A new pull from the dead peer fails (or, over shared memory, reads intact bytes), by
        // its deadline, and nothing stays pending.
        let again = t
            .pull(request(&peer, vec![(0, 0)], Duration::from_secs(5)))
            .await;
        if name != "ucx" {
            assert!(again.is_err(), "{name}: a pull from a dead peer succeeded");
        }
        assert!(
            started.elapsed() < deadline + Duration::from_secs(15),
            "{name}: hung"
        );
        assert_eq!(t.pending(), 0, "{name}: pulls left pending");
        assert!(
            t.counters
                .pulls_failed
                .load(std::sync::atomic::Ordering::Relaxed)
                <= 2
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_region_is_refused_after_its_owner_registers_anew() {
    for (name, backend, tls) in BACKENDS {
        if skip(backend) {
            continue;
        }
        let args = serve_args(backend, tls, 64);
        let mut peer = Peer::spawn(Path::new(EXE), &args).expect("peer starts");
        let layout = peer.descriptor.layout;
        let (t, mem) = local(backend, tls, layout).await;
        let old = peer.descriptor.clone();
        // The owner "restarts": fresh memory, a new epoch, the next seed's pattern.
        let new = peer.reregister().expect("reregister");
        assert!(new.id.epoch > old.id.epoch, "{name}: epochs grow");
        if backend == "tcp" {
            // The server itself refuses the old epoch, even before we heard of the new one.
            let req = PullRequest {
                from: old.clone(),
                ..request(&peer, vec![(0, 0)], Duration::from_secs(10))
            };
            let err = t
                .pull(req)
                .await
                .expect_err("old epoch refused by the server");
            assert!(matches!(err, TransportError::Stale(_)), "{name}: {err}");
        }
        t.learn(&new);
        let req = PullRequest {
            from: old.clone(),
            ..request(&peer, vec![(0, 0)], Duration::from_secs(10))
        };
        let err = t.pull(req).await.expect_err("stale epoch refused");
        assert!(matches!(err, TransportError::Stale(_)), "{name}: {err}");
        // The new descriptor reads the new memory.
        let pairs = vec![(5, 9), (6, 10)];
        t.pull(request(&peer, pairs.clone(), Duration::from_secs(10)))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        verify_pull(&layout, &layout, &mem, &pairs, 12).expect("the new pattern");
        assert_eq!(t.pending(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_filters_delay_drop_and_cut_pulls() {
    let args = serve_args("tcp", None, 16);
    let peer = Peer::spawn(Path::new(EXE), &args).expect("peer starts");
    let layout = peer.descriptor.layout;
    let (t, _mem) = local("tcp", None, layout).await;
    t.faults().set_delay(Some(Duration::from_millis(300)));
    let s = t
        .pull(request(&peer, vec![(0, 0)], Duration::from_secs(10)))
        .await
        .expect("delayed pull");
    assert!(s.elapsed >= Duration::from_millis(300), "{:?}", s.elapsed);
    // A delay past the deadline is a timeout, not a hang.
    let err = t
        .pull(request(&peer, vec![(0, 0)], Duration::from_millis(100)))
        .await
        .expect_err("deadline");
    assert_eq!(err, TransportError::Timeout);
    t.faults().set_delay(None);
    t.faults().set_drop(Some((1.0, 3)));
    assert!(matches!(
        t.pull(request(&peer, vec![(0, 0)], Duration::from_secs(10)))
            .await,
        Err(TransportError::Injected(_))
    ));
    t.faults().set_drop(None);
    t.faults().set_cut(&["peer".into()]);
    assert!(matches!(
        t.pull(request(&peer, vec![(0, 0)], Duration::from_secs(10)))
            .await,
        Err(TransportError::Injected(_))
    ));
    t.faults().set_cut(&[]);
    t.pull(request(&peer, vec![(0, 0)], Duration::from_secs(10)))
        .await
        .expect("healed");
    assert_eq!(t.pending(), 0);
}

/// What the TCP server answers to one raw request frame: `Some(reason)` for a refusal.
async fn raw_request(addr: &str, frame: &[u8], len_prefix: u32) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_u32_le(len_prefix).await.expect("write");
    s.write_all(frame).await.expect("write");
    match s.read_u8().await.expect("status") {
        0 => None,
        _ => {
            let n = s.read_u32_le().await.expect("len");
            let mut why = vec![0; n as usize];
            s.read_exact(&mut why).await.expect("reason");
            Some(String::from_utf8_lossy(&why).into_owned())
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_server_refuses_bad_requests_and_keeps_serving() {
    use flotilla::transport::tcp::{CHUNK_BYTES, ReadRequest};
    let args = serve_args("tcp", None, 1024); // 16 MiB: more than one chunk
    let peer = Peer::spawn(Path::new(EXE), &args).expect("peer starts");
    let d = peer.descriptor.clone();
    let region_bytes = d.layout.region_bytes();
    let frame = |runs: Vec<(u64, u64)>| {
        rmp_serde::to_vec(&ReadRequest {
            region: d.id.clone(),
            runs,
        })
        .expect("encode")
    };
    // A frame length far beyond the limit.
    let why = raw_request(&d.tcp, b"", u32::MAX).await;
    assert!(why.is_some_and(|w| w.contains("too large")));
    // Not MessagePack.
    let junk = b"not a request";
    assert!(raw_request(&d.tcp, junk, junk.len() as u32).await.is_some());
    // A run past the end, an overflowing run, more than one chunk at once.
    for runs in [
        vec![(region_bytes - 8, 16)],
        vec![(u64::MAX - 4, 8)],
        vec![(0, CHUNK_BYTES), (0, 8)],
    ] {
        let f = frame(runs.clone());
        let why = raw_request(&d.tcp, &f, f.len() as u32).await;
        assert!(why.is_some(), "{runs:?} was served");
    }
    // An unknown owner.
    let f = rmp_serde::to_vec(&ReadRequest {
        region: flotilla::transport::RegionId {
            owner: "nobody".into(),
            epoch: d.id.epoch,
        },
        runs: vec![(0, 8)],
    })
    .expect("encode");
    assert!(
        raw_request(&d.tcp, &f, f.len() as u32)
            .await
            .is_some_and(|w| w.contains("unknown"))
    );
    // A good request on a fresh connection still works, and a real pull too.
    let f = frame(vec![(0, 8)]);
    assert_eq!(raw_request(&d.tcp, &f, f.len() as u32).await, None);
    let (t, mem) = local("tcp", None, d.layout).await;
    t.pull(request(&peer, vec![(3, 4)], Duration::from_secs(10)))
        .await
        .expect("pull after the bad requests");
    verify_pull(&d.layout, &d.layout, &mem, &[(3, 4)], 11).expect("intact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transport_actor_runs_pulls_as_tasks() {
    use flotilla::transport::{TransportActor, TransportMsg};
    let args = serve_args("tcp", None, 64);
    let peer = Peer::spawn(Path::new(EXE), &args).expect("peer starts");
    let layout = peer.descriptor.layout;
    let (t, mem) = local("tcp", None, layout).await;
    let (actor, handle) = ractor::Actor::spawn(None, TransportActor, Arc::new(t))
        .await
        .expect("spawn");
    // Two pulls at once, each run by its own task.
    let pairs: Vec<(u32, u32)> = (0..32).map(|b| (b, b + 32)).collect();
    let pull = |req: PullRequest| {
        let actor = actor.clone();
        async move { ractor::call_t!(actor, TransportMsg::Pull, 30_000, Box::new(req)) }
    };
    let (a, b) = tokio::join!(
        pull(request(&peer, pairs.clone(), Duration::from_secs(20))),
        pull(request(&peer, vec![(40, 0)], Duration::from_secs(20))),
    );
    a.expect("call").expect("pull a");
    b.expect("call").expect("pull b");
    verify_pull(&layout, &layout, &mem, &pairs, 11).expect("intact");
    let regions = ractor::call_t!(actor, TransportMsg::Regions, 5_000).expect("regions");
    assert_eq!(regions.len(), 1);
    assert_eq!(
        ractor::call_t!(actor, TransportMsg::Pending, 5_000).expect("pending"),
        0
    );
    actor.stop(None);
    handle.await.expect("stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_to_a_restarted_peer_is_replaced() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let mut args = serve_args("tcp", None, 16);
    args.tcp_bind = Some(format!("127.0.0.1:{port}"));
    let mut first = Peer::spawn(Path::new(EXE), &args).expect("peer starts");
    let layout = first.descriptor.layout;
    let (t, mem) = local("tcp", None, layout).await;
    t.pull(request(&first, vec![(1, 1)], Duration::from_secs(10)))
        .await
        .expect("first pull");
    // The peer dies and comes back on the same port with new memory (the next seed).
    first.kill();
    args.seed = 12;
    let second = Peer::spawn(Path::new(EXE), &args).expect("peer restarts");
    assert_eq!(second.descriptor.tcp, first.descriptor.tcp);
    t.pull(request(&second, vec![(2, 2)], Duration::from_secs(10)))
        .await
        .expect("the pooled connection is dead; a fresh one serves");
    verify_pull(&layout, &layout, &mem, &[(2, 2)], 12).expect("the new peer's bytes");
    // The old descriptor is refused by the new server (another epoch).
    assert!(matches!(
        t.pull(request(&first, vec![(1, 1)], Duration::from_secs(10)))
            .await,
        Err(TransportError::Stale(_))
    ));
}

/// A device stand-in for staged memory: its own bytes, behind copies it counts.
#[derive(Clone, Default)]
struct FakeDevice(Arc<FakeBytes>);

#[derive(Default)]
struct FakeBytes {
    bytes: std::sync::Mutex<Vec<u8>>,
    copies: std::sync::atomic::AtomicUsize,
}

impl flotilla::transport::DeviceAccess for FakeDevice {
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), String> {
        self.0
            .copies
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let b = self.0.bytes.lock().expect("lock");
        out.copy_from_slice(&b[offset..offset + out.len()]);
        Ok(())
    }
    fn write(&self, offset: usize, data: &[u8]) -> Result<(), String> {
        self.0
            .copies
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut b = self.0.bytes.lock().expect("lock");
        b[offset..offset + data.len()].copy_from_slice(data);
        Ok(())
    }
}

/// Device memory: a region of CUDA kind that this UCX cannot map is
/// registered anyway and served over TCP, every run staged through its copies, in both
/// directions; UCX (where it runs) never gets its address. The fake device's "address" is
/// unmapped, so any dereference of it would crash the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_is_staged_through_host_copies_over_tcp() {
    use flotilla::transport::{KvMemory, MemoryKind};
    let layout = KvLayout {
        n_layers: 2,
        num_blocks: 16,
        block_bytes: 4096,
    };
    let len = layout.region_bytes() as usize;
    let backend = if ucx::available() { "ucx" } else { "tcp" };
    let (t, host) = local(backend, None, layout).await;
    let dev = FakeDevice(Arc::new(FakeBytes {
        bytes: std::sync::Mutex::new((0..len).map(|i| (i % 251) as u8).collect()),
        ..FakeBytes::default()
    }));
    let addr = std::ptr::NonNull::new(0x1000 as *mut u8).expect("non-null");
    let kind = MemoryKind::Cuda { device: 0 };
    let mem = KvMemory::staged(addr, len, kind, Box::new(dev.clone())).expect("staged");
    let d = t
        .register("me/gpu-0", layout, Arc::new(mem))
        .await
        .expect("device memory registers");
    assert_eq!(d.memory, kind);
    assert!(d.ucx.is_none(), "this UCX has no CUDA support: {d:?}");
    // Device → host: the blocks arrive as the device holds them.
    let pairs = vec![(3, 0), (4, 1), (9, 7)];
    let s = t
        .pull(PullRequest {
            from: d.clone(),
            into: "me/replica-0".into(),
            blocks: pairs.clone(),
            deadline: Instant::now() + Duration::from_secs(20),
        })
        .await
        .expect("device → host");
    assert_eq!(s.backend, flotilla::transport::Backend::Tcp);
    assert_eq!(s.bytes, 3 * layout.bytes_per_block());
    let want = dev.0.bytes.lock().expect("lock").clone();
    for seg in layout.segments(&layout, &pairs).expect("segments") {
        let mut got = vec![0u8; seg.len as usize];
        // SAFETY: no one else writes the host region during the test.
        unsafe { host.read_into(seg.local as usize, &mut got) }.expect("read");
        let r = seg.remote as usize;
        assert_eq!(got, want[r..r + seg.len as usize], "segment {seg:?}");
    }
    assert!(dev.0.copies.load(std::sync::atomic::Ordering::Relaxed) > 0);
    // Host → device: over TCP too (UCX, where it runs, does not write into staged memory).
    // SAFETY: as above.
    unsafe { host.write_from(0, &vec![0xAB; len]) }.expect("pattern");
    let own = t
        .descriptors()
        .into_iter()
        .find(|d| d.id.owner == "me/replica-0")
        .expect("host region");
    let s = t
        .pull(PullRequest {
            from: own,
            into: "me/gpu-0".into(),
            blocks: vec![(5, 2)],
            deadline: Instant::now() + Duration::from_secs(20),
        })
        .await
        .expect("host → device");
    assert_eq!(s.backend, flotilla::transport::Backend::Tcp);
    let b = dev.0.bytes.lock().expect("lock");
    for seg in layout.segments(&layout, &[(5, 2)]).expect("segments") {
        let l = seg.local as usize;
        assert!(b[l..l + seg.len as usize].iter().all(|&x| x == 0xAB));
    }
}
