//! PNG bar charts, one per workload: wall time and CPU time of every system, medians
//! with min–max whiskers, as in the papers' figures.

use super::report::cell;
use super::systems::System;
use super::workloads::Workload;
use super::Sample;
use anyhow::{Context, Result};
use plotters::coord::combinators::BindKeyPoints;
use plotters::prelude::*;
use std::path::Path;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const WALL: RGBColor = RGBColor(0x3b, 0x6e, 0xa8);
const CPU: RGBColor = RGBColor(0xe0, 0x8a, 0x2c);

/// Registers the font plotters draws with; false if there is none (then no plots).
fn font() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| {
        let Ok(bytes) = std::fs::read(FONT) else {
            return false;
        };
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
    })
}

/// Draws every workload's chart into `out`; returns the file names written.
pub fn all(
    out: &Path,
    systems: &[System],
    ws: &[Workload],
    samples: &[Sample],
) -> Result<Vec<String>> {
    if !font() {
        eprintln!("bench: no plots: {FONT} is missing (Debian package fonts-dejavu-core)");
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
        chart(&out.join(&name), w.name(), &rows).with_context(|| format!("drawing {name}"))?;
        written.push(name);
    }
    Ok(written)
}

type Row = (String, (f64, f64, f64), (f64, f64, f64));

/// Each system gets a band of `BAND` units on the y axis, top to bottom in the given
/// order: wall bar in the upper half, CPU bar in the lower half, named at the middle.
const BAND: i32 = 100;

fn chart(path: &Path, title: &str, rows: &[Row]) -> Result<()> {
    let n = rows.len() as i32;
    // One empty band on top holds the legend.
    let height = 160 + 52 * n as u32;
    let root = BitMapBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE).map_err(drawing)?;
    let top = rows
        .iter()
        .map(|r| r.1 .2.max(r.2 .2))
        .fold(0.0f64, f64::max)
        .max(0.01)
        * 1.15;
    // Band k (row k) spans [base(k), base(k) + BAND), row 0 at the top.
    let base = |k: usize| (n - 1 - k as i32) * BAND;
    let names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    let centers: Vec<i32> = (0..rows.len()).map(|k| base(k) + BAND / 2).collect();
    let mut c = ChartBuilder::on(&root)
        .caption(
            format!("{title}: seconds, median with min–max"),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(170)
        .build_cartesian_2d(0.0..top, (0..(n + 1) * BAND).with_key_points(centers))
        .map_err(drawing)?;
    c.configure_mesh()
        .disable_y_mesh()
        .light_line_style(WHITE)
        .y_label_formatter(&|v| {
            let k = n - 1 - v / BAND;
            usize::try_from(k)
                .ok()
                .and_then(|k| names.get(k).cloned())
                .unwrap_or_default()
        })
        .x_desc("seconds")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(drawing)?;
    for (k, r) in rows.iter().enumerate() {
        let b = base(k);
        for (m, color, lo, hi) in [(r.1, WALL, 52, 88), (r.2, CPU, 12, 48)] {
            let mid = b + (lo + hi) / 2;
            c.draw_series([
                Rectangle::new([(0.0, b + lo), (m.0, b + hi)], color.filled()).into_dyn(),
                PathElement::new(vec![(m.1, mid), (m.2, mid)], BLACK.stroke_width(2)).into_dyn(),
                PathElement::new(vec![(m.1, b + lo + 8), (m.1, b + hi - 8)], BLACK).into_dyn(),
                PathElement::new(vec![(m.2, b + lo + 8), (m.2, b + hi - 8)], BLACK).into_dyn(),
                Text::new(
                    format!("{:.2}", m.0),
                    (m.2 + top * 0.01, b + hi),
                    ("sans-serif", 12).into_font(),
                )
                .into_dyn(),
            ])
            .map_err(drawing)?;
        }
    }
    for (label, color) in [
        ("wall", WALL),
        ("CPU (user + system, the file system's own included)", CPU),
    ] {
        c.draw_series(std::iter::empty::<Rectangle<(f64, i32)>>())
            .map_err(drawing)?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(drawing)?;
    root.present().map_err(drawing)?;
    Ok(())
}

fn drawing<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}
