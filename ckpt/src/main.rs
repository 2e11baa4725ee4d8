use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use titan_cli::{Bin, ExitCode as Code, Level, Verbosity};

use titan_ckpt::adapter::{self, Family, Hints, MapOptions, Naming, TtNames};
use titan_ckpt::consolidate::{self, FileLayout, RankShare};
use titan_ckpt::error::{Error, Result};
use titan_ckpt::formats::{self, dcp_hf};
use titan_ckpt::inspect::{self, VerifyReport};
use titan_ckpt::plan::{Format, is_model_tensor};
use titan_ckpt::write::{EngineOptions, OutFilePlan, OutTensor, Progress};
use titan_ckpt::{Dtype, experts, fp8, storage};

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
#[derive(Parser)]
#[command(
    name = "titan-ckpt",
    version,
    verbatim_doc_comment,
    after_help = TITAN_CKPT.after_help()
)]
struct Cli {
    #[command(flatten)]
    verbosity: Verbosity,
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
    ///
    /// A mixture-of-experts checkpoint is also checked expert by expert: every routed expert of
    /// every layer exactly once (stacked `[E, ...]` tensors: chunks cover experts 0..E with no
    /// gap or overlap, E as the layer's router says; HF's per-expert tensors: none missing),
    /// model and optimizer state alike; errors name the tensor, the layer and the experts
    /// (exit 1). Two experts of one model tensor that are bit-identical (a rank's experts
    /// saved in another's place) are a warning: listed, but exit 0 unless --strict (exit 3),
    /// since a checkpoint upcycled from a dense model starts with copies on purpose.
    #[command(verbatim_doc_comment)]
    Verify(VerifyArgs),
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
struct ShareArgs {
    /// This process's rank among --world-size processes sharing the work (default: RANK under
    /// torchrun, SLURM_PROCID under srun, else 0).
    #[arg(long, requires = "world_size")]
    rank: Option<usize>,
    /// Number of processes sharing the work, each with its own --rank (default: WORLD_SIZE
    /// under torchrun, SLURM_NTASKS under srun, else 1).
    #[arg(long)]
    world_size: Option<usize>,
}

impl ShareArgs {
    /// (rank, world size) from the flags, else torchrun's or SLURM's variables, else (0, 1).
    fn resolve(&self) -> Result<(usize, usize)> {
        let env = |k: &str| -> Result<Option<usize>> {
            match std::env::var(k) {
                Ok(v) => v.trim().parse().map(Some).map_err(|_| {
                    Error::usage(format!("environment variable {k}={v:?} is not a number"))
                }),
                Err(_) => Ok(None),
            }
        };
        let (rank, world, from) = match self.world_size {
            Some(w) => (self.rank.unwrap_or(0), w, "--rank/--world-size"),
            None => match (env("RANK")?, env("WORLD_SIZE")?) {
                (Some(r), Some(w)) => (r, w, "RANK/WORLD_SIZE"),
                _ => match (env("SLURM_PROCID")?, env("SLURM_NTASKS")?) {
                    (Some(r), Some(w)) => (r, w, "SLURM_PROCID/SLURM_NTASKS"),
                    _ => (0, 1, "default"),
                },
            },
        };
        if world == 0 || rank >= world {
            return Err(Error::usage(format!(
                "rank {rank} must be below world size {world} (from {from})"
            )));
        }
        if world > 1 {
            tracing::info!(rank, world, from, "sharing the work across processes");
        }
        Ok((rank, world))
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
    /// Keep only model weights: leave out the optimizer, lr_scheduler, dataloader,
    /// train_state and rng_state tensors of a training checkpoint.
    #[arg(long)]
    model_only: bool,
    #[command(flatten)]
    share: ShareArgs,
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
    #[arg(long, value_parser = cli_value::<Format>())]
    to: Format,
    /// Rename tensors for a model family between torchtitan 0.3.0 (or older llama3) names and
    /// HF names, transforming what differs; --to hf also writes config.json (from the shapes,
    /// torchtitan's flavor defaults for what a checkpoint does not hold, or --hf-config).
    /// Without it, --to hf picks the family as `auto` does when the names are torchtitan's,
    /// and every other case keeps the names (saying so); `none` always keeps them.
    #[arg(long, value_parser = cli_value::<AdapterChoice>())]
    adapter: Option<AdapterChoice>,
    /// Write into an output folder that already holds files (files of the same name are
    /// replaced, others stay).
    #[arg(long)]
    force: bool,
    /// Which torchtitan names to write (--to dcp/dcp-hf with --adapter): torchtitan 0.3.0's
    /// (`attention.qkv_linear.wq`, `lm_head`) or older releases' (`attention.wq`, `output`).
    #[arg(long, value_parser = cli_value::<TtNames>(), default_value = "current")]
    tt_names: TtNames,
    /// Convert floating point tensors to this dtype.
    #[arg(long)]
    dtype: Option<Dtype>,
    /// Keep only model weights: drop optimizer, lr_scheduler, dataloader, train_state and rng_state
    /// entries and every non-tensor item (with --adapter this happens anyway, with a note).
    #[arg(long)]
    model_only: bool,
    /// Attention heads (llama3 needs them for the RoPE permutation unless the model is a known
    /// torchtitan flavor: debugmodel, 1B, 3B, 8B, 70B, 405B; qwen3 reads them from q_norm,
    /// gpt_oss from the attention sinks).
    #[arg(long)]
    n_heads: Option<u64>,
    /// Key/value heads (default: inferred from wk's shape).
    #[arg(long)]
    n_kv_heads: Option<u64>,
    /// RoPE theta written to config.json (default: the family's torchtitan default).
    #[arg(long)]
    rope_theta: Option<f64>,
    /// No RoPE scaling in config.json: llama3 without the Llama-3.1 scaling, gpt_oss and
    /// deepseek_v3 without torchtitan's YaRN.
    #[arg(long)]
    no_rope_scaling: bool,
    /// RMSNorm epsilon written to config.json.
    #[arg(long)]
    norm_eps: Option<f64>,
    /// max_position_embeddings written to config.json.
    #[arg(long)]
    max_position_embeddings: Option<u64>,
    /// Routed experts per token (MoE config.json; not stored in checkpoints; gpt_oss defaults
    /// to torchtitan's 4).
    #[arg(long)]
    experts_per_token: Option<u64>,
    /// For --to hf: copy this config.json instead of writing one from the inferred arguments.
    #[arg(long)]
    hf_config: Option<std::path::PathBuf>,
    /// For --to dcp: compress every item with zstd at this level (torch's ZStandard extension,
    /// transform `stream.zstd/1`; torch uses 3).
    #[arg(long)]
    zstd_level: Option<i32>,
    /// For --to hf: pack tensors into files of at most this size.
    #[arg(long, default_value = "5GB", value_parser = consolidate::parse_size)]
    max_shard_size: u64,
    /// For --to hf: split the output files across processes (dcp and dcp-hf outputs are written
    /// by rank 0 alone).
    #[command(flatten)]
    share: ShareArgs,
    /// Seconds rank 0 waits for the other ranks' files before writing the index.
    #[arg(long, default_value_t = 3600)]
    wait_timeout: u64,
    #[command(flatten)]
    workers: Workers,
}

/// `--adapter` values: every [`Family`] (with its help), `auto` and `none`.
#[derive(Clone, Copy)]
enum AdapterChoice {
    Family(Family),
    Auto,
    None,
}

/// A value of one of the library's enums on the command line: its name and `--help` text. The
/// library knows the values and names; their help is the binary's.
trait CliValue: Copy + Send + Sync + 'static {
    fn all() -> Vec<Self>;
    fn name(self) -> &'static str;
    fn help(self) -> &'static str;
}

/// clap's parser of a [`CliValue`]: the possible values, each with its help.
fn cli_value<T: CliValue>() -> impl clap::builder::TypedValueParser<Value = T> {
    use clap::builder::TypedValueParser;
    let values = T::all()
        .into_iter()
        .map(|v| clap::builder::PossibleValue::new(v.name()).help(v.help()));
    clap::builder::PossibleValuesParser::new(values).map(|s| {
        T::all()
            .into_iter()
            .find(|v| v.name() == s)
            .expect("clap accepts only the possible values")
    })
}

impl CliValue for Format {
    fn all() -> Vec<Self> {
        Format::ALL.to_vec()
    }
    fn name(self) -> &'static str {
        Format::name(self)
    }
    fn help(self) -> &'static str {
        match self {
            Format::Hf => {
                "Hugging Face safetensors: one file, or shards plus model.safetensors.index.json"
            }
            Format::DcpHf => {
                "DCP sharded safetensors (torch HuggingFaceStorageWriter, save_distributed=True)"
            }
            Format::Dcp => {
                "DCP native: pickled `.metadata` plus `__R_K.distcp` files of torch.save items"
            }
        }
    }
}

