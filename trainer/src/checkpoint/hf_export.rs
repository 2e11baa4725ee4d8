//! The last save in Hugging Face format (`checkpoint.last_save_in_hf`), as torchtitan does it:
//! each rank writes its weights as DCP sharded safetensors (`sharded/shard-RRRRR-model-...`,
//! HF names, q/k permuted, `export_dtype`), then the output files are consolidated with
//! titan-ckpt's consolidate, the files split across ranks, rank 0 writing the index. The layout
//! is the `fqn_to_index_mapping` of `model.hf_assets_path/model.safetensors.index.json` when it
//! exists, else files of at most 5 GB. A `config.json` for transformers (LlamaForCausalLM,
//! Qwen3ForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM) is written next to the weights.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use tch::Kind;
use titan_ckpt::consolidate::{self, FileLayout, RankShare};
use titan_ckpt::formats::{self, dcp_hf};
use titan_ckpt::safetensors::{OutEntry, build_header};
use titan_ckpt::write::EngineOptions;
use titan_storage::Root;

use super::host::HostTensor;
use super::layout;
use crate::hf;
use crate::model::ModelArgs;
use crate::parallel::Mesh;
use crate::parallelize::ParallelModel;

/// HF's default maximum shard size.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;
const SHARDED: &str = "sharded";

