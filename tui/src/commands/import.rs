//! `titan-obs import RUN OUT`: any run titan-obs reads, written in titan's Parquet layout.

use anyhow::Result;
use titan_obs_core::read::Columns;

use super::{RunArgs, exit_code, load_run};

/// Write a torchtitan run or Chrome trace as titan parts (OUT/obs/rank-<R>/part-000000.parquet):
/// it re-opens faster, and DuckDB/pyarrow read it directly.
#[derive(clap::Args, Debug)]
pub struct ImportArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Output run location (directory or object store URL); must not hold parts already.
    pub out: String,
}

pub fn run(args: &ImportArgs) -> Result<i32> {
    let loaded = load_run(&args.run, Columns::ALL)?;
    let t = std::time::Instant::now();
    let s = titan_obs_core::convert::write_parts(&loaded, &args.out)?;
    eprintln!(
        "wrote {}: {} ranks, {} records, {:.1} MB in {:.1} s",
        args.out,
        s.ranks,
        s.records,
        s.bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    Ok(exit_code(&args.run, &loaded))
}
