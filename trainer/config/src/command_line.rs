//! The command line, in either of torchtitan's two forms, read onto one [`JobConfig`]:
//!
//! - the TOML form of torchtitan before 0.3 (and of titan's `configs/`): `--job.config_file FILE`
//!   (else the embedded debug config) and `--section.key value` overrides;
//! - torchtitan 0.3.0's form: `--module llama3 --config llama3_debugmodel` picks a config
//!   function of its registry ([`REGISTRY`]; each is a TOML file under `configs/registry/`, the
//!   function's values in titan's layout), then overrides with 0.3.0's key names
//!   (`--dump_folder`, `--hf_assets_path`, `--dataloader.dataset_path`, `--validator.enable`,
//!   `--optimizer.param_groups.0.optimizer_kwargs.lr`, ...) and tyro's spellings: `-` or `_`
//!   in keys, booleans as flags (`--checkpoint.enable`, `--checkpoint.no-enable`), the
//!   activation-checkpointing subcommand `activation_checkpoint:full|selective|none`.
//!
//! Either form takes either key spelling. 0.3.0 keys titan has no field for are accepted only at
//! values that change nothing here ([`NO_EFFECT`]); anything else is a [`ConfigError`] (exit 2).

use std::path::{Path, PathBuf};

use crate::{ConfigError, DEFAULT_CONFIG, DEFAULT_CONFIG_FILE, JobConfig, Override};

/// A torchtitan 0.3.0 config function titan implements, as the TOML of its values.
#[derive(Debug)]
pub struct Registered {
    pub module: &'static str,
    pub name: &'static str,
    pub toml: &'static str,
}

/// torchtitan 0.3.0's config registries titan implements (`torchtitan/models/*/config_registry.py`).
/// The 405B entry asks for torch.compile, which titan-train refuses, naming the key.
pub const REGISTRY: &[Registered] = &[
    Registered {
        module: "llama3",
        name: "llama3_debugmodel",
        toml: include_str!("../../../configs/registry/llama3_debugmodel.toml"),
    },
    Registered {
        module: "llama3",
        name: "llama3_debugmodel_varlen_attn",
        toml: include_str!("../../../configs/registry/llama3_debugmodel_varlen_attn.toml"),
    },
    Registered {
        module: "llama3",
        name: "llama3_debugmodel_ce_loss",
        toml: include_str!("../../../configs/registry/llama3_debugmodel_ce_loss.toml"),
    },
    Registered {
        module: "llama3",
        name: "llama3_debugmodel_float8",
        toml: include_str!("../../../configs/registry/llama3_debugmodel_float8.toml"),
    },
    Registered {
        module: "llama3",
        name: "llama3_8b",
        toml: include_str!("../../../configs/registry/llama3_8b.toml"),
    },
    Registered {
        module: "llama3",
        name: "llama3_70b",
        toml: include_str!("../../../configs/registry/llama3_70b.toml"),
    },
    Registered {
        module: "llama3",
        name: "llama3_405b",
        toml: include_str!("../../../configs/registry/llama3_405b.toml"),
    },
    Registered {
        module: "qwen3",
        name: "qwen3_debugmodel",
        toml: include_str!("../../../configs/registry/qwen3_debugmodel.toml"),
    },
    Registered {
        module: "qwen3",
        name: "qwen3_moe_debug",
        toml: include_str!("../../../configs/registry/qwen3_moe_debug.toml"),
    },
    Registered {
        module: "deepseek_v3",
        name: "deepseek_v3_debugmodel",
        toml: include_str!("../../../configs/registry/deepseek_v3_debugmodel.toml"),
    },
];

/// torchtitan 0.3.0 key -> titan's key for the same setting.
const ALIASES: &[(&str, &str)] = &[
    ("dump_folder", "job.dump_folder"),
    ("hf_assets_path", "model.hf_assets_path"),
    ("dataloader.dataset", "training.dataset"),
    ("dataloader.dataset_path", "training.dataset_path"),
    ("validator.enable", "validation.enable"),
    ("validator.freq", "validation.freq"),
    ("validator.steps", "validation.steps"),
    ("validator.dataloader.dataset", "validation.dataset"),
    (
        "validator.dataloader.dataset_path",
        "validation.dataset_path",
    ),
    ("optimizer.param_groups.0.optimizer_name", "optimizer.name"),
    (
        "optimizer.param_groups.0.optimizer_kwargs.lr",
        "optimizer.lr",
    ),
    (
        "optimizer.param_groups.0.optimizer_kwargs.eps",
        "optimizer.eps",
    ),
    (
        "optimizer.param_groups.0.optimizer_kwargs.weight_decay",
        "optimizer.weight_decay",
    ),
    ("debug.print_config", "job.print_config"),
    // torchtitan's older spelling of `[memory_estimation]`'s switch.
    ("memory_estimation.enabled", "memory_estimation.enable"),
];