impl CliValue for TtNames {
    fn all() -> Vec<Self> {
        TtNames::ALL.to_vec()
    }
    fn name(self) -> &'static str {
        TtNames::name(self)
    }
    fn help(self) -> &'static str {
        match self {
            TtNames::Current => "torchtitan 0.3.0 (`attention.qkv_linear.wq`, `lm_head`)",
            TtNames::Legacy => "Older torchtitan releases (`attention.wq`, `output`)",
        }
    }
}

impl CliValue for AdapterChoice {
    fn all() -> Vec<Self> {
        Family::ALL
            .into_iter()
            .map(AdapterChoice::Family)
            .chain([AdapterChoice::Auto, AdapterChoice::None])
            .collect()
    }
    fn name(self) -> &'static str {
        match self {
            AdapterChoice::Family(f) => f.name(),
            AdapterChoice::Auto => "auto",
            AdapterChoice::None => "none",
        }
    }
    fn help(self) -> &'static str {
        match self {
            AdapterChoice::Family(Family::Llama3) => {
                "Llama-3 (torchtitan 0.3.0 or older names): q/k rows permuted between RoPE layouts"
            }
            AdapterChoice::Family(Family::Qwen3) => {
                "Qwen3 dense and MoE: q_norm/k_norm, experts split/stacked, tied embeddings"
            }
            AdapterChoice::Family(Family::DeepseekV3) => {
                "DeepSeek-V3: MLA with or without q-LoRA, routed and shared experts, expert bias, \
                 MTP layers after the main ones"
            }
            AdapterChoice::Family(Family::KimiK27) => {
                "Kimi K2.5/K2.7: a DeepSeek-V3 text model under `language_model.` and the MoonViT \
                 vision encoder (fused qkv split, Conv2d patch embedding as a Linear, projector)"
            }
            AdapterChoice::Family(Family::Qwen35) => {
                "Qwen3.5: full attention and GatedDeltaNet layers (fused q/k/v split), dense FFN or \
                 fused gate/up experts, vision encoder (fused qkv, Conv3d patch embedding) and \
                 merger"
            }
            AdapterChoice::Family(Family::GptOss) => {
                "gpt-oss: biased attention with sinks, router bias, stacked experts transposed per \
                 expert (unquantized; MXFP4 checkpoints need dequantizing first)"
            }
            AdapterChoice::Auto => "Pick the family from the tensor names, and say which.",
            AdapterChoice::None => "Keep the tensor names as they are (no config.json).",
        }
    }
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
struct VerifyArgs {
    #[command(flatten)]
    input: InspectArgs,
    /// Warnings fail too: exit 3 when the checkpoint is whole but verify warned
    /// (bit-identical experts).
    #[arg(long)]
    strict: bool,
}

