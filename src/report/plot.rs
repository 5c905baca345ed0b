//! A measured step's live memory over time, as an SVG or PNG: live bytes
//! stacked by component (weights, optimizer state, gradients, activations,
//! temporaries), the phases of the step (forward, backward, optimizer step)
//! shaded and labelled, the budget as a line.
//!
//! A CUDA timeline (one with a [`PoolTrace`]) stacks the components on the
//! device memory outside the pool (context, modules, cuBLAS workspaces: a
//! labelled constant band at the bottom), so the top of the stack is what
//! the device holds for the run, and draws the pool's reserved bytes (on the
//! same band) as a second line; the header gives the fragmentation at the
//! allocated peak (reserved minus allocated: the pool's cached, free
//! memory; CUDA's pool does not tell its largest free block).
//!
//! The step's changes are reduced to at most [`COLUMNS`] samples, each the
//! moment of highest total within its slice of time, so peaks survive. When
//! the budget is more than twice the peak, drawing it would flatten the data:
//! the axis then ends above the peak and the legend gives the budget as off
//! the chart.
//!
//! PNGs are drawn by a small raster backend of our own (text from the public
//! domain 8×8 font of `font8x8`), so no system fonts are needed.

use crate::measure::timeline::{ComponentBytes, PoolTrace};
use crate::measure::Timeline;
use crate::track::alloc::Phase;
use crate::track::Component;
use crate::units::format_bytes;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendTextStyle, DrawingErrorKind, FontTransform,
};
use std::path::Path;

/// Most samples drawn across the time axis.
pub const COLUMNS: usize = 1000;

/// Size of the picture in pixels.
const SIZE: (u32, u32) = (1200, 600);

/// An image format for `--plot`, chosen by the file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotFormat {
    /// `.svg`
    Svg,
    /// `.png`
    Png,
}

impl PlotFormat {
    /// The format `path` names by its extension (case-insensitive); an error
    /// message naming the path for anything else.
    pub fn from_path(path: &Path) -> Result<PlotFormat, String> {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("svg") => Ok(PlotFormat::Svg),
            Some("png") => Ok(PlotFormat::Png),
            _ => Err(format!(
                "cannot plot to {}: the file name must end in .svg or .png",
                path.display()
            )),
        }
    }
}

fn color(c: Component) -> RGBColor {
    match c {
        Component::Weights => RGBColor(0x4e, 0x79, 0xa7),
        Component::OptimizerState => RGBColor(0xaf, 0x7a, 0xa1),
        Component::Gradients => RGBColor(0xf2, 0x8e, 0x2c),
        Component::Activations => RGBColor(0x59, 0xa1, 0x4f),
        Component::Temporaries => RGBColor(0xba, 0xb0, 0xab),
    }
}

fn phase_style(p: Phase) -> Option<(RGBColor, &'static str)> {
    match p {
        Phase::Setup => None,
        Phase::Forward => Some((RGBColor(0xdd, 0xea, 0xf7), "forward")),
        Phase::Backward => Some((RGBColor(0xfc, 0xe6, 0xcf), "backward")),
        Phase::OptimizerStep => Some((RGBColor(0xf1, 0xdc, 0xec), "optimizer step")),
    }
}

/// At most `columns` samples of the series: per slice of time, the moment of
/// highest total (and the first and last moments).
fn samples(timeline: &Timeline, columns: usize) -> Vec<(f64, ComponentBytes)> {
    let series = timeline.series();
    let end = timeline.end_ns.max(1);
    let mut out: Vec<(u64, ComponentBytes)> = Vec::new();
    let mut slot = usize::MAX;
    let total = |b: &ComponentBytes| b.iter().sum::<u64>();
    for (t, b) in &series {
        let s = (*t as u128 * columns as u128 / end as u128) as usize;
        match out.last_mut() {
            Some(last) if s == slot => {
                if total(b) > total(&last.1) {
                    *last = (*t, *b);
                }
            }
            _ => {
                out.push((*t, *b));
                slot = s;
            }
        }
    }
    if let (Some(last), Some(&(t, b))) = (out.last(), series.last()) {
        if last.0 != t || last.1 != b {
            out.push((t, b));
        }
    }
    // What is live after the last change stays live to the end of the step.
    if let Some(&(t, b)) = out.last() {
        if t < timeline.end_ns {
            out.push((timeline.end_ns, b));
        }
    }
    out.into_iter().map(|(t, b)| (t as f64 / 1e6, b)).collect()
}

