//! The charts of `flotilla bench`, `flotilla sim` and `flotilla plot`, drawn with `plotters`
//! as SVG (its SVG backend) and PNG (its bitmap backend into a buffer, encoded by `png`).
//!
//! A figure is a grid of [`Panel`]s, one colour per run in every panel (the same run, the
//! same colour), each panel with its own legend. Text is set in DejaVu Sans, embedded in the
//! binary (the `dejavu` crate) and registered with plotters' `ab_glyph` text backend once
//! ([`register_font`]), so drawing needs no system font, fontconfig or other system library.
//!
//! Figures:
//! - [`latency_panels`] (`latency.svg` / `latency.png`, bench and sim `--out`): TTFT over time
//!   (one point per request, at its first token), inter-token latency over time (one point
//!   per gap, at its later token), and the CDFs of both.
//! - [`cdf_panels`] (`latency_cdf.svg` / `latency_cdf.png`): the CDFs (drawn as steps) of TTFT and end-to-end
//!   latency.
//! - [`side_by_side_panels`] (`flotilla plot`): the CDFs of TTFT and ITL and the requests in
//!   flight over time, for runs from several folders.
//!
//! Over-time panels keep at most [`MAX_TIME_POINTS`] points per run (evenly strided through
//! the samples in time order), CDFs at most [`MAX_POINTS`] (`cdf_points`).

use anyhow::anyhow;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::metrics::RequestResult;

/// Most points per run in an over-time panel.
pub const MAX_TIME_POINTS: usize = 2000;
/// Most points drawn per CDF line (the same bound as the in-flight step functions of
/// [`PlotSeries`](super::report::PlotSeries)).
pub use super::report::MAX_POINTS;

/// One panel's size (px); a figure is a grid of them.
pub const PANEL_SIZE: (u32, u32) = (560, 380);

/// Line colours, cycled (one per run).
const COLOURS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// How a panel draws its series.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// Connected lines (CDFs, counts over time); y from 0 to 1 when `fraction`.
    Lines { fraction: bool },
    /// One dot per sample (latencies over time).
    Points,
}

/// One panel of a figure: a title, axis descriptions, and one `(label, points)` series per
/// run.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    pub style: Style,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

/// Points `(value, cumulative fraction)` of the empirical CDF of `v`, at most [`MAX_POINTS`]
/// (+1: the last sample at fraction 1); non-finite samples are left out.
pub fn cdf_points(v: &[f64]) -> Vec<(f64, f64)> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let step = n.div_ceil(MAX_POINTS).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (s[i], (i + 1) as f64 / n as f64))
        .collect();
    if let (Some(&last), Some(p)) = (s.last(), pts.last())
        && p.1 < 1.0
    {
        pts.push((last, 1.0));
    }
    pts
}

/// `pts` (in order of x) as a step function: before each point, one at its x and the
/// previous point's y (the first starts from 0).
fn steps(pts: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(pts.len() * 2);
    let mut y = 0.0;
    for &(px, py) in pts {
        out.push((px, y));
        out.push((px, py));
        y = py;
    }
    out
}

/// At most `max` of `pts`, evenly strided, in order of x.
fn thin(mut pts: Vec<(f64, f64)>, max: usize) -> Vec<(f64, f64)> {
    pts.retain(|(x, y)| x.is_finite() && y.is_finite());
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let step = pts.len().div_ceil(max.max(1)).max(1);
    pts.into_iter().step_by(step).collect()
}

/// `(s from the run's start, TTFT ms)` of each successful request, at its first token.
pub fn ttft_over_time(results: &[RequestResult]) -> Vec<(f64, f64)> {
    let pts = results
        .iter()
        .filter(|r| r.ok)
        .filter_map(|r| r.ttft_ms.map(|t| (r.sent_s + t / 1000.0, t)))
        .collect();
    thin(pts, MAX_TIME_POINTS)
}

/// `(s from the run's start, ITL ms)` of every gap between two content chunks of a
/// successful request, at the later chunk.
pub fn itl_over_time(results: &[RequestResult]) -> Vec<(f64, f64)> {
    let ok = || results.iter().filter(|r| r.ok && r.ttft_ms.is_some());
    // A long run has millions of gaps: keep every `step`-th as they are read (about
    // MAX_TIME_POINTS of them), then put those in time order.
    let total: usize = ok().map(|r| r.itl_ms.len()).sum();
    let step = total.div_ceil(MAX_TIME_POINTS).max(1);
    let mut pts = Vec::with_capacity(total / step + 1);
    let mut i = 0usize;
    for r in ok() {
        let mut at_ms = r.ttft_ms.unwrap_or(0.0);
        for &gap in &r.itl_ms {
            at_ms += gap;
            if i.is_multiple_of(step) {
                pts.push((r.sent_s + at_ms / 1000.0, gap));
            }
            i += 1;
        }
    }
    thin(pts, MAX_TIME_POINTS)
}

