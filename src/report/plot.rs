//! A measured step's live memory over time, as an SVG: live bytes above the
//! process baseline, the phases of the step shaded, the budget as a line.

use crate::measure::{alloc::Phase, Timeline};
use plotters::prelude::*;

/// Draws the timeline into an SVG document.
pub fn timeline_svg(timeline: &Timeline, budget: u64, title: &str) -> Result<String, String> {
    let mib = |b: u64| b.saturating_sub(timeline.baseline) as f64 / (1u64 << 20) as f64;
    let points: Vec<(f64, f64)> =
        timeline.events.iter().map(|e| (e.time_ns as f64 / 1e6, mib(e.live))).collect();
    let end = points.last().map_or(1.0, |p| p.0.max(1e-3));
    let top = points.iter().map(|p| p.1).fold(mib(timeline.baseline + budget), f64::max) * 1.1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..end, 0.0..top)
            .map_err(|e| e.to_string())?;
        chart.configure_mesh().x_desc("time (ms)").y_desc("live memory (MiB)").draw().map_err(|e| e.to_string())?;
        // phase bands
        let mut start = 0.0;
        let mut phase = timeline.events.first().map_or(Phase::Setup, |e| e.phase);
        let mut bands = Vec::new();
        for e in &timeline.events {
            if e.phase != phase {
                let t = e.time_ns as f64 / 1e6;
                bands.push((start, t, phase));
                start = t;
                phase = e.phase;
            }
        }
        bands.push((start, end, phase));
        for (a, b, p) in bands {
            let color = match p {
                Phase::ForwardBackward => BLUE.mix(0.08),
                Phase::OptimizerStep => RED.mix(0.10),
                Phase::Setup => WHITE.mix(0.0),
            };
            chart.draw_series([Rectangle::new([(a, 0.0), (b, top)], color.filled())]).map_err(|e| e.to_string())?;
        }
        chart
            .draw_series(LineSeries::new(points, &BLACK))
            .map_err(|e| e.to_string())?
            .label("live (forward+backward: blue band, optimizer step: red band)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK));
        let b = mib(timeline.baseline + budget);
        chart
            .draw_series(LineSeries::new([(0.0, b), (end, b)], RED.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label("budget")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED.stroke_width(2)));
        chart.configure_series_labels().background_style(WHITE).border_style(BLACK).draw().map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}
