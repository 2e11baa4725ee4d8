//! titan-obs on torchtitan 0.3.0's own files: structured-logger JSONL written by the real
//! logger on 3 processes (`tests/python/tt_obs_make_run.py`: a known straggler, checkpoint
//! and eval tags, scalars, an exception inside a span), torchtitan's `generate_gantt_trace`
//! output and a CPU torch.profiler trace (`tests/python/tt_obs_traces.py`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;
use titan_tests::{bin, output_text, run_ok, tt_python_script};

const RANKS: u32 = 3;
const STEPS: u64 = 6;
const STRAGGLER: u64 = 1;

/// The fixture run (made once per test binary) and the script's independent pairing.
fn fixture() -> &'static (PathBuf, Value) {
    static F: OnceLock<(PathBuf, Value)> = OnceLock::new();
    F.get_or_init(|| {
        let dir = titan_tests::binary_subdir("run");
        let run = dir.join("run");
        let expected = dir.join("expected.json");
        run_ok(
            tt_python_script("tests/python/tt_obs_make_run.py")
                .arg(&run)
                .args(["--ranks", &RANKS.to_string(), "--steps", &STEPS.to_string()])
                .args(["--straggler-rank", &STRAGGLER.to_string()])
                .arg("--expected")
                .arg(&expected),
        );
        let e: Value = serde_json::from_str(&std::fs::read_to_string(&expected).unwrap()).unwrap();
        (run, e)
    })
}

fn obs(args: &[&str], run: &Path) -> Command {
    let mut c = Command::new(bin("titan-obs"));
    c.args(args).arg(run);
    c
}

fn summary_json(run: &Path) -> Value {
    let o = run_ok(&mut obs(&["summary", "--json", "--quiet"], run));
    serde_json::from_slice(&o.stdout).expect("summary --json is JSON")
}

fn phase<'a>(s: &'a Value, name: &str) -> &'a Value {
    s["phases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("phase {name} missing from {s:#}"))
}

/// Counts and totals per phase equal the independent pairing, totals within `tol_ns` per
/// span (1 ns for the JSONL: both round the logged float milliseconds).
fn assert_phases_match(s: &Value, expected: &Value, tol_ns: i64) {
    for (name, e) in expected["phases"].as_object().unwrap() {
        let p = phase(s, name);
        assert_eq!(p["count"], e["count"], "count of {name}");
        let (got, want) = (
            p["total_ns"].as_i64().unwrap(),
            e["total_ns"].as_i64().unwrap(),
        );
        assert!(
            (got - want).abs() <= tol_ns * e["count"].as_i64().unwrap(),
            "total of {name}: {got} vs {want}"
        );
    }
}

fn has_straggler(s: &Value, rank: u64, phase: &str) -> bool {
    s["stragglers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["rank"] == rank && x["phase"] == phase)
}

#[test]
fn summary_of_a_torchtitan_run_matches_an_independent_pairing() {
    let (run, expected) = fixture();
    let s = summary_json(run);
    assert_eq!(s["format"], "torchtitan");
    assert_eq!(s["ranks"], RANKS);
    assert_eq!(s["steps"], STEPS);
    assert_phases_match(&s, expected, 1);
    // torchtitan's phase names, nested under its `step`.
    assert_eq!(phase(&s, "step")["depth"], 0);
    assert_eq!(phase(&s, "fwd_bwd")["depth"], 1);
    assert!(has_straggler(&s, STRAGGLER, "fwd_bwd"), "{s:#}");
    // The checkpoint_save that raised is one error record.
    assert_eq!(s["errors"], 1);
    let tagged: Vec<(u64, Vec<String>)> = s["tagged_steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["step"].as_u64().unwrap(),
                serde_json::from_value(t["tags"].clone()).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        tagged,
        vec![
            (3, vec!["checkpoint_save".to_string()]),
            (6, vec!["checkpoint_save".to_string(), "eval".to_string()])
        ]
    );
    for t in s["tagged_steps"].as_array().unwrap() {
        assert!(t["tagged_phase_ns"].as_i64().unwrap() >= 4_000_000, "{t}");
    }
    assert_eq!(s["malformed_lines"], 0);
    assert!(s["open_spans"].as_array().unwrap().is_empty());
    // One host: nothing to align.
    assert!(s["clock_alignment"].is_null());

    let text = output_text(&run_ok(&mut obs(&["summary", "--quiet"], run)));
    assert!(text.contains("torchtitan structured logs"), "{text}");
    assert!(text.contains("fwd_bwd"), "{text}");
}

#[test]
fn metrics_come_from_metric_value_records() {
    let (run, _) = fixture();
    let o = run_ok(&mut obs(&["metrics", "--json", "--quiet"], run));
    let lines: Value = serde_json::from_slice(&o.stdout).unwrap();
    let lines = lines.as_array().unwrap();
    assert_eq!(lines.len() as u64, STEPS);
    // loss = 10 / step + rank on ranks 0..3 -> mean 10 / step + 1.
    for l in lines {
        let step = l["step"].as_f64().unwrap();
        let v = &l["values"];
        assert!((v["loss_mean"].as_f64().unwrap() - (10.0 / step + 1.0)).abs() < 1e-9);
        assert_eq!(v["local_valid_tokens_mean"], 2049.0);
        assert_eq!(v["global_valid_tokens_mean"], 2048.0 * RANKS as f64);
    }
}

/// A copy of the fixture's structured_logs with one malformed line added to rank 0's file
/// (as line 5) and rank 2's file cut in the middle of its last line.
fn damaged_copy() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let (run, _) = fixture();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("structured_logs");
    std::fs::create_dir_all(&logs).unwrap();
    let mut bad = PathBuf::new();
    let mut cut = PathBuf::new();
    for e in std::fs::read_dir(run.join("structured_logs")).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        let text = std::fs::read_to_string(e.path()).unwrap();
        let dst = logs.join(&name);
        let text = if name.contains("global_rank_0.") {
            bad = dst.clone();
            let mut lines: Vec<&str> = text.lines().collect();
            lines.insert(4, "{\"log_type\": \"event\", \"log_type_name\": oops}");
            lines.join("\n") + "\n"
        } else if name.contains("global_rank_2.") {
            cut = dst.clone();
            let trimmed = text.trim_end_matches('\n');
            let last = trimmed.rfind('\n').unwrap();
            trimmed[..last + 40].to_string()
        } else {
            text
        };
        std::fs::write(&dst, text).unwrap();
    }
    (dir, bad, cut)
}