#[derive(Args)]
struct DiffArgs {
    a: String,
    b: String,
    /// Tensors whose max abs difference is at most this are equal.
    #[arg(long, default_value_t = 0.0)]
    atol: f64,
    /// Compare a torchtitan checkpoint with an HF one: the torchtitan side's model weights
    /// are renamed (and q/k permuted) by this family's adapter first, through a temporary HF
    /// copy in $TMPDIR (as large as its model weights); its training state is left out.
    #[arg(long, value_parser = cli_value::<AdapterChoice>())]
    adapter: Option<AdapterChoice>,
    /// Attention heads, for --adapter llama3 when the model is not a known torchtitan flavor.
    #[arg(long)]
    n_heads: Option<u64>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    workers: Workers,
}

const OK: Code = Code::new(0, "success (diff: the checkpoints match; verify: OK)");
const FAILED: Code = Code::new(
    1,
    "diff found differences, verify failed, or a checkpoint could not be read or written",
);
const USAGE: Code = Code::new(2, "usage error (bad flags or values, wrong kind of input)");
const WARNED: Code = Code::new(
    3,
    "verify --strict: the checkpoint is whole but verify warned (bit-identical experts)",
);

/// The `titan-ckpt` binary: message prefix and exit-code table.
const TITAN_CKPT: Bin = Bin::new("titan-ckpt", &[OK, FAILED, USAGE, WARNED]);

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.verbosity.init_logging(Level::Warn);
    match run(cli.command, cli.verbosity.is_quiet()) {
        Ok(code) => code.into(),
        Err(e) => {
            TITAN_CKPT.error(&e);
            match e {
                Error::Usage(_) => USAGE,
                _ => FAILED,
            }
            .into()
        }
    }
}

/// The library's [`Progress`] drawn as an indicatif bar on stderr.
struct Bar(ProgressBar);

impl Progress for Bar {
    fn set_length(&self, bytes: u64) {
        self.0.set_length(bytes);
    }
    fn inc(&self, bytes: u64) {
        self.0.inc(bytes);
    }
}

