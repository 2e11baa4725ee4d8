//! Expert parallelism as torchtitan 0.3.0 runs it (`AllToAllTokenDispatcher` in
//! `models/common/token_dispatcher.py`): each MoE layer's routed experts are split over the `ep`
//! ranks, rank i holding experts `[i E/ep, (i+1) E/ep)`, and every (token, choice) pair travels
//! to the rank holding its expert and back.
//!
//! A layer's forward, after the router sorted this rank's pairs by expert
//! ([`ExpertParallel::routed_experts`]):
//! 1. counts: each rank's per-expert counts all-to-all'd in blocks of `E/ep`, so each rank
//!    learns how many pairs every rank sends each of its experts; both are read to the host
//!    once (the next all-to-all's splits: one device-to-host wait per layer, as torchtitan's
//!    `_sync_token_count_exchange`);
//! 2. dispatch: the sorted tokens all-to-all'd with those splits. They arrive rank-major
//!    (rank 0's for each local expert, then rank 1's, ...) and are reordered expert-major
//!    (torchtitan's `_permute`);
//! 3. this rank's experts run over them;
//! 4. combine: the outputs reordered back (`_unpermute`) and all-to-all'd in reverse, to be
//!    weighted by their scores and added to their tokens as without expert parallelism.
//!
//! The token all-to-alls are autograd functions whose backward is the reverse all-to-all, so an
//! expert's gradient sums the tokens every rank sent it: whole on its rank, with no reduction
//! over `ep` (FSDP reduces it over `efsdp` only).

use std::sync::Arc;

use tch::{Kind, Tensor};
use titan_obs_core::vocab::moe as moe_names;

use super::kept::Kept;
use super::tp::ok;
use crate::autograd::{self, Function};
use crate::distributed::{CommError, Group};
use crate::host_sync;

/// This rank's place among the ranks that split the routed experts.
#[derive(Clone)]
pub struct ExpertParallel {
    group: Group,
    /// The group's global ranks, for a failed exchange's message.
    members: Arc<[usize]>,
}

