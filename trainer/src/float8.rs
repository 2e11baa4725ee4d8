//! Float8 training of linear layers with dynamic scaling, computed as torchao 0.18's
//! `Float8Linear` computes it (what torchtitan's float8 converter swaps in).
//!
//! A linear `y = x Wᵀ` runs three matmuls, and each casts its two operands to float8 just before
//! multiplying, with scales taken from the operands' current values ("dynamic" scaling):
//!
//! | matmul | product | operand a | operand b |
//! |---|---|---|---|
//! | output | `y = x · Wᵀ` (M×K · K×N) | x | Wᵀ |
//! | grad_input | `gx = go · W` (M×N · N×K) | grad_out | W |
//! | grad_weight | `gW = goᵀ · x` (N×M · M×K) | grad_outᵀ | x |
//!
//! An operand's scale is `max_fp8 / max(amax, 1e-12)`, divided in f64 and kept as f32 (torchao's
//! `amax_to_scale`); the operand is multiplied by it in f32, clamped to ±max_fp8 (saturation:
//! out-of-range values become the largest float8 value, never inf/NaN) and cast. The product is
//! `(a_fp8 / s_a) · (b_fp8 / s_b)`: either through `torch._scaled_mm` with the inverse scales
//! ([`Backend::ScaledMm`]; CPU kernel in torch ≥ 2.8, CUDA SM 8.9+), or as an f32 `mm` of the
//! dequantised operands ([`Backend::Emulated`], torchao's `emulate=True`). A rowwise `_scaled_mm`
//! returns bf16 where the layer computes in f32 (the rowwise kernels have no f32 output; torchao
//! does the same).
//!
//! The recipes (torchao's `Float8LinearConfig.from_recipe_name`):
//! - **tensorwise**: one amax per operand; x and W in e4m3fn, grad_out in e5m2 (its range).
//! - **rowwise**: one scale per row of a and per column of b, i.e. along the contraction
//!   dimension of each matmul (x per token for the output, per input feature for the weight
//!   gradient, ...); e4m3fn everywhere; scales rounded down to a power of two.
//! - **rowwise_with_gw_hp**: the output as rowwise; grad_input with grad_out rowwise and W
//!   tensorwise (e4m3fn, power-of-two scales); the weight gradient in high precision.
//!
//! Under tensor parallelism an operand split over the tp ranks takes its amax over the whole
//! tensor (an all-reduce of the local amaxes, as a reduction over a sharded DTensor gives), so a
//! TP run casts to the same float8 values as one process (a rowwise `_scaled_mm` then rounds each
//! rank's partial product of a row-wise linear to bf16 before the ranks add them).
//!
//! Only the matmuls see float8: parameters, gradients, optimizer state and checkpoints keep their
//! dtype.

use tch::{Kind, Tensor};

use titan_ckpt::adapter::{legacy_name, tables::LLAMA3};

use crate::autograd::{self, Function};
pub use crate::config::Float8Recipe as Recipe;
use crate::distributed::{Group, ReduceOp};

/// The smallest amax a scale is computed from (torchao's `EPS`): an all-zero tensor gets a
/// finite scale.
pub const EPS: f64 = 1e-12;

/// How each of the three matmuls of `recipe` casts its operands.
fn recipe_plan(recipe: Recipe) -> Plan {
    use Kind::{Float8e4m3fn as E4, Float8e5m2 as E5};
    let tensorwise = |kind| {
        Some(Cast {
            kind,
            rowwise: false,
        })
    };
    let rowwise = |kind| {
        Some(Cast {
            kind,
            rowwise: true,
        })
    };
    // torchao's default gemm configs: fast accumulation for the output only.
    let gemm = |a, b, fast_accum| Gemm { a, b, fast_accum };
    match recipe {
        Recipe::Tensorwise => Plan {
            output: gemm(tensorwise(E4), tensorwise(E4), true),
            grad_input: gemm(tensorwise(E5), tensorwise(E4), false),
            grad_weight: gemm(tensorwise(E5), tensorwise(E4), false),
            pow2: false,
        },
        Recipe::Rowwise => Plan {
            output: gemm(rowwise(E4), rowwise(E4), true),
            grad_input: gemm(rowwise(E4), rowwise(E4), false),
            grad_weight: gemm(rowwise(E4), rowwise(E4), false),
            pow2: true,
        },
        Recipe::RowwiseWithGwHp => Plan {
            output: gemm(rowwise(E4), rowwise(E4), true),
            grad_input: gemm(rowwise(E4), tensorwise(E4), false),
            grad_weight: gemm(None, None, false),
            pow2: true,
        },
    }
}

