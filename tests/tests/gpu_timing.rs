//! titan-obs's GPU clock (trainer/src/gpu_clock.rs): on CUDA, forward, backward and the
//! optimizer are also timed with CUDA events, as `gpu:<phase>` twins on a lane of their own,
//! placed on the host's clock; on CPU there are none and every phase says it is on the host's
//! clock.
//!
//! The CUDA test runs where a GPU is (`TITAN_TEST_CUDA=1`, bench/trainer/cuda_checks.sh) and
//! says it skipped elsewhere. It holds the twins to what a device can do: a twin starts no
//! earlier than the host began queuing its phase (the GPU cannot run work not yet queued), and on
//! a step that logs, whose loss the host reads, the forward and backward twins end before the
//! host's step does.

use std::path::Path;

use serde_json::Value;
use titan_obs_core::NO_STEP;
use titan_obs_core::read::Run;
use titan_tests::{bin, run_ok, titan_train};

const STEPS: u64 = 8;
const LOG_FREQ: u64 = 4;

fn train(dump: &Path, device: &str) {
    // A GPU gets enough work per phase for its events to time; a CPU run only has to show that
    // there are no twins, so it gets the smallest batch (these shapes made it 200 s of CI).
    let (batch, seq_len) = if device == "cuda" {
        ("4", "512")
    } else {
        ("2", "64")
    };
    run_ok(titan_train().args([
        "--job.dump_folder",
        dump.to_str().unwrap(),
        "--training.device",
        device,
        "--training.steps",
        &STEPS.to_string(),
        "--metrics.log_freq",
        &LOG_FREQ.to_string(),
        "--training.local_batch_size",
        batch,
        "--training.seq_len",
        seq_len,
        "--validation.enable=false",
        "--observability.flush_interval_s",
        "0.2",
    ]));
}

fn summary_phases(dump: &Path) -> Vec<Value> {
    let o = run_ok(
        std::process::Command::new(bin("titan-obs"))
            .args(["summary", "--json"])
            .arg(dump),
    );
    let v: Value = serde_json::from_slice(&o.stdout).expect("summary --json prints JSON");
    v["phases"].as_array().expect("a phases array").clone()
}

/// Span indices named `name`, in start order.
fn spans_named(run: &Run, name: &str) -> Vec<usize> {
    let s = &run.spans;
    let mut v: Vec<usize> = (0..s.len())
        .filter(|&i| run.names[s.name[i] as usize] == name)
        .collect();
    v.sort_by_key(|&i| s.start_ns[i]);
    v
}

#[test]
fn cpu_runs_have_no_gpu_lane_and_say_their_clock() {
    let dir = tempfile::tempdir().unwrap();
    train(dir.path(), "cpu");
    let run = titan_obs_core::load(dir.path().to_str().unwrap(), &Default::default()).unwrap();
    assert!(!spans_named(&run, "forward").is_empty());
    assert!(
        run.names.iter().all(|n| !n.starts_with("gpu:")),
        "no GPU twins on CPU: {:?}",
        run.names
    );
    let phases = summary_phases(dir.path());
    for p in &phases {
        assert_eq!(p["clock"], "host", "{p}");
    }
}

#[test]
fn cuda_twins_are_placed_where_the_device_ran_them() {
    if !std::env::var("TITAN_TEST_CUDA").is_ok_and(|v| v == "1") {
        eprintln!("skipped: needs a GPU (TITAN_TEST_CUDA=1)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    train(dir.path(), "cuda");
    let run = titan_obs_core::load(dir.path().to_str().unwrap(), &Default::default()).unwrap();
    let s = &run.spans;
    let end = |i: usize| s.start_ns[i] + s.dur_ns[i];
    // The device's clock and the host's agree to the anchor's few microseconds.
    const SLACK_NS: i64 = 200_000;
    for (host, twin) in [
        ("forward", "gpu:forward"),
        ("backward", "gpu:backward"),
        ("optimizer", "gpu:optimizer"),
    ] {
        let (h, g) = (spans_named(&run, host), spans_named(&run, twin));
        // The optimizer built before the first step has no twin (nothing runs on the GPU).
        let h: Vec<usize> = h.into_iter().filter(|&i| s.step[i] != NO_STEP).collect();
        let steps_of = |v: &[usize]| v.iter().map(|&i| s.step[i]).collect::<Vec<_>>();
        assert_eq!(
            steps_of(&h),
            steps_of(&g),
            "one {twin} per {host}, at the same steps"
        );
        assert!(!g.is_empty());
        for (&hi, &gi) in h.iter().zip(&g) {
            assert_eq!(s.step[hi], s.step[gi], "{twin} carries its step");
            assert_ne!(s.thread[hi], s.thread[gi], "{twin} is on the GPU lane");
            assert!(
                s.dur_ns[gi] > 0,
                "{twin} at step {} has no duration",
                s.step[gi]
            );
            assert!(
                s.start_ns[gi] + SLACK_NS >= s.start_ns[hi],
                "{twin} of step {} starts {} us before the host queued it",
                s.step[gi],
                (s.start_ns[hi] - s.start_ns[gi]) / 1000
            );
        }
    }
    let steps = spans_named(&run, "step");
    for twin in ["gpu:forward", "gpu:backward"] {
        for gi in spans_named(&run, twin) {
            let step = s.step[gi];
            if !step.is_multiple_of(LOG_FREQ) && step != 1 {
                continue;
            }
            let si = *steps.iter().find(|&&i| s.step[i] == step).unwrap();
            assert!(
                end(gi) <= end(si) + SLACK_NS,
                "{twin} of logged step {step} ends {} us after the host read its loss",
                (end(gi) - end(si)) / 1000
            );
        }
    }
    let phases = summary_phases(dir.path());
    let clock = |name: &str| {
        phases
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no phase {name}"))["clock"]
            .clone()
    };
    assert_eq!(clock("gpu:forward"), "gpu");
    assert_eq!(clock("forward"), "host");
    // The device's peak of tensor bytes, from the caching allocator (max_active).
    let lines = titan_tests::metrics(dir.path(), "train");
    let peak = lines.last().unwrap()["tensor_peak_gib"].as_f64().unwrap();
    // On CUDA `memory_gib` is the caching allocator's peak reserved memory.
    let reserved = lines.last().unwrap()["memory_gib"].as_f64().unwrap();
    assert!(
        peak > 0.0 && peak <= reserved,
        "tensor_peak_gib {peak}, reserved {reserved}"
    );
}
