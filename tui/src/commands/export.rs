//! `titan-obs export RUN --chrome OUT.json`: Chrome Trace Event JSON for Perfetto.

use std::path::PathBuf;

use anyhow::Result;
use titan_obs_core::analysis::write_chrome;
use titan_obs_core::read::Columns;

use super::{RunArgs, exit_code, load_run, write_atomically};

/// Export the run for other viewers.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Write Chrome Trace Event JSON here (open it at ui.perfetto.dev or chrome://tracing):
    /// one process per rank, one track per thread, nested spans, instants for events and step
    /// tags, counters for scalars.
    #[arg(long, value_name = "OUT.json", required = true)]
    pub chrome: PathBuf,
}

pub fn run(args: &ExportArgs) -> Result<i32> {
    let loaded = load_run(&args.run, Columns::ALL)?;
    let mut stats = None;
    write_atomically(&args.chrome, |w| {
        stats = Some(write_chrome(&loaded, w)?);
        Ok(())
    })?;
    let s = stats.expect("written");
    eprintln!(
        "wrote {}: {} spans, {} instants, {} errors, {} counter samples from {} ranks",
        args.chrome.display(),
        s.spans,
        s.instants,
        s.errors,
        s.counters,
        loaded.ranks.len()
    );
    Ok(exit_code(&args.run, &loaded))
}
