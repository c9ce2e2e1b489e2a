//! The chart of `density_bench --svg PATH`: one panel per configuration, each showing
//! the device memory every server held over time as stacked areas, the GPU's size and the
//! sum of the guarantees (requests) as horizontal lines, and each out-of-memory error as a
//! red cross. Drawn with plotters' SVG backend only: no fonts and no system libraries are
//! needed, the `<text>` elements are rendered by whatever views the SVG.
//!
//! All panels share one memory axis (GiB); each has its own time axis (s), from its start
//! to its end, so that a slow configuration (swap) does not squeeze the others.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

const GIB: f64 = (1u64 << 30) as f64;

/// Server colours, a fixed palette (Tableau 10 without its red, kept for out-of-memory
/// errors): 9 distinct colours, repeated from the 10th server on.
pub const PALETTE: [RGBColor; 9] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xba, 0xb0, 0xac),
];
/// The colour of out-of-memory crosses.
pub const OOM_RED: RGBColor = RGBColor(0xd6, 0x27, 0x28);
/// The `stroke` attribute the SVG gives an out-of-memory cross (and its legend entry).
pub const OOM_STROKE: &str = "stroke=\"#D62728\"";
const GPU_LINE: RGBColor = RGBColor(0x20, 0x20, 0x20);
const REQUEST_LINE: RGBColor = RGBColor(0x1f, 0x4e, 0x9a);

/// At most this many samples are drawn per panel (evenly picked), which keeps the SVG
/// small whatever the sampling period and the run's length.
pub const MAX_POINTS: usize = 500;

const WIDTH: u32 = 1200;
const PANEL_HEIGHT: u32 = 250;
const HEADER_HEIGHT: u32 = 90;

/// What each server held at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Seconds since the configuration started.
    pub t: f64,
    /// Device memory held by each server, in bytes (index = server).
    pub held: Vec<u64>,
}

/// An out-of-memory error: a burst that failed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Oom {
    /// Seconds since the configuration started, when the server reported it.
    pub t: f64,
    /// The server that failed.
    pub server: usize,
}

/// One configuration's run.
#[derive(Debug, Clone, Default)]
pub struct Panel {
    /// The panel's title (the configuration and its outcome).
    pub title: String,
    /// Number of servers (bands).
    pub servers: usize,
    /// Samples in time order.
    pub samples: Vec<Sample>,
    /// Out-of-memory errors.
    pub ooms: Vec<Oom>,
    /// Sum of the servers' guaranteed memory (requests), in bytes; `None` without gpufrac.
    pub guarantees: Option<u64>,
}