#[test]
fn malformed_lines_are_named_and_a_cut_last_line_is_not_an_error() {
    let (dir, bad, cut) = damaged_copy();
    let s = summary_json(dir.path());
    assert_eq!(s["malformed_lines"], 1);
    assert_eq!(s["bad_lines"][0]["file"], bad.display().to_string());
    assert_eq!(s["bad_lines"][0]["line"], 5);
    assert_eq!(s["truncated_tails"][0], cut.display().to_string());
    // Rank 2's last line was its `step_end` of the last step: that step is open, drawn to the
    // process's last record.
    let open = s["open_spans"].as_array().unwrap();
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(open[0]["rank"], 2);
    assert_eq!(open[0]["name"], "step");
    assert_eq!(open[0]["step"], STEPS);
    // The rest is analysed as usual.
    assert_eq!(phase(&s, "fwd_bwd")["count"], RANKS as u64 * STEPS);
    assert_eq!(phase(&s, "step")["count"], RANKS as u64 * STEPS);

    let o = obs(&["summary", "--quiet"], dir.path()).output().unwrap();
    assert_eq!(o.status.code(), Some(0));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("malformed line {}:5", bad.display())),
        "{err}"
    );
    // --strict: printed, but exit 3 because a line was malformed.
    let o = obs(&["summary", "--quiet", "--strict"], dir.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3));
}