fn progress(quiet: bool, what: &str) -> Arc<Bar> {
    if quiet {
        return Arc::new(Bar(ProgressBar::hidden()));
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
    Arc::new(Bar(pb))
}

fn run(cmd: Command, quiet: bool) -> Result<Code> {
    match cmd {
        Command::Inspect(a) => {
            let plan = open_input(&a.path)?;
            let report = inspect::inspect(&plan);
            if a.json {
                println!("{}", serde_json::to_string_pretty(&report).expect("json"));
            } else {
                print!("{}", report.render());
            }
            Ok(OK)
        }
        Command::Verify(a) => verify(&a),
        Command::Diff(a) => {
            let mut pa = open_input(&a.a)?;
            let mut pb = open_input(&a.b)?;
            // The temporary HF copy --adapter compares against lives until the diff is done.
            let _renamed = match a.adapter {
                Some(choice) => Some(diff_in_hf_names(&mut pa, &mut pb, choice, &a, quiet)?),
                None => {
                    let naming =
                        |p: &titan_ckpt::CheckpointPlan| adapter::detect_naming(p.tensors.keys());
                    let word = |n: Naming| match n {
                        Naming::Torchtitan => "torchtitan",
                        Naming::Hf => "HF",
                    };
                    if let (Some(x), Some(y)) = (naming(&pa), naming(&pb))
                        && x != y
                    {
                        let (x, y) = (word(x), word(y));
                        TITAN_CKPT.note(format_args!(
                            "A has {x} names, B {y} names: the same weight is \"only in\" both \
                             sides; --adapter auto compares them in HF names"
                        ));
                    }
                    None
                }
            };
            let bar = progress(quiet || a.json, "diff");
            let report = inspect::diff(&pa, &pb, a.atol, a.workers.count(), bar.as_ref())?;
            bar.0.finish_and_clear();
            if a.json {
                println!("{}", serde_json::to_string_pretty(&report).expect("json"));
            } else {
                print!("{}", report.render());
            }
            Ok(if report.equal { OK } else { FAILED })
        }
        Command::Consolidate(a) => consolidate_cmd(&a, quiet),
        Command::Convert(a) => convert_cmd(&a, quiet),
    }
}

fn verify(v: &VerifyArgs) -> Result<Code> {
    let a = &v.input;
    // A run or checkpoint folder stands for its newest complete step: the report names the
    // step it checked, so "OK" is not read as "every step is OK".
    let (loc, step) = resolve_input(&a.path)?;
    let mut report = VerifyReport {
        path: a.path.clone(),
        checked: step.clone(),
        ok: false,
        format: None,
        tensors: 0,
        chunks: 0,
        block_scaled: 0,
        experts: None,
        error: None,
        warnings: Vec::new(),
    };
    let mut errors = Vec::new();
    match formats::read(&loc) {
        Ok(mut plan) => {
            report.format = Some(plan.format);
            report.tensors = plan.tensors.len();
            report.chunks = plan.tensors.values().map(|t| t.chunks.len()).sum();
            errors = checked_plan(&mut plan, &mut report);
        }
        Err(e @ Error::Usage(_)) => return Err(e),
        Err(e) => errors.push(e.to_string()),
    }
    report.ok = errors.is_empty();
    report.error = (!errors.is_empty()).then(|| errors.join("\n"));
    let what = match &report.checked {
        Some(step) => format!(
            "{} (checked {step}, the newest step whose save committed, only)",
            report.path
        ),
        None => report.path.clone(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("json"));
    } else if report.ok {
        let scales = match report.block_scaled {
            0 => String::new(),
            n => {
                format!("; {n} FP8 weights' block scales fit their shapes, all finite and non-zero")
            }
        };
        let experts = match &report.experts {
            Some(x) if x.tensors > 0 => format!(
                "; {} MoE layers x {} experts, each expert exactly once in {} expert tensors{}",
                x.layers,
                inspect::list(&x.experts_per_layer),
                x.tensors,
                match x.warnings.len() {
                    0 => ", no two bit-identical".to_string(),
                    n => format!(", {n} WARNINGS"),
                }
            ),
            _ => String::new(),
        };
        println!(
            "{what}: OK ({}, {} tensors, {} chunks tile exactly{scales}{experts})",
            report.format.map(|f| f.to_string()).unwrap_or_default(),
            report.tensors,
            report.chunks
        );
        for w in &report.warnings {
            println!("  warning: {w}");
        }
    } else if let [one] = errors.as_slice() {
        println!("{what}: FAILED: {one}");
    } else {
        println!("{what}: FAILED ({} problems):", errors.len());
        for e in &errors {
            println!("  {e}");
        }
    }
    Ok(match (report.ok, report.warnings.is_empty()) {
        (false, _) => FAILED,
        (true, false) if v.strict => WARNED,
        _ => OK,
    })
}

/// `verify`'s checks of a read plan, filling `report`: every tensor's tiling (stacked experts'
/// said per expert), then what `formats::open` finishes with (FP8 scales), DCP items, FP8
/// scales and the experts. Returns the errors.
fn checked_plan(plan: &mut titan_ckpt::CheckpointPlan, report: &mut VerifyReport) -> Vec<String> {
    let tiling: Vec<String> = plan
        .tiling_errors()
        .into_iter()
        .map(
            |(name, e)| match experts::describe_coverage(name, &plan.tensors[name]) {
                Some(said) => Error::tensor(where_chunks_are_listed(plan), name, said).to_string(),
                None => e.to_string(),
            },
        )
        .collect();
    if !tiling.is_empty() {
        return tiling;
    }
    let checked = fp8::attach(plan)
        .and_then(|_| formats::dcp_native::check_items(plan))
        .and_then(|()| fp8::verify(plan))
        .and_then(|n| Ok((n, experts::check(plan)?)));
    match checked {
        Ok((n, x)) => {
            report.block_scaled = n;
            report.warnings = x.warnings.clone();
            let errors = x.errors.clone();
            report.experts = Some(x);
            errors
        }
        Err(e) => vec![e.to_string()],
    }
}

/// The file that lists a checkpoint's chunks (DCP's `.metadata`; the folder for safetensors),
/// which an error about chunks that are not there names.
fn where_chunks_are_listed(plan: &titan_ckpt::CheckpointPlan) -> String {
    match plan.format {
        Format::Dcp => plan.root.display_file(".metadata"),
        _ => plan.root.display(),
    }
}

/// Where a command-line checkpoint is, and the `step-N` folder a run or checkpoint folder
/// resolved to (said in a note).
fn resolve_input(s: &str) -> Result<(storage::Location, Option<String>)> {
    let (loc, step) = formats::resolve_steps(storage::Location::parse(s)?)?;
    if let Some(step) = &step {
        // "Committed", not "complete": `.metadata` is written last, so its save finished,
        // but its shards are only checked when read (issue 39: a short shard was called
        // "the newest complete checkpoint" just before the read failed on it).
        TITAN_CKPT.note(format_args!(
            "using {step}, the newest checkpoint whose save committed (.metadata written)"
        ));
    }
    Ok((loc, step))
}

/// Opens a command-line checkpoint, saying which `step-N` a run or checkpoint folder resolved to.
fn open_input(s: &str) -> Result<titan_ckpt::CheckpointPlan> {
    formats::open(&resolve_input(s)?.0)
}

fn consolidate_cmd(a: &ConsolidateArgs, quiet: bool) -> Result<Code> {
    let (rank, world_size) = a.share.resolve()?;
    let mut plan = open_input(&a.input)?;
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
    let included = keep_model_only(&mut plan, a.model_only);
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
        rank,
        world_size,
        wait_timeout: Duration::from_secs(a.wait_timeout),
    };
    let summary = consolidate::run(&plan, &out, &files, write_index, share, &opts)?;
    bar.0.finish_and_clear();
    eprintln!(
        "rank {}/{}: wrote {} file(s), {}{}; {included}",
        rank,
        world_size,
        summary.files_written.len(),
        inspect::human_bytes(summary.bytes_written),
        if summary.index_written {
            " and the index"
        } else {
            ""
        }
    );
    Ok(OK)
}

