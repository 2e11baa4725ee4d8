//! `titan-train --memory_estimation.enable`: the per-rank memory of a training step for a config
//! and a layout, by arithmetic on the model's shapes. No tensor is allocated, no rank started.
//!
//! torchtitan's own estimator (`scripts/estimate/estimation.py`, section `[memory_estimation]`,
//! key `enabled`, later `enable`) builds the model under `FakeTensorMode` and runs two steps with
//! `FSDPMemTracker`; titan-train computes the same quantities from the shapes instead, which needs
//! no device and works for any layout (TP, PP, CP included, which torchtitan's estimator skips).
//!
//! # What a rank holds
//!
//! The model is FSDP2 + torchtitan's llama3 tensor-parallel plan (sequence parallel per
//! `parallelism.enable_sequence_parallel`, loss parallel unless `parallelism.disable_loss_parallel`), on torchtitan's mesh: `Mesh::new`
//! resolves `dp_replicate x dp_shard x cp x tp x pp = world size` (the -1 rule). Notation:
//! `N = dp_shard x cp` (torchtitan's `fsdp` mesh: FSDP shards over data *and* context ranks;
//! `dp_replicate` replicates, so it divides nothing), `t = tp`, `L` layers (`ceil(L / pp)` per
//! pipeline stage), `d` dim, `h`/`k` query/kv heads, `e` head dim, `F` FFN hidden dim, `V`
//! vocabulary, `B` local batch, `S` sequence, `T = B x S / cp` tokens per rank.
//!
//! **Shapes per rank.** TP splits each weight as torchtitan's plan does (column-wise `wq`, `wk`,
//! `wv`, `w1`, `w3`, `tok_embeddings`, `lm_head`: rows / t; row-wise `wo`, `w2`: columns / t; the
//! norms replicated). FSDP2 then chunks dim 0 of every parameter's local tensor into `N` parts,
//! each `ceil(rows / N)` rows (the last padded), so a rank holds `ceil(rows / N) x cols` elements
//! of each parameter and an all-gather materialises `N x ceil(rows / N) x cols` (padded).
//!
//! | term | formula (per rank) |
//! |---|---|
//! | parameter shards | `sum_p ceil(rows_p / N) x cols_p x` bytes of `training.dtype` (fp32 master weights) |
//! | all-gathered blocks | `2 x` one block's padded unsharded size `x` bytes of the param dtype: the block computing and the one FSDP2 prefetches; every block of the stage when blocks are not resharded after forward (`fsdp_reshard_after_forward = never`, or `default` with PP) |
//! | norm + output kept | `norm` + `lm_head` unsharded in the param dtype: torchtitan does not reshard them after forward unless `always` |
//! | tok_embeddings kept | unsharded in the param dtype when blocks are not resharded after forward |
//! | gradient shards | the parameter shards' size in `training.dtype` (FSDP2 casts the reduced gradient to the sharded parameter's dtype) |
//! | unsharded gradients | the largest FSDP unit (a block, or `norm`+`lm_head`, or `tok_embeddings`) unsharded, in the param dtype: what backward produces before the reduce-scatter |
//! | reduce-scatter inputs | none for a unit that communicates nothing; else `2 x` the same unit in `mixed_precision_reduce` (fp32): FSDP copies the gradients into one per unit's backward, and keeps at most two reductions in flight (`fsdp::REDUCTIONS_IN_FLIGHT`, FSDP2's rule); under pipeline parallelism every unit of the stage in `mixed_precision_reduce` instead: the gradients summed over the step's microbatches, reduced once after the last backward |
//! | AdamW state | `2 x` the parameter shards (`exp_avg`, `exp_avg_sq`, in `training.dtype`) |
//! | saved activations | per layer and mode (below) `x` layers `x` microbatches in flight, in the param dtype |
//! | output head inputs | final norm input `T d / t` + `lm_head` input `T d` (gathered by SP), param dtype, + `rstd` |
//! | backward working set | `max(3 x T x V_l x 4` (the fp32 log-softmax output and the gradients of it and of the logits, measured; `V_l = V / t` with loss parallel), one layer's recompute + activation gradients `2 T d + 2 T F / t`: a SwiGLU's backward holds three `T F / t` gradients once w2's saved input is gone) |
//! | batch + RoPE | input ids, labels, positions (`3 B S / cp x 8`), the RoPE table (`max_seq_len x e / 2 x 8`, complex64) and its rows for the batch (`T x e / 2 x 8`), the `B x S x S` boolean document mask when attention is document-causal without the varlen kernel (under context parallelism, with any backend, this rank's queries over every key: `T x S`) |
//!
//! The gathered copies exist only when FSDP gathers something: `N > 1`, or a param dtype other
//! than `training.dtype` (FSDP2 then casts each unit, and frees the casts as gathers); the
//! reduce-scatter copies only when the unit communicates (`N > 1`, or DDP's replicas with a
//! reduce dtype other than the param dtype). With `N = 1` and one dtype (a plain fp32 single
//! process) both are 0.
//!
//! **Activations saved per layer** (elements of the param dtype; with TP, `h_l = h / t`,
//! `k_l = k / t`, `F_l = F / t`; sequence-parallel regions hold `T / t` tokens):
//!
//! - `none`: the two norm inputs `2 T d / t` (with `training.device = cpu` `4 T d / t` in fp32
//!   whatever the dtype: libtorch's CPU `rms_norm` is the composite op, which saves its input
//!   upcast to fp32 and the normalised input; qwen3's q and k norms save likewise, `T (h_l +
//!   k_l) e`); the two norm outputs all-gathered for the column-wise matmuls `2 T d` (saved by `wq`/`wk`/`wv` and `w1`/`w3`); `q` `T h_l e`; `k`, `v`
//!   `2 T k_l e` (at the kv heads: the varlen kernel, or SDPA with `enable_gqa`; under context
//!   parallelism gathered from every cp rank, `2 T cp k_l e`); the attention
//!   output `T h_l e` (also `wo`'s input); the FFN's `w1` output, its
//!   SiLU, the `w3` output and the product `4 T F_l`; plus fp32 `rstd` `2 T / t` and the
//!   attention log-sum-exp `T h_l` (x 4 bytes); with a mask (document-causal SDPA, or any
//!   attention under context parallelism) SDPA's additive copy of it, `T x S`. A mixture of experts (`E` experts, top `K`,
//!   hidden `F`, `R = T K` routed tokens) saves instead of the FFN's products: the router's
//!   scores `T E` (fp32), the grouped matmuls' bf16 inputs and outputs (`2 R d + 4 R F`, 2
//!   bytes), the experts' weights cast to bf16 (`3 E F d`, 2 bytes, unless the parameters are
//!   bf16), the fp32 expert outputs the scores weight (`R d`) and the scores (`R`); its
//!   parameters are counted whole (every expert: the memory is the total, not the active,
//!   parameters). Under expert parallelism a rank holds `E / ep` experts (their rows sharded
//!   over `efsdp = dp_shard x cp x tp / ep` instead of `N`, gathered to `E / ep`), casts those
//!   to bf16, computes the `R` tokens the ranks send them (balanced routing assumed), and its
//!   backward's working set holds the all-to-all's sent and received tokens (`2 R d`).
//! - `full`: the block input `T d / t`.
//! - `selective`, `op` (titan's rule: the 1st, 3rd, 5th, 7th matmul): the block input `T d / t`,
//!   `wq` `T h_l e`, `wv` `T k_l e`, `w1` `T F_l`, `w2` `T d` (a mixture of experts' matmuls
//!   are recomputed; torchtitan also keeps the SDPA
//!   output, `T h_l e` more); and the collectives' outputs torchtitan's policy saves, so that
//!   the recompute does not communicate them again: under tensor parallelism with sequence
//!   parallelism the two reduce-scatters `2 T d / t`, under expert parallelism the dispatched
//!   and combined tokens `2 R d`.
//! - `selective`, `N`: layers N, 2N, ... as `full`, the others as `none`.
//!
//! With checkpointing, the backward of one layer recomputes its `none` set: that minus what the
//! mode kept is the recompute term inside the backward working set.
//!
//! **Pipeline parallelism**: every stage holds `ceil(L / pp)` layers; the first also
//! `tok_embeddings`, the last `norm`+`lm_head`, the output head's inputs and the loss. The local
//! batch runs as microbatches of `pipeline_parallel_microbatch_size`; a stage keeps the saved
//! activations of those it has run forward and not yet backward: all of them with GPipe, `pp - s`
//! on stage `s` with 1F1B, at most `pp` with the interleaved schedules. Units that communicate
//! (FSDP, or DDP's replicas) sum their unsharded gradients over the step's microbatches in
//! `mixed_precision_reduce` and reduce them once after the last backward, as torch's pipeline
//! stage does: those sums (the stage's units in full) replace the gradient shards and the
//! reduce-scatter copies in every phase, and the step's gradient reduction is one more phase.
//!
//! **Peak.** The rows above are each item at its largest; they are not all alive at once. The
//! peak is the largest of the step's phases on each stage, each adding what is alive then: the
//! states (parameter shards, AdamW, gathered copies kept, the batch and RoPE) with
//! - the **forward's end** (the **loss** on the last stage): every microbatch in flight's saved
//!   activations, the output head's inputs and the logits' working set; gradients only from an
//!   earlier microbatch of the step (accumulation or PP);
//! - **a block's backward**, for each layer `j`: the saved activations of the layers up to `j`
//!   (and of the other microbatches in flight), the gradient shards of the units already done
//!   (all of them after the step's first microbatch), `j`'s recompute and gradient working set,
//!   and FSDP's unsharded gradients and reduce-scatter inputs of one unit.
//!
//! The sum of the rows is reported too (`terms_bytes`), an upper bound. Not counted: the CUDA
//! context and NCCL buffers (~1-3 GiB per GPU), the caching allocator's fragmentation, and the
//! optimizer's transient buffers. Against the peak titan-train measures (`tensor_peak_gib`,
//! tests/tests/trainer_memory_measured.rs): 0.98 to 1.10 times it on every layout it checks
//! (docs/training.md, "Against the measured tensor peak").

