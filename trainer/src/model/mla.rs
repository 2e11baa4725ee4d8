//! DeepSeek-V3's multi-head latent attention as torchtitan 0.3.0 computes it
//! (`models/deepseek_v3/model.py`: `Attention`) and the YaRN RoPE of its rope features
//! (`models/common/rope.py`: `ComplexRoPE` with `scaling="yarn"`, `_yarn_inv_freq`).
//!
//! A head's query is `qk_nope_head_dim` features without position and `qk_rope_head_dim`
//! rotated ones, from `wq` (or through the low rank `wq_a`, `q_norm`, `wq_b`). Keys and values
//! come down to a latent of `kv_lora_rank` features plus one rotated key every head shares
//! (`wkv_a`), the latent normalised (`kv_norm`) and brought up per head to the unrotated key and
//! the value (`wkv_b`). Causal attention over the `qk_nope + qk_rope` features, scaled by
//! `qk_head_dim^-0.5` times YaRN's temperature squared, then `wo`.

use tch::{Device, Kind, Tensor};

use super::args::{MlaArgs, ModelArgs};
use super::{
    BlockShape, ForwardContext, Ops, RopeStyle, Weight, apply_rotary_emb, inverse_frequencies, sdpa,
};

/// How a latent attention projects its queries.
pub(super) enum Query {
    /// `wq` (`q_lora_rank = 0`).
    Direct(Weight),
    /// `wq_a`, `q_norm`, `wq_b`.
    LowRank { a: Weight, norm: Tensor, b: Weight },
}

/// A latent attention's parameters as its block's FSDP unit gathered them.
pub(super) struct MlaWeights {
    pub q: Query,
    pub wkv_a: Weight,
    pub kv_norm: Tensor,
    pub wkv_b: Weight,
    pub wo: Weight,
}

impl MlaWeights {
    /// From a block's parameters in registration order: wq (or wq_a, q_norm, wq_b), wkv_a,
    /// kv_norm, wkv_b, wo.
    pub(super) fn take(args: &MlaArgs, mut next: impl FnMut() -> Weight) -> Self {
        let q = if args.q_lora_rank == 0 {
            Query::Direct(next())
        } else {
            Query::LowRank {
                a: next(),
                norm: next().value,
                b: next(),
            }
        };
        MlaWeights {
            q,
            wkv_a: next(),
            kv_norm: next().value,
            wkv_b: next(),
            wo: next(),
        }
    }
}

/// The complex RoPE table (max_seq_len, qk_rope_head_dim / 2) with YaRN's frequencies, built
/// with torchtitan's tensor operations in float32 (so its rounding): the inverse frequencies
/// `1 / theta^(2i/d)` blend into themselves divided by `rope_factor` along a ramp between the
/// dimensions where `beta_fast` and `beta_slow` rotations fit the original context (floored and
/// ceiled, as DeepSeek truncates).
pub(super) fn yarn_table(args: &ModelArgs, m: &MlaArgs, device: Device) -> Tensor {
    let dim = m.qk_rope_head_dim;
    let cpu = (Kind::Float, Device::Cpu);
    let inv_freq = inverse_frequencies(dim, args.rope_theta);
    let mut freqs = inv_freq.shallow_clone();
    if m.rope_factor > 1.0 {
        let correction_dim = |rotations: f64| {
            (dim as f64
                * (m.original_seq_len as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln())
                / (2.0 * args.rope_theta.ln())
        };
        let low = correction_dim(m.beta_fast).floor().max(0.0);
        let mut high = correction_dim(m.beta_slow).ceil().min((dim - 1) as f64);
        if low == high {
            high += 0.001;
        }
        let ramp = ((Tensor::arange(dim / 2, cpu) - low) / (high - low)).clamp(0.0, 1.0);
        let keep = ramp.ones_like() - &ramp;
        freqs = &inv_freq / m.rope_factor * &ramp + &inv_freq * keep;
    }
    let t = Tensor::arange(args.max_seq_len, cpu);
    let angles = t.outer(&freqs);
    Tensor::polar(&angles.ones_like(), &angles).to_device(device)
}

/// Multi-head latent attention of `x` (B, S, dim): `wo` of the heads' attention outputs.
pub(super) fn attention(
    w: &MlaWeights,
    m: &MlaArgs,
    shape: BlockShape,
    ctx: &ForwardContext,
    x: &Tensor,
    ops: &dyn Ops,
) -> Tensor {
    let (b, s, _) = x.size3().expect("hidden states are (B, S, dim)");
    let h = shape.n_heads;
    let (nope, rope, vd, kvr) = (
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    );
    let q = match &w.q {
        Query::Direct(wq) => ops.linear(x, wq),
        Query::LowRank { a, norm, b } => {
            let low = ops.linear(x, a);
            ops.linear(
                &low.rms_norm([m.q_lora_rank], Some(norm), shape.norm_eps),
                b,
            )
        }
    };
    let q = q.view([b, s, h, nope + rope]);
    let (q_nope, q_pe) = (q.narrow(3, 0, nope), q.narrow(3, nope, rope));
    let kv = ops.linear(x, &w.wkv_a);
    let (latent, k_pe) = (kv.narrow(2, 0, kvr), kv.narrow(2, kvr, rope));
    let q_pe = apply_rotary_emb(&q_pe, &ctx.rope, RopeStyle::Complex);
    let k_pe = apply_rotary_emb(&k_pe.unsqueeze(2), &ctx.rope, RopeStyle::Complex);
    let q = Tensor::cat(&[q_nope, q_pe], -1);
    let kv = ops
        .linear(
            &latent.rms_norm([kvr], Some(&w.kv_norm), shape.norm_eps),
            &w.wkv_b,
        )
        .view([b, s, h, nope + vd]);
    let (k_nope, v) = (kv.narrow(3, 0, nope), kv.narrow(3, nope, vd));
    let k = Tensor::cat(&[k_nope, k_pe.expand([-1, -1, h, -1], false)], -1);
    let (k, v) = ops.keys_values(&k, &v);
    // SDPA, not FlashAttention's varlen kernel (q/k and v widths differ: `with_attn_backend`
    // leaves it off), with YaRN's temperature in the scale.
    let out = sdpa(&q, &k, &v, &ctx.attend, Some(m.softmax_scale()), false);
    ops.linear(&out.reshape([b, s, h * vd]), &w.wo)
}
