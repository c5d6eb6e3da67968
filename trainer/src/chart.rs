//! Minimal line charts rendered straight to PNG.
//!
//! This module draws training curves (reward, loss, gradient norm, ...) without
//! any plotting library or font files: it rasterises into an RGB buffer with a
//! built-in 5x7 bitmap font and encodes the result with the `png` crate.
//!
//! A chart is a main title above one or more [`Panel`]s stacked vertically.
//! Every panel has its own y range, a legend, and one or more [`Series`].
//!
//! ```no_run
//! use tapline_trainer::chart::{Panel, Series, write_png};
//!
//! let loss = Series { name: "loss".into(), points: vec![(0.0, 2.3), (1.0, 1.9), (2.0, 1.7)] };
//! let panel = Panel { title: "Loss".into(), x_label: "step".into(), series: vec![loss] };
//! write_png(std::path::Path::new("curves.png"), "run 42", &[panel])?;
//! # Ok::<(), std::io::Error>(())
//! ```

use std::io::{self, Write};
use std::path::Path;

/// One named curve: `(x, y)` points joined in the order given.
///
/// Points whose `x` or `y` is not finite (NaN or infinite) are skipped and
/// break the line, so they show up as a gap.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// Name shown in the panel legend.
    pub name: String,
    /// Data points as `(x, y)`.
    pub points: Vec<(f64, f64)>,
}

/// One plot area with a title, an x-axis label and any number of series
/// sharing the same axes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Panel {
    /// Title drawn above the plot area (clipped if too long).
    pub title: String,
    /// Label drawn centred below the x axis.
    pub x_label: String,
    /// Curves drawn in this panel, coloured from a fixed palette in order.
    pub series: Vec<Series>,
}

/// Width of the rendered image in pixels.
pub const WIDTH: u32 = 800;
/// Height of the band holding the main title, in pixels.
pub const TITLE_HEIGHT: u32 = 36;
/// Height of each panel in pixels.
pub const PANEL_HEIGHT: u32 = 260;

/// Series colours, used in order and repeated if there are more series.
pub const PALETTE: [Rgb; 8] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [23, 190, 207],
];

/// An RGB colour.
pub type Rgb = [u8; 3];

const WHITE: Rgb = [255, 255, 255];
const INK: Rgb = [20, 20, 20];
const AXIS: Rgb = [90, 90, 90];
const GRID: Rgb = [228, 228, 228];
const MUTED: Rgb = [150, 150, 150];

// Panel layout, relative to the panel's top-left corner.
const PLOT_LEFT: i64 = 72;
const PLOT_RIGHT: i64 = WIDTH as i64 - 20;
const PLOT_TOP: i64 = 34;
const PLOT_BOTTOM: i64 = PANEL_HEIGHT as i64 - 44;
/// Pixels between the plot frame and the extreme data values, so dots at the
/// data range's edges are not cut by the axes.
const INSET: i64 = 8;

/// Renders `panels` stacked vertically under `title` and writes the PNG to `path`.
///
/// The image is [`WIDTH`] pixels wide and `TITLE_HEIGHT + panels.len() * PANEL_HEIGHT`
/// pixels high, on a white background. Each panel gets a frame, y ticks at the
/// data minimum, midpoint and maximum, "nice" (integer where the data allow) x ticks,
/// one palette colour per series with a legend naming it, and a dot at each
/// point so that even a single point is visible.
///
/// Degenerate data (no points, one point, constant values, NaN or infinite
/// values, extreme magnitudes, over-long labels) is handled without panicking.
///
/// # Errors
///
/// Returns any error from creating or writing the file.
pub fn write_png(path: &Path, title: &str, panels: &[Panel]) -> io::Result<()> {
    let canvas = draw(title, panels);
    let mut file = io::BufWriter::new(std::fs::File::create(path)?);
    encode(&canvas, &mut file)?;
    file.flush()
}

/// Renders the same chart as [`write_png`] and returns the encoded PNG bytes.
pub fn render_png(title: &str, panels: &[Panel]) -> Vec<u8> {
    let canvas = draw(title, panels);
    let mut bytes = Vec::new();
    encode(&canvas, &mut bytes).expect("PNG encoding into memory does not fail");
    bytes
}

