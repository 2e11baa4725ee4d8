//! The job configuration: torchtitan's sections and key names, loaded from a TOML file plus
//! command-line overrides (`--section.key value` or `--section.key=value`).
//!
//! Every section struct has torchtitan's defaults and denies unknown keys. Loading checks each key
//! of the file and of the overrides against the defaults (so a typo names the key and the file),
//! converts override strings by the type of the key, and deserializes with the key path attached to
//! any type error. Every problem is a [`ConfigError`], which `titan-train` reports with exit code 2.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The config file used when `--job.config_file` is not given.
pub const DEFAULT_CONFIG_FILE: &str = "configs/debug_model.toml";

/// A usage or configuration error: the user must change the command line or the config file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("unknown config key `{key}` (from {origin}); known keys in [{section}]: {known}")]
    UnknownKey {
        key: String,
        origin: String,
        section: String,
        known: String,
    },
    #[error("unknown config section [{section}] (from {origin}); known sections: {known}")]
    UnknownSection {
        section: String,
        origin: String,
        known: String,
    },
    #[error("config key `{key}` (from {origin}): {message}")]
    BadValue {
        key: String,
        origin: String,
        message: String,
    },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
    #[error("{0}")]
    Usage(String),
}

/// `[job]`: what the run is and where its outputs go.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Job {
    pub config_file: Option<String>,
    /// Every output of the run (checkpoints, observability records) goes under this folder.
    pub dump_folder: String,
    pub description: String,
    /// Log the resolved config at startup.
    pub print_config: bool,
}

impl Default for Job {
    fn default() -> Self {
        Self {
            config_file: None,
            dump_folder: "./outputs".into(),
            description: "default job".into(),
            print_config: false,
        }
    }
}

/// `[model]`: which model and tokenizer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Model {
    pub name: String,
    pub flavor: String,
    /// Folder holding `tokenizer.json` (and optionally `tokenizer_config.json`); empty means the
    /// tokenizer embedded in titan-train.
    pub hf_assets_path: String,
    pub converters: Vec<String>,
    pub print_after_conversion: bool,
}

impl Default for Model {
    fn default() -> Self {
        Self {
            name: "llama3".into(),
            flavor: "debugmodel".into(),
            hf_assets_path: String::new(),
            converters: Vec::new(),
            print_after_conversion: false,
        }
    }
}

/// `[optimizer]`: AdamW hyper-parameters.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Optimizer {
    pub name: String,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// torchtitan's `for-loop` / `foreach` / `fused`; all run the same per-tensor update here.
    pub implementation: String,
    pub early_step_in_backward: bool,
}

impl Default for Optimizer {
    fn default() -> Self {
        Self {
            name: "AdamW".into(),
            lr: 8e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            implementation: "fused".into(),
            early_step_in_backward: false,
        }
    }
}

/// `[lr_scheduler]`: warmup, stable and decay phases.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LrScheduler {
    pub warmup_steps: u64,
    /// Fraction of the steps spent decaying; unset means every step after warmup decays.
    pub decay_ratio: Option<f64>,
    /// `linear`, `sqrt` or `cosine`.
    pub decay_type: String,
    pub min_lr_factor: f64,
}

impl Default for LrScheduler {
    fn default() -> Self {
        Self {
            warmup_steps: 200,
            decay_ratio: None,
            decay_type: "linear".into(),
            min_lr_factor: 0.0,
        }
    }
}

/// `[training]`: data, batch, steps.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Training {
    /// `default` (embedded) or a name for the files at `dataset_path`.
    pub dataset: String,
    /// A `.txt`, `.jsonl` or `.parquet` file, or a folder of them.
    pub dataset_path: Option<String>,
    pub local_batch_size: i64,
    /// Samples per optimizer step across all data-parallel ranks; -1 means
    /// local_batch_size * dp degree (no gradient accumulation).
    pub global_batch_size: i64,
    pub seq_len: i64,
    pub max_norm: f64,
    pub steps: u64,
    pub enable_cpu_offload: bool,
    pub mixed_precision_param: String,
    pub mixed_precision_reduce: String,
    pub gc_freq: u64,
    pub gc_debug: bool,
    /// `auto` (CUDA when available), `cpu` or `cuda`.
    pub device: String,
}

impl Default for Training {
    fn default() -> Self {
        Self {
            dataset: "default".into(),
            dataset_path: None,
            local_batch_size: 8,
            global_batch_size: -1,
            seq_len: 2048,
            max_norm: 1.0,
            steps: 10000,
            enable_cpu_offload: false,
            mixed_precision_param: "bfloat16".into(),
            mixed_precision_reduce: "float32".into(),
            gc_freq: 50,
            gc_debug: false,
            device: "auto".into(),
        }
    }
}

