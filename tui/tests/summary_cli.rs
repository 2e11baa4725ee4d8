//! `titan-obs summary` of a pipeline run: the pipeline section from the per-part summaries
//! (each stage's passes and windows) as `--exact` has it, and stragglers found among the
//! ranks of each stage.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use titan_obs_core::location::Location;
use titan_obs_core::part::{PartBuilder, PartHeader, PartSink, Row, encode};
use titan_obs_core::schema::{Kind, PipelineSlot};

fn summary_json(run: &str, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
        .args(["summary", run, "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Writes a pipeline run: per rank (rank, stage, slowdown of its passes), `steps` steps of 2
/// microbatches; a stage's passes take (1 + stage) ms times the rank's slowdown.
fn write_pipeline_run(run: &str, ranks: &[(u32, u16, f64)], steps: u64) {
    let world = ranks.len() as u32;
    for &(rank, stage, slow) in ranks {
        let header = PartHeader {
            run_id: "pp".into(),
            source: "trainer".into(),
            host: "h".into(),
            rank,
            local_rank: rank,
            world_size: world,
            pid: 1,
            clock_offset_ns: 0,
            threads: BTreeMap::from([(0, "main".into())]),
            run_metadata: Default::default(),
        };
        let mut b = PartBuilder::new();
        let mut seq = 0;
        let mut push = |name: &str, step: u64, start: i64, dur: i64, depth, slot| {
            seq += 1;
            b.push(&Row {
                thread: 0,
                seq,
                kind: Kind::Span,
                name,
                step: Some(step),
                start_ns: start,
                dur_ns: Some(dur),
                value: None,
                reduce: None,
                depth,
                parent: None,
                tags: &[],
                message: None,
                pipeline: slot,
            });
        };
        for step in 0..steps {
            // A little jitter, so that medians are not ties.
            let jitter = ((step * 7 + u64::from(rank) * 3) % 5) as f64 * 0.01;
            let pass = (1_000_000.0 * f64::from(1 + stage) * slow * (1.0 + jitter)) as i64;
            let t0 = step as i64 * 100_000_000;
            for mb in 0..2u16 {
                let slot = Some(PipelineSlot {
                    microbatch: mb,
                    stage,
                });
                let at = t0 + i64::from(mb) * 3 * pass;
                push("forward", step, at, pass, 2, slot);
                push("backward", step, at + pass, 2 * pass, 2, slot);
            }
            push("forward_backward", step, t0, 20_000_000, 1, None);
            push("step", step, t0, 30_000_000, 0, None);
        }
        let batch = b.finish(&header).unwrap();
        let sink = PartSink::new(Location::parse(run).unwrap(), rank).unwrap();
        sink.put(0, encode(&batch, &header, 0).unwrap()).unwrap();
    }
}

/// The pipeline section from the summaries against `--exact`'s: the same but for the
/// per-microbatch pass medians, which come from the sketches (within their 1%).
fn same_pipeline(fast: &serde_json::Value, exact: &serde_json::Value) {
    let (mut f, mut e) = (fast["pipeline"].clone(), exact["pipeline"].clone());
    assert!(f.is_object(), "{fast}");
    let stages = |v: &mut serde_json::Value| v["per_stage"].as_array_mut().unwrap().clone();
    for (a, b) in stages(&mut f).iter().zip(stages(&mut e).iter()) {
        for k in ["forward_ns", "backward_ns"] {
            let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
            assert!((x - y).abs() <= 0.01 * y + 1.0, "{k}: {x} vs {y}");
        }
    }
    for v in [&mut f, &mut e] {
        for st in v["per_stage"].as_array_mut().unwrap() {
            st["forward_ns"] = serde_json::Value::Null;
            st["backward_ns"] = serde_json::Value::Null;
        }
    }
    assert_eq!(f, e);
}

#[test]
fn a_pipeline_run_has_the_same_pipeline_section_from_summaries() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    // Two pipeline ranks (stages 0 and 1), 4 steps; stage 1 is slower.
    write_pipeline_run(run_s, &[(0, 0, 1.0), (1, 1, 1.0)], 4);
    let fast = summary_json(run_s, &[]);
    let exact = summary_json(run_s, &["--exact"]);
    same_pipeline(&fast, &exact);
    assert_eq!(fast["spans"], exact["spans"]);
}

/// Under PP a rank is compared with the ranks of its own stage: the slow data-parallel
/// replica of stage 1 is named, stage 1 itself (twice stage 0's passes by design) is not.
#[test]
fn a_slow_replica_of_a_stage_is_a_straggler_and_a_slower_stage_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    // Stage 0 on ranks 0 and 1, stage 1 on ranks 2 and 3; rank 3's passes 1.5x.
    write_pipeline_run(
        run_s,
        &[(0, 0, 1.0), (1, 0, 1.0), (2, 1, 1.0), (3, 1, 1.5)],
        12,
    );
    for extra in [&[][..], &["--exact"][..]] {
        let s = summary_json(run_s, extra);
        let named: Vec<(String, u64)> = s["stragglers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| {
                (
                    x["phase"].as_str().unwrap().to_string(),
                    x["rank"].as_u64().unwrap(),
                )
            })
            .collect();
        assert!(
            named.contains(&("forward".into(), 3)),
            "{extra:?}: {named:?}"
        );
        assert!(
            named.contains(&("backward".into(), 3)),
            "{extra:?}: {named:?}"
        );
        assert!(named.iter().all(|(_, r)| *r == 3), "{extra:?}: {named:?}");
    }
    let fast = summary_json(run_s, &[]);
    let exact = summary_json(run_s, &["--exact"]);
    assert_eq!(fast["stragglers"], exact["stragglers"]);
    same_pipeline(&fast, &exact);
}