fn cdf_panel(title: &str, runs: &[(&str, &[f64])]) -> Panel {
    Panel {
        title: title.to_owned(),
        x_desc: "ms".to_owned(),
        y_desc: "fraction".to_owned(),
        style: Style::Lines { fraction: true },
        series: runs
            .iter()
            .map(|(l, v)| ((*l).to_owned(), cdf_points(v)))
            .collect(),
    }
}

/// The bench's latency figure (`latency.svg` / `.png`): TTFT over time, ITL over time, and
/// their CDFs, one series per run (`(label, the run's requests)`).
pub fn latency_panels(runs: &[(String, Vec<RequestResult>)]) -> Vec<Panel> {
    let over_time = |title: &str, y: &str, f: fn(&[RequestResult]) -> Vec<(f64, f64)>| Panel {
        title: title.to_owned(),
        x_desc: "s from the run's start".to_owned(),
        y_desc: y.to_owned(),
        style: Style::Points,
        series: runs.iter().map(|(l, r)| (l.clone(), f(r))).collect(),
    };
    let ttft: Vec<Vec<f64>> = runs
        .iter()
        .map(|(_, r)| {
            r.iter()
                .filter(|x| x.ok)
                .filter_map(|x| x.ttft_ms)
                .collect()
        })
        .collect();
    let itl: Vec<Vec<f64>> = runs
        .iter()
        .map(|(_, r)| {
            r.iter()
                .filter(|x| x.ok)
                .flat_map(|x| x.itl_ms.iter().copied())
                .collect()
        })
        .collect();
    let cdf = |title: &str, v: &[Vec<f64>]| {
        let s: Vec<(&str, &[f64])> = runs
            .iter()
            .zip(v)
            .map(|((l, _), x)| (l.as_str(), x.as_slice()))
            .collect();
        cdf_panel(title, &s)
    };
    let (ttft_cdf, itl_cdf) = (cdf("TTFT CDF", &ttft), cdf("Inter-token latency CDF", &itl));
    vec![
        over_time("TTFT over time", "TTFT (ms)", ttft_over_time),
        over_time("Inter-token latency over time", "ITL (ms)", itl_over_time),
        ttft_cdf,
        itl_cdf,
    ]
}

/// `latency_cdf.svg` / `.png`: the CDFs of TTFT and end-to-end latency, one line per run
/// (`(label, TTFTs, E2E latencies)`, ms).
pub fn cdf_panels(runs: &[(&str, &[f64], &[f64])]) -> Vec<Panel> {
    let ttft: Vec<(&str, &[f64])> = runs.iter().map(|(l, t, _)| (*l, *t)).collect();
    let e2e: Vec<(&str, &[f64])> = runs.iter().map(|(l, _, e)| (*l, *e)).collect();
    vec![
        cdf_panel("TTFT CDF", &ttft),
        cdf_panel("End-to-end latency CDF", &e2e),
    ]
}

/// `flotilla plot`'s figure: the CDFs of TTFT and ITL and the requests in flight over time,
/// one series per run (`(label, series)`).
pub fn side_by_side_panels(runs: &[(String, super::report::PlotSeries)]) -> Vec<Panel> {
    let ttft: Vec<(&str, &[f64])> = runs
        .iter()
        .map(|(l, s)| (l.as_str(), s.ttft_ms.as_slice()))
        .collect();
    let itl: Vec<(&str, &[f64])> = runs
        .iter()
        .map(|(l, s)| (l.as_str(), s.itl_ms.as_slice()))
        .collect();
    vec![
        cdf_panel("TTFT CDF", &ttft),
        cdf_panel("Inter-token latency CDF", &itl),
        Panel {
            title: "Requests in flight".to_owned(),
            x_desc: "s from the first request".to_owned(),
            y_desc: "requests".to_owned(),
            style: Style::Lines { fraction: false },
            series: runs
                .iter()
                .map(|(l, s)| (l.clone(), s.in_flight.clone()))
                .collect(),
        },
    ]
}

/// Register DejaVu Sans as plotters' fonts (once per process; `ab_glyph` draws with the
/// fonts registered, never the system's).
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        ["sans-serif", "serif", "monospace"]
            .into_iter()
            .all(|family| {
                plotters::style::register_font(family, FontStyle::Normal, dejavu::sans::regular())
                    .is_ok()
            })
    });
    anyhow::ensure!(ok, "the embedded font is not a TrueType font");
    Ok(())
}

