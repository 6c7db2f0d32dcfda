//! The Gnothi suite's report: throughput tables and bars per f, ratios to G′ and to a
//! local disk, bytes stored per replica, the catch-up timelines, and the goals.

use super::{Row, Stored, Timeline, SYSTEMS};
use crate::{median, plot};
use anyhow::Result;
use std::fmt::Write as _;
use std::path::Path;

#[derive(Debug, serde::Serialize)]
pub struct Meta {
    pub quick: bool,
    pub runs: usize,
    pub seconds: u64,
    pub size_mib: u64,
    pub disks: String,
    pub elapsed_s: f64,
}

/// Median, min and max MB/s of the runs of one cell; None if none.
fn cell(rows: &[Row], system: &str, f: u16, workload: &str, bs: usize) -> Option<(f64, f64, f64)> {
    let v: Vec<f64> = rows
        .iter()
        .filter(|r| r.system == system && r.workload == workload && r.block_size == bs)
        .filter(|r| r.f == f || system == "local")
        .map(|r| r.mb_per_s)
        .collect();
    (!v.is_empty()).then(|| median(v))
}

fn ratio(a: Option<(f64, f64, f64)>, b: Option<(f64, f64, f64)>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b.0 > 0.0 => Some(a.0 / b.0),
        _ => None,
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or("–".into(), |r| format!("{r:.2}×"))
}

fn goal(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "met",
        Some(false) => "**not met**",
        None => "not judged",
    }
}