/// At most `columns` samples of the pool's reserved bytes (ms, bytes): per
/// slice of time the highest, and the last.
fn reserved_samples(pool: &PoolTrace, end_ns: u64, columns: usize) -> Vec<(f64, u64)> {
    let end = end_ns.max(1);
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut slot = usize::MAX;
    for &(t, _, r) in &pool.samples {
        let s = (t as u128 * columns as u128 / end as u128) as usize;
        match out.last_mut() {
            Some(last) if s == slot => {
                if r > last.1 {
                    *last = (t, r);
                }
            }
            _ => {
                out.push((t, r));
                slot = s;
            }
        }
    }
    if let (Some(last), Some(&(t, _, r))) = (out.last(), pool.samples.last()) {
        if last.0 != t {
            out.push((t, r));
        }
    }
    out.into_iter().map(|(t, r)| (t as f64 / 1e6, r)).collect()
}

/// The phases as `(start ms, end ms, phase)`.
fn phase_spans(timeline: &Timeline) -> Vec<(f64, f64, Phase)> {
    let ms = |t: u64| t as f64 / 1e6;
    let end = ms(timeline.end_ns);
    let p = &timeline.phases;
    (0..p.len())
        .map(|i| (ms(p[i].0), p.get(i + 1).map_or(end, |n| ms(n.0)), p[i].1))
        .collect()
}

const MIB: f64 = (1u64 << 20) as f64;

