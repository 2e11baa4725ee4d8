//! The TUI's command-line entry points, called from `main.rs`: `titan-obs RUN [--follow]`
//! opens the gantt, `titan-obs gantt RUN --svg/--png` writes a static one.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;

use super::detail::DetailRun;
use super::detail_source::{self, DetailSource};
use super::export::{self, GanttImageOptions, MAX_IMAGE_ROWS};
use super::model::Timeline;
use super::source::{RunSource, title_of};
use super::terminal::{self, TimelineSource};
use crate::conventions::{FAILED, INCOMPLETE, OK, TITAN_OBS, USAGE};

/// Options of the interactive view (`titan-obs RUN`).
#[derive(Debug, Clone, Args)]
pub struct OpenArgs {
    /// Watch a running job: every second, read what was appended (torchtitan logs: only the
    /// new bytes and new files; titan runs: new parts).
    #[arg(long)]
    pub follow: bool,
    /// Which run of the location to show, by run id, when it holds several (each launch of
    /// titan-train in one dump folder is a run of its own). Default: the newest.
    #[arg(long = "run", value_name = "ID")]
    pub run_id: Option<String>,
    /// Draw from the parts' detail levels (`part-<N>.lod`), reading only what is on screen:
    /// `auto` does for titan runs (local or object store) whose parts hold 32 MB or more.
    #[arg(long, value_enum, default_value_t = DetailLevels::Auto, value_name = "WHEN")]
    pub detail_levels: DetailLevels,
}

/// When the interactive view draws from detail levels instead of loading every span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DetailLevels {
    Auto,
    Always,
    Never,
}

/// Parts of at least this many bytes in all are drawn from detail levels (`--detail-levels
/// auto`): loading every span of them takes seconds.
const DETAIL_LEVELS_FROM: u64 = 32 << 20;

/// Whether `titan-obs RUN` or `titan-obs gantt` draws the titan run `run` from its detail
/// levels.
fn use_detail_levels(run: &str, when: DetailLevels, titan: bool) -> bool {
    if !titan {
        return false;
    }
    match when {
        DetailLevels::Never => false,
        DetailLevels::Always => true,
        DetailLevels::Auto => super::detail::run_holds(run, DETAIL_LEVELS_FROM),
    }
}

/// `titan-obs gantt RUN --svg OUT.svg [--png OUT.png]`: a static gantt for reports and PRs.
#[derive(Debug, Clone, Args)]
pub struct GanttArgs {
    /// Run: titan run dir, torchtitan run (structured_logs/), Chrome trace; or object store URL.
    pub run: String,
    /// Write an SVG here.
    #[arg(long, value_name = "OUT.svg")]
    pub svg: Option<PathBuf>,
    /// Write a PNG here.
    #[arg(long, value_name = "OUT.png")]
    pub png: Option<PathBuf>,
    /// Image width in pixels.
    #[arg(long, default_value_t = 1600)]
    pub width: u32,
    /// Only these steps, e.g. `10..20` (inclusive) or `15`.
    #[arg(long, value_name = "A..B", value_parser = parse_steps)]
    pub steps: Option<(u64, u64)>,
    /// One row per phase showing min/median/max across ranks (automatic above
    /// 600 lane rows, unless --lanes).
    #[arg(long, conflicts_with = "lanes")]
    pub collapsed: bool,
    /// Always one row per rank/thread/depth, however many.
    #[arg(long)]
    pub lanes: bool,
    /// Hide spans nested deeper than this (0 = top-level spans only).
    #[arg(long, value_name = "N")]
    pub max_depth: Option<u8>,
    /// Exit with code 3 when ranks are missing or parts are corrupt (after writing the image).
    #[arg(long)]
    pub strict: bool,
    /// Which run of the location to draw, by run id, when it holds several. Default: the
    /// newest.
    #[arg(long = "run", value_name = "ID")]
    pub run_id: Option<String>,
    /// Draw from the parts' detail levels (`part-<N>.lod`) instead of loading every span:
    /// `auto` does for titan runs whose parts hold 32 MB or more. Zoomed in (`--steps`) past
    /// the finest level, the spans of the parts under the window are decoded.
    #[arg(long, value_enum, default_value_t = DetailLevels::Auto, value_name = "WHEN")]
    pub detail_levels: DetailLevels,
}

fn parse_steps(s: &str) -> Result<(u64, u64), String> {
    let bad = || format!("expected a step range like 10..20 or one step like 15, got {s:?}");
    match s.split_once("..") {
        Some((a, b)) => {
            let a = a.trim().parse().map_err(|_| bad())?;
            let b = b
                .trim()
                .trim_start_matches('=')
                .parse()
                .map_err(|_| bad())?;
            Ok((a, b))
        }
        None => {
            let a = s.trim().parse().map_err(|_| bad())?;
            Ok((a, a))
        }
    }
}

