//! PNG bar charts, one per workload: wall time and CPU time of every system, medians
//! with min–max whiskers, as in the papers' figures.

use super::report::cell;
use super::systems::System;
use super::workloads::Workload;
use super::Sample;
use anyhow::{Context, Result};
use std::path::Path;

/// Draws every workload's chart into `out`; returns the file names written.
pub fn all(
    out: &Path,
    systems: &[System],
    ws: &[Workload],
    samples: &[Sample],
) -> Result<Vec<String>> {
    if !crate::plot::font() {
        return Ok(Vec::new());
    }
    let mut written = Vec::new();
    for &w in ws {
        let rows: Vec<Row> = systems
            .iter()
            .filter(|s| !s.opt_only())
            .filter_map(|s| {
                let c = cell(samples, s.name, w)?;
                Some((s.name.to_string(), c.wall, c.cpu))
            })
            .collect();
        if rows.is_empty() {
            continue;
        }
        let name = format!("{}.png", w.name());
        let rows: Vec<crate::plot::BarRow> = rows
            .into_iter()
            .map(|(n, wall, cpu)| (n, vec![Some(wall), Some(cpu)]))
            .collect();
        crate::plot::bars(
            &out.join(&name),
            w.name(),
            "seconds",
            &[
                "wall",
                "CPU (user + system, the file system's own included)",
            ],
            &rows,
        )
        .with_context(|| format!("drawing {name}"))?;
        written.push(name);
    }
    Ok(written)
}

type Row = (String, (f64, f64, f64), (f64, f64, f64));
