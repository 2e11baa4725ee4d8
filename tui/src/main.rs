//! titan-obs: look at where the time of a titan run went.
use clap::Parser;

/// Timing analysis of titan runs.
#[derive(Parser)]
#[command(name = "titan-obs", version)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
}
