//! Line charts as SVG, drawn with the plotters crate (its SVG backend: text stays text,
//! so no font file is needed, which the `FROM scratch` images do not have).
//!
//! A chart is a main title above one or more [`Panel`]s stacked vertically. Every
//! panel has its own y range, one or more [`Series`], and a legend (left out when the
//! panel's one series has the panel's title as its name). `train` writes
//! `chart.svg`, `tapline-trainer plot` any chart, and `report.html` embeds one per
//! curve.
//!
//! ```no_run
//! use tapline_trainer::chart::{Panel, Series, write_svg};
//!
//! let loss = Series { name: "loss".into(), points: vec![(0.0, 2.3), (1.0, 1.9), (2.0, 1.7)] };
//! let panel = Panel { title: "Loss".into(), x_label: "step".into(), series: vec![loss] };
//! write_svg(std::path::Path::new("curves.svg"), "run 42", &[panel])?;
//! # Ok::<(), std::io::Error>(())
//! ```

use std::path::Path;

use plotters::prelude::*;

/// One named curve: `(x, y)` points joined in the order given.
///
/// Points whose `x` or `y` is not finite (NaN or infinite) are skipped and break the
/// line, so they show up as a gap.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// Name shown in the panel legend (none when it is the panel's title and the panel's
    /// only series).
    pub name: String,
    /// Data points as `(x, y)`.
    pub points: Vec<(f64, f64)>,
}

/// One plot area with a title, an x-axis label and any number of series sharing the
/// same axes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Panel {
    /// Title drawn above the plot area.
    pub title: String,
    /// Label drawn below the x axis.
    pub x_label: String,
    /// Curves drawn in this panel, coloured from plotters' palette in order.
    pub series: Vec<Series>,
}

/// Width of a chart in pixels.
pub const WIDTH: u32 = 800;
/// Height of the band holding the main title.
pub const TITLE_HEIGHT: u32 = 36;
/// Height of each panel.
pub const PANEL_HEIGHT: u32 = 260;

/// The range of `values`, widened a little (or by 0.5 around a single value) so that no
/// point sits on the frame.
fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi > lo {
        let pad = (hi - lo) * 0.05;
        (lo - pad, hi + pad)
    } else {
        (lo - 0.5, hi + 0.5)
    }
}

/// The tick label of `v` on an axis from `lo` to `hi`: one format for the whole axis,
/// with as many digits as its six ticks need to be told apart (plotters' default prints
/// 1e-5 steps as "0.0"); scientific notation when the axis's values are very small or
/// very large.
fn tick_label(v: f64, lo: f64, hi: f64) -> String {
    let step = (hi - lo) / 6.0;
    let magnitude = lo.abs().max(hi.abs());
    if v == 0.0 {
        return "0".into();
    }
    if step > 0.0 && !(1e-3..1e6).contains(&magnitude) {
        // Mantissa digits: as many as the step is below the largest value.
        let decimals = ((magnitude.log10() - step.log10()).ceil().max(1.0) as usize).min(8);
        return format!("{v:.decimals$e}");
    }
    let decimals = if step >= 1.0 || step <= 0.0 {
        usize::from(v.fract() != 0.0)
    } else {
        ((-step.log10()).ceil() as usize).min(8)
    };
    format!("{v:.decimals$}")
}

/// The runs of finite points of a series (a non-finite point ends a run).
fn segments(points: &[(f64, f64)]) -> Vec<Vec<(f64, f64)>> {
    let mut out = vec![Vec::new()];
    for &(x, y) in points {
        if x.is_finite() && y.is_finite() {
            if let Some(last) = out.last_mut() {
                last.push((x, y));
            }
        } else if out.last().is_some_and(|l| !l.is_empty()) {
            out.push(Vec::new());
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let finite = || {
        panel
            .series
            .iter()
            .flat_map(|s| &s.points)
            .filter(|(x, y)| x.is_finite() && y.is_finite())
    };
    let (x0, x1) = range(finite().map(|p| p.0));
    let (y0, y1) = range(finite().map(|p| p.1));
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(32)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    let y_label = |v: &f64| tick_label(*v, y0, y1);
    chart
        .configure_mesh()
        .x_desc(panel.x_label.as_str())
        .light_line_style(WHITE.mix(0.0))
        .x_labels(8)
        .y_labels(6)
        .y_label_formatter(&y_label)
        .draw()?;
    for (i, s) in panel.series.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let mut labelled = false;
        for seg in segments(&s.points) {
            let line =
                chart.draw_series(LineSeries::new(seg.iter().copied(), colour.stroke_width(2)))?;
            if !labelled {
                labelled = true;
                line.label(s.name.as_str()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
                });
            }
            chart.draw_series(seg.iter().map(|&p| Circle::new(p, 2, colour.filled())))?;
        }
    }
    // One series named as its panel: the title says it, and a legend would only hide
    // the curve.
    let named_by_title = matches!(&panel.series[..], [one] if one.name == panel.title);
    if !named_by_title && panel.series.iter().any(|s| !segments(&s.points).is_empty()) {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
    }
    Ok(())
}