/// How a float8 product is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `torch._scaled_mm` on the float8 operands.
    ScaledMm,
    /// f32 `mm` of the dequantised operands (torchao's `emulate=True`): the same float8 values,
    /// no float8 kernel needed.
    Emulated,
}

/// How one operand is cast: its float8 dtype, and whether it has a scale per row (along the
/// matmul's contraction dimension) or one for the whole tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cast {
    pub kind: Kind,
    pub rowwise: bool,
}

/// One matmul: its operands' casts (`None`: high precision; both or neither).
#[derive(Debug, Clone, Copy)]
struct Gemm {
    a: Option<Cast>,
    b: Option<Cast>,
    fast_accum: bool,
}

#[derive(Debug, Clone, Copy)]
struct Plan {
    output: Gemm,
    grad_input: Gemm,
    grad_weight: Gemm,
    /// Scales rounded down to a power of two (torchao's `round_scales_to_power_of_2`).
    pow2: bool,
}

/// The largest finite value of a float8 dtype (`torch.finfo(kind).max`).
pub fn max_value(kind: Kind) -> f64 {
    match kind {
        Kind::Float8e4m3fn => 448.0,
        Kind::Float8e5m2 => 57344.0,
        Kind::Float8e4m3fnuz => 240.0,
        Kind::Float8e5m2fnuz => 57344.0,
        other => panic!("{other:?} is not a float8 dtype"),
    }
}

/// The amax an operand's scale comes from: of the whole tensor, or per row of `t` along
/// `inner_dim` (kept as a (R, 1) or (1, C) tensor).
pub fn amax(t: &Tensor, cast: Cast, inner_dim: i64) -> Tensor {
    let abs = t.abs();
    if cast.rowwise {
        abs.amax([inner_dim], true)
    } else {
        abs.max()
    }
}

/// The scale for `amax`: `max_fp8 / max(amax, EPS)` in f64, stored as f32, optionally rounded
/// down to a power of two.
pub fn amax_to_scale(amax: &Tensor, kind: Kind, pow2: bool) -> Tensor {
    let amax = amax.to_kind(Kind::Double).clamp_min(EPS);
    let scale = amax.full_like(max_value(kind)).divide(&amax);
    let scale = scale.to_kind(Kind::Float);
    if pow2 {
        scale.log2().floor().exp2()
    } else {
        scale
    }
}

/// `t` scaled and cast to float8 `kind`, saturating at the dtype's largest value.
pub fn to_float8(t: &Tensor, scale: &Tensor, kind: Kind) -> Tensor {
    let max = max_value(kind);
    (t.to_kind(Kind::Float) * scale)
        .clamp(-max, max)
        .to_kind(kind)
}

/// `(a / scale_a) · (b / scale_b)` for float8 `a` (R×I) and `b` (I×C) and their scales
/// (0-dim, or (R, 1) and (1, C)), returned in `out`.
fn product(
    (a, scale_a): (&Tensor, &Tensor),
    (b, scale_b): (&Tensor, &Tensor),
    out: Kind,
    fast_accum: bool,
    backend: Backend,
) -> Tensor {
    match backend {
        Backend::Emulated => {
            let a = a.to_kind(Kind::Float) / scale_a;
            let b = b.to_kind(Kind::Float) / scale_b;
            a.mm(&b).to_kind(out)
        }
        Backend::ScaledMm => {
            let (rows, cols) = (a.size()[0], b.size()[1]);
            let rowwise = scale_a.dim() == 2 || scale_b.dim() == 2;
            let inverse = |s: &Tensor, shape: [i64; 2]| {
                let inv = s.reciprocal();
                // _scaled_mm takes both scales in one granularity: a tensorwise scale next to
                // a rowwise one is repeated along the rows (as torchao's preprocess_addmm).
                if rowwise {
                    inv.expand(shape, false).contiguous()
                } else {
                    inv
                }
            };
            let (inv_a, inv_b) = (inverse(scale_a, [rows, 1]), inverse(scale_b, [1, cols]));
            // The rowwise kernels have no f32/f16 output: torchao takes bf16 and casts.
            let mm_out = if rowwise && matches!(out, Kind::Float | Kind::Half) {
                Kind::BFloat16
            } else {
                out
            };
            // a row-major, b column-major: the layout the kernels take.
            let a = a.contiguous();
            let b = b.transpose(0, 1).contiguous().transpose(0, 1);
            a.internal_scaled_mm(
                &b,
                &inv_a,
                &inv_b,
                None::<Tensor>,
                None::<Tensor>,
                mm_out,
                fast_accum,
            )
            .to_kind(out)
        }
    }
}