/// `[parallelism]`: degrees of each parallelism dimension.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Parallelism {
    pub data_parallel_replicate_degree: i64,
    /// -1 means "the ranks left over by the other degrees".
    pub data_parallel_shard_degree: i64,
    pub fsdp_reshard_after_forward: String,
    pub tensor_parallel_degree: i64,
    pub context_parallel_degree: i64,
    pub pipeline_parallel_degree: i64,
    pub expert_parallel_degree: i64,
    pub enable_compiled_autograd: bool,
    pub disable_loss_parallel: bool,
}

impl Default for Parallelism {
    fn default() -> Self {
        Self {
            data_parallel_replicate_degree: 1,
            data_parallel_shard_degree: -1,
            fsdp_reshard_after_forward: "default".into(),
            tensor_parallel_degree: 1,
            context_parallel_degree: 1,
            pipeline_parallel_degree: 1,
            expert_parallel_degree: 1,
            enable_compiled_autograd: false,
            disable_loss_parallel: false,
        }
    }
}

/// `[checkpoint]`: saving and loading (DCP).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Checkpoint {
    pub enable: bool,
    /// Relative to `job.dump_folder`.
    pub folder: String,
    pub interval: u64,
    pub initial_load_path: Option<String>,
    pub initial_load_model_only: bool,
    pub initial_load_in_hf: bool,
    pub last_save_model_only: bool,
    pub last_save_in_hf: bool,
    pub export_dtype: String,
    /// `disabled`, `async` or `async_with_pinned_mem`.
    pub async_mode: String,
    /// 0 keeps every checkpoint.
    pub keep_latest_k: u64,
    /// -1 loads the latest step.
    pub load_step: i64,
    pub exclude_from_loading: Vec<String>,
    pub enable_first_step_checkpoint: bool,
    pub create_seed_checkpoint: bool,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Self {
            enable: false,
            folder: "checkpoint".into(),
            interval: 500,
            initial_load_path: None,
            initial_load_model_only: true,
            initial_load_in_hf: false,
            last_save_model_only: true,
            last_save_in_hf: false,
            export_dtype: "float32".into(),
            async_mode: "disabled".into(),
            keep_latest_k: 10,
            load_step: -1,
            exclude_from_loading: Vec::new(),
            enable_first_step_checkpoint: false,
            create_seed_checkpoint: false,
        }
    }
}

/// `[metrics]`: console metrics.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Metrics {
    pub log_freq: u64,
    pub enable_tensorboard: bool,
    pub disable_color_printing: bool,
    pub save_tb_folder: String,
    pub save_for_all_ranks: bool,
    pub enable_wandb: bool,
    /// Peak TFLOPS used for MFU; 0 means the GPU table (H100/A100/H200 bf16 dense) on CUDA and
    /// 1 TFLOPS on CPU, where no table applies.
    pub peak_tflops: f64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            log_freq: 10,
            enable_tensorboard: false,
            disable_color_printing: false,
            save_tb_folder: "tb".into(),
            save_for_all_ranks: false,
            enable_wandb: false,
            peak_tflops: 0.0,
        }
    }
}

/// `[validation]`: periodic loss on a held-out split.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Validation {
    pub enable: bool,
    pub dataset: String,
    pub dataset_path: Option<String>,
    pub local_batch_size: i64,
    pub seq_len: i64,
    pub freq: u64,
    /// Batches per validation; -1 runs the whole split once.
    pub steps: i64,
}

impl Default for Validation {
    fn default() -> Self {
        Self {
            enable: false,
            dataset: "default_validation".into(),
            dataset_path: None,
            local_batch_size: 8,
            seq_len: 2048,
            freq: 500,
            steps: -1,
        }
    }
}

/// `[debug]`: seeding and determinism.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Debug {
    pub seed: Option<u64>,
    pub deterministic: bool,
    pub deterministic_warn_only: bool,
}

/// `[observability]`: titan-obs recording of spans and scalars under `job.dump_folder`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Observability {
    pub enable: bool,
    pub flush_interval_s: f64,
}

impl Default for Observability {
    fn default() -> Self {
        Self {
            enable: true,
            flush_interval_s: 2.0,
        }
    }
}

/// `[comm]`: the distributed runtime's timeouts (torchtitan's names).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Comm {
    /// Rendezvous, connection setup and the first collective must finish within this.
    pub init_timeout_seconds: i64,
    /// After the first step: a collective whose peers make no progress for this long fails,
    /// naming the rank it waited for.
    pub train_timeout_seconds: i64,
    /// Accepted for torchtitan config compatibility (its NCCL flight-recorder size); unused.
    pub trace_buf_size: i64,
}

