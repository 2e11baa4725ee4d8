//! `titan-train`: trains a Llama-3 model from a torchtitan-style TOML config plus
//! `--section.key value` overrides. Exit codes: 0 done, 1 training failed, 2 usage/config error.

use std::process::ExitCode;

use titan_train::config::{self, JobConfig};
use titan_train::parallel::SingleProcess;
use titan_train::train;

fn help() -> String {
    let defaults = serde_json::to_value(JobConfig::default()).expect("defaults serialize");
    let mut keys = String::new();
    if let serde_json::Value::Object(sections) = defaults {
        for (section, body) in sections {
            keys.push_str(&format!("  [{section}]\n"));
            if let serde_json::Value::Object(body) = body {
                for (key, value) in body {
                    let shown = match value {
                        serde_json::Value::Null => "(unset)".to_string(),
                        v => v.to_string(),
                    };
                    keys.push_str(&format!("    --{section}.{key} {shown}\n"));
                }
            }
        }
    }
    format!(
        "titan-train: train a Llama-3 model (torchtitan's llama3 numerics, config names and metrics)\n\
         \n\
         USAGE:\n  titan-train [--job.config_file FILE] [--section.key VALUE | --section.key=VALUE]...\n\
         \n\
         The config is torchtitan's TOML layout: defaults, then FILE (default {default_file}),\n\
         then the command-line overrides in order. A boolean key alone (--debug.deterministic) means true;\n\
         list keys take comma-separated values. Unknown keys and wrong types are errors (exit 2).\n\
         \n\
         EXAMPLES:\n  titan-train --training.steps 200\n  titan-train --debug.seed=42 --debug.deterministic --training.steps 20\n  titan-train --training.dataset_path my_texts/ --model.hf_assets_path my_tokenizer/\n\
         \n\
         DATA: training.dataset = default uses the embedded dataset; training.dataset_path reads .txt (one\n\
         sample per line), .jsonl and .parquet (a `text` field) files or a folder of them. The embedded\n\
         tokenizer is used unless model.hf_assets_path names a folder with tokenizer.json.\n\
         \n\
         OUTPUTS (under job.dump_folder): config.toml (resolved config), metrics.jsonl (every logged\n\
         step and validation, full precision), obs/ (titan-obs timing records when observability.enable).\n\
         \n\
         EXIT CODES: 0 success, 1 training failed, 2 usage or config error.\n\
         \n\
         KEYS (with defaults):\n{keys}",
        default_file = config::DEFAULT_CONFIG_FILE,
    )
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("{}", help());
        return ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--version" || a == "-V") {
        println!("titan-train {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    let cfg = match config::parse_overrides(args).and_then(|o| JobConfig::load(&o)) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("run `titan-train --help` for the keys and their types");
            return ExitCode::from(2);
        }
    };
    if cfg.debug.deterministic {
        // cuBLAS picks reduction splits per workspace; a fixed workspace config makes them
        // repeatable. Must be set before CUDA initialises.
        // SAFETY: single-threaded at this point; no other thread reads the environment.
        unsafe { std::env::set_var("CUBLAS_WORKSPACE_CONFIG", ":4096:8") };
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(
            !cfg.metrics.disable_color_printing
                && std::io::IsTerminal::is_terminal(&std::io::stdout()),
        )
        .init();
    if cfg.job.print_config {
        match toml::to_string(&cfg) {
            Ok(text) => tracing::info!("resolved config:\n{text}"),
            Err(e) => tracing::warn!("cannot print the config: {e}"),
        }
    }
    let dump = std::path::Path::new(&cfg.job.dump_folder);
    let shown = dump
        .canonicalize()
        .unwrap_or_else(|_| dump.to_path_buf())
        .display()
        .to_string();
    match train::run(&cfg, &mut SingleProcess::new()) {
        Ok(summary) => {
            let shown = summary
                .dump_folder
                .canonicalize()
                .map_or(shown, |p| p.display().to_string());
            println!(
                "titan-train: {} steps done; outputs in {shown}",
                summary.steps
            );
            println!("  {shown}/config.toml    resolved config");
            println!("  {shown}/metrics.jsonl  logged steps and validations");
            if cfg.observability.enable {
                println!("  {shown}/obs/           timing records (titan-obs summary {shown})");
            }
            ExitCode::SUCCESS
        }
        Err(e) if e.downcast_ref::<config::ConfigError>().is_some() => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
        Err(e) => {
            tracing::error!("training failed: {e:#}");
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}
