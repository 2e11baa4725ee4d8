//! titan-obs end to end: a process that records like the trainer leaves parts that pyarrow
//! reads with the documented schema; summary, metrics and export work on them; kill -9 loses
//! at most one flush interval (the journal keeps every flushed batch); corrupt parts and missing ranks are reported by name; runs on
//! an S3 object store (moto) work.
//!
//! The recording process is this test binary re-executed with `OBS_CHILD_RUN` set, running
//! the ignored `recorder_child` test.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use titan_obs_core::Reduce;
use titan_tests::{MotoServer, Tmux, bin, python_script, shell_quote};

const CHILD_ENV: &str = "OBS_CHILD_RUN";

/// Known sleep lengths (ms) of the child's phases, asserted as lower bounds by the tests.
const FORWARD_MS: u64 = 6;
const BACKWARD_MS: u64 = 9;
const STEPS: u64 = 6;

fn sleep_ms(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}

/// The recording child: `OBS_CHILD_MODE=train` records a short training-like run and exits;
/// `OBS_CHILD_MODE=rate` records one instant per millisecond forever (to be killed).
#[test]
#[ignore = "helper process for the other tests"]
fn recorder_child() {
    let Ok(run) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mode = std::env::var("OBS_CHILD_MODE").unwrap_or_default();
    let rank: u32 = std::env::var("OBS_CHILD_RANK").map_or(0, |r| r.parse().unwrap());
    let world: u32 = std::env::var("OBS_CHILD_WORLD").map_or(1, |r| r.parse().unwrap());
    let flush_ms: u64 = std::env::var("OBS_CHILD_FLUSH_MS").map_or(2000, |r| r.parse().unwrap());
    // A rotate interval short enough for a few parts in the child's life (default 600 s).
    let rotate = std::env::var("OBS_CHILD_ROTATE_MS").map_or(Duration::from_secs(600), |r| {
        Duration::from_millis(r.parse().unwrap())
    });
    titan_obs_core::set_clock_offset_ns(1234);
    titan_tests::init_trainer_recorder(run, rank, world, Duration::from_millis(flush_ms), rotate);
    if mode == "rate" {
        let start = Instant::now();
        let mut i = 0u64;
        loop {
            titan_obs_core::set_step(i / 100);
            titan_obs_core::instant("tick");
            i += 1;
            let next = start + Duration::from_millis(i);
            if let Some(d) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(d);
            }
        }
    }
    train_like(rank);
    titan_obs_core::finish().expect("finish");
}

fn train_like(rank: u32) {
    for phase in [
        "tokenizer",
        "dataloader",
        "model_build",
        "parallelism",
        "optimizer",
        "checkpoint",
    ] {
        let _s = titan_obs_core::span(phase);
        sleep_ms(1);
    }
    // A data loader thread recording in parallel.
    let loader = std::thread::Builder::new()
        .name("dataloader".into())
        .spawn(|| {
            for _ in 0..3 {
                let _s = titan_obs_core::span("prefetch");
                sleep_ms(2);
            }
        })
        .unwrap();
    for step in 1..=STEPS {
        titan_obs_core::set_step(step);
        let _step = titan_obs_core::span("step");
        {
            let _s = titan_obs_core::span("data_loading");
            sleep_ms(1);
        }
        {
            let _fb = titan_obs_core::span("forward_backward");
            for _ in 0..2 {
                let _mb = titan_obs_core::span("microbatch");
                {
                    let _f = titan_obs_core::span("forward");
                    sleep_ms(FORWARD_MS);
                }
                let _b = titan_obs_core::span("backward");
                sleep_ms(BACKWARD_MS + if rank == 1 { 8 } else { 0 });
            }
        }
        {
            let _o = titan_obs_core::span("optimizer");
            for p in ["clip", "optimizer_step", "lr"] {
                let _s = titan_obs_core::span(p);
                sleep_ms(1);
            }
        }
        if step == 3 {
            titan_obs_core::add_step_tag("checkpoint");
            let _c = titan_obs_core::span("checkpoint");
            sleep_ms(20);
        }
        if step == 4 {
            titan_obs_core::add_step_tag("validation");
            let _v = titan_obs_core::span("validation");
            sleep_ms(5);
            titan_obs_core::scalar("validation/loss", 5.0 + rank as f64, Reduce::Mean);
        }
        if step == 5 {
            let g = titan_obs_core::span("collectives");
            g.error("all_reduce timed out on rank 1");
        }
        titan_obs_core::scalar(
            "training/loss",
            10.0 - step as f64 + rank as f64,
            Reduce::Mean,
        );
        titan_obs_core::scalar(
            "training/grad_norm",
            step as f64 * (rank as f64 + 1.0),
            Reduce::Max,
        );
        titan_obs_core::scalar(
            "trainer_throughput/tps",
            100.0 * (rank as f64 + 1.0),
            Reduce::Sum,
        );
    }
    loader.join().unwrap();
    let _t = titan_obs_core::span("teardown");
}