#[test]
fn follow_reader_reads_only_appended_bytes() {
    use titan_obs_core::ingest::Follower;
    use titan_obs_core::read::ReadOptions;
    let (run, _) = fixture();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("structured_logs");
    std::fs::create_dir_all(&logs).unwrap();
    let src: Vec<PathBuf> = {
        let mut v: Vec<PathBuf> = std::fs::read_dir(run.join("structured_logs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    };
    // Start with the first half of rank 0's lines (the last one cut short) and nothing else.
    let text0 = std::fs::read_to_string(&src[0]).unwrap();
    let half = text0.len() / 2;
    let dst0 = logs.join(src[0].file_name().unwrap());
    std::fs::write(&dst0, &text0[..half]).unwrap();
    let complete_half = text0[..half].rfind('\n').unwrap() + 1;

    let opts = ReadOptions::default();
    let mut f = Follower::open(dir.path().to_str().unwrap()).unwrap();
    assert!(f.is_incremental());
    let (r1, s1) = f.refresh(&opts, false).unwrap();
    assert_eq!(s1.bytes, complete_half as u64, "the cut line waits");
    assert_eq!(s1.new_files, 1);
    // An unfinished span is shown open in the snapshot.
    assert!(!r1.report.open_spans.is_empty());

    // Nothing new: nothing read.
    let (_, s2) = f.refresh(&opts, false).unwrap();
    assert_eq!((s2.bytes, s2.new_files), (0, 0));

    // The rest of rank 0 and the other ranks' files arrive.
    std::fs::OpenOptions::new()
        .append(true)
        .open(&dst0)
        .and_then(|mut w| std::io::Write::write_all(&mut w, &text0.as_bytes()[half..]))
        .unwrap();
    let mut others = 0u64;
    for p in &src[1..] {
        let t = std::fs::read(p).unwrap();
        others += t.len() as u64;
        std::fs::write(logs.join(p.file_name().unwrap()), t).unwrap();
    }
    let (r3, s3) = f.refresh(&opts, false).unwrap();
    assert_eq!(s3.bytes, (text0.len() - complete_half) as u64 + others);
    assert_eq!(s3.new_files, src.len() - 1);
    assert!(r3.report.open_spans.is_empty());
    // Same analysis as reading everything at once.
    let once = titan_obs_core::load(dir.path().to_str().unwrap(), &opts).unwrap();
    let a = titan_obs_core::analysis::summary(&r3, &Default::default());
    let b = titan_obs_core::analysis::summary(&once, &Default::default());
    assert_eq!(
        serde_json::to_value(&a.phases).unwrap(),
        serde_json::to_value(&b.phases).unwrap()
    );
}

#[test]
fn hosts_without_a_shared_clock_are_aligned_on_step_starts() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    run_ok(
        tt_python_script("tests/python/tt_obs_make_run.py")
            .arg(&run)
            .args(["--ranks", "2", "--steps", "4", "--skew-ms", "250"]),
    );
    let s = summary_json(&run);
    let a = &s["clock_alignment"];
    assert_eq!(a["reference_host"], host_of_rank0(&run));
    let node1 = a["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["host"] == "node1")
        .expect("node1 aligned");
    let off = node1["offset_ns"].as_i64().unwrap();
    // The logger wrote node1's times 250 ms ahead; step starts agree to a few ms.
    assert!((off + 250_000_000).abs() < 10_000_000, "offset {off}");
    assert_eq!(node1["ranks"], serde_json::json!([1]));
    assert_eq!(node1["steps_used"], 4);
    let text = output_text(&run_ok(&mut obs(&["summary", "--quiet"], &run)));
    assert!(text.contains("hosts aligned to"), "{text}");
    // --no-clock-align keeps the recorded clocks.
    let o = run_ok(&mut obs(
        &["summary", "--json", "--quiet", "--no-clock-align"],
        &run,
    ));
    let raw: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(raw["clock_alignment"].is_null());
}

fn host_of_rank0(run: &Path) -> String {
    let f = std::fs::read_dir(run.join("structured_logs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("global_rank_0."))
        .unwrap();
    let first = std::fs::read_to_string(f).unwrap();
    let v: Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    v["host_name"].as_str().unwrap().to_string()
}

#[test]
fn torchtitan_gantt_trace_opens_with_the_same_phases() {
    let (run, expected) = fixture();
    let dir = tempfile::tempdir().unwrap();
    let gantt = dir.path().join("gantt.json");
    run_ok(
        tt_python_script("tests/python/tt_obs_traces.py")
            .arg("gantt")
            .arg(run.join("structured_logs"))
            .arg(&gantt),
    );
    let s = summary_json(&gantt);
    assert_eq!(s["format"], "chrome_trace");
    assert_eq!(s["ranks"], RANKS);
    assert_eq!(s["steps"], STEPS);
    // The gantt keeps every paired span: counts equal. Its `dur` is `end_ts - start_ts` with
    // start_ts ~1.8e15 us, so a float with 0.25 us steps: totals agree to 1 us per span.
    assert_phases_match(&s, expected, 1000);
    assert!(has_straggler(&s, STRAGGLER, "fwd_bwd"), "{s:#}");
    // `ERROR: checkpoint_save` instant.
    assert_eq!(s["errors"], 1);
    // Scalars come back from `name=value` instants.
    let o = run_ok(&mut obs(&["metrics", "--json", "--quiet"], &gantt));
    let lines: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!((lines[0]["values"]["loss_mean"].as_f64().unwrap() - 11.0).abs() < 1e-3);
}

#[test]
fn pytorch_profiler_trace_opens() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    run_ok(
        tt_python_script("tests/python/tt_obs_traces.py")
            .arg("profile")
            .arg(&trace),
    );
    let s = summary_json(&trace);
    assert_eq!(s["format"], "chrome_trace");
    assert_eq!(s["ranks"], 1);
    // schedule(wait=0, warmup=1, active=3): three recorded ProfilerStep#N spans.
    assert_eq!(s["steps"], 3);
    assert_eq!(phase(&s, "ProfilerStep")["count"], 3);
    assert_eq!(phase(&s, "ProfilerStep")["depth"], 0);
    assert_eq!(phase(&s, "fwd_bwd")["count"], 3);
    assert_eq!(phase(&s, "optim")["count"], 3);
    assert!(phase(&s, "aten::mm")["depth"].as_u64().unwrap() >= 2);
    // And it exports / draws.
    let out = dir.path().join("gantt.svg");
    run_ok(
        Command::new(bin("titan-obs"))
            .arg("gantt")
            .arg(&trace)
            .arg("--svg")
            .arg(&out),
    );
    assert!(std::fs::read_to_string(&out).unwrap().contains("aten::mm"));
}

#[test]
fn import_writes_titan_parts_with_the_same_analysis() {
    let (run, _) = fixture();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("imported");
    run_ok(
        Command::new(bin("titan-obs"))
            .args(["import", "--quiet"])
            .arg(run)
            .arg(&out),
    );
    for r in 0..RANKS {
        assert!(
            out.join(format!("obs/rank-{r}/part-000000.parquet"))
                .is_file()
        );
    }
    let a = summary_json(run);
    // The imported parts decoded record for record (a titan run's default summary reads the
    // parts' summaries, whose quantiles are within the sketch's 1%: tests/obs/summaries.rs).
    let o = run_ok(&mut obs(&["summary", "--json", "--quiet", "--exact"], &out));
    let b: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(b["format"], "titan");
    assert_eq!(a["phases"], b["phases"]);
    assert_eq!(a["stragglers"], b["stragglers"]);
    assert_eq!(a["tagged_steps"], b["tagged_steps"]);
    // The default summary agrees on everything but the quantiles' last digits.
    let c = summary_json(&out);
    assert_eq!(a["stragglers"], c["stragglers"]);
    assert_eq!(a["tagged_steps"], c["tagged_steps"]);
    for (x, y) in a["phases"]
        .as_array()
        .unwrap()
        .iter()
        .zip(c["phases"].as_array().unwrap())
    {
        assert_eq!(
            (&x["name"], &x["count"], &x["max_ns"]),
            (&y["name"], &y["count"], &y["max_ns"])
        );
        let (p, q) = (x["p50_ns"].as_f64().unwrap(), y["p50_ns"].as_f64().unwrap());
        assert!((p - q).abs() <= 0.01 * p, "{}: p50 {p} vs {q}", x["name"]);
    }
    // Importing onto existing parts is refused.
    let o = Command::new(bin("titan-obs"))
        .args(["import", "--quiet"])
        .arg(run)
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists"));
}

#[test]
fn export_and_gantt_work_on_a_torchtitan_run() {
    let (run, _) = fixture();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("trace.json");
    run_ok(obs(&["export", "--quiet", "--chrome"], &json).arg(run));
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let spans = t["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"] == "fwd_bwd")
        .count();
    assert_eq!(spans as u64, RANKS as u64 * STEPS);
    let png = dir.path().join("g.png");
    run_ok(
        Command::new(bin("titan-obs"))
            .arg("gantt")
            .arg(run)
            .arg("--png")
            .arg(&png),
    );
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
}

#[test]
fn torchtitan_run_on_s3_reads_like_the_local_one() {
    let (run, expected) = fixture();
    let moto = titan_tests::MotoServer::start("tt-obs");
    moto.s3(&[
        "put",
        run.join("structured_logs").to_str().unwrap(),
        "runs/tt/structured_logs",
    ]);
    let mut cmd = Command::new(bin("titan-obs"));
    moto.aws_env(&mut cmd)
        .args(["summary", "--json", "--quiet", "s3://tt-obs/runs/tt"]);
    let s: Value = serde_json::from_slice(&run_ok(&mut cmd).stdout).unwrap();
    assert_eq!(s["format"], "torchtitan");
    assert_eq!(s["ranks"], RANKS);
    assert_phases_match(&s, expected, 1);
    assert!(has_straggler(&s, STRAGGLER, "fwd_bwd"), "{s:#}");
}
