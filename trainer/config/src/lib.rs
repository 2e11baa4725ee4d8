//! titan-train's job configuration, the bottom layer of the trainer: torchtitan's sections and
//! key names with their defaults ([`JobConfig`] and one struct per section), the closed sets of
//! values as enums ([`DtypeName`], [`AcMode`], [`ActivationCheckpointing`], [`AttnBackend`],
//! [`Float8Recipe`], ...), validation ([`JobConfig::validate`], every failure a [`ConfigError`],
//! exit 2), and both of torchtitan's command lines ([`command_line`]: the TOML form and 0.3.0's
//! `--module/--config` registry) read onto it by [`JobConfig::load`].
//!
//! It depends on serde and toml only: no libtorch, no model or parallelism types, so `--help`,
//! config checks and the arithmetic of the memory estimate can be read (and built) on their own.
//! Layers above (distributed, model, float8, parallelize, the loop) import it; it imports none of
//! them.

pub mod command_line;
mod job;

pub use job::*;