impl Default for Comm {
    fn default() -> Self {
        Self {
            init_timeout_seconds: 300,
            train_timeout_seconds: 100,
            trace_buf_size: 20000,
        }
    }
}

/// The whole job configuration, one field per torchtitan section.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct JobConfig {
    pub job: Job,
    pub model: Model,
    pub optimizer: Optimizer,
    pub lr_scheduler: LrScheduler,
    pub training: Training,
    pub parallelism: Parallelism,
    pub checkpoint: Checkpoint,
    pub metrics: Metrics,
    pub validation: Validation,
    pub debug: Debug,
    pub observability: Observability,
    pub comm: Comm,
}

/// One `--section.key value` from the command line, value still a string.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub key: String,
    pub value: String,
}

/// Splits command-line arguments into overrides. A key without a value (`--debug.deterministic`
/// followed by another `--key` or nothing) means `true`.
pub fn parse_overrides<I: IntoIterator<Item = String>>(
    args: I,
) -> Result<Vec<Override>, ConfigError> {
    let mut out = Vec::new();
    let mut args = args.into_iter().peekable();
    while let Some(arg) = args.next() {
        let Some(body) = arg.strip_prefix("--") else {
            return Err(ConfigError::Usage(format!(
                "unexpected argument `{arg}`: options are `--section.key value` (see --help)"
            )));
        };
        let (key, value) = match body.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => {
                let takes_next = args.peek().is_some_and(|next| !next.starts_with("--"));
                let value = if takes_next {
                    args.next().unwrap_or_default()
                } else {
                    "true".to_string()
                };
                (body.to_string(), value)
            }
        };
        if !key.contains('.') {
            return Err(ConfigError::Usage(format!(
                "unexpected option `--{key}`: config options are `--section.key value`, e.g. `--training.steps 10` (see --help)"
            )));
        }
        out.push(Override { key, value });
    }
    Ok(out)
}

