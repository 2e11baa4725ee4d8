//! The decoder of torchtitan's llama3, qwen3 and deepseek_v3 families with torchtitan's
//! parameter names: GQA or DeepSeek-V3's multi-head latent attention ([`mla`]), RMSNorm, SwiGLU
//! or a mixture of experts ([`moe`]), RoPE (complex with Llama-3.1 or YaRN scaling, or qwen3's
//! cos/sin with q/k norms and tied embeddings), causal SDPA, initialised as torchtitan does.
//!
//! Parameters live in one fqn-keyed list ([`Llama::named_parameters`]) in torchtitan's
//! registration order, so checkpointing and the optimizer address them by name; the per-layer
//! structs hold shallow clones (same storage, same autograd leaf) for the forward pass.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Result, bail};
use tch::{Device, Kind, Tensor};

use crate::config::{ActivationCheckpointing, AttnBackend};
use crate::float8::{Float8Linear, Float8Training, Float8Weight};
use crate::parallelize::fsdp::{Float8Gather, FsdpUnit, Gathered};
use crate::parallelize::pipeline::StageModules;
use crate::parallelize::plan::tp_style;
use crate::parallelize::tp::TensorParallel;
use crate::parallelize::weight_grad::{WeightGradStash, deferred_linear};
use crate::parallelize::{ParallelPlan, Placement};
use crate::recompute::{checkpoint, kept_linear};

mod args;
mod mla;
pub mod moe;
pub use args::{
    BLOCK_PARAMS, Family, Init, MlaArgs, ModelArgs, Module, MoeArgs, ParamSpec, RopeScaling,
    RopeStyle, ScoreFunc,
};
use moe::{MoeBuffers, MoeWeights};

/// RoPE inverse frequencies with Llama-3.1 scaling, as torchtitan's `precompute_freqs_cis`.
fn rope_frequencies(args: &ModelArgs) -> Vec<f64> {
    let dim = args.head_dim();
    let mut freqs: Vec<f64> = (0..dim / 2)
        .map(|i| {
            // torchtitan computes these in float32: keep that rounding.
            let exponent = (2 * i) as f32 / dim as f32;
            (1.0f32 / (args.rope_theta as f32).powf(exponent)) as f64
        })
        .collect();
    if let Some(s) = args.rope_scaling {
        let low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
        let high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
        for f in &mut freqs {
            let wavelen = 2.0 * std::f64::consts::PI / *f;
            if wavelen < high_freq_wavelen {
                continue;
            }
            if wavelen > low_freq_wavelen {
                *f /= s.factor;
            } else {
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
            }
        }
    }
    freqs
}

/// The RoPE table for positions `0..max_seq_len`, one row per position: the complex rotations
/// `exp(i * t * freq)` (S, head_dim/2) for [`RopeStyle::Complex`], or `[cos | sin]` of the
/// angles repeated over both halves (S, 2 * head_dim) for [`RopeStyle::CosSin`].
pub fn precompute_freqs_cis(args: &ModelArgs, device: Device) -> Tensor {
    if let Some(m) = &args.mla {
        return mla::yarn_table(args, m, device);
    }
    if args.rope_style() == RopeStyle::CosSin {
        return cos_sin_table(args).to_device(device);
    }
    let freqs = Tensor::from_slice(&rope_frequencies(args)).to_kind(Kind::Float);
    let t = Tensor::arange(args.max_seq_len, (Kind::Float, Device::Cpu));
    let angles = t.outer(&freqs);
    Tensor::polar(&angles.ones_like(), &angles).to_device(device)
}

/// RoPE's inverse frequencies `1 / theta^(2i/dim)` (dim/2 of them) on the CPU as torchtitan's
/// `CosSinRoPE` and YaRN compute them: with torch's float32 tensor operations.
fn inverse_frequencies(dim: i64, theta: f64) -> Tensor {
    let exponents = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, Device::Cpu))
        .narrow(0, 0, dim / 2)
        .to_kind(Kind::Float)
        / dim as f64;
    Tensor::pow_scalar(theta, &exponents).reciprocal()
}

/// torchtitan's `CosSinRoPE` cache, built with the same tensor operations in float32 (so the
/// same rounding): `inv_freq = 1 / theta^(2i/d)`, angles `t * inv_freq` for both halves.
fn cos_sin_table(args: &ModelArgs) -> Tensor {
    let inv_freq = inverse_frequencies(args.head_dim(), args.rope_theta);
    let t = Tensor::arange(args.max_seq_len, (Kind::Float, Device::Cpu));
    let freqs = t.outer(&inv_freq);
    let angles = Tensor::cat(&[&freqs, &freqs], -1);
    Tensor::cat(&[angles.cos(), angles.sin()], -1)
}

/// The rotations for each token, shape (B or 1, S, 1, head_dim/2): the table's rows for the
/// tokens' `positions` (B, S) in their documents, or rows `0..S` without positions.
fn rope_for(freqs_cis: &Tensor, seq_len: i64, positions: Option<&Tensor>) -> Tensor {
    let half = freqs_cis.size()[1];
    match positions {
        Some(p) => {
            let b = p.size()[0];
            freqs_cis
                .index_select(0, &p.reshape([-1]))
                .reshape([b, seq_len, 1, half])
        }
        None => freqs_cis
            .narrow(0, 0, seq_len)
            .reshape([1, seq_len, 1, half]),
    }
}

/// Rotates `x` (B, S, H, head_dim) by `rope` (from [`rope_for`]) in `style`.
fn apply_rotary_emb(x: &Tensor, rope: &Tensor, style: RopeStyle) -> Tensor {
    let (b, s, h, d) = x.size4().expect("attention input is (B, S, H, D)");
    if style == RopeStyle::CosSin {
        // x * cos + rotate_half(x) * sin in float32, rotate_half(x) = [-x2, x1].
        let (cos, sin) = (rope.narrow(3, 0, d), rope.narrow(3, d, d));
        let xf = x.to_kind(Kind::Float);
        let (x1, x2) = (xf.narrow(3, 0, d / 2), xf.narrow(3, d / 2, d / 2));
        let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
        return (&xf * cos + rotated * sin).to_kind(x.kind());
    }
    let xc = x
        .to_kind(Kind::Float)
        .reshape([b, s, h, d / 2, 2])
        .view_as_complex();
    (xc * rope)
        .view_as_real()
        .reshape([b, s, h, d])
        .to_kind(x.kind())
}

/// The attention mask of one forward pass: (B, 1, S, S) booleans, true where query `q` may
/// attend to key `k` (`k <= q` and both in the same document), or `None` for plain causal.
/// Documents start where `positions` is 0 (torchtitan's `get_document_mask_mod`).
pub fn document_causal_mask(positions: &Tensor) -> Tensor {
    let (b, s) = positions.size2().expect("positions are (B, S)");
    let doc = positions.eq(0).cumsum(1, Kind::Int64);
    let same_doc = doc.unsqueeze(2).eq_tensor(&doc.unsqueeze(1));
    let causal = Tensor::ones([s, s], (Kind::Bool, positions.device())).tril(0);
    (same_doc.logical_and(&causal)).view([b, 1, s, s])
}

/// Where each document starts in the packed (B * S) tokens, then B * S (int32, the layout
/// FlashAttention's varlen kernel takes), and the longest document's length.
pub fn document_offsets(positions: &Tensor) -> (Tensor, i64) {
    let flat = positions.reshape([-1]);
    let total = flat.size()[0];
    let starts = flat.eq(0).nonzero().reshape([-1]);
    let end = Tensor::from_slice(&[total]).to_device(positions.device());
    let offsets = Tensor::cat(&[starts, end], 0);
    // A host read (counted) for the kernel's launch bounds: the loop passes the loader's
    // host-counted offsets instead ([`Llama::forward_stage`]); this is the fallback.
    let longest = crate::host_sync::read_i64(
        &offsets.diff(1, 0, None::<Tensor>, None::<Tensor>).max(),
        "longest document",
    );
    (offsets.to_kind(Kind::Int), longest)
}