/// Values a [`NO_EFFECT`] key accepts.
enum Accepts {
    /// Any value: the setting chooses between implementations titan does not have, with the
    /// same results.
    Any,
    /// Only these spellings of torchtitan's default.
    Only(&'static [&'static str]),
}

/// torchtitan 0.3.0 keys titan-train has no field for, the values it accepts, and why they
/// change nothing here.
const NO_EFFECT: &[(&str, Accepts, &str)] = &[
    (
        "parallelism.spmd_backend",
        Accepts::Only(&["spmd_types", "partial_dtensor", "full_dtensor"]),
        "how torchtitan expresses sharded tensors; titan-train has one implementation",
    ),
    (
        "training.disable_cuda_graphs",
        Accepts::Any,
        "titan-train captures no CUDA graphs",
    ),
    (
        "parallelism.enable_fsdp_symm_mem",
        Accepts::Only(&["false"]),
        "",
    ),
    (
        "dataloader.num_workers",
        Accepts::Only(&["0"]),
        "titan-train reads data on a thread of the training process (training.prefetch_batches)",
    ),
    (
        "dataloader.persistent_workers",
        Accepts::Only(&["false"]),
        "",
    ),
    ("dataloader.pin_memory", Accepts::Only(&["false"]), ""),
    ("dataloader.prefetch_factor", Accepts::Only(&["none"]), ""),
    (
        "dataloader.infinite",
        Accepts::Only(&["true"]),
        "the training data re-loops",
    ),
    (
        "validator.dataloader.infinite",
        Accepts::Only(&["false"]),
        "",
    ),
    (
        "validator.dataloader.num_workers",
        Accepts::Only(&["0"]),
        "",
    ),
    (
        "loss.num_chunks",
        Accepts::Only(&["8"]),
        "the loss of the whole sequence is the same value; titan-train does not split it",
    ),
    (
        "debug.enable_structured_logging",
        Accepts::Any,
        "titan-train records every phase with titan-obs (observability.enable)",
    ),
    (
        "profiler.enable_profiling",
        Accepts::Only(&["false"]),
        "titan-train has no torch profiler; titan-obs records every phase",
    ),
    (
        "compile.enable_async_tensor_parallel",
        Accepts::Only(&["false"]),
        "",
    ),
    ("comm.mode", Accepts::Only(&["default"]), ""),
    ("checkpoint.load_only", Accepts::Only(&["false"]), ""),
    (
        "checkpoint.initial_load_in_hf_quantized",
        Accepts::Only(&["false"]),
        "",
    ),
    ("debug.spmd_typechecking", Accepts::Only(&["false"]), ""),
    ("debug.detect_anomaly", Accepts::Only(&["false"]), ""),
    ("debug.batch_invariant", Accepts::Only(&["false"]), ""),
    (
        "activation_checkpoint.preserve_rng_state",
        Accepts::Any,
        "the model draws no random numbers in forward",
    ),
    (
        "activation_checkpoint.determinism_check",
        Accepts::Only(&["default"]),
        "",
    ),
    ("activation_checkpoint.debug", Accepts::Only(&["false"]), ""),
    (
        "optimizer.param_groups.0.pattern",
        Accepts::Only(&[".*"]),
        "",
    ),
];

/// The parsed command line.
#[derive(Debug, Default)]
pub struct CommandLine {
    /// `--module M --config C`: the registry entry the config starts from.
    pub registry: Option<&'static Registered>,
    /// Overrides in titan's key names, in order.
    pub overrides: Vec<Override>,
    /// What the reader accepted without effect or found contradictory: warnings for the log.
    pub notes: Vec<String>,
}

