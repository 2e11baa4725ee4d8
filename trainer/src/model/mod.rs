//! The decoder of torchtitan's llama3, qwen3 and deepseek_v3 families with torchtitan's
//! parameter names: GQA or DeepSeek-V3's multi-head latent attention ([`mla`]), RMSNorm, SwiGLU
//! or a mixture of experts ([`moe`]), RoPE (complex with Llama-3.1 or YaRN scaling, or qwen3's
//! cos/sin with q/k norms and tied embeddings), causal SDPA, initialised as torchtitan does.
//!
//! The model knows nothing of how it is split. Its parameters are drawn whole in torchtitan's
//! registration order ([`draw_parameters`]); the forward pass is [`block`] and [`output`] over
//! a block's weights in that order ([`Layer::from_params`]), asking an [`Ops`] to run each
//! linear and to enter and leave tensor-parallel regions. [`Decoder`] is the whole model on one
//! device with [`Plain`] ops; `crate::parallelize::ParallelModel` runs the same functions over
//! a rank's part of the parameters.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use tch::{Device, Kind, Tensor};

mod args;
mod mla;
pub mod moe;
pub use args::{
    BLOCK_PARAMS, Family, Init, MlaArgs, ModelArgs, Module, MoeArgs, ParamSpec, RopeScaling,
    RopeStyle, ScoreFunc,
};
pub use moe::MoeBuffers;
use moe::MoeWeights;

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
    // host-counted offsets instead (`ParallelModel::forward_stage`); this is the fallback.
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
pub struct ForwardContext {
    rope: Tensor,
    attend: Attend,
}

/// How tokens attend in one forward pass.
pub enum Attend {
    /// Plain causal attention.
    Causal,
    /// SDPA with a mask (B, 1, S_q, S_k): the document-causal mask, or under context
    /// parallelism this rank's queries over every rank's keys ([`Ops::keys_values`]).
    Masked(Tensor),
    /// FlashAttention's varlen kernel over the packed documents: offsets and longest document.
    Varlen(Tensor, i64),
}

impl ForwardContext {
    /// The context of a forward pass over `seq_len` tokens a row at `positions` in their
    /// documents (`None`: each row one document from position 0), with the model's RoPE table
    /// `freqs_cis`.
    pub fn new(
        freqs_cis: &Tensor,
        seq_len: i64,
        positions: Option<&Tensor>,
        attend: Attend,
    ) -> Self {
        ForwardContext {
            rope: rope_for(freqs_cis, seq_len, positions),
            attend,
        }
    }