/// The grid a figure of `n` panels is laid out in: 2 columns (1 for one panel).
fn grid(n: usize) -> (usize, usize) {
    let cols = if n <= 1 { 1 } else { 2 };
    (n.div_ceil(cols).max(1), cols)
}

/// The figure's size (px) for `n` panels.
pub fn figure_size(n: usize) -> (u32, u32) {
    let (rows, cols) = grid(n);
    (PANEL_SIZE.0 * cols as u32, PANEL_SIZE.1 * rows as u32)
}

/// The largest finite value of `f` over every series' points, at least `floor`.
fn max_of(p: &Panel, f: fn(&(f64, f64)) -> f64, floor: f64) -> f64 {
    p.series
        .iter()
        .flat_map(|(_, v)| v.iter().map(f))
        .filter(|x| x.is_finite())
        .fold(floor, f64::max)
}

fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel) -> anyhow::Result<()> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing {}: {e:?}", p.title);
    let x_max = max_of(p, |q| q.0, 0.0) * 1.02;
    let x_max = if x_max > 0.0 { x_max } else { 1.0 };
    let y_max = match p.style {
        Style::Lines { fraction: true } => 1.0,
        _ => (max_of(p, |q| q.1, 0.0) * 1.05).max(1.0),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(p.x_desc.as_str())
        .y_desc(p.y_desc.as_str())
        .label_style(("sans-serif", 12))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()
        .map_err(err)?;
    for (k, (label, pts)) in p.series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let pts: Vec<(f64, f64)> = pts
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        let drawn = match p.style {
            // An empirical CDF is a step function: flat to each sample, then up.
            Style::Lines { fraction: true } => chart
                .draw_series(LineSeries::new(steps(&pts), colour.stroke_width(2)))
                .map_err(err)?,
            Style::Lines { .. } => chart
                .draw_series(LineSeries::new(pts, colour.stroke_width(2)))
                .map_err(err)?,
            Style::Points => chart
                .draw_series(
                    pts.into_iter()
                        .map(|xy| Circle::new(xy, 2, colour.mix(0.6).filled())),
                )
                .map_err(err)?,
        };
        drawn.label(label.as_str()).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(3))
        });
    }
    if !p.series.is_empty() {
        let position = match p.style {
            Style::Lines { fraction: true } => SeriesLabelPosition::LowerRight,
            _ => SeriesLabelPosition::UpperRight,
        };
        chart
            .configure_series_labels()
            .position(position)
            .label_font(("sans-serif", 12))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(0x88, 0x88, 0x88))
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, panels: &[Panel]) -> anyhow::Result<()> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing a figure: {e:?}");
    root.fill(&WHITE).map_err(err)?;
    for (area, p) in root.split_evenly(grid(panels.len())).iter().zip(panels) {
        draw_panel(area, p)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// The panels as one SVG document.
///
/// # Errors
/// Drawing failed (not expected: the backend writes into a string).
pub fn svg(panels: &[Panel]) -> anyhow::Result<String> {
    register_font()?;
    let mut out = String::new();
    draw(
        SVGBackend::with_string(&mut out, figure_size(panels.len())).into_drawing_area(),
        panels,
    )?;
    Ok(out)
}

/// The panels as one PNG image (8-bit RGB).
///
/// # Errors
/// Drawing or encoding failed (not expected: both write into memory).
pub fn png(panels: &[Panel]) -> anyhow::Result<Vec<u8>> {
    register_font()?;
    let (w, h) = figure_size(panels.len());
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    draw(
        BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area(),
        panels,
    )?;
    let mut out = Vec::new();
    let mut enc = ::png::Encoder::new(&mut out, w, h);
    enc.set_color(::png::ColorType::Rgb);
    enc.set_depth(::png::BitDepth::Eight);
    let mut writer = enc.write_header()?;
    writer.write_image_data(&rgb)?;
    writer.finish()?;
    Ok(out)
}

/// Write `panels` as `dir/<stem>.svg` and `dir/<stem>.png`; returns both paths.
///
/// # Errors
/// Drawing failed, or a file cannot be written.
pub fn write_figure(
    dir: &std::path::Path,
    stem: &str,
    panels: &[Panel],
) -> anyhow::Result<[std::path::PathBuf; 2]> {
    use anyhow::Context;
    let svg_path = dir.join(format!("{stem}.svg"));
    std::fs::write(&svg_path, svg(panels)?)
        .with_context(|| format!("cannot write {}", svg_path.display()))?;
    let png_path = dir.join(format!("{stem}.png"));
    std::fs::write(&png_path, png(panels)?)
        .with_context(|| format!("cannot write {}", png_path.display()))?;
    Ok([svg_path, png_path])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two small synthetic runs: requests sent every 0.5 s, TTFT growing, three gaps each.
    fn runs() -> Vec<(String, Vec<RequestResult>)> {
        (0..2)
            .map(|k| {
                let results = (0..20)
                    .map(|i| RequestResult {
                        ok: i != 3,
                        sent_s: 0.5 * f64::from(i),
                        ttft_ms: Some(100.0 + 10.0 * f64::from(i) + 50.0 * f64::from(k)),
                        e2e_ms: 400.0,
                        itl_ms: vec![20.0, 30.0, 40.0 + f64::from(k)],
                        output_tokens: 4,
                        ..Default::default()
                    })
                    .collect();
                (format!("run <{k}>"), results)
            })
            .collect()
    }

    #[test]
    fn samples_over_time_are_placed_at_their_tokens() {
        let r = &runs()[0].1;
        let t = ttft_over_time(r);
        assert_eq!(t.len(), 19, "the failed request is left out");
        assert_eq!(t[0], (0.1, 100.0));
        let itl = itl_over_time(r);
        assert_eq!(itl.len(), 19 * 3);
        assert_eq!(itl[0], (0.12, 20.0));
        assert!((itl[2].0 - 0.19).abs() < 1e-12, "{:?}", &itl[..3]);
        assert!(itl.windows(2).all(|w| w[0].0 <= w[1].0), "in time order");
        let many: Vec<(f64, f64)> = (0..10_000).map(|i| (f64::from(i), 1.0)).collect();
        assert!(thin(many, MAX_TIME_POINTS).len() <= MAX_TIME_POINTS);
        let long = vec![RequestResult {
            ok: true,
            ttft_ms: Some(1.0),
            itl_ms: vec![1.0; 10 * MAX_TIME_POINTS + 3],
            ..Default::default()
        }];
        let thinned = itl_over_time(&long);
        assert!(thinned.len() <= MAX_TIME_POINTS && thinned.len() > MAX_TIME_POINTS / 2);
        assert_eq!(
            steps(&[(1.0, 0.5), (3.0, 1.0)]),
            vec![(1.0, 0.0), (1.0, 0.5), (3.0, 0.5), (3.0, 1.0)]
        );
        let c = cdf_points(&[3.0, 1.0, 2.0, f64::NAN]);
        assert_eq!(c, [(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0)]);
    }

    /// The SVG is one document with each panel's title, each run's label (escaped), one
    /// line per run in each CDF panel and a dot per sample in the over-time panels.
    #[test]
    fn latency_svg_has_the_titles_and_series() {
        let runs = runs();
        let panels = latency_panels(&runs);
        let titles: Vec<&str> = panels.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(
            titles,
            [
                "TTFT over time",
                "Inter-token latency over time",
                "TTFT CDF",
                "Inter-token latency CDF"
            ]
        );
        let svg = svg(&panels).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
        assert!(svg.trim_end().ends_with("</svg>"));
        for t in titles {
            assert!(svg.contains(&format!(">\n{t}\n</text>")), "title {t}");
        }
        assert!(svg.contains("run &lt;1&gt;") && !svg.contains("run <1>"));
        // Two CDF panels × two runs, plus the legend's sample lines.
        assert!(svg.matches("<polyline").count() >= 4);
        // 19 TTFT dots and 57 ITL dots per run (plus nothing else drawn as circles).
        assert_eq!(svg.matches("<circle").count(), 2 * (19 + 57));
    }

    /// The PNG has the PNG signature and decodes to an RGB image of the figure's size that
    /// is not all white (the series and text were drawn).
    #[test]
    fn png_is_a_png_of_the_figure() {
        let panels = latency_panels(&runs());
        let bytes = png(&panels).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let mut reader = ::png::Decoder::new(std::io::Cursor::new(&bytes[..]))
            .read_info()
            .unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), figure_size(4));
        assert_eq!(info.color_type, ::png::ColorType::Rgb);
        let blue = buf.chunks(3).filter(|p| p[2] > 150 && p[0] < 120).count();
        assert!(blue > 100, "run 0's colour drawn: {blue} pixels");
        // Empty runs still draw.
        let empty = cdf_panels(&[("x", &[], &[])]);
        assert!(png(&empty).unwrap().starts_with(b"\x89PNG"));
        assert!(svg(&empty).unwrap().contains("End-to-end latency CDF"));
    }

    #[test]
    fn figures_are_written_as_svg_and_png() {
        let dir = tempfile::tempdir().unwrap();
        let [s, p] = write_figure(dir.path(), "latency", &latency_panels(&runs())).unwrap();
        assert!(std::fs::read_to_string(s).unwrap().starts_with("<svg"));
        assert!(std::fs::read(p).unwrap().starts_with(b"\x89PNG"));
    }
}
