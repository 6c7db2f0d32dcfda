//! quilt-crashtest: the crash-consistency explorer behind `quiltfs crashtest`.
//!
//! A run: make a small image (ext3 for the journal modes) with the workload's starting
//! state, mount it over a recording device, run the workload through the native API
//! (marks before every operation and after every fsync), and drop the file system
//! without unmounting. Crash states are then cut from the recorded history
//! (`states`): every prefix at a flush or a mark, and before every flush the subsets of
//! the writes in flight (all of them up to four writes, random ones past that). Each
//! state is checked (`check`): e2fsck -fn, judged by the mode (soft updates may leak and
//! overcount, the journal modes must be spotless after our replay and after e2fsck's,
//! which must agree, async is reported in full), and the persistence oracle (what was
//! fsynced must be there unless a later operation changed it).
//!
//! Workloads (`workload`): `ace` (every sequence of one to three operations from creat,
//! mkdir, write, truncate, link, unlink, rename, rmdir, fsync over a small set of files
//! and directories, each followed by an fsync), `untar`, `rmrf`, `postmark`.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod check;
pub mod kv;
pub mod lying;
pub mod replay;
pub mod states;
pub mod workload;

use check::{Outcome, Verdict};
use quilt_block::{MemDevice, RecordingDevice};
use quilt_ext2::{MkfsOptions, Mode, MountOptions};
use quilt_patch::EngineOptions;
use quilt_vfs::KernelFs;
use states::CrashState;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use workload::{Recorder, Rng};

const BS: usize = 4096;
const BLOCKS: u64 = 4096;
const JOURNAL_BLOCKS: u32 = 1024;

pub const WORKLOADS: [&str; 9] = [
    "ace", "untar", "rmrf", "postmark", "mail", "rename", "clone", "deep", "full",
];

/// The workloads `all` runs. ext2's leaves out the tree renames: its soft updates may
/// leave a renamed directory under both names until e2fsck clears one (an entry e2fsck
/// reports as a second link to a directory, which the explorer's classifier counts as
/// a violation); `--workload rename` runs it for any mode. Clones, deep trees (zones)
/// and a full device (the tree's space) are betrfs's alone.
fn all_workloads(betrfs: bool) -> impl Iterator<Item = &'static str> {
    WORKLOADS
        .into_iter()
        .filter(move |w| betrfs || !["rename", "clone", "deep", "full"].contains(w))
}

#[derive(Debug, Clone)]
pub struct Config {
    /// ext2's consistency mode (ignored for betrfs).
    pub mode: Mode,
    /// Explore betrfs instead of ext2.
    pub betrfs: bool,
    /// betrfs only: the control run, whose fsync, sync and patchgroup syncs make
    /// nothing durable (`lying::Lying`): the oracle must find broken promises.
    pub lying: bool,
    pub workload: String,
    /// At most this many states are checked in all (sampled evenly).
    pub states: usize,
    pub seed: u64,
    pub keep_failures: Option<PathBuf>,
    /// ext2's journal modes: where commits go (ring, or skip: then the device is a disk
    /// model in virtual time, so records land wherever its head gets first).
    pub placement: quilt_ext2::JournalPlacement,
    /// When the runs of `seed` have fewer states than `states`, run the seeded
    /// workloads again with the following seeds until the budget is spent.
    pub more_seeds: bool,
}

/// One checked state that broke the mode's guarantees.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Failure {
    pub run: String,
    pub state: CrashState,
    pub problems: Vec<String>,
    /// Where the crash image and its reproduction were saved (`--keep-failures`).
    pub image: Option<String>,
}

