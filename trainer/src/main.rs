//! `titan-train`: trains a Llama-3 or dense Qwen3 model from a torchtitan-style TOML config plus
//! `--section.key value` overrides. Exit codes: [`TITAN_TRAIN`]. The arguments are parsed by
//! hand, not with clap: torchtitan's `--section.key value` overrides are open-ended (every key
//! of the config, checked against the config types), which clap cannot express as flags.
//!
//! One binary, three roles: with `--nproc-per-node N` it is the launcher (starts and supervises
//! N copies of itself, like torchrun); started by a launcher (torchrun, srun, ours, or variables
//! set by hand) it is one rank of a data-parallel job; otherwise it trains as one process.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use titan_cli::{Bin, ExitCode as Code, LOGGING_HELP, Level, Verbosity};
use titan_train::command_line;
use titan_train::config::{self, JobConfig};
use titan_train::distributed::launch::{self, LaunchArgs};
use titan_train::distributed::{Backend, CommOptions, DeviceMesh, Dist, LaunchEnv};
use titan_train::memory_estimate;
use titan_train::parallel::Mesh;
use titan_train::parallelize::layout::check_layout;
use titan_train::train::{self, TrainSummary};

const OK: Code = Code::new(0, "success");
const TRAINING_FAILED: Code = Code::new(
    1,
    "training failed (with --nproc-per-node: a rank failed; the launcher exits with the first \
     failing rank's code, 1 when it was killed by a signal)",
);
const USAGE: Code = Code::new(
    2,
    "usage or config error (unknown key, wrong type, unsupported torchtitan setting)",
);
const INTERRUPTED: Code = Code::new(
    130,
    "the launcher got SIGINT (Ctrl-C) and stopped the ranks",
);
const TERMINATED: Code = Code::new(143, "the launcher got SIGTERM and stopped the ranks");

/// The `titan-train` binary: message prefix and exit-code table.
const TITAN_TRAIN: Bin = Bin::new(
    "titan-train",
    &[OK, TRAINING_FAILED, USAGE, INTERRUPTED, TERMINATED],
);

fn help() -> String {
    // The values a bare `titan-train` runs with: the embedded debug config over the key defaults.
    let bare = JobConfig::load(&command_line::CommandLine::default())
        .expect("the embedded default config loads");
    let defaults = serde_json::to_value(bare).expect("defaults serialize");
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
        "titan-train: train a Llama-3 or dense Qwen3 model (torchtitan 0.3.0's numerics, config names and metrics)\n\
         \n\
         USAGE:\n  titan-train [-v|-vv|-q] [--job.config_file FILE] [--section.key VALUE | --section.key=VALUE]...\n  titan-train [-v|-vv|-q] --module llama3|qwen3 --config NAME [--key VALUE]...  (torchtitan 0.3.0's form)\n\
         \n\
         Two command lines, one config. The TOML form (torchtitan before 0.3): defaults, then FILE\n\
         (default: the embedded copy of {default_file}, from any directory), then the overrides in\n\
         order. torchtitan 0.3.0's form: --module/--config pick a function of its config registry\n\
         ({registry}; their values are in configs/registry/NAME.toml), then the overrides, with\n\
         0.3.0's key names (--dump_folder, --hf_assets_path, --dataloader.dataset_path, --validator.enable,\n\
         --optimizer.param_groups.0.optimizer_kwargs.lr, ...) and tyro's spellings (- or _, --x.no-enable,\n\
         activation_checkpoint:full|selective|none); either form takes either name. A boolean key\n\
         alone (--debug.deterministic) means true; list keys take comma-separated values. Unknown keys,\n\
         wrong types and values outside a key's choices are errors (exit 2), and so is any torchtitan key\n\
         titan-train does not implement (compile, the ZBVZeroBubble and DualPipeV schedules, wandb, ...)\n\
         unless at its default. Parallelism: data_parallel_shard_degree (FSDP2),\n\
         data_parallel_replicate_degree (DDP/HSDP), tensor_parallel_degree, context_parallel_degree,\n\
         expert_parallel_degree (MoE models), pipeline_parallel_degree with pipeline_parallel_schedule\n\
         GPipe | 1F1B | Interleaved1F1B | InterleavedZeroBubble; float8 linears with [float8]. Mixed precision: training.mixed_precision_param bfloat16 (default, autocast with fp32\n\
         weights) or float32; training.dtype bfloat16 trains bf16 weights and AdamW state. Activation\n\
         checkpointing: activation_checkpoint.mode none | full | selective, with selective_ac_option\n\
         op (recompute the elementwise work between matmuls) or N (recompute every N-th layer).\n\
         \n\
         EXAMPLES:\n  titan-train --training.steps 200\n  titan-train --module llama3 --config llama3_debugmodel --dataloader.dataset_path data/ --hf_assets_path tok/\n  titan-train --debug.seed=42 --debug.deterministic --training.steps 20\n  titan-train --training.dataset_path my_texts/ --model.hf_assets_path my_tokenizer/\n\
         \n\
         DATA: training.dataset = default uses the embedded dataset; training.dataset_path reads .txt (one\n\
         sample per line), .jsonl and .parquet (a `text` field) files or a folder of them. The embedded\n\
         tokenizer is used unless model.hf_assets_path names a folder with tokenizer.json.\n\
         \n\
         OUTPUTS (under job.dump_folder): config.toml (resolved config), metrics.jsonl (every logged\n\
         step and validation, full precision, appended; each line names its run), obs/ (titan-obs\n\
         timing records when observability.enable), tb/<date>/events.out.tfevents.*\n\
         (metrics.enable_tensorboard). Each launch is a run with its own run id; a resume from a\n\
         checkpoint continues that checkpoint's run. On a terminal, rank 0 shows a step counter.\n\
         \n\
         {exit_codes}\n\
         \n\
         {logging} titan-train logs on stdout, at info by default.\n\
         \n\
         {launch_help}\n\n\
         KEYS (with the values a bare `titan-train` uses: the embedded {default_file} over the key\n\
         defaults; --job.config_file or --module/--config start from their own values):\n{keys}",
        default_file = config::DEFAULT_CONFIG_FILE,
        registry = command_line::REGISTRY
            .iter()
            .map(|r| r.name)
            .collect::<Vec<_>>()
            .join(", "),
        launch_help = launch::LAUNCH_HELP,
        exit_codes = TITAN_TRAIN.exit_codes_help(),
        logging = LOGGING_HELP,
    )
}