use anyhow::Result;
use serde_json::json;

use crate::config::ActivationCheckpointing;
use crate::config::{DtypeName, JobConfig, ReshardAfterForward};
use crate::model::{ModelArgs, Module};
use crate::parallel::Mesh;
use crate::parallelize::fsdp::REDUCTIONS_IN_FLIGHT;
use crate::parallelize::layout::{check_tensor_parallel, microbatches};
use crate::parallelize::pipeline::Schedule;
use crate::parallelize::plan::{TpStyle, tp_local_shape, tp_style};

const GIB: f64 = (1u64 << 30) as f64;

/// The mesh the estimate assumed: torchtitan's degrees, resolved by [`Mesh::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub world_size: usize,
    pub dp_replicate: usize,
    pub dp_shard: usize,
    pub cp: usize,
    pub tp: usize,
    pub pp: usize,
    /// Expert parallelism: the routed experts split over `ep` ranks, FSDP'd over `efsdp`.
    pub ep: usize,
}

impl Layout {
    /// The degrees for `world_size` ranks; a layout torchtitan's `ParallelDims` refuses is an
    /// error with its message.
    pub fn resolve(cfg: &crate::config::Parallelism, world_size: usize) -> Result<Self> {
        let mesh = Mesh::new(cfg, 0, 0, world_size)?;
        Ok(Self {
            world_size,
            dp_replicate: mesh.dp_replicate,
            dp_shard: mesh.dp_shard,
            cp: mesh.cp,
            tp: mesh.tp,
            pp: mesh.pp,
            ep: mesh.ep,
        })
    }

    /// FSDP's shard count: torchtitan's `fsdp` mesh is `dp_shard x cp`.
    pub fn fsdp(&self) -> usize {
        self.dp_shard * self.cp
    }

    /// FSDP's shard count for the routed experts under expert parallelism (torchtitan's
    /// `efsdp`: `dp_shard x cp x tp / ep`); without it, [`Layout::fsdp`].
    pub fn expert_fsdp(&self) -> usize {
        if self.ep > 1 {
            self.dp_shard * self.cp * self.tp / self.ep
        } else {
            self.fsdp()
        }
    }
}

/// Which of the four reported quantities a row adds to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Term {
    Params,
    Grads,
    Optimizer,
    Activations,
}

impl Term {
    pub fn name(self) -> &'static str {
        match self {
            Term::Params => "params",
            Term::Grads => "grads",
            Term::Optimizer => "optimizer",
            Term::Activations => "activations",
        }
    }
}

/// One line of the estimate: what it is, its bytes and how they were computed.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub term: Term,
    pub what: &'static str,
    pub bytes: u64,
    pub formula: String,
}

/// The per-rank estimate.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub layout: Layout,
    pub flavor: String,
    pub num_params: u64,
    /// Parameters this rank stores (its shards, padding included).
    pub params_per_rank: u64,
    pub local_batch_size: u64,
    pub seq_len: u64,
    pub checkpointing: ActivationCheckpointing,
    pub master_dtype: DtypeName,
    pub param_dtype: DtypeName,
    pub reduce_dtype: DtypeName,
    pub rows: Vec<Row>,
    /// The step's phases on each pipeline stage with what is alive in each: the peak is the
    /// largest.
    pub phases: Vec<Phase>,
}

/// One moment of the step on one pipeline stage, and the bytes alive then.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    pub stage: usize,
    pub what: &'static str,
    pub bytes: u64,
    pub formula: String,
}