/// With `model_only`, drops every training-state tensor (optimizer, lr_scheduler, dataloader,
/// train_state, RNG) and non-tensor item from `plan`. Returns what the output holds, in words
/// for the closing line: a training checkpoint's optimizer state in `model.safetensors` is a
/// surprise unless said.
fn keep_model_only(plan: &mut titan_ckpt::CheckpointPlan, model_only: bool) -> String {
    let total = plan.tensors.len();
    let model = plan.tensors.keys().filter(|n| is_model_tensor(n)).count();
    let state = total - model;
    if model_only {
        plan.tensors.retain(|n, _| is_model_tensor(n));
        plan.bytes_items.clear();
        if state == 0 {
            format!("{model} model tensors (no training state to leave out)")
        } else {
            format!("{model} model tensors; {state} training-state tensors left out (--model-only)")
        }
    } else if state == 0 {
        format!("{model} model tensors")
    } else {
        format!(
            "{total} tensors: {model} model, {state} training state (optimizer, lr_scheduler, \
             dataloader, train_state, RNG; --model-only leaves those out)"
        )
    }
}

fn convert_cmd(a: &ConvertArgs, quiet: bool) -> Result<Code> {
    let (rank, world_size) = a.share.resolve()?;
    let mut plan = open_input(&a.input)?;
    let out = formats::output_root(&a.output)?;
    // Several processes share one output folder and see each other's files appear: only a
    // single writer can tell an earlier output from its own.
    if !a.force && world_size == 1 {
        refuse_existing_output(&out, &a.output)?;
    }
    let family = adapter_family(a, &plan)?;
    let dequantized = note_dequantization(&plan, a.dtype);
    if a.model_only || family.is_some() {
        let before = plan.tensors.len() + plan.bytes_items.len();
        plan.tensors.retain(|n, _| is_model_tensor(n));
        plan.bytes_items.clear();
        let dropped = before - plan.tensors.len();
        if dropped > 0 && !a.model_only {
            TITAN_CKPT.note(format_args!(
                "{dropped} training-state entries (optimizer, lr_scheduler, dataloader, \
                 train_state, RNG) are not model weights; left out"
            ));
        }
    }
    let target_naming = match a.to {
        Format::Hf => Naming::Hf,
        Format::Dcp | Format::DcpHf => Naming::Torchtitan,
    };
    let mut config = None;
    let tensors: Vec<OutTensor> = match family {
        Some(family) => {
            let hints = Hints {
                n_heads: a.n_heads,
                n_kv_heads: a.n_kv_heads,
                rope_theta: a.rope_theta,
                norm_eps: a.norm_eps,
                max_position_embeddings: a.max_position_embeddings,
                experts_per_token: a.experts_per_token,
                no_rope_scaling: a.no_rope_scaling,
            };
            let map = MapOptions {
                to: target_naming,
                tt_names: a.tt_names,
                dtype: a.dtype,
            };
            let (tensors, args) = adapt(&plan, family, &hints, map)?;
            config = Some(args);
            tensors
        }
        None => plan
            .tensors
            .iter()
            .map(|(name, t)| {
                let to = match a.dtype {
                    Some(d) if t.dtype.is_float() => d,
                    _ => t.value_dtype(),
                };
                titan_ckpt::cast::check(t.dtype, to)?;
                Ok(OutTensor::whole(name.clone(), name, t, to))
            })
            .collect::<Result<_>>()?,
    };
    let bar = progress(quiet, "convert");
    let opts = EngineOptions {
        workers: a.workers.count(),
        window_bytes: a.workers.window,
        progress: bar.clone(),
    };
    if a.to != Format::Hf && rank != 0 {
        TITAN_CKPT.note(format_args!(
            "rank {rank}/{world_size}: --to {} is written by rank 0 alone",
            a.to
        ));
        return Ok(OK);
    }
    match a.to {
        Format::Hf => {
            if !plan.bytes_items.is_empty() {
                tracing::warn!(
                    items = plan.bytes_items.len(),
                    "non-tensor items cannot be stored in HF safetensors; skipped"
                );
            }
            let dtype = tensors
                .iter()
                .map(|t| t.dtype)
                .find(|d| d.is_float())
                .unwrap_or(Dtype::F32);
            let files =
                consolidate::plan_files(tensors, &FileLayout::MaxShardSize(a.max_shard_size))?;
            let write_index = files.len() > 1;
            let share = RankShare {
                rank,
                world_size,
                wait_timeout: Duration::from_secs(a.wait_timeout),
            };
            consolidate::run(&plan, &out, &files, write_index, share, &opts)?;
            if rank == 0 {
                write_config(a, &plan, config.as_ref(), dequantized, dtype, &out)?;
            }
        }
        Format::DcpHf => {
            let file = dcp_hf_single_file(tensors);
            titan_ckpt::write::write_files(&plan, &out, &[file], &opts)?;
        }
        Format::Dcp => {
            let output = formats::dcp_native::DcpOutput {
                zstd_level: a.zstd_level,
            };
            formats::dcp_native::write(&plan, &out, &tensors, output, &opts)?;
        }
    }
    bar.0.finish_and_clear();
    eprintln!("converted {} -> {} ({})", a.input, a.output, a.to);
    Ok(OK)
}

