//! SVG charts of a `just bench` result, drawn from its JSON (`bench/results/latest.json`), so
//! they can be drawn again from a stored result without measuring anything:
//! - `ratios.svg`: per scenario, req/s and Envoy CPU per request relative to S3 (tollgate
//!   loaded, no policy matching), the ratios the markdown table and notes report; the scenarios
//!   against a real upstream (1u, 5u) relative to S1u, as the table's "× S1" column does.
//! - `overload.svg`: scenario 7 (over the limit), per variant (its first round in the file):
//!   the requests each Envoy answered 200 per second, both together, next to what the policy
//!   allows per second (rate × keys, plus the full buckets in the first second) and each
//!   instance's part of that by the demand split.

use std::fmt;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

/// Why a chart could not be drawn.
#[derive(Debug, Clone, PartialEq)]
pub enum ChartError {
    /// The file could not be read or is not JSON.
    Unreadable(String),
    /// The JSON is not a `just bench` result, or a field has the wrong shape.
    Malformed(String),
    /// The result holds nothing this chart shows.
    NoData(String),
    /// plotters failed to draw.
    Draw(String),
}

impl fmt::Display for ChartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChartError::Unreadable(m) => write!(f, "cannot read the result: {m}"),
            ChartError::Malformed(m) => write!(f, "not a `just bench` result: {m}"),
            ChartError::NoData(m) => write!(f, "nothing to chart: {m}"),
            ChartError::Draw(m) => write!(f, "drawing failed: {m}"),
        }
    }
}

impl std::error::Error for ChartError {}

fn draw_err(e: impl fmt::Display) -> ChartError {
    ChartError::Draw(e.to_string())
}

const BLUE: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
const ORANGE: RGBColor = RGBColor(0xff, 0x7f, 0x0e);
const RED: RGBColor = RGBColor(0xd6, 0x27, 0x28);
const GREY: RGBColor = RGBColor(0x88, 0x88, 0x88);

/// The colours of the ratio bars (tests find the bars by them).
pub const RPS_COLOUR: &str = "#1F77B4";
pub const CPU_COLOUR: &str = "#FF7F0E";

/// One scenario's bars.
#[derive(Debug, Clone, PartialEq)]
pub struct RatioBars {
    pub id: String,
    /// The scenario its ratios are relative to (`3`, or `1u` for the real-upstream ones).
    pub baseline: String,
    pub rps: Option<f64>,
    pub envoy_cpu: Option<f64>,
}

/// Scenario 7, one variant: per-second counts of both instances.
#[derive(Debug, Clone, PartialEq)]
pub struct OverloadPanel {
    pub variant: String,
    pub round: u64,
    /// Requests per second the policy allows over all keys (rate × keys).
    pub allowed_per_s: f64,
    /// The keys' full buckets, spendable in the first second on top of the rate.
    pub burst_total: f64,
    /// Demand split A:B.
    pub split: (f64, f64),
    /// Answered 200 per second, instance A and B.
    pub admitted: [Vec<u64>; 2],
}

/// Parses a result file's text.
pub fn parse(text: &str) -> Result<Value, ChartError> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| ChartError::Unreadable(format!("not JSON: {e}")))?;
    if !value.is_object() {
        return Err(ChartError::Malformed(
            "the top level is not an object".into(),
        ));
    }
    if value.get("scenarios").is_none() && value.get("over_limit").is_none() {
        return Err(ChartError::Malformed(
            "it has neither `scenarios` nor `over_limit`".into(),
        ));
    }
    Ok(value)
}

fn array<'a>(result: &'a Value, name: &str) -> Result<&'a [Value], ChartError> {
    match result.get(name) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(ChartError::Malformed(format!("`{name}` is not an array"))),
    }
}

/// A number field that may be absent or null (`–` in the table); anything else is an error.
fn optional_number(item: &Value, field: &str, what: &str) -> Result<Option<f64>, ChartError> {
    match item.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| ChartError::Malformed(format!("{what}.{field} is not a number: {v}"))),
    }
}

