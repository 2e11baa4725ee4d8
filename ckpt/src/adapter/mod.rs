//! Model adapters: torchtitan <-> Hugging Face names for Llama-3, with the q/k RoPE row
//! permutation, and the HF `config.json` for a Llama checkpoint.

use serde_json::{Value, json};

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::plan::CheckpointPlan;
use crate::write::RowMap;

/// Which naming a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    Torchtitan,
    Hf,
}

/// The Llama-3 architecture arguments (torchtitan's ModelArgs, HF's LlamaConfig).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaArgs {
    pub dim: u64,
    pub n_layers: u64,
    pub n_heads: u64,
    pub n_kv_heads: u64,
    pub vocab_size: u64,
    pub ffn_hidden: u64,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: u64,
}

/// What the user told us about the model (anything not given is inferred from shapes or from
/// the known torchtitan flavors).
#[derive(Debug, Clone, Default)]
pub struct LlamaHints {
    pub n_heads: Option<u64>,
    pub n_kv_heads: Option<u64>,
    pub rope_theta: Option<f64>,
    pub norm_eps: Option<f64>,
    pub max_position_embeddings: Option<u64>,
}

const LAYER_MAP: [(&str, &str); 9] = [
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
];

const TOP_MAP: [(&str, &str); 3] = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// The HF name of a torchtitan Llama-3 parameter.
pub fn to_hf_name(name: &str) -> Option<String> {
    if let Some((_, hf)) = TOP_MAP.iter().find(|(t, _)| *t == name) {
        return Some(hf.to_string());
    }
    let rest = name.strip_prefix("layers.")?;
    let (i, tail) = rest.split_once('.')?;
    i.parse::<u64>().ok()?;
    let (_, hf) = LAYER_MAP.iter().find(|(t, _)| *t == tail)?;
    Some(format!("model.layers.{i}.{hf}"))
}

/// The torchtitan name of an HF Llama parameter.
pub fn from_hf_name(name: &str) -> Option<String> {
    if let Some((t, _)) = TOP_MAP.iter().find(|(_, hf)| *hf == name) {
        return Some(t.to_string());
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (i, tail) = rest.split_once('.')?;
    i.parse::<u64>().ok()?;
    let (t, _) = LAYER_MAP.iter().find(|(_, hf)| *hf == tail)?;
    Some(format!("layers.{i}.{t}"))
}

/// Which naming `names` use (by the embedding's name).
pub fn detect_naming<'a>(names: impl IntoIterator<Item = &'a String>) -> Option<Naming> {
    for n in names {
        if n == "tok_embeddings.weight" {
            return Some(Naming::Torchtitan);
        }
        if n == "model.embed_tokens.weight" {
            return Some(Naming::Hf);
        }
    }
    None
}

/// n_heads of the torchtitan Llama-3 flavors, by (dim, n_layers).
fn known_heads(dim: u64, n_layers: u64) -> Option<u64> {
    match (dim, n_layers) {
        (256, 6) => Some(16),      // debugmodel
        (4096, 32) => Some(32),    // 8B
        (8192, 80) => Some(64),    // 70B
        (16384, 126) => Some(128), // 405B
        _ => None,
    }
}

/// Infers the model arguments from the shapes in `plan` (named per `naming`) and `hints`.
pub fn infer_args(plan: &CheckpointPlan, naming: Naming, hints: &LlamaHints) -> Result<LlamaArgs> {
    let name = |tt: &str| -> String {
        match naming {
            Naming::Torchtitan => tt.to_string(),
            Naming::Hf => to_hf_name(tt).unwrap_or_default(),
        }
    };
    let shape = |tt: &str| -> Result<Vec<u64>> {
        let n = name(tt);
        plan.tensors
            .get(&n)
            .map(|t| t.shape.clone())
            .ok_or_else(|| {
                Error::tensor(
                    plan.root.display(),
                    &n,
                    "needed to infer the Llama model arguments but missing",
                )
            })
    };
    let emb = shape("tok_embeddings.weight")?;
    let (vocab_size, dim) = (emb[0], *emb.get(1).unwrap_or(&0));
    let n_layers = (0..)
        .take_while(|i| {
            plan.tensors
                .contains_key(&name(&format!("layers.{i}.attention.wq.weight")))
        })
        .count() as u64;
    let n_heads = hints
        .n_heads
        .or_else(|| known_heads(dim, n_layers))
        .ok_or_else(|| {
            Error::usage(format!(
                "cannot tell the number of attention heads of a Llama model with dim {dim} and {n_layers} layers: pass --n-heads"
            ))
        })?;
    if n_heads == 0 || dim % n_heads != 0 {
        return Err(Error::usage(format!(
            "--n-heads {n_heads} does not divide dim {dim}"
        )));
    }
    let head_dim = dim / n_heads;
    let wk = shape("layers.0.attention.wk.weight")?;
    let n_kv_heads = hints.n_kv_heads.unwrap_or(wk[0] / head_dim);
    let ffn_hidden = shape("layers.0.feed_forward.w1.weight")?[0];
    Ok(LlamaArgs {
        dim,
        n_layers,
        n_heads,
        n_kv_heads,
        vocab_size,
        ffn_hidden,
        norm_eps: hints.norm_eps.unwrap_or(1e-5),
        rope_theta: hints.rope_theta.unwrap_or(500000.0),
        max_position_embeddings: hints.max_position_embeddings.unwrap_or(131072),
    })
}

/// The rename and RoPE row map for one tensor going from `from` naming to `to`; None for names
/// outside the model (an error for the caller to report).
pub fn map_tensor(
    name: &str,
    from: Naming,
    to: Naming,
    args: &LlamaArgs,
) -> Option<(String, Option<RowMap>)> {
    if from == to {
        return Some((name.to_string(), None));
    }
    let (tt, out) = match (from, to) {
        (Naming::Torchtitan, Naming::Hf) => (name.to_string(), to_hf_name(name)?),
        _ => (from_hf_name(name)?, from_hf_name(name)?),
    };
    let heads = if tt.ends_with("attention.wq.weight") {
        Some(args.n_heads)
    } else if tt.ends_with("attention.wk.weight") {
        Some(args.n_kv_heads)
    } else {
        None
    };
    let map = heads.map(|heads| match to {
        Naming::Hf => RowMap::ToHf { heads },
        Naming::Torchtitan => RowMap::FromHf { heads },
    });
    Some((out, map))
}

/// HF `config.json` for LlamaForCausalLM with Llama-3.1 RoPE scaling.
pub fn hf_config(args: &LlamaArgs, dtype: Dtype) -> Value {
    let rope = json!({
        "rope_type": "llama3",
        "rope_theta": args.rope_theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    });
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.dim / args.n_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": false,
        "rope_parameters": rope,
        "dtype": dtype.torch_name(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for n in [
            "tok_embeddings.weight",
            "layers.3.attention.wk.weight",
            "layers.0.ffn_norm.weight",
            "output.weight",
        ] {
            let hf = to_hf_name(n).unwrap();
            assert_eq!(from_hf_name(&hf).as_deref(), Some(n));
        }
        assert_eq!(
            to_hf_name("layers.1.feed_forward.w2.weight").unwrap(),
            "model.layers.1.mlp.down_proj.weight"
        );
        assert_eq!(to_hf_name("layers.x.attention.wq.weight"), None);
        assert_eq!(to_hf_name("optimizer.state"), None);
    }
}