fn child(run: &Path, mode: &str, rank: u32, world: u32, flush_ms: u64) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        titan_tests::test_name(module_path!(), "recorder_child").as_str(),
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, run)
    .env("OBS_CHILD_MODE", mode)
    .env("OBS_CHILD_RANK", rank.to_string())
    .env("OBS_CHILD_WORLD", world.to_string())
    .env("OBS_CHILD_FLUSH_MS", flush_ms.to_string())
    .stdout(Stdio::null());
    cmd
}

fn record_two_ranks(run: &Path) {
    let mut kids: Vec<_> = (0..2)
        .map(|r| child(run, "train", r, 2, 2000).spawn().unwrap())
        .collect();
    for k in &mut kids {
        assert!(k.wait().unwrap().success(), "recording child failed");
    }
}

fn titan_obs_core(args: &[&str]) -> std::process::Output {
    Command::new(bin("titan-obs")).args(args).output().unwrap()
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn recorded_run_is_readable_by_pyarrow_and_analysed() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    record_two_ranks(&run);

    // pyarrow reads the parts with the documented schema and values.
    let out = python_script("tests/python/obs_check_parts.py")
        .arg(&run)
        .arg(FORWARD_MS.to_string())
        .arg(BACKWARD_MS.to_string())
        .arg(STEPS.to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pyarrow check failed:\n{}\n{}",
        stdout(&out),
        stderr(&out)
    );

    // summary --json: phases with known counts and lower-bounded durations; rank 1's
    // backward is 8 ms slower and must show up as a straggler; tagged steps 3 and 4.
    let run_s = run.to_str().unwrap();
    let o = titan_obs_core(&["summary", run_s, "--json", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["ranks"], 2);
    assert_eq!(s["steps"], STEPS);
    assert_eq!(s["errors"], 2);
    let phase = |name: &str| {
        s["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("phase {name} missing"))
            .clone()
    };
    let fwd = phase("forward");
    assert_eq!(fwd["count"], 2 * 2 * STEPS);
    assert!(fwd["p50_ns"].as_i64().unwrap() >= (FORWARD_MS * 1_000_000) as i64);
    assert!(fwd["p50_ns"].as_i64().unwrap() < (FORWARD_MS * 1_000_000 * 3) as i64);
    assert_eq!(phase("step")["count"], 2 * STEPS);
    // A step's time is every top-level span of its main thread: the `step` spans, plus the
    // microseconds of `teardown`, recorded in the last step after its `step` span ended.
    let step_share = phase("step")["share_of_step"].as_f64().unwrap();
    assert!(step_share < 1.0 && step_share > 0.999, "{step_share}");
    assert!(phase("tokenizer")["share_of_step"].is_null());
    assert_eq!(phase("prefetch")["count"], 6);
    let bwd_straggler = s["stragglers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["phase"] == "backward")
        .expect("rank 1's slow backward is a straggler");
    assert_eq!(bwd_straggler["rank"], 1);
    assert_eq!(bwd_straggler["above_median_steps"], STEPS);
    let excess = bwd_straggler["median_excess_ns"].as_f64().unwrap();
    // 2 ranks: the median is the mean, so the excess is half of 2 x 8 ms per step.
    assert!(excess > 5e6 && excess < 16e6, "excess {excess}");
    let tagged: Vec<(u64, String)> = s["tagged_steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["step"].as_u64().unwrap(),
                t["tags"][0].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        tagged,
        vec![(3, "checkpoint".into()), (4, "validation".into())]
    );
    let ckpt = &s["tagged_steps"][0];
    assert!(ckpt["tagged_phase_ns"].as_i64().unwrap() >= 20_000_000);
    assert!(ckpt["extra_ns"].as_i64().unwrap() >= 15_000_000);

    // The table form names the same things.
    let o = titan_obs_core(&["summary", run_s, "--quiet"]);
    assert!(o.status.success());
    let text = stdout(&o);
    for needle in [
        "forward_backward",
        "p95",
        "% step",
        "stragglers",
        "backward",
        "checkpoint",
    ] {
        assert!(text.contains(needle), "summary lacks {needle}:\n{text}");
    }

    // metrics: torchtitan's console lines with the recorded reductions.
    let o = titan_obs_core(&["metrics", run_s, "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<String> = stdout(&o).lines().map(String::from).collect();
    assert_eq!(lines.len() as u64, STEPS + 1, "{lines:?}");
    // Step 1: loss mean of 9 and 10 = 9.5; grad_norm max of 1 and 2 = 2; tps sum 300.
    assert_eq!(
        lines[0],
        "step:  1  training/loss_mean: 9.5  training/grad_norm_max: 2  trainer_throughput/tps_sum: 300"
    );
    assert!(
        lines.contains(&"validate step:  4  validation/loss_mean: 5.5".to_string()),
        "{lines:?}"
    );
    let o = titan_obs_core(&["metrics", run_s, "--csv", "--quiet"]);
    let csv = stdout(&o);
    assert!(
        csv.starts_with(
            "kind,step,training/loss_mean,training/grad_norm_max,trainer_throughput/tps_sum"
        ),
        "{csv}"
    );
    assert!(csv.contains("\ntraining,6,4.5,12,300"), "{csv}");
    let o = titan_obs_core(&["metrics", run_s, "--json", "--quiet"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j[0]["values"]["training/loss_mean"], 9.5);

    // export: Chrome trace JSON with a process per rank, nested X events and instants.
    let trace = dir.path().join("trace.json");
    let o = titan_obs_core(&[
        "export",
        run_s,
        "--chrome",
        trace.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let procs: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["name"] == "process_name")
        .collect();
    assert_eq!(procs.len(), 2);
    assert!(
        procs[1]["args"]["name"]
            .as_str()
            .unwrap()
            .starts_with("rank 1 (")
    );
    assert!(
        events
            .iter()
            .any(|e| e["name"] == "thread_name" && e["args"]["name"] == "dataloader")
    );
    let xs: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let spans_total: u64 = s["spans"].as_u64().unwrap();
    assert_eq!(xs.len() as u64, spans_total);
    // Nesting: every forward lies inside a microbatch of the same pid/tid.
    for f in xs.iter().filter(|e| e["name"] == "forward") {
        let (ts, dur) = (f["ts"].as_f64().unwrap(), f["dur"].as_f64().unwrap());
        assert!(dur >= (FORWARD_MS * 1000) as f64);
        assert!(xs.iter().any(|m| m["name"] == "microbatch"
            && m["pid"] == f["pid"]
            && m["tid"] == f["tid"]
            && m["ts"].as_f64().unwrap() <= ts
            && m["ts"].as_f64().unwrap() + m["dur"].as_f64().unwrap() >= ts + dur));
    }
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "i" && e["name"] == "checkpoint" && e["cat"] == "step_tag")
    );
    assert!(events.iter().any(|e| e["ph"] == "i"
        && e["cat"] == "error"
        && e["args"]["message"] == "all_reduce timed out on rank 1"));
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "C" && e["name"] == "training/loss")
    );
}

#[test]
fn kill_9_loses_at_most_one_flush_interval() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let flush_ms = 400u64;
    let mut kid = child(&run, "rate", 0, 1, flush_ms).spawn().unwrap();
    // Let it record for several intervals, then kill -9 (SIGKILL on unix).
    std::thread::sleep(Duration::from_millis(2500));
    let killed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64;
    kid.kill().unwrap();
    let status = kid.wait().unwrap();
    assert!(!status.success());

    let loaded = titan_obs_core::load(run.to_str().unwrap(), &Default::default()).unwrap();
    assert!(
        loaded.report.corrupt_parts.is_empty(),
        "{:?}",
        loaded.report.corrupt_parts
    );
    // What survives is the rank's open journal (compacted by the next process of the rank).
    assert!(run.join("obs/rank-0/journal-000000.arrows").exists());
    assert_eq!(loaded.report.parts_read, 1);
    let ticks = &loaded.instants;
    let last = *ticks.start_ns.iter().max().expect("some ticks survived");
    let first = *ticks.start_ns.iter().min().unwrap();
    let lost_ms = (killed_at - last) as f64 / 1e6;
    // One flush interval plus the writer's drain tick and scheduling slack on a loaded box.
    assert!(
        lost_ms <= flush_ms as f64 + 250.0,
        "lost the last {lost_ms:.0} ms (> one {flush_ms} ms interval)"
    );
    // Nothing before the loss window is missing: ~1 tick per ms.
    let span_ms = (last - first) as f64 / 1e6;
    assert!(
        ticks.rank.len() as f64 >= span_ms * 0.9,
        "{} ticks over {span_ms:.0} ms",
        ticks.rank.len()
    );
}

#[test]
fn corrupt_parts_and_missing_ranks_are_reported_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let cfg = titan_obs_core::synth::SynthConfig {
        ranks: 4,
        steps: 20,
        spans_per_step: 12,
        steps_per_part: 5,
        ..Default::default()
    };
    titan_obs_core::synth::write_run(run.to_str().unwrap(), &cfg).unwrap();
    // Truncate one part of rank 1, and remove rank 3 entirely.
    let bad = run.join("obs/rank-1/part-000002.parquet");
    let bytes = std::fs::read(&bad).unwrap();
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::remove_dir_all(run.join("obs/rank-3")).unwrap();

    let run_s = run.to_str().unwrap();
    let o = titan_obs_core(&["summary", run_s, "--json", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(&format!("corrupt part {}", bad.display())),
        "{err}"
    );
    // rank 3 is missing, but only known from world size in the footers.
    assert!(err.contains("rank 3 of 4 is missing"), "{err}");
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["ranks"], 3);
    assert_eq!(s["missing_ranks"], serde_json::json!([3]));
    assert_eq!(s["corrupt_parts"][0][0], bad.display().to_string());
    // The rest is analysed: ranks 0 and 2 have all 20 steps, rank 1 lost 5 steps.
    let step = s["phases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "step")
        .unwrap();
    assert_eq!(step["count"], 20 + 15 + 20);

    let o = titan_obs_core(&["metrics", run_s, "--strict", "--quiet"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("step:  1  training/loss_mean:"));

    // A directory that is not a run is a usage error with a hint, exit 2.
    let o = titan_obs_core(&["summary", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    // The hint names every layout titan-obs reads.
    for hint in [
        "is not a run titan-obs can read",
        "obs/rank-<R>",
        "structured_logs/",
    ] {
        assert!(stderr(&o).contains(hint), "{}", stderr(&o));
    }
    // Usage errors exit 2.
    let o = titan_obs_core(&["export", run_s]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn records_to_and_reads_from_s3() {
    let moto = MotoServer::start("obs-test");
    let url = "s3://obs-test/runs/r1";
    // The writers' spool (journals, the node's files): this test's own.
    let tmp = tempfile::tempdir().unwrap();
    let mut kids: Vec<_> = (0..2)
        .map(|r| {
            let mut c = child(Path::new(url), "train", r, 2, 20);
            c.env("OBS_CHILD_ROTATE_MS", "60").env("TMPDIR", tmp.path());
            moto.aws_env(&mut c).spawn().unwrap()
        })
        .collect();
    for k in &mut kids {
        assert!(k.wait().unwrap().success());
    }
    // A titan-obs command on the run: its stdout, and the requests it made, by method.
    let run = |args: &[&str]| {
        let before = moto.requests();
        let o = moto
            .aws_env(Command::new(bin("titan-obs")).args(args))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let made: BTreeMap<String, usize> = (moto.requests().into_iter())
            .map(|(m, n)| (m.clone(), n - before.get(&m).copied().unwrap_or(0)))
            .filter(|(_, n)| *n > 0)
            .collect();
        (stdout(&o), made)
    };
    let metrics = || run(&["metrics", url, "--quiet", "--strict"]);
    let summary = || {
        let (out, made) = run(&["summary", url, "--json", "--quiet", "--strict"]);
        let s: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(s["ranks"], 2);
        assert_eq!(s["steps"], STEPS);
        (s, made)
    };
    // Issue 42: what `summary` costs on S3. Each rank's writer keeps its rank summary beside
    // its parts: one LIST page and one GET a rank, not one a part; before them, what the
    // location holds is told by a HEAD (one object?) and a LIST of its top level. `summary`
    // lists `obs/`'s top level once more first (`--node-figures auto`: are there 1024 rank
    // folders?).
    let listing = moto.s3(&["ls", "runs/r1/obs"]);
    let parts = listing.lines().filter(|l| l.ends_with(".parquet")).count();
    assert_eq!(
        listing
            .lines()
            .filter(|l| l.ends_with("/rank.summary"))
            .count(),
        2,
        "{listing}"
    );
    assert!(parts > 2, "{listing}");
    let opened = |gets: usize| BTreeMap::from([("GET".to_string(), 1 + gets), ("HEAD".into(), 1)]);
    let (with_rank_summaries, made) = summary();
    assert_eq!(made, opened(1 + 1 + 2));
    // `metrics` reads the same summaries.
    let (lines, made) = metrics();
    assert!(lines.starts_with(
        "step:  1  training/loss_mean: 9.5  training/grad_norm_max: 2  trainer_throughput/tps_sum: 300"
    ));
    assert_eq!(made, opened(1 + 2));
    // The node's figures and timeline, published by its ranks' writers beside the rank
    // folders (both ranks run on this host: one node). `summary --node-figures on` reads them:
    // a LIST of `obs/`'s top level, a GET a node, a HEAD a rank (is there a part after the
    // last one its figures cover?), no rank folder listed and no rank summary read.
    let node_files: Vec<&str> = (listing.lines())
        .filter(|l| l.starts_with("node-"))
        .collect();
    assert_eq!(node_files.len(), 2, "{listing}");
    assert!(node_files[0].ends_with(".figures") && node_files[1].ends_with(".timeline"));
    // The TUI on the run in the bucket, in a terminal: its gantt of both ranks (drawn from the
    // node's timeline), a selected span's figures over the ranks, and a clean exit.
    let vars: Vec<String> = (moto.aws_vars().iter())
        .map(|(k, v)| format!("{k}={}", shell_quote(v)))
        .collect();
    let cmd = format!(
        "{} TERM=xterm-256color {} {url}",
        vars.join(" "),
        shell_quote(bin("titan-obs"))
    );
    let tui = Tmux::start(&cmd, 160, 40);
    let screen = tui.wait_for("the gantt of both ranks", |s| {
        s.contains("r0") && s.contains("r1") && s.contains("forward_backward")
    });
    assert!(screen.contains("2 ranks"), "{screen}");
    tui.keys(&["g", "2", "Enter", "Down", "Tab"]);
    let screen = tui.wait_for("a selection", |s| s.contains("selected: "));
    assert!(screen.contains("step 2"), "{screen}");
    assert!(screen.contains("on 2 ranks: min"), "{screen}");
    tui.keys(&["q"]);
    let (status, screen) = tui.wait_for_exit();
    assert_eq!(status, 0, "{screen}");
    drop(tui);
    let from_figures = |gets: usize, heads: usize| {
        let (out, made) = run(&["summary", url, "--json", "--quiet", "--node-figures", "on"]);
        assert_eq!(
            made,
            BTreeMap::from([("GET".to_string(), gets), ("HEAD".into(), heads)])
        );
        let s: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            (s["ranks"].clone(), s["steps"].clone()),
            (2.into(), STEPS.into())
        );
        s
    };
    let mut fig = from_figures(2, 2);
    assert_eq!(fig["node_figures"]["nodes"], 1, "{}", fig["node_figures"]);
    assert_eq!(fig["node_figures"]["ranks_from_folders"], 0);
    // The same figures as the run copied to a local folder gives: there they are
    // recomputed from its rank folders (copied, the folders have other mtimes).
    let copy = tempfile::tempdir().unwrap();
    moto.s3(&["get", "runs/r1", copy.path().to_str().unwrap()]);
    let local = titan_obs_core(&[
        "summary",
        copy.path().to_str().unwrap(),
        "--json",
        "--quiet",
        "--node-figures",
        "on",
    ]);
    assert!(local.status.success(), "{}", stderr(&local));
    let mut local: serde_json::Value = serde_json::from_str(&stdout(&local)).unwrap();
    assert_eq!(local["node_figures"]["ranks_from_folders"], 2);
    for s in [&mut fig, &mut local] {
        s.as_object_mut().unwrap().remove("run");
        s.as_object_mut().unwrap().remove("node_figures");
    }
    assert_eq!(fig, local);
    // Figures that end before a rank's last part (a writer killed before it published):
    // the node's ranks are read from their folders, each listed and its rank summary read
    // (which covers exactly its parts); the same figures.
    let figures_file = copy.path().join("obs").join(node_files[0]);
    let mut f =
        titan_obs_core::digest::figures::decode(&std::fs::read(&figures_file).unwrap()).unwrap();
    let r1 = f.ranks.iter_mut().find(|r| r.rank == 1).unwrap();
    r1.last_part = r1.last_part.unwrap().checked_sub(1);
    let older = tempfile::tempdir().unwrap();
    std::fs::write(
        older.path().join(node_files[0]),
        titan_obs_core::digest::figures::encode(&f),
    )
    .unwrap();
    moto.s3(&["put", older.path().to_str().unwrap(), "runs/r1/obs"]);
    let mut recomputed = from_figures(2 + 2 * 2, 2);
    assert_eq!(recomputed["node_figures"]["nodes"], 0);
    assert_eq!(recomputed["node_figures"]["ranks_from_folders"], 2);
    let shown = recomputed.as_object_mut().unwrap();
    shown.remove("run");
    shown.remove("node_figures");
    assert_eq!(recomputed, fig);
    // A part the rank summary does not cover (a writer killed between the two): the run is
    // read as without figures.
    let last = (listing.lines())
        .filter_map(|l| l.strip_prefix("rank-1/part-"))
        .filter_map(|l| l.strip_suffix(".parquet")?.parse::<u64>().ok())
        .max()
        .unwrap();
    let extra = tempfile::tempdir().unwrap();
    std::fs::copy(
        copy.path().join("obs/rank-1/part-000000.parquet"),
        extra.path().join(format!("part-{:06}.parquet", last + 1)),
    )
    .unwrap();
    moto.s3(&["put", extra.path().to_str().unwrap(), "runs/r1/obs/rank-1"]);
    let (out, _) = run(&["summary", url, "--json", "--quiet", "--node-figures", "on"]);
    let s: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(s["node_figures"].is_null(), "{}", s["node_figures"]);
    moto.s3(&[
        "rm",
        &format!("runs/r1/obs/rank-1/part-{:06}.parquet", last + 1),
    ]);

    // Without them (a run written before): one ranged GET a part, the same answers.
    moto.s3(&["rm", "runs/r1/obs/rank-0/rank.summary"]);
    moto.s3(&["rm", "runs/r1/obs/rank-1/rank.summary"]);
    let (without, made) = summary();
    assert_eq!(made, opened(1 + 1 + parts));
    assert_eq!(with_rank_summaries, without);
    let (lines_without, made) = metrics();
    assert_eq!(made, opened(1 + parts));
    assert_eq!(lines_without, lines);
}