/// The chart as an SVG document, [`WIDTH`] wide, [`PANEL_HEIGHT`] per panel.
pub fn render_svg(title: &str, panels: &[Panel]) -> String {
    render_svg_sized(title, panels, (WIDTH, PANEL_HEIGHT))
}

/// The chart as an SVG document `width` pixels wide, `panel_height` per panel (the run
/// report draws its curves at the size they are shown, so that their text is as large
/// as the page's).
pub fn render_svg_sized(
    title: &str,
    panels: &[Panel],
    (width, panel_height): (u32, u32),
) -> String {
    let n = panels.len().max(1) as u32;
    let title_height = if title.is_empty() { 0 } else { TITLE_HEIGHT };
    let height = title_height + n * panel_height;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        let drawn = (|| {
            root.fill(&WHITE)?;
            let body = if title.is_empty() {
                root.clone()
            } else {
                root.titled(title, ("sans-serif", 20))?
            };
            for (area, panel) in body
                .split_evenly((panels.len().max(1), 1))
                .iter()
                .zip(panels)
            {
                draw_panel(area, panel)?;
            }
            root.present()
        })();
        if let Err(e) = drawn {
            tracing::warn!("chart {title:?}: {e}");
        }
    }
    svg
}

/// Writes [`render_svg`] to `path`.
pub fn write_svg(path: &Path, title: &str, panels: &[Panel]) -> std::io::Result<()> {
    std::fs::write(path, render_svg(title, panels))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, points: &[(f64, f64)]) -> Series {
        Series {
            name: name.into(),
            points: points.to_vec(),
        }
    }

    fn panel(title: &str, series: Vec<Series>) -> Panel {
        Panel {
            title: title.into(),
            x_label: "step".into(),
            series,
        }
    }

    #[test]
    fn a_chart_is_svg_with_its_titles_legend_and_one_line_per_unbroken_run() {
        let svg = render_svg(
            "run <42>",
            &[
                panel(
                    "mean reward",
                    vec![
                        series("reward", &[(1.0, 0.1), (2.0, 0.4), (3.0, 0.9)]),
                        series("baseline", &[(1.0, 0.2), (3.0, 0.3)]),
                    ],
                ),
                panel(
                    "loss",
                    vec![series(
                        "loss",
                        &[(1.0, 2.0), (2.0, f64::NAN), (3.0, 1.0), (4.0, 0.5)],
                    )],
                ),
            ],
        );
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        assert!(svg.contains("run &lt;42&gt;"), "titles are escaped");
        assert!(
            svg.contains("\nmean reward\n") && svg.contains("\nloss\n"),
            "{svg}"
        );
        assert!(
            svg.contains("\nreward\n") && svg.contains("\nbaseline\n"),
            "the legend of a panel of two names them"
        );
        // The series' lines are 2 px wide: reward and baseline one each, loss two (broken
        // by the NaN; the lone first point is a line of one point), and a legend entry per
        // series of the two-series panel only.
        let lines = svg
            .lines()
            .filter(|l| l.starts_with("<polyline") && l.contains("stroke-width=\"2\""))
            .count();
        assert_eq!(lines, 4 + 2, "{svg}");
        assert_eq!(svg.matches("<circle").count(), 8);
    }

    #[test]
    fn empty_and_constant_series_still_render() {
        for panels in [
            vec![],
            vec![panel("nothing", vec![])],
            vec![panel("flat", vec![series("x", &[(0.0, 1.0), (1.0, 1.0)])])],
            vec![panel("nan", vec![series("x", &[(0.0, f64::NAN)])])],
        ] {
            let svg = render_svg("", &panels);
            assert!(
                svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
                "{svg}"
            );
        }
    }

    #[test]
    fn tick_labels_tell_small_steps_apart() {
        assert_eq!(tick_label(0.5, 0.0, 1.0), "0.5");
        assert_eq!(tick_label(200.0, 195.0, 205.0), "200");
        assert_eq!(tick_label(2.5e-5, 0.0, 3e-5), "2.5e-5");
        assert_eq!(tick_label(0.0, 0.0, 3e-5), "0");
        assert_eq!(tick_label(1.0002, 1.0, 1.0003), "1.00020");
        assert_eq!(tick_label(3.0e7, 2.0e7, 3.0e7), "3.00e7");
        // Close values far from zero are told apart, in one format for the axis.
        assert_eq!(tick_label(5.003e-4, 4.99e-4, 5.01e-4), "5.0030e-4");
        assert_eq!(tick_label(1e-3, 5e-4, 9.9e-4), "1.00e-3");
    }

    #[test]
    fn segments_break_at_non_finite_points() {
        let s = segments(&[(0.0, 1.0), (1.0, f64::INFINITY), (2.0, 2.0), (3.0, 3.0)]);
        assert_eq!(s, vec![vec![(0.0, 1.0)], vec![(2.0, 2.0), (3.0, 3.0)]]);
    }
}
