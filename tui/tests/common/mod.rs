//! What the CLI tests share: a pipeline-parallel run written part by part.

use std::collections::BTreeMap;

use titan_obs_core::footer::PartHeader;
use titan_obs_core::location::Location;
use titan_obs_core::part::{PartBuilder, PartSink, Row, encode};
use titan_obs_core::schema::PipelineSlot;

/// Writes a pipeline run: per rank (rank, stage, slowdown of its passes), `steps` steps of 2
/// microbatches; a stage's passes take (1 + stage) ms times the rank's slowdown.
pub fn write_pipeline_run(run: &str, ranks: &[(u32, u16, f64)], steps: u64) {
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
                pipeline: slot,
                ..Row::span(seq, name, step, start, dur, depth)
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
