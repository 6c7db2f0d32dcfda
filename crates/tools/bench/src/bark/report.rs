//! The Bark suite's report: runtimes and tps by cache setting and client count, the
//! journal disk's write-latency distributions (CDF plots), and the goals.

use super::{Cache, Row, SYSTEMS};
use crate::median;
use anyhow::Result;
use quilt_block::LATENCY_BUCKETS_US;
use std::fmt::Write as _;
use std::path::Path;

#[derive(Debug, serde::Serialize)]
pub struct Meta {
    pub quick: bool,
    pub runs: usize,
    pub transactions: u32,
    pub scale_cached: u32,
    pub scale_uncached: u32,
    pub seconds: f64,
    pub postgres: String,
    /// Whether the model disks' flushes also flushed their files on the host.
    pub host_flush: bool,
}

/// A rotation of the modelled disk, ms.
const ROTATION_MS: f64 = 60_000.0 / 7200.0;

/// The upper bound of bucket `i`, ms (the last, unbounded one: twice the one before).
fn bound_ms(i: usize) -> f64 {
    match LATENCY_BUCKETS_US.get(i) {
        Some(&u64::MAX) | None => {
            LATENCY_BUCKETS_US[LATENCY_BUCKETS_US.len() - 2] as f64 * 2.0 / 1000.0
        }
        Some(&b) => b as f64 / 1000.0,
    }
}

/// The summed histogram of some runs.
fn histogram<'a>(rows: impl Iterator<Item = &'a Row>) -> Vec<u64> {
    let mut h = vec![0u64; LATENCY_BUCKETS_US.len()];
    for r in rows {
        for (a, b) in h.iter_mut().zip(&r.journal_write_latency) {
            *a += b;
        }
    }
    h
}

/// The `q` quantile of a histogram, ms, interpolated within its bucket; None if empty.
pub fn quantile(h: &[u64], q: f64) -> Option<f64> {
    let total: u64 = h.iter().sum();
    if total == 0 {
        return None;
    }
    let want = q * total as f64;
    let mut cum = 0.0;
    for (i, &n) in h.iter().enumerate() {
        if n > 0 && cum + n as f64 >= want {
            let lo = if i == 0 { 0.0 } else { bound_ms(i - 1) };
            let hi = bound_ms(i);
            return Some(lo + (hi - lo) * ((want - cum) / n as f64).clamp(0.0, 1.0));
        }
        cum += n as f64;
    }
    Some(bound_ms(h.len() - 1))
}

/// The CDF's points: (bucket bound in ms, fraction at or below it).
fn cdf_points(h: &[u64]) -> Vec<(f64, f64)> {
    let total: u64 = h.iter().sum();
    if total == 0 {
        return Vec::new();
    }
    let mut cum = 0u64;
    h.iter()
        .enumerate()
        .map(|(i, &n)| {
            cum += n;
            (bound_ms(i), cum as f64 / total as f64)
        })
        .collect()
}

struct Cell {
    seconds: (f64, f64, f64),
    tps: f64,
    latency_median: Option<f64>,
}

fn cell(rows: &[Row], sys: &str, cache: Cache, clients: u32) -> Option<Cell> {
    let mine: Vec<&Row> = rows
        .iter()
        .filter(|r| r.system == sys && r.cache == cache && r.clients == clients)
        .collect();
    if mine.is_empty() {
        return None;
    }
    Some(Cell {
        seconds: median(mine.iter().map(|r| r.seconds).collect()),
        tps: median(mine.iter().map(|r| r.tps).collect()).0,
        latency_median: quantile(&histogram(mine.iter().copied()), 0.5),
    })
}

