//! What the obs integration tests share: a run with an open journal.

use std::path::{Path, PathBuf};

use titan_obs_core::journal::JournalWriter;
use titan_obs_core::read::read_part;
use titan_obs_core::synth::{SynthConfig, write_run};

/// A two-rank synthetic run whose rank 0 holds `part-000000.parquet` and, instead of its
/// second part, an open journal of the same records in several batches.
pub fn run_with_journal(dir: &Path) -> (PathBuf, PathBuf) {
    let run = dir.join("run");
    let cfg = SynthConfig {
        ranks: 2,
        steps: 12,
        spans_per_step: 12,
        steps_per_part: 6,
        ..Default::default()
    };
    write_run(run.to_str().unwrap(), &cfg).unwrap();
    let rank0 = run.join("obs/rank-0");
    let part = rank0.join("part-000001.parquet");
    let bytes = bytes::Bytes::from(std::fs::read(&part).unwrap());
    let (footer, batches) = read_part(bytes).unwrap();
    std::fs::remove_file(&part).unwrap();
    let mut w = JournalWriter::create(&rank0, 1, &footer.header).unwrap();
    for b in &batches {
        let n = b.num_rows();
        let step = n.div_ceil(40);
        let mut at = 0;
        while at < n {
            let len = step.min(n - at);
            w.append(&b.slice(at, len)).unwrap();
            at += len;
        }
    }
    let path = w.path().to_path_buf();
    (run, path)
}