/// The reproduction of a failing state: the operations begun before the cut, the
/// state, what e2fsck said, the verdicts.
fn reproduction(spec: &str, mode: Mode, rec: &Recorded, s: &CrashState, out: &Outcome) -> String {
    let mut t = format!(
        "run: {spec}\nmode: {mode}\ncrash state: the first {} entries of the recorded history ({} writes, {} flushes, {} marks in all); {}; of the writes after the last flush, these persisted: {:?}\n\noperations begun before the crash:\n",
        s.len,
        rec.log.writes(),
        rec.log
            .entries
            .iter()
            .filter(|e| matches!(e, quilt_block::LogEntry::Flush))
            .count(),
        rec.log
            .entries
            .iter()
            .filter(|e| matches!(e, quilt_block::LogEntry::Mark(_)))
            .count(),
        s.why,
        s.kept
    );
    for (k, op) in rec.touched.iter().enumerate() {
        if rec
            .log
            .mark_position(&format!("op-{k}"))
            .is_some_and(|p| p <= s.len)
        {
            t.push_str(&format!("  {k:4}  {}\n", op.what));
        }
    }
    t.push_str(
        "\nthe same operations as values (quilt_vfs::FsOp as JSON, one per line, each after its number above; FsOp::apply replays them):\n",
    );
    for (k, op) in &rec.ops {
        if rec
            .log
            .mark_position(&format!("op-{k}"))
            .is_some_and(|p| p <= s.len)
        {
            let json =
                serde_json::to_string(op).unwrap_or_else(|e| format!("(unserialisable: {e})"));
            t.push_str(&format!("  {k:4}  {json}\n"));
        }
    }
    t.push_str("\nverdicts:\n");
    for p in &out.problems {
        t.push_str(&format!("  {:?}  {}\n", p.verdict, p.what));
    }
    t.push_str("\ne2fsck -fn:\n");
    t.push_str(&out.fsck);
    t
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    pub mode: String,
    pub workload: String,
    pub seed: u64,
    /// Runs made (sequences, for ACE), of `runs_possible`.
    pub runs: usize,
    pub runs_possible: usize,
    pub operations: usize,
    pub states_generated: usize,
    pub states_checked: usize,
    pub clean: usize,
    /// States whose only problems are ones the mode allows.
    pub allowed_only: usize,
    pub with_violations: usize,
    pub promises_checked: usize,
    /// How often each kind of problem was seen (the message without its numbers).
    pub problem_kinds: BTreeMap<String, (usize, &'static str)>,
    pub failures: Vec<Failure>,
    pub seconds: f64,
}

/// What a run does to a fresh image before recording starts.
type Setup = Box<dyn Fn(&dyn KernelFs) -> Result<(), String> + Send + Sync>;

/// The rmrf workloads' setup: the untar tree of seed `seed + 6`, made durable.
fn untar_tree(seed: u64) -> Setup {
    Box::new(move |fs| {
        let dev = MemDevice::new(BS, 1).map_err(|e| e.to_string())?;
        let mut r = Recorder::new(&dev, fs);
        workload::untar(&mut r, seed.wrapping_add(6), 3, 24);
        Ok(())
    })
}

/// A workload run: its name, and how to set up and drive it.
struct RunSpec {
    name: String,
    setup: Setup,
    body: Box<dyn Fn(&mut Recorder) + Send + Sync>,
}

/// The trees the rename workload moves (files each; the ext2 image has 1,024 inodes).
const RENAME_SIZES: &[usize] = &[1, 10, 100, 600];
/// The trees the clone workload clones (betrfs only).
const CLONE_SIZES: &[usize] = &[1, 10, 100, 10_000];

fn specs(workload: &str, seed: u64, betrfs: bool) -> Result<Vec<RunSpec>, String> {
    let none = || -> Setup { Box::new(|_| Ok(())) };
    Ok(match workload {
        "ace" => {
            let mut v = Vec::new();
            let ops = workload::ACE_OPS;
            let mut seqs: Vec<Vec<usize>> = (0..ops.len()).map(|a| vec![a]).collect();
            for len in 2..=3 {
                let prev: Vec<Vec<usize>> = seqs
                    .iter()
                    .filter(|s| s.len() == len - 1)
                    .cloned()
                    .collect();
                for s in prev {
                    for o in 0..ops.len() {
                        let mut t = s.clone();
                        t.push(o);
                        seqs.push(t);
                    }
                }
            }
            for s in seqs {
                let name = format!(
                    "ace[{}]",
                    s.iter().map(|&i| ops[i]).collect::<Vec<_>>().join(",")
                );
                v.push(RunSpec {
                    name,
                    setup: Box::new(|fs| workload::ace_setup(fs).map_err(|e| e.to_string())),
                    body: Box::new(move |r| {
                        for (pos, &o) in s.iter().enumerate() {
                            workload::ace_step(r, ops[o], pos);
                        }
                    }),
                });
            }
            v
        }
        "untar" => vec![RunSpec {
            name: "untar".into(),
            setup: none(),
            body: Box::new(move |r| workload::untar(r, seed, 3, 24)),
        }],
        "rmrf" => vec![
            RunSpec {
                name: "rmrf".into(),
                // The tree to remove (the default seed 1 gives the tree of seed 7 that earlier
                // versions always removed).
                setup: untar_tree(seed),
                body: Box::new(|r| workload::rmrf(r, 3, 24)),
            },
            RunSpec {
                // The same through a FUSE mount's eyes: files held, forgotten in batches.
                name: "rmrf-held".into(),
                setup: untar_tree(seed),
                body: Box::new(|r| workload::rmrf_held(r, 3, 24)),
            },
        ],
        "postmark" => vec![RunSpec {
            name: "postmark".into(),
            setup: none(),
            body: Box::new(move |r| workload::postmark(r, seed, 30, 120)),
        }],
        "mail" => vec![RunSpec {
            name: "mail".into(),
            setup: Box::new(move |fs| {
                workload::mail_setup(fs, seed, 12).map_err(|e| e.to_string())
            }),
            body: Box::new(move |r| workload::mail_move(r, seed, 12, true)),
        }],
        "rename" => vec![RunSpec {
            name: "rename".into(),
            setup: Box::new(move |fs| {
                workload::rename_setup(fs, seed, RENAME_SIZES).map_err(|e| e.to_string())
            }),
            body: Box::new(|r| workload::rename_trees(r, RENAME_SIZES)),
        }],
        "clone" if betrfs => vec![RunSpec {
            name: "clone".into(),
            setup: Box::new(move |fs| {
                workload::clone_setup(fs, seed, CLONE_SIZES).map_err(|e| e.to_string())
            }),
            body: Box::new(|r| workload::clone_trees(r, CLONE_SIZES)),
        }],
        "clone" => return Err("the clone workload needs --fs betrfs".into()),
        "deep" if betrfs => vec![RunSpec {
            name: "deep".into(),
            setup: none(),
            body: Box::new(move |r| workload::deep(r, seed, 28)),
        }],
        "full" if betrfs => vec![RunSpec {
            name: "full".into(),
            setup: none(),
            body: Box::new(move |r| workload::full(r, seed)),
        }],
        "deep" | "full" => return Err(format!("the {workload} workload needs --fs betrfs")),
        // The same move with no patchgroups and no fsync: its crash states must break
        // the move's invariant, or the check could not see a lost message.
        "mail-unordered" => vec![RunSpec {
            name: "mail-unordered".into(),
            setup: Box::new(move |fs| {
                workload::mail_setup(fs, seed, 12).map_err(|e| e.to_string())
            }),
            body: Box::new(move |r| workload::mail_move(r, seed, 12, false)),
        }],
        "all" => {
            let mut v = Vec::new();
            for w in all_workloads(betrfs) {
                v.extend(specs(w, seed, betrfs)?);
            }
            v
        }
        other => {
            return Err(format!(
                "unknown workload '{other}' (expected one of {}, or all)",
                WORKLOADS.join(", ")
            ))
        }
    })
}

/// The image a run starts from: fresh, with a journal in the journal modes, and the
/// workload's setup made durable by a clean unmount.
fn base_image(
    cfg: &Config,
    setup: &dyn Fn(&dyn KernelFs) -> Result<(), String>,
) -> Result<Vec<u8>, String> {
    let mode = cfg.mode;
    let dev = Arc::new(MemDevice::new(BS, BLOCKS).map_err(|e| e.to_string())?);
    if cfg.betrfs {
        quilt_stack::mkfs_betrfs(dev.clone()).map_err(|e| format!("mkfs: {e}"))?;
        let fs = quilt_stack::betrfs(dev.clone(), betrfs_options()).map_err(|e| e.to_string())?;
        setup(&fs)?;
        fs.unmount().map_err(|e| e.to_string())?;
        drop(fs);
        return Ok(dev.to_vec());
    }
    quilt_stack::mkfs_ext2(
        dev.clone(),
        EngineOptions::default(),
        &MkfsOptions {
            device_is_zeroed: true,
            inodes: Some(1024),
            ..Default::default()
        },
    )
    .map_err(|e| format!("mkfs: {e}"))?;
    let fs = quilt_stack::ext2(
        dev.clone(),
        quilt_stack::Ext2Spec::mount(MountOptions::default()),
    )
    .map_err(|e| e.to_string())?;
    if mode.is_journal() {
        fs.create_journal_for(
            JOURNAL_BLOCKS,
            cfg.placement == quilt_ext2::JournalPlacement::Skip,
        )
        .map_err(|e| format!("creating the journal: {e}"))?;
    }
    setup(&fs)?;
    fs.unmount().map_err(|e| e.to_string())?;
    drop(fs);
    Ok(dev.to_vec())
}

/// What one recorded run left: the base, the history, the promises.
struct Recorded {
    base: Vec<u8>,
    log: quilt_block::RecordingLog,
    promises: Vec<workload::Promise>,
    touched: Vec<workload::Touch>,
    /// The file-system operations made, each with its `touched` entry.
    ops: Vec<(usize, quilt_vfs::FsOp)>,
    invariants: Vec<workload::Invariant>,
    /// The journal's transactions, as committed (ext2's journal modes).
    txns: replay::Txns,
}

/// betrfs as the explorer mounts it: no periodic commit (the run is deterministic).
fn betrfs_options() -> quilt_betrfs::MountOptions {
    quilt_betrfs::MountOptions {
        commit_interval: None,
        ..Default::default()
    }
}

fn record(cfg: &Config, spec: &RunSpec) -> Result<Recorded, String> {
    let mode = cfg.mode;
    let base = base_image(cfg, &*spec.setup)?;
    let mem = Arc::new(MemDevice::from_bytes(BS, &base).map_err(|e| e.to_string())?);
    let rec = Arc::new(RecordingDevice::new(mem, 1 << 30));
    if cfg.betrfs {
        let fs = quilt_stack::betrfs(rec.clone(), betrfs_options())
            .map_err(|e| format!("mount: {e}"))?;
        let (promises, touched, invariants) = {
            let liar = lying::Lying(&fs);
            let target: &dyn KernelFs = if cfg.lying { &liar } else { &fs };
            let mut r = Recorder::new(rec.as_ref(), target);
            (spec.body)(&mut r);
            (r.promises, (r.touched, r.ops), r.invariants)
        };
        let (touched, ops) = touched;
        let log = rec.take_log();
        drop(fs);
        return Ok(Recorded {
            base,
            log,
            promises,
            touched,
            ops,
            invariants,
            txns: replay::Txns::new(),
        });
    }
    let txns = Arc::new(std::sync::Mutex::new(replay::Txns::new()));
    let sink = txns.clone();
    let observer = quilt_journal::Observer(Arc::new(move |seq, blocks, revoked| {
        let t = replay::Txn {
            blocks: blocks.iter().map(|(b, d)| (*b, d.to_vec())).collect(),
            revoked: revoked.to_vec(),
        };
        sink.lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(seq, t);
    }));
    let mut spec_dev = quilt_stack::DeviceSpec::given(rec.clone());
    if cfg.placement == quilt_ext2::JournalPlacement::Skip {
        // Where the head gets first: records land all over the area.
        spec_dev = spec_dev.with(quilt_stack::Layer::Disk {
            params: quilt_block::DiskParams::desktop_7200(),
            virtual_time: true,
            host_flush: true,
        });
    }
    let dev = quilt_stack::device(spec_dev)
        .map_err(|e| e.to_string())?
        .dev;
    let fs = quilt_stack::ext2(
        dev,
        quilt_stack::Ext2Spec::mount(MountOptions {
            mode,
            read_only: false,
            journal_observer: mode.is_journal().then_some(observer),
            ..Default::default()
        }),
    )
    .map_err(|e| format!("mount: {e}"))?;
    let (promises, touched, invariants) = {
        let mut r = Recorder::new(rec.as_ref(), &fs);
        (spec.body)(&mut r);
        (r.promises, (r.touched, r.ops), r.invariants)
    };
    let (touched, ops) = touched;
    let log = rec.take_log();
    // The crash: the file system goes away without unmounting.
    drop(fs);
    let txns = std::mem::take(&mut *txns.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(Recorded {
        base,
        log,
        promises,
        touched,
        ops,
        invariants,
        txns,
    })
}

/// The message without numbers, to count kinds of problems.
fn kind_of(what: &str) -> String {
    let s: String = what
        .chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect();
    let mut out = String::new();
    let mut last = ' ';
    for c in s.chars() {
        if !(c == '#' && last == '#') {
            out.push(c);
        }
        last = c;
    }
    out.chars().take(90).collect()
}

/// Runs the explorer. After each run, `progress` hears the states checked so far, an
/// estimate of how many will be checked in all, and the run's name.
pub fn run(cfg: &Config, mut progress: impl FnMut(usize, usize, &str)) -> Result<Report, String> {
    let t0 = std::time::Instant::now();
    let mut specs = specs(&cfg.workload, cfg.seed, cfg.betrfs)?;
    let mut rng = Rng::new(cfg.seed);
    let total_runs = specs.len();
    if cfg.states < specs.len() {
        // Fewer states than runs: every non-ACE run, and an even random choice of the
        // ACE sequences, one state each.
        let (ace, other): (Vec<RunSpec>, Vec<RunSpec>) =
            specs.into_iter().partition(|s| s.name.starts_with("ace["));
        let want = cfg.states.saturating_sub(other.len()).max(1);
        let mut ace: Vec<Option<RunSpec>> = ace.into_iter().map(Some).collect();
        let mut picked = Vec::new();
        let n = ace.len();
        let mut idx: Vec<usize> = (0..n).collect();
        for i in 0..want.min(n) {
            let j = i + rng.below((n - i) as u64) as usize;
            idx.swap(i, j);
        }
        idx.truncate(want.min(n));
        idx.sort_unstable();
        for i in idx {
            picked.extend(ace[i].take());
        }
        specs = other;
        specs.extend(picked);
    }
    let tmp = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let mut report = Report {
        mode: if cfg.betrfs {
            "betrfs".into()
        } else {
            cfg.mode.to_string()
        },
        workload: cfg.workload.clone(),
        seed: cfg.seed,
        runs: specs.len(),
        runs_possible: total_runs,
        ..Default::default()
    };
    let per_run = (cfg.states / specs.len().max(1)).max(1);
    let mut kept = 0usize;
    let n = specs.len();
    for (done, spec) in specs.iter().enumerate() {
        let remaining = (n - done - 1) * per_run;
        explore(
            cfg,
            spec,
            per_run,
            remaining,
            &mut rng,
            &tmp,
            &mut report,
            &mut kept,
            &mut progress,
        )?;
    }
    // Budget left after every state of the chosen runs: more runs of the seeded workloads
    // (untar, rm -rf, PostMark) with the following seeds, until it is spent.
    let extendable: Vec<&str> = match cfg.workload.as_str() {
        "all" => all_workloads(cfg.betrfs).filter(|w| *w != "ace").collect(),
        "ace" => Vec::new(),
        w => vec![w],
    };
    let mut next_seed = cfg.seed;
    while cfg.more_seeds && report.states_checked < cfg.states && !extendable.is_empty() {
        next_seed = next_seed.wrapping_add(1);
        if next_seed.wrapping_sub(cfg.seed) > 100_000 {
            break;
        }
        for w in &extendable {
            let left = cfg.states.saturating_sub(report.states_checked);
            if left == 0 {
                break;
            }
            for mut spec in self::specs(w, next_seed, cfg.betrfs)? {
                spec.name = format!("{}@{next_seed}", spec.name);
                let left = cfg.states.saturating_sub(report.states_checked);
                explore(
                    cfg,
                    &spec,
                    left,
                    0,
                    &mut rng,
                    &tmp,
                    &mut report,
                    &mut kept,
                    &mut progress,
                )?;
                report.runs += 1;
                report.runs_possible += 1;
            }
        }
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Records one run, cuts its states, checks at most `budget` of them, and adds the
/// results to `report`. `after` is how many more states later runs will check (for the
/// progress estimate).
#[allow(clippy::too_many_arguments)]
fn explore(
    cfg: &Config,
    spec: &RunSpec,
    budget: usize,
    after: usize,
    rng: &mut Rng,
    tmp: &std::path::Path,
    report: &mut Report,
    kept: &mut usize,
    progress: &mut impl FnMut(usize, usize, &str),
) -> Result<(), String> {
    let rec = record(cfg, spec)?;
    report.operations += rec.touched.len();
    let all = states::generate(&rec.log, rng);
    report.states_generated += all.len();
    let chosen = states::sample(all, budget, rng);
    let planned_run = chosen.len();
    let mut outcomes = Vec::with_capacity(planned_run);
    let base = report.states_checked;
    let estimate = |checked: usize| {
        (base + planned_run + after).max(cfg.states.min(checked + after).max(checked))
    };
    // In slices, so the progress estimate moves within long runs too.
    for slice in chosen.chunks(32) {
        outcomes.extend(check_all(cfg, &rec, slice, tmp));
        let checked = base + outcomes.len();
        progress(checked, estimate(checked), &spec.name);
    }
    for (state, out) in chosen.iter().zip(outcomes) {
        report.states_checked += 1;
        report.promises_checked += out.promises_checked;
        for p in &out.problems {
            let e = report
                .problem_kinds
                .entry(kind_of(&p.what))
                .or_insert((0, "allowed"));
            e.0 += 1;
            if p.verdict == Verdict::Violation {
                e.1 = "violation";
            }
        }
        if out.problems.is_empty() {
            report.clean += 1;
        } else if out.violations == 0 {
            report.allowed_only += 1;
        } else {
            report.with_violations += 1;
            let mut image = None;
            if let Some(dir) = &cfg.keep_failures {
                if *kept < 50 {
                    let name = format!(
                        "{}-{}-{}.img",
                        spec.name.replace(['[', ']', ','], "_"),
                        state.len,
                        kept
                    );
                    let path = dir.join(&name);
                    let img = state_image(&rec, state)?;
                    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
                    std::fs::write(&path, img).map_err(|e| e.to_string())?;
                    std::fs::write(
                        path.with_extension("txt"),
                        reproduction(&spec.name, cfg.mode, &rec, state, &out),
                    )
                    .map_err(|e| e.to_string())?;
                    image = Some(path.display().to_string());
                    *kept += 1;
                }
            }
            if report.failures.len() < 200 {
                report.failures.push(Failure {
                    run: spec.name.clone(),
                    state: state.clone(),
                    problems: out
                        .problems
                        .iter()
                        .filter(|p| p.verdict == Verdict::Violation)
                        .map(|p| p.what.clone())
                        .collect(),
                    image,
                });
            }
        }
    }
    progress(
        report.states_checked,
        report.states_checked + after,
        &spec.name,
    );
    Ok(())
}

fn state_image(rec: &Recorded, s: &CrashState) -> Result<Vec<u8>, String> {
    let dev = MemDevice::from_bytes(BS, &rec.base).map_err(|e| e.to_string())?;
    rec.log
        .replay_subset(s.len, &dev, |i| s.keeps(i))
        .map_err(|e| e.to_string())?;
    Ok(dev.to_vec())
}

/// How many operations had begun at cut `len`.
fn begun_at(rec: &Recorded, len: usize) -> usize {
    (0..rec.touched.len())
        .take_while(|k| {
            rec.log
                .mark_position(&format!("op-{k}"))
                .is_some_and(|x| x <= len)
        })
        .count()
}

/// The promises a crash at cut `len` must keep: those made before the cut, unless an
/// operation after the promise (and begun before the cut) touched its path or its file.
fn promises_at(rec: &Recorded, len: usize) -> Vec<&workload::Promise> {
    let pos = |m: &str| rec.log.mark_position(m);
    let begun = begun_at(rec, len);
    rec.promises
        .iter()
        .filter(|p| pos(&p.mark).is_some_and(|x| x <= len))
        .filter(|p| !(p.op + 1..begun).any(|k| rec.touched[k].invalidates(p)))
        .collect()
}

/// Checks `states` on two threads (e2fsck runs as a separate process).
fn check_all(
    cfg: &Config,
    rec: &Recorded,
    states: &[CrashState],
    tmp: &std::path::Path,
) -> Vec<Outcome> {
    let one = |s: &CrashState| -> Outcome {
        let img = match state_image(rec, s) {
            Ok(i) => i,
            Err(e) => {
                return Outcome {
                    problems: vec![check::Problem {
                        what: format!("building the state: {e}"),
                        verdict: Verdict::Violation,
                    }],
                    violations: 1,
                    promises_checked: 0,
                    fsck: String::new(),
                }
            }
        };
        // The image is the crash state of every cut in `also` too: it must keep the
        // promises of each.
        let mut relevant: Vec<&workload::Promise> = Vec::new();
        let mut invariants: Vec<&workload::Invariant> = Vec::new();
        for len in std::iter::once(s.len).chain(s.also.iter().copied()) {
            for p in promises_at(rec, len) {
                if !relevant.iter().any(|q| std::ptr::eq(*q, p)) {
                    relevant.push(p);
                }
            }
            let begun = begun_at(rec, len);
            for i in rec.invariants.iter().filter(|i| i.active(begun)) {
                if !invariants.iter().any(|j| std::ptr::eq(*j, i)) {
                    invariants.push(i);
                }
            }
        }
        if cfg.betrfs {
            return check::check_betrfs_state(&img, &relevant, &invariants);
        }
        let mut out = check::check_state(&img, cfg.mode, &relevant, &invariants, tmp);
        if cfg.mode.is_journal() {
            let lens: Vec<usize> = std::iter::once(s.len)
                .chain(s.also.iter().copied())
                .collect();
            let (lo, hi) = replay::bounds(&rec.log, &lens);
            if let Some(what) = replay::check(&img, BS, &rec.txns, lo, hi) {
                out.problems.push(check::Problem {
                    what: format!("against the journal model: {what}"),
                    verdict: Verdict::Violation,
                });
                out.violations += 1;
            }
        }
        out
    };
    let half = states.len().div_ceil(2);
    std::thread::scope(|sc| {
        let (a, b) = states.split_at(half.min(states.len()));
        let h = sc.spawn(|| a.iter().map(one).collect::<Vec<_>>());
        let mut rb: Vec<Outcome> = b.iter().map(one).collect();
        let mut ra = h.join().unwrap_or_default();
        ra.append(&mut rb);
        ra
    })
}

impl Report {
    /// A human summary.
    pub fn text(&self) -> String {
        let mut s = format!(
            "crashtest: mode {}, workload {} (seed {}): {} of {} runs, {} operations; {} crash states generated, {} checked in {:.1} s\n  clean: {}   only what the mode allows: {}   with violations: {}   fsync promises checked: {}\n",
            self.mode, self.workload, self.seed, self.runs, self.runs_possible, self.operations,
            self.states_generated, self.states_checked, self.seconds,
            self.clean, self.allowed_only, self.with_violations, self.promises_checked
        );
        if !self.problem_kinds.is_empty() {
            s.push_str("  problems seen (count, verdict):\n");
            for (k, (n, v)) in &self.problem_kinds {
                s.push_str(&format!("    {n:6}  {v:9}  {k}\n"));
            }
        }
        for f in self.failures.iter().take(5) {
            s.push_str(&format!(
                "  e.g. {} at {} ({}, {} writes in flight kept): {}\n",
                f.run,
                f.state.len,
                f.state.why,
                f.state.kept.len(),
                f.problems.first().cloned().unwrap_or_default()
            ));
        }
        s
    }
}
