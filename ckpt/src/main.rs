use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use titan_ckpt::adapter::{self, LlamaHints, Naming};
use titan_ckpt::consolidate::{self, FileLayout, RankShare};
use titan_ckpt::error::{Error, Result};
use titan_ckpt::formats::{self, dcp_hf};
use titan_ckpt::inspect::{self, VerifyReport};
use titan_ckpt::plan::Format;
use titan_ckpt::write::{self, EngineOptions, OutFilePlan, OutTensor};
use titan_ckpt::{Dtype, storage};

/// Checkpoint tools for PyTorch Distributed Checkpoint (DCP) and Hugging Face safetensors.
///
/// Formats (detected automatically on input):
///   hf      HF safetensors: model.safetensors, or model-*-of-*.safetensors + model.safetensors.index.json
///   dcp-hf  DCP sharded safetensors (torch HuggingFaceStorageWriter, save_distributed=True):
///           shard-RRRRR-model-IIIII-of-NNNNN.safetensors with DCP_SHARDING_INFO offsets
///   dcp     DCP native: .metadata + __R_K.distcp (torch dcp.save), with or without zstd
///
/// Paths may be local or object store URLs (s3://, gs://, az://, file://); credentials and
/// endpoints come from the environment as object_store reads them (AWS_ACCESS_KEY_ID,
/// AWS_ENDPOINT, AWS_ALLOW_HTTP, GOOGLE_SERVICE_ACCOUNT, AZURE_STORAGE_ACCOUNT_NAME, ...).
///
/// Exit codes: 0 ok; 1 differences found, verification failed or the checkpoint is invalid;
/// 2 usage errors.
#[derive(Parser)]
#[command(name = "titan-ckpt", version, verbatim_doc_comment)]
struct Cli {
    /// More log output on stderr (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// No progress bars.
    #[arg(short, long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Consolidate dcp-hf or dcp shards into full HF safetensors files plus an index.
    ///
    /// Output files are planned from an existing HF index (--index-from) or packed up to
    /// --max-shard-size; each appears only when complete. With --rank/--world-size, N processes
    /// (on one or many nodes sharing OUT) each write their share of the files; rank 0 writes
    /// model.safetensors.index.json after every file is there.
    #[command(verbatim_doc_comment)]
    Consolidate(ConsolidateArgs),
    /// Convert between hf, dcp-hf and dcp, optionally renaming torchtitan <-> HF Llama-3 tensors.
    Convert(ConvertArgs),
    /// List tensors, dtypes, global shapes, chunks per tensor, bytes and the parameter count.
    Inspect(InspectArgs),
    /// Check that headers, offsets and file sizes are consistent and chunks tile every tensor
    /// exactly (exit 1 when not).
    Verify(InspectArgs),
    /// Per-tensor max abs difference between two checkpoints of any formats (exit 1 when they differ).
    Diff(DiffArgs),
}

#[derive(Args)]
struct Workers {
    /// Worker threads (default: available cores).
    #[arg(long)]
    workers: Option<usize>,
    /// Bytes a worker moves per read or write (bounds memory per worker), e.g. 16MiB.
    #[arg(long, default_value = "16MiB", value_parser = consolidate::parse_size)]
    window: u64,
}

impl Workers {
    fn count(&self) -> usize {
        self.workers.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
    }
}

#[derive(Args)]
struct ConsolidateArgs {
    /// Input checkpoint directory or URL (dcp-hf or dcp; hf works too).
    input: String,
    /// Output directory or URL.
    output: String,
    /// Take the tensor -> file mapping from this HF model.safetensors.index.json.
    #[arg(long, conflicts_with = "max_shard_size")]
    index_from: Option<String>,
    /// Pack tensors into files of at most this size (5GB, 500MB, 2GiB).
    #[arg(long, default_value = "5GB", value_parser = consolidate::parse_size)]
    max_shard_size: u64,
    /// Convert floating point tensors to this dtype (bf16, f16, f32, ...); integer and bool
    /// tensors keep theirs.
    #[arg(long)]
    dtype: Option<Dtype>,
    /// This process's rank among --world-size processes sharing the work.
    #[arg(long, default_value_t = 0, requires = "world_size")]
    rank: usize,
    /// Number of processes sharing the work (each runs with its own --rank).
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    /// Seconds rank 0 waits for the other ranks' files before writing the index.
    #[arg(long, default_value_t = 3600)]
    wait_timeout: u64,
    #[command(flatten)]
    workers: Workers,
}