/// Every family's name, for messages saying none was found.
const KNOWN_FAMILIES: &str = "llama3, qwen3, deepseek_v3, gpt_oss, kimi_k2_7 or qwen3_5";

/// The family `convert` renames with (None: names kept), from `--adapter` or, without it,
/// the default: `--to hf` is for transformers, which loads only HF names with a config.json,
/// so torchtitan names of a known family are renamed as `auto` would; everything else keeps
/// its names. Either way the choice is said on stderr.
fn adapter_family(a: &ConvertArgs, plan: &titan_ckpt::CheckpointPlan) -> Result<Option<Family>> {
    let detected = || adapter::detect_family(plan);
    match a.adapter {
        Some(AdapterChoice::Family(f)) => Ok(Some(f)),
        Some(AdapterChoice::Auto) => {
            let f = detected().ok_or_else(|| {
                Error::usage(format!(
                    "--adapter auto: no {KNOWN_FAMILIES} tensor names found"
                ))
            })?;
            TITAN_CKPT.note(format_args!("--adapter auto picked {f}"));
            Ok(Some(f))
        }
        Some(AdapterChoice::None) => {
            TITAN_CKPT.note("--adapter none: tensor names kept as they are");
            Ok(None)
        }
        None => {
            let naming = adapter::detect_naming(plan.tensors.keys());
            match (a.to, detected(), naming) {
                (Format::Hf, Some(f), Some(Naming::Torchtitan)) => {
                    TITAN_CKPT.note(format_args!(
                        "no --adapter: picked {f} from the tensor names (as --adapter auto); \
                         --adapter none keeps torchtitan's names"
                    ));
                    Ok(Some(f))
                }
                (Format::Hf, _, Some(Naming::Hf)) => {
                    TITAN_CKPT.note("tensor names kept as they are: they are HF's already");
                    Ok(None)
                }
                (Format::Hf, _, _) if plan.tensors.values().any(|t| t.scales.is_some()) => {
                    TITAN_CKPT.note(format_args!(
                        "tensor names kept as they are (no {KNOWN_FAMILIES} names found); float8 \
                         weights are dequantized"
                    ));
                    Ok(None)
                }
                (Format::Hf, _, _) => {
                    TITAN_CKPT.warning(format_args!(
                        "tensor names kept as they are: no {KNOWN_FAMILIES} names found, so no \
                         config.json either (transformers will not load this as a model; \
                         --adapter FAMILY renames)"
                    ));
                    Ok(None)
                }
                (_, Some(f), Some(Naming::Hf)) => {
                    TITAN_CKPT.note(format_args!(
                        "tensor names kept as they are (HF's); --adapter auto renames them to \
                         torchtitan's ({f})"
                    ));
                    Ok(None)
                }
                _ => {
                    TITAN_CKPT.note("tensor names kept as they are (--adapter renames)");
                    Ok(None)
                }
            }
        }
    }
}