impl JobConfig {
    /// Loads the config: defaults, then the TOML file (`--job.config_file`, else
    /// [`DEFAULT_CONFIG_FILE`] when it exists), then the overrides in order.
    pub fn load(overrides: &[Override]) -> Result<Self, ConfigError> {
        let file = overrides
            .iter()
            .rev()
            .find(|o| o.key == "job.config_file")
            .map(|o| PathBuf::from(&o.value))
            .or_else(|| {
                let default = Path::new(DEFAULT_CONFIG_FILE);
                default.exists().then(|| default.to_path_buf())
            });
        let toml_text = match &file {
            Some(path) => {
                Some(
                    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                        path: path.clone(),
                        source,
                    })?,
                )
            }
            None => None,
        };
        let mut cfg = Self::from_parts(
            toml_text
                .as_deref()
                .map(|t| (t, file.as_deref().unwrap_or(Path::new("")))),
            overrides,
        )?;
        if let Some(path) = file {
            cfg.job.config_file = Some(path.display().to_string());
        }
        Ok(cfg)
    }

    /// Builds the config from an optional (TOML text, its path) and overrides.
    pub fn from_parts(
        toml_file: Option<(&str, &Path)>,
        overrides: &[Override],
    ) -> Result<Self, ConfigError> {
        let schema = serde_json::to_value(JobConfig::default()).expect("defaults serialize");
        let Value::Object(schema) = schema else {
            unreachable!("JobConfig serializes to a map")
        };
        let mut merged = schema.clone();

        if let Some((text, path)) = toml_file {
            let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
            let origin = path.display().to_string();
            for (section, body) in table {
                let toml::Value::Table(body) = body else {
                    return Err(ConfigError::BadValue {
                        key: section,
                        origin,
                        message: "expected a [section] table".into(),
                    });
                };
                for (key, value) in body {
                    let full = format!("{section}.{key}");
                    check_known(&schema, &section, &key, &origin)?;
                    let json = serde_json::to_value(&value).map_err(|e| ConfigError::BadValue {
                        key: full.clone(),
                        origin: origin.clone(),
                        message: e.to_string(),
                    })?;
                    set(&mut merged, &section, &key, json);
                }
            }
        }

        for o in overrides {
            let origin = "the command line".to_string();
            let (section, key) = o.key.split_once('.').ok_or_else(|| {
                ConfigError::Usage(format!("option `--{}` is not `--section.key`", o.key))
            })?;
            check_known(&schema, section, key, &origin)?;
            let default = &schema[section][key];
            let value =
                convert_override(default, &o.value).map_err(|message| ConfigError::BadValue {
                    key: o.key.clone(),
                    origin: origin.clone(),
                    message,
                })?;
            set(&mut merged, section, key, value);
        }

        let cfg: JobConfig =
            serde_path_to_error::deserialize(Value::Object(merged)).map_err(|e| {
                ConfigError::Invalid {
                    key: e.path().to_string(),
                    message: e.inner().to_string(),
                }
            })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the values that types alone cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, message: String| {
            Err(ConfigError::Invalid {
                key: key.into(),
                message,
            })
        };
        if !["linear", "sqrt", "cosine"].contains(&self.lr_scheduler.decay_type.as_str()) {
            return bad(
                "lr_scheduler.decay_type",
                format!(
                    "`{}` is not one of linear, sqrt, cosine",
                    self.lr_scheduler.decay_type
                ),
            );
        }
        if let Some(r) = self.lr_scheduler.decay_ratio
            && !(0.0..=1.0).contains(&r)
        {
            return bad("lr_scheduler.decay_ratio", format!("{r} is not in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.lr_scheduler.min_lr_factor) {
            return bad(
                "lr_scheduler.min_lr_factor",
                format!("{} is not in [0, 1]", self.lr_scheduler.min_lr_factor),
            );
        }
        if self.optimizer.name != "AdamW" {
            return bad(
                "optimizer.name",
                format!("`{}` is not supported (only AdamW)", self.optimizer.name),
            );
        }
        if !["for-loop", "foreach", "fused"].contains(&self.optimizer.implementation.as_str()) {
            return bad(
                "optimizer.implementation",
                format!(
                    "`{}` is not one of for-loop, foreach, fused",
                    self.optimizer.implementation
                ),
            );
        }
        if self.model.name != "llama3" {
            return bad(
                "model.name",
                format!("`{}` is not supported (only llama3)", self.model.name),
            );
        }
        for (key, v) in [
            ("training.local_batch_size", self.training.local_batch_size),
            ("training.seq_len", self.training.seq_len),
            (
                "validation.local_batch_size",
                self.validation.local_batch_size,
            ),
            ("validation.seq_len", self.validation.seq_len),
        ] {
            if v < 1 {
                return bad(key, format!("{v} must be at least 1"));
            }
        }
        if self.metrics.log_freq == 0 {
            return bad("metrics.log_freq", "must be at least 1".into());
        }
        if self.validation.enable && self.validation.freq == 0 {
            return bad("validation.freq", "must be at least 1".into());
        }
        if !["auto", "cpu", "cuda"].contains(&self.training.device.as_str()) {
            return bad(
                "training.device",
                format!("`{}` is not one of auto, cpu, cuda", self.training.device),
            );
        }
        if !self.model.converters.is_empty() {
            return bad(
                "model.converters",
                "model converters (float8, ...) are not supported".into(),
            );
        }
        for (key, v) in [
            (
                "parallelism.tensor_parallel_degree",
                self.parallelism.tensor_parallel_degree,
            ),
            (
                "parallelism.context_parallel_degree",
                self.parallelism.context_parallel_degree,
            ),
            (
                "parallelism.pipeline_parallel_degree",
                self.parallelism.pipeline_parallel_degree,
            ),
            (
                "parallelism.expert_parallel_degree",
                self.parallelism.expert_parallel_degree,
            ),
        ] {
            if v != 1 {
                return bad(
                    key,
                    format!("{v} is not supported: titan-train does data parallelism only"),
                );
            }
        }
        for (key, v) in [
            (
                "observability.flush_interval_s",
                self.observability.flush_interval_s,
            ),
            (
                "comm.init_timeout_seconds",
                self.comm.init_timeout_seconds as f64,
            ),
            (
                "comm.train_timeout_seconds",
                self.comm.train_timeout_seconds as f64,
            ),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return bad(
                    key,
                    format!("{v} must be a number of seconds greater than 0"),
                );
            }
        }
        Ok(())
    }
}

fn check_known(
    schema: &Map<String, Value>,
    section: &str,
    key: &str,
    origin: &str,
) -> Result<(), ConfigError> {
    let Some(Value::Object(keys)) = schema.get(section) else {
        return Err(ConfigError::UnknownSection {
            section: section.into(),
            origin: origin.into(),
            known: schema.keys().cloned().collect::<Vec<_>>().join(", "),
        });
    };
    if !keys.contains_key(key) {
        return Err(ConfigError::UnknownKey {
            key: format!("{section}.{key}"),
            origin: origin.into(),
            section: section.into(),
            known: keys.keys().cloned().collect::<Vec<_>>().join(", "),
        });
    }
    Ok(())
}

