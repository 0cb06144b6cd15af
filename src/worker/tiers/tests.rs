//! The tier stores on real memory and a real file: bytes survive every hop, a damaged record
//! is refused.

use super::*;
use crate::kv::{CopyKind, SnapshotBlock};
use crate::runtime::ids::{BlockHash, SeqId, SequenceHash};

const LAYOUT: KvLayout = KvLayout {
    n_layers: 3,
    num_blocks: 8,
    block_bytes: 64,
};

/// G1 with every byte set from its offset (distinct per block, layer and K/V).
fn g1() -> Arc<KvMemory> {
    let m = KvMemory::zeroed(LAYOUT.region_bytes() as usize).expect("alloc");
    let bytes: Vec<u8> = (0..m.len()).map(|i| (i * 7 + i / 251) as u8).collect();
    // SAFETY: the memory is ours alone.
    unsafe { m.write_from(0, &bytes).expect("fill") };
    Arc::new(m)
}

fn block_of(m: &KvMemory, b: u32) -> Vec<u8> {
    let mut out = Vec::new();
    for layer in 0..LAYOUT.n_layers {
        for kv in 0..2 {
            let mut run = vec![0u8; LAYOUT.block_bytes as usize];
            // SAFETY: no concurrent writer in this test.
            unsafe {
                m.read_into(LAYOUT.offset(layer, kv, b) as usize, &mut run)
                    .expect("read")
            };
            out.extend(run);
        }
    }
    out
}