fn number(item: &Value, field: &str, what: &str) -> Result<f64, ChartError> {
    optional_number(item, field, what)?
        .ok_or_else(|| ChartError::Malformed(format!("{what}.{field} is missing")))
}

fn string<'a>(item: &'a Value, field: &str, what: &str) -> Result<&'a str, ChartError> {
    item.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| ChartError::Malformed(format!("{what}.{field} is missing or not text")))
}

/// The bars of every scenario that has a ratio (S3 itself is 1.0 by definition and shown).
pub fn ratio_bars(result: &Value) -> Result<Vec<RatioBars>, ChartError> {
    let mut bars = Vec::new();
    for (i, sc) in array(result, "scenarios")?.iter().enumerate() {
        let what = format!("scenarios[{i}]");
        let id = string(sc, "id", &what)?;
        let real_upstream = id.ends_with('u');
        let (baseline, rps, envoy_cpu) = if real_upstream {
            ("1u", optional_number(sc, "ratio_to_s1", &what)?, None)
        } else {
            (
                "3",
                optional_number(sc, "ratio_to_s3", &what)?,
                optional_number(sc, "envoy_cpu_ratio_to_s3", &what)?,
            )
        };
        if rps.is_some() || envoy_cpu.is_some() {
            bars.push(RatioBars {
                id: id.to_string(),
                baseline: baseline.to_string(),
                rps,
                envoy_cpu,
            });
        }
    }
    if bars.is_empty() {
        return Err(ChartError::NoData(
            "no scenario has a ratio to S3 (or S1u): run `just bench` with S3 among the scenarios"
                .into(),
        ));
    }
    Ok(bars)
}

/// Scenario 7's variants, each from its first round in the result that has per-second samples.
pub fn overload_panels(result: &Value) -> Result<Vec<OverloadPanel>, ChartError> {
    let mut panels: Vec<OverloadPanel> = Vec::new();
    for (i, run) in array(result, "over_limit")?.iter().enumerate() {
        let what = format!("over_limit[{i}]");
        let variant = string(run, "variant", &what)?;
        if panels.iter().any(|p| p.variant == variant) {
            continue;
        }
        let instances = run
            .get("instances")
            .and_then(Value::as_array)
            .ok_or_else(|| ChartError::Malformed(format!("{what}.instances is missing")))?;
        let mut admitted: [Vec<u64>; 2] = Default::default();
        let mut sampled = true;
        for (slot, (k, instance)) in admitted.iter_mut().zip(instances.iter().enumerate()) {
            let Some(seconds) = instance.get("per_second") else {
                sampled = false;
                break;
            };
            let seconds = seconds.as_array().ok_or_else(|| {
                ChartError::Malformed(format!("{what}.instances[{k}].per_second is not an array"))
            })?;
            for (s, second) in seconds.iter().enumerate() {
                let n = second
                    .get("admitted")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| {
                        ChartError::Malformed(format!(
                            "{what}.instances[{k}].per_second[{s}].admitted is not a count"
                        ))
                    })?;
                slot.push(n);
            }
        }
        if !sampled || instances.len() != 2 {
            continue;
        }
        // Elapsed time runs from the first tick to the last answer, a few ms past the paced
        // seconds: the seconds it covers whole are the ones drawn (a last, partial one is not).
        let whole = (number(run, "seconds", &what)? + 0.05).floor().max(0.0) as usize;
        for series in &mut admitted {
            series.truncate(whole);
        }
        let tenants = number(run, "tenants", &what)?;
        let split = run
            .get("demand_split")
            .and_then(Value::as_array)
            .and_then(|s| Some((s.first()?.as_f64()?, s.get(1)?.as_f64()?)))
            .ok_or_else(|| ChartError::Malformed(format!("{what}.demand_split is not [a, b]")))?;
        panels.push(OverloadPanel {
            variant: variant.to_string(),
            round: run.get("round").and_then(Value::as_u64).unwrap_or(0),
            allowed_per_s: number(run, "rate_per_s", &what)? * tenants,
            burst_total: number(run, "burst", &what)? * tenants,
            split,
            admitted,
        });
    }
    if panels.iter().all(|p| p.admitted.iter().all(Vec::is_empty)) {
        return Err(ChartError::NoData(
            "no over-limit run (scenario 7) with per-second samples: run `just bench --only 7`"
                .into(),
        ));
    }
    Ok(panels)
}