// Loading lives beside the command line it reads, so the schema below it imports nothing above.
impl JobConfig {
    /// Loads the config: defaults, then the registry entry (`--module/--config`), or the TOML
    /// file (`--job.config_file`, else the embedded [`DEFAULT_CONFIG`](crate::DEFAULT_CONFIG)), then the overrides in
    /// order.
    pub fn load(command_line: &CommandLine) -> Result<Self, ConfigError> {
        let overrides = &command_line.overrides;
        if let Some(entry) = command_line.registry {
            let origin = format!(
                "torchtitan 0.3.0's {}.{} (configs/registry/{}.toml)",
                entry.module, entry.name, entry.name
            );
            return Self::from_parts(Some((entry.toml, Path::new(&origin))), overrides);
        }
        let file = overrides
            .iter()
            .rev()
            .find(|o| o.key == "job.config_file")
            .map(|o| PathBuf::from(&o.value));
        let Some(path) = file else {
            let origin = format!("the embedded {DEFAULT_CONFIG_FILE}");
            return Self::from_parts(Some((DEFAULT_CONFIG, Path::new(&origin))), overrides);
        };
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        let mut cfg = Self::from_parts(Some((&text, &path)), overrides)?;
        cfg.job.config_file = Some(path.display().to_string());
        Ok(cfg)
    }
}

/// The titan key a boolean-looking flag sets, when `key` names a boolean field of `schema`.
fn is_bool(schema: &serde_json::Value, key: &str) -> bool {
    let Some((section, field)) = key.split_once('.') else {
        return false;
    };
    schema[section][field].is_boolean()
}

/// The titan key for a (normalised) key of either spelling.
fn titan_key(key: &str) -> &str {
    ALIASES
        .iter()
        .find(|(from, _)| *from == key)
        .map_or(key, |(_, to)| to)
}

fn usage(message: String) -> ConfigError {
    ConfigError::Usage(message)
}

type Args = std::iter::Peekable<std::vec::IntoIter<String>>;

/// Reads the arguments (launcher flags and `-v`/`-q` already removed).
pub fn parse(args: Vec<String>) -> Result<CommandLine, ConfigError> {
    let schema = serde_json::to_value(JobConfig::default()).expect("the default config serializes");
    let mut out = CommandLine::default();
    let (mut module, mut config) = (None, None);
    let mut args = args.into_iter().peekable();
    while let Some(arg) = args.next() {
        let Some(body) = arg.strip_prefix("--") else {
            // tyro's subcommand for the activation-checkpointing union.
            if let Some((section, mode)) = arg.split_once(':')
                && section.replace('-', "_") == "activation_checkpoint"
            {
                out.overrides
                    .extend(activation_checkpoint_subcommand(mode)?);
                continue;
            }
            return Err(usage(format!(
                "unexpected argument `{arg}`: options are `--section.key value` (see --help)"
            )));
        };
        let (raw_key, inline) = match body.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string())),
            None => (body, None),
        };
        // `--quantize.linear.float8.KEY` is `[float8]`'s KEY (config::NESTED_SECTIONS).
        let key = crate::unnest_key(&raw_key.replace('-', "_"));
        let take_value = |args: &mut Args, what: &str| -> Result<String, ConfigError> {
            if let Some(v) = inline.clone() {
                return Ok(v);
            }
            match args.next_if(|next| !next.starts_with("--")) {
                Some(v) => Ok(v),
                None => Err(usage(format!("--{raw_key} needs a value ({what})"))),
            }
        };
        match key.as_str() {
            "module" => {
                module = Some(take_value(&mut args, "e.g. --module llama3")?);
                continue;
            }
            "config" => {
                config = Some(take_value(&mut args, "e.g. --config llama3_debugmodel")?);
                continue;
            }
            _ => {}
        }
        // `--x.no_flag`: tyro's false for boolean `x.flag`.
        let negated = key
            .rsplit_once('.')
            .and_then(|(head, last)| last.strip_prefix("no_").map(|f| format!("{head}.{f}")))
            .filter(|k| is_bool(&schema, titan_key(k)));
        if let Some(positive) = negated {
            if inline.is_some() {
                return Err(usage(format!("--{raw_key} is a flag and takes no value")));
            }
            push(&mut out, &positive, "false".into())?;
            continue;
        }
        let value = if is_bool(&schema, titan_key(&key)) {
            // A flag alone is true; `--flag true|false` (and `=`) as the TOML form writes it.
            match inline {
                Some(v) => v,
                None => args
                    .next_if(|next| matches!(next.to_ascii_lowercase().as_str(), "true" | "false"))
                    .unwrap_or_else(|| "true".into()),
            }
        } else if inline.is_none() && args.peek().is_none_or(|next| next.starts_with("--")) {
            // A key alone that is no boolean: a value is missing, or (a key titan does not know)
            // a flag that the config check then names.
            let titan = titan_key(&key);
            if !titan.contains('.') {
                return Err(usage(format!(
                    "unexpected option `--{raw_key}`: config options are `--section.key value`, e.g. `--training.steps 10` (see --help)"
                )));
            }
            let (section, field) = titan.split_once('.').expect("checked above");
            if schema.get(section).is_some_and(|s| s.get(field).is_some()) {
                return Err(usage(format!("--{raw_key} needs a value")));
            }
            "true".into()
        } else {
            take_value(&mut args, "a value")?
        };
        push(&mut out, &key, value)?;
    }
    out.registry = match (module, config) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(usage(
                "--config is required with --module. Example: --module llama3 --config llama3_debugmodel"
                    .into(),
            ));
        }
        (None, Some(_)) => {
            return Err(usage(
                "--module is required with --config. Example: --module llama3 --config llama3_debugmodel"
                    .into(),
            ));
        }
        (Some(m), Some(c)) => Some(lookup(&m, &c)?),
    };
    if out.registry.is_some() && out.overrides.iter().any(|o| o.key == "job.config_file") {
        return Err(usage(
            "--job.config_file and --module/--config both choose the starting config: give one"
                .into(),
        ));
    }
    Ok(out)
}

