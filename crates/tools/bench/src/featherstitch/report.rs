//! The Markdown report: the paper's benchmark table and optimization table with this
//! run's numbers, per-workload details with ratios to the kernel's ext2 and ext3, and
//! the goals checked against the medians.

use super::systems::System;
use super::workloads::{Inputs, Workload};
use super::Sample;
use crate::median;
use std::fmt::Write;

#[derive(Debug, Clone, serde::Serialize)]
pub struct Meta {
    pub quiltfs_version: &'static str,
    pub kernel: String,
    pub cpu: String,
    pub cores: usize,
    pub quick: bool,
    pub runs: usize,
    pub image_mib: u64,
    pub inputs: Inputs,
    pub duration_s: f64,
}

impl Meta {
    pub fn gather(
        inputs: &Inputs,
        quick: bool,
        runs: usize,
        image_mib: u64,
        took: std::time::Duration,
    ) -> Meta {
        let (kernel, cpu) = super::machine();
        Meta {
            quiltfs_version: env!("CARGO_PKG_VERSION"),
            kernel,
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            quick,
            runs,
            image_mib,
            inputs: inputs.clone(),
            duration_s: took.as_secs_f64(),
        }
    }
}

/// Medians over the runs of one system on one workload.
pub struct Cell {
    pub wall: (f64, f64, f64),
    pub cpu: (f64, f64, f64),
    pub user: f64,
    pub sys: f64,
    pub fs: f64,
    pub writes: f64,
    pub flushes: f64,
    pub patches: Option<f64>,
    pub undo: Option<f64>,
    /// The largest peak RSS of the server over the runs, MiB.
    pub rss: Option<f64>,
    /// FUSE requests answered by the quiltfs server, by type (medians over the runs).
    pub requests: Option<std::collections::BTreeMap<String, f64>>,
    /// The FUSE transport of the runs: "io_uring", "/dev/fuse" or "mixed".
    pub transport: Option<&'static str>,
}

pub fn cell(samples: &[Sample], system: &str, w: Workload) -> Option<Cell> {
    let v: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.system == system && s.workload == w)
        .collect();
    if v.is_empty() {
        return None;
    }
    let m = |f: &dyn Fn(&Sample) -> f64| median(v.iter().map(|s| f(s)).collect());
    let opt = |f: &dyn Fn(&Sample) -> Option<u64>| {
        let xs: Vec<f64> = v.iter().filter_map(|s| f(s)).map(|x| x as f64).collect();
        (!xs.is_empty()).then(|| median(xs).0)
    };
    Some(Cell {
        wall: m(&|s| s.wall_s),
        cpu: m(&|s| s.cpu_s()),
        user: m(&|s| s.user_s()).0,
        sys: m(&|s| s.sys_s()).0,
        fs: m(&|s| s.fs_user_s + s.fs_sys_s).0,
        writes: m(&|s| s.device_writes as f64).0,
        flushes: m(&|s| s.device_flushes as f64).0,
        patches: opt(&|s| s.patches_created),
        undo: opt(&|s| s.undo_bytes),
        rss: v
            .iter()
            .filter_map(|s| s.server_peak_rss_mib)
            .reduce(f64::max),
        requests: requests_median(&v),
        transport: {
            let t: Vec<bool> = v.iter().filter_map(|s| s.io_uring).collect();
            match (t.iter().all(|&x| x), t.iter().any(|&x| x)) {
                _ if t.is_empty() => None,
                (true, _) => Some("io_uring"),
                (false, false) => Some("/dev/fuse"),
                (false, true) => Some("mixed"),
            }
        },
    })
}

/// Median count of each request type over the runs that counted requests.
fn requests_median(v: &[&Sample]) -> Option<std::collections::BTreeMap<String, f64>> {
    let counted: Vec<&std::collections::BTreeMap<String, u64>> =
        v.iter().filter_map(|s| s.requests.as_ref()).collect();
    if counted.is_empty() {
        return None;
    }
    let types: std::collections::BTreeSet<&String> =
        counted.iter().flat_map(|m| m.keys()).collect();
    Some(
        types
            .into_iter()
            .map(|t| {
                let xs = counted
                    .iter()
                    .map(|m| m.get(t).copied().unwrap_or(0) as f64)
                    .collect();
                (t.clone(), median(xs).0)
            })
            .collect(),
    )
}