/// For `diff --adapter`: replaces whichever of `pa`/`pb` has torchtitan names by an HF copy
/// of its model weights (the adapter's renaming and q/k permutation, written to a temporary
/// folder, returned so it outlives the diff), so both sides are in HF names.
fn diff_in_hf_names(
    pa: &mut titan_ckpt::CheckpointPlan,
    pb: &mut titan_ckpt::CheckpointPlan,
    choice: AdapterChoice,
    a: &DiffArgs,
    quiet: bool,
) -> Result<Option<tempfile::TempDir>> {
    // The family given, None for `auto` (picked from the torchtitan side's names below).
    let given = match choice {
        AdapterChoice::None => return Ok(None),
        AdapterChoice::Family(f) => Some(f),
        AdapterChoice::Auto => None,
    };
    let naming = |p: &titan_ckpt::CheckpointPlan| adapter::detect_naming(p.tensors.keys());
    let (side, plan) = match (naming(pa), naming(pb)) {
        (Some(Naming::Torchtitan), Some(Naming::Hf)) => ("A", &mut *pa),
        (Some(Naming::Hf), Some(Naming::Torchtitan)) => ("B", &mut *pb),
        (x, y) if x.is_some() && x == y => {
            TITAN_CKPT
                .note("--adapter: both sides have the same kind of names; compared as they are");
            return Ok(None);
        }
        _ => {
            return Err(Error::usage(format!(
                "--adapter: cannot tell torchtitan from HF names in {} or {} (looked for \
                 `tok_embeddings.weight` and `model.embed_tokens.weight`)",
                a.a, a.b
            )));
        }
    };
    let family = match given {
        Some(f) => f,
        None => {
            let f = adapter::detect_family(plan).ok_or_else(|| {
                Error::usage(format!(
                    "--adapter auto: no {KNOWN_FAMILIES} tensor names in {side}"
                ))
            })?;
            TITAN_CKPT.note(format_args!("--adapter auto picked {f} for {side}"));
            f
        }
    };
    let state = plan.tensors.len();
    plan.tensors.retain(|n, _| is_model_tensor(n));
    plan.bytes_items.clear();
    let state = state - plan.tensors.len();
    if state > 0 {
        TITAN_CKPT.note(format_args!(
            "{side}: {state} training-state tensors are not model weights; not compared"
        ));
    }
    let hints = Hints {
        n_heads: a.n_heads,
        ..Hints::default()
    };
    let map = MapOptions {
        to: Naming::Hf,
        tt_names: TtNames::Current,
        dtype: None,
    };
    let (tensors, _) = adapt(plan, family, &hints, map)?;
    let dir = tempfile::Builder::new()
        .prefix("titan-ckpt-diff-")
        .tempdir()
        .map_err(|e| Error::io(std::env::temp_dir().display(), e))?;
    let out = storage::Root::parse(&dir.path().display().to_string())?;
    let bar = progress(quiet || a.json, &format!("{side} in HF names"));
    let opts = EngineOptions {
        workers: a.workers.count(),
        window_bytes: a.workers.window,
        progress: bar.clone(),
    };
    let files = consolidate::plan_files(tensors, &FileLayout::MaxShardSize(5_000_000_000))?;
    let share = RankShare {
        rank: 0,
        world_size: 1,
        wait_timeout: Duration::from_secs(0),
    };
    consolidate::run(plan, &out, &files, files.len() > 1, share, &opts)?;
    bar.0.finish_and_clear();
    *plan = formats::open(&storage::Location {
        root: out,
        file: None,
    })?;
    TITAN_CKPT.note(format_args!(
        "{side} compared in HF names ({family} adapter)"
    ));
    Ok(Some(dir))
}

/// `plan`'s tensors renamed (and transformed) by `family`'s adapter into `map.to`'s names,
/// with the model arguments inferred on the way; what the adapter leaves out is warned about.
fn adapt(
    plan: &titan_ckpt::CheckpointPlan,
    family: Family,
    hints: &Hints,
    map: MapOptions,
) -> Result<(Vec<OutTensor>, adapter::ModelArgs)> {
    let table = family.table();
    let from = adapter::detect_naming(plan.tensors.keys()).ok_or_else(|| {
        Error::usage(format!(
            "--adapter {family}: found neither `tok_embeddings.weight` (torchtitan) nor \
             `model.embed_tokens.weight` (HF) in {}",
            plan.root.display()
        ))
    })?;
    let hint = |e| wrong_family_hint(e, family, plan);
    let args = adapter::args::infer(plan, table, from, hints).map_err(hint)?;
    let planned = adapter::plan_tensors(plan, table, from, &args, map).map_err(hint)?;
    for (name, why) in &planned.dropped {
        TITAN_CKPT.warning(format_args!("`{name}` left out: {why}"));
    }
    Ok((planned.tensors, args))
}