/// The registry entry `module`/`config`, or an error listing what there is.
fn lookup(module: &str, config: &str) -> Result<&'static Registered, ConfigError> {
    let modules: std::collections::BTreeSet<&str> = REGISTRY.iter().map(|r| r.module).collect();
    if !modules.contains(module) {
        return Err(usage(format!(
            "--module `{module}` is not one titan-train trains (it has: {})",
            modules.into_iter().collect::<Vec<_>>().join(", ")
        )));
    }
    REGISTRY
        .iter()
        .find(|r| r.module == module && r.name == config)
        .ok_or_else(|| {
            let known: Vec<&str> = REGISTRY
                .iter()
                .filter(|r| r.module == module)
                .map(|r| r.name)
                .collect();
            usage(format!(
                "config function `{config}` is not in {module}'s registry as titan-train implements it (available: {})",
                known.join(", ")
            ))
        })
}

/// Adds `key` = `value` (key normalised, either spelling) to the overrides, or checks a
/// [`NO_EFFECT`] key's value.
fn push(out: &mut CommandLine, key: &str, value: String) -> Result<(), ConfigError> {
    if let Some((_, accepts, why)) = NO_EFFECT.iter().find(|(k, _, _)| *k == key) {
        let ok = match accepts {
            Accepts::Any => true,
            Accepts::Only(values) => values.contains(&value.to_ascii_lowercase().as_str()),
        };
        if !ok {
            let Accepts::Only(values) = accepts else {
                unreachable!("Any accepts every value")
            };
            return Err(ConfigError::Unsupported {
                key: key.into(),
                value,
                default: values.join(" / "),
                note: if why.is_empty() {
                    String::new()
                } else {
                    format!(" ({why})")
                },
            });
        }
        out.notes.push(format!(
            "--{key} {value} has no effect in titan-train{}",
            if why.is_empty() {
                String::new()
            } else {
                format!(": {why}")
            }
        ));
        return Ok(());
    }
    let key = titan_key(key).to_string();
    out.overrides.push(Override { key, value });
    Ok(())
}

