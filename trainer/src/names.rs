//! The two generations of torchtitan Llama-3 parameter names titan-train meets.
//!
//! titan-train's model uses torchtitan 0.3.0's names (`layers.N.attention.qkv_linear.wq.weight`,
//! `lm_head.weight`), so torchtitan 0.3.0 loads its checkpoints. Checkpoints written by earlier
//! titan-train versions (and torchtitan before 0.3.0) use `layers.N.attention.wq.weight` and
//! `output.weight`; [`legacy`] gives that name so those checkpoints still resume.
//!
//! torchtitan 0.3.0 trains a fused `qkv_linear.wqkv` parameter and splits it into `wq`/`wk`/`wv`
//! only in the model state dict, so its optimizer state is keyed by [`fused_qkv`];
//! [`split_fused_qkv`] recovers the per-projection rows.

use tch::Tensor;

/// (0.3.0 infix, older infix) inside a layer's attention, and the top-level renames.
const LAYER_RENAMES: [(&str, &str); 3] = [
    (".attention.qkv_linear.wq.", ".attention.wq."),
    (".attention.qkv_linear.wk.", ".attention.wk."),
    (".attention.qkv_linear.wv.", ".attention.wv."),
];
const TOP_RENAMES: [(&str, &str); 1] = [("lm_head.weight", "output.weight")];

/// The pre-0.3.0 name of a 0.3.0 fqn, or `None` when both generations agree.
pub fn legacy(fqn: &str) -> Option<String> {
    if let Some((_, old)) = TOP_RENAMES.iter().find(|(new, _)| *new == fqn) {
        return Some(old.to_string());
    }
    LAYER_RENAMES
        .iter()
        .find(|(new, _)| fqn.contains(new))
        .map(|(new, old)| fqn.replacen(new, old, 1))
}

/// The 0.3.0 name of a fqn of either generation.
pub fn current(fqn: &str) -> String {
    if let Some((new, _)) = TOP_RENAMES.iter().find(|(_, old)| *old == fqn) {
        return new.to_string();
    }
    for (new, old) in LAYER_RENAMES {
        if fqn.contains(old) {
            return fqn.replacen(old, new, 1);
        }
    }
    fqn.to_string()
}

/// Which q/k/v projection a 0.3.0 fqn is, with the fqn of its fused `wqkv` parameter.
pub fn fused_qkv(fqn: &str) -> Option<(usize, String)> {
    let (prefix, tail) = fqn.split_once(".attention.qkv_linear.")?;
    let part = ["wq.weight", "wk.weight", "wv.weight"]
        .iter()
        .position(|p| *p == tail)?;
    Some((part, format!("{prefix}.attention.qkv_linear.wqkv.weight")))
}

/// Part `part` (0 = q, 1 = k, 2 = v) of a fused `wqkv` tensor (rows grouped per kv head: the
/// group's `n_heads / n_kv_heads` q heads, then its k head, then its v head), as torchtitan
/// 0.3.0's `FusedQKVLinear` splits it on save.
pub fn split_fused_qkv(fused: &Tensor, part: usize, n_heads: i64, n_kv_heads: i64) -> Tensor {
    let (rows, cols) = fused.size2().expect("wqkv is 2-D");
    let per_kv = n_heads / n_kv_heads;
    let head_dim = rows / (n_kv_heads * (per_kv + 2));
    let grouped = fused.reshape([n_kv_heads, per_kv + 2, head_dim, cols]);
    let (start, len) = match part {
        0 => (0, per_kv),
        1 => (per_kv, 1),
        _ => (per_kv + 1, 1),
    };
    grouped
        .narrow(1, start, len)
        .reshape([-1, cols])
        .contiguous()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_map_both_ways() {
        for (new, old) in [
            (
                "layers.3.attention.qkv_linear.wk.weight",
                "layers.3.attention.wk.weight",
            ),
            ("lm_head.weight", "output.weight"),
        ] {
            assert_eq!(legacy(new).as_deref(), Some(old));
            assert_eq!(current(old), new);
            assert_eq!(current(new), new);
        }
        assert_eq!(legacy("layers.0.attention.wo.weight"), None);
        assert_eq!(legacy("tok_embeddings.weight"), None);
        assert_eq!(
            fused_qkv("layers.2.attention.qkv_linear.wv.weight"),
            Some((2, "layers.2.attention.qkv_linear.wqkv.weight".into()))
        );
        assert_eq!(fused_qkv("layers.2.attention.wo.weight"), None);
    }

    #[test]
    fn fused_split_follows_kv_groups() {
        // 4 q heads, 2 kv heads, head_dim 1: rows are [q0 q1 k0 v0 q2 q3 k1 v1].
        let fused = Tensor::arange(8, (tch::Kind::Float, tch::Device::Cpu)).view([8, 1]);
        let rows = |t: Tensor| Vec::<f32>::try_from(t.view([-1])).unwrap();
        assert_eq!(rows(split_fused_qkv(&fused, 0, 4, 2)), [0.0, 1.0, 4.0, 5.0]);
        assert_eq!(rows(split_fused_qkv(&fused, 1, 4, 2)), [2.0, 6.0]);
        assert_eq!(rows(split_fused_qkv(&fused, 2, 4, 2)), [3.0, 7.0]);
    }
}