impl Cell {
    /// All FUSE requests (median of each type, summed).
    pub fn total_requests(&self) -> Option<f64> {
        self.requests.as_ref().map(|m| m.values().sum())
    }
}

fn ratio(a: f64, b: Option<f64>) -> String {
    match b {
        Some(b) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    }
}

pub fn markdown(meta: &Meta, systems: &[System], ws: &[Workload], samples: &[Sample]) -> String {
    let mut t = String::new();
    let i = &meta.inputs;
    let _ = writeln!(
        t,
        "# Featherstitch's evaluation on this machine{}\n",
        if meta.quick { " (quick mode)" } else { "" }
    );
    let _ = writeln!(
        t,
        "quiltfs {}, Linux {}, {} × {}; {} run(s) per system, interleaved; {} MiB images on \
         loop devices; {:.0} s in all.\n",
        meta.quiltfs_version,
        meta.kernel,
        meta.cores,
        meta.cpu,
        meta.runs,
        meta.image_mib,
        meta.duration_s
    );
    let _ = writeln!(
        t,
        "- **untar**: `tar xf` of {} ({:.0} MB, {} entries; read into the page cache \
         before timing), then sync.\n\
         - **delete**: after unmounting and mounting again (caches dropped), `rm -rf` of \
         that tree, then sync.\n\
         - **postmark**: Debian's PostMark, {} files of {}–{} bytes, {} transactions, \
         seed {}, then sync.\n\
         - **andrew**: make the directory hierarchy of {} ({} files, {:.1} MB), copy the \
         files, stat every file, read every file, `make -j1 {}`, then sync.\n\
         - Every timing runs until the data is durable and the file system unmounted: \
         the workload, a sync (`sync -f`; for quiltfs its own sync request, which does what \
         syncfs(2) does on its fuseblk mounts), and the unmount, which for a FUSE server \
         lasts until it has written back and exited. The page cache is dropped before \
         each workload. Each run starts from a fresh image.\n\
         - **CPU** is user + system seconds of the workload's processes plus the file \
         system's own: the FUSE server (quiltfs, fuse2fs), or the kernel's jbd2 thread. A \
         kernel file system's other work is system time of the processes that call it; \
         kernel writeback and loop-device threads are not counted for any system.\n\
         - **Safe** systems flush the device's write cache where durability needs it; \
         `-unsafe` quiltfs systems never flush (the paper's unsafe); kernel ext2 orders \
         nothing, and fuse2fs writes back only at unmount.\n",
        i.tarball.display(),
        i.tarball_bytes as f64 / 1e6,
        i.tarball_entries,
        i.postmark.files,
        i.postmark.min_size,
        i.postmark.max_size,
        i.postmark.transactions,
        i.postmark.seed,
        i.source.display(),
        i.source_files,
        i.source_bytes as f64 / 1e6,
        if i.make_targets.is_empty() {
            "(the default target)".to_string()
        } else {
            i.make_targets.join(" ")
        },
    );

    let main: Vec<&System> = systems.iter().filter(|s| !s.opt_only()).collect();
    // The paper's figure: seconds, CPU in brackets.
    let _ = writeln!(
        t,
        "## Benchmark times\n\nWall seconds, median of {} run(s); total CPU seconds in \
         brackets.\n",
        meta.runs
    );
    let _ = write!(t, "| system | safe |");
    for w in ws {
        let _ = write!(t, " {} |", w.name());
    }
    let _ = write!(t, "\n|---|---|");
    for _ in ws {
        let _ = write!(t, "---|");
    }
    t.push('\n');
    for s in &main {
        let _ = write!(
            t,
            "| {} (`{}`) | {} |",
            s.what,
            s.name,
            if s.safe { "safe" } else { "unsafe" }
        );
        for &w in ws {
            match cell(samples, s.name, w) {
                Some(c) => {
                    let _ = write!(t, " {:.2} [{:.2}] |", c.wall.0, c.cpu.0);
                }
                None => t.push_str(" – |"),
            }
        }
        t.push('\n');
    }

    for &w in ws {
        let ext2 = cell(samples, "ext2", w).map(|c| c.wall.0);
        let floor = cell(samples, crate::systems::FLOOR, w).map(|c| c.wall.0);
        let _ = writeln!(
            t,
            "\n## {}\n\n| system | wall s (min–max) | CPU s (min–max) | user s | sys s | of which fs process s | vs ext2 | vs ext3 (same guarantee) | vs FUSE floor | device writes | device flushes | server peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            w.name()
        );
        for s in &main {
            let Some(c) = cell(samples, s.name, w) else {
                continue;
            };
            let peer = s.ext3_peer();
            let ext3 = cell(samples, peer, w).map(|c| c.wall.0);
            let _ = writeln!(
                t,
                "| `{}` | {:.2} ({:.2}–{:.2}) | {:.2} ({:.2}–{:.2}) | {:.2} | {:.2} | {:.2} | {} | {} {} | {} | {:.0} | {:.0} | {} |",
                s.name,
                c.wall.0,
                c.wall.1,
                c.wall.2,
                c.cpu.0,
                c.cpu.1,
                c.cpu.2,
                c.user,
                c.sys,
                c.fs,
                ratio(c.wall.0, ext2),
                ratio(c.wall.0, ext3),
                peer.trim_start_matches("ext3-"),
                ratio(c.wall.0, floor),
                c.writes,
                c.flushes,
                c.rss.map_or("–".into(), |r| format!("{r:.0}"))
            );
        }
    }

    // FUSE requests per workload, for every quiltfs system that counted them.
    for &w in ws {
        let rows: Vec<(&str, Cell)> = main
            .iter()
            .filter_map(|s| Some((s.name, cell(samples, s.name, w)?)))
            .filter(|(_, c)| c.requests.is_some())
            .collect();
        if rows.is_empty() {
            continue;
        }
        let entries = match w {
            Workload::Untar | Workload::Delete => Some(i.tarball_entries as f64),
            _ => None,
        };
        let _ = writeln!(
            t,
            "\n## FUSE requests: {}\n\nRequests the quiltfs server answered over the workload \
             and its sync (medians){}.\n\n| system | transport | requests | per entry | by type |\n|---|---|---|---|---|",
            w.name(),
            if entries.is_some() {
                "; per entry of the tarball"
            } else {
                ""
            }
        );
        for (name, c) in rows {
            let reqs = c.requests.as_ref().expect("filtered");
            let mut by: Vec<(&String, &f64)> = reqs.iter().collect();
            by.sort_by(|a, b| b.1.total_cmp(a.1));
            let types: Vec<String> = by
                .iter()
                .filter(|(_, n)| **n >= 1.0)
                .map(|(k, n)| format!("{k} {n:.0}"))
                .collect();
            let total = c.total_requests().unwrap_or(0.0);
            let _ = writeln!(
                t,
                "| `{name}` | {} | {total:.0} | {} | {} |",
                c.transport.unwrap_or("–"),
                entries.map_or("–".into(), |e| format!("{:.2}", total / e)),
                types.join(", ")
            );
        }
    }

    // The optimization table (soft updates).
    let opts: Vec<(&str, &str)> = [
        ("none", "None"),
        ("hard", "Hard patches"),
        ("merge", "Overlap merging"),
        ("both", "Both"),
    ]
    .into_iter()
    .filter(|(o, _)| systems.iter().any(|s| s.opt == Some(o)))
    .collect();
    if !opts.is_empty() {
        let _ = writeln!(
            t,
            "\n## Patch optimizations (quiltfs soft updates)\n\nPatches created and undo \
             bytes allocated over the workload and its sync; CPU of the server; medians.\n\n\
             | workload | optimization | patches created | undo data MB | server CPU s | wall s |\n|---|---|---|---|---|---|"
        );
        for &w in ws {
            for &(o, label) in &opts {
                let Some(sys) = systems.iter().find(|s| s.opt == Some(o)) else {
                    continue;
                };
                let Some(c) = cell(samples, sys.name, w) else {
                    continue;
                };
                let _ = writeln!(
                    t,
                    "| {} | {label} | {} | {} | {:.2} | {:.2} |",
                    w.name(),
                    c.patches.map_or("–".into(), |p| format!("{p:.0}")),
                    c.undo.map_or("–".into(), |u| format!("{:.2}", u / 1e6)),
                    c.fs,
                    c.wall.0
                );
            }
        }
    }

    t.push_str("\n## Goals\n\nThe engine issue (17):\n\n");
    for g in goals(samples) {
        let _ = writeln!(t, "- {g}");
    }
    t.push_str("\nThe FUSE path issue (18):\n\n");
    for g in fuse_goals(samples, i.tarball_entries as f64) {
        let _ = writeln!(t, "- {g}");
    }
    t.push_str("\nThe FUSE data path issue (51):\n\n");
    for g in floor_goals(samples) {
        let _ = writeln!(t, "- {g}");
    }
    t
}

