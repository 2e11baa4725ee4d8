//! The interactive gantt in a real terminal: `titan-obs RUN` started inside tmux on a
//! synthetic 4-rank run; keys are sent (zoom, step jump, select, quit) and the screen is read
//! back with `tmux capture-pane -p`. Also: without a terminal it explains the other commands,
//! and `titan-obs gantt` writes SVG/PNG.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use titan_tests::{Tmux, shell_quote};

/// Runs `titan-obs ARGS` to completion, asserts it succeeded (its stderr otherwise) and returns
/// its stdout.
fn titan_obs_core<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Vec<u8> {
    let out = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
        .args(args)
        .output()
        .expect("running titan-obs");
    assert!(
        out.status.success(),
        "titan-obs {:?} failed: {}",
        args.iter().map(|a| a.as_ref()).collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// `titan-obs synth RUN --ranks R --steps S --spans-per-step 12 EXTRA...`: a run of real part files.
fn synth(run: &Path, ranks: u32, steps: u32, extra: &[&str]) {
    let (ranks, steps) = (ranks.to_string(), steps.to_string());
    let mut args = vec![
        "synth",
        run.to_str().unwrap(),
        "--ranks",
        &ranks,
        "--steps",
        &steps,
    ];
    args.extend(["--spans-per-step", "12"]);
    args.extend(extra);
    titan_obs_core(&args);
}

/// A 4-rank, 8-step run written by `titan-obs synth` (real part files); rank 2 is 2x slow in
/// forward_backward, every 4th step is a checkpoint step and every 3rd a validation step.
fn synthetic_run(dir: &Path) -> PathBuf {
    let run = dir.join("run");
    synth(
        &run,
        4,
        8,
        &[
            "--steps-per-part",
            "4",
            "--straggler",
            "2:forward_backward:2.0",
            "--checkpoint-every",
            "4",
            "--validation-every",
            "3",
        ],
    );
    run
}

/// The status line's window text, e.g. "window 0 – 1.2s (1.20s)".
fn status_line(screen: &str) -> String {
    screen
        .lines()
        .find(|l| l.contains(" window ") || l.contains(" jump to step"))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn tui_in_tmux_zoom_step_jump_select_quit() {
    let dir = tempfile::tempdir().unwrap();
    let run = synthetic_run(dir.path());
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_titan-obs"));
    let cmd = format!(
        "TERM=xterm-256color {} {}",
        shell_quote(&bin),
        shell_quote(&run)
    );
    let tmux = Tmux::start(&cmd, 160, 50);

    // Every rank's lane, the legend and the numbered steps are on screen.
    let s = tmux.wait_for("the gantt", |s| {
        s.contains("r3") && s.contains("forward_backward")
    });
    for r in 0..4 {
        assert!(s.contains(&format!("r{r}")), "rank {r} lane missing:\n{s}");
    }
    assert!(s.contains("4 ranks"), "{s}");
    assert!(s.contains("│1"), "step numbers missing:\n{s}");

    // Zoom in: the window shrinks around the cursor.
    let before = status_line(&s);
    tmux.keys(&["+"]);
    let s = tmux.wait_for("zoom", |s| status_line(s) != before);
    assert!(status_line(&s).contains("window"), "{s}");

    // Jump to step 5.
    tmux.keys(&["g", "5", "Enter"]);
    let s = tmux.wait_for("step 5", |s| status_line(s).contains("step 5"));
    assert!(s.contains("│5"), "step 5 boundary not shown:\n{s}");

    // Go to rank 0's depth-1 row, walk right into a span and select it.
    tmux.keys(&["Down", "Tab"]);
    let s = tmux.wait_for("a selection", |s| s.contains("selected: "));
    assert!(s.contains("rank 0"), "{s}");
    assert!(s.contains("step 5"), "{s}");
    assert!(
        s.contains("on 4 ranks: min"),
        "cross-rank stats missing:\n{s}"
    );

    // Collapsed mode and the help overlay.
    tmux.keys(&["c"]);
    tmux.wait_for("collapsed mode", |s| {
        s.contains("collapsed: min/median/max")
    });
    tmux.keys(&["?"]);
    tmux.wait_for("help", |s| s.contains("keys (? or Esc closes)"));
    tmux.keys(&["Escape"]);
    tmux.wait_for("help closed", |s| !s.contains("keys (? or Esc closes)"));

    // q quits cleanly and gives the terminal back.
    tmux.keys(&["q"]);
    let (status, s) = tmux.wait_for_exit();
    assert_eq!(status, 0, "{s}");
}

#[test]
fn tui_without_a_terminal_explains_the_non_interactive_commands() {
    let dir = tempfile::tempdir().unwrap();
    let run = synthetic_run(dir.path());
    let out = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
        .arg(&run)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs a terminal"), "{err}");
    for cmd in [
        "summary RUN",
        "metrics RUN",
        "export RUN --chrome",
        "gantt RUN --svg",
    ] {
        assert!(err.contains(cmd), "`{cmd}` not explained:\n{err}");
    }
}

#[test]
fn tui_gantt_writes_svg_and_png() {
    let dir = tempfile::tempdir().unwrap();
    let run = synthetic_run(dir.path());
    let svg = dir.path().join("gantt.svg");
    let png = dir.path().join("gantt.png");
    titan_obs_core(&[
        "gantt",
        run.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
        "--png",
        png.to_str().unwrap(),
        "--width",
        "1200",
    ]);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    for r in [0, 1, 3] {
        assert!(text.contains(&format!(">r{r}</text>")), "rank {r} missing");
    }
    // The others waited for rank 2 at the all_reduce: its lane is marked.
    assert!(text.contains(">r2 late</text>"), "late rank not marked");
    assert!(text.contains(">forward_backward</text>"), "legend missing");
    // The straggler (rank 2, forward_backward x2) is painted in the straggler colour.
    assert!(
        text.contains("fill=\"#ff0000\""),
        "straggler not highlighted"
    );
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 1200);

    // A step range outside the run is a usage error naming the range.
    let out = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
        .args([
            "gantt",
            run.to_str().unwrap(),
            "--svg",
            svg.to_str().unwrap(),
            "--steps",
            "50..60",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("steps 50..60 are not in this run"));
}

/// A torchtitan run written by torchtitan 0.3.0's own structured logger (2 ranks, 4 steps;
/// `tests/python/tt_obs_make_run.py` through `$TITAN_TT_PYTHON`).
fn torchtitan_run(dir: &Path) -> PathBuf {
    let python = std::env::var("TITAN_TT_PYTHON")
        .expect("TITAN_TT_PYTHON (set in .cargo/config.toml) points at .venv-tt's python");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/tt_obs_make_run.py");
    let run = dir.join("full");
    let out = Command::new(python)
        .arg(script)
        .arg(&run)
        .args(["--ranks", "2", "--steps", "4"])
        .output()
        .expect("running tt_obs_make_run.py");
    assert!(
        out.status.success(),
        "tt_obs_make_run.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    run
}

#[test]
fn tui_follows_a_torchtitan_run_as_its_logs_grow() {
    let dir = tempfile::tempdir().unwrap();
    let full = torchtitan_run(dir.path());
    let mut files: Vec<PathBuf> = std::fs::read_dir(full.join("structured_logs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    // The live run starts with rank 0's first 20 lines (its first step still open).
    let live = dir.path().join("live");
    let logs = live.join("structured_logs");
    std::fs::create_dir_all(&logs).unwrap();
    let text0 = std::fs::read_to_string(&files[0]).unwrap();
    let cut = text0.match_indices('\n').nth(19).unwrap().0 + 1;
    let live0 = logs.join(files[0].file_name().unwrap());
    std::fs::write(&live0, &text0[..cut]).unwrap();

    let bin = PathBuf::from(env!("CARGO_BIN_EXE_titan-obs"));
    let cmd = format!(
        "TERM=xterm-256color {} {} --follow",
        shell_quote(&bin),
        shell_quote(&live)
    );
    let tmux = Tmux::start(&cmd, 160, 40);
    let s = tmux.wait_for("the first part of rank 0", |s| {
        s.contains("following: 1 files") && s.contains("r0")
    });
    assert!(s.contains("fwd_bwd"), "torchtitan's phase names:\n{s}");
    assert!(!s.contains("r1."), "rank 1 has logged nothing yet:\n{s}");

    // The rest of rank 0 is appended and rank 1's file appears.
    std::fs::OpenOptions::new()
        .append(true)
        .open(&live0)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &text0.as_bytes()[cut..]))
        .unwrap();
    std::fs::copy(&files[1], logs.join(files[1].file_name().unwrap())).unwrap();
    let s = tmux.wait_for("rank 1 and the appended steps", |s| {
        s.contains("following: 2 files") && s.contains("r1")
    });
    // Only the new bytes were read on that refresh: rank 0's appended part + rank 1's file.
    let new_bytes = (text0.len() - cut) as u64 + std::fs::metadata(&files[1]).unwrap().len();
    let shown = format!("{:.1} kB new", new_bytes as f64 / 1024.0);
    assert!(s.contains(&shown), "expected `{shown}` in the status:\n{s}");
    // All 4 steps are on screen.
    assert!(s.contains("│4"), "step 4 missing:\n{s}");

    tmux.keys(&["q"]);
    let (status, s) = tmux.wait_for_exit();
    assert_eq!(status, 0, "{s}");
}

#[test]
fn tui_opens_a_torchtitan_gantt_trace() {
    let dir = tempfile::tempdir().unwrap();
    let full = torchtitan_run(dir.path());
    let python = std::env::var("TITAN_TT_PYTHON").unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/tt_obs_traces.py");
    let gantt = dir.path().join("gantt.json");
    let out = Command::new(python)
        .arg(script)
        .arg("gantt")
        .arg(full.join("structured_logs"))
        .arg(&gantt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_titan-obs"));
    let cmd = format!(
        "TERM=xterm-256color {} {}",
        shell_quote(&bin),
        shell_quote(&gantt)
    );
    let tmux = Tmux::start(&cmd, 160, 40);
    let s = tmux.wait_for("the gantt of the trace", |s| {
        s.contains("r1") && s.contains("fwd_bwd")
    });
    assert!(s.contains("2 ranks"), "{s}");
    tmux.keys(&["q"]);
    let (status, s) = tmux.wait_for_exit();
    assert_eq!(status, 0, "{s}");
}

/// Rank 3 is 1.3x slow in forward_backward; the other ranks wait for it at the all_reduce.
/// `summary --json`, the TUI's phase table and title, and the gantt image name the same rank
/// and phase: they all read obs's analysis.
#[test]
fn summary_tui_and_gantt_name_the_same_straggler() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    synth(&run, 4, 12, &["--straggler", "3:forward_backward:1.3"]);

    let out = titan_obs_core(&["summary", run.to_str().unwrap(), "--json"]);
    let s: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let top = &s["waits"][0];
    assert_eq!(top["rank"], 3, "{s:#}");
    assert_eq!(top["phase"], "forward_backward", "{s:#}");
    assert_eq!(top["steps_last"], 12);
    assert!(top["wait_caused_ns"].as_i64().unwrap() > 0);
    let stragglers = s["stragglers"].as_array().unwrap();
    assert!(
        stragglers
            .iter()
            .any(|x| x["rank"] == 3 && x["phase"] == "forward_backward"),
        "{stragglers:#?}"
    );
    assert!(stragglers.iter().all(|x| x["rank"] == 3), "{stragglers:#?}");

    // The TUI: title and the phase table's "slow" column.
    let tmux = Tmux::start(
        &format!("{} {}", env!("CARGO_BIN_EXE_titan-obs"), shell_quote(&run)),
        200,
        50,
    );
    let screen = tmux.wait_for("the phase table", |s| s.contains("phases (all ranks"));
    assert!(
        screen.contains("waiting on r3 (forward_backward)"),
        "{screen}"
    );
    let row = screen
        .lines()
        .filter_map(|l| l.rsplit_once("█ forward_backward "))
        .map(|(_, rest)| rest.to_string())
        .next()
        .unwrap_or_else(|| panic!("no forward_backward row:\n{screen}"));
    let slow = row
        .trim_end()
        .trim_end_matches('│')
        .split_whitespace()
        .last();
    assert_eq!(slow, Some("r3"), "forward_backward row: {row}\n{screen}");
    tmux.keys(&["q"]);

    // The gantt image: the late rank's lane and the legend's headline.
    let svg = dir.path().join("gantt.svg");
    titan_obs_core(&[
        "gantt",
        run.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains(">r3 late</text>"));
    assert!(
        text.contains("waiting on r3"),
        "gantt legend has no waits headline"
    );
    assert!(
        text.contains("waiting on r3 (late from forward_backward, last in 12 steps"),
        "legend has no headline"
    );
}

/// `export --chrome` carries the same analysis: otherData's waits and stragglers, and each
/// collective span's wait.
#[test]
fn chrome_export_carries_the_waits() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    synth(&run, 4, 6, &["--straggler", "1:forward_backward:1.3"]);
    let json = dir.path().join("trace.json");
    titan_obs_core(&[
        "export",
        run.to_str().unwrap(),
        "--chrome",
        json.to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let top = &v["otherData"]["waits"][0];
    assert_eq!(
        (&top["rank"], &top["phase"]),
        (&1.into(), &"forward_backward".into())
    );
    assert!(
        v["otherData"]["stragglers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["rank"] == 1 && x["phase"] == "forward_backward")
    );
    // Ranks 0, 2 and 3 waited in every all_reduce; rank 1 never did.
    let waited: Vec<(u64, i64)> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "all_reduce" && e["ph"] == "X")
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["args"]["waited_ns"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(waited.len(), 4 * 6);
    for (rank, w) in waited {
        assert_eq!(w > 0, rank != 1, "rank {rank} waited {w} ns");
    }
}

/// A longer run (4 ranks x `steps` steps of ~61 ms: 3000 are 4.4 simulated minutes in 30
/// parts per rank) for the gantt drawn from detail levels.
fn long_run(dir: &Path, steps: u32) -> PathBuf {
    let run = dir.join("long");
    synth(
        &run,
        4,
        steps,
        &[
            "--steps-per-part",
            "100",
            "--straggler",
            "2:forward_backward:1.5",
        ],
    );
    run
}

/// The details panel's first line (what is under the cursor or selected).
fn details_line(screen: &str) -> String {
    screen
        .lines()
        .find(|l| l.contains("under cursor: ") || l.contains("selected: "))
        .unwrap_or_default()
        .to_string()
}

/// The lane rows of rank `r` (its label row and its depth rows) hold bars.
fn lane_has_bars(screen: &str, r: u32) -> bool {
    let label = format!(" r{r} ");
    screen
        .lines()
        .skip_while(|l| !l.starts_with(&label) && !l.starts_with(&format!("▶r{r} ")))
        .take(4)
        .any(|l| l.contains('█'))
}

/// The first frame of [`long_run`] (3000 steps) drawn from detail levels: every rank's lanes
/// hold bars, the whole run is in the window, and what is under the cursor is a bucket of a
/// detail level, not a span; then the whole run's steps, summary and metrics from the worker.
/// Returns the first frame.
fn long_run_first_frame_and_summary(tmux: &Tmux) -> String {
    let first = tmux.wait_for("the gantt", |s| {
        s.contains("4 ranks") && s.contains("forward_backward") && lane_has_bars(s, 3)
    });
    for r in 0..4 {
        assert!(lane_has_bars(&first, r), "rank {r} has no bars:\n{first}");
    }
    assert!(
        status_line(&first).contains("(4m"),
        "the whole run:\n{first}"
    );
    assert!(details_line(&first).contains("detail level's"), "{first}");
    let s = tmux.wait_for("the summary and metrics", |s| {
        s.contains("p95") && s.contains("step 3000")
    });
    assert!(s.contains("waiting on r2"), "{s}");
    first
}

/// Zooms in ten times (1/1024 of the run, ~1 s): past the finest level, the spans. Returns
/// the screen.
fn zoom_into_spans(tmux: &Tmux) -> String {
    for _ in 0..10 {
        tmux.keys(&["+"]);
    }
    let s = tmux.wait_for("spans", |s| {
        let d = details_line(s);
        d.contains("under cursor: ") && !d.contains("detail level's")
    });
    assert!(details_line(&s).contains("duration"), "{s}");
    s
}

#[test]
fn tui_draws_a_long_run_from_detail_levels_and_zooms_in_to_its_spans() {
    let dir = tempfile::tempdir().unwrap();
    let run = long_run(dir.path(), 3000);
    // Rank 3's first part's detail levels (in its footer) are damaged: named, and the part
    // drawn from its spans.
    let damaged = run.join("obs/rank-3/part-000000.parquet");
    let bytes = std::fs::read(&damaged).unwrap();
    let bytes = titan_obs_core::embedded::reencode(bytes.into(), |kv| {
        let lod = kv.iter_mut().find(|k| k.key == "titan.lod").unwrap();
        let v = lod.value.as_mut().unwrap();
        let at = v.len() / 2;
        let c = if &v[at..=at] == "A" { "B" } else { "A" };
        v.replace_range(at..=at, c);
    })
    .unwrap();
    std::fs::write(&damaged, &bytes).unwrap();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_titan-obs"));
    let cmd = format!(
        "TERM=xterm-256color {} {} --detail-levels always",
        shell_quote(&bin),
        shell_quote(&run)
    );
    let tmux = Tmux::start(&cmd, 160, 50);

    let s = long_run_first_frame_and_summary(&tmux);
    assert!(
        s.contains("part-000000.parquet: levels damaged"),
        "the damaged detail file is named:\n{s}"
    );
    let s = zoom_into_spans(&tmux);
    assert!(
        status_line(&s).contains("ms)") || status_line(&s).contains("s)"),
        "{s}"
    );
    for r in 0..4 {
        assert!(
            lane_has_bars(&s, r),
            "rank {r} has no spans zoomed in:\n{s}"
        );
    }
    // The step labels are there at this zoom too.
    assert!(s.contains("│1"), "{s}");

    // Zoom out ten times: buckets again (2^30 ns is finer than a cell).
    for _ in 0..10 {
        tmux.keys(&["-"]);
    }
    let s = tmux.wait_for("buckets", |s| details_line(s).contains("detail level's"));
    for r in 0..4 {
        assert!(
            lane_has_bars(&s, r),
            "rank {r} has no bars zoomed out:\n{s}"
        );
    }
    // Fit: the whole run again.
    tmux.keys(&["f"]);
    let s = tmux.wait_for("fit", |s| status_line(s).contains("(4m"));
    assert!(lane_has_bars(&s, 0), "{s}");

    tmux.keys(&["q"]);
    let (status, s) = tmux.wait_for_exit();
    assert_eq!(status, 0, "{s}");
}

#[test]
fn tui_follow_appends_a_growing_run_to_its_detail_levels() {
    use titan_obs_core::footer::PartHeader;
    use titan_obs_core::journal::JournalWriter;
    use titan_obs_core::part::{PartBuilder, Row};
    let dir = tempfile::tempdir().unwrap();
    let run = long_run(dir.path(), 300);
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_titan-obs"));
    let cmd = format!(
        "TERM=xterm-256color {} {} --detail-levels always --follow",
        shell_quote(&bin),
        shell_quote(&run)
    );
    let tmux = Tmux::start(&cmd, 160, 50);
    let s = tmux.wait_for("the gantt and the whole run", |s| {
        s.contains("300 steps") && s.contains("metrics") && lane_has_bars(s, 1)
    });
    assert!(s.contains("following: detail levels"), "{s}");
    let before = status_line(&s);

    // Rank 1 starts a journal after its parts and appends 20 steps, one batch per step.
    let loaded = titan_obs_core::load(run.to_str().unwrap(), &Default::default()).unwrap();
    let info = &loaded.ranks[&1];
    let end = (0..loaded.spans.len())
        .map(|i| loaded.spans.start_ns[i] + loaded.spans.dur_ns[i])
        .max()
        .unwrap();
    let header = PartHeader {
        run_id: info.run_id.clone(),
        source: info.source.clone(),
        host: info.host.clone(),
        rank: 1,
        local_rank: info.local_rank,
        world_size: info.world_size,
        pid: info.pid,
        clock_offset_ns: 0,
        threads: info.threads.clone(),
        run_metadata: info.run_metadata.clone(),
    };
    let rank_dir = run.join("obs/rank-1");
    let mut journal = JournalWriter::create(&rank_dir, 3, &header).unwrap();
    let step_ns = 2_000_000_000i64;
    for k in 0..20u64 {
        let mut b = PartBuilder::new();
        let t0 = end + k as i64 * step_ns;
        for (name, depth, start, dur) in [
            ("step", 0, t0, step_ns - 1000),
            ("forward_backward", 1, t0, step_ns / 2),
            ("optimizer", 1, t0 + step_ns / 2, step_ns / 4),
        ] {
            let seq = 1_000_000 + k * 3 + depth as u64;
            b.push(&Row::span(seq, name, 301 + k, start, dur, depth));
        }
        journal.append(&b.finish(&header).unwrap()).unwrap();
    }
    // Appended: the run has 20 more steps, its window grew (it showed the whole run), and
    // the status says what the refresh read and appended.
    let s = tmux.wait_for("the appended steps", |s| s.contains("+60 spans"));
    assert!(
        s.contains("│320"),
        "the last appended step on the step row:\n{s}"
    );
    assert!(s.contains("appended"), "{s}");
    assert_ne!(
        status_line(&s),
        before,
        "the window follows the run's end:\n{s}"
    );

    // Jump to an appended step: rank 1 has its spans there, rank 0 none.
    tmux.keys(&["g", "310", "Enter"]);
    let s = tmux.wait_for("step 310", |s| status_line(s).contains("step 310"));
    assert!(lane_has_bars(&s, 1), "rank 1's appended spans:\n{s}");
    assert!(!lane_has_bars(&s, 0), "rank 0 recorded nothing there:\n{s}");

    tmux.keys(&["q"]);
    let (status, s) = tmux.wait_for_exit();
    assert_eq!(status, 0, "{s}");
    drop(journal);
}

/// A local S3 server (`moto_server` from the workspace's `.venv`) on a free port, with one
/// bucket; killed on drop.
struct S3 {
    child: std::process::Child,
    endpoint: String,
}

impl S3 {
    fn start(bucket: &str) -> S3 {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let child = Command::new(root.join(".venv/bin/moto_server"))
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start .venv/bin/moto_server (scripts/setup.sh installs it)");
        let s3 = S3 {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "moto_server did not start");
            std::thread::sleep(Duration::from_millis(200));
        }
        let made = Command::new(root.join(".venv/bin/python"))
            .arg(root.join("tests/python/s3_client.py"))
            .args([&s3.endpoint, bucket, "mkbucket"])
            .status()
            .unwrap();
        assert!(made.success());
        s3
    }

    /// The environment that points titan-obs's object store client at this server.
    fn env(&self) -> [(&'static str, String); 5] {
        [
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// `titan-obs ARGS` against this server, asserting it succeeded.
    fn titan_obs(&self, args: &[&str]) {
        let out = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
            .args(args)
            .envs(self.env())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "titan-obs {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What two gantt SVGs of one run must share whether drawn from detail levels or from every
/// span: every text above the legend (title, axis, step labels with their tags in any order,
/// lane labels), the legend's phases and waits headline in any order, and, within 2%, the
/// number of bars. (Drawn from levels the legend lists phases in the order the detail files
/// named them, and single spans carry no straggler mark: no "straggler" legend entry.)
/// `collapsed`: the rows' labels as a set (collapsed rows follow that phase order), and the
/// bars within 5% (from levels a collapsed bar starts at its step's start, not the median
/// start: adjacent bars merge differently).
fn same_gantt(levels: &str, spans: &str, collapsed: bool) {
    let texts = |svg: &str| -> (Vec<String>, Vec<String>) {
        let legend_y = svg
            .split("<text ")
            .filter_map(|t| t.split_once("y=\"")?.1.split_once('"'))
            .filter_map(|(y, _)| y.parse::<u32>().ok())
            .max()
            .unwrap_or(0);
        let all: Vec<(u32, String)> = svg
            .split("<text ")
            .skip(1)
            .map(|t| {
                let t = t.split("</text>").next().unwrap_or_default();
                let (attrs, text) = t.split_once('>').unwrap_or_default();
                // Tag letters after a step number come in tag-id order, which differs.
                let digits: String = text.chars().take_while(char::is_ascii_digit).collect();
                let mut rest: Vec<char> = text[digits.len()..].chars().collect();
                if rest.iter().all(char::is_ascii_uppercase) {
                    rest.sort_unstable();
                }
                let y = attrs
                    .split_once("y=\"")
                    .and_then(|(_, y)| y.split_once('"')?.0.parse().ok())
                    .unwrap_or(0);
                (
                    y,
                    format!("{attrs}>{digits}{}", rest.into_iter().collect::<String>()),
                )
            })
            .collect();
        // The legend: its last two text rows (phases, then the headline), text only.
        let legend_from = legend_y.saturating_sub(20);
        let mut body: Vec<String> = all
            .iter()
            .filter(|(y, _)| *y < legend_from)
            .map(|(_, t)| t.clone())
            .collect();
        if collapsed {
            // Row labels are drawn at x=4: without their y, sorted.
            for t in &mut body {
                if t.starts_with("x=\"4\"") {
                    *t = t.split_once('>').map_or(t.clone(), |(_, x)| x.to_string());
                }
            }
            body.sort();
        }
        let mut legend: Vec<String> = all
            .iter()
            .filter(|(y, _)| *y >= legend_from)
            .map(|(_, t)| t.split_once('>').map_or(t.clone(), |(_, x)| x.to_string()))
            .filter(|t| !t.starts_with("straggler"))
            .collect();
        legend.sort();
        (body, legend)
    };
    assert_eq!(texts(levels), texts(spans));
    let bars = |svg: &str| svg.matches("<rect").count() as f64;
    let (a, b) = (bars(levels), bars(spans));
    let tolerance = if collapsed { 0.05 } else { 0.02 };
    assert!(
        (a - b).abs() <= tolerance * b,
        "{a} bars from levels, {b} from spans"
    );
}

#[test]
fn tui_draws_an_object_store_run_from_detail_levels() {
    let s3 = S3::start("obs-tui");
    let url = "s3://obs-tui/runs/long";
    s3.titan_obs(&[
        "synth",
        url,
        "--ranks",
        "4",
        "--steps",
        "3000",
        "--spans-per-step",
        "12",
        "--steps-per-part",
        "100",
        "--straggler",
        "2:forward_backward:1.5",
    ]);
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_titan-obs"));
    let env: Vec<String> = s3.env().iter().map(|(k, v)| format!("{k}={v}")).collect();
    let cmd = format!(
        "TERM=xterm-256color {} {} {url} --detail-levels always",
        env.join(" "),
        shell_quote(&bin),
    );
    let tmux = Tmux::start(&cmd, 160, 50);
    // Drawn from the detail files in the bucket: every rank's lanes, the whole run, a bucket
    // under the cursor; then the whole run's steps and summary from the bucket's summaries.
    long_run_first_frame_and_summary(&tmux);
    // Zoomed in past the finest level: the spans of the parts under the window, decoded
    // from the bucket.
    let s = zoom_into_spans(&tmux);
    for r in 0..4 {
        assert!(lane_has_bars(&s, r), "rank {r} has no spans:\n{s}");
    }
    tmux.keys(&["q"]);
    let (status, s) = tmux.wait_for_exit();
    assert_eq!(status, 0, "{s}");

    // `gantt` on the bucket: the image from detail levels is the one from every span.
    let dir = tempfile::tempdir().unwrap();
    let svg = |name: &str, when: &str| {
        let p = dir.path().join(name);
        s3.titan_obs(&[
            "gantt",
            url,
            "--svg",
            p.to_str().unwrap(),
            "--detail-levels",
            when,
        ]);
        std::fs::read_to_string(p).unwrap()
    };
    same_gantt(
        &svg("levels.svg", "always"),
        &svg("spans.svg", "never"),
        false,
    );
}

#[test]
fn gantt_from_detail_levels_is_the_gantt_from_spans() {
    let dir = tempfile::tempdir().unwrap();
    let run = long_run(dir.path(), 3000);
    let run = run.to_str().unwrap();
    let svg = |name: &str, extra: &[&str]| {
        let p = dir.path().join(name);
        let mut args = vec!["gantt", run, "--svg", p.to_str().unwrap()];
        args.extend(extra);
        titan_obs_core(&args);
        std::fs::read_to_string(p).unwrap()
    };
    // The whole run (buckets of a detail level per pixel) and three steps (the spans of the
    // parts under the window, decoded).
    for steps in [&[][..], &["--steps", "10..12"][..]] {
        let levels = svg(
            "levels.svg",
            &[steps, &["--detail-levels", "always"]].concat(),
        );
        let spans = svg(
            "spans.svg",
            &[steps, &["--detail-levels", "never"]].concat(),
        );
        assert!(
            levels.contains("4 ranks, 147600 spans, 3000 steps"),
            "{steps:?}"
        );
        same_gantt(&levels, &spans, false);
    }
    // Collapsed (one row per phase, from the per-part summaries): the same rows and legend.
    let levels = svg("levels.svg", &["--collapsed", "--detail-levels", "always"]);
    let spans = svg("spans.svg", &["--collapsed", "--detail-levels", "never"]);
    assert!(levels.contains(">forward_backward</text>"), "{levels}");
    same_gantt(&levels, &spans, true);
}

/// Two runs in one folder (a second launch wrote 2 ranks after the first's 4): drawn from
/// detail levels, the TUI shows the newest, or the one `--run ID` names, and never mixes them.
#[test]
fn tui_run_id_picks_a_run_drawn_from_detail_levels() {
    let dir = tempfile::tempdir().unwrap();
    let run = long_run(dir.path(), 3000);
    let second = dir.path().join("second");
    synth(
        &second,
        2,
        20,
        &["--run-id", "second", "--steps-per-part", "100"],
    );
    for rank in 0..2 {
        for e in std::fs::read_dir(second.join(format!("obs/rank-{rank}")))
            .unwrap()
            .flatten()
        {
            let name = e.file_name().into_string().unwrap();
            // The parts and the files beside them; not the second run's rank summary.
            let Some((index, ext)) = name.strip_prefix("part-").and_then(|n| n.split_once('.'))
            else {
                continue;
            };
            let index: u64 = index.parse().unwrap();
            let to = run.join(format!("obs/rank-{rank}/part-{:06}.{ext}", index + 1000));
            std::fs::copy(e.path(), to).unwrap();
        }
    }
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_titan-obs"));
    let open = |extra: &str| {
        Tmux::start(
            &format!(
                "TERM=xterm-256color {} {} --detail-levels always {extra}",
                shell_quote(&bin),
                shell_quote(&run)
            ),
            160,
            50,
        )
    };
    // The newest: 2 ranks, 20 steps.
    let tmux = open("");
    // The title comes before the lanes: a screen caught between them has none yet (seen once
    // under a full suite's load), so the wait is for both.
    let s = tmux.wait_for("the newest run and its lanes", |s| {
        s.contains("2 ranks") && s.contains("20 steps") && lane_has_bars(s, 1)
    });
    assert!(!s.contains(" r2 "), "rank 2 is not in the newest run:\n{s}");
    tmux.keys(&["q"]);
    // The first: 4 ranks, 3000 steps, its straggler.
    let tmux = open("--run synthetic");
    let s = tmux.wait_for("the first run and its straggler", |s| {
        s.contains("4 ranks") && s.contains("3000 steps") && s.contains("waiting on r2")
    });
    assert!(details_line(&s).contains("detail level's"), "{s}");
    for r in 0..4 {
        assert!(lane_has_bars(&s, r), "rank {r} has no bars:\n{s}");
    }
    tmux.keys(&["q"]);
    // No such run: a usage error naming the runs.
    let tmux = open("--run third");
    let (status, s) = tmux.wait_for_exit();
    assert_eq!(status, 2, "{s}");
    assert!(s.contains("second") && s.contains("synthetic"), "{s}");

    // Following the first run: journals of both runs grow; only the first's spans are drawn.
    let tmux = open("--run synthetic --follow");
    tmux.wait_for("the first run", |s| {
        s.contains("3000 steps") && s.contains("metrics")
    });
    let journal = |rank: u32, run_id: &str, spans: u64| {
        use titan_obs_core::footer::PartHeader;
        use titan_obs_core::journal::JournalWriter;
        use titan_obs_core::part::{PartBuilder, Row};
        let header = PartHeader {
            run_id: run_id.into(),
            source: "trainer".into(),
            rank,
            world_size: 4,
            ..Default::default()
        };
        let dir = run.join(format!("obs/rank-{rank}"));
        let mut j = JournalWriter::create(&dir, 1001, &header).unwrap();
        let mut b = PartBuilder::new();
        for k in 0..spans {
            let start = 1_750_001_000_000_000_000 + k as i64 * 1_000_000;
            b.push(&Row::span(
                9_000_000 + k,
                "step",
                4000 + k,
                start,
                500_000,
                0,
            ));
        }
        j.append(&b.finish(&header).unwrap()).unwrap();
        j
    };
    let _other = journal(0, "second", 3);
    let _shown = journal(1, "synthetic", 6);
    let s = tmux.wait_for("the appended spans", |s| s.contains("+6 spans"));
    assert!(!s.contains("+9 spans") && !s.contains("+3 spans"), "{s}");
}

/// The slow-rank column of the TUI's phase table for `phase`.
fn slow_column(screen: &str, phase: &str) -> Option<String> {
    let row = screen
        .lines()
        .filter_map(|l| l.rsplit_once(&format!("█ {phase} ")))
        .map(|(_, rest)| rest.to_string())
        .next()?;
    row.trim_end()
        .trim_end_matches('│')
        .split_whitespace()
        .last()
        .map(str::to_string)
}

/// Under PP the TUI compares a rank with the ranks of its own stage, as `summary` does: the
/// slow replica of stage 1 is named in the passes, stage 1 itself (twice stage 0's passes by
/// design) is not. From every span and from detail levels (the per-part summaries).
#[test]
fn tui_names_the_stragglers_of_each_pipeline_stage() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("pp");
    common::write_pipeline_run(
        run.to_str().unwrap(),
        &[(0, 0, 1.0), (1, 0, 1.0), (2, 1, 1.0), (3, 1, 1.5)],
        12,
    );
    for when in ["never", "always"] {
        let tmux = Tmux::start(
            &format!(
                "{} {} --detail-levels {when}",
                env!("CARGO_BIN_EXE_titan-obs"),
                shell_quote(&run)
            ),
            200,
            50,
        );
        let s = tmux.wait_for("the phase table", |s| {
            s.contains("phases (all ranks") && slow_column(s, "backward").is_some()
        });
        for phase in ["forward", "backward"] {
            assert_eq!(
                slow_column(&s, phase).as_deref(),
                Some("r3"),
                "{when}: {phase}\n{s}"
            );
        }
        tmux.keys(&["q"]);
    }
}