unsafe extern "C" {
    fn titan_varlen_attention(
        q: *mut std::ffi::c_void,
        k: *mut std::ffi::c_void,
        v: *mut std::ffi::c_void,
        cu_seqlens: *mut std::ffi::c_void,
        max_len: i64,
        scale: f64,
        out: *mut *mut std::ffi::c_void,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
}

/// Document-causal attention with FlashAttention's varlen kernel: q (T, H, D), k/v (T, H_kv, D)
/// packed tokens, `offsets`/`longest` from [`document_offsets`]. CUDA and bf16/fp16 only;
/// differentiable (libtorch's autograd runs its backward kernel).
pub fn varlen_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    offsets: &Tensor,
    longest: i64,
) -> Result<Tensor> {
    let raw = |t: &Tensor| t.as_ptr().cast_mut().cast();
    let scale = 1.0 / (q.size()[2] as f64).sqrt();
    let mut out = std::ptr::null_mut();
    // SAFETY: live tch tensors (`at::Tensor*`) borrowed for the call; on success `out` is a new
    // at::Tensor* that we own.
    crate::shim::call(|err| unsafe {
        titan_varlen_attention(
            raw(q),
            raw(k),
            raw(v),
            raw(offsets),
            longest,
            scale,
            &mut out,
            err,
        )
    })
    .map_err(|m| anyhow::anyhow!("varlen attention: {m}"))?;
    // SAFETY: see above.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

/// What every block of one forward pass shares: the rotations for its tokens and how its tokens
/// attend, both built once per forward pass.
struct ForwardContext {
    rope: Tensor,
    attend: Attend,
}

/// How tokens attend in one forward pass.
enum Attend {
    /// Plain causal attention.
    Causal,
    /// SDPA with the document-causal mask (B, 1, S, S).
    Masked(Tensor),
    /// FlashAttention's varlen kernel over the packed documents: offsets and longest document.
    Varlen(Tensor, i64),
}

impl ForwardContext {
    fn share(&self) -> ForwardContext {
        ForwardContext {
            rope: self.rope.shallow_clone(),
            attend: match &self.attend {
                Attend::Causal => Attend::Causal,
                Attend::Masked(m) => Attend::Masked(m.shallow_clone()),
                Attend::Varlen(o, l) => Attend::Varlen(o.shallow_clone(), *l),
            },
        }
    }
}

/// A linear's weight as its FSDP unit gathered it: the values (a placeholder of its shape when
/// gathered in float8), and the float8 values when it was.
struct Weight {
    value: Tensor,
    float8: Option<Float8Weight>,
}

struct Layer {
    attention: Attention,
    ffn: FeedForward,
    attention_norm: Tensor,
    ffn_norm: Tensor,
}

/// A block's attention: grouped-query (llama3, qwen3), or latent (deepseek_v3).
enum Attention {
    Gqa(GqaWeights),
    Mla(mla::MlaWeights),
}

struct GqaWeights {
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    /// qwen3's RMSNorm weights over each head's q and k.
    qk_norm: Option<(Tensor, Tensor)>,
}

/// A block's feed-forward: a SwiGLU, or a mixture of experts.
enum FeedForward {
    Dense { w1: Weight, w2: Weight, w3: Weight },
    Moe(MoeWeights),
}

impl Layer {
    /// A block's parameters in registration order (as its FSDP unit gathers them), with the
    /// q/k norms after `wo` when `qk_norm`, and a mixture of experts' four parameters (seven
    /// with shared experts) in place of w1, w2, w3 when `moe`. A latent attention's block
    /// ([`mla::MlaWeights::take`]) has its two norms before its feed-forward.
    fn from_params(g: Gathered, shape: &BlockShape, moe: Option<&MoeArgs>) -> Layer {
        let mut weights = g
            .params
            .into_iter()
            .zip(g.float8)
            .map(|(value, float8)| Weight { value, float8 });
        let mut next = || {
            weights
                .next()
                .expect("a transformer block has its parameters")
        };
        let (attention, norms) = match &shape.mla {
            Some(m) => {
                let attention = Attention::Mla(mla::MlaWeights::take(m, &mut next));
                (attention, Some((next().value, next().value)))
            }
            None => {
                let (wq, wk, wv, wo) = (next(), next(), next(), next());
                let qk_norm = shape.qk_norm.then(|| (next().value, next().value));
                let gqa = GqaWeights {
                    wq,
                    wk,
                    wv,
                    wo,
                    qk_norm,
                };
                (Attention::Gqa(gqa), None)
            }
        };
        let ffn = match moe {
            Some(args) => {
                let (w1, w2, w3, gate) = (next().value, next().value, next().value, next().value);
                let shared = (args.num_shared_experts > 0)
                    .then(|| [next().value, next().value, next().value]);
                FeedForward::Moe(MoeWeights {
                    w1,
                    w2,
                    w3,
                    gate,
                    shared,
                })
            }
            None => {
                let (w1, w2, w3) = (next(), next(), next());
                FeedForward::Dense { w1, w2, w3 }
            }
        };
        let (attention_norm, ffn_norm) = norms.unwrap_or_else(|| (next().value, next().value));
        Layer {
            attention,
            ffn,
            attention_norm,
            ffn_norm,
        }
    }
}

/// The sizes a transformer block needs, copied into recomputed regions.
#[derive(Debug, Clone, Copy)]
struct BlockShape {
    dim: i64,
    n_heads: i64,
    kv_heads: i64,
    head_dim: i64,
    norm_eps: f64,
    rope: RopeStyle,
    /// The attention scale torchtitan passes when head_dim is given outright (`head_dim^-0.5`),
    /// else SDPA's default.
    scale: Option<f64>,
    /// The block has q/k norms.
    qk_norm: bool,
    /// How the model's mixtures of experts route (the blocks that have one).
    moe: Option<MoeArgs>,
    /// The model's latent attention (deepseek_v3).
    mla: Option<MlaArgs>,
}

impl BlockShape {
    /// The shape of this rank's part of a block: `tp` splits the heads.
    fn of(args: &ModelArgs, tp: i64) -> Self {
        BlockShape {
            dim: args.dim,
            n_heads: args.n_heads / tp,
            kv_heads: args.kv_heads() / tp,
            head_dim: args.head_dim(),
            norm_eps: args.norm_eps,
            rope: args.rope_style(),
            scale: args.explicit_head_dim.map(|hd| (hd as f64).powf(-0.5)),
            qk_norm: args.qk_norm,
            moe: args.moe,
            mla: args.mla,
        }
    }
}

/// The model: this rank's parameters by fqn (the whole tensors on one process, else the parts
/// [`ParallelPlan`] gives it), the FSDP units that gather them, and the RoPE table.
pub struct Llama {
    pub args: ModelArgs,
    params: Vec<(String, Tensor)>,
    placements: Vec<Placement>,
    /// The pipeline stages this rank holds, by stage index (one stage, the whole model,
    /// without pipeline parallelism).
    stages: Vec<(usize, StageModules)>,
    embeddings: Option<FsdpUnit>,
    /// This rank's transformer blocks by global layer index, ascending.
    layers: Vec<(usize, FsdpUnit)>,
    /// The final norm and the output projection.
    head: Option<FsdpUnit>,
    /// The dtype parameters are gathered and computed in (FSDP's `mixed_precision_param`), and
    /// so the dtype of the hidden states.
    compute_kind: Kind,
    tp: TensorParallel,
    freqs_cis: Tensor,
    checkpointing: ActivationCheckpointing,
    attn_backend: AttnBackend,
    /// Document-causal attention runs FlashAttention's varlen kernel: CUDA, bf16/fp16
    /// activations, and the kernel answered a probe.
    varlen_kernel: bool,
    /// The linears that multiply in float8 (`[float8]`); `None`: none.
    float8: Option<Arc<ModelFloat8>>,
    /// This rank's mixtures of experts' buffers by global layer index, ascending.
    moe: Vec<(usize, MoeBuffers)>,
    /// Training forward passes count the tokens each expert gets (torchtitan's
    /// `module.training`; validation turns it off).
    training: AtomicBool,
}

/// Which linears of the model multiply in float8.
struct ModelFloat8 {
    blocks: Vec<BlockFloat8>,
    lm_head: Option<Float8Linear>,
    /// lm_head multiplies the sequence in this many chunks (each with its own scales).
    lm_head_chunks: i64,
}

/// The float8 linears of one transformer block (`None`: high precision).
#[derive(Clone, Default)]
struct BlockFloat8 {
    qkv: Qkv,
    wo: Option<Float8Linear>,
    w1: Option<Float8Linear>,
    w2: Option<Float8Linear>,
    w3: Option<Float8Linear>,
}

/// How q, k and v are projected.
#[derive(Clone)]
enum Qkv {
    /// One float8 linear over the three weights fused as torchtitan 0.3.0's `wqkv` (rows grouped
    /// per kv head): one scale (tensorwise) or one per token (rowwise) spans q, k and v, as there.
    Fused(Float8Linear),
    /// Each by itself (float8 or not): when a filter names some of them, as the torchtitan
    /// generation with separate wq/wk/wv linears does.
    Separate(Box<[Option<Float8Linear>; 3]>),
}

impl Default for Qkv {
    fn default() -> Self {
        Qkv::Separate(Box::new([None, None, None]))
    }
}

/// Whether FlashAttention's varlen kernel runs on `device`: a two-document probe, once.
fn probe_varlen_kernel(device: Device) -> bool {
    if !device.is_cuda() {
        return false;
    }
    let q = Tensor::zeros([4, 1, 64], (Kind::BFloat16, device));
    let offsets = Tensor::from_slice(&[0i32, 2, 4]).to_device(device);
    match varlen_attention(&q, &q, &q, &offsets, 2) {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!("document-causal attention uses SDPA with a mask: {e:#}");
            false
        }
    }
}

