//! Hugging Face checkpoints <-> torchtitan names on tch tensors, for llama3, qwen3 (dense and
//! MoE) and deepseek_v3: the name tables are titan-ckpt's, shared with `titan-ckpt convert` (its families'
//! rules, both torchtitan generations for llama3). A rule's transform says what a tensor goes
//! through: llama3's q/k rows permuted between HF's rotate-half RoPE and torchtitan's
//! interleaved (complex) RoPE (`RopeQ`/`RopeK`), a MoE layer's experts stacked in one
//! `[E, ...]` tensor in torchtitan and one tensor each in HF (`Experts`).

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use tch::Tensor;

use titan_ckpt::adapter::pattern::{fill, matches};
use titan_ckpt::adapter::{Table, Transform, TtNames, find_hf, find_tt, hf_of};

use crate::model::{Family, ModelArgs};
/// Heads of a weight the table marks RoPE-permuted (`RopeQ`: the q heads, `RopeK`: the key/value
/// heads); `None` for every other tensor.
fn rope_heads(transform: Transform, args: &ModelArgs) -> Option<i64> {
    match transform {
        Transform::RopeQ => Some(args.n_heads),
        Transform::RopeK => Some(args.kv_heads()),
        _ => None,
    }
}

/// HF -> torchtitan layout of a q/k weight: `w.view(H, 2, D1/H/2, D2).transpose(1, 2)`.
pub fn permute_from_hf(w: &Tensor, heads: i64) -> Tensor {
    let (d1, d2) = w.size2().expect("q/k weights are 2-D");
    w.view([heads, 2, d1 / heads / 2, d2])
        .transpose(1, 2)
        .reshape([d1, d2])
}

/// torchtitan -> HF layout of a q/k weight: `w.view(H, D1/H/2, 2, D2).transpose(1, 2)`.
pub fn permute_to_hf(w: &Tensor, heads: i64) -> Tensor {
    let (d1, d2) = w.size2().expect("q/k weights are 2-D");
    w.view([heads, d1 / heads / 2, 2, d2])
        .transpose(1, 2)
        .reshape([d1, d2])
}

/// titan-ckpt's name table for the family of `args`.
pub fn table(args: &ModelArgs) -> &'static Table {
    use titan_ckpt::adapter::Family as Ckpt;
    match args.family {
        Family::Llama3 => Ckpt::Llama3.table(),
        Family::Qwen3 => Ckpt::Qwen3.table(),
        Family::DeepseekV3 => Ckpt::DeepseekV3.table(),
    }
}

/// The HF name torchtitan tensor `name` sorts by (its first expert's, for stacked experts), or
/// `None` when it has no HF counterpart.
pub fn hf_sort_name(name: &str, table: &Table) -> Option<String> {
    let (rule, mut caps) = find_tt(table, name)?;
    if rule.transform == Transform::Experts {
        caps.expert = Some(0);
    }
    Some(hf_of(table, rule, caps))
}

/// Whether torchtitan tensor `name` has no HF counterpart by the table's own account (qwen3's
/// `expert_bias_E`: transformers' Qwen3-MoE has no load-balancing bias), or is the output
/// layer of a model whose HF config ties it to the embedding.
pub fn left_out_of_hf(name: &str, table: &Table, args: &ModelArgs) -> bool {
    (args.tie_embeddings && name == "lm_head.weight")
        || table
            .no_hf_home
            .iter()
            .any(|(p, _)| matches(p, name).is_some())
}