fn encode<W: Write>(canvas: &Canvas, out: W) -> io::Result<()> {
    let mut encoder = png::Encoder::new(out, canvas.width as u32, canvas.height as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(&canvas.pixels)?;
    writer.finish()?;
    Ok(())
}

fn draw(title: &str, panels: &[Panel]) -> Canvas {
    let height = TITLE_HEIGHT as usize + panels.len() * PANEL_HEIGHT as usize;
    let mut canvas = Canvas::new(WIDTH as usize, height);
    let width = i64::from(WIDTH);
    // Drawn twice, one pixel apart, for a bold face.
    let title = fit(title, 2, width - 25);
    canvas.text(12, 10, &title, 2, INK);
    canvas.text(13, 10, &title, 2, INK);
    for (i, panel) in panels.iter().enumerate() {
        let top = i64::from(TITLE_HEIGHT) + i as i64 * i64::from(PANEL_HEIGHT);
        draw_panel(&mut canvas, panel, top);
    }
    canvas
}

fn draw_panel(canvas: &mut Canvas, panel: &Panel, top: i64) {
    let (left, right) = (PLOT_LEFT, PLOT_RIGHT);
    let (plot_top, plot_bottom) = (top + PLOT_TOP, top + PLOT_BOTTOM);

    // Header: legend right-aligned, title gets the room that is left.
    let legend_width = draw_legend(canvas, &panel.series, right, top + 12);
    canvas.text(
        left,
        top + 8,
        &fit(&panel.title, 2, right - left - legend_width - 16),
        2,
        INK,
    );

    let finite = |&&(x, y): &&(f64, f64)| x.is_finite() && y.is_finite();
    let points = || {
        panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().filter(finite))
    };
    let x_range = Range::of(points().map(|p| p.0));
    let y_range = Range::of(points().map(|p| p.1));

    let label_y = plot_bottom + 30;
    let label = fit(&panel.x_label, 1, right - left);
    canvas.text(
        (left + right - text_width(&label, 1)) / 2,
        label_y,
        &label,
        1,
        AXIS,
    );

    if let (Some(xr), Some(yr)) = (x_range, y_range) {
        let px = |x: f64| lerp(left + INSET, right - INSET, xr.fraction(x));
        let py = |y: f64| lerp(plot_bottom - INSET, plot_top + INSET, yr.fraction(y));

        // Snap a midpoint that is zero up to rounding noise (e.g. -0.3 .. 0.3).
        let half_span = yr.max * 0.5 - yr.min * 0.5;
        let mid = if yr.mid().abs() < half_span * 2e-9 {
            0.0
        } else {
            yr.mid()
        };
        for y in [yr.min, mid, yr.max] {
            let row = py(y);
            canvas.hline(left, right, row, GRID);
            let text = fit(&format_number(y), 1, left - 10);
            canvas.text(left - 6 - text_width(&text, 1), row - 3, &text, 1, INK);
        }
        for x in x_ticks(xr, points().all(|p| p.0.fract() == 0.0)) {
            let col = px(x);
            canvas.vline(col, plot_top, plot_bottom, GRID);
            canvas.vline(col, plot_bottom, plot_bottom + 4, AXIS);
            let text = if x.fract() == 0.0 && x.abs() < 1e9 {
                format!("{x:.0}")
            } else {
                format_number(x)
            };
            canvas.text(
                col - text_width(&text, 1) / 2,
                plot_bottom + 9,
                &text,
                1,
                INK,
            );
        }
        for (series, colour) in panel.series.iter().zip(PALETTE.iter().cycle()) {
            let mut previous: Option<(i64, i64)> = None;
            for &(x, y) in &series.points {
                if !(x.is_finite() && y.is_finite()) {
                    previous = None;
                    continue;
                }
                let here = (px(x), py(y));
                if let Some(from) = previous {
                    canvas.thick_line(from, here, *colour);
                }
                canvas.dot(here, 3, *colour);
                previous = Some(here);
            }
        }
    } else {
        let text = "no data";
        let (cx, cy) = ((left + right) / 2, (plot_top + plot_bottom) / 2);
        canvas.text(cx - text_width(text, 2) / 2, cy - 7, text, 2, MUTED);
    }

    for (x0, y0, x1, y1) in [
        (left, plot_top, right, plot_top),
        (left, plot_bottom, right, plot_bottom),
        (left, plot_top, left, plot_bottom),
        (right, plot_top, right, plot_bottom),
    ] {
        canvas.line((x0, y0), (x1, y1), AXIS);
    }
}