#[derive(Args)]
struct ConvertArgs {
    /// Input checkpoint (any format).
    input: String,
    /// Output directory or URL.
    output: String,
    /// Output format.
    #[arg(long, value_enum)]
    to: Format,
    /// Rename tensors for a model family: llama3 maps torchtitan names to HF names (and back)
    /// with the q/k RoPE row permutation, and writes an HF config.json for --to hf.
    #[arg(long, value_parser = ["llama3"])]
    adapter: Option<String>,
    /// Convert floating point tensors to this dtype.
    #[arg(long)]
    dtype: Option<Dtype>,
    /// Keep only model weights: drop optimizer, lr_scheduler, dataloader, train_state and rng_state
    /// entries and every non-tensor item.
    #[arg(long)]
    model_only: bool,
    /// Llama attention heads (needed for the RoPE permutation unless the model is a known
    /// torchtitan flavor: debugmodel, 8B, 70B, 405B).
    #[arg(long)]
    n_heads: Option<u64>,
    /// Llama key/value heads (default: inferred from wk's shape).
    #[arg(long)]
    n_kv_heads: Option<u64>,
    /// RoPE theta written to config.json.
    #[arg(long)]
    rope_theta: Option<f64>,
    /// RMSNorm epsilon written to config.json.
    #[arg(long)]
    norm_eps: Option<f64>,
    /// max_position_embeddings written to config.json.
    #[arg(long)]
    max_position_embeddings: Option<u64>,
    /// For --to dcp: compress every item with zstd at this level (torch's ZStandard extension,
    /// transform `stream.zstd/1`; torch uses 3).
    #[arg(long)]
    zstd_level: Option<i32>,
    /// For --to hf: pack tensors into files of at most this size.
    #[arg(long, default_value = "5GB", value_parser = consolidate::parse_size)]
    max_shard_size: u64,
    #[command(flatten)]
    workers: Workers,
}

