//! torchtitan's llama3 tensor-parallel plan as one table: which weight dimension each parameter
//! is split along over `tp` (`parallelize_llama`'s `ColwiseParallel`/`RowwiseParallel` over the
//! model's modules). The model build places its parameters by it ([`crate::parallelize::
//! ParallelPlan::placement_of`]), float8 linears take their operand splits from it, and the
//! memory estimate its TP-local shapes. No libtorch here.

use anyhow::{Result, bail};

/// Which dimension of a weight tensor parallelism splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpStyle {
    /// Split dim 0: column-wise parallel linears (output features), and the vocab-sharded
    /// embedding (torch's `RowwiseParallel` on an `nn.Embedding` splits its rows too).
    Rows,
    /// Split dim 1: row-wise parallel linears (input features).
    Cols,
    /// Whole on every tp rank, applied where activations are whole or, under sequence
    /// parallelism, split by sequence (the blocks' norms): its gradient is partial over tp
    /// only under sequence parallelism.
    Replicated,
    /// Whole on every tp rank and applied inside a block's tp region, where what it feeds is
    /// split (qwen3's q/k norms over each rank's heads; deepseek_v3's low-rank projections and
    /// their norms, whose outputs meet each rank's heads; the router, whose scores weight each
    /// rank's part of the experts' outputs): torchtitan's `Replicate` weight with a `Partial`
    /// gradient, summed over tp on every tp layout.
    ReplicatedPartialGrad,
    /// Grouped experts' w1/w3 (E, F, D) split along F, dim 1: torchtitan's expert tensor
    /// parallelism when expert parallelism is off (`moe_sharding.py`).
    ExpertRows,
    /// Grouped experts' w2 (E, D, F) split along F, dim 2.
    ExpertCols,
}

impl TpStyle {
    /// The weight dimension split, if any.
    pub fn dim(self) -> Option<usize> {
        match self {
            TpStyle::Rows => Some(0),
            TpStyle::Cols | TpStyle::ExpertRows => Some(1),
            TpStyle::ExpertCols => Some(2),
            TpStyle::Replicated | TpStyle::ReplicatedPartialGrad => None,
        }
    }

    /// Whether a tp rank's gradient of a weight placed so is partial even without sequence
    /// parallelism (with it, every replicated weight's is).
    pub fn grad_partial_over_tp(self) -> bool {
        self == TpStyle::ReplicatedPartialGrad
    }
}

/// The llama3 plan: a parameter's fqn without its `layers.{i}.` prefix, and its style.
/// torchtitan 0.3.0: `tok_embeddings` RowwiseParallel (vocab split, output replicated or
/// sequence-sharded), q/k/v/w1/w3 ColwiseParallel, wo/w2 RowwiseParallel, norms as
/// SequenceParallel (weights replicated), `lm_head` ColwiseParallel (loss parallel).
pub const LLAMA3_TP_PLAN: &[(&str, TpStyle)] = &[
    ("tok_embeddings.weight", TpStyle::Rows),
    ("attention.qkv_linear.wq.weight", TpStyle::Rows),
    ("attention.qkv_linear.wk.weight", TpStyle::Rows),
    ("attention.qkv_linear.wv.weight", TpStyle::Rows),
    // torchtitan 0.3.0's fused q/k/v as one float8 linear: the three column-wise weights stacked.
    ("attention.qkv_linear.wqkv.weight", TpStyle::Rows),
    ("attention.wo.weight", TpStyle::Cols),
    // qwen3's per-head q/k norms (over head_dim: whole on every rank, their input sharded on
    // heads, as torchtitan's qwen3 plan places them).
    // (deepseek_v3's q-LoRA norm has the same name and the same gradient: partial.)
    ("attention.q_norm.weight", TpStyle::ReplicatedPartialGrad),
    ("attention.k_norm.weight", TpStyle::ReplicatedPartialGrad),
    ("feed_forward.w1.weight", TpStyle::Rows),
    ("feed_forward.w2.weight", TpStyle::Cols),
    ("feed_forward.w3.weight", TpStyle::Rows),
    // A mixture of experts (qwen3's MoE flavors) in place of the feed-forward: the experts'
    // hidden features split as one column-/row-wise pair, the router whole.
    (
        "moe.routed_experts.inner_experts.w1_EFD",
        TpStyle::ExpertRows,
    ),
    (
        "moe.routed_experts.inner_experts.w2_EDF",
        TpStyle::ExpertCols,
    ),
    (
        "moe.routed_experts.inner_experts.w3_EFD",
        TpStyle::ExpertRows,
    ),
    ("moe.router.gate.weight", TpStyle::ReplicatedPartialGrad),
    // deepseek_v3's shared experts: a SwiGLU beside the routed experts, split as the
    // feed-forward is.
    ("moe.shared_experts.w1.weight", TpStyle::Rows),
    ("moe.shared_experts.w2.weight", TpStyle::Cols),
    ("moe.shared_experts.w3.weight", TpStyle::Rows),
    // deepseek_v3's latent attention (`set_deepseek_v3_sharding_config`): the down-projections
    // to the low ranks and their norms whole, the up-projections per head column-wise (wo is
    // row-wise, as above).
    ("attention.wq.weight", TpStyle::Rows),
    ("attention.wq_a.weight", TpStyle::ReplicatedPartialGrad),
    ("attention.wq_b.weight", TpStyle::Rows),
    ("attention.wkv_a.weight", TpStyle::ReplicatedPartialGrad),
    ("attention.kv_norm.weight", TpStyle::ReplicatedPartialGrad),
    ("attention.wkv_b.weight", TpStyle::Rows),
    ("attention_norm.weight", TpStyle::Replicated),
    ("ffn_norm.weight", TpStyle::Replicated),
    ("norm.weight", TpStyle::Replicated),
    ("lm_head.weight", TpStyle::Rows),
];