impl ExpertParallel {
    /// Over `group`, whose ranks are the global ranks `members` (in group order).
    pub fn new(group: Group, members: Vec<usize>) -> Self {
        ExpertParallel {
            group,
            members: members.into(),
        }
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn group(&self) -> &Group {
        &self.group
    }

    /// A routed experts' tensor whole (E, ..) from every ep rank's block (E/ep, ..), in rank
    /// order. A collective.
    pub fn gather_experts(&self, local: &Tensor) -> Tensor {
        if self.size() == 1 {
            return local.shallow_clone();
        }
        let local = local.contiguous();
        let mut shape = local.size();
        shape[0] *= self.size() as i64;
        let out = Tensor::empty(shape.as_slice(), (local.kind(), local.device()));
        ok(self.group.all_gather(&out, &local));
        out
    }

    /// The routed experts' outputs for `routed` (R, D), this rank's (token, choice) pairs
    /// sorted by expert, `per_expert` (E,) of them for each expert: `experts(tokens, counts)`
    /// runs this rank's experts over tokens sorted by them (`counts` per local expert). Alone,
    /// that is all; over `ep` ranks the pairs go to their experts' ranks and the outputs come
    /// back in `routed`'s order. A collective: every ep rank calls it for the same layer.
    /// Over ranks, the local experts run inside a span named after `layer`
    /// (`moe/layer/<L>/experts`): a rank whose experts got more tokens arrives late at the
    /// all-to-all that follows, and titan-obs names the layer it came late from.
    ///
    /// Under selective activation checkpointing (`kept`) the three exchanges' outputs are kept,
    /// as torchtitan's policy saves `all_to_all_single`'s (and the counts' copy to the host):
    /// the recompute exchanges nothing.
    pub fn routed_experts(
        &self,
        layer: Option<usize>,
        routed: &Tensor,
        per_expert: &Tensor,
        experts: &dyn Fn(&Tensor, &Tensor) -> Tensor,
        kept: Option<&Kept>,
    ) -> Tensor {
        let ep = self.size();
        if ep == 1 {
            return experts(routed, per_expert);
        }
        let total = per_expert.size()[0] as usize;
        let local = total / ep;
        let exchange_counts = || {
            let sent = per_expert.to_kind(Kind::Int64).contiguous();
            let received = sent.empty_like();
            let blocks = vec![local; ep];
            exchanged(
                layer,
                "token counts",
                &self.members,
                self.group.all_to_all(&received, &sent, &blocks, &blocks),
            );
            let counts = host_sync::read_f64s(
                &Tensor::cat(&[&sent, &received], 0),
                "expert parallelism's all-to-all splits",
            );
            // On the host: a recompute reads them without waiting for the device.
            Tensor::from_slice(&counts.iter().map(|&c| c as i64).collect::<Vec<_>>())
        };
        let counts = Kept::keep_in(kept, "token counts exchange", exchange_counts, |c| c);
        let counts: Vec<usize> = Vec::<i64>::try_from(&counts)
            .expect("the token counts are a host vector of int64")
            .into_iter()
            .map(|c| c as usize)
            .collect();
        let (sent, received) = counts.split_at(total);
        let per_rank = |c: &[usize]| -> Vec<usize> {
            c.chunks(local).map(|block| block.iter().sum()).collect()
        };
        let (input_splits, output_splits) = (per_rank(sent), per_rank(received));
        let dispatch = |kept: Option<Tensor>| {
            let f = AllToAll {
                group: self.group.clone(),
                output_splits: output_splits.clone(),
                input_splits: input_splits.clone(),
                layer,
                what: ["token dispatch", "token dispatch's gradients"],
                members: self.members.clone(),
                kept,
            };
            autograd::apply(f, &[routed], 1).remove(0)
        };
        let dispatched = Kept::keep_in(
            kept,
            "token dispatch",
            || dispatch(None),
            |v| dispatch(Some(v)),
        );
        let (order, per_local_expert) = expert_major(received, ep, local);
        let device = routed.device();
        let n = order.len() as i64;
        let mut inverse = vec![0i64; order.len()];
        for (at, &from) in order.iter().enumerate() {
            inverse[from as usize] = at as i64;
        }
        let order = host_sync::upload(&order, &[n], device);
        let inverse = host_sync::upload(&inverse, &[n], device);
        let counts = host_sync::upload(&per_local_expert, &[local as i64], device);
        let out = {
            let _experts = layer.map(|l| titan_obs_core::span(moe_names::experts_span(l)));
            experts(&dispatched.index_select(0, &order), &counts)
        };
        let back = out.index_select(0, &inverse);
        let combine = |kept: Option<Tensor>| {
            let f = AllToAll {
                group: self.group.clone(),
                output_splits: input_splits.clone(),
                input_splits: output_splits.clone(),
                layer,
                what: ["combine of the experts' outputs", "combine's gradients"],
                members: self.members.clone(),
                kept,
            };
            autograd::apply(f, &[&back], 1).remove(0)
        };
        Kept::keep_in(kept, "combine", || combine(None), |v| combine(Some(v)))
    }
}

/// torchtitan's `_permute` on the host: `received` holds, rank-major, how many tokens each of
/// the `ep` ranks sent each of this rank's `local` experts (`received[r * local + e]`). Returns
/// for each position of the expert-major order (expert 0's tokens from rank 0, from rank 1,
/// ..., then expert 1's) the position it comes from in the rank-major order, and each local
/// expert's token count.
fn expert_major(received: &[usize], ep: usize, local: usize) -> (Vec<i64>, Vec<i64>) {
    let mut starts = Vec::with_capacity(received.len());
    let mut at = 0;
    for &c in received {
        starts.push(at);
        at += c;
    }
    let mut order = Vec::with_capacity(at);
    let mut per_expert = vec![0i64; local];
    for (e, count) in per_expert.iter_mut().enumerate() {
        for r in 0..ep {
            let segment = r * local + e;
            let start = starts[segment];
            order.extend((start..start + received[segment]).map(|i| i as i64));
            *count += received[segment] as i64;
        }
    }
    (order, per_expert)
}

/// `all_to_all_single` as an autograd function: forward sends `input_splits` rows to each rank
/// and receives `output_splits`; backward sends the gradients back the other way.
struct AllToAll {
    group: Group,
    output_splits: Vec<usize>,
    input_splits: Vec<usize>,
    /// The MoE layer, and what the exchange is in forward and in backward (for a failure).
    layer: Option<usize>,
    what: [&'static str; 2],
    /// The ep group's global ranks.
    members: Arc<[usize]>,
    /// The forward's output, kept by selective activation checkpointing: the recompute
    /// returns it without exchanging (the backward still exchanges the gradients).
    kept: Option<Tensor>,
}

impl Function for AllToAll {
    fn forward(&mut self, x: &[Tensor]) -> Vec<Tensor> {
        if let Some(kept) = self.kept.take() {
            return vec![kept];
        }
        vec![self.exchange(&x[0], &self.output_splits, &self.input_splits, 0)]
    }

