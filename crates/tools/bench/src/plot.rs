//! PNG charts for the suites' reports: horizontal bars (a value per system and series,
//! median with min–max whiskers, as in the papers' figures) and lines (a value against
//! a size, one line per system). Fonts come from a TTF file at run time.

use anyhow::Result;
use plotters::coord::combinators::BindKeyPoints;
use plotters::prelude::*;
use std::path::Path;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const COLORS: [RGBColor; 8] = [
    RGBColor(0x3b, 0x6e, 0xa8),
    RGBColor(0xe0, 0x8a, 0x2c),
    RGBColor(0x4c, 0x9a, 0x5a),
    RGBColor(0xc2, 0x3b, 0x3b),
    RGBColor(0x7e, 0x5a, 0xa8),
    RGBColor(0x8c, 0x6d, 0x3e),
    RGBColor(0xd4, 0x6a, 0xb4),
    RGBColor(0x5a, 0x5a, 0x5a),
];

/// Registers the font plotters draws with; false if there is none (then no plots).
pub fn font() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| {
        let Ok(bytes) = std::fs::read(FONT) else {
            eprintln!("bench: no plots: {FONT} is missing (Debian package fonts-dejavu-core)");
            return false;
        };
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
    })
}

/// A median with its minimum and maximum.
pub type Spread = (f64, f64, f64);

/// One system's bars: its name and a spread per series (`None`: not measured).
pub type BarRow = (String, Vec<Option<Spread>>);

/// Each system gets a band of `BAND` units on the y axis, top to bottom in the given
/// order, one bar per series in it, named at the middle.
const BAND: i32 = 100;