/// Whether `backend` computes float8 products on `device`: a 16×16 product of each pair of
/// float8 dtypes the recipes use, tensorwise and rowwise. `Err` says what failed.
pub fn probe(backend: Backend, device: tch::Device) -> Result<(), String> {
    if backend == Backend::Emulated {
        return Ok(());
    }
    let result = std::panic::catch_unwind(|| {
        let x = Tensor::ones([16, 16], (Kind::Float, device));
        for (ka, kb) in [
            (Kind::Float8e4m3fn, Kind::Float8e4m3fn),
            (Kind::Float8e5m2, Kind::Float8e4m3fn),
        ] {
            let one = Tensor::ones([], (Kind::Float, device));
            let rows = Tensor::ones([16, 1], (Kind::Float, device));
            let cols = Tensor::ones([1, 16], (Kind::Float, device));
            for (sa, sb) in [(&one, &one), (&rows, &cols)] {
                let a = x.to_kind(ka);
                let b = x.to_kind(kb).transpose(0, 1);
                let _product = a
                    .f_internal_scaled_mm(
                        &b,
                        sa,
                        sb,
                        None::<Tensor>,
                        None::<Tensor>,
                        Kind::BFloat16,
                        false,
                    )
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    });
    result.unwrap_or_else(|p| Err(autograd::panic_text(p)))
}

/// Which dimension of each matmul operand (in the matmul's orientation) is split over tp:
/// `[output (a, b), grad_input (a, b), grad_weight (a, b)]`.
type Splits = [(Option<i64>, Option<i64>); 3];

/// Which dimension of a float8 linear's weight (out_features, in_features) tensor parallelism
/// splits over its group: the one fact of the TP plan a float8 linear needs (the plan maps its
/// styles to it, `crate::parallelize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightSplit {
    /// The same weight on every rank.
    Whole,
    /// Column-wise parallel: the output features (dim 0).
    OutFeatures,
    /// Row-wise parallel: the input features (dim 1), and the input with them.
    InFeatures,
}

/// The matmul operands' splits of a linear whose weight is split as `split`.
fn operand_splits(split: WeightSplit) -> Splits {
    match split {
        WeightSplit::Whole => [(None, None); 3],
        // Column-wise: W's rows (output features) split, the input whole.
        // x (M,K) whole, Wᵀ (K,N/tp); go (M,N/tp), W (N/tp,K); goᵀ (N/tp,M), x whole.
        WeightSplit::OutFeatures => [(None, Some(1)), (Some(1), Some(0)), (Some(0), None)],
        // Row-wise: W's columns (input features) split, and the input with them.
        // x (M,K/tp), Wᵀ (K/tp,N); go whole, W (N,K/tp); goᵀ whole, x (M,K/tp).
        WeightSplit::InFeatures => [(Some(1), Some(0)), (None, Some(1)), (None, Some(1))],
    }
}

/// One float8 linear layer's settings: recipe, how products are computed, and its place under
/// tensor parallelism. [`Float8Linear::apply`] is the differentiable `x.linear(w)`.
#[derive(Clone)]
pub struct Float8Linear {
    plan: Plan,
    backend: Backend,
    /// The tensor-parallel group the weight is split over (its amaxes are reduced over it).
    tp: Group,
    splits: Splits,
}

impl Float8Linear {
    /// A float8 linear whose weight is split as `split` over the ranks of `tp`.
    pub fn new(recipe: Recipe, backend: Backend, tp: Group, split: WeightSplit) -> Self {
        let split = if tp.size() > 1 {
            split
        } else {
            WeightSplit::Whole
        };
        Float8Linear {
            plan: recipe_plan(recipe),
            backend,
            tp,
            splits: operand_splits(split),
        }
    }

    /// `x.linear(w)` (x: (..., K), w: (N, K)) with float8 matmuls forward and backward.
    pub fn apply(&self, x: &Tensor, w: &Tensor) -> Tensor {
        self.run(x, w, None, None, 1)
    }

    /// [`Float8Linear::apply`] for a weight FSDP gathered already cast (`w` is then the
    /// high-precision weight autograd hands the weight gradient to; its values are not read).
    pub fn apply_gathered(&self, x: &Tensor, w: &Tensor, gathered: &Float8Weight) -> Tensor {
        self.run(x, w, Some(gathered.clone()), None, 1)
    }

    /// [`Float8Linear::apply`] (or `apply_gathered`) on `chunks` pieces of x (B, S, K) along
    /// the sequence, each cast with its own scales, as torchtitan 0.3.0's chunked loss feeds its
    /// `lm_head`; backward takes the chunks in order too and adds their weight gradients one
    /// after the other (chunk 0 first, as the chunked loss's per-chunk backward accumulates
    /// them), so the weight gradient is torchtitan's bit for bit.
    pub fn apply_in_chunks(
        &self,
        x: &Tensor,
        w: &Tensor,
        gathered: Option<&Float8Weight>,
        chunks: i64,
    ) -> Tensor {
        self.run(x, w, gathered.cloned(), None, chunks.max(1))
    }

    /// For a recompute that already has the forward's output `kept`: returns it without
    /// multiplying and back-propagates as [`Float8Linear::apply`] (or `apply_gathered` with
    /// `gathered`) does (selective activation checkpointing's replay).
    pub fn apply_kept(
        &self,
        x: &Tensor,
        w: &Tensor,
        gathered: Option<&Float8Weight>,
        kept: &Tensor,
    ) -> Tensor {
        self.run(x, w, gathered.cloned(), Some(kept.shallow_clone()), 1)
    }

    fn run(
        &self,
        x: &Tensor,
        w: &Tensor,
        gathered: Option<Float8Weight>,
        kept: Option<Tensor>,
        chunks: i64,
    ) -> Tensor {
        assert!(
            gathered.is_none() || self.takes_gathered_weights(),
            "only the tensorwise recipe multiplies a weight gathered in float8"
        );
        let f = Float8Matmul {
            linear: self.clone(),
            gathered,
            kept,
            chunks,
            saved: None,
        };
        autograd::apply(f, &[x, w], 1).remove(0)
    }

    /// Whether this layer casts its weight the way [`Float8Weight::cast`] does in every matmul
    /// that reads it (tensorwise e4m3fn, no power-of-two rounding): the layers FSDP may gather
    /// in float8.
    pub fn takes_gathered_weights(&self) -> bool {
        let weight = Some(Cast {
            kind: WEIGHT_KIND,
            rowwise: false,
        });
        self.plan.output.b == weight && self.plan.grad_input.b == weight && !self.plan.pow2
    }

    /// The scales this layer gives x and W in the forward matmul and grad_out in the grad_input
    /// matmul, for x (..., K), w (N, K) and go (..., N): shapes (M, 1) / (1, N) / (M, 1) when
    /// rowwise, 0-dim when tensorwise. For tests and inspection (computed again, as backward does).
    pub fn scales(&self, x: &Tensor, w: &Tensor, go: &Tensor) -> [Tensor; 3] {
        let cast = |c: Option<Cast>, t: &Tensor, inner: i64, split: Option<i64>| match c {
            Some(c) => self.cast(t, c, inner, split).1,
            None => Tensor::ones([], (Kind::Float, t.device())),
        };
        let (k, n) = (w.size()[1], w.size()[0]);
        let [out, grad_input, _] = self.splits;
        [
            cast(self.plan.output.a, &x.reshape([-1, k]), 1, out.0),
            cast(self.plan.output.b, &w.transpose(0, 1), 0, out.1),
            cast(
                self.plan.grad_input.a,
                &go.reshape([-1, n]),
                1,
                grad_input.0,
            ),
        ]
    }

    /// `t` cast for one operand: its float8 values and scale. `inner_dim` is the contraction
    /// dimension of `t` in the matmul, `split` the dimension tp splits (if any).
    fn cast(&self, t: &Tensor, cast: Cast, inner_dim: i64, split: Option<i64>) -> (Tensor, Tensor) {
        let mut amax = amax(t, cast, inner_dim);
        // A tensorwise amax spans every dimension; a rowwise one only the contraction dim.
        if split.is_some_and(|d| !cast.rowwise || d == inner_dim) {
            // Outside autograd, over the ranks holding the other parts (a split implies a
            // group of more than one).
            amax = amax.contiguous();
            if let Err(e) = self.tp.all_reduce(&amax, ReduceOp::Max) {
                panic!("{e}");
            }
        }
        let scale = amax_to_scale(&amax, cast.kind, self.plan.pow2);
        (to_float8(t, &scale, cast.kind), scale)
    }

    /// One matmul `a · b` (a: R×I, b: I×C) as `gemm` casts it, in `out`.
    fn gemm(
        &self,
        gemm: Gemm,
        (a, b): (Operand, Operand),
        splits: (Option<i64>, Option<i64>),
        out: Kind,
    ) -> Tensor {
        match (gemm.a, gemm.b) {
            (Some(ca), Some(cb)) => {
                let (qa, sa) = self.operand(a, ca, 1, splits.0);
                let (qb, sb) = self.operand(b, cb, 0, splits.1);
                product((&qa, &sa), (&qb, &sb), out, gemm.fast_accum, self.backend)
            }
            _ => a.high_precision().mm(&b.high_precision()).to_kind(out),
        }
    }

    /// An operand's float8 values and scale: cast now, or as gathered.
    fn operand(
        &self,
        t: Operand,
        cast: Cast,
        inner_dim: i64,
        split: Option<i64>,
    ) -> (Tensor, Tensor) {
        match t {
            Operand::High(t) => self.cast(&t, cast, inner_dim, split),
            Operand::Float8(w) => (w.data, w.scale),
        }
    }

    /// The forward output of `x` (..., K) and `w` (N, K): (..., N) in x's dtype.
    fn output(&self, x: &Tensor, w: &Tensor, gathered: Option<&Float8Weight>) -> Tensor {
        let mut shape = x.size();
        let k = *shape
            .last()
            .expect("a linear's input has a feature dimension");
        let wt = match gathered {
            Some(g) => Operand::Float8(g.transposed()),
            None => Operand::High(w.transpose(0, 1)),
        };
        let y = self.gemm(
            self.plan.output,
            (Operand::High(x.reshape([-1, k])), wt),
            self.splits[0],
            x.kind(),
        );
        *shape.last_mut().expect("checked above") = w.size()[0];
        y.reshape(shape.as_slice())
    }

    /// The gradients of x and w for the output gradient `go` (..., N), in go's dtype.
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        gathered: Option<&Float8Weight>,
        go: &Tensor,
    ) -> (Tensor, Tensor) {
        let (n, k) = (w.size()[0], w.size()[1]);
        let go2 = go.reshape([-1, n]);
        let w_operand = match gathered {
            Some(g) => Operand::Float8(g.clone()),
            None => Operand::High(w.shallow_clone()),
        };
        let gx = self
            .gemm(
                self.plan.grad_input,
                (Operand::High(go2.shallow_clone()), w_operand),
                self.splits[1],
                go.kind(),
            )
            .reshape(x.size().as_slice());
        let gw = self.gemm(
            self.plan.grad_weight,
            (
                Operand::High(go2.transpose(0, 1)),
                Operand::High(x.reshape([-1, k])),
            ),
            self.splits[2],
            go.kind(),
        );
        (gx, gw)
    }
}

