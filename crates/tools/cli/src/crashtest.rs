//! `quiltfs crashtest`: the crash-consistency explorer (`quilt_crashtest`).

use anyhow::{bail, Context, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct CrashtestArgs {
    /// What to explore: ext2 (the file system, in --mode), betrfs (the Bε-tree file
    /// system: every state must recover, pass quiltfs fsck and keep every fsync and
    /// synced patchgroup), or betree (the Bε-tree key-value store: recovery must yield
    /// every synced batch and a prefix of the rest).
    #[arg(long, default_value = "ext2")]
    pub fs: String,
    /// Consistency mode of ext2: soft-updates, meta-journal, full-journal or async.
    #[arg(long, required_if_eq("fs", "ext2"))]
    pub mode: Option<quilt_ext2::Mode>,
    /// betree and betrfs only: the control run, which claims syncs it never makes (the
    /// oracle must find lost batches, broken fsync promises).
    #[arg(long)]
    pub lying: bool,
    /// betree only: the control run whose syncs leave the values of puts logged by
    /// reference out of the log (a record that names data nothing made durable): the
    /// oracle must find lost batches.
    #[arg(long, conflicts_with = "lying")]
    pub unbound: bool,
    /// Workload: ace (every sequence of 1-3 operations), untar, rmrf, postmark, mail (a
    /// mailbox move ordered by patchgroups), rename (trees of 1 to 600 files renamed:
    /// exactly one name holds each, whole; in `all` for betrfs only), clone (betrfs:
    /// trees of 1 to 10,000 files cloned, a clone is absent or whole and its original
    /// unchanged, writes to one never change the other), or all;
    /// mail-unordered is the same move with nothing ordered (it must lose messages).
    #[arg(long, default_value = "all")]
    pub workload: String,
    /// How many crash states to check (sampled evenly over the runs; past what one seed
    /// yields, the seeded workloads run again with the following seeds).
    #[arg(long, default_value_t = 3000)]
    pub states: usize,
    /// ext2's journal modes: where commits go, ring (JBD2's log) or skip (log skipping,
    /// on a disk model in virtual time so that records land all over the area).
    #[arg(long, default_value = "ring", value_parser = parse_placement)]
    pub journal_placement: quilt_ext2::JournalPlacement,
    /// Seed of the random choices (workload contents, subsets, sampling).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the full report as JSON here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Save the crash images that break the mode's guarantees here (up to 50).
    #[arg(long)]
    pub keep_failures: Option<PathBuf>,
}

pub fn run(a: CrashtestArgs) -> Result<()> {
    if a.states == 0 {
        bail!("--states must be at least 1");
    }
    // Every state copies whole images into fresh buffers: with freed pages going back to
    // the system at once (the server's setting) each copy faulted its pages in again,
    // and 500 journal states took 79 s (59 s of it in the kernel); with a delay, 29 s.
    crate::set_allocator_purge_delay(1000);
    if a.unbound && a.fs != "betree" {
        bail!("--unbound is a control of --fs betree only");
    }
    let (mode, betrfs) = match (a.fs.as_str(), a.mode) {
        ("betree", _) => return run_betree(&a),
        ("betrfs", _) => (quilt_ext2::Mode::SoftUpdates, true),
        ("ext2", Some(m)) => (m, false),
        ("ext2", None) => bail!("--mode is required for ext2"),
        (fs, _) => bail!("unknown --fs {fs}: ext2, betrfs or betree"),
    };
    if std::process::Command::new("e2fsck")
        .arg("-V")
        .output()
        .is_err()
    {
        bail!("crashtest needs e2fsck (Debian package e2fsprogs)");
    }
    let cfg = quilt_crashtest::Config {
        mode,
        betrfs,
        lying: a.lying,
        workload: a.workload.clone(),
        states: a.states,
        seed: a.seed,
        keep_failures: a.keep_failures.clone(),
        placement: a.journal_placement,
        more_seeds: true,
    };
    let mut meter = crate::progress::Meter::new("crashtest", "states", 0);
    let r = quilt_crashtest::run(&cfg, |checked, planned, run| {
        meter.set(checked as u64, planned as u64, run)
    })
    .map_err(anyhow::Error::msg);
    meter.finish();
    let r = r?;
    print!("{}", r.text());
    if let Some(p) = &a.report {
        let json = serde_json::to_string_pretty(&r)?;
        std::fs::write(p, json).with_context(|| format!("writing {}", p.display()))?;
        println!("  report: {}", p.display());
    }
    match mode {
        _ if betrfs && a.lying => {
            if r.with_violations == 0 {
                bail!("the lying control broke no promise in {} states: the oracle cannot see a lost fsync", r.states_checked);
            }
            println!(
                "  control: {} of {} states break promises, as they must when syncs lie",
                r.with_violations, r.states_checked
            );
            Ok(())
        }
        _ if betrfs && r.with_violations > 0 => bail!(
            "{} of {} crash states of betrfs break its guarantees",
            r.with_violations,
            r.states_checked
        ),
        _ if betrfs => Ok(()),
        quilt_ext2::Mode::Async => {
            if r.with_violations == 0 {
                println!("  note: async left no violation in these states; a workload that reorders more would show them");
            } else {
                println!("  async keeps no order across blocks: these violations are expected, and show the explorer sees corruption");
            }
            Ok(())
        }
        _ if r.with_violations > 0 => bail!(
            "{} of {} crash states break the {} guarantees",
            r.with_violations,
            r.states_checked,
            mode
        ),
        _ => Ok(()),
    }
}

fn run_betree(a: &CrashtestArgs) -> Result<()> {
    let mut meter = crate::progress::Meter::new("crashtest", "states", a.states as u64);
    let r = quilt_crashtest::kv::run(a.states, a.seed, a.lying, a.unbound, |done, total| {
        meter.set(done as u64, total as u64, "")
    })
    .map_err(anyhow::Error::msg);
    meter.finish();
    let r = r?;
    print!("{}", r.text());
    if let Some(p) = &a.report {
        std::fs::write(p, serde_json::to_string_pretty(&r)?)
            .with_context(|| format!("writing {}", p.display()))?;
        println!("  report: {}", p.display());
    }
    match (a.lying || a.unbound, r.with_violations) {
        (true, 0) => bail!("the control run lost nothing: the oracle would be blind"),
        (true, _) => {
            println!(
                "  control: {}, so these violations are expected",
                if a.lying {
                    "syncs were claimed but not made"
                } else {
                    "syncs left the values of puts by reference out of the log"
                }
            );
            Ok(())
        }
        (false, 0) => Ok(()),
        (false, n) => bail!(
            "{n} of {} crash states of the Bε-tree break its guarantees",
            r.states_checked
        ),
    }
}

fn parse_placement(s: &str) -> Result<quilt_ext2::JournalPlacement, String> {
    match s.parse()? {
        quilt_ext2::JournalPlacement::Null => {
            Err("a null journal promises nothing after a crash: explore ring or skip".into())
        }
        p => Ok(p),
    }
}