/// Writes the final model of `step` as HF safetensors to `root/step-N`; returns that folder.
/// Every rank of `world` calls it: each writes its share of the (replicated) weights as dcp-hf
/// shards, the consolidation's output files are split across the ranks, and rank 0 commits.
/// `sync(name)` makes all ranks meet (a no-op for one process).
pub fn export(
    root: &Path,
    step: u64,
    model: &ParallelModel,
    kind: Kind,
    world: Mesh,
    hf_assets: Option<&Path>,
    sync: &dyn Fn(&str) -> Result<()>,
) -> Result<PathBuf> {
    let partial = layout::partial_dir(root, step);
    if world.rank == 0 && partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("clearing {}", partial.display()))?;
    }
    sync("hf-start")?;
    let result = (|| -> Result<()> {
        {
            let _s = titan_obs_core::span("checkpoint_save");
            write_sharded(&partial.join(SHARDED), model, kind, world)?;
        }
        sync("hf-written")?;
        {
            let _s = titan_obs_core::span("checkpoint_consolidate");
            consolidate_shards(&partial, world, hf_assets)?;
        }
        // Every rank has read the shards it needed before rank 0 removes them.
        sync("hf-consolidated")?;
        if world.rank == 0 {
            std::fs::remove_dir_all(partial.join(SHARDED))
                .context("removing the sharded HF files")?;
            warn_if_transformers_routes_otherwise(&model.args);
            let config = hf_config(&model.args, kind)?;
            std::fs::write(
                partial.join("config.json"),
                serde_json::to_vec_pretty(&config)?,
            )
            .context("writing config.json")?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        if world.rank == 0 {
            let _ = std::fs::remove_dir_all(&partial);
        }
        return Err(e);
    }
    if world.rank == 0 {
        layout::commit(root, &partial, step)
    } else {
        Ok(root.join(layout::step_dir_name(step)))
    }
}

/// This rank's share of the weights (rank r of the ranks holding its pipeline stages takes every
/// n-th of their tensors in name order) as
/// one DCP sharded safetensors file. Sharded parameters are gathered whole one unit at a time
/// (every rank takes part), and each rank keeps only its share.
fn write_sharded(dir: &Path, model: &ParallelModel, kind: Kind, world: Mesh) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Rank r takes every n-th tensor in HF name order; only that share is permuted,
    // copied to host memory and cast. (A name without an HF counterpart sorts first and makes
    // `to_hf` fail on the rank that takes it.)
    let table = hf::table(&model.args);
    // The parameters, and the buffers HF has a place for (deepseek_v3's `expert_bias_E` is its
    // `e_score_correction_bias`; whole on every rank of their stage).
    let buffers: Vec<(String, tch::Tensor)> = model
        .named_buffers()
        .into_iter()
        .filter(|(n, _)| {
            hf::hf_sort_name(n, table).is_some() && !hf::left_out_of_hf(n, table, &model.args)
        })
        .collect();
    let mut titan: Vec<(Option<String>, &String)> = model
        .named_parameters()
        .iter()
        .map(|(n, _)| n)
        .chain(buffers.iter().map(|(n, _)| n))
        .map(|n| (hf::hf_sort_name(n, table), n))
        .collect();
    titan.sort();
    // The ranks holding the same pipeline stages share out their names (every rank, without
    // pipeline parallelism); each stage's names are its own.
    let peers = world.group_members(&[
        crate::parallel::Dim::DpReplicate,
        crate::parallel::Dim::DpShard,
        crate::parallel::Dim::Cp,
        crate::parallel::Dim::Tp,
    ]);
    let me = peers.iter().position(|&r| r == world.rank).unwrap_or(0);
    let mine: std::collections::BTreeSet<&str> = titan
        .iter()
        .enumerate()
        .filter(|(i, _)| i % peers.len() == me)
        .map(|(_, (_, n))| n.as_str())
        .collect();
    let mut share = tch::no_grad(|| model.full_parameters(|name| mine.contains(name)));
    share.extend(
        buffers
            .iter()
            .filter(|(n, _)| mine.contains(n.as_str()))
            .map(|(n, b)| (n.clone(), b.shallow_clone())),
    );
    let hf_named = tch::no_grad(|| hf::to_hf(&share, &model.args))?;
    let staged: Vec<(String, HostTensor)> = hf_named
        .iter()
        .map(|(n, t)| Ok((n.clone(), HostTensor::from_tensor(t, Some(kind))?)))
        .collect::<Result<_>>()?;
    if staged.is_empty() {
        return Ok(());
    }
    let entries: Vec<OutEntry> = staged
        .iter()
        .map(|(n, t)| OutEntry {
            name: n.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    let metadata =
        dcp_hf::whole_tensors_metadata(staged.iter().map(|(n, t)| (n.as_str(), &t.shape[..])));
    let (header, _offsets) = build_header(&entries, &metadata);
    let path = dir.join(dcp_hf::shard_name(world.rank as u32 + 1, 1, 1));
    let tmp = path.with_extension("tmp");
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
    );
    f.write_all(&header)?;
    for (_, t) in &staged {
        f.write_all(&t.data)?;
    }
    let f = f.into_inner().map_err(|e| e.into_error())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

fn consolidate_shards(out_dir: &Path, world: Mesh, hf_assets: Option<&Path>) -> Result<()> {
    let plan = dcp_hf::read(&Root::local(out_dir.join(SHARDED)), None)
        .context("reading the sharded HF files back")?;
    let layout = match hf_assets
        .map(|p| p.join(formats::HF_INDEX))
        .filter(|p| p.is_file())
    {
        Some(index) => {
            let dir = index.parent().expect("index has a parent");
            FileLayout::Mapping(
                formats::hf::read_index(&Root::local(dir), formats::HF_INDEX).with_context(
                    || format!("reading fqn_to_index_mapping from {}", index.display()),
                )?,
            )
        }
        None => FileLayout::MaxShardSize(DEFAULT_MAX_SHARD_BYTES),
    };
    let tensors = consolidate::consolidation_tensors(&plan, None)?;
    let files = consolidate::plan_files(tensors, &layout)?;
    let write_index = files.len() > 1 || matches!(layout, FileLayout::Mapping(_));
    let share = RankShare {
        rank: world.rank,
        world_size: world.world_size,
        wait_timeout: Duration::from_secs(600),
    };
    let opts = EngineOptions {
        workers: 2,
        window_bytes: 64 << 20,
        progress: std::sync::Arc::new(titan_ckpt::write::NoProgress),
    };
    consolidate::run(
        &plan,
        &Root::local(out_dir),
        &files,
        write_index,
        share,
        &opts,
    )
    .context("consolidating the HF export")?;
    Ok(())
}

/// transformers' DeepseekV3 router scores with a sigmoid (DeepSeek-V3's, torchtitan's 671B);
/// torchtitan's other deepseek_v3 flavors score with a softmax, which no config.json can say:
/// their export loads in transformers but routes otherwise (tests/python/tt_hf_logits.py).
fn warn_if_transformers_routes_otherwise(args: &ModelArgs) {
    let softmax = args
        .moe
        .as_ref()
        .is_some_and(|m| m.score_func == crate::model::ScoreFunc::Softmax);
    if args.mla.is_some() && softmax {
        tracing::warn!(
            "this deepseek_v3 model routes with softmax scores; transformers' \
             DeepseekV3ForCausalLM routes with sigmoid scores, so the HF export loads there but \
             picks and weights experts otherwise (torchtitan's to_hf writes the same)"
        );
    }
}

/// transformers' `config.json` for this model (LlamaForCausalLM with llama3 RoPE scaling,
/// Qwen3ForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM with YaRN), written by
/// titan-ckpt's
/// [`titan_ckpt::adapter::hf_config`], as `titan-ckpt convert` writes it.
pub fn hf_config(args: &ModelArgs, kind: Kind) -> Result<serde_json::Value> {
    use titan_ckpt::adapter::args::{Dsv3Routing, Llama3Rope, MlaArgs, RopeScaling};
    let rope_scaling = match (args.rope_scaling, &args.mla) {
        (Some(s), _) => RopeScaling::Llama3(Llama3Rope {
            factor: s.factor,
            low_freq_factor: s.low_freq_factor,
            high_freq_factor: s.high_freq_factor,
            original_max_position_embeddings: s.original_max_position_embeddings as u64,
        }),
        // deepseek_v3's YaRN, as `mla::yarn_table` applies it (whenever the factor is over 1;
        // its correction range floored and ceiled: HF's `truncate`).
        (None, Some(m)) if m.rope_factor > 1.0 => RopeScaling::Yarn {
            factor: m.rope_factor,
            beta_fast: m.beta_fast,
            beta_slow: m.beta_slow,
            truncate: true,
            original_max_position_embeddings: m.original_seq_len as u64,
            mscale: Some(m.mscale),
        },
        (None, _) => RopeScaling::None,
    };
    let mla = match (&args.mla, &args.moe) {
        (Some(m), Some(moe)) => Some(MlaArgs {
            q_lora_rank: (m.q_lora_rank > 0).then_some(m.q_lora_rank as u64),
            kv_lora_rank: m.kv_lora_rank as u64,
            qk_nope_head_dim: m.qk_nope_head_dim as u64,
            qk_rope_head_dim: m.qk_rope_head_dim as u64,
            v_head_dim: m.v_head_dim as u64,
            first_k_dense: args.n_dense_layers as u64,
            n_shared_experts: moe.num_shared_experts as u64,
            mtp_layers: 0,
            routing: Dsv3Routing {
                top_k: moe.top_k as u64,
                n_group: moe.num_expert_groups.unwrap_or(1) as u64,
                topk_group: moe.num_limited_groups.unwrap_or(1) as u64,
                route_scale: moe.route_scale,
                route_norm: moe.route_norm,
                mscale: m.mscale,
            },
        }),
        _ => None,
    };
    let hf = titan_ckpt::adapter::ModelArgs {
        family: hf::table(args).family,
        dim: args.dim as u64,
        n_layers: args.n_layers as u64,
        n_heads: args.n_heads as u64,
        n_kv_heads: args.kv_heads() as u64,
        head_dim: args.head_dim() as u64,
        vocab_size: args.vocab_size as u64,
        ffn_hidden: args.ffn_hidden_dim() as u64,
        norm_eps: args.norm_eps,
        rope_theta: args.rope_theta,
        rope_scaling,
        max_position_embeddings: args.max_seq_len.max(8192) as u64,
        tie_word_embeddings: args.tie_embeddings,
        moe: args
            .moe
            .as_ref()
            .map(|m| titan_ckpt::adapter::args::MoeArgs {
                num_experts: m.num_experts as u64,
                expert_hidden: m.hidden_dim as u64,
                experts_per_token: Some(m.top_k as u64),
            }),
        sliding_window: None,
        mla,
        assumed: Vec::new(),
    };
    titan_ckpt::adapter::hf_config(&hf, super::host::dtype_of(kind)?)?
        .context("titan-ckpt writes this family's config.json")
}