/// The whole chart.
#[derive(Debug, Clone, Default)]
pub struct Chart {
    /// The title above the panels.
    pub title: String,
    /// A second line under the title (the trace), may be empty.
    pub subtitle: String,
    /// The GPU's memory, in bytes.
    pub device: u64,
    /// One panel per configuration, top to bottom.
    pub panels: Vec<Panel>,
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

fn colour(server: usize) -> RGBColor {
    PALETTE[server % PALETTE.len()]
}

/// At most `max` samples, evenly picked, the first and the last kept.
pub fn downsample(samples: &[Sample], max: usize) -> Vec<&Sample> {
    let max = max.max(2);
    if samples.len() <= max {
        return samples.iter().collect();
    }
    let last = samples.len() - 1;
    (0..max).map(|i| &samples[i * last / (max - 1)]).collect()
}

/// The top of server `k`'s band (servers `0..=k` stacked) in `sample`, in bytes.
fn band_top(sample: &Sample, k: usize) -> u64 {
    sample.held.iter().take(k + 1).sum()
}

/// Where an out-of-memory error is drawn, in bytes: the top of the failing server's band
/// just before it failed (its last 250 ms of samples, the highest: the server frees what
/// its burst got before it reports the failure), which is where its next allocation
/// would have gone.
pub fn oom_height(samples: &[Sample], oom: &Oom) -> u64 {
    let recent = samples
        .iter()
        .filter(|s| s.t <= oom.t + 0.005 && s.t >= oom.t - 0.25)
        .map(|s| band_top(s, oom.server))
        .max();
    recent.unwrap_or_else(|| {
        samples
            .iter()
            .min_by(|a, b| (a.t - oom.t).abs().total_cmp(&(b.t - oom.t).abs()))
            .map_or(0, |s| band_top(s, oom.server))
    })
}

/// Renders `chart` as an SVG document.
pub fn render_svg(chart: &Chart) -> Result<String, String> {
    let panels = chart.panels.len().max(1) as u32;
    let height = HEADER_HEIGHT + panels * PANEL_HEIGHT;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        draw(&root, chart).map_err(|e| format!("drawing the chart: {e}"))?;
        root.present().map_err(|e| format!("drawing the chart: {e}"))?;
    }
    Ok(svg)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type Result2<T> = Result<T, Box<dyn std::error::Error>>;

fn draw(root: &Area<'_>, chart: &Chart) -> Result2<()> {
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(HEADER_HEIGHT);
    draw_header(&header, chart)?;

    let peak = chart
        .panels
        .iter()
        .flat_map(|p| p.samples.iter().map(|s| s.held.iter().sum::<u64>()))
        .max()
        .unwrap_or(0);
    let y_max = gib(chart.device.max(peak)) * 1.12;

    let areas = body.split_evenly((chart.panels.len().max(1), 1));
    for (panel, area) in chart.panels.iter().zip(areas.iter()) {
        let t_max = panel.samples.last().map_or(1.0, |s| s.t.max(1.0));
        draw_panel(root, area, panel, chart.device, (t_max * 1.02).ceil(), y_max)?;
    }
    Ok(())
}

fn draw_header(area: &Area<'_>, chart: &Chart) -> Result2<()> {
    let title = ("sans-serif", 22).into_font().style(FontStyle::Bold).color(&BLACK);
    area.draw(&Text::new(chart.title.as_str(), (20, 8), title))?;
    let sub = ("sans-serif", 15).into_font().color(&RGBColor(0x40, 0x40, 0x40));
    area.draw(&Text::new(chart.subtitle.as_str(), (20, 36), sub))?;

    // The legend: one swatch per server, then the lines and the cross.
    let servers = chart.panels.iter().map(|p| p.servers).max().unwrap_or(0);
    let font = ("sans-serif", 14).into_font().color(&BLACK);
    let y = 68;
    area.draw(&Text::new("servers", (20, y - 8), font.clone()))?;
    let mut x = 80;
    for k in 0..servers.min(PALETTE.len()) {
        area.draw(&Rectangle::new([(x, y - 6), (x + 14, y + 6)], colour(k).filled()))?;
        area.draw(&Text::new(k.to_string(), (x + 18, y - 8), font.clone()))?;
        x += 40;
    }
    if servers > PALETTE.len() {
        area.draw(&Text::new(
            format!("(colours repeat from server {})", PALETTE.len()),
            (x, y - 8),
            font.clone(),
        ))?;
        x += 230;
    }
    x += 12;
    area.draw(&PathElement::new(vec![(x, y), (x + 28, y)], GPU_LINE.stroke_width(2)))?;
    area.draw(&Text::new("GPU size", (x + 34, y - 8), font.clone()))?;
    x += 100;
    area.draw(&PathElement::new(vec![(x, y), (x + 28, y)], REQUEST_LINE.stroke_width(2)))?;
    area.draw(&Text::new("sum of requests", (x + 34, y - 8), font.clone()))?;
    x += 150;
    area.draw(&Cross::new((x + 7, y), 6, OOM_RED.stroke_width(2)))?;
    area.draw(&Text::new("out-of-memory error (on the failing server's band)", (x + 20, y - 8), font))?;
    Ok(())
}

/// Draws `text` right-aligned with its right end at `(x, y)` (backend pixels) on a
/// translucent white box, so that it stays legible over the bands. `above`: the text's
/// bottom is at `y`; else its top.
fn label(root: &Area<'_>, text: &str, (x, y): (i32, i32), above: bool, colour: RGBColor) -> Result2<()> {
    const SIZE: f64 = 13.0;
    // The SVG backend writes the font size / 1.24; an average sans-serif glyph is about
    // 0.55 of that wide.
    let px = SIZE / 1.24;
    let width = (text.len() as f64 * px * 0.56).ceil() as i32 + 6;
    let height = px.ceil() as i32 + 4;
    let (top, bottom) = if above { (y - height - 1, y - 1) } else { (y + 1, y + height + 1) };
    root.draw(&Rectangle::new([(x - width, top), (x, bottom)], WHITE.mix(0.8).filled()))?;
    let style = ("sans-serif", SIZE).into_font().color(&colour).pos(Pos::new(HPos::Right, VPos::Center));
    root.draw(&Text::new(text.to_owned(), (x - 3, (top + bottom) / 2), style))?;
    Ok(())
}

fn draw_panel(
    root: &Area<'_>,
    area: &Area<'_>,
    panel: &Panel,
    device: u64,
    x_max: f64,
    y_max: f64,
) -> Result2<()> {
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title.as_str(), ("sans-serif", 17).into_font().style(FontStyle::Bold))
        .margin_left(12)
        .margin_right(24)
        .margin_bottom(4)
        .x_label_area_size(38)
        .y_label_area_size(62)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("memory held (GiB)")
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .x_labels(16)
        .y_labels(6)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
        .draw()?;

