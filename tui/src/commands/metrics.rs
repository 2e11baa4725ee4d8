//! `titan-obs metrics RUN`: torchtitan's aggregated per-step metric lines from the scalars.

use anyhow::Result;
use titan_obs_core::analysis::{format_line, metrics, to_csv};
use titan_obs_core::read::Columns;

use super::{RunArgs, exit_code, load_run_with};

/// Per-step metrics aggregated across ranks, in torchtitan's console format.
#[derive(clap::Args, Debug)]
pub struct MetricsArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// CSV: kind,step,<one column per metric>.
    #[arg(long, conflicts_with = "json")]
    pub csv: bool,
    /// JSON: [{"step": 1, "validation": false, "values": {"training/loss_mean": 8.03, ...}}, ...].
    #[arg(long)]
    pub json: bool,
    /// Decode every scalar instead of reading the per-part summaries (`part-<N>.summary`):
    /// means summed record by record rather than part by part (the same but for float
    /// rounding), at the cost of reading all the data.
    #[arg(long)]
    pub exact: bool,
}

pub fn run(args: &MetricsArgs) -> Result<i32> {
    let loaded = load_run_with(&args.run, Columns::METRICS, !args.exact)?;
    let lines = metrics(&loaded);
    if args.csv {
        print!("{}", to_csv(&lines));
    } else if args.json {
        let json: Vec<serde_json::Value> = lines
            .iter()
            .map(|l| {
                serde_json::json!({
                    "step": l.step,
                    "validation": l.validation,
                    "values": l.values.iter().map(|(k, v)| (k.clone(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        if lines.is_empty() {
            titan_obs::conventions::TITAN_OBS.warning(format_args!(
                "no scalars with a step in {}",
                loaded.location
            ));
        }
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        for l in &lines {
            // A closed pipe (`| head`) just ends the output.
            if writeln!(out, "{}", format_line(l)).is_err() {
                break;
            }
        }
    }
    Ok(exit_code(&args.run, &loaded))
}
