//! The mixture-of-experts feed-forward as torchtitan 0.3.0 computes it without expert
//! parallelism (`models/common/moe.py`: `TokenChoiceTopKRouter`, `GroupedExperts`, `MoE`;
//! `token_dispatcher.py`: `LocalTokenDispatcher`), and its auxiliary-loss-free load balancing
//! (`components/optimizer/optimizer.py`: `register_moe_load_balancing_hook`).
//!
//! A token's path: the router scores every expert (softmax or sigmoid of the gate), picks the
//! `top_k` best by score plus `expert_bias` (the bias only chooses; the weights are the
//! unbiased scores, renormalised and scaled); the tokens are sorted by expert (a stable sort,
//! so within an expert they keep their order), each expert's SwiGLU runs over its run of
//! tokens as one grouped matmul — in bf16 whatever the model's dtype, as torchtitan casts —,
//! the outputs are weighted by their scores in fp32 and added back to their tokens in the
//! sorted order. Each layer counts the tokens it sent to each expert; before every optimizer
//! step the counts, summed over the data-parallel ranks, move `expert_bias` a fixed step
//! towards the experts that got fewer than the mean.

use anyhow::Result;
use tch::{Kind, Tensor};

use super::args::{MoeArgs, ScoreFunc};

/// A MoE layer's parameters as its FSDP unit gathered them.
pub(super) struct MoeWeights {
    /// `w1_EFD` (E, F, D), `w2_EDF` (E, D, F), `w3_EFD` (E, F, D).
    pub w1: Tensor,
    pub w2: Tensor,
    pub w3: Tensor,
    /// The router's gate (E, D).
    pub gate: Tensor,
    /// The shared experts' SwiGLU `w1`, `w2`, `w3` (deepseek_v3), if any.
    pub shared: Option<[Tensor; 3]>,
}

/// A MoE layer's state besides its parameters: torchtitan's buffers.
pub struct MoeBuffers {
    /// `expert_bias_E` (E,) fp32, saved in checkpoints; `None` without load balancing.
    pub expert_bias: Option<Tensor>,
    /// `tokens_per_expert_E` (E,) fp32: tokens the training forward passes sent to each expert
    /// since the last optimizer step (not saved).
    pub tokens_per_expert: Tensor,
}

impl MoeBuffers {
    pub fn new(args: &MoeArgs, device: tch::Device) -> Self {
        let zeros = || Tensor::zeros([args.num_experts], (Kind::Float, device));
        MoeBuffers {
            expert_bias: args.load_balance_coeff.map(|_| zeros()),
            tokens_per_expert: zeros(),
        }
    }

    /// The counts start again from zero (after an optimizer step).
    pub fn restart_counts(&self) {
        tch::no_grad(|| {
            let _ = self.tokens_per_expert.shallow_clone().zero_();
        });
    }

    /// Shallow clones, for a forward pass's closures.
    pub(super) fn share(&self) -> MoeBuffers {
        MoeBuffers {
            expert_bias: self.expert_bias.as_ref().map(Tensor::shallow_clone),
            tokens_per_expert: self.tokens_per_expert.shallow_clone(),
        }
    }
}

/// The MoE feed-forward of `x` (B, S, D): the routed experts' outputs added per token, plus the
/// shared experts' output when there are shared experts (added after, as torchtitan). Which
/// tokens are routed here and the routed experts run through `ops` (where expert parallelism
/// sends tokens to them, and may route only a block of `x` on each rank). With `count`, the
/// tokens sent to each expert are added to its `tokens_per_expert` (a training forward pass;
/// not its recompute in backward, which would count them twice).
pub(super) fn forward(
    x: &Tensor,
    weights: &MoeWeights,
    args: &MoeArgs,
    buffers: &MoeBuffers,
    count: bool,
    ops: &dyn super::Ops,
) -> Tensor {
    let seq_len = x.size()[1];
    // The tokens this process routes: all of `x`, or the block of it `ops` gives it.
    let x_routed = ops.routed_tokens(x);
    let (b, s, d) = x_routed.size3().expect("hidden states are (B, S, dim)");
    let (k, tokens) = (args.top_k, b * s);
    let (scores, experts) = route(&x_routed, &weights.gate, args, buffers.expert_bias.as_ref());
    let per_expert = experts
        .reshape([-1])
        .bincount(None::<Tensor>, args.num_experts);
    if count {
        tch::no_grad(|| {
            let mut tokens = buffers.tokens_per_expert.shallow_clone();
            tokens += &per_expert;
        });
    }
    // Dispatch: the (token, choice) pairs sorted by expert, stably (so by token within one).
    let order = experts.reshape([-1]).argsort_stable(true, 0, false);
    let sorted_scores = scores.reshape([-1]).index(&[Some(&order)]);
    let token_of = order.floor_divide_scalar(k);
    let x_td = x_routed.reshape([tokens, d]);
    let routed = x_td.index(&[Some(&token_of)]);
    let out = ops.routed_experts(&routed, &per_expert, &|tokens, counts| {
        grouped_experts(tokens, weights, counts)
    });
    // Combine: each output weighted by its score in fp32, added to its token in sorted order
    // (torchtitan's deterministic scatter-add).
    let out = (out.to_kind(Kind::Float) * sorted_scores.reshape([-1, 1])).to_kind(out.kind());
    let index = token_of.reshape([-1, 1]).expand([-1, d], false);
    let routed = x_td
        .zeros_like()
        .scatter_add(0, &index, &out)
        .view([b, s, d]);
    let routed = ops.routed_output(&routed, seq_len);
    match &weights.shared {
        Some([w1, w2, w3]) => {
            let up = x.linear::<&Tensor>(w1, None).silu() * x.linear::<&Tensor>(w3, None);
            routed + up.linear::<&Tensor>(w2, None)
        }
        None => routed,
    }
}