/// The style of parameter `fqn` (`layers.3.feed_forward.w2.weight`, `lm_head.weight`).
pub fn tp_style(fqn: &str) -> Result<TpStyle> {
    let local = match fqn.strip_prefix("layers.") {
        Some(rest) => rest
            .split_once('.')
            .filter(|(i, _)| i.parse::<usize>().is_ok())
            .map_or(fqn, |(_, name)| name),
        None => fqn,
    };
    match LLAMA3_TP_PLAN.iter().find(|(name, _)| *name == local) {
        Some((_, style)) => Ok(*style),
        None => bail!("`{fqn}` has no entry in the llama3 tensor-parallel plan"),
    }
}

/// The TP-local shape of a parameter of `global` shape placed by `style` over `tp` ranks: the
/// split dimension must divide evenly.
pub fn tp_local_shape(global: &[i64], style: TpStyle, tp: i64) -> Result<Vec<i64>> {
    let mut local = global.to_vec();
    if let Some(d) = style.dim().filter(|_| tp > 1) {
        if global[d] % tp != 0 {
            bail!(
                "a parameter of shape {global:?} cannot be split into \
                 parallelism.tensor_parallel_degree = {tp} equal parts along dim {d}"
            );
        }
        local[d] = global[d] / tp;
    }
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelArgs;

    #[test]
    fn every_parameter_has_a_style() {
        for (name, flavor) in [
            ("llama3", "debugmodel"),
            ("qwen3", "debugmodel"),
            ("qwen3", "debugmodel_moe"),
            ("deepseek_v3", "debugmodel"),
            ("deepseek_v3", "236B"),
            ("deepseek_v3", "671B"),
        ] {
            for spec in ModelArgs::of(name, flavor).unwrap().parameters() {
                tp_style(&spec.fqn).unwrap();
            }
        }
        assert_eq!(
            tp_style("layers.12.attention.wo.weight").unwrap(),
            TpStyle::Cols
        );
        assert!(tp_style("layers.0.attention.wx.weight").is_err());
        assert!(tp_style("layers.x.attention.wo.weight").is_err());
    }

    #[test]
    fn local_shapes_split_one_dim() {
        assert_eq!(
            tp_local_shape(&[768, 256], TpStyle::Cols, 2).unwrap(),
            [768, 128]
        );
        assert_eq!(
            tp_local_shape(&[256], TpStyle::Replicated, 4).unwrap(),
            [256]
        );
        assert!(tp_local_shape(&[6, 4], TpStyle::Rows, 4).is_err());
    }
}