/// A usage or configuration error: printed with a hint, exit 2.
fn usage_error(message: impl std::fmt::Display) -> ExitCode {
    TITAN_TRAIN.error(format_args!(
        "{message}\nrun `titan-train --help` for the flags, keys and their types"
    ));
    USAGE.into()
}

/// Removes `-v`/`-vv`/`--verbose` and `-q`/`--quiet` from `args` (before `--`).
fn take_verbosity(args: &mut Vec<String>) -> Result<Verbosity, String> {
    let mut v = Verbosity::default();
    let end = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let mut kept = Vec::with_capacity(args.len());
    for (i, a) in args.drain(..).enumerate() {
        match a.as_str() {
            _ if i >= end => kept.push(a),
            "--verbose" => v.verbose += 1,
            "-q" | "--quiet" => v.quiet = true,
            s if s.len() > 1 && s.starts_with('-') && s[1..].bytes().all(|b| b == b'v') => {
                v.verbose += (s.len() - 1) as u8
            }
            _ => kept.push(a),
        }
    }
    *args = kept;
    if v.quiet && v.verbose > 0 {
        return Err("-v and -q contradict each other; give one".into());
    }
    Ok(v)
}

fn main() -> ExitCode {
    let (launch, args) = match launch::split_args(std::env::args_os().skip(1).collect()) {
        Ok(split) => split,
        Err(e) => return usage_error(e),
    };
    let rank_args = args.clone();
    let mut args: Vec<String> = match args.into_iter().map(OsString::into_string).collect() {
        Ok(a) => a,
        Err(bad) => return usage_error(format!("argument {bad:?} is not valid UTF-8")),
    };
    let verbosity = match take_verbosity(&mut args) {
        Ok(v) => v,
        Err(e) => return usage_error(e),
    };
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("{}", help());
        return ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--version" || a == "-V") {
        println!("titan-train {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    // Checked before any rank starts, so a typo costs no rendezvous.
    let command_line = match command_line::parse(args) {
        Ok(c) => c,
        Err(e) => return usage_error(e),
    };
    let cfg = match JobConfig::load(&command_line) {
        Ok(cfg) => cfg,
        Err(e) => return usage_error(e),
    };
    init_logging(&cfg, &verbosity);
    for note in &command_line.notes {
        tracing::warn!("{note}");
    }
    for warning in cfg.ignored_settings(&command_line.overrides) {
        tracing::warn!("{warning}");
    }
    if cfg.memory_estimation.enable {
        // Arithmetic only: no model is built and no rank started.
        return print_memory_estimate(&cfg, launch.as_ref());
    }
    if let Some(launch) = launch {
        // The degrees are checked against the world before any rank starts.
        let world_size = launch.nproc_per_node * launch.nnodes;
        let checked = Mesh::new(&cfg.parallelism, 0, 0, world_size)
            .and_then(|world| Ok(check_layout(&cfg, &world)?));
        if let Err(e) = checked {
            return usage_error(format!("{e:#}"));
        }
        return run_launcher(&launch, &rank_args);
    }
    let env = match LaunchEnv::from_process_env() {
        Ok(env) => env,
        Err(e) => return usage_error(e),
    };
    // The model's split too, before the rendezvous: every rank finds the same problem alone.
    let checked = Mesh::new(&cfg.parallelism, env.rank, env.local_rank, env.world_size)
        .and_then(|world| Ok(check_layout(&cfg, &world)?));
    if let Err(e) = checked {
        return usage_error(format!("{e:#}"));
    }
    if cfg.debug.deterministic {
        // cuBLAS picks reduction splits per workspace; a fixed workspace config makes them
        // repeatable. Must be set before CUDA initialises.
        // SAFETY: single-threaded at this point; no other thread reads the environment.
        unsafe { std::env::set_var("CUBLAS_WORKSPACE_CONFIG", ":4096:8") };
    }
    if cfg.job.print_config && env.rank == 0 {
        match toml::to_string(&cfg) {
            Ok(text) => tracing::info!("resolved config:\n{text}"),
            Err(e) => tracing::warn!("cannot print the config: {e}"),
        }
    }
    let rank = env.rank;
    let result = if env.is_distributed() {
        train_distributed(&cfg, env)
    } else {
        train::run(&cfg, &DeviceMesh::single())
    };
    match result {
        Ok(summary) => {
            if rank == 0 {
                print_outputs(&cfg, &summary);
            }
            ExitCode::SUCCESS
        }
        Err(e) if e.downcast_ref::<config::ConfigError>().is_some() => {
            usage_error(format!("{e:#}"))
        }
        Err(e) => {
            tracing::error!("training failed: {e:#}");
            TITAN_TRAIN.error(format_args!("{e:#}"));
            TRAINING_FAILED.into()
        }
    }
}

/// `--memory_estimation.enable`: prints one rank's estimate for the job's world size (the
/// launcher's `--nproc-per-node x --nnodes`, else WORLD_SIZE) once, from node 0's launcher or
/// rank 0, and exits.
fn print_memory_estimate(cfg: &JobConfig, launch: Option<&LaunchArgs>) -> ExitCode {
    let (world_size, prints) = match launch {
        Some(l) => (l.nproc_per_node * l.nnodes, l.node_rank == 0),
        None => match LaunchEnv::from_process_env() {
            Ok(env) => (env.world_size, env.rank == 0),
            Err(e) => return usage_error(e),
        },
    };
    let estimate = match memory_estimate::estimate(cfg, world_size) {
        Ok(e) => e,
        Err(e) => return usage_error(format!("{e:#}")),
    };
    if prints {
        if cfg.memory_estimation.json {
            println!("{}", estimate.to_json());
        } else {
            print!("{}", estimate.table());
        }
    }
    ExitCode::SUCCESS
}

/// Logs on stdout (with the metrics lines, as torchtitan does) at info, or as -v/-q/RUST_LOG say,
/// in lines of at most 100 columns, coloured only on a terminal; -q also hides the step counter.
fn init_logging(cfg: &JobConfig, verbosity: &Verbosity) {
    let ansi =
        !cfg.metrics.disable_color_printing && std::io::IsTerminal::is_terminal(&std::io::stdout());
    if verbosity.quiet {
        titan_train::console::hide_step_counter();
    }
    tracing_subscriber::fmt()
        .with_env_filter(verbosity.filter(Level::Info))
        .with_ansi(ansi)
        .with_writer(titan_train::console::ConsoleWriter)
        .event_format(titan_train::console::LineFormat {
            ansi,
            width: titan_train::console::line_width(),
        })
        .init();
}

/// Starts this node's ranks (copies of this executable with `rank_args`) and waits for them.
fn run_launcher(launch: &LaunchArgs, rank_args: &[OsString]) -> ExitCode {
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            TITAN_TRAIN.error(format_args!(
                "cannot find this executable to start the ranks: {e}"
            ));
            return TRAINING_FAILED.into();
        }
    };
    match launch::run(launch, &program, rank_args) {
        Ok(outcome) => {
            if let Some(failure) = &outcome.failure {
                TITAN_TRAIN.error(failure);
            }
            ExitCode::from(outcome.exit_code.clamp(0, 255) as u8)
        }
        Err(e) => {
            TITAN_TRAIN.error(format_args!("{e:#}"));
            TRAINING_FAILED.into()
        }
    }
}