/// The router: (the chosen experts' weights (B, S, K), their indices (B, S, K)).
fn route(
    x: &Tensor,
    gate: &Tensor,
    args: &MoeArgs,
    expert_bias: Option<&Tensor>,
) -> (Tensor, Tensor) {
    // torchtitan computes the gate under `autocast(dtype=float32)`: fp32 on CUDA; torch's CPU
    // autocast has no fp32 and turns itself off, so on a CPU the gate runs in x's dtype.
    let kind = if x.device().is_cuda() {
        Kind::Float
    } else {
        x.kind()
    };
    let logits = x.to_kind(kind).linear::<&Tensor>(&gate.to_kind(kind), None);
    let scores = match args.score_func {
        ScoreFunc::Softmax => logits.softmax(-1, None::<Kind>),
        ScoreFunc::Sigmoid => logits.sigmoid(),
    };
    let experts = if args.force_load_balance {
        // Round-robin over the experts, exactly balanced (debug.moe_force_load_balance).
        let (b, s, _) = scores.size3().expect("scores are (B, S, E)");
        Tensor::arange(b * s * args.top_k, (Kind::Int64, x.device()))
            .reshape([b, s, args.top_k])
            .remainder(args.num_experts)
    } else {
        let choice = match expert_bias {
            Some(bias) => &scores + bias,
            None => scores.shallow_clone(),
        };
        let choice = match (args.num_expert_groups, args.num_limited_groups) {
            (Some(groups), Some(limited)) => limit_to_groups(&choice, groups, limited),
            _ => choice,
        };
        choice.topk(args.top_k, -1, true, false).1
    };
    let mut chosen = scores.gather(-1, &experts, false);
    if args.route_norm {
        chosen = &chosen / (chosen.sum_dim_intlist(-1, true, None::<Kind>) + 1e-20);
    }
    (chosen * args.route_scale, experts)
}

/// Node-limited routing (torchtitan's `_get_node_limited_routing_scores`): the experts in
/// `groups` equal groups, each scored by its two best experts' `choice` scores; the experts
/// outside the `limited` best groups are not chosen (their scores become -inf).
fn limit_to_groups(choice: &Tensor, groups: i64, limited: i64) -> Tensor {
    let (b, s, e) = choice.size3().expect("scores are (B, S, E)");
    let grouped = choice.view([b, s, groups, e / groups]);
    let group_scores = grouped
        .topk(2, -1, true, true)
        .0
        .sum_dim_intlist(-1, false, None::<Kind>);
    let chosen = group_scores.topk(limited, -1, true, false).1;
    let dropped = group_scores
        .ones_like()
        .to_kind(Kind::Bool)
        .scatter_value(-1, &chosen, 0);
    grouped
        .masked_fill(&dropped.unsqueeze(-1), f64::NEG_INFINITY)
        .view([b, s, e])
}

/// Every expert's SwiGLU over its run of `routed` tokens (R, D), `per_expert` (E,) tokens
/// each: `torch._grouped_mm` in bf16 (torchtitan casts the tokens and the weights whatever
/// the model's dtype), the result in `routed`'s dtype.
fn grouped_experts(routed: &Tensor, w: &MoeWeights, per_expert: &Tensor) -> Tensor {
    let offsets = per_expert.cumsum(0, Kind::Int);
    let bf16 = |t: &Tensor| t.to_kind(Kind::BFloat16);
    let mm = |a: &Tensor, weight: &Tensor| {
        a.internal_grouped_mm(
            &bf16(weight).transpose(-2, -1),
            Some(&offsets),
            None::<&Tensor>,
            None::<Kind>,
        )
    };
    let h = mm(&bf16(routed), &w.w1).silu() * mm(&bf16(routed), &w.w3);
    mm(&h, &w.w2).to_kind(routed.kind())
}

/// torchtitan's optimizer step pre-hook: each layer's token counts (`layers` in model order,
/// `(buffers, coeff)`), summed over the data-parallel ranks by `sum_over_dp`, move its
/// `expert_bias` by `coeff * sign(mean - count)` less that step's mean. The caller restarts
/// the counts ([`MoeBuffers::restart_counts`]).
pub fn update_expert_bias(
    layers: &[(&MoeBuffers, f64)],
    sum_over_dp: impl FnOnce(&Tensor) -> Result<()>,
) -> Result<()> {
    if layers.is_empty() {
        return Ok(());
    }
    tch::no_grad(|| {
        let counts = Tensor::vstack(
            &layers
                .iter()
                .map(|(b, _)| b.tokens_per_expert.shallow_clone())
                .collect::<Vec<_>>(),
        );
        sum_over_dp(&counts)?;
        for (l, (buffers, coeff)) in layers.iter().enumerate() {
            let count = counts.get(l as i64);
            let delta = (count.mean(None::<Kind>) - &count).sign() * *coeff;
            let delta = &delta - delta.mean(None::<Kind>);
            if let Some(bias) = &buffers.expert_bias {
                let mut bias = bias.shallow_clone();
                bias += &delta;
            }
        }
        Ok(())
    })
}