fn copy(id: u64, kind: CopyKind, from: BlockLoc, to: BlockLoc, h: u64) -> TierCopy {
    TierCopy {
        id: CopyId(id),
        kind,
        from,
        to,
        block: SnapshotBlock {
            seq_hash: SequenceHash(h),
            parent: None,
            block_hash: BlockHash(h ^ 0xFF),
        },
    }
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flotilla-tiers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn a_block_survives_host_and_disk_byte_for_byte() {
    let g1 = g1();
    let d = dir("roundtrip");
    let (s, why) =
        TierStores::new(g1.clone(), LAYOUT, 4, Some((&d, 4)), "n/replica-0").expect("stores");
    assert!(why.is_none() && s.has_disk(), "{why:?}");
    let want = block_of(&g1, 3);
    let seq = SeqId(1);
    for c in [
        copy(
            1,
            CopyKind::Offload,
            BlockLoc::Device(3),
            BlockLoc::Host(2),
            42,
        ),
        copy(
            2,
            CopyKind::Demote,
            BlockLoc::Host(2),
            BlockLoc::Disk(1),
            42,
        ),
        copy(
            3,
            CopyKind::Onboard(seq),
            BlockLoc::Host(2),
            BlockLoc::Device(5),
            42,
        ),
        copy(
            4,
            CopyKind::Onboard(seq),
            BlockLoc::Disk(1),
            BlockLoc::Device(6),
            42,
        ),
    ] {
        assert_eq!(s.run(&c), CopyOutcome::Done, "{c:?}");
    }
    assert_eq!(block_of(&g1, 5), want, "through G2");
    assert_eq!(block_of(&g1, 6), want, "through G3");
    assert_ne!(block_of(&g1, 4), want);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_damaged_or_foreign_disk_record_is_corrupt_and_writes_nothing() {
    let g1 = g1();
    let d = dir("corrupt");
    let (s, _) = TierStores::new(g1.clone(), LAYOUT, 4, Some((&d, 4)), "w").expect("stores");
    let seq = SeqId(1);
    s.run(&copy(
        1,
        CopyKind::Offload,
        BlockLoc::Device(1),
        BlockLoc::Host(0),
        7,
    ));
    s.run(&copy(
        2,
        CopyKind::Demote,
        BlockLoc::Host(0),
        BlockLoc::Disk(0),
        7,
    ));
    let before = block_of(&g1, 4);
    // Another block's hash: refused.
    let other = copy(
        3,
        CopyKind::Onboard(seq),
        BlockLoc::Disk(0),
        BlockLoc::Device(4),
        8,
    );
    assert_eq!(s.run(&other), CopyOutcome::Corrupt);
    // A flipped payload byte: refused.
    let path = s.disk_path().expect("segment").to_owned();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    f.write_all_at(&[0xAB], RECORD_HEADER + 10).expect("damage");
    let same = copy(
        4,
        CopyKind::Onboard(seq),
        BlockLoc::Disk(0),
        BlockLoc::Device(4),
        7,
    );
    assert_eq!(s.run(&same), CopyOutcome::Corrupt);
    // A never-written slot (zeros): refused.
    let empty = copy(
        5,
        CopyKind::Onboard(seq),
        BlockLoc::Disk(3),
        BlockLoc::Device(4),
        7,
    );
    assert_eq!(s.run(&empty), CopyOutcome::Corrupt);
    assert_eq!(
        block_of(&g1, 4),
        before,
        "nothing written from a bad record"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_segment_that_cannot_be_made_leaves_the_disk_tier_off() {
    let g1 = g1();
    // A directory under a regular file cannot be created (whoever runs the test).
    let file = dir("not-a-dir");
    std::fs::write(&file, b"x").expect("file");
    let (s, why) =
        TierStores::new(g1, LAYOUT, 2, Some((&file.join("sub"), 4)), "w").expect("G2 still");
    assert!(!s.has_disk());
    assert!(why.expect("a reason").contains("sub"));
    let c = copy(1, CopyKind::Demote, BlockLoc::Host(0), BlockLoc::Disk(0), 1);
    assert_eq!(s.run(&c), CopyOutcome::TierOff);
    let _ = std::fs::remove_file(&file);
}

#[test]
fn the_copier_answers_every_copy_in_lane_order() {
    let g1 = g1();
    let (s, _) = TierStores::new(g1.clone(), LAYOUT, 4, None, "w").expect("stores");
    let (tx, rx) = mpsc::channel();
    let copier = TierCopier::start(Arc::new(s), move |r| {
        let _ = tx.send(r);
    })
    .expect("threads");
    let seq = SeqId(9);
    copier.submit(
        vec![
            copy(
                1,
                CopyKind::Offload,
                BlockLoc::Device(0),
                BlockLoc::Host(0),
                1,
            ),
            copy(
                2,
                CopyKind::Offload,
                BlockLoc::Device(1),
                BlockLoc::Host(1),
                2,
            ),
            copy(
                3,
                CopyKind::Onboard(seq),
                BlockLoc::Host(9),
                BlockLoc::Device(2),
                3,
            ),
        ],
        |_| panic!("lanes are up"),
    );
    let mut got = Vec::new();
    while got.len() < 3 {
        got.extend(
            rx.recv_timeout(std::time::Duration::from_secs(10))
                .expect("answered"),
        );
    }
    got.sort_by_key(|(id, _)| *id);
    assert_eq!(
        got,
        vec![
            (CopyId(1), CopyOutcome::Done),
            (CopyId(2), CopyOutcome::Done),
            (CopyId(3), CopyOutcome::Failed), // slot 9 is out of G2
        ]
    );
    drop(copier);
}

/// A device's pool reached only through copies (what a GPU engine publishes): the stores move
/// its blocks through the same interface, and never dereference its address.
#[test]
fn a_staged_device_pool_offloads_and_onboards_through_its_copies() {
    use crate::transport::{DeviceAccess, MemoryKind};
    struct Twin(std::sync::Mutex<Vec<u8>>);
    impl DeviceAccess for Arc<Twin> {
        fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), String> {
            let b = self.0.lock().map_err(|e| e.to_string())?;
            out.copy_from_slice(&b[offset..offset + out.len()]);
            Ok(())
        }
        fn write(&self, offset: usize, data: &[u8]) -> Result<(), String> {
            let mut b = self.0.lock().map_err(|e| e.to_string())?;
            b[offset..offset + data.len()].copy_from_slice(data);
            Ok(())
        }
    }
    let len = LAYOUT.region_bytes() as usize;
    let twin = Arc::new(Twin(std::sync::Mutex::new(
        (0..len).map(|i| (i * 13) as u8).collect(),
    )));
    // An address nothing maps: a dereference would crash the test.
    let addr = std::ptr::NonNull::new(0x10 as *mut u8).expect("non-null");
    let g1 = KvMemory::staged(
        addr,
        len,
        MemoryKind::Cuda { device: 0 },
        Box::new(twin.clone()),
    )
    .expect("staged");
    let g1 = Arc::new(g1);
    let d = dir("staged");
    let (s, _) = TierStores::new(g1.clone(), LAYOUT, 4, Some((&d, 4)), "gpu").expect("stores");
    let want = block_of(&g1, 2);
    let seq = SeqId(3);
    for c in [
        copy(
            1,
            CopyKind::Offload,
            BlockLoc::Device(2),
            BlockLoc::Host(0),
            5,
        ),
        copy(2, CopyKind::Demote, BlockLoc::Host(0), BlockLoc::Disk(0), 5),
        copy(
            3,
            CopyKind::Onboard(seq),
            BlockLoc::Disk(0),
            BlockLoc::Device(7),
            5,
        ),
    ] {
        assert_eq!(s.run(&c), CopyOutcome::Done, "{c:?}");
    }
    assert_eq!(block_of(&g1, 7), want);
    let _ = std::fs::remove_dir_all(&d);
}