/// Horizontal bars: `title`, the value's `unit`, a label per series, a row per system.
pub fn bars(path: &Path, title: &str, unit: &str, series: &[&str], rows: &[BarRow]) -> Result<()> {
    let n = rows.len() as i32;
    let k = series.len().max(1) as i32;
    let height = 160 + (26 * k as u32 + 10) * n as u32;
    let root = BitMapBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE).map_err(drawing)?;
    let top = rows
        .iter()
        .flat_map(|r| r.1.iter().flatten().map(|s| s.2))
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.15;
    let base = |i: usize| (n - 1 - i as i32) * BAND;
    let names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    let centers: Vec<i32> = (0..rows.len()).map(|i| base(i) + BAND / 2).collect();
    let mut c = ChartBuilder::on(&root)
        .caption(
            format!("{title}: {unit}, median with min–max"),
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
            let i = n - 1 - v / BAND;
            usize::try_from(i)
                .ok()
                .and_then(|i| names.get(i).cloned())
                .unwrap_or_default()
        })
        .x_desc(unit)
        .x_label_formatter(&|v| number(*v))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(drawing)?;
    let slot = (BAND - 10) / k;
    for (i, r) in rows.iter().enumerate() {
        let b = base(i);
        for (j, v) in r.1.iter().enumerate() {
            let Some(m) = v else { continue };
            let color = COLORS[j % COLORS.len()];
            let hi = BAND - 6 - j as i32 * slot;
            let lo = hi - slot + 4;
            let mid = b + (lo + hi) / 2;
            c.draw_series([
                Rectangle::new([(0.0, b + lo), (m.0, b + hi)], color.filled()).into_dyn(),
                PathElement::new(vec![(m.1, mid), (m.2, mid)], BLACK.stroke_width(2)).into_dyn(),
                PathElement::new(vec![(m.1, b + lo + 4), (m.1, b + hi - 4)], BLACK).into_dyn(),
                PathElement::new(vec![(m.2, b + lo + 4), (m.2, b + hi - 4)], BLACK).into_dyn(),
                Text::new(
                    number(m.0),
                    (m.2 + top * 0.01, b + hi),
                    ("sans-serif", 12).into_font(),
                )
                .into_dyn(),
            ])
            .map_err(drawing)?;
        }
    }
    for (j, label) in series.iter().enumerate() {
        let color = COLORS[j % COLORS.len()];
        c.draw_series(std::iter::empty::<Rectangle<(f64, i32)>>())
            .map_err(drawing)?
            .label(*label)
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

/// Lines on log–log axes: one per system, (x, y) points in order of x.
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    let pts = || series.iter().flat_map(|s| s.1.iter());
    let (xmin, xmax) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (ymin, ymax) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    if xmin > xmax || ymin > ymax {
        return Ok(());
    }
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(drawing)?;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(80)
        .build_cartesian_2d(
            (xmin.max(1e-9) * 0.8..xmax * 1.25).log_scale(),
            (ymin.max(1e-9) * 0.6..ymax * 1.6).log_scale(),
        )
        .map_err(drawing)?;
    c.configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|v| number(*v))
        .y_label_formatter(&|v| number(*v))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(drawing)?;
    for (j, (name, p)) in series.iter().enumerate() {
        let color = COLORS[j % COLORS.len()];
        c.draw_series(plotters::series::LineSeries::new(
            p.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(drawing)?
        .label(name.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        c.draw_series(p.iter().map(|&q| Circle::new(q, 3, color.filled())))
            .map_err(drawing)?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(drawing)?;
    root.present().map_err(drawing)?;
    Ok(())
}

/// Cumulative distributions: x on a log axis, the fraction (0 to 1) on a linear one;
/// one line per series, its points in order of x.
pub fn cdf(
    path: &Path,
    title: &str,
    x_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    let xs = || series.iter().flat_map(|s| s.1.iter().map(|p| p.0));
    let (xmin, xmax) = xs().fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    if xmin > xmax {
        return Ok(());
    }
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(drawing)?;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin.max(1e-6) * 0.8..xmax * 1.25).log_scale(), 0.0..1.02)
        .map_err(drawing)?;
    c.configure_mesh()
        .x_desc(x_desc)
        .y_desc("fraction of writes")
        .x_label_formatter(&|v| number(*v))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(drawing)?;
    for (j, (name, p)) in series.iter().enumerate() {
        let color = COLORS[j % COLORS.len()];
        c.draw_series(plotters::series::LineSeries::new(
            p.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(drawing)?
        .label(name.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(drawing)?;
    root.present().map_err(drawing)?;
    Ok(())
}

/// Lines over time on linear axes (throughput against seconds), one per series, with
/// dashed vertical marks for events: (series index, what, seconds), drawn in the
/// series' colour.
pub fn timeline(
    path: &Path,
    title: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    events: &[(usize, String, f64)],
) -> Result<()> {
    let pts = || series.iter().flat_map(|s| s.1.iter());
    let xmax = pts().map(|p| p.0).fold(0.0f64, f64::max).max(1.0);
    let ymax = pts().map(|p| p.1).fold(0.0f64, f64::max).max(1e-6) * 1.15;
    let root = BitMapBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(drawing)?;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..xmax * 1.02, 0.0..ymax)
        .map_err(drawing)?;
    c.configure_mesh()
        .x_desc("seconds")
        .y_desc(y_desc)
        .y_label_formatter(&|v| number(*v))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(drawing)?;
    for (j, (name, p)) in series.iter().enumerate() {
        let color = COLORS[j % COLORS.len()];
        c.draw_series(plotters::series::LineSeries::new(
            p.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(drawing)?
        .label(name.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    for (k, (j, what, at)) in events.iter().enumerate() {
        let color = COLORS[j % COLORS.len()];
        // Dashes: short segments up the axis.
        let steps = 40;
        c.draw_series((0..steps).step_by(2).map(|i| {
            let y0 = ymax * i as f64 / steps as f64;
            let y1 = ymax * (i + 1) as f64 / steps as f64;
            PathElement::new(vec![(*at, y0), (*at, y1)], color.stroke_width(1))
        }))
        .map_err(drawing)?;
        // Labels staggered so that marks close together stay readable.
        let y = ymax * (0.97 - 0.05 * (k % 6) as f64);
        c.draw_series(std::iter::once(Text::new(
            what.clone(),
            (*at, y),
            ("sans-serif", 12).into_font().color(&color),
        )))
        .map_err(drawing)?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(drawing)?;
    root.present().map_err(drawing)?;
    Ok(())
}

/// A number with three significant digits at most, as a label.
pub fn number(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 || (a >= 10.0 && v.fract() == 0.0) {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn drawing<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}