/// The FUSE data path issue's goals: PostMark near the kernel's ext3 of the same
/// guarantee (ext2 for soft updates), untar near ext2, and every workload of every
/// quiltfs mode within 1.25× of libfuse's passthrough_hp over ext4.
pub fn floor_goals(samples: &[Sample]) -> Vec<String> {
    let mut g = Vec::new();
    within(
        &mut g,
        samples,
        Workload::Postmark,
        ("quilt-meta", "ext3-writeback"),
        1.5,
    );
    within(
        &mut g,
        samples,
        Workload::Postmark,
        ("quilt-full", "ext3-journal"),
        1.5,
    );
    within(
        &mut g,
        samples,
        Workload::Postmark,
        ("quilt-su", "ext2"),
        2.0,
    );
    within(&mut g, samples, Workload::Untar, ("quilt-su", "ext2"), 1.5);
    for w in super::workloads::ALL {
        for q in ["quilt-su", "quilt-meta", "quilt-full", "quilt-su-wbcache"] {
            if med(samples, q, w).is_some() {
                within(&mut g, samples, w, (q, crate::systems::FLOOR), 1.25);
            }
        }
    }
    g
}

/// The FUSE path issue's goals: soft updates within 2× of kernel ext2 and at most the
/// passthrough floor on untar and delete, every mode at least 3× faster than fuse2fs
/// there, and few requests per entry.
pub fn fuse_goals(samples: &[Sample], entries: f64) -> Vec<String> {
    let mut g = Vec::new();
    for w in [Workload::Untar, Workload::Delete] {
        within(&mut g, samples, w, ("quilt-su", "ext2"), 2.0);
        within(&mut g, samples, w, ("quilt-su", crate::systems::FLOOR), 1.0);
        for q in ["quilt-su", "quilt-meta", "quilt-full", "quilt-async"] {
            match (med(samples, q, w), med(samples, "fuse2fs", w)) {
                (Some(a), Some(b)) => g.push(format!(
                    "{}: `{q}` at least 3× faster than `fuse2fs`: {:.2}× ({a:.2} s against {b:.2} s) {}.",
                    w.name(),
                    b / a,
                    verdict(b >= 3.0 * a)
                )),
                _ => g.push(format!(
                    "{}: `{q}` against `fuse2fs`: not measured.",
                    w.name()
                )),
            }
        }
        let limit = if w == Workload::Untar { 3.0 } else { 2.0 };
        match cell(samples, "quilt-su", w).and_then(|c| c.total_requests()) {
            Some(n) if entries > 0.0 => g.push(format!(
                "{}: FUSE requests per entry (`quilt-su`) ≤ {limit}: {:.2} ({n:.0} for {entries:.0} entries) {}.",
                w.name(),
                n / entries,
                verdict(n / entries <= limit)
            )),
            _ => g.push(format!(
                "{}: FUSE requests per entry: not measured.",
                w.name()
            )),
        }
    }
    g
}

