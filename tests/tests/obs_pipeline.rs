//! A pipeline's bubbles from its own timing records: two real titan-train ranks (PP=2, 1F1B,
//! 8 microbatches), once with the stages balanced and once with the first stage made light
//! (`pipeline_parallel_first_stage_less_layers`), so the second is the slow one. `titan-obs
//! summary --json` must show every pass tagged with its microbatch and stage, name the slow
//! stage, and measure the light stage's bubble growing as a two-stage pipeline predicts: with
//! per-microbatch pass costs c0 < c1 the pipeline takes about m*c1 + c0, of which the light
//! stage computes m*c0.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use titan_tests::{Tmux, bin, output_text as text, run_ok, shell_quote};

const MICROBATCHES: f64 = 8.0;

fn train_pp2(run: &Path, extra: &[&str]) -> Value {
    let mut c = titan_tests::titan_train();
    c.args([
        "--nproc-per-node",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--job.dump_folder",
        run.to_str().unwrap(),
        "--training.steps",
        "4",
        "--training.local_batch_size",
        "8",
        "--training.seq_len",
        "128",
        "--validation.enable=false",
        "--comm.train_timeout_seconds",
        "120",
    ])
    .args(extra);
    run_ok(&mut c);
    let out =
        run_ok(Command::new(bin("titan-obs")).args(["summary", run.to_str().unwrap(), "--json"]));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Per-microbatch pass cost (forward + backward) of a per-stage row.
fn cost(stage: &Value) -> f64 {
    f(&stage["forward_ns"]) + f(&stage["backward_ns"])
}

#[test]
fn summary_names_the_slow_stage_and_its_neighbours_bubble_grows_as_predicted() {
    let dir = tempfile::tempdir().unwrap();
    let balanced = train_pp2(&dir.path().join("balanced"), &[]);
    let p = &balanced["pipeline"];
    assert!(p.is_object(), "no pipeline section: {balanced:#}");
    assert_eq!(p["stages"], 2, "{p:#}");
    assert_eq!(p["pipeline_ranks"], 2, "{p:#}");
    assert_eq!(p["stages_per_rank"], 1, "{p:#}");
    assert_eq!(p["microbatches"], 8, "{p:#}");
    assert!((f(&p["ideal_bubble"]) - 1.0 / 9.0).abs() < 1e-12, "{p:#}");
    let rows = p["per_stage"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{p:#}");
    for (s, row) in rows.iter().enumerate() {
        assert_eq!(row["stages"], serde_json::json!([s]), "{p:#}");
        assert_eq!(row["ranks"], serde_json::json!([s]), "{p:#}");
        // Four steps of 8 forwards and 8 backwards, each in its own tagged span.
        assert_eq!(row["rank_steps"], 4, "{p:#}");
        let bubble = f(&row["bubble"]);
        assert!((0.0..0.5).contains(&bubble), "stage {s}: {p:#}");
    }
    let balanced_light = f(&rows[0]["bubble"]);
    assert_pipeline_bytes(&dir.path().join("balanced"));

    let slowed = train_pp2(
        &dir.path().join("slowed"),
        &[
            "--parallelism.pipeline_parallel_first_stage_less_layers",
            "5",
            "--parallelism.pipeline_parallel_last_stage_less_layers",
            "0",
        ],
    );
    let p = &slowed["pipeline"];
    let rows = p["per_stage"].as_array().unwrap();
    let slowest = p["slowest"].as_u64().unwrap() as usize;
    assert_eq!(rows[slowest]["stages"], serde_json::json!([1]), "{p:#}");
    let (c0, c1) = (cost(&rows[0]), cost(&rows[1]));
    assert!(c1 > 2.0 * c0, "stage 1 holds 5 of 6 layers: {p:#}");
    let light = f(&rows[0]["bubble"]);
    let predicted = 1.0 - MICROBATCHES * c0 / (MICROBATCHES * c1 + c0);
    assert!(
        light > balanced_light + 0.25,
        "the light stage waits on the slow one: {balanced_light:.3} -> {light:.3}\n{p:#}"
    );
    assert!(
        (light - predicted).abs() < 0.12,
        "light stage bubble {light:.3}, predicted {predicted:.3}\n{p:#}"
    );
    assert!(
        f(&rows[1]["bubble"]) < light,
        "the slow stage idles least: {p:#}"
    );

    // The table says the same.
    let out = run_ok(
        Command::new(bin("titan-obs"))
            .args(["summary", dir.path().join("slowed").to_str().unwrap()]),
    );
    let table = text(&out);
    assert!(table.contains("slowest stage: 1 (ranks [1])"), "{table}");
    assert!(table.contains("ideal bubble 11.1%"), "{table}");

    // Every pass's span says which microbatch and stage it ran (Perfetto export args).
    let trace = dir.path().join("slowed.json");
    run_ok(Command::new(bin("titan-obs")).args([
        "export",
        dir.path().join("slowed").to_str().unwrap(),
        "--chrome",
        trace.to_str().unwrap(),
    ]));
    let trace: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let mut forwards: Vec<(u64, u64, u64)> = events
        .iter()
        .filter(|e| e["name"] == "forward" && e["args"]["step"] == 2)
        .map(|e| {
            let a = &e["args"];
            (
                e["pid"].as_u64().unwrap(),
                a["stage"].as_u64().unwrap(),
                a["microbatch"].as_u64().unwrap(),
            )
        })
        .collect();
    forwards.sort_unstable();
    let expected: Vec<(u64, u64, u64)> = (0..2)
        .flat_map(|s| (0..8).map(move |m| (s, s, m)))
        .collect();
    assert_eq!(forwards, expected);

    // The TUI, zoomed in on the start of a step: each pass's bar says
    // `<stage><pass><microbatch>`.
    let labels = ["0F0", "0F1", "1F0", "1B0"];
    let screen = tui_screen_at_step(&dir.path().join("balanced"), 3, &labels);
    for label in labels {
        assert!(screen.contains(label), "{label} missing:\n{screen}");
    }
}

/// The bytes the pipeline's point-to-point batches send (`comm/batch_isend_irecv_bytes`, summed
/// over both ranks per step) against the count from the shapes: each step, stage 0 sends every
/// microbatch's activations forward and stage 1 every microbatch's input gradient back, each
/// (local batch / microbatches) x seq x dim values (debug model: dim 256) in bf16, the default
/// `mixed_precision_param` the stages compute in (torchtitan 0.3.0's FSDP2 policy on every layout).
fn assert_pipeline_bytes(run: &Path) {
    let out = run_ok(
        Command::new(bin("titan-obs"))
            .args(["metrics", "--json"])
            .arg(run),
    );
    let steps: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let per_transfer = (8.0 / MICROBATCHES) * 128.0 * 256.0 * 2.0;
    let expected = 2.0 * MICROBATCHES * per_transfer;
    let training: Vec<&Value> = steps.iter().filter(|s| s["validation"] == false).collect();
    assert_eq!(training.len(), 4, "{steps:#?}");
    for s in training {
        let sent = f(&s["values"]["comm/batch_isend_irecv_bytes_sum"]);
        assert_eq!(sent, expected, "step {}: {s:#}", s["step"]);
    }
}

/// The TUI's screen (200 x 30, in a private tmux server) after jumping to `step` and zooming
/// in twice on its start, once it shows every one of `labels` (else after 30 s).
fn tui_screen_at_step(run: &Path, step: u64, labels: &[&str]) -> String {
    let cmd = format!(
        "TERM=xterm-256color {} {}",
        shell_quote(bin("titan-obs")),
        shell_quote(run)
    );
    let tmux = Tmux::start(&cmd, 200, 30);
    tmux.wait_for("gantt", |s| s.contains("forward_backward"));
    tmux.keys(&["g", &step.to_string(), "Enter", "+", "+"]);
    tmux.wait_for("the zoomed step's labels", |s| {
        s.contains(&format!("step {step}")) && labels.iter().all(|l| s.contains(l))
    })
}

/// torchtitan's PP is torch.distributed.pipelining: with its profiler on, the schedule runtime
/// names every action `PP:<stage><type><microbatch>` in the traces, and `summary` reads the
/// pipeline from them — a real 2-rank run of each looped schedule (4 stages, 8 microbatches), the
/// zero-bubble one with its split backward (`I` and `W` actions).
#[test]
fn summary_reads_the_pipeline_of_torch_pipelining_profiler_traces() {
    for schedule in ["Interleaved1F1B", "InterleavedZeroBubble"] {
        let dir = tempfile::tempdir().unwrap();
        let port = titan_tests::free_port().to_string();
        run_ok(
            Command::new(titan_tests::tt_python())
                .args(["-m", "torch.distributed.run", "--nproc-per-node", "2"])
                .args(["--master-port", &port])
                .arg(titan_tests::workspace_root().join("tests/python/torch_pp_trace.py"))
                .args([schedule, dir.path().to_str().unwrap()]),
        );
        let out = run_ok(Command::new(bin("titan-obs")).args([
            "summary",
            dir.path().to_str().unwrap(),
            "--json",
        ]));
        let s: Value = serde_json::from_slice(&out.stdout).unwrap();
        let p = &s["pipeline"];
        assert_eq!(p["stages"], 4, "{schedule}: {p:#}");
        assert_eq!(p["stages_per_rank"], 2, "{schedule}: {p:#}");
        assert_eq!(p["pipeline_ranks"], 2, "{schedule}: {p:#}");
        assert_eq!(p["microbatches"], 8, "{schedule}: {p:#}");
        // The zero-bubble schedule's weight passes fill the bubble (p-1)/(v*m+p-1) counts.
        if schedule == "InterleavedZeroBubble" {
            assert!(p["ideal_bubble"].is_null(), "{p:#}");
            assert_eq!(p["split_backward"], true, "{p:#}");
        } else {
            assert!((f(&p["ideal_bubble"]) - 1.0 / 17.0).abs() < 1e-12, "{p:#}");
        }
        let rows = p["per_stage"].as_array().unwrap();
        for (r, row) in rows.iter().enumerate() {
            assert_eq!(
                row["stages"],
                serde_json::json!([r, r + 2]),
                "{schedule}: {p:#}"
            );
            // The profiler kept 2 steps.
            assert_eq!(row["rank_steps"], 2, "{schedule}: {p:#}");
            assert!(
                f(&row["forward_ns"]) > 0.0 && f(&row["backward_ns"]) > 0.0,
                "{p:#}"
            );
            assert!((0.0..1.0).contains(&f(&row["bubble"])), "{schedule}: {p:#}");
        }
    }
}
