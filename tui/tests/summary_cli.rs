//! `titan-obs summary` of a pipeline run: the per-part summaries leave the pipeline analysis
//! out, so `summary` reads the spans for it and shows the same pipeline section as `--exact`.

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

#[test]
fn a_pipeline_run_has_the_same_pipeline_section_from_summaries() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    // Two pipeline ranks (stages 0 and 1), 4 steps of 2 microbatches; stage 1 is slower.
    for rank in 0..2u32 {
        let header = PartHeader {
            run_id: "pp".into(),
            source: "trainer".into(),
            host: "h".into(),
            rank,
            local_rank: rank,
            world_size: 2,
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
        let pass = 1_000_000 * (1 + i64::from(rank));
        for step in 0..4u64 {
            let t0 = step as i64 * 100_000_000;
            for mb in 0..2u16 {
                let slot = Some(PipelineSlot {
                    microbatch: mb,
                    stage: rank as u16,
                });
                let at = t0 + i64::from(mb) * 3 * pass;
                push("forward", step, at, pass, 2, slot);
                push("backward", step, at + pass, 2 * pass, 2, slot);
            }
            push("forward_backward", step, t0, 20_000_000, 1, None);
            push("step", step, t0, 30_000_000, 0, None);
        }
        let batch = b.finish(&header).unwrap();
        let sink = PartSink::new(Location::parse(run_s).unwrap(), rank).unwrap();
        sink.put(0, encode(&batch, &header, 0).unwrap()).unwrap();
    }
    let fast = summary_json(run_s, &[]);
    let exact = summary_json(run_s, &["--exact"]);
    assert!(fast["pipeline"].is_object(), "{fast}");
    assert_eq!(fast["pipeline"], exact["pipeline"]);
    assert_eq!(fast["spans"], exact["spans"]);
}
