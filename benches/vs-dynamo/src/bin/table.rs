//! Prints the markdown tables of Flotilla/Dynamo ratios without criterion's runs (plain timers:
//! timed builds, churn batches and 20 000 find-matches calls per query kind and index), plus
//! the heap each index holds, read from a counting global allocator.
//!
//! `cargo run --release --bin vs-dynamo-table` (`VS_DYNAMO_WORKERS=256` keeps one world).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use flotilla_vs_dynamo::{World, heap_of, measure_world, table, worker_counts};

/// The system allocator, counting the bytes allocated and not yet freed.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged; only a counter is updated.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn main() {
    let figures: Vec<_> = worker_counts()
        .into_iter()
        .map(|w| {
            let world = World::generate(w, 7);
            let heap = heap_of(&world, || LIVE.load(Ordering::Relaxed));
            let mut m = measure_world(world);
            m.figures.heap_bytes = Some(heap);
            m.figures
        })
        .collect();
    println!("{}", table(&figures));
}