/// A usage error of the adapter for `family` on a checkpoint whose names are another
/// family's (`--adapter qwen3` on a llama3 checkpoint): the error then names the family the
/// names look like, and `auto`.
fn wrong_family_hint(e: Error, family: Family, plan: &titan_ckpt::CheckpointPlan) -> Error {
    match (e, adapter::detect_family(plan)) {
        (Error::Usage(msg), Some(found)) if found != family => Error::Usage(format!(
            "{msg}; the tensor names look like a {found} checkpoint: pass --adapter {found} \
             or --adapter auto"
        )),
        (e, _) => e,
    }
}

/// Refuses to write into an output folder that already holds files: convert would replace
/// some and leave others (a stale shard beside a new index).
fn refuse_existing_output(out: &titan_ckpt::storage::Root, given: &str) -> Result<()> {
    let files = match out.list() {
        Ok(files) => files,
        // Not there yet (or not listable): nothing to overwrite; writing reports real errors.
        Err(_) => return Ok(()),
    };
    if files.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = files.iter().take(3).map(|(n, _)| n.as_str()).collect();
    Err(Error::usage(format!(
        "output {given} already holds {} file(s) ({}{}): pass --force to write into it, or \
         choose a new folder",
        files.len(),
        names.join(", "),
        if files.len() > names.len() {
            ", ..."
        } else {
            ""
        }
    )))
}

/// Says on stderr which float8 weights `convert` dequantizes (and into what); returns whether
/// any are.
fn note_dequantization(plan: &titan_ckpt::CheckpointPlan, dtype: Option<Dtype>) -> bool {
    let scaled: Vec<&titan_ckpt::TensorPlan> = plan
        .tensors
        .values()
        .filter(|t| t.scales.is_some())
        .collect();
    let Some(s) = scaled.first().and_then(|t| t.scales.as_deref()) else {
        return false;
    };
    TITAN_CKPT.note(format_args!(
        "dequantizing {} block-quantized float8 weights ({}x{} blocks, from {}) to {}; their \
         `{}` tensors are consumed",
        scaled.len(),
        s.block[0],
        s.block[1],
        s.block_from,
        dtype
            .unwrap_or(fp8::DEQUANT_DTYPE)
            .to_string()
            .to_lowercase(),
        fp8::SCALE_SUFFIX
    ));
    true
}

/// config.json next to an HF output: copied from --hf-config, else (when float8 weights were
/// dequantized) the input's own config.json, else written from the inferred arguments when the
/// family's class can be described from them. A copied config of dequantized weights loses its
/// `quantization_config` (transformers would otherwise quantize the model again on load) and
/// says the output dtype.
fn write_config(
    a: &ConvertArgs,
    plan: &titan_ckpt::CheckpointPlan,
    args: Option<&adapter::ModelArgs>,
    dequantized: bool,
    dtype: Dtype,
    out: &titan_ckpt::storage::Root,
) -> Result<()> {
    let copied = match &a.hf_config {
        Some(path) => {
            let bytes = std::fs::read(path).map_err(|e| Error::io(path.display(), e))?;
            Some((format!("--hf-config {}", path.display()), bytes))
        }
        None if dequantized && plan.root.list()?.iter().any(|(f, _)| f == "config.json") => {
            let bytes = plan.root.read_small("config.json", 10 << 20)?;
            Some((plan.root.display_file("config.json"), bytes))
        }
        None => None,
    };
    if let Some((from, bytes)) = copied {
        let mut cfg: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| Error::usage(format!("{from}: not JSON: {e}")))?;
        if !dequantized {
            return Ok(out.write_small("config.json", &bytes)?);
        }
        if let Some(o) = cfg.as_object_mut() {
            o.remove("quantization_config");
            for key in ["torch_dtype", "dtype"] {
                if o.contains_key(key) {
                    o.insert(key.into(), dtype.torch_name().into());
                }
            }
        }
        TITAN_CKPT.note(format_args!(
            "config.json: {from} without its quantization_config"
        ));
        let json = serde_json::to_vec_pretty(&cfg).expect("json");
        return Ok(out.write_small("config.json", &json)?);
    }
    let Some(args) = args else { return Ok(()) };
    match adapter::hf_config(args, dtype)? {
        Some(cfg) => {
            for value in &args.assumed {
                TITAN_CKPT.note(format_args!(
                    "config.json: {value}: not in the checkpoint, torchtitan's {} \
                     default (pass --hf-config to copy a config.json instead)",
                    args.family
                ));
            }
            let json = serde_json::to_vec_pretty(&cfg).expect("json");
            Ok(out.write_small("config.json", &json)?)
        }
        None => {
            TITAN_CKPT.warning(format_args!(
                "no config.json written: {}'s HF config needs arguments a \
                 checkpoint does not hold; pass --hf-config",
                args.family
            ));
            Ok(())
        }
    }
}

/// A dcp-hf checkpoint from one writer: every tensor whole, offsets all zero.
fn dcp_hf_single_file(tensors: Vec<OutTensor>) -> OutFilePlan {
    let md =
        dcp_hf::whole_tensors_metadata(tensors.iter().map(|t| (t.name.as_str(), &t.shape[..])));
    OutFilePlan::safetensors(dcp_hf::shard_name(1, 1, 1), tensors, &md)
}