pub fn write(
    out: &Path,
    meta: &Meta,
    rows: &[Row],
    stored: &[Stored],
    timelines: &[Timeline],
) -> Result<()> {
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "meta": meta, "rows": rows, "stored": stored, "timelines": timelines,
        }))?,
    )?;
    std::fs::write(out.join("results.csv"), crate::csv(rows)?)?;
    std::fs::write(out.join("stored.csv"), crate::csv(stored)?)?;
    let plots = plot::font();

    let mut md = String::new();
    writeln!(md, "# Gnothi: replicated block storage, regenerated\n")?;
    writeln!(
        md,
        "{} run(s) of {} s per measurement, a {} MiB volume, devices: {}{}; {:.0} s in all. \
         Replicas are processes on this machine talking gRPC over loopback; the client is \
         the bench. MB/s are 10^6 bytes a second over the last 80% of each run (median, \
         min–max over runs).\n",
        meta.runs,
        meta.seconds,
        meta.size_mib,
        if meta.disks == "model" {
            "7200 RPM disks (modelled, write cache on), two per replica"
        } else {
            "plain files"
        },
        if meta.quick {
            " (quick mode: figures are not for reading ratios)"
        } else {
            ""
        },
        meta.elapsed_s
    )?;
    writeln!(md, "Systems:\n")?;
    for (s, what) in SYSTEMS {
        writeln!(md, "- `{s}`: {what}")?;
    }
    writeln!(md)?;

    let mut fs: Vec<u16> = rows.iter().filter(|r| r.f > 0).map(|r| r.f).collect();
    fs.sort_unstable();
    fs.dedup();
    let mut sizes: Vec<usize> = rows
        .iter()
        .filter(|r| !is_recovery(&r.workload))
        .map(|r| r.block_size)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let workloads = ["randwrite", "seqwrite", "randread", "seqread"];
    let present: Vec<&str> = SYSTEMS
        .iter()
        .map(|s| s.0)
        .filter(|s| {
            rows.iter()
                .any(|r| r.system == *s && !is_recovery(&r.workload))
        })
        .collect();
    let mut goals: Vec<(String, Option<bool>, String)> = Vec::new();
    for &f in &fs {
        writeln!(md, "## Throughput, f = {f} ({} replicas)\n", 2 * f + 1)?;
        // Ceph's pool of size 3 is measured at f = 1 only.
        let present: Vec<&str> = present
            .iter()
            .copied()
            .filter(|s| *s != "ceph-rbd" || f == 1)
            .collect();
        write!(md, "| workload | request |")?;
        for s in &present {
            write!(md, " {s} MB/s |")?;
        }
        let with_ceph = f == 1 && present.contains(&"ceph-rbd");
        write!(md, " gnothi ÷ gprime | gnothi ÷ local |")?;
        writeln!(
            md,
            "{}",
            if with_ceph {
                " gnothi ÷ ceph-rbd |"
            } else {
                ""
            }
        )?;
        write!(md, "|---|---:|")?;
        for _ in &present {
            write!(md, "---:|")?;
        }
        writeln!(md, "---:|---:|{}", if with_ceph { "---:|" } else { "" })?;
        let mut bar_rows: Vec<plot::BarRow> = present
            .iter()
            .map(|s| (s.to_string(), Vec::new()))
            .collect();
        let mut series = Vec::new();
        for w in workloads {
            for &bs in &sizes {
                if !rows.iter().any(|r| r.workload == w && r.block_size == bs) {
                    continue;
                }
                series.push(format!("{w} {} KiB", bs >> 10));
                write!(md, "| {w} | {} KiB |", bs >> 10)?;
                for (i, s) in present.iter().enumerate() {
                    let c = cell(rows, s, f, w, bs);
                    bar_rows[i].1.push(c);
                    match c {
                        Some((m, lo, hi)) if meta.runs > 1 => {
                            write!(md, " {m:.2} ({lo:.2}–{hi:.2}) |")?
                        }
                        Some((m, _, _)) => write!(md, " {m:.2} |")?,
                        None => write!(md, " – |")?,
                    }
                }
                let g = cell(rows, "gnothi", f, w, bs);
                let vs_g = ratio(g, cell(rows, "gprime", f, w, bs));
                let vs_l = ratio(g, cell(rows, "local", f, w, bs));
                write!(md, " {} | {} |", fmt_ratio(vs_g), fmt_ratio(vs_l))?;
                if with_ceph {
                    let vs_c = ratio(g, cell(rows, "ceph-rbd", f, w, bs));
                    write!(md, " {} |", fmt_ratio(vs_c))?;
                    if w.ends_with("write") {
                        goals.push((
                            format!("{w} {} KiB, plain files: gnothi ≥ 1.5× ceph-rbd", bs >> 10),
                            vs_c.map(|r| r >= 1.5),
                            fmt_ratio(vs_c),
                        ));
                    }
                }
                writeln!(md)?;
                let want = match (w, f) {
                    ("randwrite", 1) => Some(1.45),
                    ("randwrite", _) => Some(1.6),
                    ("seqwrite", _) => Some(1.45),
                    _ => None,
                };
                if let Some(want) = want {
                    goals.push((
                        format!("{w} {} KiB, f={f}: gnothi ≥ {want}× gprime", bs >> 10),
                        vs_g.map(|r| r >= want),
                        fmt_ratio(vs_g),
                    ));
                }
                if w.ends_with("read") {
                    goals.push((
                        format!(
                            "{w} {} KiB, f={f}: gnothi no more than 5% below gprime",
                            bs >> 10
                        ),
                        vs_g.map(|r| (0.95..=1.05).contains(&r) || r > 1.05),
                        fmt_ratio(vs_g),
                    ));
                }
                if w == "randread" && bs == 4096 && f == 1 {
                    goals.push((
                        "randread 4 KiB, f=1: gnothi ≥ 2.5× local".into(),
                        vs_l.map(|r| r >= 2.5),
                        fmt_ratio(vs_l),
                    ));
                }
            }
        }
        writeln!(md)?;
        if plots && !series.is_empty() {
            let name = format!("throughput-f{f}.png");
            let refs: Vec<&str> = series.iter().map(String::as_str).collect();
            plot::bars(
                &out.join(&name),
                &format!("Client throughput, f = {f}"),
                "MB/s",
                &refs,
                &bar_rows,
            )?;
            writeln!(md, "![throughput, f = {f}]({name})\n")?;
        }
    }

    if !stored.is_empty() {
        writeln!(md, "## Bytes stored per replica\n")?;
        writeln!(
            md,
            "Volume data each replica keeps at home after the runs (allocated bytes of its data \
             device's home area; the reserve is counted apart, in blocks in use), against the \
             volume's size.\n"
        )?;
        writeln!(
            md,
            "| system | f | replica | home MiB | ÷ volume | reserve blocks in use |"
        )?;
        writeln!(md, "|---|---:|---:|---:|---:|---:|")?;
        let last_run = stored.iter().map(|s| s.run).max().unwrap_or(0);
        for s in stored.iter().filter(|s| s.run == last_run) {
            writeln!(
                md,
                "| {} | {} | {} | {:.0} | {:.2} | {} |",
                s.system,
                s.f,
                s.replica,
                s.home_bytes as f64 / 1048576.0,
                s.home_bytes as f64 / s.volume_bytes.max(1) as f64,
                s.reserve_used_blocks
            )?;
        }
        writeln!(md)?;
        for &f in &fs {
            let mean = |sys: &str| {
                let v: Vec<f64> = stored
                    .iter()
                    .filter(|s| s.system == sys && s.f == f && s.run == last_run)
                    .map(|s| s.home_bytes as f64)
                    .collect();
                (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
            };
            if let (Some(g), Some(p)) = (mean("gnothi"), mean("gprime")) {
                let ideal = f64::from(f + 1) / f64::from(2 * f + 1);
                goals.push((
                    format!(
                        "f={f}: data per replica ≈ (f+1)/(2f+1) = {ideal:.2} of G′'s (within 0.1)"
                    ),
                    Some(g / p <= ideal + 0.1),
                    format!("{:.2}", g / p),
                ));
            }
        }
    }

    let catchups: Vec<&Row> = rows.iter().filter(|r| r.workload == "catchup").collect();
    if !catchups.is_empty() {
        writeln!(md, "## Catch-up recovery (f = 1, random 1 MiB writes)\n")?;
        writeln!(
            md,
            "A follower is killed, restarted later, and recovers: Phase 1 brings its \
             metadata up to the leader's log index at the restart; Phase 2 fetches the \
             blocks of its preferred slices that it holds INCOMPLETE, one 16 MiB request \
             per recovery interval. Throughput is the clients' while the replica \
             recovers (restart to the end of Phase 2, or to the cap).\n"
        )?;
        recovery_table(
            &mut md,
            &catchups,
            "during recovery",
            "recovery s",
            "caught up",
            true,
        )?;
        writeln!(md)?;
        let mut intervals: Vec<u64> = catchups
            .iter()
            .filter_map(|r| r.recovery_interval_ms)
            .collect();
        intervals.sort_unstable();
        intervals.dedup();
        for &i in &intervals {
            let at = |sys: &str| -> Vec<&Row> {
                catchups
                    .iter()
                    .copied()
                    .filter(|r| r.system == sys && r.recovery_interval_ms == Some(i))
                    .collect()
            };
            let g = at("gnothi");
            if !g.is_empty() {
                goals.push((
                    format!("gnothi recovers at interval {i} ms"),
                    Some(g.iter().all(|r| r.caught_up == Some(true))),
                    format!(
                        "{} of {}",
                        g.iter().filter(|r| r.caught_up == Some(true)).count(),
                        g.len()
                    ),
                ));
            }
            let p = at("gprime");
            let med = |v: &[&Row]| median(v.iter().map(|r| r.mb_per_s).collect()).0;
            if !g.is_empty() && !p.is_empty() && med(&p) > 0.0 {
                let r = med(&g) / med(&p);
                goals.push((
                    format!(
                        "interval {i} ms: client throughput while recovering, gnothi ≥ 3× gprime"
                    ),
                    Some(r >= 3.0),
                    format!("{r:.2}×"),
                ));
            }
            if plots {
                let tls: Vec<&Timeline> = timelines
                    .iter()
                    .filter(|t| {
                        t.workload == "catchup" && t.recovery_interval_ms == i && t.run == 0
                    })
                    .collect();
                let name = format!("catchup-{i}ms.png");
                timeline_plot(
                    &out.join(&name),
                    &format!("Catch-up, recovery interval {i} ms (f = 1, random 1 MiB writes)"),
                    &tls,
                )?;
                writeln!(md, "![catch-up at {i} ms]({name})\n")?;
            }
        }
    }

    let rebuilds: Vec<&Row> = rows
        .iter()
        .filter(|r| r.workload == "rereplication")
        .collect();
    if !rebuilds.is_empty() {
        writeln!(md, "## Re-replication (f = 1, random 1 MiB writes)\n")?;
        writeln!(
            md,
            "A follower's data disk is replaced by an empty one under load (`quiltfs \
             cluster replace-disk`): the volume is told it holds nothing, and it \
             rebuilds every block of its preferred slices (Phase 2), while G′'s \
             replica rebuilds every block of the volume. Throughput is the clients' \
             from the replacement to the end of the rebuild.\n"
        )?;
        recovery_table(
            &mut md,
            &rebuilds,
            "during rebuild",
            "rebuild s",
            "rebuilt",
            false,
        )?;
        writeln!(md)?;
        let of = |sys: &str| -> Vec<&Row> {
            rebuilds
                .iter()
                .copied()
                .filter(|r| r.system == sys)
                .collect()
        };
        let (g, p) = (of("gnothi"), of("gprime"));
        if !g.is_empty() {
            goals.push((
                "gnothi re-replication completes".into(),
                Some(g.iter().all(|r| r.caught_up == Some(true))),
                format!(
                    "{} of {}",
                    g.iter().filter(|r| r.caught_up == Some(true)).count(),
                    g.len()
                ),
            ));
        }
        let med = |v: &[&Row]| median(v.iter().map(|r| r.mb_per_s).collect()).0;
        if !g.is_empty() && !p.is_empty() && med(&p) > 0.0 {
            let r = med(&g) / med(&p);
            goals.push((
                "re-replication: client throughput while rebuilding, gnothi ≥ 3× gprime".into(),
                Some(r >= 3.0),
                format!("{r:.2}×"),
            ));
        }
        if plots {
            let tls: Vec<&Timeline> = timelines
                .iter()
                .filter(|t| t.workload == "rereplication" && t.run == 0)
                .collect();
            timeline_plot(
                &out.join("rereplication.png"),
                "Re-replication onto an empty data disk (f = 1, random 1 MiB writes)",
                &tls,
            )?;
            writeln!(md, "![re-replication](rereplication.png)\n")?;
        }
    }

    let phase1: Vec<&Row> = rows.iter().filter(|r| r.workload == "phase1").collect();
    if !phase1.is_empty() {
        writeln!(md, "## Phase 1 after many small writes (Gnothi, f = 1)\n")?;
        writeln!(
            md,
            "A follower is killed and restarted with nothing missed (the restart's own \
             cost: the process's start, reading its log and devices, rejoining); then \
             killed again while the clients write random 4 KiB blocks, and restarted \
             after they stop. Phase 1 ends when it has applied the leader's log index. \
             The marginal cost is the difference, per missed write.\n"
        )?;
        writeln!(
            md,
            "| run | missed writes | missed entries | writes/s while down | restart, nothing missed, s | Phase 1 s | marginal s per 100,000 writes | s per 100,000 writes, restart included |"
        )?;
        writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|")?;
        let per_100k = |r: &Row, t: f64| t / (r.missed_writes.unwrap_or(0).max(1) as f64 / 1e5);
        let marginal = |r: &Row| Some(per_100k(r, (r.phase1_s? - r.phase1_baseline_s?).max(0.0)));
        let total = |r: &Row| Some(per_100k(r, r.phase1_s?));
        let s2 = |v: Option<f64>| v.map_or("–".into(), |s| format!("{s:.2}"));
        for r in &phase1 {
            writeln!(
                md,
                "| {} | {} | {} | {:.0} | {} | {} | {} | {} |",
                r.run + 1,
                r.missed_writes.unwrap_or(0),
                r.missed_entries.unwrap_or(0),
                r.mb_per_s * 1e6 / r.block_size.max(1) as f64,
                s2(r.phase1_baseline_s),
                r.phase1_s
                    .map_or("not within the cap".into(), |s| format!("{s:.2}")),
                s2(marginal(r)),
                s2(total(r)),
            )?;
        }
        writeln!(md)?;
        let fewest = phase1
            .iter()
            .filter_map(|r| r.missed_writes)
            .min()
            .unwrap_or(0);
        for (what, f) in [
            ("marginal", &marginal as &dyn Fn(&Row) -> Option<f64>),
            ("restart included", &total),
        ] {
            let all: Option<Vec<f64>> = phase1.iter().map(|r| f(r)).collect();
            let (verdict, measured) = match all {
                // Below 10,000 missed writes timing noise dominates: no verdict.
                Some(v) => {
                    let m = median(v).0;
                    (
                        (fewest >= 10_000).then_some(m <= 1.0),
                        format!("{m:.2} s (median)"),
                    )
                }
                None => (Some(false), "not caught up within the cap".into()),
            };
            goals.push((
                format!(
                    "Phase 1 ≤ 1 s per 100,000 missed writes, {what} (at least {fewest} missed)"
                ),
                verdict,
                measured,
            ));
        }
    }

    writeln!(md, "## Goals\n")?;
    if meta.quick {
        writeln!(
            md,
            "Quick mode: too short and small to judge; read the full run.\n"
        )?;
    }
    writeln!(md, "| goal | measured | |")?;
    writeln!(md, "|---|---:|---|")?;
    for (what, ok, measured) in &goals {
        writeln!(md, "| {what} | {measured} | {} |", goal(*ok))?;
    }
    writeln!(md)?;
    std::fs::write(out.join("report.md"), md)?;
    Ok(())
}