/// A matmul operand: in high precision (the layer casts it), or a weight gathered in float8.
enum Operand {
    High(Tensor),
    Float8(Float8Weight),
}

impl Operand {
    fn high_precision(&self) -> Tensor {
        match self {
            Operand::High(t) => t.shallow_clone(),
            Operand::Float8(w) => w.data.to_kind(Kind::Float) / &w.scale,
        }
    }
}

/// The float8 dtype weights are cast to (every recipe's weight operand).
pub const WEIGHT_KIND: Kind = Kind::Float8e4m3fn;

/// A weight FSDP gathered already cast to float8 (`enable_fsdp_float8_all_gather`, as torchao's
/// `WeightWithDynamicFloat8CastTensor`): its e4m3fn values and the tensorwise scale they were
/// cast with. The scale comes from the amax of the whole weight, so the values are the ones a
/// tensorwise layer would cast from the whole weight itself.
pub struct Float8Weight {
    pub data: Tensor,
    /// 0-dim f32.
    pub scale: Tensor,
}

impl Clone for Float8Weight {
    fn clone(&self) -> Self {
        Float8Weight {
            data: self.data.shallow_clone(),
            scale: self.scale.shallow_clone(),
        }
    }
}

impl Float8Weight {
    /// The tensorwise scale for a weight whose (global) amax is `amax`.
    pub fn scale_for(amax: &Tensor) -> Tensor {
        amax_to_scale(amax, WEIGHT_KIND, false)
    }