    // Stacked bands: server k between the sum of servers 0..k and the sum of 0..=k.
    let picked = downsample(&panel.samples, MAX_POINTS);
    let mut lower: Vec<f64> = vec![0.0; picked.len()];
    for k in 0..panel.servers {
        let upper: Vec<f64> = picked
            .iter()
            .zip(&lower)
            .map(|(s, low)| low + gib(s.held.get(k).copied().unwrap_or(0)))
            .collect();
        if upper.iter().zip(&lower).any(|(u, l)| u > l) {
            let mut outline: Vec<(f64, f64)> = picked.iter().zip(&upper).map(|(s, &u)| (s.t, u)).collect();
            outline.extend(picked.iter().zip(&lower).rev().map(|(s, &l)| (s.t, l)));
            chart.draw_series(std::iter::once(Polygon::new(outline, colour(k).mix(0.85).filled())))?;
        }
        lower = upper;
    }

    let line = |y: f64, style: ShapeStyle| PathElement::new(vec![(0.0, y), (x_max, y)], style);
    let device_gib = gib(device);
    chart.draw_series(std::iter::once(line(device_gib, GPU_LINE.stroke_width(2))))?;
    let right = |chart: &ChartContext<'_, _, _>, y: f64| {
        let (x, y) = chart.backend_coord(&(x_max, y));
        (x - 4, y)
    };
    label(root, &format!("GPU size {device_gib:.0} GiB"), right(&chart, device_gib), true, GPU_LINE)?;
    if let Some(guarantees) = panel.guarantees {
        let g = gib(guarantees);
        chart.draw_series(std::iter::once(line(g, REQUEST_LINE.stroke_width(2))))?;
        label(root, &format!("sum of requests {g:.2} GiB"), right(&chart, g), false, REQUEST_LINE)?;
    }

    chart.draw_series(
        panel
            .ooms
            .iter()
            .map(|o| Cross::new((o.t, gib(oom_height(&panel.samples, o))), 6, OOM_RED.stroke_width(2))),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synthetic(ooms: Vec<Oom>) -> Chart {
        let panel = |title: &str, guarantees: Option<u64>, ooms: Vec<Oom>| Panel {
            title: title.to_owned(),
            servers: 2,
            samples: (0..50u32)
                .map(|i| Sample { t: f64::from(i) * 0.1, held: vec![u64::from(1 + i % 3) << 30, 2 << 30] })
                .collect(),
            ooms,
            guarantees,
        };
        Chart {
            title: "density".to_owned(),
            subtitle: "synthetic".to_owned(),
            device: 16 << 30,
            panels: vec![
                panel("static fractions", Some(8 << 30), Vec::new()),
                panel("bare, no gpufrac", None, ooms),
                panel("gpufrac, wait", Some(2 << 30), Vec::new()),
            ],
        }
    }

    /// The content of every `<text>` element, trimmed.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_owned()))
            .collect()
    }

    #[test]
    fn the_svg_has_a_panel_per_configuration_the_gpu_line_and_the_oom_marks() {
        let oom = Oom { t: 2.0, server: 1 };
        let svg = render_svg(&synthetic(vec![oom])).expect("renders");
        let texts = texts(&svg);
        let count = |text: &str| texts.iter().filter(|t| *t == text).count();
        for title in ["static fractions", "bare, no gpufrac", "gpufrac, wait"] {
            assert_eq!(count(title), 1, "one title {title:?} in {texts:?}");
        }
        assert_eq!(count("GPU size 16 GiB"), 3, "a GPU-size line per panel");
        assert_eq!(count("sum of requests 8.00 GiB"), 1);
        assert_eq!(count("sum of requests 2.00 GiB"), 1);
        for label in ["time (s)", "memory held (GiB)"] {
            assert_eq!(count(label), 3, "{label:?} on each panel");
        }
        for legend in [
            "servers",
            "GPU size",
            "sum of requests",
            "out-of-memory error (on the failing server&apos;s band)",
        ] {
            assert_eq!(count(legend), 1, "legend {legend:?}");
        }
        assert!(svg.contains("<polygon"), "stacked areas");
        // A cross is two red lines; the legend's is one more.
        let without = render_svg(&synthetic(Vec::new())).expect("renders");
        assert_eq!(svg.matches(OOM_STROKE).count(), without.matches(OOM_STROKE).count() + 2);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // The OOM is drawn at the top of server 1's band at 2.0 s: (1 + 20 % 3) + 2 GiB.
        assert_eq!(oom_height(&synthetic(Vec::new()).panels[0].samples, &oom), 5 << 30);
    }

    #[test]
    fn downsampling_keeps_the_ends_and_the_bound() {
        let samples: Vec<Sample> = (0..1001).map(|i| Sample { t: f64::from(i), held: vec![] }).collect();
        let picked = downsample(&samples, 100);
        assert_eq!(picked.len(), 100);
        assert_eq!(picked[0].t, 0.0);
        assert_eq!(picked[99].t, 1000.0);
        assert_eq!(downsample(&samples[..10], 100).len(), 10);
    }
}