fn bytes_of(d: DtypeName) -> u64 {
    match d {
        DtypeName::Float32 => 4,
        DtypeName::Bfloat16 | DtypeName::Float16 => 2,
    }
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// One parameter's TP-local shape: rows (FSDP's dim 0) and columns (1 for a vector).
#[derive(Debug, Clone, Copy)]
struct Shape {
    rows: u64,
    /// The product of every dimension after the first (a grouped expert weight (E, F, D) is E
    /// rows of F x D).
    cols: u64,
    /// A routed experts' tensor under expert parallelism: `rows` are this rank's `E / ep`
    /// experts, sharded over `efsdp` instead of FSDP's `N`.
    experts: bool,
}

impl Shape {
    /// Elements one rank stores: `ceil(rows / n) x cols`.
    fn shard(self, n: u64) -> u64 {
        ceil_div(self.rows, n) * self.cols
    }

    /// Elements an all-gather materialises: `n x ceil(rows / n) x cols`.
    fn unsharded(self, n: u64) -> u64 {
        self.shard(n) * n
    }
}

/// FSDP's shard counts: `n` for every parameter, `efsdp` for the routed experts under expert
/// parallelism.
#[derive(Clone, Copy)]
struct Shards {
    n: u64,
    efsdp: u64,
}

impl Shards {
    fn of(self, s: &Shape) -> u64 {
        if s.experts { self.efsdp } else { self.n }
    }
}

fn sum_shard(shapes: &[Shape], n: Shards) -> u64 {
    shapes.iter().map(|s| s.shard(n.of(s))).sum()
}

fn sum_unsharded(shapes: &[Shape], n: Shards) -> u64 {
    shapes.iter().map(|s| s.unsharded(n.of(s))).sum()
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// Estimates one rank's memory for `cfg` on `world_size` ranks.
pub fn estimate(cfg: &JobConfig, world_size: usize) -> Result<Estimate> {
    let layout = Layout::resolve(&cfg.parallelism, world_size)?;
    let args = ModelArgs::for_job(cfg)?;
    let u = |v: i64| v as u64;
    let (d, layers, heads, kv_heads, e, f, v) = (
        u(args.dim),
        u(args.n_layers),
        u(args.n_heads),
        u(args.kv_heads()),
        u(args.head_dim()),
        u(args.ffn_hidden_dim()),
        u(args.vocab_size),
    );
    let (t, n, pp, cp) = (
        layout.tp as u64,
        layout.fsdp() as u64,
        layout.pp as u64,
        layout.cp as u64,
    );
    let ep = layout.ep as u64;
    let shards = Shards {
        n,
        efsdp: layout.expert_fsdp() as u64,
    };
    // The trainer's own rules for splitting the model over tp (heads, split weights, sequence).
    check_tensor_parallel(cfg, &args, layout.tp)?;
    // Activation widths under TP: heads and features split as the plan splits q/k/v, w1/w3 and
    // lm_head's outputs.
    let (h_l, k_l, f_l, v_l) = (heads / t, kv_heads / t, ceil_div(f, t), ceil_div(v, t));
    // Parameters' TP-local shapes by the one TP plan: a block's (the first with a mixture of
    // experts, the largest, when some come after dense ones as in deepseek_v3; else layer 0's),
    // the embedding's, the head's.
    let largest_block = (args.n_dense_layers as usize).min(args.n_layers as usize - 1);
    let local = |module: Module| -> Result<Vec<Shape>> {
        args.parameters()
            .into_iter()
            .filter(|p| p.module == module)
            .map(|p| {
                let style = tp_style(&p.fqn)?;
                // Under expert parallelism the routed experts split over `ep`, not `tp`.
                let experts = ep > 1 && matches!(style, TpStyle::ExpertRows | TpStyle::ExpertCols);
                let shape = if experts {
                    let mut s = p.shape.clone();
                    s[0] /= ep as i64;
                    s
                } else {
                    tp_local_shape(&p.shape, style, t as i64)?
                };
                Ok(Shape {
                    rows: u(shape[0]),
                    cols: shape[1..].iter().copied().map(u).product(),
                    experts,
                })
            })
            .collect()
    };
    let (block, embed, head) = (
        local(Module::Layer(largest_block))?,
        local(Module::Embeddings)?,
        local(Module::Head)?,
    );
    let stage_layers = ceil_div(layers, pp);

    let master = cfg.training.dtype;
    let param = if master == DtypeName::Float32 {
        cfg.training.mixed_precision_param
    } else {
        master
    };
    let reduce = cfg.training.mixed_precision_reduce;
    let (mb, pb, rb) = (bytes_of(master), bytes_of(param), bytes_of(reduce));

    let shard_elems = stage_layers * sum_shard(&block, shards)
        + sum_shard(&embed, shards)
        + sum_shard(&head, shards);
    let block_full = sum_unsharded(&block, shards);
    let embed_full = sum_unsharded(&embed, shards);
    let head_full = sum_unsharded(&head, shards);
    let gathers = n > 1 || pb != mb;

    let policy = cfg.parallelism.fsdp_reshard_after_forward;
    let reshard_blocks = match policy {
        ReshardAfterForward::Always => true,
        ReshardAfterForward::Never => false,
        ReshardAfterForward::Default => pp == 1,
    };
    let mut rows = Vec::new();
    let mut row = |term, what, bytes, formula: String| {
        rows.push(Row {
            term,
            what,
            bytes,
            formula,
        })
    };
    let mesh_note = format!("N = dp_shard {} x cp {cp} = {n}", layout.dp_shard);
    row(
        Term::Params,
        "parameter shards",
        shard_elems * mb,
        format!(
            "sum_p ceil(rows_p / N) x cols_p = {shard_elems} elements x {mb} B ({}; {mesh_note}; \
             {stage_layers} layers + tok_embeddings + norm + lm_head, TP-local shapes)",
            master.name()
        ),
    );
    // With PP, the local batch runs as microbatches of `pipeline_parallel_microbatch_size`
    // samples; a stage keeps the saved activations of the microbatches it has run forward but
    // not yet backward: all of them with GPipe, `pp - s` on stage `s` with 1F1B, and at most
    // `pp` on a rank's stages of the interleaved schedules (counted so on every stage).
    let batch = cfg.training.local_batch_size as u64;
    let pp_micro = (cfg.parallelism.pipeline_parallel_microbatch_size.max(1) as u64).min(batch);
    let microbatches_per_step = if pp > 1 { batch / pp_micro } else { 1 };
    let schedule =
        Schedule::parse(&cfg.parallelism.pipeline_parallel_schedule).map_err(anyhow::Error::msg)?;
    let in_flight_on = |stage: u64| match (pp, schedule) {
        (1, _) => 1,
        (_, Schedule::GPipe) => microbatches_per_step,
        (_, Schedule::OneFOneB) => (pp - stage).min(microbatches_per_step),
        _ => pp.min(microbatches_per_step),
    };
    let in_flight = in_flight_on(0);
    // Blocks not resharded after forward are kept gathered, once: under pipeline parallelism
    // a unit's first gather of a step serves the step's other microbatches (FSDP2 under torch's
    // schedules), so one copy lives from the stage's first forward to the step's end.
    // (A unit of one shard that casts to another param dtype frees its cast copy as it would a
    // gather, as FSDP2 on one rank does.)
    let gathered_blocks = match (gathers, reshard_blocks) {
        (false, _) => 0,
        (true, true) => stage_layers.min(2),
        (true, false) => stage_layers,
    };
    row(
        Term::Params,
        "all-gathered blocks",
        gathered_blocks * block_full * pb,
        if gathers {
            format!(
                "{gathered_blocks} blocks ({}) x {block_full} elements (N x ceil(rows / N) x cols) x {pb} B ({})",
                if reshard_blocks {
                    "the one computing + the one prefetched"
                } else if pp > 1 {
                    "not resharded after forward: gathered once a step, for every microbatch"
                } else {
                    "not resharded after forward"
                },
                param.name()
            )
        } else {
            "nothing to gather: N = 1 and one dtype".into()
        },
    );
    let head_kept = gathers && policy != ReshardAfterForward::Always;
    row(
        Term::Params,
        "norm + lm_head kept after forward",
        if head_kept { head_full * pb } else { 0 },
        if head_kept {
            format!(
                "{head_full} elements x {pb} B: torchtitan reshards them after forward only with \
                 fsdp_reshard_after_forward = always"
            )
        } else {
            "resharded after forward, or nothing gathered".into()
        },
    );
    let embed_kept = gathers && !reshard_blocks;
    row(
        Term::Params,
        "tok_embeddings kept after forward",
        if embed_kept { embed_full * pb } else { 0 },
        if embed_kept {
            format!("{embed_full} elements x {pb} B: not resharded after forward")
        } else {
            "resharded after forward, or nothing gathered".into()
        },
    );

    row(
        Term::Grads,
        "gradient shards",
        shard_elems * mb,
        format!(
            "as the parameter shards: {shard_elems} elements x {mb} B ({})",
            master.name()
        ),
    );
    let largest_unit = block_full.max(embed_full).max(head_full);
    let unit_name = if largest_unit == block_full {
        "a block"
    } else if largest_unit == head_full {
        "norm + lm_head"
    } else {
        "tok_embeddings"
    };
    // Under pipeline parallelism every unit that communicates (FSDP, or DDP's replicas) sums
    // its unsharded gradients over the step's microbatches in the reduce dtype and reduces the
    // sums once, after the last backward (torch's stage): a stage's gradients in full, which
    // are also the reductions' send buffers.
    let sums_for_step = pp > 1 && (n > 1 || layout.dp_replicate > 1);
    // A unit's backward hands its unsharded gradients to FSDP (or to DDP's sum, under PP).
    let unit_grads_apart = gathers || sums_for_step;
    row(
        Term::Grads,
        "unsharded gradients of one unit",
        if unit_grads_apart {
            largest_unit * pb
        } else {
            0
        },
        if unit_grads_apart {
            format!(
                "the largest FSDP unit ({unit_name}) {largest_unit} elements x {pb} B ({})",
                param.name()
            )
        } else {
            "gradients accumulate in place: N = 1 and one dtype".into()
        },
    );
    // The reduce-scatter sends a copy in the reduce dtype; DDP's all-reduce too where that is
    // another dtype; a unit that communicates nothing, none.
    let copies_in = n > 1 || (layout.dp_replicate > 1 && pb != rb);
    let stage_full = |first: bool, last: bool| {
        stage_layers * block_full
            + if first { embed_full } else { 0 }
            + if last { head_full } else { 0 }
    };
    let largest_stage = (0..pp)
        .map(|s| stage_full(s == 0, s == pp - 1))
        .max()
        .unwrap_or(0);
    row(
        Term::Grads,
        "reduce-scatter inputs",
        if sums_for_step {
            largest_stage * rb
        } else if gathers && copies_in {
            REDUCTIONS_IN_FLIGHT as u64 * largest_unit * rb
        } else {
            0
        },
        if sums_for_step {
            format!(
                "every unit of the largest stage, summed over the step's microbatches and \
                 reduced after the last backward: {largest_stage} elements x {rb} B ({}, \
                 mixed_precision_reduce)",
                reduce.name()
            )
        } else if gathers && copies_in {
            format!(
                "{REDUCTIONS_IN_FLIGHT} reductions in flight x {largest_unit} elements x {rb} B \
                 ({}, mixed_precision_reduce)",
                reduce.name()
            )
        } else {
            "no reduce-scatter copy".into()
        },
    );
    row(
        Term::Optimizer,
        "AdamW exp_avg + exp_avg_sq",
        2 * shard_elems * mb,
        format!("2 x {shard_elems} elements x {mb} B ({})", master.name()),
    );

    // Activations, per microbatch.
    let seq = cfg.training.seq_len as u64;
    let micro_batch = if pp > 1 { pp_micro } else { batch };
    let tokens = ceil_div(micro_batch * seq, cp);
    // A sequence-parallel region: tokens split over tp (replicated with
    // `enable_sequence_parallel = false`).
    let seq_parallel = cfg.parallelism.enable_sequence_parallel;
    let sp = |x: u64| if seq_parallel { ceil_div(x, t) } else { x };
    let ab = pb;
    let device_cpu = cfg.training.device == crate::config::DeviceChoice::Cpu;
    let document_causal = cfg.model.attn_backend.document_causal();
    // titan's model runs FlashAttention's varlen kernel for document-causal attention with
    // bf16/fp16 activations on CUDA (no mask); otherwise SDPA, with a (B, 1, S, S) boolean mask
    // when document-causal.
    let varlen = document_causal && ab == 2 && !device_cpu;
    // Both attention paths take k and v at the kv heads (SDPA with `enable_gqa`).
    let kv_saved = k_l;
    // What an rms_norm over `x` elements saves, in bytes. libtorch's CPU rms_norm is the
    // composite one: it upcasts the input to fp32 and saves that and the normalised input, in
    // fp32 whatever the activations' dtype (`2 x 4 B` an element; a bf16 input itself is not
    // saved). CUDA's fused kernel saves the input in its dtype and rstd only.
    let norm_saved = |x: u64| if device_cpu { 2 * x * 4 } else { x * ab };
    // The feed-forward's saved tensors and its backward's gradients: a SwiGLU's four (B, S, F)
    // products, or a mixture of experts' (below).
    let (ffn_saved, ffn_ws, ep_exchanged) = match args.moe_layer(largest_block) {
        // A SwiGLU's backward holds three T x F gradients at once (of w2's input, then of the
        // gate and up outputs), by when w2's saved input has gone: two more than it saved.
        None => (4 * tokens * f_l * ab, 2 * tokens * f_l * ab, 0),
        Some(moe) => {
            // This rank's experts: all, or under expert parallelism its `E / ep`. The routed
            // tokens it computes: its own `T K`, or under expert parallelism what the ranks
            // send its experts, `T K` when the routing is balanced (the estimate's assumption).
            // Under expert parallelism with tensor parallelism each tp rank routes its own
            // block of the sequence (`T / t` tokens), and the experts are whole; without it
            // tensor parallelism splits their hidden features.
            let all_experts = u(moe.num_experts);
            let (experts, k) = (all_experts / ep, u(moe.top_k));
            let (routing, f) = if ep > 1 {
                (tokens / t, u(moe.hidden_dim))
            } else {
                (tokens, ceil_div(u(moe.hidden_dim), t))
            };
            let routed = routing * k;
            // Router: the softmax/sigmoid output (fp32, T x E). Grouped matmuls in bf16: the
            // routed tokens cast twice (w1's and w3's input), the w1 and w3 outputs and SiLU
            // (3 R F), their product (w2's input, R F); the weights' bf16 copies (3 E F D)
            // unless the parameters are bf16 already. The combine: fp32 outputs (R D) and
            // scores.
            let weights = if pb == 2 { 0 } else { 3 * experts * f * d * 2 };
            let saved = routing * all_experts * 4
                + (2 * routed * d + 4 * routed * f) * 2
                + weights
                + routed * d * 4
                + routed * 4;
            // Expert parallelism's all-to-alls hold the sent and the received tokens, and their
            // expert-major copy, while the experts run (2 R d more than without).
            let exchanged = if ep > 1 { 2 * routed * d * ab } else { 0 };
            (
                saved,
                3 * routed * f * 2 + routed * d * 4 + exchanged,
                exchanged,
            )
        }
    };
    // Attention saves k and v as it reads them: under context parallelism every cp rank's,
    // gathered (B x S keys for T = B x S / cp queries).
    let none_elems =
        2 * tokens * d + tokens * h_l * e + 2 * tokens * cp * kv_saved * e + tokens * h_l * e;
    let none_fp32 = 2 * sp(tokens) + tokens * h_l;
    // SDPA given a boolean mask saves it as an additive one in the activations' dtype, T x S
    // per layer (measured: +8.0 MiB a layer at b8 x s512 in fp32 on one process, +4.0 MiB
    // under cp 2).
    let masked = cp > 1 || (document_causal && !varlen);
    let mask_saved = if masked { tokens * seq * ab } else { 0 };
    // The block's two norms (over the sequence-parallel tokens), and qwen3's per-head norms of
    // q and k before RoPE.
    let norms_saved = 2 * norm_saved(sp(tokens * d))
        + if args.qk_norm {
            norm_saved(tokens * h_l * e) + norm_saved(tokens * k_l * e)
        } else {
            0
        };
    let none_bytes = norms_saved + none_elems * ab + none_fp32 * 4 + ffn_saved + mask_saved;
    let input_bytes = sp(tokens * d) * ab;
    // Selective op AC keeps every other linear's output (wq, wv, w1, w2); a mixture of experts'
    // grouped matmuls are recomputed.
    let ffn_kept = if args.moe.is_some() {
        0
    } else {
        tokens * f_l + tokens * d
    };
    let op_kept = (sp(tokens * d) + tokens * h_l * e + tokens * k_l * e + ffn_kept) * ab;
    // ... and the outputs of the collectives torchtitan's policy saves, which `none` does not
    // save (the recompute does not make them again): tensor parallelism's two reduce-scatters
    // under sequence parallelism (`T d / t` each) and expert parallelism's dispatched and
    // combined tokens (`2 R d`).
    let reduce_scattered = if t > 1 && seq_parallel {
        2 * sp(tokens * d) * ab
    } else {
        0
    };
    let op_bytes = op_kept + reduce_scattered + ep_exchanged;
    let policy_ac = cfg.activation_checkpoint.policy();
    let (saved_per_stage, kept_when_recomputed, ac_name) = match policy_ac {
        ActivationCheckpointing::None => (stage_layers * none_bytes, none_bytes, "none".into()),
        ActivationCheckpointing::Full => (stage_layers * input_bytes, input_bytes, "full".into()),
        ActivationCheckpointing::Op => (stage_layers * op_bytes, op_kept, "selective op".into()),
        ActivationCheckpointing::EveryNthLayer(every) => {
            let whole = stage_layers / every;
            (
                whole * input_bytes + (stage_layers - whole) * none_bytes,
                if whole > 0 { input_bytes } else { none_bytes },
                format!("selective every {every}"),
            )
        }
    };
    row(
        Term::Activations,
        "saved activations",
        saved_per_stage * in_flight,
        format!(
            "{stage_layers} layers x {} per layer ({ac_name}; none would be {}){}; T = {tokens} \
             tokens{}",
            mib(saved_per_stage / stage_layers.max(1)),
            mib(none_bytes),
            if in_flight > 1 {
                format!(" x {in_flight} microbatches in flight")
            } else {
                String::new()
            },
            if args.moe.is_some() {
                ", a mixture of experts in each"
            } else {
                ""
            }
        ),
    );
    let head_inputs = norm_saved(sp(tokens * d)) + tokens * d * ab + sp(tokens) * 4;
    row(
        Term::Activations,
        "final norm + lm_head inputs",
        head_inputs,
        format!(
            "{} + T d x {ab} B + rstd T / t x 4 B",
            if device_cpu {
                "2 x T d / t x 4 B (CPU rms_norm saves its input and the normalised input, in fp32)"
                    .to_string()
            } else {
                format!("T d / t x {ab} B")
            }
        ),
    );
    let v_loss = if t > 1 && !cfg.parallelism.disable_loss_parallel {
        v_l
    } else {
        v
    };
    // Measured (trainer_memory_measured, live bytes around one process's step): when the
    // loss's backward starts, the log-softmax output the forward saved and the gradients of it
    // and of the logits are alive at once.
    let loss_ws = 3 * tokens * v_loss * 4;
    let recompute = none_bytes.saturating_sub(kept_when_recomputed);
    let grad_ws = 2 * tokens * d * ab + ffn_ws;
    let layer_ws = match policy_ac {
        ActivationCheckpointing::None => grad_ws,
        _ => recompute + grad_ws,
    };
    row(
        Term::Activations,
        "backward working set",
        loss_ws.max(layer_ws),
        format!(
            "max(logits + cross-entropy 3 x T x {v_loss} x 4 B = {}, one layer's recompute {} + \
             activation gradients (2 T d x {ab} B + the feed-forward's) = {})",
            mib(loss_ws),
            mib(if policy_ac == ActivationCheckpointing::None {
                0
            } else {
                recompute
            }),
            mib(grad_ws)
        ),
    );
    let rope_table = u(args.max_seq_len) * (e / 2) * 8;
    let rope_rows = tokens * (e / 2) * 8;
    let batch_tensors = 3 * ceil_div(micro_batch * seq, cp) * 8;
    // Under context parallelism every backend attends with a mask: this rank's T queries
    // over all S keys.
    let mask = if cp > 1 {
        tokens * seq
    } else if document_causal && !varlen {
        micro_batch * seq * seq
    } else {
        0
    };
    row(
        Term::Activations,
        "batch, RoPE and mask",
        rope_table + rope_rows + batch_tensors + mask,
        format!(
            "ids/labels/positions 3 x {} x 8 B + RoPE table {} x {} x 8 B + its rows {tokens} x \
             {} x 8 B + mask {}",
            ceil_div(micro_batch * seq, cp),
            args.max_seq_len,
            e / 2,
            e / 2,
            if mask > 0 && cp > 1 {
                format!("T x S = {mask} B")
            } else if mask > 0 {
                format!("B x S x S = {mask} B")
            } else {
                "none".into()
            }
        ),
    );

    // The peak: the largest of the step's phases on each stage, each adding what is alive
    // then (the rows above are each item at its own largest; they need not coincide).
    let inputs = rope_table + rope_rows + batch_tensors + mask;
    let accumulation = microbatches(&cfg.training, layout.dp_replicate * layout.dp_shard)?;
    // Gradients stay from an earlier microbatch of the step (accumulation, or PP's several).
    let accumulating = accumulation > 1 || microbatches_per_step > 1;
    // Each layer's saved activations and its backward's working set, bottom up.
    // (The first stage's layers, by the model's own rule of which layers are checkpointed.)
    let per_layer: Vec<(u64, u64)> = (0..stage_layers as usize)
        .map(|layer| {
            if policy_ac.whole_layer(layer) {
                (input_bytes, none_bytes - input_bytes + grad_ws)
            } else if policy_ac == ActivationCheckpointing::Op {
                (op_bytes, none_bytes.saturating_sub(op_kept) + grad_ws)
            } else {
                (none_bytes, grad_ws)
            }
        })
        .collect();
    let stage_saved: u64 = per_layer.iter().map(|(saved, _)| saved).sum();
    let mut phases = Vec::new();
    for stage in 0..pp {
        let (first, last) = (stage == 0, stage == pp - 1);
        let k = in_flight_on(stage);
        let block_shards = sum_shard(&block, shards) * mb;
        let embed_shards = if first {
            sum_shard(&embed, shards) * mb
        } else {
            0
        };
        let head_shards = if last {
            sum_shard(&head, shards) * mb
        } else {
            0
        };
        let shards = stage_layers * block_shards + embed_shards + head_shards;
        let gathered = match (gathers, reshard_blocks) {
            (false, _) => 0,
            (true, true) => stage_layers.min(2) * block_full * pb,
            (true, false) => stage_layers * block_full * pb,
        } + if last && head_kept { head_full * pb } else { 0 }
            + if first && embed_kept {
                embed_full * pb
            } else {
                0
            };
        // Between stages: each microbatch in flight's output, kept as the root of its backward
        // (on the last stage its input), and the activation or gradient being received.
        let boundary = if pp > 1 { (k + 1) * tokens * d * pb } else { 0 };
        // Parameter shards, AdamW's two moments, gathered copies kept, the batch and RoPE.
        let states = 3 * shards + gathered + inputs + boundary;
        let largest = block_full
            .max(if first { embed_full } else { 0 })
            .max(if last { head_full } else { 0 });
        // Under PP the gradients sum in `summed` (no shard has one until the step's end), and
        // a unit's backward adds its unsharded gradients to them instead of sending a copy.
        let summed = if sums_for_step {
            stage_full(first, last) * rb
        } else {
            0
        };
        let reducing = if unit_grads_apart {
            largest * pb
                + if copies_in && !sums_for_step {
                    REDUCTIONS_IN_FLIGHT as u64 * largest * rb
                } else {
                    0
                }
        } else {
            0
        };
        let earlier_grads = match (sums_for_step, accumulating) {
            (true, _) => summed,
            (false, true) => shards,
            (false, false) => 0,
        };
        // The loss's backward ends in lm_head's, whose gradient (unsharded, and the copy its
        // reduce-scatter sends, under FSDP) comes while the logits' working set is alive.
        let head_grads = match (last, gathers) {
            (false, _) => 0,
            (true, false) => head_shards,
            (true, true) => {
                head_full * pb
                    + if copies_in && !sums_for_step {
                        head_full * rb
                    } else {
                        0
                    }
            }
        };
        let head_phase = if last {
            head_inputs + loss_ws + head_grads
        } else {
            0
        };
        phases.push(Phase {
            stage: stage as usize,
            what: if last { "loss" } else { "forward's end" },
            bytes: states + earlier_grads + k * stage_saved + head_phase,
            formula: format!(
                "states {} + earlier gradients {} + {k} x saved activations {}{}",
                mib(states),
                mib(earlier_grads),
                mib(stage_saved),
                if last {
                    format!(
                        " + output head inputs, loss and lm_head's gradient {}",
                        mib(head_phase)
                    )
                } else {
                    String::new()
                }
            ),
        });
        // Backward of layer j: the layers below still hold theirs, the ones above have their
        // gradient shards (all of them when accumulating), and the other microbatches in
        // flight keep all of theirs.
        let (bytes, formula) = (0..stage_layers as usize)
            .map(|j| {
                let below: u64 = per_layer[..=j].iter().map(|(saved, _)| saved).sum();
                let grads = match (sums_for_step, accumulating) {
                    (true, _) => summed,
                    (false, true) => shards,
                    (false, false) => head_shards + (stage_layers - 1 - j as u64) * block_shards,
                };
                let ws = per_layer[j].1;
                let bytes = states + grads + (k - 1) * stage_saved + below + ws + reducing;
                let formula = format!(
                    "layer {j}: states {} + gradients {} + {} x saved activations + {} below + \
                     working set {} + gradient reduction {}",
                    mib(states),
                    mib(grads),
                    k - 1,
                    mib(below),
                    mib(ws),
                    mib(reducing)
                );
                (bytes, formula)
            })
            .max_by_key(|(bytes, _)| *bytes)
            .unwrap_or((states, "no layers".into()));
        phases.push(Phase {
            stage: stage as usize,
            what: "a block's backward",
            bytes,
            formula,
        });
        if sums_for_step {
            // After the last backward: the sums are reduced (each freed when its reduction is
            // done) into the gradient shards, with every activation gone.
            phases.push(Phase {
                stage: stage as usize,
                what: "the step's gradient reduction",
                bytes: states + summed + shards,
                formula: format!(
                    "states {} + summed gradients {} + gradient shards {}",
                    mib(states),
                    mib(summed),
                    mib(shards)
                ),
            });
        }
    }

    let (num_params, _) = args.num_params();
    Ok(Estimate {
        layout,
        flavor: cfg.model.flavor.clone(),
        num_params: num_params as u64,
        params_per_rank: shard_elems,
        local_batch_size: batch,
        seq_len: seq,
        checkpointing: policy_ac,
        master_dtype: master,
        param_dtype: param,
        reduce_dtype: reduce,
        rows,
        phases,
    })
}

impl Estimate {
    /// The sum of the rows of `term`.
    pub fn bytes(&self, term: Term) -> u64 {
        self.rows
            .iter()
            .filter(|r| r.term == term)
            .map(|r| r.bytes)
            .sum()
    }

    pub fn params_bytes(&self) -> u64 {
        self.bytes(Term::Params)
    }

    pub fn grads_bytes(&self) -> u64 {
        self.bytes(Term::Grads)
    }

    pub fn optimizer_bytes(&self) -> u64 {
        self.bytes(Term::Optimizer)
    }

    pub fn activations_bytes(&self) -> u64 {
        self.bytes(Term::Activations)
    }

    /// The four terms added: every item at its own largest, an upper bound of the peak.
    pub fn terms_bytes(&self) -> u64 {
        self.params_bytes() + self.grads_bytes() + self.optimizer_bytes() + self.activations_bytes()
    }

    /// The largest phase (module doc: "Peak").
    pub fn peak_bytes(&self) -> u64 {
        self.peak_phase().map_or(0, |p| p.bytes)
    }

    /// The phase that sets the peak.
    pub fn peak_phase(&self) -> Option<&Phase> {
        self.phases.iter().max_by_key(|p| p.bytes)
    }

    fn layout_line(&self) -> String {
        let l = &self.layout;
        format!(
            "world {} = dp_replicate {} x dp_shard {} x cp {} x tp {} x pp {} (FSDP shards over \
             dp_shard x cp = {})",
            l.world_size,
            l.dp_replicate,
            l.dp_shard,
            l.cp,
            l.tp,
            l.pp,
            l.fsdp()
        )
    }

    /// `--memory_estimation.json`: one object, the five sums first.
    pub fn to_json(&self) -> serde_json::Value {
        let l = &self.layout;
        json!({
            "params_bytes": self.params_bytes(),
            "grads_bytes": self.grads_bytes(),
            "optimizer_bytes": self.optimizer_bytes(),
            "activations_bytes": self.activations_bytes(),
            "terms_bytes": self.terms_bytes(),
            "peak_bytes": self.peak_bytes(),
            "layout": {
                "world_size": l.world_size,
                "dp_replicate": l.dp_replicate,
                "dp_shard": l.dp_shard,
                "cp": l.cp,
                "tp": l.tp,
                "pp": l.pp,
                "fsdp": l.fsdp(),
            },
            "model": {
                "flavor": self.flavor,
                "num_params": self.num_params,
                "params_per_rank": self.params_per_rank,
            },
            "local_batch_size": self.local_batch_size,
            "seq_len": self.seq_len,
            "activation_checkpointing": format!("{:?}", self.checkpointing),
            "dtypes": {
                "master": self.master_dtype.name(),
                "param": self.param_dtype.name(),
                "reduce": self.reduce_dtype.name(),
            },
            "rows": self.rows.iter().map(|r| json!({
                "term": r.term.name(),
                "what": r.what,
                "bytes": r.bytes,
                "formula": r.formula,
            })).collect::<Vec<_>>(),
            "phases": self.phases.iter().map(|p| json!({
                "stage": p.stage,
                "what": p.what,
                "bytes": p.bytes,
                "formula": p.formula,
            })).collect::<Vec<_>>(),
        })
    }

    /// The human-readable table: one row per item, each term's total, the peak.
    pub fn table(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "titan-train memory estimate, per rank (arithmetic on the shapes; nothing allocated)\n",
        );
        out.push_str(&format!(
            "  model: llama3 {} ({} parameters, {} stored per rank); local_batch_size {} x \
             seq_len {}; activation checkpointing {:?}\n",
            self.flavor,
            self.num_params,
            self.params_per_rank,
            self.local_batch_size,
            self.seq_len,
            self.checkpointing
        ));
        out.push_str(&format!("  layout: {}\n", self.layout_line()));
        out.push_str(&format!(
            "  dtypes: parameters/gradients/AdamW {}, gathered + activations {}, reduce {}\n\n",
            self.master_dtype.name(),
            self.param_dtype.name(),
            self.reduce_dtype.name()
        ));
        out.push_str(&format!(
            "  {:<12} {:<42} {:>10} {:>18}\n",
            "term", "item", "GiB", "bytes"
        ));
        let line = |out: &mut String, term: &str, what: &str, bytes: u64| {
            out.push_str(&format!(
                "  {:<12} {:<42} {:>10.3} {:>18}\n",
                term,
                what,
                bytes as f64 / GIB,
                bytes
            ));
        };
        for term in [
            Term::Params,
            Term::Grads,
            Term::Optimizer,
            Term::Activations,
        ] {
            for r in self.rows.iter().filter(|r| r.term == term) {
                line(&mut out, term.name(), r.what, r.bytes);
                out.push_str(&format!("  {:<12}   = {}\n", "", r.formula));
            }
            line(&mut out, term.name(), "TOTAL", self.bytes(term));
            out.push('\n');
        }
        line(
            &mut out,
            "terms",
            "params + grads + optimizer + activations",
            self.terms_bytes(),
        );
        out.push('\n');
        for p in &self.phases {
            let what = format!("stage {}: {}", p.stage, p.what);
            line(&mut out, "phase", &what, p.bytes);
            out.push_str(&format!("  {:<12}   = {}\n", "", p.formula));
        }
        let what = match self.peak_phase() {
            Some(p) => format!("the largest phase (stage {}: {})", p.stage, p.what),
            None => "no phase".into(),
        };
        line(&mut out, "peak", &what, self.peak_bytes());
        out.push_str(
            "  (not counted: CUDA context and NCCL buffers, allocator fragmentation; see \
             docs/training.md#memory-estimate)\n",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command_line;

    fn config(args: &[&str]) -> JobConfig {
        let cl = command_line::parse(args.iter().map(|s| s.to_string()).collect()).unwrap();
        JobConfig::load(&cl).unwrap()
    }

    fn registry(name: &str, extra: &[&str]) -> JobConfig {
        let module = name.split('_').next().unwrap_or(name);
        let mut args = vec!["--module", module, "--config", name];
        args.extend_from_slice(extra);
        args.push("--memory_estimation.enable");
        config(&args)
    }

    fn backward_ws(est: &Estimate) -> u64 {
        est.rows
            .iter()
            .find(|r| r.what == "backward working set")
            .unwrap()
            .bytes
    }

    #[test]
    fn debugmodel_on_one_fp32_rank_is_the_plain_sum() {
        let cfg = config(&[
            "--training.mixed_precision_param",
            "float32",
            "--memory_estimation.enable",
        ]);
        let est = estimate(&cfg, 1).unwrap();
        let args = ModelArgs::flavor("debugmodel").unwrap();
        let p = args.num_params().0 as u64;
        assert_eq!(est.params_per_rank, p);
        // N = 1, one dtype: no gathered copies, no reduce-scatter buffers.
        assert_eq!(est.params_bytes(), 4 * p);
        assert_eq!(est.grads_bytes(), 4 * p);
        assert_eq!(est.optimizer_bytes(), 8 * p);
        assert!(est.activations_bytes() > 0);
        assert_eq!(
            est.terms_bytes(),
            16 * p + est.activations_bytes(),
            "the terms add up"
        );
        // One microbatch, no checkpointing: the loss is the largest phase, when every layer's
        // activations are saved and the logits' working set is alive but no gradient yet.
        let peak = est.peak_phase().unwrap();
        assert_eq!(peak.what, "loss", "{}", est.table());
        // The backward working set there is the loss's, and lm_head's gradient the only one:
        // the terms less the other gradient shards.
        assert!(backward_ws(&est) > 0);
        let lm_head = (args.vocab_size * args.dim * 4) as u64;
        let norm = (args.dim * 4) as u64;
        assert_eq!(
            est.peak_bytes(),
            est.terms_bytes() - est.grads_bytes() + lm_head + norm
        );
    }

    /// The debug model at b2 x s64 with sdpa (no mask), and `extra`.
    fn b2_s64(extra: &[&str]) -> JobConfig {
        let mut args = vec![
            "--training.local_batch_size",
            "2",
            "--training.seq_len",
            "64",
            "--validation.seq_len",
            "64",
            "--model.attn_backend",
            "sdpa",
            "--memory_estimation.enable",
        ];
        args.extend_from_slice(extra);
        config(&args)
    }

    #[test]
    fn debugmodel_none_activations_by_hand() {
        // b2 x s64, fp32, sdpa (no mask), one rank: every term written out.
        let cfg = b2_s64(&["--training.mixed_precision_param", "float32"]);
        let est = estimate(&cfg, 1).unwrap();
        let (tk, d, h, e, f, v, l) = (128u64, 256u64, 16u64, 16u64, 768u64, 2048u64, 6u64);
        // norm inputs 2Td, gathered norm outputs 2Td, q, k, v (repeated), out: 4 T h e, FFN 4TF.
        let per_layer = (4 * tk * d + 4 * tk * h * e + 4 * tk * f) * 4 + (2 * tk + tk * h) * 4;
        let saved = l * per_layer;
        let head = 2 * tk * d * 4 + tk * 4;
        let loss = 3 * tk * v * 4;
        let grads = (2 * tk * d + 3 * tk * f) * 4;
        let other = 64 * (e / 2) * 8 + tk * (e / 2) * 8 + 3 * tk * 8;
        assert_eq!(
            est.activations_bytes(),
            saved + head + loss.max(grads) + other
        );
    }

    /// bf16 parameters on one CPU process, as `trainer_memory_measured` measured them: the CPU
    /// rms_norm saves fp32 whatever the dtype, the blocks' cast copies are freed after forward
    /// as gathers are (kept for the step under PP), and nothing is copied for a reduction.
    #[test]
    fn one_process_with_bf16_parameters_on_cpu() {
        let row =
            |est: &Estimate, what: &str| est.rows.iter().find(|r| r.what == what).unwrap().bytes;
        let cpu = ["--training.device", "cpu"];
        let est = estimate(&b2_s64(&cpu), 1).unwrap();
        let (tk, d, h, e, f) = (128u64, 256u64, 16u64, 16u64, 768u64);
        // Two norms saving 2 T d in fp32; norm outputs 2Td, q, k, v, out 4 T h e, FFN 4 T F in
        // bf16; rstd and the log-sum-exp in fp32.
        let per_layer = 2 * 2 * tk * d * 4
            + (2 * tk * d + 4 * tk * h * e + 4 * tk * f) * 2
            + (2 * tk + tk * h) * 4;
        assert_eq!(row(&est, "saved activations"), 6 * per_layer);
        let block = ModelArgs::flavor("debugmodel")
            .unwrap()
            .parameters()
            .iter()
            .filter(|p| p.module == Module::Layer(0))
            .map(|p| p.shape.iter().product::<i64>() as u64)
            .sum::<u64>();
        assert_eq!(row(&est, "all-gathered blocks"), 2 * block * 2);
        assert_eq!(row(&est, "reduce-scatter inputs"), 0);
        // Under PP a stage's copies serve the step's microbatches: one of each block.
        let pp_cpu = [&cpu[..], &["--parallelism.pipeline_parallel_degree", "2"]].concat();
        let pp = estimate(&b2_s64(&pp_cpu), 2).unwrap();
        assert_eq!(row(&pp, "all-gathered blocks"), 3 * block * 2);
        assert_eq!(row(&pp, "reduce-scatter inputs"), 0);
    }

    /// A mixture of experts holds every expert (total, not active, parameters): each grouped
    /// weight (E, F, D) is E rows of F x D for FSDP's dim-0 chunks.
    #[test]
    fn moe_parameters_are_counted_whole() {
        let cfg = registry("qwen3_moe_debug", &[]);
        let est = estimate(&cfg, 2).unwrap();
        assert_eq!(est.num_params, 315_758_848);
        assert_eq!(est.params_per_rank, 315_758_848 / 2);
        assert_eq!(est.rows[0].bytes, 315_758_848 / 2 * 4);
    }

    /// Under expert parallelism a rank stores the same share of the parameters (its 4 of 8
    /// experts whole instead of half of every expert's rows) but gathers only its own experts:
    /// a block's gathered copy loses half the experts' elements.
    #[test]
    fn expert_parallel_gathers_only_its_experts() {
        let row =
            |est: &Estimate, what: &str| est.rows.iter().find(|r| r.what == what).unwrap().bytes;
        let fp32 = ["--training.mixed_precision_param", "float32"];
        let fsdp = estimate(&registry("qwen3_moe_debug", &fp32), 2).unwrap();
        let ep = estimate(
            &registry(
                "qwen3_moe_debug",
                &[&fp32[..], &["--parallelism.expert_parallel_degree", "2"]].concat(),
            ),
            2,
        )
        .unwrap();
        assert_eq!(ep.rows[0].bytes, fsdp.rows[0].bytes, "parameter shards");
        let args = ModelArgs::of("qwen3", "debugmodel_moe").unwrap();
        let moe = args.moe.as_ref().unwrap();
        // w1, w2, w3: E x F x D each, half of them not gathered, x 2 blocks (computing +
        // prefetched) x 4 B.
        let experts = 3 * moe.num_experts * moe.hidden_dim * args.dim;
        assert_eq!(
            row(&fsdp, "all-gathered blocks") - row(&ep, "all-gathered blocks"),
            (experts / 2 * 2 * 4) as u64
        );
    }

    #[test]
    fn llama3_8b_on_8_fsdp_ranks_fits_80_gb() {
        let cfg = registry("llama3_8b", &[]);
        let est = estimate(&cfg, 8).unwrap();
        assert_eq!((est.layout.dp_shard, est.layout.fsdp()), (8, 8));
        let p = 8_030_261_248u64;
        // Padded shards: every dim-0 of the 8B model divides by 8, so exactly P / 8.
        assert_eq!(est.params_per_rank, p / 8);
        let shards = est.rows[0].bytes;
        assert_eq!(shards, p / 8 * 4);
        assert_eq!(est.optimizer_bytes(), 2 * shards);
        assert!(est.peak_bytes() < 80 * (1u64 << 30), "{}", est.table());
        assert!(est.peak_bytes() < 80_000_000_000, "{}", est.table());
        assert_eq!(
            est.terms_bytes(),
            est.params_bytes()
                + est.grads_bytes()
                + est.optimizer_bytes()
                + est.activations_bytes()
        );
        // Not every item at its largest at once: the peak is a phase, below their sum.
        assert!(est.peak_bytes() < est.terms_bytes(), "{}", est.table());
    }

    #[test]
    fn padding_follows_fsdp2_chunks() {
        // debugmodel on 3 FSDP ranks: dim 256 rows split ceil(256/3) = 86, padded to 258.
        let cfg = config(&[
            "--training.mixed_precision_param",
            "float32",
            "--memory_estimation.enable",
        ]);
        let est = estimate(&cfg, 3).unwrap();
        let (d, f, v, kv) = (256u64, 768u64, 2048u64, 256u64);
        let s = |rows: u64, cols: u64| rows.div_ceil(3) * cols;
        let block = s(d, d) + 2 * s(kv, d) + s(d, d) + 2 * s(f, d) + s(d, f) + 2 * s(d, 1);
        let want = 6 * block + s(v, d) + s(d, 1) + s(v, d);
        assert_eq!(est.params_per_rank, want);
        assert!(want * 3 > ModelArgs::flavor("debugmodel").unwrap().num_params().0 as u64);
    }

    #[test]
    fn tensor_parallel_divides_weights_and_activations() {
        let fsdp8 = estimate(&registry("llama3_8b", &[]), 8).unwrap();
        let tp2 = estimate(
            &registry("llama3_8b", &["--parallelism.tensor_parallel_degree", "2"]),
            8,
        )
        .unwrap();
        assert_eq!((tp2.layout.dp_shard, tp2.layout.tp), (4, 2));
        // Sharded over dp_shard x tp = 8 either way, except the 65 norm vectors, which TP
        // replicates: those are split 4 ways, not 8.
        assert_eq!(
            tp2.params_per_rank,
            fsdp8.params_per_rank + 65 * (4096 / 4 - 4096 / 8)
        );
        assert!(tp2.activations_bytes() < fsdp8.activations_bytes());
        // 70B on 64 ranks, its registry layout TP 8 x FSDP 8.
        let est = estimate(&registry("llama3_70b", &[]), 64).unwrap();
        assert_eq!((est.layout.dp_shard, est.layout.tp), (8, 8));
        assert!(est.peak_bytes() < 80 * (1u64 << 30), "{}", est.table());
        // tp must divide the heads.
        let err = estimate(
            &registry("llama3_8b", &["--parallelism.tensor_parallel_degree", "3"]),
            6,
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("tensor_parallel_degree"),
            "{err:#}"
        );
    }

    #[test]
    fn pipeline_stages_sum_their_gradients_unsharded_until_the_step_ends() {
        // debugmodel (6 layers) on PP2 x FSDP2: each stage's units sum their gradients in
        // fp32, in full, and reduce-scatter them once after the last backward.
        let cfg = config(&[
            "--training.mixed_precision_param",
            "float32",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--memory_estimation.enable",
        ]);
        let est = estimate(&cfg, 4).unwrap();
        let args = ModelArgs::flavor("debugmodel").unwrap();
        let u = |v: i64| v as u64;
        let (d, v) = (u(args.dim), u(args.vocab_size));
        let block: u64 = args
            .parameters()
            .iter()
            .filter(|p| p.module == Module::Layer(0))
            .map(|p| p.shape.iter().product::<i64>() as u64)
            .sum();
        // The larger stage: 3 blocks and the embeddings (v x d) or norm + output (d + v x d).
        let stage = 3 * block + d + v * d;
        let row = |what: &str| est.rows.iter().find(|r| r.what == what).unwrap().bytes;
        assert_eq!(row("reduce-scatter inputs"), 4 * stage, "{}", est.table());
        let reductions: Vec<&Phase> = est
            .phases
            .iter()
            .filter(|p| p.what == "the step's gradient reduction")
            .collect();
        assert_eq!(reductions.len(), 2, "one a stage:\n{}", est.table());
        // Without pipeline parallelism: two reductions in flight, no sums.
        let cfg = config(&[
            "--training.mixed_precision_param",
            "float32",
            "--memory_estimation.enable",
        ]);
        let flat = estimate(&cfg, 2).unwrap();
        let row = |what: &str| flat.rows.iter().find(|r| r.what == what).unwrap().bytes;
        assert_eq!(row("reduce-scatter inputs"), 2 * 4 * block.max(d + v * d));
        assert!(
            flat.phases
                .iter()
                .all(|p| p.what != "the step's gradient reduction")
        );
    }

    #[test]
    fn checkpointing_orders_activations() {
        let act = |mode: &[&str]| {
            estimate(&registry("llama3_8b", mode), 8)
                .unwrap()
                .activations_bytes()
        };
        let none = act(&["activation_checkpoint:none"]);
        let op = act(&["activation_checkpoint:selective"]);
        let full = act(&["activation_checkpoint:full"]);
        let every2 = act(&[
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
        ]);
        assert!(full < op && op < none && full < every2 && every2 < none);
    }

    #[test]
    fn config_files_take_either_spelling() {
        for key in ["enable", "enabled"] {
            let toml = format!("[memory_estimation]\n{key} = true\njson = true\n");
            let cfg =
                JobConfig::from_parts(Some((&toml, std::path::Path::new("m.toml"))), &[]).unwrap();
            assert!(
                cfg.memory_estimation.enable && cfg.memory_estimation.json,
                "{key}"
            );
        }
        let toml = "[memory_estimation]\nenable = true\ndisable_fake_mode = true\n";
        let err =
            JobConfig::from_parts(Some((toml, std::path::Path::new("m.toml"))), &[]).unwrap_err();
        assert!(err.to_string().contains("disable_fake_mode"), "{err}");
    }

    #[test]
    fn a_bad_layout_is_refused_with_torchtitans_rule() {
        let cfg = registry(
            "llama3_8b",
            &["--parallelism.data_parallel_shard_degree", "3"],
        );
        let err = estimate(&cfg, 8).unwrap_err();
        assert!(format!("{err}").contains("WORLD_SIZE(8)"), "{err}");
    }
}