    /// `w` (or a shard of it) cast with `scale`.
    pub fn cast(w: &Tensor, scale: &Tensor) -> Tensor {
        to_float8(w, scale, WEIGHT_KIND)
    }

    /// A high-precision tensor of `size` that holds no memory (zero strides, one element): where
    /// a gathered weight's values are never read, only its shape and its gradient's way back.
    pub fn placeholder(size: &[i64], kind: Kind, device: tch::Device) -> Tensor {
        Tensor::empty_strided(size, vec![0; size.len()].as_slice(), (kind, device))
    }

    fn transposed(&self) -> Float8Weight {
        Float8Weight {
            data: self.data.transpose(0, 1),
            scale: self.scale.shallow_clone(),
        }
    }
}

/// Float8 training of a model as the config asks: recipe, how products are computed, and which
/// linears (torchtitan's converter rule).
#[derive(Debug, Clone)]
pub struct Float8Training {
    pub recipe: Recipe,
    pub backend: Backend,
    pub filter_fqns: Vec<String>,
    /// The sequence chunks a float8 `lm_head` multiplies separately.
    pub lm_head_chunks: i64,
    /// FSDP gathers the float8 linears' weights in float8 (`enable_fsdp_float8_all_gather`).
    pub fsdp_all_gather: bool,
    /// ... with scales computed once after each optimizer step
    /// (`precompute_float8_dynamic_scale_for_fsdp`).
    pub precompute_scales: bool,
}

