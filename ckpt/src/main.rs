use clap::Parser;

/// Checkpoint tools for PyTorch DCP and Hugging Face safetensors checkpoints.
#[derive(Parser)]
#[command(name = "titan-ckpt", version)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
}
