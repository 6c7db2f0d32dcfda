//! The BetrFS suite's report: what ran where, a table per workload (medians with
//! min–max, ratios to ext4 and to the FUSE floor), the FUSE requests of each quiltfs
//! server, rename and clone latencies by size, the native API, every goal of the
//! benchmark and FUSE data path issues as met or missed with its figure, and the plots.

use super::{Sample, Scale};
use crate::median;
use crate::plot::{self, BarRow, Spread};
use crate::systems::{System, FLOOR};
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

#[derive(Debug, Clone, serde::Serialize)]
pub struct Meta {
    pub quiltfs_version: &'static str,
    pub kernel: String,
    pub cpu: String,
    pub cores: usize,
    /// Which CPUs the suite's processes (and so the workloads and servers it starts) may
    /// run on: nobody is pinned.
    pub placement: String,
    pub quick: bool,
    pub runs: usize,
    pub scale: Scale,
    pub tarball: String,
    pub duration_s: f64,
}

impl Meta {
    pub fn gather(
        scale: &Scale,
        quick: bool,
        runs: usize,
        tarball: &Path,
        took: std::time::Duration,
    ) -> Meta {
        let (kernel, cpu) = crate::featherstitch::machine();
        let allowed = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Cpus_allowed_list"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|v| v.trim().to_string())
            })
            .unwrap_or_default();
        Meta {
            quiltfs_version: env!("CARGO_PKG_VERSION"),
            kernel,
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            placement: format!(
                "unpinned: the workloads, FUSE servers and kernel threads may run on CPUs {allowed}; \
                 quiltfs's io_uring transport serves each request on a queue of the caller's CPU"
            ),
            quick,
            runs,
            scale: scale.clone(),
            tarball: tarball.display().to_string(),
            duration_s: took.as_secs_f64(),
        }
    }
}

/// Median, min and max of the samples of one system, workload and parameter.
fn spread(samples: &[Sample], system: &str, w: &str, param: &str) -> Option<Spread> {
    let v: Vec<f64> = samples
        .iter()
        .filter(|s| s.system == system && s.workload == w && s.param == param)
        .map(|s| s.value)
        .collect();
    (!v.is_empty()).then(|| median(v))
}

fn med(samples: &[Sample], system: &str, w: &str, param: &str) -> Option<f64> {
    spread(samples, system, w, param).map(|s| s.0)
}

fn unit_of(samples: &[Sample], w: &str) -> &'static str {
    samples
        .iter()
        .find(|s| s.workload == w)
        .map_or("", |s| s.unit)
}

/// Whether a larger value is better (throughputs) or smaller (times, latencies).
fn higher_is_better(unit: &str) -> bool {
    unit.ends_with("/s")
}

const THROUGHPUT: &[&str] = &[
    "seqwrite",
    "seqread",
    "randwrite",
    "untar",
    "find",
    "grep",
    "rmrf",
    "toku1",
    "toku4",
];
const NATIVE: &[&str] = &["randwrite-native", "toku1-native", "toku4-native"];

/// How many times better `v` is than `base` (above 1: better), for times and
/// throughputs alike.
fn better_by(unit: &str, v: f64, base: f64) -> f64 {
    if higher_is_better(unit) {
        v / base
    } else {
        base / v
    }
}

/// The median count of each FUSE request type over the runs that counted them.
fn requests_med(samples: &[Sample], system: &str, w: &str) -> Option<BTreeMap<String, f64>> {
    let runs: Vec<&BTreeMap<String, u64>> = samples
        .iter()
        .filter(|s| s.system == system && s.workload == w)
        .filter_map(|s| s.requests.as_ref())
        .collect();
    if runs.is_empty() {
        return None;
    }
    let mut types: Vec<&String> = runs.iter().flat_map(|r| r.keys()).collect();
    types.sort();
    types.dedup();
    Some(
        types
            .into_iter()
            .map(|t| {
                let v = runs
                    .iter()
                    .map(|r| r.get(t).copied().unwrap_or(0) as f64)
                    .collect();
                (t.clone(), median(v).0)
            })
            .collect(),
    )
}

