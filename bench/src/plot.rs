//! SVG plots: TTFT CDF per mode, and p50 / p99 TTFT against load.

use std::path::Path;

use plotters::prelude::*;

use crate::compare::mode_rank;

/// Colours by mode rank (round-robin, least-request, approx, kvasir).
const COLOURS: [RGBColor; 5] = [
    RGBColor(120, 120, 120),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 120, 60),
    RGBColor(204, 121, 167),
];

fn colour(mode: &str) -> RGBColor {
    COLOURS[mode_rank(mode).min(COLOURS.len() - 1)]
}

type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// Plots the CDF of TTFT (log x axis) for each `(mode, sorted TTFTs)`.
/// Requests that never answered (infinite TTFT) keep the curve below 1.
pub fn ttft_cdf(path: &Path, title: &str, series: &[(String, Vec<f64>)]) -> PlotResult {
    let finite = || {
        series
            .iter()
            .flat_map(|(_, v)| v.iter().copied().filter(|x| x.is_finite() && *x > 0.0))
    };
    let lo = finite().fold(f64::INFINITY, f64::min).max(1.0);
    let hi = finite().fold(0.0, f64::max).max(lo * 10.0);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo * 0.9..hi * 1.1).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (simulated ms, log scale)")
        .y_desc("share of requests")
        .draw()?;
    for (mode, v) in series {
        let n = v.len().max(1) as f64;
        let pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, x)| (x.max(lo), (i + 1) as f64 / n))
            .collect();
        let c = colour(mode);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(mode.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// One mode's percentile curve against load.
pub struct LoadCurve {
    /// Mode label.
    pub mode: String,
    /// (load factor, p50 TTFT ms, p99 TTFT ms).
    pub points: Vec<(f64, f64, f64)>,
}

/// Plots p50 (left) and p99 (right) TTFT against load, log y axis.
/// Infinite values (requests that never answered) are drawn at the top.
pub fn ttft_vs_load(path: &Path, title: &str, curves: &[LoadCurve]) -> PlotResult {
    let vals = || {
        curves
            .iter()
            .flat_map(|c| c.points.iter().flat_map(|p| [p.1, p.2]))
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    let lo = vals().fold(f64::INFINITY, f64::min).max(1.0);
    let hi = vals().fold(0.0, f64::max).max(lo * 10.0);
    let (xlo, xhi) = curves
        .iter()
        .flat_map(|c| c.points.iter().map(|p| p.0))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
            (a.min(x), b.max(x))
        });
    let (xlo, xhi) = if xlo < xhi {
        (xlo, xhi)
    } else {
        (xlo - 0.5, xlo + 0.5)
    };
    let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let panels = root.split_evenly((1, 2));
    for (k, panel) in panels.iter().enumerate() {
        let which = if k == 0 { "p50" } else { "p99" };
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{which} TTFT"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(xlo - 0.1..xhi + 0.1, (lo * 0.8..hi * 1.5).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("load (1.0 = round-robin at ~70% prefill use)")
            .y_desc("simulated ms (log)")
            .draw()?;
        for c in curves {
            let col = colour(&c.mode);
            let pts: Vec<(f64, f64)> = c
                .points
                .iter()
                .map(|p| {
                    let v = if k == 0 { p.1 } else { p.2 };
                    (p.0, if v.is_finite() { v.max(lo) } else { hi * 1.4 })
                })
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))?
                .label(c.mode.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], col.stroke_width(2))
                });
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, col.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_render_to_svg_even_with_infinities() {
        let dir = std::env::temp_dir().join(format!("kvasir-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cdf = dir.join("cdf.svg");
        ttft_cdf(
            &cdf,
            "t",
            &[
                ("round-robin".into(), vec![10.0, 100.0, f64::INFINITY]),
                ("kvasir".into(), vec![5.0, 6.0]),
            ],
        )
        .unwrap();
        let text = std::fs::read_to_string(&cdf).unwrap();
        assert!(text.starts_with("<svg") && text.contains("kvasir"));
        let load = dir.join("load.svg");
        ttft_vs_load(
            &load,
            "t",
            &[LoadCurve {
                mode: "kvasir".into(),
                points: vec![(1.0, 10.0, 50.0), (2.0, 20.0, f64::INFINITY)],
            }],
        )
        .unwrap();
        assert!(std::fs::read_to_string(&load).unwrap().contains("p99 TTFT"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