    fn backward(&mut self, grads: &[Tensor]) -> Vec<Tensor> {
        vec![self.exchange(&grads[0], &self.input_splits, &self.output_splits, 1)]
    }
}

impl AllToAll {
    fn exchange(
        &self,
        x: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
        pass: usize,
    ) -> Tensor {
        let x = x.contiguous();
        let mut shape = x.size();
        shape[0] = output_splits.iter().sum::<usize>() as i64;
        let out = Tensor::empty(shape.as_slice(), (x.kind(), x.device()));
        exchanged(
            self.layer,
            self.what[pass],
            &self.members,
            self.group.all_to_all(&out, &x, output_splits, input_splits),
        );
        out
    }
}

/// A failed all-to-all of expert parallelism fails the step (as [`ok`] does) with the
/// collective's error — the rank at fault — and which exchange of which MoE layer it was, over
/// which ranks (`members`, global): a hung peer otherwise reads as an anonymous
/// `all_to_all_single`.
fn exchanged(layer: Option<usize>, what: &str, members: &[usize], result: Result<(), CommError>) {
    if let Err(e) = result {
        let layer = layer.map_or_else(|| "a MoE layer".to_string(), |l| format!("MoE layer {l}"));
        let ranks: Vec<String> = members.iter().map(usize::to_string).collect();
        panic!(
            "{e}\n  in {layer}'s {what} (expert parallelism's all-to-all over the ep group of \
             ranks {})",
            ranks.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torchtitan's `_permute` on its docstring's layout: 2 ranks x 2 local experts, rank-major
    /// in, expert-major out.
    #[test]
    fn tokens_are_reordered_expert_major() {
        // From rank 0: 2 tokens for expert 0, 1 for expert 1; from rank 1: 0 and 3.
        let (order, counts) = expert_major(&[2, 1, 0, 3], 2, 2);
        // Rank-major positions: r0e0 = 0, 1; r0e1 = 2; r1e1 = 3, 4, 5.
        assert_eq!(order, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(counts, vec![2, 4]);
        let (order, counts) = expert_major(&[1, 2, 3, 1], 2, 2);
        // r0e0 = 0; r0e1 = 1, 2; r1e0 = 3, 4, 5; r1e1 = 6.
        assert_eq!(order, vec![0, 3, 4, 5, 1, 2, 6]);
        assert_eq!(counts, vec![4, 3]);
    }

    /// An ep group whose peer never answers: every all-to-all times out naming it.
    struct Unanswered;

    impl crate::distributed::Collectives for Unanswered {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            2
        }
        fn backend(&self) -> &'static str {
            "fake"
        }
        fn all_reduce(
            &mut self,
            _: &Tensor,
            _: crate::distributed::ReduceOp,
        ) -> Result<(), CommError> {
            Ok(())
        }
        fn reduce_scatter(
            &mut self,
            _: &Tensor,
            _: &Tensor,
            _: crate::distributed::ReduceOp,
        ) -> Result<(), CommError> {
            Ok(())
        }
        fn all_gather(&mut self, _: &Tensor, _: &Tensor) -> Result<(), CommError> {
            Ok(())
        }
        fn broadcast(&mut self, _: &Tensor, _: usize) -> Result<(), CommError> {
            Ok(())
        }
        fn all_to_all(
            &mut self,
            _: &Tensor,
            _: &Tensor,
            _: &[usize],
            _: &[usize],
        ) -> Result<(), CommError> {
            Err(CommError::PeerTimeout {
                rank: 0,
                peer: 1,
                op: "all_to_all_single",
                timeout: std::time::Duration::from_secs(100),
            })
        }
        fn send_recv(&mut self, _: &[crate::distributed::P2pOp<'_>]) -> Result<(), CommError> {
            Ok(())
        }
        fn barrier(&mut self) -> Result<(), CommError> {
            Ok(())
        }
        fn queue(
            &mut self,
            _: crate::distributed::comm::CollectiveOp<'_>,
            _: Option<&dyn crate::distributed::comm::QueuedWork>,
        ) -> Result<crate::distributed::comm::Issued, CommError> {
            unreachable!("the blocking all-to-all is what fails")
        }
    }

    /// A hung all-to-all names the rank at fault, the collective, and the MoE layer and
    /// exchange it was in.
    #[test]
    fn a_hung_all_to_all_names_its_layer() {
        let ep = ExpertParallel::new(Group::new(Box::new(Unanswered)), vec![4, 5]);
        let routed = Tensor::zeros([4, 2], (Kind::Float, tch::Device::Cpu));
        let counts = Tensor::from_slice(&[1i64, 1, 1, 1]);
        let panic = std::panic::catch_unwind(|| {
            ep.routed_experts(Some(3), &routed, &counts, &|t, _| t.shallow_clone(), None)
        })
        .expect_err("the exchange fails");
        let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            message.contains("rank 0: rank 1 made no progress")
                && message.contains("all_to_all_single")
                && message.contains("MoE layer 3's token counts")
                && message.contains("over the ep group of ranks 4, 5"),
            "{message}"
        );
    }

    /// Alone, the experts run over the tokens as they are.
    #[test]
    fn one_rank_runs_its_experts_in_place() {
        let ep = ExpertParallel::new(Group::solo(), vec![0]);
        let routed = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).view([3, 1]);
        let counts = Tensor::from_slice(&[2i64, 1]);
        let out = ep.routed_experts(
            None,
            &routed,
            &counts,
            &|t, c| {
                assert_eq!(Vec::<i64>::try_from(c).unwrap(), vec![2, 1]);
                t * 2.0
            },
            None,
        );
        assert_eq!(
            Vec::<f32>::try_from(out.view([-1])).unwrap(),
            vec![2.0, 4.0, 6.0]
        );
    }
}