/// `activation_checkpoint:MODE`, tyro's subcommand for torchtitan 0.3.0's AC union.
fn activation_checkpoint_subcommand(mode: &str) -> Result<Vec<Override>, ConfigError> {
    let set = |k: &str, v: &str| Override {
        key: format!("activation_checkpoint.{k}"),
        value: v.into(),
    };
    match mode.replace('_', "-").as_str() {
        // torchtitan's SelectiveAC is per-op: every other matmul kept.
        "selective" => Ok(vec![
            set("mode", "selective"),
            set("selective_ac_option", "op"),
        ]),
        "full" => Ok(vec![set("mode", "full")]),
        "none" => Ok(vec![set("mode", "none")]),
        "memory-budget" => Err(ConfigError::Unsupported {
            key: "activation_checkpoint".into(),
            value: "memory-budget".into(),
            default: "selective".into(),
            note: " (memory-budget AC needs torch.compile's partitioner)".into(),
        }),
        other => Err(usage(format!(
            "activation_checkpoint:{other} is not one of selective, full, none"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_strs(args: &[&str]) -> Result<CommandLine, ConfigError> {
        parse(args.iter().map(|s| s.to_string()).collect())
    }

    fn pairs(cl: &CommandLine) -> Vec<(String, String)> {
        cl.overrides
            .iter()
            .map(|o| (o.key.clone(), o.value.clone()))
            .collect()
    }

    #[test]
    fn torchtitan_030_keys_and_tyro_spellings() {
        let cl = parse_strs(&[
            "--module",
            "llama3",
            "--config=llama3_debugmodel",
            "--dump_folder",
            "out",
            "--hf-assets-path",
            "tok",
            "--dataloader.dataset_path",
            "data",
            "--validator.no-enable",
            "--checkpoint.enable",
            "--checkpoint.no_last_save_model_only",
            "--optimizer.param-groups.0.optimizer-kwargs.lr",
            "0",
            "activation-checkpoint:full",
            "--parallelism.spmd_backend",
            "partial_dtensor",
        ])
        .unwrap();
        assert_eq!(cl.registry.unwrap().name, "llama3_debugmodel");
        let want: Vec<(String, String)> = [
            ("job.dump_folder", "out"),
            ("model.hf_assets_path", "tok"),
            ("training.dataset_path", "data"),
            ("validation.enable", "false"),
            ("checkpoint.enable", "true"),
            ("checkpoint.last_save_model_only", "false"),
            ("optimizer.lr", "0"),
            ("activation_checkpoint.mode", "full"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(pairs(&cl), want);
        assert_eq!(cl.notes.len(), 1, "{:?}", cl.notes);
    }

    #[test]
    fn registry_and_no_effect_errors_name_the_problem() {
        let err = parse_strs(&["--module", "llama3"]).unwrap_err().to_string();
        assert!(err.contains("--config is required"), "{err}");
        let err = parse_strs(&["--module", "mistral", "--config", "x"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("mistral") && err.contains("llama3, qwen3"),
            "{err}"
        );
        let err = parse_strs(&["--module", "qwen3", "--config", "qwen3_moe_deepep"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("qwen3_moe_debug"), "{err}");
        let err = parse_strs(&["--module", "llama3", "--config", "llama3_1b"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("llama3_1b") && err.contains("llama3_debugmodel"),
            "{err}"
        );
        let err = parse_strs(&["--dataloader.num_workers", "4"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("dataloader.num_workers"), "{err}");
        let err = parse_strs(&[
            "--module",
            "llama3",
            "--config",
            "llama3_8b",
            "--job.config_file",
            "x.toml",
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("give one"), "{err}");
        let err = parse_strs(&["--dump_folder"]).unwrap_err().to_string();
        assert!(
            err.contains("needs a value") || err.contains("dump_folder"),
            "{err}"
        );
    }

    #[test]
    fn toml_file_and_module_config_resolve_to_the_same_config() {
        use crate::JobConfig;
        let toml = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/registry/llama3_debugmodel.toml"
        );
        let module = parse_strs(&[
            "--module",
            "llama3",
            "--config",
            "llama3_debugmodel",
            "--dump_folder",
            "out",
            "--dataloader.dataset-path",
            "data",
            "--training.steps",
            "5",
            "activation_checkpoint:none",
        ])
        .unwrap();
        let file = parse_strs(&[
            "--job.config_file",
            toml,
            "--job.dump_folder",
            "out",
            "--training.dataset_path",
            "data",
            "--training.steps",
            "5",
            "--activation_checkpoint.mode",
            "none",
        ])
        .unwrap();
        let a = JobConfig::load(&module).unwrap();
        let mut b = JobConfig::load(&file).unwrap();
        b.job.config_file = None;
        assert_eq!(a, b);
        // And they are torchtitan's llama3_debugmodel values, not titan's TOML defaults.
        assert_eq!(a.metrics.log_freq, 1);
        assert_eq!(a.lr_scheduler.decay_ratio, Some(0.8));
        assert_eq!(a.training.dataset, "c4_test");
        assert_eq!(a.validation.batch_shape(&a.training), (8, 2048));
        assert!(!a.validation.enable);
        // Every registry entry parses (70B/405B then refuse their parallelism, naming it).
        for entry in REGISTRY {
            let cl = CommandLine {
                registry: Some(entry),
                ..Default::default()
            };
            match JobConfig::load(&cl) {
                Ok(c) => assert_eq!(c.model.name, entry.module),
                Err(e) => assert!(
                    matches!(e, ConfigError::Unsupported { .. }),
                    "{}: {e}",
                    entry.name
                ),
            }
        }
    }

    #[test]
    fn toml_form_flags_keep_working() {
        let cl = parse_strs(&[
            "--debug.deterministic",
            "--training.steps",
            "3",
            "--checkpoint.enable",
            "false",
        ])
        .unwrap();
        assert_eq!(
            pairs(&cl),
            [
                ("debug.deterministic".to_string(), "true".to_string()),
                ("training.steps".into(), "3".into()),
                ("checkpoint.enable".into(), "false".into()),
            ]
        );
        assert!(cl.registry.is_none());
    }
}
