//! Patch creation and write-back throughput for the four optimization settings.
//!
//! `patch_create`: the synthetic soft-updates workload (`quilt_patch::synth`) building its
//! graph in memory, no write-back; throughput in changes per second.
//! `write_back`: syncing that graph to a memory device; throughput in blocks written per
//! second. Run with `cargo bench -p quilt-patch --bench engine`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use quilt_block::MemDevice;
use quilt_patch::{synth, Engine, EngineOptions};
use std::sync::Arc;

const FILES: u64 = 2_000;
const CONFIGS: [(&str, bool, bool); 4] = [
    ("none", false, false),
    ("hard", true, false),
    ("merge", false, true),
    ("both", true, true),
];

fn engine(hard: bool, merge: bool) -> Engine {
    let dev = Arc::new(MemDevice::new(4096, 8192).unwrap());
    Engine::new(
        dev,
        EngineOptions {
            hard_patches: hard,
            overlap_merge: merge,
            cache_bytes_max: 1 << 30,
            ..EngineOptions::default()
        },
    )
}

/// A workload without fsyncs, so creation measures only creation.
fn build(hard: bool, merge: bool) -> (Engine, synth::SynthReport) {
    let e = engine(hard, merge);
    let r = synth::run(&e, FILES, 7, 0).unwrap();
    (e, r)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("patch_create");
    for (name, hard, merge) in CONFIGS {
        let changes = build(hard, merge).1.changes;
        g.throughput(Throughput::Elements(changes));
        g.bench_function(name, |b| {
            b.iter_batched(
                || engine(hard, merge),
                |e| synth::run(&e, FILES, 7, 0).unwrap(),
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();

    let mut g = c.benchmark_group("write_back");
    for (name, hard, merge) in CONFIGS {
        let (e, _) = build(hard, merge);
        let before = e.stats().blocks_written;
        e.sync().unwrap();
        let blocks = e.stats().blocks_written - before;
        g.throughput(Throughput::Elements(blocks));
        g.bench_function(name, |b| {
            b.iter_batched(
                || build(hard, merge).0,
                |e| e.sync().unwrap(),
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
