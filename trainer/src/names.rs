//! The two generations of torchtitan Llama-3 parameter names titan-train meets.
//!
//! titan-train's model uses torchtitan 0.3.0's names (`layers.N.attention.qkv_linear.wq.weight`,
//! `lm_head.weight`), so torchtitan 0.3.0 loads its checkpoints. Checkpoints written by earlier
//! titan-train versions (and torchtitan before 0.3.0) use `layers.N.attention.wq.weight` and
//! `output.weight`; titan-ckpt's Llama-3 table owns both generations
//! ([`titan_ckpt::adapter::legacy_name`] gives the older name), so those checkpoints still resume.
//!
//! torchtitan 0.3.0 trains a fused `qkv_linear.wqkv` parameter and splits it into `wq`/`wk`/`wv`
//! only in the model state dict, so its optimizer state is keyed by [`fused_qkv`];
//! [`split_fused_qkv`] recovers the per-projection rows.

use tch::Tensor;

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

/// The fused `wqkv` tensor of `q`, `k` and `v` (rows grouped per kv head): the inverse of
/// [`split_fused_qkv`].
pub fn fuse_qkv(q: &Tensor, k: &Tensor, v: &Tensor, n_kv_heads: i64) -> Tensor {
    let cols = q.size()[1];
    let group = |t: &Tensor| t.reshape([n_kv_heads, -1, cols]);
    Tensor::cat(&[group(q), group(k), group(v)], 1).reshape([-1, cols])
}

/// Where rows `start..start + rows` of projection `part` (0 = q, 1 = k, 2 = v) sit in the fused
/// `wqkv` tensor (the layout [`split_fused_qkv`] reads): runs of `(row in the projection, row in
/// the fused tensor, length)`. A q run ends at its kv group's end, a k or v run at its head's.
pub fn fused_qkv_runs(
    part: usize,
    start: i64,
    rows: i64,
    n_heads: i64,
    n_kv_heads: i64,
    head_dim: i64,
) -> Vec<(i64, i64, i64)> {
    let per_kv = n_heads / n_kv_heads;
    let group_rows = (per_kv + 2) * head_dim;
    let mut runs = Vec::new();
    let mut r = start;
    while r < start + rows {
        let (fused, end) = match part {
            0 => {
                let group = r / (per_kv * head_dim);
                let within = r % (per_kv * head_dim);
                (group * group_rows + within, (group + 1) * per_kv * head_dim)
            }
            _ => {
                let head = r / head_dim;
                let slot = per_kv + part as i64 - 1;
                (
                    head * group_rows + slot * head_dim + r % head_dim,
                    (head + 1) * head_dim,
                )
            }
        };
        let len = end.min(start + rows) - r;
        runs.push((r, fused, len));
        r += len;
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_qkv_names() {
        assert_eq!(
            fused_qkv("layers.2.attention.qkv_linear.wv.weight"),
            Some((2, "layers.2.attention.qkv_linear.wqkv.weight".into()))
        );
        assert_eq!(fused_qkv("layers.2.attention.wo.weight"), None);
    }

    #[test]
    fn fused_runs_invert_the_split() {
        // 8 q heads, 2 kv heads (4 q heads per group), head_dim 3: any row range of any part
        // lands where split_fused_qkv reads it from.
        let (h, kv, hd, cols) = (8i64, 2i64, 3i64, 2i64);
        let total = kv * (h / kv + 2) * hd;
        let fused =
            Tensor::arange(total * cols, (tch::Kind::Float, tch::Device::Cpu)).view([total, cols]);
        for part in 0..3 {
            let whole = split_fused_qkv(&fused, part, h, kv);
            let n = whole.size()[0];
            for (start, rows) in [(0, n), (1, n - 2), (5, 7.min(n - 5)), (n - 1, 1)] {
                for (at, to, len) in fused_qkv_runs(part, start, rows, h, kv, hd) {
                    assert!(fused.narrow(0, to, len).equal(&whole.narrow(0, at, len)));
                }
                let covered: i64 = fused_qkv_runs(part, start, rows, h, kv, hd)
                    .iter()
                    .map(|r| r.2)
                    .sum();
                assert_eq!(covered, rows);
            }
        }
    }

    #[test]
    fn fuse_inverts_split() {
        let fused = Tensor::arange(8 * 3, (tch::Kind::Float, tch::Device::Cpu)).view([8, 3]);
        let part = |i| split_fused_qkv(&fused, i, 4, 2);
        assert!(fuse_qkv(&part(0), &part(1), &part(2), 2).equal(&fused));
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