/// Draws the legend ending at `right` and returns its width in pixels.
fn draw_legend(canvas: &mut Canvas, series: &[Series], right: i64, y: i64) -> i64 {
    const SWATCH: i64 = 18;
    const GAP: i64 = 14;
    if series.is_empty() {
        return 0;
    }
    let budget = (right - PLOT_LEFT) * 3 / 5;
    let per_item = budget / series.len() as i64 - SWATCH - 4 - GAP;
    let names: Vec<String> = series.iter().map(|s| fit(&s.name, 1, per_item)).collect();
    let total: i64 = names
        .iter()
        .map(|n| SWATCH + 4 + text_width(n, 1) + GAP)
        .sum::<i64>()
        - GAP;
    let mut x = right - total;
    for (name, colour) in names.iter().zip(PALETTE.iter().cycle()) {
        canvas.thick_line((x, y + 3), (x + SWATCH - 1, y + 3), *colour);
        canvas.dot((x + SWATCH / 2, y + 3), 3, *colour);
        x += SWATCH + 4;
        canvas.text(x, y, name, 1, INK);
        x += text_width(name, 1) + GAP;
    }
    total
}

/// Closed interval of data values, never empty or zero-width.
#[derive(Debug, Clone, Copy)]
struct Range {
    min: f64,
    max: f64,
}

impl Range {
    /// Range spanned by `values` (all finite), padded if they are all (nearly) equal.
    fn of(values: impl Iterator<Item = f64>) -> Option<Self> {
        let (min, max) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
        if min > max {
            return None;
        }
        let magnitude = min.abs().max(max.abs());
        if max - min <= magnitude * 1e-12 {
            let pad = if magnitude > 0.0 {
                magnitude * 0.05
            } else {
                1.0
            };
            return Some(Self {
                min: min - pad,
                max: max + pad,
            });
        }
        Some(Self { min, max })
    }

    /// Position of `v` within the range, 0 at `min` and 1 at `max`.
    /// Halving first keeps the arithmetic finite even for ranges near `f64::MAX`.
    fn fraction(self, v: f64) -> f64 {
        (v * 0.5 - self.min * 0.5) / (self.max * 0.5 - self.min * 0.5)
    }

    fn mid(self) -> f64 {
        self.min * 0.5 + self.max * 0.5
    }
}

fn lerp(a: i64, b: i64, t: f64) -> i64 {
    // `as` saturates, and `t` is within [0, 1] for in-range values anyway.
    a + ((b - a) as f64 * t).round() as i64
}

/// Tick positions on the x axis: multiples of a 1/2/5 step within the range,
/// at least 1 apart when all x values are integers.
fn x_ticks(range: Range, integer_data: bool) -> Vec<f64> {
    let span = range.max * 0.5 - range.min * 0.5; // half the true span
    let raw = span / 5.0; // at most ~11 ticks
    let magnitude = 10f64.powf(raw.log10().floor());
    let nice = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * magnitude);
    let step = if integer_data { nice.max(1.0) } else { nice };
    // Ticks are computed as integer multiples of `step` so that 0 comes out exact.
    let first = (range.min / step).ceil();
    let count = (range.max / step).floor() - first;
    if !(step.is_finite() && step > 0.0 && first.is_finite() && (0.0..=50.0).contains(&count)) {
        return vec![range.min, range.max];
    }
    (0..=count as usize)
        .map(|i| (first + i as f64) * step)
        .collect()
}

/// Formats a tick value compactly: `0`, `-0.35`, `1520`, `12.3`, `1.2e-4`, `3e6`.
pub fn format_number(v: f64) -> String {
    if !v.is_finite() {
        return format!("{v}").to_lowercase();
    }
    let a = v.abs();
    if a == 0.0 {
        return "0".to_string();
    }
    if !(1e-3..1e5).contains(&a) {
        let s = format!("{v:.1e}");
        return s.replace(".0e", "e");
    }
    let decimals = (2 - a.log10().floor() as i32).clamp(0, 6) as usize;
    let mut s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.truncate(s.trim_end_matches('0').trim_end_matches('.').len());
    }
    if s == "-0" { "0".to_string() } else { s }
}