/// Draws `t`'s values by `init` from the global torch RNG.
fn initialise(t: &mut Tensor, init: Init) {
    match init {
        Init::Normal { std } => {
            let _ = t.normal_(0.0, std);
        }
        Init::TruncNormal { std, a, b } => trunc_normal_(t, std, a, b),
        Init::Ones => {
            let _ = t.fill_(1.0);
        }
    }
}

/// Fills `t` with a normal(0, std) truncated to [a, b] as torch 2.13 and 2.15's
/// `nn.init.trunc_normal_` draws it, RNG call for RNG call: when most of the normal lies inside
/// the bounds (probability > 0.3), a normal draw with every value outside them drawn again (a
/// whole tensor's draw per round, kept where needed); otherwise uniform candidates on [a, b]
/// accepted with the normal's density. (The inverse-CDF method older torch used puts values on
/// the bounds when a float32 uniform hits its endpoint: `tests/tests/trainer_seed_init.rs` saw
/// weights of exactly -2 against torchtitan's.)
pub fn trunc_normal_(t: &mut Tensor, std: f64, a: f64, b: f64) {
    let norm_cdf = |x: f64| (1.0 + erf(x / std::f64::consts::SQRT_2)) / 2.0;
    let p = norm_cdf(b / std) - norm_cdf(a / std);
    let any = |mask: &Tensor| mask.any().int64_value(&[]) != 0;
    if p > 0.3 {
        // torch compares against the bounds rounded to the tensor's dtype.
        let (lo, hi) = (
            Tensor::from(a).to_kind(t.kind()).double_value(&[]),
            Tensor::from(b).to_kind(t.kind()).double_value(&[]),
        );
        let _ = t.normal_(0.0, std);
        let mut result = t.shallow_clone();
        let mut redrawn = false;
        loop {
            let mask = result.lt(lo).logical_or(&result.gt(hi));
            if !any(&mask) {
                break;
            }
            let mut redraw = result.empty_like();
            let _ = redraw.normal_(0.0, std);
            result = redraw.where_self(&mask, &result);
            redrawn = true;
        }
        if redrawn {
            t.copy_(&result);
        }
        return;
    }
    let mode = a.max(0.0f64.min(b));
    let log_peak = -0.5 * (mode / std).powi(2);
    let log_pdf = |c: &mut Tensor| {
        let _ = c
            .g_sub_scalar_(0.0)
            .g_div_scalar_(std)
            .pow_(2)
            .g_mul_scalar_(-0.5);
        let _ = c.g_sub_scalar_(log_peak);
    };
    let mut candidates = t.empty_like();
    let mut accept = t.empty_like();
    let _ = t.uniform_(a, b);
    candidates.copy_(t);
    log_pdf(&mut candidates);
    let mut pending = accept.uniform_(0.0, 1.0).log_().gt_tensor(&candidates);
    if !any(&pending) {
        return;
    }
    let mut result = t.shallow_clone();
    loop {
        let _ = candidates.uniform_(a, b);
        result = candidates.where_self(&pending, &result);
        log_pdf(&mut candidates);
        let again = accept.uniform_(0.0, 1.0).log_().gt_tensor(&candidates);
        pending = again.where_self(&pending, &pending);
        if !any(&pending) {
            break;
        }
    }
    t.copy_(&result);
}

/// The error function, for the CDF bounds of [`trunc_normal_`] (Rust's std has no erf).
fn erf(x: f64) -> f64 {
    1.0 - erfc(x)
}