/// One rank of a multi-process job: join it, train, and tell the other ranks if this one fails.
fn train_distributed(cfg: &JobConfig, env: LaunchEnv) -> anyhow::Result<TrainSummary> {
    let invalid = |key: &str, e: anyhow::Error| -> anyhow::Error {
        config::ConfigError::invalid(key, format!("{e:#}")).into()
    };
    let world = Mesh::new(&cfg.parallelism, env.rank, env.local_rank, env.world_size)
        .map_err(|e| invalid("parallelism.data_parallel_shard_degree", e))?;
    let device = train::select_device(&cfg.training, &cfg.comm, env.local_rank)
        .map_err(|e| invalid("training.device", e))?;
    let backend = match (cfg.comm.backend, device) {
        (config::CommBackend::Cpu, _) | (config::CommBackend::Auto, tch::Device::Cpu) => {
            Backend::Cpu
        }
        (config::CommBackend::Nccl | config::CommBackend::Auto, tch::Device::Cuda(_)) => {
            Backend::Nccl
        }
        (config::CommBackend::Nccl, _) => {
            return Err(invalid(
                "comm.backend",
                anyhow::anyhow!(
                    "nccl runs collectives on CUDA tensors, but this rank trains on {device:?}: \
                     set training.device = \"cuda\" on a GPU machine, or comm.backend = \"cpu\""
                ),
            ));
        }
        (_, other) => {
            return Err(invalid(
                "training.device",
                anyhow::anyhow!("{other:?} is not a device titan-train trains on"),
            ));
        }
    };
    let opts = CommOptions {
        backend,
        init_timeout: Duration::from_secs(cfg.comm.init_timeout_seconds as u64),
        timeout: Duration::from_secs(cfg.comm.train_timeout_seconds as u64),
        cuda_device: match device {
            tch::Device::Cuda(i) => Some(i),
            _ => None,
        },
        ..CommOptions::default()
    };
    let rank = env.rank;
    let dist = Dist::init(env, opts).context("joining the distributed job")?;
    // Rank timelines in titan-obs line up on rank 0's clock.
    titan_obs_core::set_clock_offset_ns(dist.clock_offset_ns);
    let mesh = DeviceMesh::connect(dist, world).context("creating the device mesh's groups")?;
    let result = train::run(cfg, &mesh);
    if let Err(e) = &result
        && let Some(dist) = mesh.dist()
    {
        // First failure wins: the other ranks' errors then name this one as the cause.
        dist.post_failure(&format!("rank {rank}: {e:#}"));
    }
    result
}

fn print_outputs(cfg: &JobConfig, summary: &TrainSummary) {
    let shown = summary.dump_folder.canonicalize().map_or_else(
        |_| summary.dump_folder.display().to_string(),
        |p| p.display().to_string(),
    );
    println!(
        "titan-train: {} steps done (run {}); outputs in {shown}",
        summary.steps, summary.run_id
    );
    // Names relative to the folder above keep the lines short (100 columns) and the path once.
    println!("  config.toml    resolved config");
    println!("  metrics.jsonl  logged steps and validations (each line names its run)");
    if cfg.checkpoint.enable {
        println!(
            "  {}/    checkpoints (titan-ckpt inspect)",
            cfg.checkpoint.folder
        );
    }
    if cfg.observability.enable {
        println!("  obs/           timing records: titan-obs summary {shown}");
    }
}