/// `titan-obs RUN`: returns the process exit code.
pub fn open(run: &str, args: &OpenArgs) -> i32 {
    // What RUN is comes first: a README or a run's obs/ folder is a usage error whether or
    // not there is a terminal to draw on.
    let detected = titan_obs_core::location::Location::parse(run)
        .and_then(|l| titan_obs_core::ingest::detect(&l));
    if let Err(e) = detected {
        TITAN_OBS.error(format_args!("{e:#}"));
        return if titan_obs_core::location::is_not_a_run(&e) {
            USAGE.as_i32()
        } else {
            FAILED.as_i32()
        };
    }
    if !terminal::has_terminal() {
        eprint!("{}", terminal::no_terminal_message());
        return USAGE.as_i32();
    }
    let titan = matches!(detected, Ok(titan_obs_core::ingest::Detected::Titan));
    let source: Box<dyn TimelineSource + Send> =
        if use_detail_levels(run, args.detail_levels, titan) {
            Box::new(
                DetailSource::new(run, &title_of(run), args.follow)
                    .showing_run(args.run_id.clone()),
            )
        } else {
            Box::new(RunSource::with_follow(run, args.follow).showing_run(args.run_id.clone()))
        };
    match terminal::run(source, args.follow) {
        Ok(()) => OK.as_i32(),
        Err(e) => {
            TITAN_OBS.error(format_args!("{e:#}"));
            // `--run` naming no run of the location is a usage error, as in the other commands.
            if titan_obs_core::location::is_not_a_run(&e) {
                USAGE.as_i32()
            } else {
                FAILED.as_i32()
            }
        }
    }
}

/// `titan-obs gantt`: returns the process exit code. `quiet` (`-q`): no notes, no `wrote` lines.
pub fn gantt(args: &GanttArgs, quiet: bool) -> i32 {
    match gantt_inner(args, quiet) {
        Ok(complete) if !complete && args.strict => INCOMPLETE.as_i32(),
        Ok(_) => OK.as_i32(),
        Err(e) => {
            TITAN_OBS.error(format_args!("gantt: {e:#}"));
            if e.downcast_ref::<UsageError>().is_some()
                || titan_obs_core::location::is_not_a_run(&e)
            {
                USAGE.as_i32()
            } else {
                FAILED.as_i32()
            }
        }
    }
}

#[derive(Debug)]
struct UsageError(String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Writes the images; `Ok(false)` when the run was incomplete (ranks missing, parts corrupt).
fn gantt_inner(args: &GanttArgs, quiet: bool) -> anyhow::Result<bool> {
    if args.svg.is_none() && args.png.is_none() {
        return Err(
            UsageError("nothing to write: give --svg OUT.svg and/or --png OUT.png".into()).into(),
        );
    }
    let titan = matches!(
        titan_obs_core::location::Location::parse(&args.run)
            .and_then(|l| titan_obs_core::ingest::detect(&l)),
        Ok(titan_obs_core::ingest::Detected::Titan)
    );
    let (t, collapsed) = if use_detail_levels(&args.run, args.detail_levels, titan) {
        gantt_from_detail_levels(args)?
    } else {
        let t = RunSource::new(&args.run)
            .showing_run(args.run_id.clone())
            .load()?;
        let collapsed = collapses(args, &t);
        (t, collapsed)
    };
    if t.span_count == 0 {
        bail!("{} has no spans to draw", args.run);
    }
    for w in &t.warnings {
        TITAN_OBS.warning(w);
    }
    let lane_rows: usize = t.lanes.iter().map(|l| l.rows.len()).sum();
    if collapsed && !args.collapsed && !quiet {
        TITAN_OBS.note(format_args!(
            "{lane_rows} lane rows would make a very tall image; drawing one row per phase \
             (min/median/max across ranks) instead (--lanes to force lanes)"
        ));
    }
    let opts = GanttImageOptions {
        width: args.width,
        steps: args.steps,
        collapsed,
        max_depth: args.max_depth,
    };
    let scene = export::scene(&t, &opts).map_err(|e| UsageError(format!("{e:#}")))?;
    if let Some(p) = &args.svg {
        export::write_atomic(p, export::to_svg(&scene).as_bytes())
            .with_context(|| format!("writing the SVG {}", p.display()))?;
        if !quiet {
            eprintln!("wrote {} ({}x{})", p.display(), scene.width, scene.height);
        }
    }
    if let Some(p) = &args.png {
        let png = export::to_png(&scene)?;
        export::write_atomic(p, &png)
            .with_context(|| format!("writing the PNG {}", p.display()))?;
        if !quiet {
            eprintln!("wrote {} ({}x{})", p.display(), scene.width, scene.height);
        }
    }
    Ok(!t.incomplete)
}

/// Whether the image has one row per phase: asked for, or more lane rows than an image holds
/// (unless `--lanes`).
fn collapses(args: &GanttArgs, t: &Timeline) -> bool {
    let lane_rows: usize = t.lanes.iter().map(|l| l.rows.len()).sum();
    args.collapsed || (!args.lanes && lane_rows > MAX_IMAGE_ROWS)
}

/// The timeline of a `gantt` image drawn from detail levels, and whether it is collapsed:
/// every step and the analysis, as the TUI's worker computes them;
/// then, for lanes, every lane's rows for the image's window at one column per pixel (the
/// detail levels whose buckets fit in a pixel, or the spans of the parts under the window).
fn gantt_from_detail_levels(args: &GanttArgs) -> anyhow::Result<(Timeline, bool)> {
    let (mut d, mut t) = DetailRun::open(&args.run, &title_of(&args.run), args.run_id.as_deref())?;
    detail_source::whole_run_into(&mut d, &mut t, &args.run);
    let collapsed = collapses(args, &t);
    if !collapsed {
        let window =
            export::image_window(&t, args.steps).map_err(|e| UsageError(format!("{e:#}")))?;
        let lanes: Vec<usize> = (0..t.lanes.len()).collect();
        d.fill(&mut t, window, args.width as usize, &lanes);
    }
    Ok((t, collapsed))
}
