//! Context parallelism as torchtitan 0.3.0 runs it with FlexAttention
//! (`prepare_context_parallel_input`, `apply_cp_to_forward`): the ranks of the `cp` group each
//! hold part of every sequence, and attention gathers every rank's keys and values.
//!
//! - [`ContextParallel::shard`]: after loading, the load balancer orders each sequence
//!   (`headtail`: 2 x cp chunks, rank i holding chunks i and 2 cp - 1 - i; `ptrr`: the attention
//!   mask's 128-token blocks dealt out by their work; `None`: as it is) and rank i keeps the i-th
//!   contiguous part of that order: its inputs, labels and positions. Its attention mask is built
//!   there too, in global coordinates: this rank's queries over every rank's keys in the order
//!   the gather concatenates them (causal on the global positions, and within documents for
//!   the document-causal backends).
//! - [`ContextParallel::gather`]: inside attention, K and V all-gathered over `cp` along the
//!   sequence, through an autograd function whose backward reduce-scatters their gradients
//!   (torchtitan's `flex_cp_allgather`, not a ring).
//!
//! FSDP shards over `dp_shard x cp`, so the parameters' gradients sum every rank's tokens; the
//! loss divides by the valid tokens of the whole sequences (counted before the split) summed
//! over `dp`, and the logged loss sums over `dp x cp` (torchtitan's `loss` mesh).

use tch::{Device, Kind, Tensor};
use titan_obs_core::vocab::titan;

use super::tp;
use crate::autograd::{self, Function};
use crate::config::{CP_MASK_BLOCK, CpLoadBalancer};
use crate::data::Batch;
use crate::distributed::Group;

/// This rank's place in the sequence split.
#[derive(Clone)]
pub struct ContextParallel {
    group: Group,
    balancer: CpLoadBalancer,
}

impl ContextParallel {
    pub fn new(group: Group, balancer: CpLoadBalancer) -> Self {
        ContextParallel { group, balancer }
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's part of `batch` (B, S): inputs, labels and positions (B, S / cp) and the
    /// attention mask of its queries over every rank's keys ([`Batch::cp_mask`]): causal on
    /// the global positions, and with `document_causal` (`flex`) within documents. The valid
    /// token count stays the whole sequences' (the loss's denominator, as torchtitan counts it
    /// before sharding). With one rank, `batch` itself.
    pub fn shard(&self, batch: Batch, document_causal: bool) -> Batch {
        let cp = self.size();
        if cp == 1 {
            return batch;
        }
        split(batch, self.group.rank(), cp, self.balancer, document_causal)
    }

    /// `k` and `v` (B, S / cp, heads, dim) of every cp rank, concatenated along the sequence in
    /// rank order: (B, S, heads, dim). Backward reduce-scatters their gradients to each
    /// rank's part. A collective: every cp rank calls it, in the same order.
    pub fn gather(&self, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        if self.size() == 1 {
            return (k.shallow_clone(), v.shallow_clone());
        }
        let [k, v]: [Tensor; 2] = autograd::apply(KeysValues(self.group.clone()), &[k, v], 2)
            .try_into()
            .expect("two outputs");
        (k, v)
    }
}

/// The all-gather of K and V over `cp`, whose backward reduce-scatters their gradients; both
/// directions in a `context_parallel` span (the summary's share of the step).
struct KeysValues(Group);

impl Function for KeysValues {
    fn forward(&mut self, kv: &[Tensor]) -> Vec<Tensor> {
        let _s = titan_obs_core::span(titan::CONTEXT_PARALLEL);
        kv.iter().map(|t| tp::gather_seq(&self.0, t)).collect()
    }