fn med(samples: &[Sample], system: &str, w: Workload) -> Option<f64> {
    cell(samples, system, w).map(|c| c.wall.0)
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "**met**"
    } else {
        "**missed**"
    }
}

/// The block cache the bench's quiltfs servers run with.
const CACHE_MIB: f64 = super::systems::CACHE_MIB as f64;

/// One "A within k× of B" goal line.
fn within(g: &mut Vec<String>, samples: &[Sample], w: Workload, (q, k): (&str, &str), factor: f64) {
    match (med(samples, q, w), med(samples, k, w)) {
        (Some(a), Some(b)) => g.push(format!(
            "{}: `{q}` within {factor}× of `{k}`: {:.2}× ({a:.2} s against {b:.2} s) {}.",
            w.name(),
            a / b,
            verdict(a <= factor * b)
        )),
        _ => g.push(format!("{}: `{q}` against `{k}`: not measured.", w.name())),
    }
}

/// The engine issue's goals, each with the measured figure; goals whose systems did not
/// run are said to be unmeasured.
pub fn goals(samples: &[Sample]) -> Vec<String> {
    let mut g = Vec::new();
    let opt = |o: &str, w: Workload| cell(samples, o, w);
    match (
        opt("quilt-su-opt-none", Workload::Untar),
        opt("quilt-su", Workload::Untar),
    ) {
        (Some(none), Some(both)) => match (none.patches, both.patches, none.undo, both.undo) {
            (Some(pn), Some(pb), Some(un), Some(ub)) if pn > 0.0 => {
                let share = 100.0 * pb / pn;
                let uc = if un > 0.0 {
                    100.0 * (1.0 - ub / un)
                } else {
                    0.0
                };
                g.push(format!(
                    "Patches created on untar ≤ 15% of the no-optimization count: {share:.1}% ({pn:.0} → {pb:.0}) {}; undo bytes cut by ≥ 99%: {uc:.2}% ({:.1} MB → {:.3} MB) {}.",
                    verdict(share <= 15.0),
                    un / 1e6,
                    ub / 1e6,
                    verdict(uc >= 99.0)
                ));
            }
            _ => g.push("Optimizations on untar: the counters are missing.".into()),
        },
        _ => g.push(
            "Optimizations on untar: not measured (needs quilt-su and quilt-su-opt-none).".into(),
        ),
    }
    within(
        &mut g,
        samples,
        Workload::Postmark,
        ("quilt-meta", "ext3-writeback"),
        1.5,
    );
    within(
        &mut g,
        samples,
        Workload::Postmark,
        ("quilt-full", "ext3-journal"),
        1.5,
    );
    within(
        &mut g,
        samples,
        Workload::Postmark,
        ("quilt-su", "ext2"),
        2.0,
    );
    within(
        &mut g,
        samples,
        Workload::Untar,
        ("quilt-full", "ext3-journal"),
        2.0,
    );
    within(
        &mut g,
        samples,
        Workload::Untar,
        ("quilt-meta", "ext3-writeback"),
        2.0,
    );
    // Memory: every quiltfs server's peak within its cache plus 64 MiB.
    let peaks: Vec<(&str, Workload, f64)> = super::SYSTEMS
        .iter()
        .filter(|s| s.is_quilt())
        .flat_map(|s| super::workloads::ALL.iter().map(move |&w| (s.name, w)))
        .filter_map(|(n, w)| Some((n, w, cell(samples, n, w)?.rss?)))
        .collect();
    match peaks.iter().max_by(|a, b| a.2.total_cmp(&b.2)) {
        Some(&(n, w, r)) => g.push(format!(
            "Server peak RSS within the cache ({CACHE_MIB:.0} MiB) + 64 MiB in every mode and workload: largest {r:.0} MiB (`{n}`, {}) {}.",
            w.name(),
            verdict(r <= CACHE_MIB + 64.0)
        )),
        None => g.push("Server peak RSS: not measured (no quiltfs server ran).".into()),
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(system: &'static str, w: Workload, run: usize, wall: f64) -> Sample {
        Sample {
            system,
            workload: w,
            run,
            wall_s: wall,
            work_s: wall,
            sync_s: 0.0,
            umount_s: 0.0,
            client_user_s: 0.1,
            client_sys_s: 0.2,
            fs_user_s: 0.3,
            fs_sys_s: 0.4,
            device_writes: 10,
            device_flushes: 1,
            patches_created: None,
            undo_bytes: None,
            patches_merged: None,
            patches_made_hard: None,
            patches_rolled_back: None,
            server_peak_rss_mib: None,
            requests: None,
            io_uring: None,
        }
    }

    #[test]
    fn cells_are_medians_with_min_and_max() {
        let s = vec![
            sample("ext2", Workload::Untar, 0, 3.0),
            sample("ext2", Workload::Untar, 1, 1.0),
            sample("ext2", Workload::Untar, 2, 2.0),
            sample("ext2", Workload::Delete, 0, 9.0),
        ];
        let c = cell(&s, "ext2", Workload::Untar).expect("cell");
        assert_eq!(c.wall, (2.0, 1.0, 3.0));
        assert!((c.cpu.0 - 1.0).abs() < 1e-9);
        assert!((c.fs - 0.7).abs() < 1e-9);
        assert!(cell(&s, "ext2", Workload::Postmark).is_none());
        assert!(cell(&s, "quilt-su", Workload::Untar).is_none());
    }

    #[test]
    fn fuse_goals_use_the_floor_fuse2fs_and_request_medians() {
        let mut s = vec![
            sample("ext2", Workload::Untar, 0, 10.0),
            sample("passthrough", Workload::Untar, 0, 15.0),
            sample("fuse2fs", Workload::Untar, 0, 60.0),
            sample("quilt-su", Workload::Untar, 0, 18.0),
            sample("quilt-su", Workload::Untar, 1, 19.0),
            sample("quilt-meta", Workload::Untar, 0, 25.0),
        ];
        let reqs = |w: u64, c: u64| -> Option<std::collections::BTreeMap<String, u64>> {
            Some([("write".to_string(), w), ("create".to_string(), c)].into())
        };
        s[3].requests = reqs(200, 100);
        s[4].requests = reqs(400, 100);
        let c = cell(&s, "quilt-su", Workload::Untar).expect("cell");
        assert_eq!(
            c.total_requests(),
            Some(400.0),
            "medians of 300 writes + 100 creates"
        );
        let g = fuse_goals(&s, 100.0);
        let find = |needle: &str| {
            g.iter()
                .find(|l| l.contains(needle))
                .unwrap_or_else(|| panic!("no goal line with {needle:?} in {g:#?}"))
                .clone()
        };
        let e2 = find("untar: `quilt-su` within 2× of `ext2`");
        assert!(e2.contains("1.85×") && e2.contains("**met**"), "{e2}");
        let floor = find("untar: `quilt-su` within 1× of `passthrough`");
        assert!(floor.contains("**missed**"), "{floor}");
        let f2 = find("untar: `quilt-su` at least 3× faster than `fuse2fs`");
        assert!(f2.contains("3.24×") && f2.contains("**met**"), "{f2}");
        let meta = find("untar: `quilt-meta` at least 3× faster");
        assert!(
            meta.contains("2.40×") && meta.contains("**missed**"),
            "{meta}"
        );
        let per = find("untar: FUSE requests per entry");
        assert!(per.contains("4.00") && per.contains("**missed**"), "{per}");
        assert!(find("delete: `quilt-su` against `ext2`").contains("not measured"));
    }

    #[test]
    fn goals_compare_the_right_systems_and_say_met_or_missed() {
        let mut s = vec![
            sample("ext3-writeback", Workload::Postmark, 0, 10.0),
            sample("quilt-meta", Workload::Postmark, 0, 14.0),
            sample("ext2", Workload::Postmark, 0, 4.0),
            sample("quilt-su", Workload::Postmark, 0, 9.0),
            sample("ext3-journal", Workload::Untar, 0, 10.0),
            sample("quilt-full", Workload::Untar, 0, 19.0),
            sample("quilt-su", Workload::Untar, 0, 7.0),
        ];
        s[1].server_peak_rss_mib = Some(150.0);
        s[3].server_peak_rss_mib = Some(201.0);
        s[6].patches_created = Some(100);
        s[6].undo_bytes = Some(5_000);
        let mut none = sample("quilt-su-opt-none", Workload::Untar, 0, 9.0);
        none.patches_created = Some(1_000);
        none.undo_bytes = Some(10_000_000);
        s.push(none);
        let g = goals(&s);
        let find = |needle: &str| {
            g.iter()
                .find(|l| l.contains(needle))
                .unwrap_or_else(|| panic!("no goal line with {needle:?} in {g:#?}"))
                .clone()
        };
        let opt = find("Patches created on untar");
        assert!(opt.contains("10.0%") && opt.contains("**met**"), "{opt}");
        assert!(opt.contains("99.95%"), "{opt}");
        let pm = find("postmark: `quilt-meta` within 1.5×");
        assert!(pm.contains("1.40×") && pm.contains("**met**"), "{pm}");
        let su = find("postmark: `quilt-su` within 2×");
        assert!(su.contains("2.25×") && su.contains("**missed**"), "{su}");
        let full = find("untar: `quilt-full` within 2×");
        assert!(full.contains("1.90×") && full.contains("**met**"), "{full}");
        assert!(find("postmark: `quilt-full` against `ext3-journal`").contains("not measured"));
        assert!(find("untar: `quilt-meta` against `ext3-writeback`").contains("not measured"));
        let rss = find("Server peak RSS");
        assert!(
            rss.contains("201 MiB") && rss.contains("`quilt-su`") && rss.contains("**missed**"),
            "{rss}"
        );
    }
}