/// Font sizes: `(title, text)`. plotters lays text out with estimated
/// metrics; the PNG's 8×8 glyphs match them at size 18.
type FontSizes = (u32, u32);
const SVG_FONTS: FontSizes = (16, 13);
const PNG_FONTS: FontSizes = (18, 18);

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    timeline: &Timeline,
    budget: u64,
    title: &str,
    (title_size, text): FontSizes,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let points = samples(timeline, COLUMNS);
    let (peak_ns, peak) = timeline.peak();
    let pool = timeline.pool.as_ref();
    // On CUDA the stack stands on the memory outside the pool.
    let outside = pool.map_or(0, |p| p.outside);
    let peak_total: u64 = peak.iter().sum::<u64>() + outside;
    let highest = peak_total.max(pool.map_or(0, |p| p.reserved_peak() + outside));
    let end = (timeline.end_ns as f64 / 1e6).max(1e-3);
    let budget_shown = budget <= highest.saturating_mul(2);
    let top = (if budget_shown {
        highest.max(budget)
    } else {
        highest
    }) as f64
        / MIB
        * 1.12
        + 1e-3;
    root.fill(&WHITE).map_err(err)?;
    let peak_line = format!(
        "peak {}{} at {:.1} ms ({}){}",
        format_bytes(peak_total),
        if pool.is_some() {
            " allocated (outside the pool included)"
        } else {
            ""
        },
        peak_ns as f64 / 1e6,
        timeline.phase_at(peak_ns).as_str().replace('_', " "),
        if timeline.truncated {
            "; the recording was cut short"
        } else {
            ""
        }
    );
    let pool_line = pool.map(PoolTrace::short_summary);
    let mut header = vec![(title, title_size), (peak_line.as_str(), text)];
    if let Some(line) = &pool_line {
        header.push((line.as_str(), text));
    }
    for (i, (line, size)) in header.into_iter().enumerate() {
        let style = ("sans-serif", size)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Left, VPos::Top));
        root.draw(&Text::new(
            line.to_string(),
            (16, 10 + 22 * i as i32),
            style,
        ))
        .map_err(err)?;
    }
    let mut chart = ChartBuilder::on(&root)
        .margin(14)
        .margin_top(if pool.is_some() { 82 } else { 60 })
        .x_label_area_size(44)
        .y_label_area_size(76)
        .build_cartesian_2d(0.0..end, 0.0..top)
        .map_err(err)?;
    let decimals = |range: f64| {
        if range >= 20.0 {
            0
        } else if range >= 2.0 {
            1
        } else {
            3
        }
    };
    let (x_decimals, y_decimals) = (decimals(end), decimals(top));
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("time in the measured step (ms)")
        .y_desc("live memory (MiB)")
        .x_label_formatter(&|v| format!("{v:.x_decimals$}"))
        .y_label_formatter(&|v| format!("{v:.y_decimals$}"))
        .label_style(("sans-serif", text))
        .axis_desc_style(("sans-serif", text + 1))
        .draw()
        .map_err(err)?;
    // Phases: shaded bands, labelled where wide enough.
    let spans = phase_spans(timeline);
    for &(a, b, p) in &spans {
        if let Some((c, _)) = phase_style(p) {
            chart
                .draw_series([Rectangle::new([(a, 0.0), (b, top)], c.filled())])
                .map_err(err)?;
        }
    }
    // The memory outside the pool, a constant band at the bottom.
    let base = outside as f64 / MIB;
    if outside > 0 {
        let grey = RGBColor(0x79, 0x70, 0x6e);
        chart
            .draw_series([Rectangle::new([(0.0, 0.0), (end, base)], grey.filled())])
            .map_err(err)?
            .label(format!(
                "outside the pool: context, modules, cuBLAS ({})",
                format_bytes(outside)
            ))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], grey.filled()));
    }
    // Components, stacked bottom to top.
    let mut lower = vec![base; points.len()];
    for c in Component::ALL {
        let upper: Vec<f64> = points
            .iter()
            .zip(&lower)
            .map(|((_, b), l)| l + b[c as usize] as f64 / MIB)
            .collect();
        if upper.iter().zip(&lower).all(|(u, l)| u <= l) {
            lower = upper;
            continue;
        }
        let mut outline: Vec<(f64, f64)> = points
            .iter()
            .zip(&upper)
            .map(|((x, _), y)| (*x, *y))
            .collect();
        outline.extend(points.iter().zip(&lower).rev().map(|((x, _), y)| (*x, *y)));
        let label = format!(
            "{} ({} at peak)",
            c.as_str().replace('_', " "),
            format_bytes(peak[c as usize])
        );
        chart
            .draw_series([Polygon::new(outline, color(c).filled())])
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color(c).filled()));
        lower = upper;
    }
    for &(a, b, p) in &spans {
        if let Some((c, name)) = phase_style(p) {
            let dark = RGBColor(c.0 / 2, c.1 / 2, c.2 / 2);
            chart
                .draw_series([PathElement::new([(a, 0.0), (a, top)], dark.mix(0.6))])
                .map_err(err)?;
            if (b - a) / end > 0.07 {
                let style = ("sans-serif", text)
                    .into_font()
                    .color(&dark)
                    .pos(Pos::new(HPos::Center, VPos::Top));
                chart
                    .draw_series([Text::new(name, ((a + b) / 2.0, top * 0.985), style)])
                    .map_err(err)?;
            }
        }
    }
    // The pool's reserved bytes, on the same base.
    if let Some(pool) = pool {
        let navy = RGBColor(0x1f, 0x2f, 0x6f);
        let line = reserved_samples(pool, timeline.end_ns, COLUMNS);
        let mut stepped = Vec::with_capacity(line.len() * 2);
        for (i, &(t, r)) in line.iter().enumerate() {
            let y = base + r as f64 / MIB;
            if i > 0 {
                stepped.push((t, stepped.last().map_or(y, |p: &(f64, f64)| p.1)));
            }
            stepped.push((t, y));
        }
        stepped.push((end, stepped.last().map_or(base, |p| p.1)));
        chart
            .draw_series(LineSeries::new(stepped, navy.stroke_width(2)))
            .map_err(err)?
            .label(format!(
                "reserved by the pool (peak {})",
                format_bytes(pool.reserved_peak())
            ))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], navy.stroke_width(2)));
    }
    // The phases in the legend too (bands may be too narrow for their labels).
    for p in [Phase::Forward, Phase::Backward, Phase::OptimizerStep] {
        if let (Some((c, name)), true) = (phase_style(p), spans.iter().any(|s| s.2 == p)) {
            chart
                .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
                .map_err(err)?
                .label(format!("{name} (shaded)"))
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
        }
    }
    let budget_label = format!("budget {}", format_bytes(budget));
    if budget_shown {
        let y = budget as f64 / MIB;
        chart
            .draw_series(LineSeries::new([(0.0, y), (end, y)], RED.stroke_width(2)))
            .map_err(err)?
            .label(budget_label)
            .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], RED.stroke_width(2)));
    } else {
        chart
            .draw_series(std::iter::empty::<PathElement<(f64, f64)>>())
            .map_err(err)?
            .label(format!("{budget_label} (off the chart)"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], RED.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", text))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Draws the timeline as an SVG document.
pub fn timeline_svg(timeline: &Timeline, budget: u64, title: &str) -> Result<String, String> {
    let mut svg = String::new();
    draw(
        SVGBackend::with_string(&mut svg, SIZE).into_drawing_area(),
        timeline,
        budget,
        title,
        SVG_FONTS,
    )?;
    Ok(svg)
}

/// Draws the timeline as a PNG image.
pub fn timeline_png(timeline: &Timeline, budget: u64, title: &str) -> Result<Vec<u8>, String> {
    let mut rgb = vec![255u8; SIZE.0 as usize * SIZE.1 as usize * 3];
    let canvas = Canvas {
        width: SIZE.0,
        height: SIZE.1,
        rgb: &mut rgb,
    };
    draw(
        canvas.into_drawing_area(),
        timeline,
        budget,
        title,
        PNG_FONTS,
    )?;
    encode_png(SIZE.0, SIZE.1, &rgb)
}

/// Draws the timeline in `format`.
pub fn timeline_plot(
    timeline: &Timeline,
    budget: u64,
    title: &str,
    format: PlotFormat,
) -> Result<Vec<u8>, String> {
    match format {
        PlotFormat::Svg => timeline_svg(timeline, budget, title).map(String::into_bytes),
        PlotFormat::Png => timeline_png(timeline, budget, title),
    }
}

/// An RGB raster that plotters draws on, with text from an 8×8 bitmap font.
struct Canvas<'a> {
    width: u32,
    height: u32,
    rgb: &'a mut [u8],
}

/// Drawing on a [`Canvas`] cannot fail; the type only satisfies plotters.
#[derive(Debug)]
struct CanvasError;

impl std::fmt::Display for CanvasError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("canvas error")
    }
}