    pub fn share(&self) -> ForwardContext {
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

/// A linear's weight: its values, and its place among its module's parameters (block or output
/// layer) in registration order, by which whatever runs the linear ([`Ops`]) tells the
/// linears apart.
pub struct Weight {
    pub value: Tensor,
    pub at: usize,
}

/// A transformer block's parameters, as the decoder's forward pass takes them.
pub struct Layer {
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
    /// A block's parameters in registration order ([`ModelArgs::parameters`]), with the
    /// q/k norms after `wo` when `qk_norm`, and a mixture of experts' four parameters (seven
    /// with shared experts) in place of w1, w2, w3 when `moe`. A latent attention's block
    /// ([`mla::MlaWeights::take`]) has its two norms before its feed-forward.
    pub fn from_params(params: Vec<Tensor>, shape: &BlockShape, moe: Option<&MoeArgs>) -> Layer {
        let mut weights = params
            .into_iter()
            .enumerate()
            .map(|(at, value)| Weight { value, at });
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
pub struct BlockShape {
    pub dim: i64,
    pub n_heads: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
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
    /// The shape of a block whose heads are split into `head_groups` equal groups, each
    /// computed apart (tensor parallelism's ranks; 1: the whole block).
    pub fn of(args: &ModelArgs, head_groups: i64) -> Self {
        BlockShape {
            dim: args.dim,
            n_heads: args.n_heads / head_groups,
            kv_heads: args.kv_heads() / head_groups,
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

/// Whether FlashAttention's varlen kernel runs on `device`: a two-document probe, once.
pub fn probe_varlen_kernel(device: Device) -> bool {
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

/// Draws every parameter of the model whole, in registration order, with torchtitan's
/// initialisation from the global torch RNG (seed it first for reproducible weights), and hands
/// each to `take` with its spec. Whoever splits the model keeps its part of each (and drops
/// other pipeline stages' parameters after drawing them), so every layout gets the values one
/// process gets and no rank holds more than one whole parameter at a time.
pub fn draw_parameters(
    args: &ModelArgs,
    device: Device,
    mut take: impl FnMut(ParamSpec, Tensor) -> Result<()>,
) -> Result<()> {
    for spec in args.parameters() {
        let mut full = Tensor::empty(spec.shape.as_slice(), (Kind::Float, device));
        tch::no_grad(|| initialise(&mut full, spec.init));
        take(spec, full)?;
    }
    Ok(())
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

/// What a block's mixture of experts needs of one forward run besides its weights.
pub struct MoeRun {
    buffers: MoeBuffers,
    /// Set until the first run of the block in this forward pass has counted its tokens.
    count: Arc<AtomicBool>,
}

impl MoeRun {
    /// One forward pass of the layer whose buffers are `buffers`; `count`: it counts the tokens
    /// each expert gets (a training forward pass), once however often the block runs.
    pub fn new(buffers: &MoeBuffers, count: bool) -> Self {
        MoeRun {
            buffers: buffers.share(),
            count: Arc::new(AtomicBool::new(count)),
        }
    }

    pub fn share(&self) -> MoeRun {
        MoeRun {
            buffers: self.buffers.share(),
            count: self.count.clone(),
        }
    }
}

/// How the decoder's matmuls run and where its tensor-parallel regions begin and end: the
/// one thing the model asks of whatever splits it. [`Plain`] is one process's;
/// `crate::parallelize` implements it with tensor parallelism's collectives, float8 linears,
/// selective activation checkpointing's kept matmuls and zero-bubble's deferred weight
/// gradients.
pub trait Ops {
    /// The input of a region of column-wise linears (attention, feed-forward, output layer).
    fn enter(&self, x: &Tensor) -> Tensor;
    /// The output of a region's row-wise linear: its partial sums added.
    fn exit(&self, x: &Tensor) -> Tensor;
    /// `x · wᵀ`.
    fn linear(&self, x: &Tensor, w: &Weight) -> Tensor;
    /// The keys and values (B, S, heads, dim) this pass's queries attend over, from this
    /// pass's own `k` and `v`: themselves, or where the sequence is split over ranks every
    /// rank's, in the order [`Attend::Masked`]'s key axis follows.
    fn keys_values(&self, k: &Tensor, v: &Tensor) -> (Tensor, Tensor);
    /// The routed experts' outputs for `routed` (R, D), tokens sorted by expert with
    /// `per_expert` (E,) of them for each: `experts(tokens, counts)` runs the experts this
    /// process holds over tokens sorted by them. Here, or where the experts are split over
    /// ranks, after sending each token to the rank holding its expert (and the output back).
    fn routed_experts(
        &self,
        routed: &Tensor,
        per_expert: &Tensor,
        experts: &dyn Fn(&Tensor, &Tensor) -> Tensor,
    ) -> Tensor;
    /// The tokens of a mixture of experts' input `x` (B, S, D) this process routes: all of
    /// them, or where several ranks of a region route different tokens (expert parallelism
    /// with tensor parallelism) its block of the sequence.
    fn routed_tokens(&self, x: &Tensor) -> Tensor {
        x.shallow_clone()
    }
    /// The routed experts' output `out` for [`Ops::routed_tokens`], as this process's part of
    /// the (B, `seq_len`, D) output its region's exit adds up: itself, or zeros outside its
    /// block of the sequence.
    fn routed_output(&self, out: &Tensor, seq_len: i64) -> Tensor {
        let _ = seq_len;
        out.shallow_clone()
    }
    /// q, k and v of `x`, each (B, S, heads * head_dim), in one matmul over the three weights
    /// fused (torchtitan 0.3.0's `wqkv`), where the implementation multiplies them so; `None`:
    /// three [`Ops::linear`]s.
    fn fused_qkv(&self, x: &Tensor, w: [&Weight; 3], shape: &BlockShape) -> Option<[Tensor; 3]>;
}

/// One process's [`Ops`]: plain matmuls, no regions.
pub struct Plain;

impl Ops for Plain {
    fn enter(&self, x: &Tensor) -> Tensor {
        x.shallow_clone()
    }

    fn exit(&self, x: &Tensor) -> Tensor {
        x.shallow_clone()
    }

    fn linear(&self, x: &Tensor, w: &Weight) -> Tensor {
        x.linear::<&Tensor>(&w.value, None)
    }

    fn keys_values(&self, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        (k.shallow_clone(), v.shallow_clone())
    }

    fn routed_experts(
        &self,
        routed: &Tensor,
        per_expert: &Tensor,
        experts: &dyn Fn(&Tensor, &Tensor) -> Tensor,
    ) -> Tensor {
        experts(routed, per_expert)
    }

    fn fused_qkv(&self, _: &Tensor, _: [&Weight; 3], _: &BlockShape) -> Option<[Tensor; 3]> {
        None
    }
}

/// One transformer block: `h + attention(norm(h))`, then `+ feed_forward(norm(..))` (a SwiGLU,
/// or the mixture of experts `moe` holds the state of).
///
/// Under tensor parallelism `h` is this rank's sequence block (sequence parallel) or the whole
/// replicated sequence, and `shape` has this rank's heads; each region is entered and left
/// through `ops`.
pub fn block(
    layer: &Layer,
    shape: BlockShape,
    ctx: &ForwardContext,
    ops: &dyn Ops,
    h: &Tensor,
    moe: Option<&MoeRun>,
) -> Tensor {
    let (d, eps) = (shape.dim, shape.norm_eps);
    let x = ops.enter(&h.rms_norm([d], Some(&layer.attention_norm), eps));
    // `h + ...`, never `h += ...`: tch's `+=` adds in place, and autograd saved `h` for the
    // rms_norm backward, so an in-place add breaks the backward pass.
    let attended = match &layer.attention {
        Attention::Gqa(gqa) => attention(gqa, shape, ctx, &x, ops),
        Attention::Mla(weights) => {
            let m = shape
                .mla
                .as_ref()
                .expect("a latent attention has its arguments");
            mla::attention(weights, m, shape, ctx, &x, ops)
        }
    };
    let h = h + ops.exit(&attended);
    let x = ops.enter(&h.rms_norm([d], Some(&layer.ffn_norm), eps));
    let out = match (&layer.ffn, moe, &shape.moe) {
        (FeedForward::Dense { w1, w2, w3 }, _, _) => {
            let gate = ops.linear(&x, w1).silu();
            let up = ops.linear(&x, w3);
            ops.linear(&(gate * up), w2)
        }
        (FeedForward::Moe(weights), Some(run), Some(args)) => {
            let count = run.count.swap(false, Ordering::Relaxed);
            moe::forward(&x, weights, args, &run.buffers, count, ops)
        }
        (FeedForward::Moe(_), _, _) => unreachable!("a mixture of experts has its state"),
    };
    h + ops.exit(&out)
}

/// The output layer: the final norm of the hidden states `h`, then `lm_head`; the logits in
/// fp32 (this rank's vocab columns under tensor parallelism).
pub fn output(
    h: &Tensor,
    norm: &Tensor,
    lm_head: &Weight,
    shape: &BlockShape,
    ops: &dyn Ops,
) -> Tensor {
    let h = ops.enter(&h.rms_norm([shape.dim], Some(norm), shape.norm_eps));
    ops.linear(&h, lm_head).to_kind(Kind::Float)
}

fn attention(
    layer: &GqaWeights,
    shape: BlockShape,
    ctx: &ForwardContext,
    x: &Tensor,
    ops: &dyn Ops,
) -> Tensor {
    let (b, s, _) = x.size3().expect("hidden states are (B, S, dim)");
    let (h, kvh, hd) = (shape.n_heads, shape.kv_heads, shape.head_dim);
    let [wq, wk, wv] = [&layer.wq, &layer.wk, &layer.wv];
    let [q, k, v] = ops
        .fused_qkv(x, [wq, wk, wv], &shape)
        .unwrap_or_else(|| [wq, wk, wv].map(|w| ops.linear(x, w)));
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
        return ops.linear(&out.reshape([b, s, h * hd]), &layer.wo);
    }
    let (k, v) = ops.keys_values(&k, &v);
    // Grouped-query attention as torchtitan asks SDPA for it (`enable_gqa`: each kv head
    // serves n_heads / kv_heads consecutive query heads), not with k and v repeated first:
    // torch picks another CPU kernel for the repeated form, which rounds differently.
    let out = sdpa(&q, &k, &v, &ctx.attend, shape.scale, kvh != h);
    ops.linear(&out.reshape([b, s, h * hd]), &layer.wo)
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

/// The whole model on one device, split over nothing: torchtitan's initialisation and the
/// forward pass as a sequence of the functions above (embedding, [`block`]s, [`output`]) with
/// [`Plain`] ops. `crate::parallelize::ParallelModel` runs the same functions over its parts of
/// the parameters; this is the reference it is checked against.
pub struct Decoder {
    pub args: ModelArgs,
    params: Vec<(String, Tensor)>,
    freqs_cis: Tensor,
    moe: Vec<(usize, MoeBuffers)>,
}

impl Decoder {
    /// The model with torchtitan's initialisation from the global torch RNG.
    pub fn new(args: ModelArgs, device: Device) -> Result<Self> {
        args.validate()?;
        let mut params = Vec::new();
        draw_parameters(&args, device, |spec, full| {
            params.push((spec.fqn, full.set_requires_grad(true)));
            Ok(())
        })?;
        let moe = (0..args.n_layers as usize)
            .filter_map(|i| Some((i, MoeBuffers::new(args.moe_layer(i)?, device))))
            .collect();
        let freqs_cis = precompute_freqs_cis(&args, device);
        Ok(Decoder {
            args,
            params,
            freqs_cis,
            moe,
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

    /// Logits (B, S, vocab) in fp32 for token ids (B, S), causal, or document-causal (SDPA
    /// with the mask) over `positions` (B, S) in their documents. A training forward pass: a
    /// mixture of experts counts its tokens.
    pub fn forward(&self, tokens: &Tensor, positions: Option<&Tensor>) -> Tensor {
        let args = &self.args;
        let shape = BlockShape::of(args, 1);
        let attend = match positions {
            Some(p) => Attend::Masked(document_causal_mask(p)),
            None => Attend::Causal,
        };
        let ctx = ForwardContext::new(&self.freqs_cis, tokens.size()[1], positions, attend);
        let take = |range: std::ops::Range<usize>| {
            self.params[range]
                .iter()
                .map(|(_, t)| t.shallow_clone())
                .collect::<Vec<_>>()
        };
        let embedding = &self.params[0].1;
        let mut h = Tensor::embedding(embedding, tokens, -1, false, false);
        let mut at = 1;
        for i in 0..args.n_layers as usize {
            let n = args.layer_params(i);
            let layer = Layer::from_params(take(at..at + n), &shape, args.moe_layer(i));
            at += n;
            let moe = self
                .moe
                .iter()
                .find(|(j, _)| *j == i)
                .map(|(_, buffers)| MoeRun::new(buffers, true));
            h = block(&layer, shape, &ctx, &Plain, &h, moe.as_ref());
        }
        let lm_head = if args.tie_embeddings {
            embedding.shallow_clone()
        } else {
            self.params[at + 1].1.shallow_clone()
        };
        let lm_head = Weight {
            value: lm_head,
            at: 1,
        };
        output(&h, &self.params[at].1, &lm_head, &shape, &Plain)
    }
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
        let _generator = crate::rng::global_generator();
        tch::manual_seed(0);
        let mut args = ModelArgs::flavor("debugmodel").unwrap();
        args.n_layers = 2;
        args.max_seq_len = 16;
        let m = Decoder::new(args.clone(), Device::Cpu).unwrap();
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