    fn backward(&mut self, grads: &[Tensor]) -> Vec<Tensor> {
        let _s = titan_obs_core::span(titan::CONTEXT_PARALLEL);
        grads
            .iter()
            .map(|g| tp::reduce_scatter_seq(&self.0, g))
            .collect()
    }
}

/// Rank `rank` of `cp`'s part of `batch` ([`ContextParallel::shard`]).
fn split(
    batch: Batch,
    rank: usize,
    cp: usize,
    balancer: CpLoadBalancer,
    document_causal: bool,
) -> Batch {
    let (rows, seq_len) = batch.inputs.size2().expect("a batch is (B, S)");
    let local_len = seq_len / cp as i64;
    let documents = batch.positions.eq(0).cumsum(1, Kind::Int64);
    let order = order(balancer, &documents, cp as i64)
        .expand([rows, seq_len], false)
        .contiguous();
    let local = order.narrow(1, rank as i64 * local_len, local_len);
    let take = |t: &Tensor| t.gather(1, &local, false);
    // Key j of the gathered K/V is the token at `order[j]`: rank 0's part, rank 1's, ...
    let causal = order.unsqueeze(1).le_tensor(&local.unsqueeze(2));
    let mask = if document_causal {
        let same_document = take(&documents)
            .unsqueeze(2)
            .eq_tensor(&documents.gather(1, &order, false).unsqueeze(1));
        causal.logical_and(&same_document)
    } else {
        causal
    };
    Batch {
        inputs: take(&batch.inputs),
        labels: take(&batch.labels),
        positions: take(&batch.positions),
        cp_mask: Some(mask.view([rows, 1, local_len, seq_len])),
        ..batch
    }
}

/// The load balancer's order of each sequence's positions, (1, S) or per row (B, S): rank i
/// of `cp` holds `order[.., i * S / cp..(i + 1) * S / cp]`. `documents`: each token's document
/// number (B, S), which `ptrr` deals by.
fn order(balancer: CpLoadBalancer, documents: &Tensor, cp: i64) -> Tensor {
    let (_, seq_len) = documents.size2().expect("documents are (B, S)");
    let device = documents.device();
    match balancer {
        CpLoadBalancer::None => Tensor::arange(seq_len, (Kind::Int64, device)).view([1, -1]),
        CpLoadBalancer::HeadTail => head_tail(seq_len, cp, device),
        CpLoadBalancer::Ptrr => ptrr(documents, cp),
    }
}

/// torch's `_HeadTailLoadBalancer`: the sequence in 2 x `cp` chunks; rank r's part is chunk r,
/// then chunk 2 cp - 1 - r. (1, S).
fn head_tail(seq_len: i64, cp: i64, device: Device) -> Tensor {
    let chunk = seq_len / (2 * cp);
    let chunks = Tensor::arange(seq_len, (Kind::Int64, device)).view([2 * cp, chunk]);
    let head = Tensor::arange(cp, (Kind::Int64, device));
    let tail = head.neg() + (2 * cp - 1);
    Tensor::stack(
        &[chunks.index_select(0, &head), chunks.index_select(0, &tail)],
        1,
    )
    .view([1, seq_len])
}

/// torch's `_PTRRLoadBalancer` over the document-causal mask's blocks of [`CP_MASK_BLOCK`]
/// tokens, per row: a query block's work is its non-empty key blocks (itself, and the earlier
/// blocks whose last token shares a document with its first); the blocks sorted by work
/// (descending, stable) are dealt to the ranks in a snake (0..cp, then cp-1..0, ...), and each
/// rank's blocks are kept in sequence order. (B, S).
fn ptrr(documents: &Tensor, cp: i64) -> Tensor {
    let (rows, seq_len) = documents.size2().expect("documents are (B, S)");
    let device = documents.device();
    let block = CP_MASK_BLOCK;
    let blocks = seq_len / block;
    let per_block = documents.view([rows, blocks, block]);
    let first = per_block.select(2, 0);
    let last = per_block.select(2, block - 1);
    // [row, q, kv]: kv < q and the kv block's last document is the q block's first.
    let earlier = Tensor::ones([blocks, blocks], (Kind::Bool, device)).tril(-1);
    let shared = last
        .unsqueeze(1)
        .eq_tensor(&first.unsqueeze(2))
        .logical_and(&earlier);
    let work = shared.sum_dim_intlist(2, false, Kind::Int64) + 1;
    let (_, descending) = work.sort_stable(true, 1, true);
    let snake = descending
        .view([rows, blocks / cp, cp])
        .flip([2])
        .view([rows, blocks]);
    let even_round = Tensor::arange(blocks, (Kind::Int64, device))
        .divide_scalar_mode(cp, "floor")
        .remainder(2)
        .eq(0);
    let dealt = descending.where_self(&even_round, &snake);
    let (per_rank, _) = dealt
        .view([rows, blocks / cp, cp])
        .transpose(1, 2)
        .sort(2, false);
    let starts = per_rank.reshape([rows, blocks, 1]) * block;
    (starts + Tensor::arange(block, (Kind::Int64, device))).view([rows, seq_len])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every balancer's parts, put back where the order took them from, are the batch; each
    /// part's mask is the whole sequence's document-causal mask at its queries and every
    /// part's keys.
    #[test]
    fn parts_reassemble_the_batch_and_its_mask() {
        // Rows of documents of these lengths, so that `ptrr` orders the rows differently: at
        // 512, row 0's blocks do 1, 2, 3, 4 blocks of work, row 1's 1, 1, 2, 3; at 256, 1, 2
        // and 1, 1.
        for (seq_len, documents) in [
            (512i64, &[100i64, 300, 112, 128, 384][..]),
            (256, &[256, 128, 128][..]),
        ] {
            let mut positions = Vec::new();
            for &len in documents {
                positions.extend(0..len);
            }
            let positions = Tensor::from_slice(&positions).view([2, seq_len]);
            check_parts(&positions);
        }
    }

    fn check_parts(positions: &Tensor) {
        let (rows, seq_len) = positions.size2().unwrap();
        let cp = 2usize;
        let inputs = Tensor::arange(rows * seq_len, (Kind::Int64, Device::Cpu)).view([rows, -1]);
        let whole = crate::model::document_causal_mask(positions);
        for balancer in [
            CpLoadBalancer::HeadTail,
            CpLoadBalancer::Ptrr,
            CpLoadBalancer::None,
        ] {
            for document_causal in [true, false] {
                let parts: Vec<Batch> = (0..cp)
                    .map(|rank| {
                        let batch = Batch {
                            inputs: inputs.shallow_clone(),
                            labels: &inputs + 1,
                            positions: positions.shallow_clone(),
                            valid_tokens: rows * seq_len,
                            document_offsets: Tensor::new(),
                            longest_document: 0,
                            cp_mask: None,
                        };
                        split(batch, rank, cp, balancer, document_causal)
                    })
                    .collect();
                // The gathered keys' order: every part's tokens, in rank order.
                let keys = Tensor::cat(&parts.iter().map(|p| &p.inputs).collect::<Vec<_>>(), 1);
                let (sorted, _) = keys.sort(1, false);
                assert!(sorted.equal(&inputs), "{balancer:?}: not a permutation");
                let causal = Tensor::ones([seq_len, seq_len], (Kind::Bool, Device::Cpu))
                    .tril(0)
                    .view([1, 1, seq_len, seq_len]);
                let want = if document_causal {
                    whole.shallow_clone()
                } else {
                    causal
                };
                for p in &parts {
                    let mask = p.cp_mask.as_ref().unwrap();
                    for b in 0..rows {
                        let (q, k) = (p.inputs.get(b) - b * seq_len, keys.get(b) - b * seq_len);
                        let expected = want
                            .select(0, b.min(want.size()[0] - 1))
                            .select(0, 0)
                            .index_select(0, &q)
                            .index_select(1, &k);
                        assert!(
                            mask.get(b).get(0).equal(&expected),
                            "{balancer:?} document_causal {document_causal}: row {b}'s mask"
                        );
                    }
                    assert!(p.labels.equal(&(&p.inputs + 1)), "{balancer:?}: labels");
                }
            }
        }
    }

    #[test]
    fn head_tail_pairs_chunks_as_torch() {
        // Seq 8 over 2 ranks: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1
        // and 2 (torch's `_generate_indices`).
        let order = head_tail(8, 2, Device::Cpu);
        assert_eq!(
            Vec::<i64>::try_from(order.view([-1])).unwrap(),
            vec![0, 1, 6, 7, 2, 3, 4, 5]
        );
    }

    #[test]
    fn ptrr_deals_blocks_as_torchs_docstring() {
        // torch's `_PTRRLoadBalancer` example: 16 blocks, documents of 4, 8 and 4 blocks; its
        // reorder is blocks [2, 3, 5, 6, 8, 11, 12, 13 | 0, 1, 4, 7, 9, 10, 14, 15].
        let docs: Vec<i64> = (0..16)
            .map(|b| match b {
                0..4 => 0,
                4..12 => 1,
                _ => 2,
            })
            .collect();
        let documents = Tensor::from_slice(&docs)
            .repeat_interleave_self_int(CP_MASK_BLOCK, None, None)
            .view([1, -1]);
        let order = ptrr(&documents, 2);
        let blocks: Vec<i64> = Vec::<i64>::try_from(
            order
                .view([-1])
                .slice(0, 0, None, CP_MASK_BLOCK)
                .divide_scalar_mode(CP_MASK_BLOCK, "floor"),
        )
        .unwrap();
        assert_eq!(
            blocks,
            vec![2, 3, 5, 6, 8, 11, 12, 13, 0, 1, 4, 7, 9, 10, 14, 15]
        );
    }
}