fn erfc(x: f64) -> f64 {
    // Numerical Recipes' erfc with fractional error < 1.2e-7 everywhere: ample for the
    // truncation bounds of an initializer.
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.26551223
            + t * (1.00002368
                + t * (0.37409196
                    + t * (0.09678418
                        + t * (-0.18628806
                            + t * (0.27886807
                                + t * (-1.13520398
                                    + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
            .exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

impl Llama {
    /// Builds this rank's part of the model on `device` with torchtitan's initialisation (uses
    /// the global torch RNG: seed it first for reproducible weights). Each parameter is drawn
    /// whole, in registration order, and only this rank's part is kept: every layout gets the
    /// values one process gets, and no rank ever holds more than one whole parameter.
    pub fn new(args: ModelArgs, device: Device, plan: &ParallelPlan) -> Result<Self> {
        let whole = StageModules::whole(args.n_layers as usize);
        Self::new_stages(args, device, plan, vec![(0, whole)])
    }

    /// Builds the pipeline stages `stages` (index, modules) of the model, as [`Llama::new`]
    /// builds the whole: every parameter is drawn in registration order, so each stage gets the
    /// values one process gets, and the parameters of other stages are dropped.
    pub fn new_stages(
        args: ModelArgs,
        device: Device,
        plan: &ParallelPlan,
        stages: Vec<(usize, StageModules)>,
    ) -> Result<Self> {
        args.validate()?;
        let has_embeddings = stages.iter().any(|(_, s)| s.embeddings);
        let has_head = stages.iter().any(|(_, s)| s.head);
        let has_layer = |i: usize| stages.iter().any(|(_, s)| s.layers.contains(&i));
        let tp = plan.tp.size() as i64;
        for (what, n) in [("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads())] {
            if n % tp != 0 {
                bail!(
                    "model {what} = {n} cannot be split over parallelism.tensor_parallel_degree = {tp}"
                );
            }
        }
        let opts = (Kind::Float, device);
        let mut params: Vec<(String, Tensor)> = Vec::new();
        let mut placements = Vec::new();
        for spec in args.parameters() {
            let keep = match spec.module {
                Module::Embeddings => has_embeddings,
                Module::Layer(i) => has_layer(i),
                Module::Head => has_head,
            };
            let placement = plan
                .placement_of(&spec.fqn, &spec.shape)
                .map_err(|e| anyhow::anyhow!("{}: {e}", spec.fqn))?;
            let mut full = Tensor::empty(spec.shape.as_slice(), opts);
            tch::no_grad(|| initialise(&mut full, spec.init));
            if !keep {
                // Another stage's parameter: drawn only to advance the RNG as one process does.
                continue;
            }
            let local = if placement.is_whole() {
                full
            } else {
                placement.take_local(&full)
            };
            params.push((spec.fqn, local.set_requires_grad(true)));
            placements.push(placement);
        }
        // FSDP units as torchtitan wraps them: the embeddings, each block, norm + output. A
        // tied embedding is also the output layer: its unit stays gathered until the head has
        // run (torchtitan's tied unit reshards only under `reshard_after_forward = always`).
        let unit = |range: std::ops::Range<usize>, last: bool| {
            FsdpUnit::new(
                &plan.fsdp,
                params[range.clone()]
                    .iter()
                    .map(|(_, t)| t.shallow_clone())
                    .collect(),
                &placements[range].iter().collect::<Vec<_>>(),
                plan.reshards(last),
            )
        };
        let n = params.len();
        let first = usize::from(has_embeddings);
        let tied = args.tie_embeddings;
        if tied && has_embeddings != has_head {
            bail!("tied embeddings need the embeddings and the output layer on one pipeline stage");
        }
        let embeddings = has_embeddings.then(|| unit(0..1, tied));
        let mut start = first;
        let layers = (0..args.n_layers as usize)
            .filter(|&i| has_layer(i))
            .map(|i| {
                let range = start..start + args.layer_params(i);
                start = range.end;
                (i, unit(range, false))
            })
            .collect();
        let moe = (0..args.n_layers as usize)
            .filter(|&i| has_layer(i))
            .filter_map(|i| Some((i, MoeBuffers::new(args.moe_layer(i)?, device))))
            .collect();
        let head_params = if tied { 1 } else { 2 };
        let head = has_head.then(|| unit(n - head_params..n, true));
        let freqs_cis = precompute_freqs_cis(&args, device);
        Ok(Self {
            args,
            params,
            placements,
            stages,
            embeddings,
            layers,
            head,
            compute_kind: plan.fsdp.param_kind,
            tp: plan.tp.clone(),
            freqs_cis,
            checkpointing: ActivationCheckpointing::None,
            attn_backend: AttnBackend::default(),
            varlen_kernel: false,
            float8: None,
            moe,
            training: AtomicBool::new(true),
        })
    }

    /// Parameters by torchtitan fqn, in registration order.
    pub fn named_parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// The parameter named `fqn`.
    pub fn parameter(&self, fqn: &str) -> Option<&Tensor> {
        self.params.iter().find(|(n, _)| n == fqn).map(|(_, t)| t)
    }

    pub fn device(&self) -> Device {
        self.params[0].1.device()
    }

    /// Where each parameter's local part sits (same order as [`Llama::named_parameters`]).
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// The placement of parameter `fqn`.
    pub fn placement(&self, fqn: &str) -> Option<&Placement> {
        let i = self.params.iter().position(|(n, _)| n == fqn)?;
        Some(&self.placements[i])
    }

    /// Sets parameter `fqn` from the whole tensor `value` (its global shape): this rank keeps
    /// its part. The load path for checkpoints of any layout.
    pub fn set_parameter(&self, fqn: &str, value: &Tensor) -> Result<()> {
        let (Some(p), Some(placement)) = (self.parameter(fqn), self.placement(fqn)) else {
            bail!("the model has no parameter `{fqn}`");
        };
        if value.size() != placement.global {
            bail!(
                "parameter `{fqn}` has shape {:?} but the loaded tensor has {:?}",
                placement.global,
                value.size()
            );
        }
        tch::no_grad(|| {
            let mut p = p.shallow_clone();
            p.copy_(&placement.take_local(value));
        });
        Ok(())
    }

    /// The summed cross entropy of `logits` from [`Llama::forward`] against `labels` over valid
    /// labels (over vocab-sharded logits under tensor parallelism).
    pub fn summed_cross_entropy(&self, logits: &Tensor, labels: &Tensor) -> Tensor {
        self.tp.cross_entropy_sum(logits, labels)
    }

    /// The whole parameters whose names `keep` accepts, in their own dtype, gathered one FSDP
    /// unit at a time. A collective: every rank calls it with the same model.
    pub fn full_parameters(&self, keep: impl Fn(&str) -> bool) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        let mut index = 0;
        for unit in self.units() {
            for full in unit.full_masters() {
                let (name, _) = &self.params[index];
                let full = match self.placements[index].tp_dim {
                    Some(dim) => self.tp.gather_dim(&full, dim),
                    None => full,
                };
                if keep(name) {
                    out.push((name.clone(), full));
                }
                index += 1;
            }
        }
        out
    }

    /// This rank's gradients as torchtitan 0.3.0's parameters hold them, in its order, each with
    /// whether tensor parallelism splits it: a block's q, k and v gradients are its one `wqkv`'s
    /// (fused in that layout when this rank holds whole rows of all three, as without FSDP
    /// sharding; else concatenated). What the gradient norm is taken over: the per-parameter
    /// norms are summed in this order, so one process's norm is torchtitan's bit for bit.
    pub fn grads_as_torchtitan_parameters(&self) -> Vec<(Tensor, bool)> {
        let grad = |i: usize| (self.params[i].1.grad(), self.placements[i].tp_dim.is_some());
        if self.args.mla.is_some() {
            // A latent attention's parameters are torchtitan's as they are.
            return (0..self.params.len()).map(grad).collect();
        }
        // Where each of this rank's blocks starts in the parameter list.
        let mut at = usize::from(self.embeddings.is_some());
        let block_starts: Vec<usize> = self
            .layers
            .iter()
            .map(|(index, _)| {
                at += self.args.layer_params(*index);
                at - self.args.layer_params(*index)
            })
            .collect();
        let kv_heads = self.args.kv_heads() / self.tp.size() as i64;
        let mut out = Vec::with_capacity(self.params.len());
        let mut i = 0;
        while i < self.params.len() {
            if !block_starts.contains(&i) {
                out.push(grad(i));
                i += 1;
                continue;
            }
            let (split, qkv) = (grad(i).1, [i, i + 1, i + 2].map(|j| grad(j).0));
            if qkv.iter().all(|g| g.defined()) {
                let whole = (i..i + 3).all(|j| {
                    let p = &self.placements[j];
                    p.local.first() == Some(&p.tp_local_rows)
                });
                let groups = if whole {
                    Some(kv_heads)
                } else {
                    self.whole_kv_groups([i, i + 1, i + 2])
                };
                let wqkv = match groups {
                    Some(groups) => crate::names::fuse_qkv(&qkv[0], &qkv[1], &qkv[2], groups),
                    None => Tensor::cat(&qkv.each_ref().map(|g| g.reshape([-1])), 0),
                };
                out.push((wqkv, split));
            }
            i += 3;
        }
        out
    }

    /// How many whole kv groups this rank's FSDP shards of a block's q, k and v (parameters
    /// `qkv`) cover, when they cover the same ones: then, fused, they are the rows of
    /// torchtitan's fused `wqkv` that its dim-0 shard on this rank holds (the data-parallel
    /// degree divides the kv heads), in its order — so their norm rounds as torchtitan's
    /// does. `None` under tensor parallelism or when the shards cut through a group.
    fn whole_kv_groups(&self, qkv: [usize; 3]) -> Option<i64> {
        if self.tp.size() > 1 {
            return None;
        }
        let [q, k, v] = qkv.map(|j| &self.placements[j]);
        let (hd, per_kv) = (
            self.args.head_dim(),
            self.args.n_heads / self.args.kv_heads(),
        );
        let (start, rows) = (k.offsets[0], k.local[0]);
        let aligned = rows > 0
            && rows % hd == 0
            && start % hd == 0
            && (v.offsets[0], v.local[0]) == (start, rows)
            && (q.offsets[0], q.local[0]) == (start * per_kv, rows * per_kv);
        aligned.then_some(rows / hd)
    }

    /// Waits for the FSDP gradient reductions the backward passes started and puts their results
    /// in the parameters' gradients: call once after the step's last backward.
    pub fn finish_gradients(&self) {
        for unit in self.units() {
            unit.finish_gradients();
        }
    }

    /// This rank's FSDP units in model order: the embeddings, its blocks, norm + output.
    fn units(&self) -> impl Iterator<Item = &FsdpUnit> {
        self.embeddings
            .iter()
            .chain(self.layers.iter().map(|(_, u)| u))
            .chain(self.head.iter())
    }

    /// The pipeline stages this rank holds (index, modules).
    pub fn stages(&self) -> &[(usize, StageModules)] {
        &self.stages
    }

    /// Whether activations between blocks are sequence-sharded over tp.
    pub fn sequence_parallel(&self) -> bool {
        self.tp.sequence_parallel()
    }

    /// Converts every parameter to `kind` in place (the shallow clones the layers hold see it):
    /// `training.dtype = bfloat16` trains bf16 parameters, gradients and optimizer state, as
    /// torchtitan 0.3.0 does by building the model under that default dtype. The weights are
    /// the fp32 initialisation rounded to `kind`; RoPE and the logits stay fp32.
    pub fn cast_parameters(&self, kind: Kind) {
        tch::no_grad(|| {
            for (_, p) in &self.params {
                let mut p = p.shallow_clone();
                let cast = p.to_kind(kind);
                p.set_data(&cast);
            }
        });
    }

    /// Sets which activations [`Llama::forward`] keeps for backward.
    pub fn with_checkpointing(mut self, policy: ActivationCheckpointing) -> Self {
        self.checkpointing = policy;
        self
    }

    pub fn checkpointing(&self) -> ActivationCheckpointing {
        self.checkpointing
    }

    /// Makes the linears `float8` converts (torchtitan's rule: [`Float8Training::converts`])
    /// multiply in float8; the others, and every parameter, stay as they are. Returns the
    /// converted linears' names too (for the log).
    pub fn with_float8(mut self, float8: Option<&Float8Training>) -> (Self, Vec<String>) {
        let Some(f8) = float8 else {
            self.float8 = None;
            return (self, Vec::new());
        };
        let a = &self.args;
        let (d, hd, kv) = (a.dim, a.ffn_hidden_dim(), a.kv_heads() * a.head_dim());
        let mut converted = Vec::new();
        // Each linear's split over tp is the TP plan's for its weight.
        let mut take = |fqn: String, out: i64, inp: i64| {
            f8.converts(&fqn, out, inp).then(|| {
                let style = tp_style(&format!("{fqn}.weight"))
                    .expect("every linear has an entry in the tensor-parallel plan");
                converted.push(fqn);
                f8.linear(&self.tp, style)
            })
        };
        let blocks: Vec<BlockFloat8> = (0..a.n_layers)
            .map(|i| {
                let p = |n: &str| format!("layers.{i}.{n}");
                let qkv_names = ["wq", "wk", "wv"].map(|n| p(&format!("attention.qkv_linear.{n}")));
                // Fused unless a filter names q, k or v alone (the 16 rule is the fused one's).
                let fused = p("attention.qkv_linear.wqkv");
                let fuse =
                    f8.converts(&fused, d + 2 * kv, d) && !qkv_names.iter().any(|n| f8.filtered(n));
                let fused = if fuse {
                    take(fused, d + 2 * kv, d)
                } else {
                    None
                };
                let qkv = match fused {
                    Some(fused) => Qkv::Fused(fused),
                    None => {
                        let [q, k, v] = qkv_names;
                        Qkv::Separate(Box::new([take(q, d, d), take(k, kv, d), take(v, kv, d)]))
                    }
                };
                BlockFloat8 {
                    qkv,
                    wo: take(p("attention.wo"), d, d),
                    w1: take(p("feed_forward.w1"), hd, d),
                    w2: take(p("feed_forward.w2"), d, hd),
                    w3: take(p("feed_forward.w3"), hd, d),
                }
            })
            .collect();
        let lm_head = take("lm_head".into(), a.vocab_size, d);
        if f8.fsdp_all_gather {
            self.gather_in_float8(&blocks, lm_head.is_some());
        }
        self.float8 = Some(Arc::new(ModelFloat8 {
            blocks,
            lm_head,
            lm_head_chunks: f8.lm_head_chunks,
        }));
        (self, converted)
    }

    /// FSDP's float8 all-gather: each unit gathers the weights of its float8 linears in float8
    /// (q, k and v of a fused `wqkv` with one scale, as the one weight they are there).
    fn gather_in_float8(&mut self, blocks: &[BlockFloat8], lm_head: bool) {
        let tp = self.tp.clone();
        let gather = |scale_of: Vec<Option<usize>>| Float8Gather {
            scale_of,
            tp: tp.clone(),
        };
        for (index, unit) in &mut self.layers {
            let b = &blocks[*index];
            // Scale groups in parameter order: wq, wk, wv, wo, w1, w2, w3, then the two norms.
            let mut next = 0;
            let mut group = |converted: bool| {
                converted.then(|| {
                    next += 1;
                    next - 1
                })
            };
            let [q, k, v] = match &b.qkv {
                Qkv::Fused(_) => {
                    let g = group(true);
                    [g; 3]
                }
                Qkv::Separate(parts) => parts.each_ref().map(|p| group(p.is_some())),
            };
            let scale_of = vec![
                q,
                k,
                v,
                group(b.wo.is_some()),
                group(b.w1.is_some()),
                group(b.w2.is_some()),
                group(b.w3.is_some()),
                None,
                None,
            ];
            unit.gather_in_float8(gather(scale_of));
        }
        if let Some(head) = &mut self.head {
            head.gather_in_float8(gather(vec![None, lm_head.then_some(0)]));
        }
    }

    /// `precompute_float8_dynamic_scale_for_fsdp`: after the optimizer step, the scales the
    /// next step's float8 all-gathers cast with, in one collective. Every rank calls it.
    pub fn precompute_float8_scales(&self) {
        crate::parallelize::fsdp::precompute_float8_scales(&self.units().collect::<Vec<_>>());
    }

    /// Sets which tokens attend to which; `activations` is the dtype attention will compute in
    /// (FlashAttention's varlen kernel takes bf16/fp16 only).
    pub fn with_attn_backend(mut self, backend: AttnBackend, activations: Kind) -> Self {
        self.attn_backend = backend;
        // A latent attention's q/k and v widths differ: it runs SDPA (with the document mask).
        self.varlen_kernel = backend.document_causal()
            && self.args.mla.is_none()
            && matches!(activations, Kind::BFloat16 | Kind::Half)
            && probe_varlen_kernel(self.device());
        self
    }

    pub fn attn_backend(&self) -> AttnBackend {
        self.attn_backend
    }

    /// Logits (B, S, vocab) in fp32 for token ids (B, S) whose `positions` (B, S) in their
    /// documents come from the loader ([`crate::data::Batch`]); `None` treats each row as one
    /// document starting at position 0. Under tensor parallelism the logits are this rank's
    /// vocab columns (B, S, vocab / tp): take the loss with [`Llama::summed_cross_entropy`].
    pub fn forward(&self, tokens: &Tensor, positions: Option<&Tensor>) -> Tensor {
        self.forward_with(tokens, positions, None)
    }

    /// [`Llama::forward`] with the documents as the loader counted them on the host
    /// ([`Llama::forward_stage`]).
    pub fn forward_with(
        &self,
        tokens: &Tensor,
        positions: Option<&Tensor>,
        documents: Option<(&Tensor, i64)>,
    ) -> Tensor {
        let stage = self.stages[0].0;
        assert!(
            self.stages.len() == 1 && self.embeddings.is_some() && self.head.is_some(),
            "forward runs the whole model; under pipeline parallelism use forward_stage"
        );
        self.forward_stage(stage, tokens, positions, documents, None)
    }

    /// Runs pipeline stage `stage` of this rank: from token ids (B, S) on the stage holding
    /// the embeddings, else from the hidden states the previous stage produced
    /// ([`Llama::hidden_shape`]); returns hidden states, or the logits (as
    /// [`Llama::forward`]) on the stage holding the output. With `defer_weight_grads`, the
    /// linears' backward computes only input gradients and parks their weight gradients there
    /// (a zero-bubble schedule runs them later). `documents`: the documents' offsets and
    /// longest length as the loader counted them on the host ([`crate::data::Batch`]): the varlen kernel then needs no read
    /// back from the device ([`document_offsets`] would make one per forward pass).
    pub fn forward_stage(
        &self,
        stage: usize,
        input: &Tensor,
        positions: Option<&Tensor>,
        documents: Option<(&Tensor, i64)>,
        defer_weight_grads: Option<&WeightGradStash>,
    ) -> Tensor {
        let modules = &self
            .stages
            .iter()
            .find(|(s, _)| *s == stage)
            .unwrap_or_else(|| panic!("this rank holds no pipeline stage {stage}"))
            .1;
        let shape = BlockShape::of(&self.args, self.tp.size() as i64);
        let seq_len = match (modules.embeddings, self.tp.sequence_parallel()) {
            // Sequence-parallel hidden states hold this rank's block of the sequence.
            (false, true) => input.size()[1] * self.tp.size() as i64,
            _ => input.size()[1],
        };
        let attend = match positions.filter(|_| self.attn_backend.document_causal()) {
            None => Attend::Causal,
            Some(p) if self.varlen_kernel => match documents {
                Some((offsets, longest)) => Attend::Varlen(offsets.shallow_clone(), longest),
                None => {
                    let (offsets, longest) = document_offsets(p);
                    Attend::Varlen(offsets, longest)
                }
            },
            Some(p) => Attend::Masked(document_causal_mask(p)),
        };
        let ctx = ForwardContext {
            rope: rope_for(&self.freqs_cis, seq_len, positions),
            attend,
        };
        // The stage's units in forward order; a prefetch left from an earlier pass is stale.
        let layers: Vec<&(usize, FsdpUnit)> = self
            .layers
            .iter()
            .filter(|(i, _)| modules.layers.contains(i))
            .collect();
        let embeddings = self.embeddings.as_ref().filter(|_| modules.embeddings);
        let head = self.head.as_ref().filter(|_| modules.head);
        let units: Vec<&FsdpUnit> = embeddings
            .into_iter()
            .chain(layers.iter().map(|(_, u)| u))
            .chain(head)
            .collect();
        for unit in &units {
            unit.drop_prefetch();
        }
        // A tied embedding weight, gathered once for the embedding and the output layer.
        let mut tied_output = None;
        let mut h = match embeddings {
            Some(unit) => {
                let [weight]: [Tensor; 1] = unit.gather().params.try_into().expect("one weight");
                if let Some(next) = units.get(1) {
                    next.prefetch();
                }
                let h = self.tp.embedding(&weight, input);
                if self.args.tie_embeddings {
                    tied_output = Some((unit, weight));
                    h
                } else {
                    unit.after_forward(h, None)
                }
            }
            None => input.shallow_clone(),
        };
        let first_layer = usize::from(embeddings.is_some());
        for (k, (index, unit)) in layers.iter().enumerate() {
            let (index, at) = (*index, first_layer + k);
            let f8 = self
                .float8
                .as_ref()
                .map(|f| f.blocks[index].clone())
                .unwrap_or_default();
            // Gather the next unit while this block computes. A checkpointed block's closure
            // runs again in backward (the recompute), where the unit backward reaches next is
            // the one before: gather that one meanwhile, if it gathers in backward at all (it
            // is recomputed too, or it resharded after forward), as FSDP2's backward prefetch.
            let (next, previous) = (
                units.get(at + 1).map(|u| (*u).clone()),
                at.checked_sub(1).map(|p| units[p]),
            );
            let previous_gathers_in_backward = previous.filter(|p| {
                p.reshards_after_forward()
                    || k.checked_sub(1).is_some_and(|j| {
                        self.checkpointing == ActivationCheckpointing::Op
                            || self.checkpointing.whole_layer(layers[j].0)
                    })
            });
            let before = previous_gathers_in_backward.map(|u| (*u).clone());
            let (unit_, ctx_, tp_) = (unit.clone(), ctx.share(), self.tp.clone());
            let forward_pass = Arc::new(AtomicBool::new(true));
            let in_forward = forward_pass.clone();
            let moe_layer = self.args.moe_layer(index).copied();
            let gather = move || {
                let layer = Layer::from_params(unit_.gather(), &shape, moe_layer.as_ref());
                let prefetch = if in_forward.swap(false, Ordering::Relaxed) {
                    &next
                } else {
                    &before
                };
                if let Some(unit) = prefetch {
                    unit.prefetch();
                }
                layer
            };
            // A mixture of experts counts its tokens in a training forward pass, once: not in
            // the recompute activation checkpointing runs in backward.
            let moe = self.moe_state(index);
            let moe_ = moe.as_ref().map(|m| m.share());
            h = if self.checkpointing == ActivationCheckpointing::Op {
                // The first run (forward) records the kept matmul outputs, the second (the
                // recompute in backward) replays them. Each run gathers the block's parameters.
                let kept = Mutex::new(None);
                let [out] = checkpoint(&[&h], move |i| {
                    let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                    let matmuls = Matmuls::new(kept.take(), f8.clone());
                    let layer = gather();
                    let out = block(&layer, shape, &ctx_, &tp_, &i[0], &matmuls, moe_.as_ref());
                    *kept = matmuls.into_recorded();
                    [out]
                });
                out
            } else if self.checkpointing.whole_layer(index) {
                let [out] = checkpoint(&[&h], move |i| {
                    [block(
                        &gather(),
                        shape,
                        &ctx_,
                        &tp_,
                        &i[0],
                        &Matmuls::plain(f8.clone()),
                        moe_.as_ref(),
                    )]
                });
                out
            } else {
                let layer = gather();
                let matmuls = Matmuls::plain(f8).deferring(defer_weight_grads);
                let out = block(&layer, shape, &ctx, &self.tp, &h, &matmuls, moe.as_ref());
                drop(layer);
                unit.after_forward(out, previous)
            };
        }
        let Some(head) = head else {
            return h;
        };
        let Gathered { params, float8 } = head.gather();
        let (norm, lm_head, lm_head_float8) = match &tied_output {
            Some((_, embedding)) => {
                let [norm]: [Tensor; 1] = params.try_into().expect("the final norm");
                (norm, embedding.shallow_clone(), None)
            }
            None => {
                let [norm, lm_head]: [Tensor; 2] = params.try_into().expect("two weights");
                (norm, lm_head, float8.into_iter().nth(1).flatten())
            }
        };
        let h = self
            .tp
            .enter(&h.rms_norm([shape.dim], Some(&norm), shape.norm_eps));
        let logits = match self
            .float8
            .as_ref()
            .and_then(|f| Some((f.lm_head.as_ref()?, f.lm_head_chunks)))
        {
            // Chunks along the sequence, as torchtitan 0.3.0's chunked loss feeds lm_head.
            Some((f8, chunks)) => f8.apply_in_chunks(&h, &lm_head, lm_head_float8.as_ref(), chunks),
            None => match defer_weight_grads {
                Some(stash) => deferred_linear(&h, &lm_head, stash),
                None => h.linear::<&Tensor>(&lm_head, None),
            },
        };
        let logits = logits.to_kind(Kind::Float);
        match tied_output {
            // The tied unit's forward ends here: backward regathers it (when it reshards)
            // before the output layer's backward needs it.
            Some((unit, _)) => unit.after_forward(logits, None),
            None => logits,
        }
    }

    /// Layer `index`'s mixture-of-experts state for one forward pass (counting only in
    /// training), if it has one.
    fn moe_state(&self, index: usize) -> Option<MoeRun> {
        let (_, buffers) = self.moe.iter().find(|(i, _)| *i == index)?;
        Some(MoeRun {
            buffers: buffers.share(),
            count: Arc::new(AtomicBool::new(self.training.load(Ordering::Relaxed))),
        })
    }

    /// Training (the default) or evaluation mode, as torch's `module.train()`/`eval()`: only
    /// training forward passes count the tokens each expert gets.
    pub fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }

    /// The persistent buffers checkpoints hold beside the parameters (torchtitan's
    /// `layers.N.moe.expert_bias_E`), whole on every rank holding the layer.
    pub fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.moe
            .iter()
            .filter_map(|(i, b)| {
                let bias = b.expert_bias.as_ref()?;
                Some((
                    format!("layers.{i}.moe.expert_bias_E"),
                    bias.shallow_clone(),
                ))
            })
            .collect()
    }

    /// Auxiliary-loss-free load balancing before the optimizer step (torchtitan's step
    /// pre-hook): the token counts summed over the data-parallel ranks by `sum_over_dp` move
    /// each layer's `expert_bias` ([`moe::update_expert_bias`]). Nothing without experts.
    pub fn update_expert_bias(
        &self,
        sum_over_dp: impl FnOnce(&Tensor) -> Result<()>,
    ) -> Result<()> {
        let layers: Vec<(&MoeBuffers, f64)> = self
            .moe
            .iter()
            .filter_map(|(i, b)| Some((b, self.args.moe_layer(*i)?.load_balance_coeff?)))
            .collect();
        moe::update_expert_bias(&layers, sum_over_dp)
    }

    /// Shape and dtype of the hidden states between blocks for `batch` rows of `seq_len`
    /// tokens: what one pipeline stage sends the next (this rank's sequence block under
    /// sequence parallelism).
    pub fn hidden_shape(&self, batch: i64, seq_len: i64) -> (Vec<i64>, Kind) {
        let tp = self.tp.size() as i64;
        let seq = if self.tp.sequence_parallel() {
            seq_len / tp
        } else {
            seq_len
        };
        (vec![batch, seq, self.args.dim], self.compute_kind)
    }
}

/// A block's matmuls (`x.linear(w)`), counted per run as torchtitan's selective-AC policy counts
/// them: the odd-numbered ones are kept when recording and taken from the record when replaying.
struct Matmuls {
    memo: RefCell<Memo>,
    count: Cell<usize>,
    float8: BlockFloat8,
    /// Zero-bubble pipelines: the plain (not float8, not recorded) linears' weight gradients
    /// are parked here instead of computed in backward.
    deferred: Option<WeightGradStash>,
}

enum Memo {
    Plain,
    Record(Vec<Tensor>),
    Replay(VecDeque<Tensor>),
}

impl Matmuls {
    fn plain(float8: BlockFloat8) -> Self {
        Self::with(Memo::Plain, float8)
    }

    /// Records when `replay` is `None`, else replays it.
    fn new(replay: Option<VecDeque<Tensor>>, float8: BlockFloat8) -> Self {
        let memo = match replay {
            None => Memo::Record(Vec::new()),
            Some(kept) => Memo::Replay(kept),
        };
        Self::with(memo, float8)
    }

    fn with(memo: Memo, float8: BlockFloat8) -> Self {
        Matmuls {
            memo: RefCell::new(memo),
            count: Cell::new(0),
            float8,
            deferred: None,
        }
    }

    fn deferring(mut self, stash: Option<&WeightGradStash>) -> Self {
        self.deferred = stash.cloned();
        self
    }

    /// `x.linear(w)`, in float8 when `f8` is set.
    fn linear(&self, x: &Tensor, weight: &Weight, f8: Option<&Float8Linear>) -> Tensor {
        self.count.set(self.count.get() + 1);
        let kept = self.count.get() % 2 == 1;
        let (w, gathered) = (&weight.value, weight.float8.as_ref());
        let multiply = || match (f8, &self.deferred) {
            (Some(f8), _) => match gathered {
                Some(g) => f8.apply_gathered(x, w, g),
                None => f8.apply(x, w),
            },
            (None, Some(stash)) => deferred_linear(x, w, stash),
            (None, None) => x.linear::<&Tensor>(w, None),
        };
        match &mut *self.memo.borrow_mut() {
            Memo::Replay(record) if kept => {
                let value = record
                    .pop_front()
                    .expect("the recompute runs the matmuls the forward recorded");
                match f8 {
                    Some(f8) => f8.apply_kept(x, w, gathered, &value),
                    None => kept_linear(x, w, &value),
                }
            }
            Memo::Record(record) if kept => {
                let y = multiply();
                record.push(y.shallow_clone());
                y
            }
            _ => multiply(),
        }
    }

    /// q, k and v of `x` (each (B, S, heads * head_dim)): three linears, or with float8 on all
    /// three one linear over torchtitan 0.3.0's fused `wqkv` (counted as one matmul).
    fn qkv(&self, x: &Tensor, layer: &GqaWeights, shape: BlockShape) -> (Tensor, Tensor, Tensor) {
        match &self.float8.qkv {
            Qkv::Fused(f8) => {
                let (b, s, _) = x.size3().expect("hidden states are (B, S, dim)");
                let (kvh, hd) = (shape.kv_heads, shape.head_dim);
                let per_kv = shape.n_heads / kvh;
                let fuse = |w: [&Tensor; 3]| crate::names::fuse_qkv(w[0], w[1], w[2], kvh);
                let [q, k, v] = [&layer.wq, &layer.wk, &layer.wv];
                // Gathered in float8, the three share one scale: their values fuse as they are.
                let float8 = match (&q.float8, &k.float8, &v.float8) {
                    (Some(fq), Some(fk), Some(fv)) => Some(Float8Weight {
                        data: fuse([&fq.data, &fk.data, &fv.data]),
                        scale: fq.scale.shallow_clone(),
                    }),
                    _ => None,
                };
                let w = Weight {
                    value: fuse([&q.value, &k.value, &v.value]),
                    float8,
                };
                let qkv = self
                    .linear(x, &w, Some(f8))
                    .view([b, s, kvh, per_kv + 2, hd]);
                let part = |start: i64, len: i64| {
                    qkv.narrow(3, start, len).reshape([b, s, kvh * len * hd])
                };
                (part(0, per_kv), part(per_kv, 1), part(per_kv + 1, 1))
            }
            Qkv::Separate(parts) => {
                let [q, k, v] = &**parts;
                (
                    self.linear(x, &layer.wq, q.as_ref()),
                    self.linear(x, &layer.wk, k.as_ref()),
                    self.linear(x, &layer.wv, v.as_ref()),
                )
            }
        }
    }

    /// What a recording run kept, for the replay (`None` after a replay).
    fn into_recorded(self) -> Option<VecDeque<Tensor>> {
        match self.memo.into_inner() {
            Memo::Record(record) => Some(record.into()),
            Memo::Plain | Memo::Replay(_) => None,
        }
    }
}

/// What a block's mixture of experts needs of one forward run besides its weights.
struct MoeRun {
    buffers: MoeBuffers,
    /// Set until the first run of the block in this forward pass has counted its tokens.
    count: Arc<AtomicBool>,
}

impl MoeRun {
    fn share(&self) -> MoeRun {
        MoeRun {
            buffers: self.buffers.share(),
            count: self.count.clone(),
        }
    }
}

/// One transformer block: `h + attention(norm(h))`, then `+ feed_forward(norm(..))` (a SwiGLU,
/// or the mixture of experts `moe` holds the state of).
///
/// Under tensor parallelism `h` is this rank's sequence block (sequence parallel) or the whole
/// replicated sequence; each linear region is entered and left through `tp`.
fn block(
    layer: &Layer,
    shape: BlockShape,
    ctx: &ForwardContext,
    tp: &TensorParallel,
    h: &Tensor,
    mm: &Matmuls,
    moe: Option<&MoeRun>,
) -> Tensor {
    let (d, eps) = (shape.dim, shape.norm_eps);
    let x = tp.enter(&h.rms_norm([d], Some(&layer.attention_norm), eps));
    // `h + ...`, never `h += ...`: tch's `+=` adds in place, and autograd saved `h` for the
    // rms_norm backward, so an in-place add breaks the backward pass.
    let attended = match &layer.attention {
        Attention::Gqa(gqa) => attention(gqa, shape, ctx, &x, mm),
        Attention::Mla(weights) => {
            let m = shape
                .mla
                .as_ref()
                .expect("a latent attention has its arguments");
            mla::attention(weights, m, shape, ctx, &x, mm)
        }
    };
    let h = h + tp.exit(&attended);
    let x = tp.enter(&h.rms_norm([d], Some(&layer.ffn_norm), eps));
    let f8 = &mm.float8;
    let out = match (&layer.ffn, moe, &shape.moe) {
        (FeedForward::Dense { w1, w2, w3 }, _, _) => {
            let gate = mm.linear(&x, w1, f8.w1.as_ref()).silu();
            let up = mm.linear(&x, w3, f8.w3.as_ref());
            mm.linear(&(gate * up), w2, f8.w2.as_ref())
        }
        (FeedForward::Moe(weights), Some(run), Some(args)) => {
            let count = run.count.swap(false, Ordering::Relaxed);
            moe::forward(&x, weights, args, &run.buffers, count)
        }
        (FeedForward::Moe(_), _, _) => unreachable!("a mixture of experts has its state"),
    };
    h + tp.exit(&out)
}

fn attention(
    layer: &GqaWeights,
    shape: BlockShape,
    ctx: &ForwardContext,
    x: &Tensor,
    mm: &Matmuls,
) -> Tensor {
    let (b, s, _) = x.size3().expect("hidden states are (B, S, dim)");
    let (h, kvh, hd) = (shape.n_heads, shape.kv_heads, shape.head_dim);
    let (q, k, v) = mm.qkv(x, layer, shape);
    let q = q.view([b, s, h, hd]);
    let k = k.view([b, s, kvh, hd]);
    let v = v.view([b, s, kvh, hd]);
    // qwen3 normalises each head's q and k before RoPE.
    let (q, k) = match &layer.qk_norm {
        Some((q_norm, k_norm)) => (
            q.rms_norm([hd], Some(q_norm), shape.norm_eps),
            k.rms_norm([hd], Some(k_norm), shape.norm_eps),
        ),
        None => (q, k),
    };
    let q = apply_rotary_emb(&q, &ctx.rope, shape.rope);
    let k = apply_rotary_emb(&k, &ctx.rope, shape.rope);
    if let Attend::Varlen(offsets, longest) = &ctx.attend {
        // The packed tokens: rows are whole documents' runs (each row starts a document).
        let pack = |t: &Tensor, heads: i64| t.reshape([b * s, heads, hd]);
        // The kernel answered the probe at build time ([`probe_varlen_kernel`]) for this dtype.
        let out = varlen_attention(
            &pack(&q, h),
            &pack(&k, kvh),
            &pack(&v, kvh),
            offsets,
            *longest,
        )
        .expect("the varlen kernel ran in the probe");
        return mm.linear(
            &out.reshape([b, s, h * hd]),
            &layer.wo,
            mm.float8.wo.as_ref(),
        );
    }
    // Grouped-query attention as torchtitan asks SDPA for it (`enable_gqa`: each kv head
    // serves n_heads / kv_heads consecutive query heads), not with k and v repeated first:
    // torch picks another CPU kernel for the repeated form, which rounds differently.
    let out = sdpa(&q, &k, &v, &ctx.attend, shape.scale, kvh != h);
    mm.linear(
        &out.reshape([b, s, h * hd]),
        &layer.wo,
        mm.float8.wo.as_ref(),
    )
}

/// Causal SDPA, or with the document-causal mask, over heads laid out (B, S, H, D) as
/// torchtitan's attention modules hold them (its flex attention runs SDPA with the mask on a
/// CPU): the output (B, S, H, D_v). `attend` is not [`Attend::Varlen`], which has its kernel.
fn sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    attend: &Attend,
    scale: Option<f64>,
    gqa: bool,
) -> Tensor {
    let mask = match attend {
        Attend::Masked(m) => Some(m),
        Attend::Causal | Attend::Varlen(..) => None,
    };
    Tensor::scaled_dot_product_attention::<&Tensor>(
        &q.transpose(1, 2),
        &k.transpose(1, 2),
        &v.transpose(1, 2),
        mask,
        0.0,
        mask.is_none(),
        scale,
        gqa,
    )
    .transpose(1, 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_dims_match_torchtitan() {
        assert_eq!(
            ModelArgs::flavor("debugmodel").unwrap().ffn_hidden_dim(),
            768
        );
        assert_eq!(ModelArgs::flavor("8B").unwrap().ffn_hidden_dim(), 14336);
        assert_eq!(ModelArgs::flavor("70B").unwrap().ffn_hidden_dim(), 28672);
        assert_eq!(ModelArgs::flavor("405B").unwrap().ffn_hidden_dim(), 53248);
        // Llama-3-8B has 8,030,261,248 parameters.
        assert_eq!(
            ModelArgs::flavor("8B").unwrap().num_params().0,
            8_030_261_248
        );
    }

    #[test]
    fn param_names_shapes_and_init() {
        tch::manual_seed(0);
        let mut args = ModelArgs::flavor("debugmodel").unwrap();
        args.n_layers = 2;
        args.max_seq_len = 16;
        let m = Llama::new(args.clone(), Device::Cpu, &ParallelPlan::single()).unwrap();
        let names: Vec<&str> = m
            .named_parameters()
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(names[0], "tok_embeddings.weight");
        assert_eq!(names[1], "layers.0.attention.qkv_linear.wq.weight");
        assert_eq!(names[6], "layers.0.feed_forward.w2.weight");
        assert_eq!(*names.last().unwrap(), "lm_head.weight");
        let total: i64 = m
            .named_parameters()
            .iter()
            .map(|(_, t)| t.numel() as i64)
            .sum();
        assert_eq!(total, args.num_params().0);
        let wq = m
            .parameter("layers.0.attention.qkv_linear.wq.weight")
            .unwrap();
        let std = wq.std(true).double_value(&[]);
        assert!((std - 0.02).abs() < 0.001, "wq std {std}");
        let w2 = m.parameter("layers.1.feed_forward.w2.weight").unwrap();
        let std = w2.std(true).double_value(&[]);
        assert!((std - 0.01).abs() < 0.001, "w2 std {std}");
        let out = m.parameter("lm_head.weight").unwrap();
        let bound = 3.0 / 16.0;
        assert!(out.abs().max().double_value(&[]) <= bound + 1e-6);
        let logits = m.forward(&Tensor::from_slice(&[1i64, 2, 3, 4]).view([1, 4]), None);
        assert_eq!(logits.size(), vec![1, 4, 2048]);
    }

    #[test]
    fn document_mask_and_offsets_follow_positions() {
        // Two rows: documents of 3 and 2 tokens, then one of 5.
        let positions = Tensor::from_slice(&[0i64, 1, 2, 0, 1, 0, 1, 2, 3, 4]).view([2, 5]);
        let mask = document_causal_mask(&positions);
        let row0: Vec<Vec<bool>> = (0..5)
            .map(|q| Vec::<bool>::try_from(&mask.get(0).get(0).get(q)).unwrap())
            .collect();
        let t = true;
        let f = false;
        assert_eq!(
            row0,
            [
                [t, f, f, f, f],
                [t, t, f, f, f],
                [t, t, t, f, f],
                [f, f, f, t, f],
                [f, f, f, t, t]
            ]
        );
        let (offsets, longest) = document_offsets(&positions);
        assert_eq!(Vec::<i32>::try_from(&offsets).unwrap(), [0, 3, 5, 10]);
        assert_eq!(longest, 5);
        // The varlen kernel exists only on CUDA: elsewhere it is an error, not a crash.
        let q = Tensor::zeros([10, 2, 8], (Kind::BFloat16, Device::Cpu));
        assert!(varlen_attention(&q, &q, &q, &offsets, longest).is_err());
    }

    #[test]
    fn erf_is_accurate() {
        assert!((erf(1.0) - 0.842_700_792_949_715).abs() < 2e-7);
        assert!((erf(-0.5) + 0.520_499_877_813_047).abs() < 2e-7);
    }
}