pub fn write(out: &Path, meta: &Meta, rows: &[Row]) -> Result<()> {
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&serde_json::json!({ "meta": meta, "rows": rows }))?,
    )?;
    let flat: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "system": r.system, "cache": r.cache.name(), "clients": r.clients, "run": r.run,
                "transactions": r.transactions, "seconds": r.seconds, "tps": r.tps,
                "journal_writes": r.journal_write_latency.iter().sum::<u64>(),
                "journal_write_median_ms": quantile(&r.journal_write_latency, 0.5),
            })
        })
        .collect();
    std::fs::write(out.join("results.csv"), crate::csv(&flat)?)?;
    let mut md = String::new();
    let _ = writeln!(md, "# quiltfs bench bark\n");
    let _ = writeln!(
        md,
        "PostgreSQL ({}) pgbench TPC-B-like, {} transactions per run in all, {} run(s) per configuration (medians, min–max); scale {} cached (512 MB shared buffers, prewarmed), {} uncached (16 MB shared buffers, 16 MB quiltfs cache, page cache dropped). Journal on its own modelled 7200 RPM disk (write cache off), data on another (write cache on); full data journaling. {:.0} s in all{}.\n",
        meta.postgres,
        meta.transactions,
        meta.runs,
        meta.scale_cached,
        meta.scale_uncached,
        meta.seconds,
        if meta.quick { " (quick mode: not for reading ratios)" } else { "" }
    );
    if !meta.host_flush {
        let _ = writeln!(
            md,
            "The model disks' flushes stopped at the model (`--no-host-flush`): the host did not flush the image files under them.\n"
        );
    }
    let systems: Vec<&str> = SYSTEMS
        .iter()
        .map(|s| s.0)
        .filter(|s| rows.iter().any(|r| r.system == *s))
        .collect();
    let mut clients: Vec<u32> = rows.iter().map(|r| r.clients).collect();
    clients.sort_unstable();
    clients.dedup();
    let mut goals = Vec::new();
    for cache in [Cache::Cached, Cache::Uncached] {
        for &c in &clients {
            if !rows.iter().any(|r| r.cache == cache && r.clients == c) {
                continue;
            }
            let _ = writeln!(md, "## {}, {c} client(s)\n", cache.name());
            let _ = writeln!(
                md,
                "| system | runtime s | tps | journal write median ms | runtime vs ring | runtime vs null |\n|---|---|---|---|---|---|"
            );
            let ring = cell(rows, "ring", cache, c);
            let null = cell(rows, "null", cache, c);
            for s in &systems {
                let Some(x) = cell(rows, s, cache, c) else {
                    continue;
                };
                let vs = |o: &Option<Cell>| {
                    o.as_ref().map_or("–".to_string(), |o| {
                        format!("{:.2}×", x.seconds.0 / o.seconds.0)
                    })
                };
                let _ = writeln!(
                    md,
                    "| {s} | {:.2} ({:.2}–{:.2}) | {:.1} | {} | {} | {} |",
                    x.seconds.0,
                    x.seconds.1,
                    x.seconds.2,
                    x.tps,
                    x.latency_median.map_or("–".into(), |m| format!("{m:.2}")),
                    vs(&ring),
                    vs(&null)
                );
            }
            let _ = writeln!(md);
            breakdown(&mut md, rows, &systems, cache, c);
            let series: Vec<(String, Vec<(f64, f64)>)> = systems
                .iter()
                .filter(|s| **s != "null")
                .map(|s| {
                    let h = histogram(
                        rows.iter()
                            .filter(|r| r.system == *s && r.cache == cache && r.clients == c),
                    );
                    (s.to_string(), cdf_points(&h))
                })
                .filter(|(_, p)| !p.is_empty())
                .collect();
            let png = format!("latency-{}-c{c}.png", cache.name());
            if crate::plot::font() && !series.is_empty() {
                crate::plot::cdf(
                    &out.join(&png),
                    &format!("Journal write latency, {}, {c} client(s)", cache.name()),
                    "latency (ms), modelled 7200 RPM disk",
                    &series,
                )?;
                let _ = writeln!(md, "![journal write latency CDF]({png})\n");
            }
            // The goals, at 1 client (the paper's setting) and reported for more.
            let skip = cell(rows, "skip", cache, c);
            if let (Some(r), Some(k)) = (&ring, &skip) {
                let faster = r.seconds.0 / k.seconds.0 - 1.0;
                let need = if cache == Cache::Cached { 0.61 } else { 0.20 };
                goals.push((
                    format!(
                        "skip ≥ {:.0}% faster than ring, {}, {c} client(s)",
                        need * 100.0,
                        cache.name()
                    ),
                    faster >= need,
                    format!(
                        "{:.0}% ({:.2} s against {:.2} s)",
                        faster * 100.0,
                        k.seconds.0,
                        r.seconds.0
                    ),
                ));
            }
            if let (Some(n), Some(k)) = (&null, &skip) {
                let over = k.seconds.0 / n.seconds.0 - 1.0;
                goals.push((
                    format!("skip within 10% of null, {}, {c} client(s)", cache.name()),
                    over <= 0.10,
                    format!(
                        "{:+.0}% ({:.2} s against {:.2} s)",
                        over * 100.0,
                        k.seconds.0,
                        n.seconds.0
                    ),
                ));
            }
            if let Some(m) = skip.as_ref().and_then(|k| k.latency_median) {
                goals.push((
                    format!(
                        "skip's median journal write below a quarter rotation ({:.2} ms), {}, {c} client(s)",
                        ROTATION_MS / 4.0,
                        cache.name()
                    ),
                    m < ROTATION_MS / 4.0,
                    format!("{m:.2} ms"),
                ));
            }
        }
    }
    let _ = writeln!(md, "## Goals\n\n| goal | met | measured |\n|---|---|---|");
    for (g, ok, v) in &goals {
        let _ = writeln!(md, "| {g} | {} | {v} |", if *ok { "yes" } else { "**no**" });
    }
    std::fs::write(out.join("report.md"), &md)?;
    print!("{md}");
    Ok(())
}