/// Width in pixels of `text` drawn at `scale`.
fn text_width(text: &str, scale: i64) -> i64 {
    (text.chars().count() as i64 * 6 - 1).max(0) * scale
}

/// Truncates `text` (with a trailing `..`) so it is at most `max_width` pixels wide.
fn fit(text: &str, scale: i64, max_width: i64) -> String {
    if text_width(text, scale) <= max_width {
        return text.to_string();
    }
    let keep = ((max_width / scale + 1) / 6 - 2).max(0) as usize;
    let mut out: String = text.chars().take(keep).collect();
    out.push_str("..");
    out
}

/// An RGB raster with clipped drawing primitives.
#[derive(Debug)]
struct Canvas {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

impl Canvas {
    fn new(width: usize, height: usize) -> Self {
        Self {
            width,
            height,
            pixels: WHITE.repeat(width * height),
        }
    }

    fn set(&mut self, x: i64, y: i64, colour: Rgb) {
        if (0..self.width as i64).contains(&x) && (0..self.height as i64).contains(&y) {
            let i = (y as usize * self.width + x as usize) * 3;
            self.pixels[i..i + 3].copy_from_slice(&colour);
        }
    }

    fn hline(&mut self, x0: i64, x1: i64, y: i64, colour: Rgb) {
        (x0..=x1).for_each(|x| self.set(x, y, colour));
    }

    fn vline(&mut self, x: i64, y0: i64, y1: i64, colour: Rgb) {
        (y0..=y1).for_each(|y| self.set(x, y, colour));
    }