/// Rows of the recovery runs (catch-up, re-replication), not of the I/O runs.
fn is_recovery(workload: &str) -> bool {
    matches!(workload, "catchup" | "rereplication" | "phase1")
}

/// One recovery timeline plot: each system's client throughput, its events marked.
fn timeline_plot(path: &Path, title: &str, tls: &[&Timeline]) -> Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = tls
        .iter()
        .map(|t| (t.system.clone(), t.points.clone()))
        .collect();
    let events: Vec<(usize, String, f64)> = tls
        .iter()
        .enumerate()
        .flat_map(|(j, t)| {
            t.events
                .iter()
                .map(move |(w, s)| (j, format!("{}: {w}", t.system), *s))
        })
        .collect();
    plot::timeline(path, title, "client MB/s", &series, &events)
}

/// The rows of recovery runs as a table: throughput before and during, the phases'
/// times, whether it completed (`missed`: with the log entries the replica missed).
fn recovery_table(
    md: &mut String,
    rows: &[&Row],
    during: &str,
    took: &str,
    done: &str,
    missed: bool,
) -> Result<()> {
    let m = if missed { " missed entries |" } else { "" };
    let ma = if missed { "---:|" } else { "" };
    writeln!(md, "| system | interval ms | run | before MB/s | {during} MB/s |{m} Phase 1 s | {took} | {done} |")?;
    writeln!(md, "|---|---:|---:|---:|---:|{ma}---:|---:|---|")?;
    for r in rows {
        let missed = if missed {
            format!(" {} |", r.missed_entries.unwrap_or(0))
        } else {
            String::new()
        };
        writeln!(
            md,
            "| {} | {} | {} | {:.2} | {:.2} |{missed} {} | {} | {} |",
            r.system,
            r.recovery_interval_ms.unwrap_or(0),
            r.run + 1,
            r.before_mb_per_s.unwrap_or(0.0),
            r.mb_per_s,
            r.phase1_s.map_or("–".into(), |s| format!("{s:.1}")),
            r.recovery_s.map_or("–".into(), |s| format!("{s:.1}")),
            if r.caught_up == Some(true) {
                "yes"
            } else {
                "**no**"
            },
        )?;
    }
    Ok(())
}