fn set(merged: &mut Map<String, Value>, section: &str, key: &str, value: Value) {
    if let Some(Value::Object(keys)) = merged.get_mut(section) {
        keys.insert(key.to_string(), value);
    }
}

/// Converts a command-line string to the JSON type of the key's default value.
fn convert_override(default: &Value, raw: &str) -> Result<Value, String> {
    match default {
        Value::Bool(_) => match raw {
            "true" | "True" | "1" => Ok(Value::Bool(true)),
            "false" | "False" | "0" => Ok(Value::Bool(false)),
            _ => Err(format!("expected true or false, got `{raw}`")),
        },
        Value::Number(n) if n.is_f64() => raw
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| format!("expected a number, got `{raw}`")),
        Value::Number(_) => raw
            .parse::<i64>()
            .map(|v| Value::Number(v.into()))
            .map_err(|_| format!("expected an integer, got `{raw}`")),
        Value::String(_) => Ok(Value::String(raw.to_string())),
        // torchtitan's list options are comma-separated on the command line.
        Value::Array(_) => Ok(Value::Array(
            raw.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| Value::String(s.to_string()))
                .collect(),
        )),
        // Optional keys (unset by default): read the value as a TOML literal, else a string.
        Value::Null | Value::Object(_) => {
            if raw == "none" || raw == "None" {
                return Ok(Value::Null);
            }
            match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
                Ok(mut t) => serde_json::to_value(t.remove("v")).map_err(|e| e.to_string()),
                Err(_) => Ok(Value::String(raw.to_string())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ov(args: &[&str]) -> Vec<Override> {
        parse_overrides(args.iter().map(|s| s.to_string())).unwrap()
    }

    #[test]
    fn defaults_match_torchtitan() {
        let c = JobConfig::from_parts(None, &[]).unwrap();
        assert_eq!(c.optimizer.lr, 8e-4);
        assert_eq!(c.optimizer.beta2, 0.95);
        assert_eq!(c.training.max_norm, 1.0);
        assert_eq!(c.parallelism.data_parallel_shard_degree, -1);
        assert_eq!(c.checkpoint.keep_latest_k, 10);
        assert_eq!(c.checkpoint.export_dtype, "float32");
        assert_eq!(c.lr_scheduler.decay_ratio, None);
    }

    #[test]
    fn file_then_overrides_both_spellings() {
        let toml = "[training]\nsteps = 5\nseq_len = 64\n[optimizer]\nlr = 1\n";
        let c = JobConfig::from_parts(
            Some((toml, Path::new("x.toml"))),
            &ov(&[
                "--training.steps",
                "7",
                "--debug.seed=42",
                "--debug.deterministic",
                "--lr_scheduler.decay_ratio",
                "0.8",
                "--job.description",
                "123",
            ]),
        )
        .unwrap();
        assert_eq!(c.training.steps, 7);
        assert_eq!(c.training.seq_len, 64);
        assert_eq!(c.optimizer.lr, 1.0);
        assert_eq!(c.debug.seed, Some(42));
        assert!(c.debug.deterministic);
        assert_eq!(c.lr_scheduler.decay_ratio, Some(0.8));
        assert_eq!(c.job.description, "123");
    }

    #[test]
    fn unknown_key_names_it() {
        let err = JobConfig::from_parts(None, &ov(&["--training.stepz", "3"])).unwrap_err();
        assert!(err.to_string().contains("`training.stepz`"), "{err}");
        let err = JobConfig::from_parts(Some(("[trainin]\nsteps = 1\n", Path::new("f.toml"))), &[])
            .unwrap_err();
        assert!(err.to_string().contains("[trainin]"), "{err}");
        assert!(err.to_string().contains("f.toml"), "{err}");
    }

    #[test]
    fn wrong_type_names_key() {
        let err = JobConfig::from_parts(None, &ov(&["--training.steps", "ten"])).unwrap_err();
        assert!(err.to_string().contains("`training.steps`"), "{err}");
        let err = JobConfig::from_parts(
            Some(("[training]\nsteps = \"ten\"\n", Path::new("f.toml"))),
            &[],
        )
        .unwrap_err();
        assert!(err.to_string().contains("training.steps"), "{err}");
        let err =
            JobConfig::from_parts(None, &ov(&["--lr_scheduler.decay_ratio", "x"])).unwrap_err();
        assert!(
            err.to_string().contains("lr_scheduler.decay_ratio"),
            "{err}"
        );
    }
}