fn cpu_med(samples: &[Sample], system: &str, w: &str) -> Option<(f64, f64)> {
    let v: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.system == system && s.workload == w)
        .collect();
    if v.is_empty() {
        return None;
    }
    Some((
        median(v.iter().map(|s| s.client_cpu_s).collect()).0,
        median(v.iter().map(|s| s.fs_cpu_s).collect()).0,
    ))
}

pub fn markdown(
    meta: &Meta,
    systems: &[System],
    chosen: &[&str],
    samples: &[Sample],
    checks: &[String],
) -> String {
    let mut o = String::new();
    let sc = &meta.scale;
    let _ = writeln!(o, "# quiltfs bench betrfs\n");
    let _ = writeln!(
        o,
        "quiltfs {} on Linux {} ({}, {} CPUs); {} run(s){}, {:.0} s in all. Placement: {}.\n",
        meta.quiltfs_version,
        meta.kernel,
        meta.cpu,
        meta.cores,
        meta.runs,
        if meta.quick { ", quick sizes" } else { "" },
        meta.duration_s,
        meta.placement
    );
    let _ = writeln!(
        o,
        "Sizes (scaled from the papers to this machine): a {} MiB file written and read in {} KiB \
         requests (papers: 10 GiB); {} random 4-byte writes into it (papers: 256 Ki); TokuBench \
         {} files (papers: 3 M); renames and clones of directories of {:?} files and of the linux \
         source ({}); a {} MiB file cloned (issue: 1 GiB); images of {} MiB. Phases that write are \
         timed until durable and unmounted; `find`, `grep` and `seqread` start cold and are timed \
         alone; rename and clone are single calls (the process, for clones), timed alone.\n",
        sc.seq_bytes >> 20,
        sc.seq_io >> 10,
        sc.rand_writes,
        sc.toku_files,
        sc.name_sizes,
        meta.tarball,
        sc.clone_file_bytes >> 20,
        sc.image_mib
    );
    let _ = writeln!(o, "| system | what |\n|---|---|");
    for s in systems {
        let _ = writeln!(o, "| {} | {} |", s.name, s.what);
    }
    // Throughputs and times.
    let _ = writeln!(o, "\n## Workloads\n");
    let _ = writeln!(
        o,
        "Medians [min–max] over the runs; the ratios are to ext4 and to the FUSE floor \
         (`{FLOOR}`: libfuse's passthrough_hp over ext4), above 1 better than it, for times \
         and throughputs alike; CPU is the workload's and the file system's own (FUSE server \
         or kernel thread), seconds.\n"
    );
    for &w in THROUGHPUT {
        let untar_for_dirs =
            w == "untar" && chosen.iter().any(|c| ["find", "grep", "rmrf"].contains(c));
        if !(chosen.contains(&w) || untar_for_dirs) {
            continue;
        }
        let unit = unit_of(samples, w);
        if unit.is_empty() {
            continue;
        }
        let _ = writeln!(o, "### {w} ({unit})\n\n| system | median | min–max | vs ext4 | vs floor | CPU (client + fs) |\n|---|---|---|---|---|---|");
        let base = med(samples, "ext4", w, "");
        let floor = med(samples, FLOOR, w, "");
        for s in systems {
            let Some(m) = spread(samples, s.name, w, "") else {
                continue;
            };
            let ratio = |to: Option<f64>| {
                to.map_or("—".to_string(), |b| {
                    format!("{:.2}×", better_by(unit, m.0, b))
                })
            };
            let cpu = cpu_med(samples, s.name, w)
                .map_or(String::new(), |(c, f)| format!("{c:.1} + {f:.1}"));
            let _ = writeln!(
                o,
                "| {} | {} | {}–{} | {} | {} | {cpu} |",
                s.name,
                plot::number(m.0),
                plot::number(m.1),
                plot::number(m.2),
                ratio(base),
                ratio(floor)
            );
        }
        let _ = writeln!(o);
    }
    // FUSE requests per workload, for the quiltfs systems (their servers count them).
    let mut head = false;
    for &w in THROUGHPUT {
        let rows: Vec<(&str, BTreeMap<String, f64>)> = systems
            .iter()
            .filter_map(|s| Some((s.name, requests_med(samples, s.name, w)?)))
            .collect();
        if rows.is_empty() {
            continue;
        }
        if !head {
            let _ = writeln!(
                o,
                "## FUSE requests\n\nRequests each quiltfs server answered over the timed phase \
                 (the workload and, for phases that write, the sync), medians of each type.\n\n\
                 | workload | system | requests | by type |\n|---|---|---|---|"
            );
            head = true;
        }
        for (name, reqs) in rows {
            let total: f64 = reqs.values().sum();
            let mut by: Vec<(&String, &f64)> = reqs.iter().filter(|(_, n)| **n >= 1.0).collect();
            by.sort_by(|a, b| b.1.total_cmp(a.1));
            let types: Vec<String> = by.iter().map(|(k, n)| format!("{k} {n:.0}")).collect();
            let _ = writeln!(o, "| {w} | {name} | {total:.0} | {} |", types.join(", "));
        }
    }
    if head {
        let _ = writeln!(o);
    }
    // Latencies.
    for w in ["rename", "clone", "seek"] {
        if !chosen.contains(&w) {
            continue;
        }
        let mut params: Vec<String> = Vec::new();
        for s in samples.iter().filter(|s| s.workload == w) {
            if !params.contains(&s.param) {
                params.push(s.param.clone());
            }
        }
        if params.is_empty() {
            continue;
        }
        let _ = writeln!(
            o,
            "## {w} latency (ms, median of every call)\n\n{}\n",
            if w == "rename" {
                "rename(2) of a directory holding that many files (in subdirectories of 100), and of the linux tree, back and forth."
            } else if w == "seek" {
                "lseek(2) on a file the size of the clone's with a 64 KiB hole in its middle and a 1 MiB hole at its end, the first call cold: `hole`: SEEK_HOLE from 0; `data`: SEEK_DATA from the middle hole; `map`: the whole extent map (SEEK_DATA and SEEK_HOLE in turn, as `cp --sparse` does)."
            } else {
                "`quiltfs clone` on betrfs, `cp -r --reflink=always` on btrfs and xfs (the others cannot share storage); `file-cp`: `cp --reflink=always` of the large file (on betrfs through libquilt_preload.so), `file`: `quiltfs clone` of it."
            }
        );
        let _ = writeln!(o, "| system | {} |", params.join(" | "));
        let _ = writeln!(o, "|---|{}", "---|".repeat(params.len()));
        for s in systems {
            if !samples
                .iter()
                .any(|x| x.system == s.name && x.workload == w)
            {
                continue;
            }
            let cells: Vec<String> = params
                .iter()
                .map(|p| med(samples, s.name, w, p).map_or("—".into(), plot::number))
                .collect();
            let _ = writeln!(o, "| {} | {} |", s.name, cells.join(" | "));
        }
        let _ = writeln!(o);
    }
    // The native API.
    if samples.iter().any(|s| NATIVE.contains(&s.workload)) {
        let _ = writeln!(
            o,
            "## The native API (no FUSE)\n\nThe same random writes and TokuBench through the module's library calls on the same kind of image; the mount's figure beside it.\n\n| system | workload | native | through the mount | native / mount |\n|---|---|---|---|---|"
        );
        for s in systems {
            for &w in NATIVE {
                let Some(n) = med(samples, s.name, w, "") else {
                    continue;
                };
                let mw = w.trim_end_matches("-native");
                let m = med(samples, s.name, mw, "");
                let _ = writeln!(
                    o,
                    "| {} | {mw} ({}) | {} | {} | {} |",
                    s.name,
                    unit_of(samples, w),
                    plot::number(n),
                    m.map_or("—".into(), plot::number),
                    m.map_or("—".into(), |m| format!("{:.1}×", n / m))
                );
            }
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(o, "## Goals (medians of this run)\n");
    for g in goals(samples, meta) {
        let _ = writeln!(o, "- {g}");
    }
    let _ = writeln!(o, "\n## Checks after each group\n");
    for c in checks {
        let _ = writeln!(o, "- {c}");
    }
    o
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "**met**"
    } else {
        "**missed**"
    }
}

/// The benchmark issue's goals, each with its figure; unmeasured ones say so.
pub fn goals(samples: &[Sample], meta: &Meta) -> Vec<String> {
    let mut g = Vec::new();
    let m = |sys: &str, w: &str| med(samples, sys, w, "");
    let pair = |w: &str| (m("betrfs", w), m("ext4", w));
    match pair("randwrite") {
        (Some(b), Some(e)) => g.push(format!(
            "Random 4-byte writes + fsync through the mount at least as fast as ext4: {:.0} against {:.0} writes/s ({:.2}×) {}.",
            b, e, b / e, verdict(b >= e)
        )),
        _ => g.push("Random writes through the mount against ext4: not measured.".into()),
    }
    match (m("betrfs", "randwrite-native"), m("ext4", "randwrite")) {
        (Some(b), Some(e)) => g.push(format!(
            "Random 4-byte writes + fsync through the native API ≥ 10× ext4: {:.0} against {:.0} writes/s ({:.1}×) {}.",
            b, e, b / e, verdict(b >= 10.0 * e)
        )),
        _ => g.push("Random writes through the native API against ext4: not measured.".into()),
    }
    match (
        m("betrfs", "toku4"),
        m("fuse2fs", "toku4"),
        m("ext4", "toku4"),
    ) {
        (Some(b), f, e) => {
            if let Some(f) = f {
                g.push(format!(
                    "TokuBench, 4 threads, ≥ 10× fuse2fs: {:.0} against {:.0} files/s ({:.1}×) {}.",
                    b,
                    f,
                    b / f,
                    verdict(b >= 10.0 * f)
                ));
            }
            if let Some(e) = e {
                g.push(format!(
                    "TokuBench, 4 threads, ≥ 0.5× ext4: {:.0} against {:.0} files/s ({:.2}×) {}.",
                    b,
                    e,
                    b / e,
                    verdict(b >= 0.5 * e)
                ));
            }
        }
        _ => g.push("TokuBench: not measured.".into()),
    }
    for (w, k) in [("find", 2.0), ("grep", 1.2), ("rmrf", 2.0)] {
        if let (Some(b), Some(e)) = pair(w) {
            g.push(format!(
                "`{w}` ≤ {k}× ext4: {:.2} s against {:.2} s ({:.2}×) {}.",
                b,
                e,
                b / e,
                verdict(b <= k * e)
            ));
        }
    }
    for w in ["seqwrite", "seqread"] {
        if let (Some(b), Some(e)) = pair(w) {
            g.push(format!(
                "`{w}` ≥ 0.7× ext4: {:.0} against {:.0} MB/s ({:.2}×) {}.",
                b,
                e,
                b / e,
                verdict(b >= 0.7 * e)
            ));
        }
    }
    // The FUSE data path issue (51): sequential I/O near ext4 on both modules, and
    // every workload within 1.25× of the floor.
    for sys in ["quilt-su", "quilt-su-wbcache", "betrfs"] {
        for (w, k) in [("seqwrite", 0.5), ("seqread", 0.8)] {
            if let (Some(b), Some(e)) = (m(sys, w), m("ext4", w)) {
                g.push(format!(
                    "`{sys}` `{w}` ≥ {k}× ext4: {b:.0} against {e:.0} MB/s ({:.2}×) {}.",
                    b / e,
                    verdict(b >= k * e)
                ));
            }
        }
        for &w in THROUGHPUT {
            let unit = unit_of(samples, w);
            if let (Some(b), Some(f)) = (m(sys, w), m(FLOOR, w)) {
                // "Within 1.25× of its time": a throughput at least 1/1.25 of it.
                let x = better_by(unit, b, f);
                g.push(format!(
                    "`{sys}` `{w}` within 1.25× of `{FLOOR}`: {} against {} {unit} ({:.2}× its time) {}.",
                    plot::number(b),
                    plot::number(f),
                    1.0 / x,
                    verdict(x >= 1.0 / 1.25)
                ));
            }
        }
    }
    let lat = |sys: &str, w: &str, p: &str| med(samples, sys, w, p);
    if let (Some(big), Some(small)) = (
        lat("betrfs", "rename", "linux"),
        lat("betrfs", "rename", "10"),
    ) {
        g.push(format!(
            "Rename of the linux tree ≤ 10 ms: {big:.3} ms {}; within 2× of 10 files ({small:.3} ms): {:.2}× {}.",
            verdict(big <= 10.0),
            big / small,
            verdict(big <= 2.0 * small)
        ));
    }
    if let Some(c) = lat("betrfs", "clone", "linux") {
        let peers: Vec<(String, f64)> = ["btrfs", "xfs"]
            .iter()
            .filter_map(|p| lat(p, "clone", "linux").map(|v| (p.to_string(), v)))
            .collect();
        let mut line = format!(
            "Clone of the linux tree ≤ 1 s: {c:.1} ms {}",
            verdict(c <= 1000.0)
        );
        for (p, v) in &peers {
            let _ = write!(
                line,
                "; {:.0}× faster than `cp -r --reflink` on {p} ({v:.0} ms)",
                v / c
            );
        }
        if let Some(best) = peers.iter().map(|p| p.1).reduce(f64::min) {
            let _ = write!(line, " (≥ 5×: {})", verdict(best >= 5.0 * c));
        }
        g.push(line + ".");
    }
    if let Some(p) = lat("betrfs", "clone-writes", "copied") {
        g.push(format!(
            "After writing 1% of a clone's files, under 5% of the clone copied: {p:.2}% {}.",
            verdict(p < 5.0)
        ));
    }
    if let Some(h) = lat("betrfs", "seek", "hole") {
        let ext4 =
            lat("ext4", "seek", "hole").map_or(String::new(), |e| format!(" (ext4 {e:.3} ms)"));
        g.push(format!(
            "SEEK_HOLE on a {} MiB sparse file ≤ 10 ms: {h:.3} ms{ext4} {}{}.",
            meta.scale.clone_file_bytes >> 20,
            verdict(h <= 10.0),
            if meta.scale.clone_file_bytes < 1 << 30 {
                " (quick sizes: the issue's file is 1 GiB)"
            } else {
                ""
            }
        ));
    }
    if let Some(f) = lat("betrfs", "clone", "file") {
        g.push(format!(
            "Clone of a {} MiB file ≤ 10 ms: {f:.2} ms {}{}.",
            meta.scale.clone_file_bytes >> 20,
            verdict(f <= 10.0),
            if meta.scale.clone_file_bytes < 1 << 30 {
                " (quick sizes: the issue's file is 1 GiB)"
            } else {
                ""
            }
        ));
    }
    g
}

/// Bars for every throughput and time workload (native beside the mount's), lines for
/// rename and clone latency by size.
pub fn plots(out: &Path, systems: &[System], samples: &[Sample]) -> Result<Vec<String>> {
    if !plot::font() {
        return Ok(Vec::new());
    }
    let mut written = Vec::new();
    for &w in THROUGHPUT {
        let unit = unit_of(samples, w);
        if unit.is_empty() {
            continue;
        }
        let native = format!("{w}-native");
        let has_native = samples.iter().any(|s| s.workload == native);
        let rows: Vec<BarRow> = systems
            .iter()
            .filter_map(|s| {
                let a = spread(samples, s.name, w, "");
                let b = has_native
                    .then(|| spread(samples, s.name, &native, ""))
                    .flatten();
                (a.is_some() || b.is_some()).then(|| {
                    let mut v = vec![a];
                    if has_native {
                        v.push(b);
                    }
                    (s.name.to_string(), v)
                })
            })
            .collect();
        if rows.is_empty() {
            continue;
        }
        let name = format!("{w}.png");
        let series: &[&str] = if has_native {
            &["through the mount", "native API"]
        } else {
            &["through the mount"]
        };
        plot::bars(&out.join(&name), w, unit, series, &rows)
            .with_context(|| format!("drawing {name}"))?;
        written.push(name);
    }
    for w in ["rename", "clone"] {
        let series: Vec<(String, Vec<(f64, f64)>)> = systems
            .iter()
            .filter_map(|s| {
                let mut params: Vec<&str> = samples
                    .iter()
                    .filter(|x| x.system == s.name && x.workload == w)
                    .map(|x| x.param.as_str())
                    .collect();
                params.sort_unstable();
                params.dedup();
                let mut pts: Vec<(f64, f64)> = params
                    .into_iter()
                    .filter_map(|p| Some((p.parse::<f64>().ok()?, med(samples, s.name, w, p)?)))
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                (!pts.is_empty()).then(|| (s.name.to_string(), pts))
            })
            .collect();
        if series.is_empty() {
            continue;
        }
        let name = format!("{w}-latency.png");
        plot::lines(
            &out.join(&name),
            &format!("{w} latency by directory size"),
            "files in the directory",
            "ms",
            &series,
        )
        .with_context(|| format!("drawing {name}"))?;
        written.push(name);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(
        system: &'static str,
        workload: &'static str,
        value: f64,
        unit: &'static str,
    ) -> Sample {
        Sample {
            system,
            workload,
            param: String::new(),
            run: 0,
            value,
            unit,
            wall_s: 1.0,
            client_cpu_s: 0.0,
            fs_cpu_s: 0.0,
            device_write_mb: 0.0,
            requests: None,
        }
    }

    fn meta() -> Meta {
        Meta {
            quiltfs_version: "0",
            kernel: String::new(),
            cpu: String::new(),
            cores: 2,
            placement: String::new(),
            quick: false,
            runs: 3,
            scale: Scale::new(false),
            tarball: String::new(),
            duration_s: 0.0,
        }
    }

    fn line<'a>(g: &'a [String], needle: &str) -> &'a str {
        g.iter()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no goal line with {needle:?} in {g:#?}"))
    }

    #[test]
    fn floor_goals_read_throughputs_and_times_the_right_way_round() {
        let s = vec![
            sample("passthrough", "seqwrite", 200.0, "MB/s"),
            sample("quilt-su", "seqwrite", 170.0, "MB/s"),
            sample("betrfs", "seqwrite", 150.0, "MB/s"),
            sample("passthrough", "untar", 10.0, "s"),
            sample("quilt-su", "untar", 12.0, "s"),
            sample("betrfs", "untar", 13.0, "s"),
            sample("ext4", "seqwrite", 400.0, "MB/s"),
        ];
        let g = goals(&s, &meta());
        // 200/170 = 1.18× the floor's time: within 1.25×; 200/150 = 1.33×: not.
        let l = line(&g, "`quilt-su` `seqwrite` within 1.25×");
        assert!(l.contains("1.18×") && l.contains("**met**"), "{l}");
        let l = line(&g, "`betrfs` `seqwrite` within 1.25×");
        assert!(l.contains("1.33×") && l.contains("**missed**"), "{l}");
        // Times: 12/10 = 1.2×, met; 13/10 = 1.3×, missed.
        let l = line(&g, "`quilt-su` `untar` within 1.25×");
        assert!(l.contains("1.20×") && l.contains("**met**"), "{l}");
        let l = line(&g, "`betrfs` `untar` within 1.25×");
        assert!(l.contains("1.30×") && l.contains("**missed**"), "{l}");
        let l = line(&g, "`quilt-su` `seqwrite` ≥ 0.5× ext4");
        assert!(l.contains("0.42×") && l.contains("**missed**"), "{l}");
    }

    #[test]
    fn request_counts_are_medians_per_type_over_the_runs_that_counted() {
        let reqs =
            |w: u64, g: u64| Some([("write".to_string(), w), ("getattr".to_string(), g)].into());
        let mut s = vec![
            sample("quilt-su", "seqwrite", 1.0, "MB/s"),
            sample("quilt-su", "seqwrite", 1.0, "MB/s"),
            sample("quilt-su", "seqwrite", 1.0, "MB/s"),
            sample("quilt-su", "seqwrite", 1.0, "MB/s"),
        ];
        s[0].requests = reqs(100, 1);
        s[1].requests = reqs(300, 3);
        s[2].requests = reqs(200, 0);
        // The fourth run counted nothing (a system without counters): not a zero.
        let m = requests_med(&s, "quilt-su", "seqwrite").expect("counted");
        assert_eq!(m["write"], 200.0);
        assert_eq!(m["getattr"], 1.0);
        assert!(requests_med(&s, "ext4", "seqwrite").is_none());
    }
}