    /// Bresenham line, calling `plot` for every pixel.
    fn walk(from: (i64, i64), to: (i64, i64), mut plot: impl FnMut(i64, i64)) {
        let (mut x, mut y) = from;
        let (dx, dy) = ((to.0 - x).abs(), -(to.1 - y).abs());
        let (sx, sy) = ((to.0 - x).signum(), (to.1 - y).signum());
        let mut err = dx + dy;
        loop {
            plot(x, y);
            if (x, y) == to {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    fn line(&mut self, from: (i64, i64), to: (i64, i64), colour: Rgb) {
        Self::walk(from, to, |x, y| self.set(x, y, colour));
    }

    /// A line two pixels thick (a 2x2 brush along the Bresenham path).
    fn thick_line(&mut self, from: (i64, i64), to: (i64, i64), colour: Rgb) {
        Self::walk(from, to, |x, y| {
            for (ox, oy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                self.set(x + ox, y + oy, colour);
            }
        });
    }

    fn dot(&mut self, (cx, cy): (i64, i64), radius: i64, colour: Rgb) {
        for y in -radius..=radius {
            for x in -radius..=radius {
                if x * x + y * y <= radius * radius + radius {
                    self.set(cx + x, cy + y, colour);
                }
            }
        }
    }

    /// Draws `text` with its top-left corner at `(x, y)`, each font pixel
    /// becoming a `scale` x `scale` square. Text is 7 rows high (8 with descenders).
    fn text(&mut self, x: i64, y: i64, text: &str, scale: i64, colour: Rgb) {
        for (i, c) in text.chars().enumerate() {
            let left = x + i as i64 * 6 * scale;
            let top = y + i64::from(descends(c)) * scale;
            for (row, bits) in (0..).zip(glyph(c)) {
                for col in (0..5).filter(|col| bits & (0x10 >> col) != 0) {
                    let (px, py) = (left + col * scale, top + row * scale);
                    for (ox, oy) in (0..scale).flat_map(|a| (0..scale).map(move |b| (a, b))) {
                        self.set(px + ox, py + oy, colour);
                    }
                }
            }
        }
    }
}

/// Whether `c` has a descender: its glyph is drawn one row lower.
fn descends(c: char) -> bool {
    matches!(c, 'g' | 'p' | 'q' | 'y')
}

/// 5x7 bitmap of `c`: seven rows, bit 4 is the leftmost column.
/// Characters without a glyph render as an empty box.
fn glyph(c: char) -> [u8; 7] {
    match c {
        ' ' => [0; 7],
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        'a' => [0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F],
        'b' => [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E],
        'c' => [0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E],
        'd' => [0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F],
        'e' => [0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E],
        'f' => [0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08],
        'g' => [0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E],
        'h' => [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11],
        'i' => [0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E],
        'j' => [0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C],
        'k' => [0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12],
        'l' => [0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'm' => [0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11],
        'n' => [0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11],
        'o' => [0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E],
        'p' => [0x00, 0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10],
        'q' => [0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x01],
        'r' => [0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10],
        's' => [0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E],
        't' => [0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06],
        'u' => [0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D],
        'v' => [0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'w' => [0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A],
        'x' => [0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11],
        'y' => [0x00, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E],
        'z' => [0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F],
        '.' => [0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C],
        ',' => [0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08],
        ':' => [0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00],
        ';' => [0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08],
        '-' => [0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00],
        '+' => [0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00],
        '=' => [0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '[' => [0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E],
        ']' => [0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E],
        '<' => [0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02],
        '>' => [0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08],
        '/' => [0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '_' => [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F],
        '!' => [0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04],
        '?' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04],
        '\'' => [0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00],
        '"' => [0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00],
        '#' => [0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A],
        '*' => [0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00],
        '&' => [0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D],
        '|' => [0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        '@' => [0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E],
        '^' => [0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00],
        '~' => [0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00],
        _ => [0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `bytes`, returning width, height and RGB pixels.
    fn decode(bytes: &[u8]) -> (u32, u32, Vec<u8>) {
        let mut reader = png::Decoder::new(bytes)
            .read_info()
            .expect("valid PNG header");
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).expect("valid PNG data");
        assert_eq!(info.color_type, png::ColorType::Rgb);
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

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
    fn decodes_to_expected_size() {
        for n in 0..4 {
            let panels = vec![panel("p", vec![series("s", &[(0.0, 1.0), (1.0, 2.0)])]); n];
            let (w, h, _) = decode(&render_png("chart", &panels));
            assert_eq!((w, h), (WIDTH, TITLE_HEIGHT + n as u32 * PANEL_HEIGHT));
        }
    }

    #[test]
    fn rising_series_goes_up() {
        let points: Vec<(f64, f64)> = (0..20)
            .map(|i| (f64::from(i), f64::from(i) * 0.5))
            .collect();
        let bytes = render_png("rise", &[panel("up", vec![series("reward", &points)])]);
        let (w, h, pixels) = decode(&bytes);
        // Lowest (largest y) pixel of the series colour in a column band.
        let lowest = |x0: u32, x1: u32| {
            (0..h)
                .rev()
                .find(|&y| {
                    (x0..x1).any(|x| {
                        let i = ((y * w + x) * 3) as usize;
                        pixels[i..i + 3] == PALETTE[0]
                    })
                })
                .expect("series colour present")
        };
        let left = lowest(0, w / 4);
        let right = lowest(3 * w / 4, w);
        assert!(
            left > right + 100,
            "left {left} should be well below right {right}"
        );
    }

    #[test]
    fn title_is_drawn() {
        let (w, _, pixels) = decode(&render_png("Reward over time", &[]));
        let dark = (0..TITLE_HEIGHT * w)
            .filter(|&p| {
                pixels[p as usize * 3..p as usize * 3 + 3]
                    .iter()
                    .all(|&c| c < 64)
            })
            .count();
        assert!(dark > 200, "only {dark} dark pixels in the title band");
        let (_, _, blank) = decode(&render_png("", &[]));
        assert!(blank.iter().all(|&c| c == 255));
    }

    #[test]
    fn edge_cases_render() {
        let (inf, nan, max) = (f64::INFINITY, f64::NAN, f64::MAX);
        let gaps = [(0.0, nan), (1.0, 1.0), (2.0, inf), (nan, 3.0), (4.0, 2.0)];
        let tiny = [(0.0, 1e-300), (1e-300, 2e-300), (2e-300, 5e-324)];
        let crowded = (0..12).map(|i| series(&"name".repeat(i), &[(0.0, 1.0)]));
        let cases = vec![
            panel("empty", vec![]),
            panel("no points", vec![series("a", &[])]),
            panel("one point", vec![series("a", &[(3.0, 7.0)])]),
            panel("flat", vec![series("a", &[(0.0, 2.0), (1.0, 2.0)])]),
            panel("zeros", vec![series("a", &[(0.0, 0.0), (5.0, 0.0)])]),
            panel("non-finite", vec![series("a", &gaps)]),
            panel("all nan", vec![series("a", &[(0.0, nan), (1.0, -inf)])]),
            panel("huge", vec![series("a", &[(-max, -1e300), (max, max)])]),
            panel("tiny", vec![series("a", &tiny)]),
            panel(
                "fraction",
                vec![series("a", &[(0.001, 1.0), (0.0013, 2.0)])],
            ),
            panel("wide x", vec![series("a", &[(0.0, 1.0), (1e9, 2.0)])]),
            panel(&"very long title ".repeat(40), crowded.collect()),
            panel(
                "odd chars \u{e9}\u{2713}",
                vec![series("\u{2192}", &[(0.0, 1.0)])],
            ),
        ];
        let (w, h, _) = decode(&render_png(&"x".repeat(500), &cases));
        let panels = u32::try_from(cases.len()).unwrap();
        assert_eq!((w, h), (WIDTH, TITLE_HEIGHT + panels * PANEL_HEIGHT));
    }

    #[test]
    fn numbers_are_compact() {
        let cases = [
            (0.0, "0"),
            (-0.35, "-0.35"),
            (1520.0, "1520"),
            (12.345, "12.3"),
            (0.00012, "1.2e-4"),
            (3e6, "3e6"),
            (-0.0001, "-1e-4"),
            (-0.0, "0"),
            (2e-300, "2e-300"),
            (99999.0, "99999"),
            (0.001234, "0.00123"),
        ];
        for (v, want) in cases {
            assert_eq!(format_number(v), want, "formatting {v}");
        }
    }

    #[test]
    fn x_ticks_are_integers_for_steps() {
        let ticks = x_ticks(Range { min: 0.0, max: 9.0 }, true);
        assert_eq!(ticks, (0..=9).map(f64::from).collect::<Vec<_>>());
        let ticks = x_ticks(Range { min: 1.0, max: 3.0 }, true);
        assert!(ticks.iter().all(|t| t.fract() == 0.0));
    }

    /// Renders a three-panel example through [`write_png`]. The file is kept
    /// at `$TAPLINE_CHART_EXAMPLE` if that is set (to look at it), else removed.
    #[test]
    fn writes_example_file() {
        let curve = |f: fn(f64) -> f64| -> Vec<(f64, f64)> {
            (0..10).map(|i| (f64::from(i), f(f64::from(i)))).collect()
        };
        let reward = vec![
            series("mean reward", &curve(|s| 0.8 - 0.6 * (-s / 4.0).exp())),
            series("max reward", &curve(|s| (0.5 + 0.05 * s).min(1.0))),
        ];
        let loss = vec![series(
            "policy loss",
            &curve(|s| -0.35 + 0.3 * (-s / 3.0).exp()),
        )];
        let grad = curve(|s| {
            if s == 6.0 {
                f64::NAN
            } else {
                1520.0 / (1.0 + s)
            }
        });
        let panels = [
            panel("Reward", reward),
            panel("Loss", loss),
            panel("Grad norm (pre-clip)", vec![series("grad_norm", &grad)]),
        ];
        let keep = std::env::var_os("TAPLINE_CHART_EXAMPLE");
        let path = keep.clone().map_or_else(
            || std::env::temp_dir().join(format!("chart-example-{}.png", std::process::id())),
            std::path::PathBuf::from,
        );
        let title = "tapline trainer: run 2024-06-01 (lr=1e-5, 10 steps)";
        write_png(&path, title, &panels).expect("write example");
        let bytes = std::fs::read(&path).expect("read example");
        if keep.is_none() {
            std::fs::remove_file(&path).expect("remove example");
        }
        let (w, h, _) = decode(&bytes);
        assert_eq!((w, h), (WIDTH, TITLE_HEIGHT + 3 * PANEL_HEIGHT));
    }
}
