//! Hugging Face Llama checkpoints <-> torchtitan names, with the q/k row permutation between
//! HF's rotate-half RoPE and torchtitan's interleaved (complex) RoPE, on tch tensors (the name
//! table is titan-ckpt's, shared with `titan-ckpt convert`: its names, both torchtitan
//! generations, and its `RopeQ`/`RopeK` roles pick the permuted weights).

use anyhow::{Result, bail};
use tch::Tensor;

use titan_ckpt::adapter::{Transform, from_hf_name, to_hf_rule};

use crate::model::ModelArgs;

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

/// Converts an HF state dict to torchtitan names and layouts for a model of shape `args`.
pub fn from_hf(tensors: Vec<(String, Tensor)>, args: &ModelArgs) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let Some(titan) = from_hf_name(&name) else {
            if name.ends_with("rotary_emb.inv_freq") {
                continue;
            }
            bail!("HF tensor `{name}` has no torchtitan llama3 counterpart");
        };
        let transform = to_hf_rule(&titan).map(|(_, t)| t);
        let t = match transform.and_then(|tr| rope_heads(tr, args)) {
            Some(h) => permute_from_hf(&t, h),
            None => t,
        };
        out.push((titan, t));
    }
    Ok(out)
}

/// Converts torchtitan-named tensors to HF names and layouts.
pub fn to_hf(tensors: &[(String, Tensor)], args: &ModelArgs) -> Result<Vec<(String, Tensor)>> {
    tensors
        .iter()
        .map(|(name, t)| {
            let Some((hf, transform)) = to_hf_rule(name) else {
                bail!("torchtitan tensor `{name}` has no HF Llama counterpart");
            };
            let t = match rope_heads(transform, args) {
                Some(h) => permute_to_hf(t, h),
                None => t.shallow_clone(),
            };
            Ok((hf, t))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use titan_ckpt::adapter::to_hf_name;

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