/// "date, commit" of the run, for the charts' subtitles.
fn provenance(result: &Value) -> String {
    let setup = result.get("setup");
    let field = |name: &str| {
        setup
            .and_then(|s| s.get(name))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    match (field("date"), field("commit")) {
        (d, c) if d.is_empty() && c.is_empty() => String::new(),
        (d, c) => format!("{d}, commit {c}"),
    }
}

/// `ratios.svg`: grouped bars per scenario, a dashed line at 1.
pub fn ratios_svg(bars: &[RatioBars], subtitle: &str) -> Result<String, ChartError> {
    if bars.is_empty() {
        return Err(ChartError::NoData("no scenario to draw".into()));
    }
    let n = bars.len() as f64;
    let top = bars
        .iter()
        .flat_map(|b| [b.rps, b.envoy_cpu])
        .flatten()
        .fold(1.0_f64, f64::max)
        * 1.18;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let (title, plot) = root.split_vertically(54);
        title
            .draw(&Text::new(
                "req/s and Envoy CPU per request relative to S3 (1u, 5u: req/s relative to S1u)",
                (12, 8),
                ("sans-serif", 19).into_font(),
            ))
            .map_err(draw_err)?;
        title
            .draw(&Text::new(
                format!("just bench, {subtitle}; higher req/s and lower CPU are better"),
                (12, 32),
                ("sans-serif", 13).into_font().color(&GREY),
            ))
            .map_err(draw_err)?;
        let mut chart = ChartBuilder::on(&plot)
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(48)
            .build_cartesian_2d(-0.5..n - 0.5, 0.0..top)
            .map_err(draw_err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .x_label_formatter(&|_| String::new())
            .y_desc("× baseline")
            .draw()
            .map_err(draw_err)?;
        chart
            .draw_series(DashedLineSeries::new(
                [(-0.5, 1.0), (n - 0.5, 1.0)],
                6,
                4,
                GREY.stroke_width(1),
            ))
            .map_err(draw_err)?;
        let width = 0.36;
        let value_style = TextStyle::from(("sans-serif", 12).into_font())
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        for (offset, colour, label, pick) in [
            (
                -width / 2.0,
                BLUE,
                "req/s ÷ baseline",
                (|b: &RatioBars| b.rps) as fn(&RatioBars) -> Option<f64>,
            ),
            (
                width / 2.0,
                ORANGE,
                "Envoy CPU per request ÷ baseline",
                |b: &RatioBars| b.envoy_cpu,
            ),
        ] {
            let values: Vec<(f64, f64)> = bars
                .iter()
                .enumerate()
                .filter_map(|(i, b)| pick(b).map(|v| (i as f64 + offset, v)))
                .collect();
            chart
                .draw_series(values.iter().map(|&(x, v)| {
                    Rectangle::new(
                        [(x - width / 2.0, 0.0), (x + width / 2.0, v)],
                        colour.filled(),
                    )
                }))
                .map_err(draw_err)?
                .label(label)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled())
                });
            chart
                .draw_series(
                    values
                        .iter()
                        .map(|&(x, v)| Text::new(format!("{v:.2}"), (x, v), value_style.clone())),
                )
                .map_err(draw_err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(GREY)
            .draw()
            .map_err(draw_err)?;
        // Scenario names under their bars.
        let label_style =
            TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
        for (i, b) in bars.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(i as f64, 0.0));
            let name = if b.baseline == "3" || b.baseline == b.id {
                format!("S{}", b.id)
            } else {
                format!("S{} (÷ S{})", b.id, b.baseline)
            };
            root.draw(&Text::new(name, (x, y + 8), label_style.clone()))
                .map_err(draw_err)?;
        }
        root.present().map_err(draw_err)?;
    }
    Ok(svg)
}