impl Float8Training {
    /// The config's float8 training, or `None` when it is off. An unset recipe is tensorwise.
    pub fn from_config(cfg: &crate::config::JobConfig) -> Option<Self> {
        cfg.float8_enabled().then(|| Float8Training {
            recipe: cfg.float8.recipe_name.unwrap_or(Recipe::Tensorwise),
            backend: if cfg.float8.emulate {
                Backend::Emulated
            } else {
                Backend::ScaledMm
            },
            filter_fqns: cfg.float8.filter_fqns.clone(),
            lm_head_chunks: cfg.float8.lm_head_chunks as i64,
            fsdp_all_gather: cfg.float8.enable_fsdp_float8_all_gather,
            precompute_scales: cfg.float8.enable_fsdp_float8_all_gather
                && cfg.float8.precompute_float8_dynamic_scale_for_fsdp,
        })
    }

    /// Whether the linear `fqn` (torchtitan 0.3.0's module name, e.g. `layers.0.feed_forward.w1`)
    /// with a weight of global shape (out, in) trains in float8: both dims multiples of 16 (the
    /// float8 kernels' rule, applied by torchtitan to every backend) and not [`Self::filtered`].
    pub fn converts(&self, fqn: &str, out_features: i64, in_features: i64) -> bool {
        out_features % 16 == 0 && in_features % 16 == 0 && !self.filtered(fqn)
    }

    /// Whether a `filter_fqns` entry is part of the linear's name, in either name generation
    /// (`lm_head` is `output` before torchtitan 0.3.0, `attention.qkv_linear.wq` is
    /// `attention.wq`).
    pub fn filtered(&self, fqn: &str) -> bool {
        let legacy = legacy_name(&LLAMA3, &format!("{fqn}.weight"))
            .map(|n| n.trim_end_matches(".weight").to_string());
        self.filter_fqns.iter().any(|f| {
            fqn.contains(f.as_str()) || legacy.as_deref().is_some_and(|l| l.contains(f.as_str()))
        })
    }

    /// The float8 layer for a linear whose weight is split as `split` over `tp`.
    pub fn linear(&self, tp: &Group, split: WeightSplit) -> Float8Linear {
        Float8Linear::new(self.recipe, self.backend, tp.clone(), split)
    }
}

/// The autograd function of one float8 linear call. It keeps the high-precision input and weight
/// for backward (as torchao does) and casts them again there along the backward's axes; a weight
/// gathered in float8 is kept as gathered.
struct Float8Matmul {
    linear: Float8Linear,
    gathered: Option<Float8Weight>,
    /// The output to return instead of multiplying (a selective-AC replay).
    kept: Option<Tensor>,
    /// Pieces of the sequence (dim 1) multiplied one after the other (1: the whole input).
    chunks: i64,
    saved: Option<(Tensor, Tensor)>,
}

impl Float8Matmul {
    /// `t`'s chunks along the sequence, each contiguous (as torchtitan's chunked loss cuts them).
    fn pieces(&self, t: &Tensor) -> Vec<Tensor> {
        t.chunk(self.chunks, 1)
            .iter()
            .map(|c| c.contiguous())
            .collect()
    }
}