/// Converts an HF state dict to torchtitan names and layouts for a model of shape `args`: each
/// expert's tensors stacked in expert order (every expert present once), derived buffers
/// (`rotary_emb.inv_freq`) and a tied output layer's copy skipped.
pub fn from_hf(tensors: Vec<(String, Tensor)>, args: &ModelArgs) -> Result<Vec<(String, Tensor)>> {
    let table = table(args);
    let mut out = Vec::with_capacity(tensors.len());
    let mut experts: BTreeMap<String, BTreeMap<u64, Tensor>> = BTreeMap::new();
    for (name, t) in tensors {
        if table.hf_ignored.iter().any(|p| matches(p, &name).is_some())
            || (args.tie_embeddings && name == "lm_head.weight")
        {
            continue;
        }
        let Some((rule, caps)) = find_hf(table, &name, TtNames::Current) else {
            bail!(
                "HF tensor `{name}` has no torchtitan {} counterpart",
                table.family
            );
        };
        let titan = fill(rule.tt, caps);
        match rule.transform {
            Transform::Copy => out.push((titan, t)),
            Transform::RopeQ | Transform::RopeK => {
                let heads = rope_heads(rule.transform, args).expect("a RoPE rule");
                out.push((titan, permute_from_hf(&t, heads)));
            }
            Transform::Experts => {
                let e = caps.expert.expect("an experts rule captures the expert");
                if experts.entry(titan).or_default().insert(e, t).is_some() {
                    bail!("HF tensor `{name}` appears twice");
                }
            }
            other => bail!("HF tensor `{name}`: titan-train does not load {other:?} tensors"),
        }
    }
    for (titan, per_expert) in experts {
        let n = per_expert.len() as u64;
        if per_expert.keys().copied().ne(0..n) {
            bail!(
                "`{titan}`: the HF checkpoint holds experts {:?}, not 0..{n}",
                per_expert.keys()
            );
        }
        // A damaged checkpoint's experts may differ in shape: an error naming them, not a panic.
        let stacked = Tensor::f_stack(&per_expert.into_values().collect::<Vec<_>>(), 0)
            .map_err(|e| anyhow::anyhow!("`{titan}`: its HF experts do not stack: {e}"))?;
        out.push((titan, stacked));
    }
    Ok(out)
}

/// Converts torchtitan-named tensors to HF names and layouts (stacked experts split, one tensor
/// each); tensors HF has no place for (see `left_out_of_hf`) are left out.
pub fn to_hf(tensors: &[(String, Tensor)], args: &ModelArgs) -> Result<Vec<(String, Tensor)>> {
    let table = table(args);
    let mut out = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if left_out_of_hf(name, table, args) {
            continue;
        }
        let Some((rule, caps)) = find_tt(table, name) else {
            bail!(
                "torchtitan tensor `{name}` has no HF {} counterpart",
                table.family
            );
        };
        match rule.transform {
            Transform::Copy => out.push((hf_of(table, rule, caps), t.shallow_clone())),
            Transform::RopeQ | Transform::RopeK => {
                let heads = rope_heads(rule.transform, args).expect("a RoPE rule");
                out.push((hf_of(table, rule, caps), permute_to_hf(t, heads)));
            }
            Transform::Experts => {
                for e in 0..t.size()[0] {
                    let mut caps = caps;
                    caps.expert = Some(e as u64);
                    out.push((hf_of(table, rule, caps), t.get(e)));
                }
            }
            other => bail!("`{name}`: titan-train does not write {other:?} tensors"),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use titan_ckpt::adapter::{from_hf_name, to_hf_name};

    #[test]
    fn names_round_trip() {
        for n in [
            "tok_embeddings.weight",
            "layers.3.attention.qkv_linear.wk.weight",
            "layers.11.feed_forward.w3.weight",
            "layers.0.ffn_norm.weight",
            "lm_head.weight",
        ] {
            assert_eq!(from_hf_name(&to_hf_name(n).unwrap()).unwrap(), n);
        }
        assert_eq!(
            to_hf_name("layers.2.feed_forward.w1.weight").unwrap(),
            "model.layers.2.mlp.gate_proj.weight"
        );
    }

    #[test]
    fn permutations_are_inverse() {
        let w = Tensor::arange(8 * 3, (tch::Kind::Float, tch::Device::Cpu)).view([8, 3]);
        let back = permute_from_hf(&permute_to_hf(&w, 2), 2);
        assert!(back.equal(&w));
        // Head 0 of HF holds [re0, re1, im0, im1]; torchtitan interleaves [re0, im0, re1, im1].
        let rows = Vec::<f32>::try_from(permute_from_hf(&w, 2).select(1, 0)).unwrap();
        assert_eq!(&rows[..4], &[0.0, 6.0, 3.0, 9.0]);
    }
}