impl std::error::Error for CanvasError {}

/// `rgb` (8-bit RGB rows) as a PNG file.
fn encode_png(width: u32, height: u32, rgb: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(rgb).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())?;
    Ok(out)
}

impl Canvas<'_> {
    /// Glyph size (square) and advance in pixels for a font size: the advance
    /// plotters' own estimate assumes, so boxes fit the text; at size 18 the
    /// 8×8 glyphs are drawn unscaled.
    fn cell(size: f64) -> (i32, i32) {
        let advance = ((size / 1.24 / 1.24 * 0.7).round() as i32).max(4);
        (advance, advance)
    }
}

impl DrawingBackend for Canvas<'_> {
    type ErrorType = CanvasError;

    fn get_size(&self) -> (u32, u32) {
        (self.width, self.height)
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<CanvasError>> {
        Ok(())
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<CanvasError>> {
        Ok(())
    }

    fn draw_pixel(
        &mut self,
        (x, y): BackendCoord,
        color: BackendColor,
    ) -> Result<(), DrawingErrorKind<CanvasError>> {
        if x < 0 || y < 0 || x >= self.width as i32 || y >= self.height as i32 {
            return Ok(());
        }
        let i = (y as usize * self.width as usize + x as usize) * 3;
        let a = color.alpha.clamp(0.0, 1.0);
        for (k, c) in [color.rgb.0, color.rgb.1, color.rgb.2]
            .into_iter()
            .enumerate()
        {
            let dst = &mut self.rgb[i + k];
            *dst = (f64::from(*dst) * (1.0 - a) + f64::from(c) * a).round() as u8;
        }
        Ok(())
    }

    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<CanvasError>> {
        let (cell, advance) = Canvas::cell(style.size());
        let (w, h) = (advance * text.chars().count() as i32, cell);
        let anchor = style.anchor();
        let dx = match anchor.h_pos {
            HPos::Left => 0,
            HPos::Right => -w,
            HPos::Center => -w / 2,
        };
        let dy = match anchor.v_pos {
            VPos::Top => 0,
            VPos::Center => -h / 2,
            VPos::Bottom => -h,
        };
        let transform = style.transform();
        let color = style.color();
        for (i, ch) in text.chars().enumerate() {
            let glyph = font8x8::legacy::BASIC_LEGACY
                .get(ch as usize)
                .copied()
                .unwrap_or([0; 8]);
            for gy in 0..cell {
                let row = glyph[(gy * 8 / cell) as usize];
                for gx in 0..cell {
                    if row >> (gx * 8 / cell) & 1 == 1 {
                        let (x, y) = (i as i32 * advance + gx + dx, gy + dy);
                        let (x, y) = match transform {
                            FontTransform::None => (x, y),
                            FontTransform::Rotate90 => (-y, x),
                            FontTransform::Rotate180 => (-x, -y),
                            FontTransform::Rotate270 => (y, -x),
                        };
                        self.draw_pixel((pos.0 + x, pos.1 + y), color)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn estimate_text_size<S: BackendTextStyle>(
        &self,
        text: &str,
        style: &S,
    ) -> Result<(u32, u32), DrawingErrorKind<CanvasError>> {
        let (cell, advance) = Canvas::cell(style.size());
        Ok((advance as u32 * text.chars().count() as u32, cell as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measure::timeline::tests::ev;
    use crate::track::alloc::EventKind;
    use crate::track::tag::Op;
    use std::collections::HashMap;

    fn timeline() -> Timeline {
        use EventKind::{Alloc, Free, StepStart};
        let events = [
            ev(Alloc, 0, 0x10, 4 << 20, Phase::Setup, Op::InitWeights),
            ev(StepStart, 1_000_000, 0, 0, Phase::Setup, Op::None),
            ev(EventKind::Phase, 2_000_000, 0, 0, Phase::Forward, Op::None),
            ev(Alloc, 3_000_000, 0x20, 2 << 20, Phase::Forward, Op::Matmul),
            ev(EventKind::Phase, 4_000_000, 0, 0, Phase::Backward, Op::None),
            ev(Free, 5_000_000, 0x20, 2 << 20, Phase::Backward, Op::None),
            ev(
                EventKind::Phase,
                6_000_000,
                0,
                0,
                Phase::OptimizerStep,
                Op::None,
            ),
            ev(
                Alloc,
                7_000_000,
                0x30,
                1 << 20,
                Phase::OptimizerStep,
                Op::AdamW,
            ),
            ev(
                Free,
                8_000_000,
                0x30,
                1 << 20,
                Phase::OptimizerStep,
                Op::AdamW,
            ),
        ];
        Timeline::from_events(&events, &HashMap::new(), 0, false)
    }

    #[test]
    fn svg_has_components_phases_and_budget() {
        let svg = timeline_svg(&timeline(), 8 << 20, "test").unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for s in [
            "weights",
            "activations",
            "forward",
            "backward",
            "optimizer step",
            "budget 8.00 MiB",
        ] {
            assert!(svg.contains(s), "{s} missing");
        }
        let far = timeline_svg(&timeline(), 1 << 30, "test").unwrap();
        assert!(far.contains("(off the chart)"));
    }

    #[test]
    fn a_device_plot_has_the_reserve_the_outside_and_the_fragmentation() {
        use crate::measure::timeline::tests::device_events;
        let t = Timeline::from_device_events(&device_events(), &HashMap::new(), 7 << 20, false);
        let svg = timeline_svg(&t, 1 << 30, "cuda").unwrap();
        for s in [
            "reserved by the pool (peak 170 B)",
            "outside the pool: context, modules, cuBLAS (7.00 MiB)",
            "fragmentation 12 B",
            "allocated (outside the pool included)",
        ] {
            assert!(svg.contains(s), "{s} missing");
        }
        let png = timeline_png(&t, 1 << 30, "cuda").unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    }

    #[test]
    fn png_is_a_png_with_drawing_in_it() {
        let png = timeline_png(&timeline(), 8 << 20, "test").unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(png.len() > 1000);
    }

    #[test]
    fn format_follows_the_extension() {
        assert_eq!(
            PlotFormat::from_path(Path::new("a/b.SVG")),
            Ok(PlotFormat::Svg)
        );
        assert_eq!(
            PlotFormat::from_path(Path::new("b.png")),
            Ok(PlotFormat::Png)
        );
        assert!(PlotFormat::from_path(Path::new("b.jpg"))
            .unwrap_err()
            .contains("b.jpg"));
        assert!(PlotFormat::from_path(Path::new("plot")).is_err());
    }

    #[test]
    fn samples_run_to_the_end_of_the_step() {
        let mut t = timeline();
        t.end_ns += 5_000_000;
        let s = samples(&t, COLUMNS);
        let &(ms, bytes) = s.last().unwrap();
        assert_eq!(ms, t.end_ns as f64 / 1e6);
        assert_eq!(
            bytes.iter().sum::<u64>(),
            4 << 20,
            "the weights, still live"
        );
    }

    #[test]
    fn samples_keep_the_peak() {
        let t = timeline();
        let s = samples(&t, 2);
        let top = s.iter().map(|(_, b)| b.iter().sum::<u64>()).max().unwrap();
        assert_eq!(top, 6 << 20);
    }
}
