//! SVG timelines of live and reserved bytes (plotters, SVG backend only).
//!
//! Each line is drawn through every point it is given; the panels built by
//! [`super::session::panel`] hold envelopes (lowest and highest value of
//! each run of operations), so short peaks stay visible.

use plotters::prelude::*;
use std::path::Path;

/// One line of a panel: (operation index, bytes) points.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One panel: a trace, its live bytes and each allocator's reserved bytes.
/// The x axis counts operations over all passes, one after the other.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub live: Series,
    pub reserved: Vec<Series>,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Check, before any replay, that an SVG plot can be written to `path`:
/// the name ends in `.svg` (PNG is not built in, to keep the replayer's
/// build light), the directory exists and the file can be created there.
/// The message says what to do.
pub fn check_path(path: &Path) -> Result<(), String> {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    match ext.as_deref() {
        Some("svg") => {}
        Some("png") => {
            return Err(format!(
                "--plot {}: the plot is written as SVG only; name it .svg and convert it if \
                 you need a PNG (for example `rsvg-convert -o timeline.png timeline.svg`)",
                path.display()
            ))
        }
        _ => {
            return Err(format!(
                "--plot {}: the plot is an SVG file; give it a .svg extension",
                path.display()
            ))
        }
    }
    if path.is_dir() {
        return Err(format!(
            "--plot {}: is a directory; name a .svg file",
            path.display()
        ));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!(
            "--plot {}: directory {} does not exist; create it first",
            path.display(),
            dir.display()
        ));
    }
    // Try the file itself: the directory may exist yet refuse new files
    // (permissions, a read-only or virtual file system). An existing file is
    // opened without truncating it; a new one is removed again, so a run
    // that then fails leaves nothing behind.
    let probe = if path.exists() {
        std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map(|_| ())
    } else {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .and_then(|_| std::fs::remove_file(path))
    };
    probe.map_err(|e| {
        format!(
            "--plot {}: cannot be written ({e}); name a file in a directory you can write to",
            path.display()
        )
    })
}

/// Draw the panels, one above the other, into an SVG file.
pub fn draw_svg(path: &Path, panels: &[Panel]) -> Result<(), String> {
    if panels.is_empty() {
        return Err("nothing to plot".into());
    }
    let height = 420 * panels.len() as u32;
    let root = SVGBackend::new(path, (1100, height)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| format!("{}: cannot draw plot: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let areas = root.split_evenly((panels.len(), 1));
    let palette = [
        RGBColor(0xd6, 0x27, 0x28),
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0xff, 0x7f, 0x0e),
        RGBColor(0x94, 0x67, 0xbd),
        RGBColor(0x8c, 0x56, 0x4b),
    ];
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let all = std::iter::once(&panel.live).chain(panel.reserved.iter());
        let (mut xmax, mut ymax) = (1.0f64, 1.0f64);
        for s in all {
            for &(x, y) in &s.points {
                xmax = xmax.max(x);
                ymax = ymax.max(y / GIB);
            }
        }
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax * 1.08)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("operations (passes one after the other)")
            .y_desc("GiB")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()
            .map_err(|e| err(&e))?;
        for (i, s) in panel.reserved.iter().enumerate() {
            let color = palette[i % palette.len()];
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().map(|&(x, y)| (x, y / GIB)),
                    color.stroke_width(2),
                ))
                .map_err(|e| err(&e))?
                .label(s.label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        let live_color = RGBColor(0x2c, 0xa0, 0x2c);
        chart
            .draw_series(LineSeries::new(
                panel.live.points.iter().map(|&(x, y)| (x, y / GIB)),
                live_color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(panel.live.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], live_color));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