/// `overload.svg`: one panel per variant, requests/s over the run's seconds.
pub fn overload_svg(panels: &[OverloadPanel], subtitle: &str) -> Result<String, ChartError> {
    if panels.is_empty() {
        return Err(ChartError::NoData("no over-limit variant to draw".into()));
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1200, 460)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let (title, body) = root.split_vertically(54);
        title
            .draw(&Text::new(
                "Over the limit (S7): requests answered 200 per second by each Envoy, against what the policy allows",
                (12, 8),
                ("sans-serif", 19).into_font(),
            ))
            .map_err(draw_err)?;
        title
            .draw(&Text::new(
                format!(
                    "just bench --only 7, {subtitle}; two Envoys, one global policy; \
                     allowed = rate × keys (+ the full buckets in second 0)"
                ),
                (12, 32),
                ("sans-serif", 13).into_font().color(&GREY),
            ))
            .map_err(draw_err)?;
        let top = panels
            .iter()
            .flat_map(|p| {
                let sum = p
                    .admitted
                    .first()
                    .into_iter()
                    .flatten()
                    .zip(p.admitted.get(1).into_iter().flatten())
                    .map(|(a, b)| (a + b) as f64);
                sum.chain([p.allowed_per_s + p.burst_total])
                    .collect::<Vec<_>>()
            })
            .fold(1.0_f64, f64::max)
            // Room above the lines for the legend.
            * 1.6;
        let areas = body.split_evenly((1, panels.len()));
        for (panel, area) in panels.iter().zip(areas.iter()) {
            draw_overload_panel(panel, area, top)?;
        }
        root.present().map_err(draw_err)?;
    }
    Ok(svg)
}

fn draw_overload_panel<DB: DrawingBackend>(
    p: &OverloadPanel,
    area: &DrawingArea<DB, plotters::coord::Shift>,
    top: f64,
) -> Result<(), ChartError>
where
    DB::ErrorType: 'static,
{
    let [a, b] = &p.admitted;
    let seconds = a.len().max(b.len()).max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("{} (round {})", p.variant, p.round),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(34)
        .y_label_area_size(52)
        .build_cartesian_2d(0.0..seconds as f64, 0.0..top)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_desc("second of the run")
        .y_desc("requests/s")
        .x_labels(seconds + 1)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(draw_err)?;
    // Each second's count drawn at the middle of its second.
    let points = |counts: &[u64]| -> Vec<(f64, f64)> {
        counts
            .iter()
            .enumerate()
            .map(|(s, &n)| (s as f64 + 0.5, n as f64))
            .collect()
    };
    let sum: Vec<u64> = a.iter().zip(b.iter()).map(|(x, y)| x + y).collect();
    let allowed: Vec<(f64, f64)> = (0..seconds)
        .map(|s| {
            let burst = if s == 0 { p.burst_total } else { 0.0 };
            (s as f64 + 0.5, p.allowed_per_s + burst)
        })
        .collect();
    let parts = p.split.0 + p.split.1;
    let share = |part: f64| -> Vec<(f64, f64)> {
        allowed
            .iter()
            .map(|&(x, y)| (x, if parts > 0.0 { y * part / parts } else { 0.0 }))
            .collect()
    };
    chart
        .draw_series(DashedLineSeries::new(
            allowed.clone(),
            8,
            4,
            RED.stroke_width(2),
        ))
        .map_err(draw_err)?
        .label("allowed/s (both)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(points(&sum), BLACK.stroke_width(2)))
        .map_err(draw_err)?
        .label("200/s, A + B")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK.stroke_width(2)));
    for (counts, part, colour, name) in [(a, p.split.0, BLUE, "A"), (b, p.split.1, ORANGE, "B")] {
        chart
            .draw_series(DashedLineSeries::new(
                share(part),
                3,
                3,
                colour.stroke_width(1),
            ))
            .map_err(draw_err)?
            .label(format!("{name}'s share of allowed"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(1)));
        chart
            .draw_series(LineSeries::new(points(counts), colour.stroke_width(2)))
            .map_err(draw_err)?
            .label(format!("200/s, {name}"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 11))
        .background_style(WHITE.mix(0.9))
        .border_style(GREY)
        .draw()
        .map_err(draw_err)?;
    Ok(())
}