impl Function for Float8Matmul {
    fn forward(&mut self, inputs: &[Tensor]) -> Vec<Tensor> {
        let (x, w) = (&inputs[0], &inputs[1]);
        let gathered = self.gathered.as_ref();
        let y = match self.kept.take() {
            Some(kept) => kept,
            None if self.chunks > 1 => {
                let parts: Vec<Tensor> = self
                    .pieces(x)
                    .iter()
                    .map(|c| self.linear.output(c, w, gathered))
                    .collect();
                Tensor::cat(&parts, 1)
            }
            None => self.linear.output(x, w, gathered),
        };
        // With a gathered weight backward multiplies its float8 values: of `w` only the shape is
        // kept (a zero-stride tensor), so a fused q/k/v placeholder is not held until backward.
        let w = match gathered {
            Some(_) => Float8Weight::placeholder(&w.size(), w.kind(), w.device()),
            None => w.shallow_clone(),
        };
        self.saved = Some((x.shallow_clone(), w));
        vec![y]
    }

    fn backward(&mut self, grads: &[Tensor]) -> Vec<Tensor> {
        let (x, w) = self.saved.as_ref().expect("forward ran before backward");
        let gathered = self.gathered.as_ref();
        if self.chunks == 1 {
            let (gx, gw) = self.linear.grads(x, w, gathered, &grads[0]);
            return vec![gx, gw];
        }
        let mut gxs = Vec::new();
        let mut gw_sum: Option<Tensor> = None;
        for (xc, gc) in self.pieces(x).iter().zip(self.pieces(&grads[0])) {
            let (gx, gw) = self.linear.grads(xc, w, gathered, &gc);
            gxs.push(gx);
            gw_sum = Some(match gw_sum {
                Some(sum) => sum + gw,
                None => gw,
            });
        }
        vec![Tensor::cat(&gxs, 1), gw_sum.expect("at least one chunk")]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(&t.to_kind(Kind::Float).reshape([-1])).unwrap()
    }

    #[test]
    fn scale_is_max_over_amax_with_eps_and_power_of_two() {
        let amax = Tensor::from_slice(&[2.0f32, 0.0, 3.0, 448.0]);
        let e4 = amax_to_scale(&amax, Kind::Float8e4m3fn, false);
        let want = [224.0, (448.0 / EPS) as f32, (448.0f64 / 3.0) as f32, 1.0];
        assert_eq!(values(&e4), want);
        // 448 / 3 = 149.33 rounds down to 128; 224 to 128; 1 stays.
        let p2 = amax_to_scale(&amax, Kind::Float8e4m3fn, true);
        assert_eq!(values(&p2)[0], 128.0);
        assert_eq!(values(&p2)[2], 128.0);
        assert_eq!(values(&p2)[3], 1.0);
        let e5 = amax_to_scale(&Tensor::from_slice(&[57344.0f32]), Kind::Float8e5m2, false);
        assert_eq!(values(&e5), [1.0]);
    }

    #[test]
    fn casting_saturates_instead_of_overflowing() {
        let t = Tensor::from_slice(&[1.0f32, -1000.0, 500.0, 1e9]);
        let one = Tensor::from(1.0f32);
        let q = to_float8(&t, &one, Kind::Float8e4m3fn);
        assert_eq!(q.kind(), Kind::Float8e4m3fn);
        assert_eq!(values(&q), [1.0, -448.0, 448.0, 448.0]);
        let q = to_float8(&t, &one, Kind::Float8e5m2);
        assert_eq!(values(&q), [1.0, -1024.0, 512.0, 57344.0]);
        // With the dynamic scale the largest magnitude lands on the dtype's max exactly.
        let s = amax_to_scale(
            &amax(
                &t,
                Cast {
                    kind: Kind::Float8e4m3fn,
                    rowwise: false,
                },
                0,
            ),
            Kind::Float8e4m3fn,
            false,
        );
        assert_eq!(values(&to_float8(&t, &s, Kind::Float8e4m3fn))[3], 448.0);
    }

    #[test]
    fn rowwise_amax_is_along_the_contraction_dim() {
        let a = Tensor::from_slice(&[1.0f32, -4.0, 2.0, 3.0]).view([2, 2]);
        let row = Cast {
            kind: Kind::Float8e4m3fn,
            rowwise: true,
        };
        assert_eq!(amax(&a, row, 1).size(), [2, 1]);
        assert_eq!(values(&amax(&a, row, 1)), [4.0, 3.0]);
        assert_eq!(values(&amax(&a, row, 0)), [2.0, 4.0]);
        let whole = Cast {
            rowwise: false,
            ..row
        };
        assert_eq!(values(&amax(&a, whole, 0)), [4.0]);
    }

