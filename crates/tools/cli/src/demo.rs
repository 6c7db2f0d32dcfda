//! `quiltfs demo`: the patch engine on a real image file, for each optimization setting.

use anyhow::{Context, Result};
use quilt_block::IoStats;
use quilt_patch::{synth, Durability, EngineOptions, EngineStats};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Image file to create (overwritten if it exists).
    #[arg(long, default_value = "quiltfs-demo.img")]
    image: PathBuf,
    /// Image size in MiB.
    #[arg(long, default_value_t = 64)]
    size_mib: u64,
    /// Files the synthetic workload creates in each run.
    #[arg(long, default_value_t = 5_000)]
    files: u64,
    /// Fsync one file in this many (0: never).
    #[arg(long, default_value_t = 64)]
    fsync_every: u64,
    /// Skip device flushes (unsafe durability).
    #[arg(long)]
    r#unsafe: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Keep the image file afterwards.
    #[arg(long)]
    keep: bool,
}

#[derive(Serialize)]
struct Row {
    config: &'static str,
    seconds: f64,
    workload: synth::SynthReport,
    engine: EngineStats,
    device: IoStats,
}

pub fn run(args: DemoArgs) -> Result<()> {
    let block_size = 4096;
    let blocks = args.size_mib * (1 << 20) / block_size as u64;
    anyhow::ensure!(
        blocks >= 256,
        "--size-mib {} is too small: the demo needs at least 1 MiB",
        args.size_mib
    );
    let mut rows = Vec::new();
    for (config, hard, merge) in [
        ("none", false, false),
        ("hard", true, false),
        ("merge", false, true),
        ("both", true, true),
    ] {
        // The demo's own scratch image, made anew for each setting (unlocked: the
        // previous setting's flusher thread may still hold its device).
        let _ = std::fs::remove_file(&args.image);
        let spec = quilt_stack::ImageSpec {
            create_bytes: Some(blocks * block_size as u64),
            lock: false,
            ..quilt_stack::ImageSpec::new(&args.image, block_size, false)
        };
        let dev = quilt_stack::device(quilt_stack::DeviceSpec::image(spec))
            .with_context(|| format!("creating {}", args.image.display()))?
            .dev;
        let engine = quilt_stack::engine(
            dev.clone(),
            EngineOptions {
                hard_patches: hard,
                overlap_merge: merge,
                durability: if args.r#unsafe {
                    Durability::Unsafe
                } else {
                    Durability::Safe
                },
                flush_interval_ms: Some(1000),
                ..EngineOptions::default()
            },
        );
        let start = Instant::now();
        let workload = synth::run(&engine, args.files, 42, args.fsync_every)?;
        engine.sync()?;
        let seconds = start.elapsed().as_secs_f64();
        engine.stop_flusher();
        engine.check_invariants().map_err(anyhow::Error::msg)?;
        rows.push(Row {
            config,
            seconds,
            workload,
            engine: engine.stats(),
            device: dev.stats(),
        });
    }
    if !args.keep {
        std::fs::remove_file(&args.image)
            .with_context(|| format!("removing {}", args.image.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let w = &rows[0].workload;
    println!(
        "quiltfs demo: {} files created, {} removed, {} fsyncs ({} changes) on a {} MiB image, per optimization setting\n",
        w.files_created, w.files_removed, w.fsyncs, w.changes, args.size_mib
    );
    println!(
        "{:<6} {:>8} {:>9} {:>8} {:>7} {:>8} {:>12} {:>8} {:>7} {:>7} {:>8}",
        "config",
        "seconds",
        "created",
        "merged",
        "hard",
        "rollbk",
        "undo bytes",
        "written",
        "epochs",
        "flushes",
        "dev wr"
    );
    for r in &rows {
        let e = &r.engine;
        println!(
            "{:<6} {:>8.3} {:>9} {:>8} {:>7} {:>8} {:>12} {:>8} {:>7} {:>7} {:>8}",
            r.config,
            r.seconds,
            e.patches_created,
            e.patches_merged,
            e.patches_made_hard,
            e.patches_rolled_back,
            e.undo_bytes_total,
            e.blocks_written,
            e.epochs,
            e.flushes,
            r.device.writes
        );
    }
    let (none, both) = (&rows[0].engine, &rows[3].engine);
    println!(
        "\nboth optimizations vs none: {:.1}% fewer patches, {:.1}% fewer undo bytes",
        100.0 * (1.0 - both.patches_created as f64 / none.patches_created.max(1) as f64),
        100.0 * (1.0 - both.undo_bytes_total as f64 / none.undo_bytes_total.max(1) as f64)
    );
    Ok(())
}