/// Both charts of one result, each drawn or the reason it was not.
pub struct Rendered {
    pub ratios: Result<String, ChartError>,
    pub overload: Result<String, ChartError>,
}

pub fn render(result: &Value) -> Rendered {
    let subtitle = provenance(result);
    Rendered {
        ratios: ratio_bars(result).and_then(|bars| ratios_svg(&bars, &subtitle)),
        overload: overload_panels(result).and_then(|panels| overload_svg(&panels, &subtitle)),
    }
}

/// What [`write_charts`] wrote, and why a chart was left out.
#[derive(Debug, Default)]
pub struct Written {
    pub files: Vec<PathBuf>,
    pub skipped: Vec<String>,
}

/// `tollgate-bench chart FILE...`: writes `ratios.svg` and `overload.svg` into `out`, each from
/// the first of `files` that has its data. Fails when no file yields either chart.
pub fn write_charts(files: &[PathBuf], out: &Path) -> Result<Written, ChartError> {
    if files.is_empty() {
        return Err(ChartError::Unreadable(
            "no result file given (e.g. bench/results/latest.json)".into(),
        ));
    }
    let mut ratios: Option<String> = None;
    let mut overload: Option<String> = None;
    let mut why: [Vec<String>; 2] = Default::default();
    for file in files {
        let rendered = std::fs::read_to_string(file)
            .map_err(|e| ChartError::Unreadable(e.to_string()))
            .and_then(|text| parse(&text))
            .map(|result| render(&result));
        let (r, o) = match rendered {
            Ok(Rendered { ratios, overload }) => (ratios, overload),
            Err(e) => (Err(e.clone()), Err(e)),
        };
        for (slot, chart, reasons) in [(&mut ratios, r, 0), (&mut overload, o, 1)] {
            if slot.is_some() {
                continue;
            }
            match chart {
                Ok(svg) => *slot = Some(svg),
                Err(e) => {
                    if let Some(list) = why.get_mut(reasons) {
                        list.push(format!("{}: {e}", file.display()));
                    }
                }
            }
        }
    }
    if ratios.is_none() && overload.is_none() {
        return Err(ChartError::NoData(format!(
            "no chart could be drawn ({})",
            why.concat().join("; ")
        )));
    }
    std::fs::create_dir_all(out).map_err(|e| ChartError::Draw(e.to_string()))?;
    let mut written = Written::default();
    for (svg, name, reasons) in [(ratios, "ratios.svg", 0), (overload, "overload.svg", 1)] {
        match svg {
            Some(svg) => {
                let path = out.join(name);
                std::fs::write(&path, svg)
                    .map_err(|e| ChartError::Draw(format!("{}: {e}", path.display())))?;
                written.files.push(path);
            }
            None => written.skipped.push(format!(
                "{name} not written: {}",
                why.get(reasons).map(|w| w.join("; ")).unwrap_or_default()
            )),
        }
    }
    Ok(written)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use serde_json::json;

    fn small_result() -> Value {
        json!({
            "setup": {"date": "2026-12-01 10:13 UTC", "commit": "abc1234"},
            "scenarios": [
                {"id": "1", "ratio_to_s1": 1.0, "ratio_to_s3": 1.31, "envoy_cpu_ratio_to_s3": 0.76},
                {"id": "3", "ratio_to_s1": 0.77, "ratio_to_s3": 1.0, "envoy_cpu_ratio_to_s3": 1.0},
                {"id": "4", "ratio_to_s1": 0.52, "ratio_to_s3": 0.82, "envoy_cpu_ratio_to_s3": 1.22},
                {"id": "1u", "ratio_to_s1": 1.0, "ratio_to_s3": null, "envoy_cpu_ratio_to_s3": null},
                {"id": "5u", "ratio_to_s1": 0.49, "ratio_to_s3": null, "envoy_cpu_ratio_to_s3": null}
            ],
            "over_limit": []
        })
    }

    fn seconds(admitted: &[u64]) -> Value {
        Value::Array(
            admitted
                .iter()
                .map(|&n| json!({"offered": 400, "admitted": n, "denied": 400 - n}))
                .collect(),
        )
    }

    fn over_limit_result() -> Value {
        json!({
            "setup": {"date": "2026-12-01 10:13 UTC", "commit": "abc1234"},
            "scenarios": [],
            "over_limit": [
                {"round": 0, "variant": "10× 3:1", "seconds": 3.98, "tenants": 4,
                 "rate_per_s": 40, "burst": 10, "demand_split": [3, 1],
                 "instances": [
                     {"name": "a", "per_second": seconds(&[150, 120, 121, 119])},
                     {"name": "b", "per_second": seconds(&[50, 40, 39, 41])}
                 ]},
                {"round": 1, "variant": "10× 3:1", "seconds": 3.98, "tenants": 4,
                 "rate_per_s": 40, "burst": 10, "demand_split": [3, 1],
                 "instances": [
                     {"name": "a", "per_second": seconds(&[1, 1, 1, 1])},
                     {"name": "b", "per_second": seconds(&[1, 1, 1, 1])}
                 ]}
            ]
        })
    }

    #[test]
    fn ratio_bars_take_the_baseline_the_table_uses() {
        let bars = ratio_bars(&small_result()).unwrap();
        assert_eq!(bars.len(), 5);
        assert_eq!(bars[2].id, "4");
        assert_eq!(bars[2].rps, Some(0.82));
        assert_eq!(bars[2].envoy_cpu, Some(1.22));
        assert_eq!(bars[4].baseline, "1u");
        assert_eq!(bars[4].rps, Some(0.49));
        assert_eq!(bars[4].envoy_cpu, None);
    }

    #[test]
    fn ratios_svg_has_a_bar_and_a_label_per_value() {
        let svg = render(&small_result()).ratios.unwrap();
        assert!(svg.starts_with("<svg"), "{svg}");
        // 5 req/s bars and 3 CPU bars (1u and 5u have no CPU ratio), plus one legend swatch each.
        let bars = |colour: &str| svg.matches(&format!("fill=\"{colour}\"")).count();
        assert_eq!(bars(RPS_COLOUR), 5 + 1, "{svg}");
        assert_eq!(bars(CPU_COLOUR), 3 + 1, "{svg}");
        // plotters writes each text on a line of its own.
        for text in [
            "S1",
            "S3",
            "S4",
            "S1u",
            "S5u (÷ S1u)",
            "0.82",
            "1.22",
            "0.49",
            "req/s ÷ baseline",
            "Envoy CPU per request ÷ baseline",
        ] {
            let line = format!(">\n{text}\n</text>");
            assert!(svg.contains(&line), "{text} missing from the chart:\n{svg}");
        }
        assert!(svg.contains("commit abc1234"), "{svg}");
    }

    #[test]
    fn overload_takes_the_first_round_of_each_variant_and_whole_seconds() {
        let panels = overload_panels(&over_limit_result()).unwrap();
        assert_eq!(panels.len(), 1);
        let p = &panels[0];
        assert_eq!(p.round, 0);
        assert_eq!(p.admitted[0], vec![150, 120, 121, 119]);
        assert_eq!(p.allowed_per_s, 160.0);
        assert_eq!(p.burst_total, 40.0);
        assert_eq!(p.split, (3.0, 1.0));

        let svg = render(&over_limit_result()).overload.unwrap();
        for text in [
            "10× 3:1 (round 0)",
            "200/s, A + B",
            "200/s, A",
            "200/s, B",
            "allowed/s (both)",
            "A&apos;s share of allowed",
            "commit abc1234",
        ] {
            let found = svg.contains(text) || svg.contains(&text.replace("&apos;", "'"));
            assert!(found, "{text} missing from the chart:\n{svg}");
        }
        // One polyline per series: the allowed line, the sum, A, B and both shares.
        assert!(svg.matches("<polyline").count() >= 4, "{svg}");
    }

    #[test]
    fn a_result_without_samples_has_no_overload_chart() {
        let mut result = over_limit_result();
        for run in result["over_limit"].as_array_mut().unwrap() {
            for i in run["instances"].as_array_mut().unwrap() {
                i.as_object_mut().unwrap().remove("per_second");
            }
        }
        let err = overload_panels(&result).unwrap_err();
        assert!(matches!(err, ChartError::NoData(_)));
        assert!(err.to_string().contains("just bench --only 7"), "{err}");
    }

    #[test]
    fn empty_and_malformed_results_are_clear_errors() {
        let empty = parse(r#"{"scenarios": [], "over_limit": []}"#).unwrap();
        let rendered = render(&empty);
        let e = rendered.ratios.unwrap_err();
        assert!(
            e.to_string().contains("no scenario has a ratio to S3"),
            "{e}"
        );
        assert!(rendered.overload.is_err());

        let e = parse("not json").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("cannot read the result: not JSON"),
            "{e}"
        );
        let e = parse("[1, 2]").unwrap_err();
        assert!(
            e.to_string().contains("the top level is not an object"),
            "{e}"
        );
        let e = parse(r#"{"rounds": 3}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("neither `scenarios` nor `over_limit`"),
            "{e}"
        );

        let bad = json!({"scenarios": [{"id": "4", "ratio_to_s3": "fast"}]});
        let e = ratio_bars(&bad).unwrap_err();
        assert_eq!(
            e,
            ChartError::Malformed("scenarios[0].ratio_to_s3 is not a number: \"fast\"".into())
        );
        let e = ratio_bars(&json!({"scenarios": [{"ratio_to_s3": 1.0}]})).unwrap_err();
        assert!(e.to_string().contains("scenarios[0].id is missing"), "{e}");
        let e = ratio_bars(&json!({"scenarios": {"id": "4"}})).unwrap_err();
        assert!(e.to_string().contains("`scenarios` is not an array"), "{e}");
        let mut bad = over_limit_result();
        bad["over_limit"][0]["instances"][1]["per_second"][2]["admitted"] = json!(-1);
        let e = overload_panels(&bad).unwrap_err();
        assert!(
            e.to_string()
                .contains("over_limit[0].instances[1].per_second[2].admitted is not a count"),
            "{e}"
        );
    }

    #[test]
    fn write_charts_takes_each_chart_from_the_first_file_that_has_it() {
        let dir = std::env::temp_dir().join(format!("tollgate-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let table = dir.join("table.json");
        let s7 = dir.join("s7.json");
        let broken = dir.join("broken.json");
        std::fs::write(&table, small_result().to_string()).unwrap();
        std::fs::write(&s7, over_limit_result().to_string()).unwrap();
        std::fs::write(&broken, "{").unwrap();
        let out = dir.join("out");

        let w = write_charts(std::slice::from_ref(&table), &out).unwrap();
        assert_eq!(w.files, vec![out.join("ratios.svg")]);
        assert!(
            w.skipped[0].contains("overload.svg not written"),
            "{:?}",
            w.skipped
        );

        let w = write_charts(&[broken.clone(), table, s7], &out).unwrap();
        assert_eq!(w.files.len(), 2);
        assert!(std::fs::read_to_string(out.join("overload.svg"))
            .unwrap()
            .contains("10× 3:1"));

        let e = write_charts(&[broken], &out).unwrap_err();
        assert!(
            e.to_string()
                .contains("broken.json: cannot read the result: not JSON"),
            "{e}"
        );
        let e = write_charts(&[dir.join("missing.json")], &out).unwrap_err();
        assert!(e.to_string().contains("missing.json"), "{e}");
        assert!(write_charts(&[], &out).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