#[derive(Args)]
struct InspectArgs {
    /// Checkpoint directory, file or URL.
    path: String,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct DiffArgs {
    a: String,
    b: String,
    /// Tensors whose max abs difference is at most this are equal.
    #[arg(long, default_value_t = 0.0)]
    atol: f64,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    workers: Workers,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let quiet = cli.quiet;
    match run(cli.command, quiet) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("titan-ckpt: error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

fn progress(quiet: bool, what: &str) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("progress template")
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

fn run(cmd: Command, quiet: bool) -> Result<u8> {
    match cmd {
        Command::Inspect(a) => {
            let plan = formats::open_str(&a.path)?;
            let report = inspect::inspect(&plan);
            if a.json {
                println!("{}", serde_json::to_string_pretty(&report).expect("json"));
            } else {
                print!("{}", report.render());
            }
            Ok(0)
        }
        Command::Verify(a) => verify(&a),
        Command::Diff(a) => {
            let pa = formats::open_str(&a.a)?;
            let pb = formats::open_str(&a.b)?;
            let bar = progress(quiet || a.json, "diff");
            let report = inspect::diff(&pa, &pb, a.atol, a.workers.count(), &bar)?;
            bar.finish_and_clear();
            if a.json {
                println!("{}", serde_json::to_string_pretty(&report).expect("json"));
            } else {
                print!("{}", report.render());
            }
            Ok(if report.equal { 0 } else { 1 })
        }
        Command::Consolidate(a) => consolidate_cmd(&a, quiet),
        Command::Convert(a) => convert_cmd(&a, quiet),
    }
}

fn verify(a: &InspectArgs) -> Result<u8> {
    let report = match formats::open_str(&a.path) {
        Ok(plan) => {
            let err = formats::dcp_native::check_items(&plan).err();
            VerifyReport {
                path: a.path.clone(),
                ok: err.is_none(),
                format: Some(plan.format),
                tensors: plan.tensors.len(),
                chunks: plan.tensors.values().map(|t| t.chunks.len()).sum(),
                error: err.map(|e| e.to_string()),
            }
        }
        Err(e @ Error::Usage(_)) => return Err(e),
        Err(e) => VerifyReport {
            path: a.path.clone(),
            ok: false,
            format: None,
            tensors: 0,
            chunks: 0,
            error: Some(e.to_string()),
        },
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("json"));
    } else if report.ok {
        println!(
            "{}: OK ({}, {} tensors, {} chunks tile exactly)",
            report.path,
            report.format.map(|f| f.to_string()).unwrap_or_default(),
            report.tensors,
            report.chunks
        );
    } else {
        println!(
            "{}: FAILED: {}",
            report.path,
            report.error.as_deref().unwrap_or("")
        );
    }
    Ok(if report.ok { 0 } else { 1 })
}

fn consolidate_cmd(a: &ConsolidateArgs, quiet: bool) -> Result<u8> {
    if a.world_size == 0 || a.rank >= a.world_size {
        return Err(Error::usage(format!(
            "--rank {} must be below --world-size {}",
            a.rank, a.world_size
        )));
    }
    let plan = formats::open_str(&a.input)?;
    let out = formats::output_root(&a.output)?;
    let layout = match &a.index_from {
        Some(p) => {
            let loc = storage::Location::parse(p)?;
            let file = loc
                .file
                .clone()
                .unwrap_or_else(|| formats::HF_INDEX.to_string());
            FileLayout::Mapping(formats::hf::read_index(&loc.root, &file)?)
        }
        None => FileLayout::MaxShardSize(a.max_shard_size),
    };
    let tensors = consolidate::consolidation_tensors(&plan, a.dtype)?;
    if !plan.bytes_items.is_empty() {
        tracing::warn!(
            items = plan.bytes_items.len(),
            "non-tensor items are not part of HF safetensors; skipped"
        );
    }
    let files = consolidate::plan_files(tensors, &layout)?;
    let write_index = files.len() > 1 || matches!(layout, FileLayout::Mapping(_));
    let bar = progress(quiet, "consolidate");
    let opts = EngineOptions {
        workers: a.workers.count(),
        window_bytes: a.workers.window,
        progress: bar.clone(),
    };
    let share = RankShare {
        rank: a.rank,
        world_size: a.world_size,
        wait_timeout: Duration::from_secs(a.wait_timeout),
    };
    let summary = consolidate::run(&plan, &out, &files, write_index, share, &opts)?;
    bar.finish_and_clear();
    eprintln!(
        "rank {}/{}: wrote {} file(s), {}{}",
        a.rank,
        a.world_size,
        summary.files_written.len(),
        inspect::human_bytes(summary.bytes_written),
        if summary.index_written {
            " and the index"
        } else {
            ""
        }
    );
    Ok(0)
}

/// Top-level state entries torchtitan (and titan-train: `rng_state`) save next to the model.
const NON_MODEL_PREFIXES: [&str; 5] = [
    "optimizer",
    "lr_scheduler",
    "dataloader",
    "train_state",
    "rng_state",
];

fn is_model_tensor(name: &str) -> bool {
    !NON_MODEL_PREFIXES
        .iter()
        .any(|p| name == *p || name.starts_with(&format!("{p}.")))
}

fn convert_cmd(a: &ConvertArgs, quiet: bool) -> Result<u8> {
    let mut plan = formats::open_str(&a.input)?;
    let out = formats::output_root(&a.output)?;
    if a.model_only {
        plan.tensors.retain(|n, _| is_model_tensor(n));
        plan.bytes_items.clear();
    }
    let target_naming = match a.to {
        Format::Hf => Naming::Hf,
        Format::Dcp | Format::DcpHf => Naming::Torchtitan,
    };
    let mut args = None;
    let mut tensors: Vec<OutTensor> = Vec::new();
    if a.adapter.is_some() {
        let from = adapter::detect_naming(plan.tensors.keys()).ok_or_else(|| {
            Error::usage("--adapter llama3: found neither `tok_embeddings.weight` nor `model.embed_tokens.weight`")
        })?;
        let hints = LlamaHints {
            n_heads: a.n_heads,
            n_kv_heads: a.n_kv_heads,
            rope_theta: a.rope_theta,
            norm_eps: a.norm_eps,
            max_position_embeddings: a.max_position_embeddings,
        };
        let la = adapter::infer_args(&plan, from, &hints)?;
        for (name, t) in &plan.tensors {
            let (out_name, row_map) = adapter::map_tensor(name, from, target_naming, &la).ok_or_else(|| {
                Error::usage(format!(
                    "--adapter llama3: `{name}` is not a Llama-3 weight (use --model-only to drop optimizer state)"
                ))
            })?;
            tensors.push(out_tensor(
                name, out_name, t.dtype, &t.shape, row_map, a.dtype,
            )?);
        }
        args = Some(la);
    } else {
        for (name, t) in &plan.tensors {
            tensors.push(out_tensor(
                name,
                name.clone(),
                t.dtype,
                &t.shape,
                None,
                a.dtype,
            )?);
        }
    }
    tensors.sort_by(|x, y| x.name.cmp(&y.name));
    let bar = progress(quiet, "convert");
    let opts = EngineOptions {
        workers: a.workers.count(),
        window_bytes: a.workers.window,
        progress: bar.clone(),
    };
    match a.to {
        Format::Hf => {
            if !plan.bytes_items.is_empty() {
                tracing::warn!(
                    items = plan.bytes_items.len(),
                    "non-tensor items cannot be stored in HF safetensors; skipped"
                );
            }
            let files =
                consolidate::plan_files(tensors, &FileLayout::MaxShardSize(a.max_shard_size))?;
            let write_index = files.len() > 1;
            consolidate::run(&plan, &out, &files, write_index, RankShare::single(), &opts)?;
            if let Some(la) = &args {
                let dtype = files
                    .iter()
                    .flat_map(|f| &f.tensors)
                    .map(|(t, _)| t.dtype)
                    .find(|d| d.is_float())
                    .unwrap_or(Dtype::F32);
                let cfg = serde_json::to_vec_pretty(&adapter::hf_config(la, dtype)).expect("json");
                out.write_small("config.json", &cfg)?;
            }
        }
        Format::DcpHf => {
            let file = dcp_hf_single_file(tensors);
            write::write_files(&plan, &out, &[file], &opts)?;
        }
        Format::Dcp => {
            let output = formats::dcp_native::DcpOutput {
                zstd_level: a.zstd_level,
            };
            formats::dcp_native::write(&plan, &out, &tensors, output, &opts)?;
        }
    }
    bar.finish_and_clear();
    eprintln!("converted {} -> {} ({})", a.input, a.output, a.to);
    Ok(0)
}

fn out_tensor(
    source: &str,
    name: String,
    dtype: Dtype,
    shape: &[u64],
    row_map: Option<write::RowMap>,
    to: Option<Dtype>,
) -> Result<OutTensor> {
    let out_dtype = match to {
        Some(d) if dtype.is_float() => d,
        _ => dtype,
    };
    titan_ckpt::cast::check(dtype, out_dtype)?;
    Ok(OutTensor {
        name,
        source: source.to_string(),
        dtype: out_dtype,
        shape: shape.to_vec(),
        row_map,
    })
}

/// A dcp-hf checkpoint from one writer: every tensor whole, offsets all zero.
fn dcp_hf_single_file(tensors: Vec<OutTensor>) -> OutFilePlan {
    let info: serde_json::Map<String, serde_json::Value> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                serde_json::json!({ "saved_offsets": vec![0u64; t.shape.len()] }),
            )
        })
        .collect();
    let md = [
        (
            formats::DCP_SHARDING_INFO.to_string(),
            serde_json::to_string(&info).expect("json"),
        ),
        ("DCP_VERSION".to_string(), "1.0".to_string()),
        ("format".to_string(), "pt".to_string()),
    ]
    .into();
    OutFilePlan::safetensors(dcp_hf::shard_name(1, 1, 1), tensors, &md)
}