    /// Every recipe's forward and gradients stay near the f32 linear, and the scaled-mm and
    /// emulated products agree (the same float8 operands; they differ only by the kernels'
    /// summation order, and rowwise by the bf16 output of the scaled kernel).
    #[test]
    fn recipes_track_the_f32_linear_and_backends_agree() {
        let _generator = crate::rng::global_generator();
        tch::manual_seed(3);
        let x = Tensor::randn([4, 8, 32], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([48, 32], (Kind::Float, Device::Cpu)) * 0.1;
        let go = Tensor::randn([4, 8, 48], (Kind::Float, Device::Cpu));
        let reference = {
            let x = x.copy().set_requires_grad(true);
            let w = w.copy().set_requires_grad(true);
            let y = x.linear::<&Tensor>(&w, None);
            (&y * &go).sum(Kind::Float).backward();
            (y.detach(), x.grad(), w.grad())
        };
        let tp = crate::distributed::DeviceMesh::single().tp;
        for recipe in [Recipe::Tensorwise, Recipe::Rowwise, Recipe::RowwiseWithGwHp] {
            let mut results = Vec::new();
            for backend in [Backend::Emulated, Backend::ScaledMm] {
                let f8 = Float8Linear::new(recipe, backend, tp.clone(), WeightSplit::Whole);
                let x = x.copy().set_requires_grad(true);
                let w = w.copy().set_requires_grad(true);
                let y = f8.apply(&x, &w);
                (&y * &go).sum(Kind::Float).backward();
                results.push((y.detach(), x.grad(), w.grad()));
            }
            for (got, want) in [
                (&results[0].0, &reference.0),
                (&results[0].1, &reference.1),
                (&results[0].2, &reference.2),
            ] {
                let rel = (got - want).norm().double_value(&[]) / want.norm().double_value(&[]);
                // e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per element), e5m2 2.
                assert!(rel < 0.1, "{recipe:?}: relative error {rel}");
            }
            for i in 0..3 {
                let (e, s) = [
                    (&results[0].0, &results[1].0),
                    (&results[0].1, &results[1].1),
                    (&results[0].2, &results[1].2),
                ][i];
                let rel = (e - s).abs().max().double_value(&[]) / e.abs().max().double_value(&[]);
                assert!(
                    rel < 1e-2,
                    "{recipe:?} tensor {i}: scaled vs emulated {rel}"
                );
            }
        }
    }

    /// A weight cast before the layer sees it (FSDP's float8 all-gather) with the whole
    /// weight's scale multiplies exactly as the layer casting it itself: the same output and
    /// gradients, bit for bit, with either backend; only tensorwise takes such weights.
    #[test]
    fn a_weight_gathered_in_float8_multiplies_as_the_layer_casts_it() {
        let _generator = crate::rng::global_generator();
        tch::manual_seed(5);
        let x = Tensor::randn([2, 8, 32], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([48, 32], (Kind::Float, Device::Cpu)) * 0.1;
        let go = Tensor::randn([2, 8, 48], (Kind::Float, Device::Cpu));
        let tp = crate::distributed::DeviceMesh::single().tp;
        let run = |f8: &Float8Linear, gathered: bool| {
            let x = x.copy().set_requires_grad(true);
            let w = w.copy().set_requires_grad(true);
            let y = if gathered {
                let scale = Float8Weight::scale_for(&w.detach().abs().max());
                let g = Float8Weight {
                    data: Float8Weight::cast(&w.detach(), &scale),
                    scale,
                };
                f8.apply_gathered(&x, &w, &g)
            } else {
                f8.apply(&x, &w)
            };
            (&y * &go).sum(Kind::Float).backward();
            [y.detach(), x.grad(), w.grad()].map(|t| values(&t))
        };
        for backend in [Backend::Emulated, Backend::ScaledMm] {
            let f8 = Float8Linear::new(Recipe::Tensorwise, backend, tp.clone(), WeightSplit::Whole);
            assert!(f8.takes_gathered_weights());
            assert_eq!(run(&f8, true), run(&f8, false), "{backend:?}");
        }
        for recipe in [Recipe::Rowwise, Recipe::RowwiseWithGwHp] {
            let f8 = Float8Linear::new(recipe, Backend::Emulated, tp.clone(), WeightSplit::Whole);
            assert!(!f8.takes_gathered_weights(), "{recipe:?}");
        }
    }

    #[test]
    fn the_scaled_mm_kernel_answers_on_cpu() {
        probe(Backend::ScaledMm, Device::Cpu).unwrap();
    }
}