/// Per transaction, medians over the runs: what the journal disk was given and the time
/// the model charged for it (the rest of a transaction is the database's, the file
/// system's and the emulator's own).
fn breakdown(md: &mut String, rows: &[Row], systems: &[&str], cache: Cache, c: u32) {
    let per_txn = |r: &Row, k: &str| {
        r.journal_counters
            .get(&format!("journal.device.{k}"))
            .map(|v| *v as f64 / r.transactions.max(1) as f64)
    };
    let med = |s: &str, k: &str, scale: f64| {
        let mut v: Vec<f64> = rows
            .iter()
            .filter(|r| r.system == s && r.cache == cache && r.clients == c)
            .filter_map(|r| per_txn(r, k))
            .map(|x| x * scale)
            .collect();
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| v[v.len() / 2])
    };
    let lines: Vec<String> = systems
        .iter()
        .filter_map(|s| {
            let writes = med(s, "writes", 1.0)?;
            let f = |x: Option<f64>, d: usize| x.map_or("–".into(), |x| format!("{x:.d$}"));
            Some(format!(
                "| {s} | {} | {} | {} | {} | {} | {} | {} |",
                f(Some(writes), 2),
                f(med(s, "bytes_written", 1.0 / 1024.0), 1),
                f(med(s, "flushes", 1.0), 2),
                f(med(s, "model.write_ns", 1e-6), 3),
                f(med(s, "model.rotation_ns", 1e-6), 3),
                f(med(s, "model.seek_ns", 1e-6), 3),
                f(med(s, "model.flush_ns", 1e-6), 3),
            ))
        })
        .collect();
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "Journal disk, per transaction (medians): \n\n| system | writes | KiB written | flushes | modelled write ms | of it rotation ms | of it seek ms | modelled flush ms |\n|---|---|---|---|---|---|---|---|"
    );
    for l in lines {
        let _ = writeln!(md, "{l}");
    }
    let _ = writeln!(md);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let mut h = vec![0u64; LATENCY_BUCKETS_US.len()];
        assert_eq!(quantile(&h, 0.5), None);
        // Everything in the 1.5–1.75 ms bucket: the median lies halfway.
        let i = LATENCY_BUCKETS_US.iter().position(|&b| b == 1750).unwrap();
        h[i] = 10;
        let m = quantile(&h, 0.5).unwrap();
        assert!((m - 1.625).abs() < 1e-9, "{m}");
        let p = cdf_points(&h);
        assert_eq!(p[i], (1.75, 1.0));
        assert_eq!(p[i - 1].1, 0.0);
    }

    #[test]
    fn the_breakdown_divides_each_run_by_its_transactions_and_takes_the_median() {
        let row = |run: usize, writes: u64, write_ns: u64| Row {
            system: "skip".into(),
            cache: Cache::Cached,
            clients: 1,
            run,
            transactions: 100,
            seconds: 1.0,
            tps: 100.0,
            journal_write_latency: vec![0; LATENCY_BUCKETS_US.len()],
            journal_counters: [
                ("journal.device.writes".to_string(), writes),
                ("journal.device.bytes_written".to_string(), writes * 4096),
                ("journal.device.model.write_ns".to_string(), write_ns),
            ]
            .into_iter()
            .collect(),
        };
        // Medians: 100 writes (1 per transaction), 30 ms of writes (0.3 ms each).
        let rows = [
            row(0, 90, 20_000_000),
            row(1, 100, 30_000_000),
            row(2, 400, 90_000_000),
        ];
        let mut md = String::new();
        breakdown(&mut md, &rows, &["skip", "null"], Cache::Cached, 1);
        assert!(
            md.contains("| skip | 1.00 | 4.0 | – | 0.300 | – | – | – |"),
            "{md}"
        );
        assert!(!md.contains("| null |"), "{md}");
        // Nothing measured, nothing written.
        let mut empty = String::new();
        breakdown(&mut empty, &rows, &["skip"], Cache::Uncached, 1);
        assert!(empty.is_empty());
    }
}
