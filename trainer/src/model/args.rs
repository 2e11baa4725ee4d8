//! The decoder families' arguments (torchtitan's llama3, qwen3 and deepseek_v3) and their parameters as
//! data: every parameter's torchtitan 0.3.0 fqn, global shape, initialisation and module, in
//! registration order ([`ModelArgs::parameters`]).
//! No libtorch: the model build draws these, the parallelism plan places them
//! ([`crate::parallelize::plan`]), and the memory estimate counts them, from this one list.

use anyhow::{Result, bail};

/// Llama-3.1's RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

impl Default for RopeScaling {
    fn default() -> Self {
        Self {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }
    }
}

/// The model families titan-train builds: torchtitan's `--module`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// Llama-3: complex RoPE with Llama-3.1 scaling, truncated-normal depth-scaled init.
    #[default]
    Llama3,
    /// Dense Qwen3: q/k RMSNorm, head_dim independent of dim, rotate-half (cos/sin) RoPE,
    /// normal(0.02) init, tied embeddings in the small sizes.
    Qwen3,
    /// DeepSeek-V3: multi-head latent attention ([`MlaArgs`]) with YaRN RoPE on its rope
    /// features, dense feed-forwards in the first `n_dense_layers` blocks and mixtures of
    /// experts with shared experts after, truncated-normal depth-scaled init as llama3's.
    #[serde(rename = "deepseek_v3")]
    DeepseekV3,
}

/// DeepSeek-V3's multi-head latent attention (torchtitan 0.3.0's `deepseek_v3.model.Attention`)
/// and the YaRN scaling of its RoPE (`ComplexRoPE` with `scaling="yarn"`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MlaArgs {
    /// 0: queries through one `wq`; else `wq_a` down to this rank, `q_norm`, `wq_b` up.
    pub q_lora_rank: i64,
    /// Keys and values come up from this rank (`wkv_a` down, `kv_norm`, `wkv_b` up).
    pub kv_lora_rank: i64,
    /// Each head's query/key features without RoPE.
    pub qk_nope_head_dim: i64,
    /// Each head's query/key features with RoPE (the key's are shared by every head).
    pub qk_rope_head_dim: i64,
    pub v_head_dim: i64,
    /// YaRN's attention temperature factor (folded into the softmax scale).
    pub mscale: f64,
    /// YaRN: the frequencies past the original context are divided by this.
    pub rope_factor: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub original_seq_len: i64,
}

impl MlaArgs {
    /// A head's query/key width.
    pub fn qk_head_dim(&self) -> i64 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// torchtitan's `softmax_scale`: `qk_head_dim^-0.5`, times YaRN's
    /// `(0.1 * mscale * ln(rope_factor) + 1)^2` when the rope is scaled.
    pub fn softmax_scale(&self) -> f64 {
        let scale = (self.qk_head_dim() as f64).powf(-0.5);
        if self.rope_factor > 1.0 {
            let m = 0.1 * self.mscale * self.rope_factor.ln() + 1.0;
            scale * m * m
        } else {
            scale
        }
    }
}

/// How a router turns gate logits into expert scores (torchtitan's `score_func`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoreFunc {
    Softmax,
    Sigmoid,
}

/// A mixture-of-experts feed-forward (torchtitan 0.3.0's `MoE.Config` with its
/// `TokenChoiceTopKRouter` and `GroupedExperts`): every token goes to its `top_k` experts of
/// `num_experts`, each a SwiGLU of hidden size `hidden_dim`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoeArgs {
    pub num_experts: i64,
    pub top_k: i64,
    /// Each routed expert's hidden size.
    pub hidden_dim: i64,
    pub score_func: ScoreFunc,
    /// The chosen experts' scores divided by their sum.
    pub route_norm: bool,
    /// The chosen experts' scores multiplied by this.
    pub route_scale: f64,
    /// Auxiliary-loss-free load balancing: each optimizer step moves `expert_bias` by this
    /// much per expert ([`crate::model::moe`]); `None`: no bias.
    pub load_balance_coeff: Option<f64>,
    /// `debug.moe_force_load_balance`: experts chosen round-robin, not by score.
    #[serde(default)]
    pub force_load_balance: bool,
    /// Shared experts: one SwiGLU of hidden size `num_shared_experts * hidden_dim` every token
    /// goes through, added to the routed output (deepseek_v3).
    #[serde(default)]
    pub num_shared_experts: i64,
    /// Node-limited routing: the experts in this many groups, of which each token picks its
    /// experts from the `num_limited_groups` with the best two scores (deepseek_v3's large
    /// flavors).
    #[serde(default)]
    pub num_expert_groups: Option<i64>,
    #[serde(default)]
    pub num_limited_groups: Option<i64>,
}

/// How RoPE rotates a head's features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// torchtitan's `ComplexRoPE`: adjacent feature pairs (llama3).
    Complex,
    /// torchtitan's `CosSinRoPE`: the first half against the second half (qwen3, HF's
    /// `rotate_half`).
    CosSin,
}

/// Shape and numerics of a decoder (torchtitan's model config). The fields after
/// `max_seq_len` came with qwen3: args written without them (llama3's, as tests and older
/// tools write them) read as llama3.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelArgs {
    #[serde(default)]
    pub family: Family,
    pub dim: i64,
    pub n_layers: i64,
    pub n_heads: i64,
    /// `None` means `n_heads` (no grouped-query attention).
    pub n_kv_heads: Option<i64>,
    pub vocab_size: i64,
    pub multiple_of: i64,
    pub ffn_dim_multiplier: Option<f64>,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    /// RoPE tables are built for this many positions (torchtitan sets it to training.seq_len).
    pub max_seq_len: i64,
    /// Features per attention head when it is not `dim / n_heads` (qwen3: 128 at every size).
    #[serde(default)]
    pub explicit_head_dim: Option<i64>,
    /// The feed-forward hidden size when given outright (qwen3), else llama's rule
    /// ([`ModelArgs::ffn_hidden_dim`]).
    #[serde(default)]
    pub explicit_hidden_dim: Option<i64>,
    /// RMSNorm of each head's q and k before RoPE (qwen3's `q_norm`/`k_norm`, over head_dim).
    #[serde(default)]
    pub qk_norm: bool,
    /// `lm_head` is `tok_embeddings`' weight (torchtitan's `enable_weight_tying`).
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Every block's feed-forward is a mixture of experts (qwen3's MoE flavors), but the first
    /// `n_dense_layers` (deepseek_v3).
    #[serde(default)]
    pub moe: Option<MoeArgs>,
    /// Blocks with a dense feed-forward before the mixtures of experts start.
    #[serde(default)]
    pub n_dense_layers: i64,
    /// Multi-head latent attention in place of grouped-query attention (deepseek_v3).
    #[serde(default)]
    pub mla: Option<MlaArgs>,
}

impl ModelArgs {
    /// `[model] name` / `flavor`: torchtitan's flavors of each family titan-train builds.
    pub fn of(name: &str, flavor: &str) -> Result<Self> {
        match name {
            "llama3" => Self::flavor(flavor),
            "qwen3" => Self::qwen3(flavor),
            "deepseek_v3" => Self::deepseek_v3(flavor),
            other => bail!(
                "model `{other}` is not one titan-train builds (it has: llama3, qwen3, deepseek_v3)"
            ),
        }
    }

    /// The model a job trains: `[model] name`/`flavor`, with RoPE tables for the longest
    /// sequence it runs (training or validation, as torchtitan sets `max_seq_len`) and
    /// `debug.moe_force_load_balance`, which needs a mixture of experts.
    pub fn for_job(cfg: &crate::config::JobConfig) -> Result<Self, crate::config::ConfigError> {
        let invalid =
            |key: &str, message: String| crate::config::ConfigError::invalid(key, message);
        let mut args = Self::of(&cfg.model.name, &cfg.model.flavor)
            .map_err(|e| invalid("model.flavor", format!("{e:#}")))?;
        let (_, val_seq_len) = cfg.validation.batch_shape(&cfg.training);
        args.max_seq_len = cfg.training.seq_len.max(val_seq_len as i64);
        if cfg.debug.moe_force_load_balance {
            let Some(moe) = &mut args.moe else {
                return Err(invalid(
                    "debug.moe_force_load_balance",
                    format!(
                        "{} {} has no mixture of experts to balance",
                        cfg.model.name, cfg.model.flavor
                    ),
                ));
            };
            moe.force_load_balance = true;
        }
        Ok(args)
    }

    /// The flavors torchtitan ships for llama3.
    pub fn flavor(name: &str) -> Result<Self> {
        let base = Self {
            family: Family::Llama3,
            dim: 4096,
            n_layers: 32,
            n_heads: 32,
            n_kv_heads: Some(8),
            vocab_size: 128256,
            multiple_of: 1024,
            ffn_dim_multiplier: Some(1.3),
            norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: Some(RopeScaling::default()),
            max_seq_len: 131072,
            explicit_head_dim: None,
            explicit_hidden_dim: None,
            qk_norm: false,
            tie_embeddings: false,
            moe: None,
            n_dense_layers: 0,
            mla: None,
        };
        Ok(match name {
            "debugmodel" => Self {
                dim: 256,
                n_layers: 6,
                n_heads: 16,
                n_kv_heads: None,
                vocab_size: 2048,
                multiple_of: 256,
                ffn_dim_multiplier: None,
                ..base
            },
            // torchtitan's 1B: tied embeddings, 128k vocabulary (the output layer is a third
            // of the parameters).
            "1B" => Self {
                dim: 2048,
                n_layers: 16,
                n_heads: 32,
                ffn_dim_multiplier: Some(1.5),
                tie_embeddings: true,
                ..base
            },
            "8B" => base,
            "70B" => Self {
                dim: 8192,
                n_layers: 80,
                n_heads: 64,
                multiple_of: 4096,
                ..base
            },
            "405B" => Self {
                dim: 16384,
                n_layers: 126,
                n_heads: 128,
                multiple_of: 4096,
                ffn_dim_multiplier: Some(1.2),
                ..base
            },
            other => {
                bail!("unknown llama3 flavor `{other}` (known: debugmodel, 1B, 8B, 70B, 405B)")
            }
        })
    }

    /// The flavors torchtitan 0.3.0 ships for qwen3 (`torchtitan/models/qwen3`): dense, and
    /// the mixtures of experts (`debugmodel_moe`, `30B-A3B`, `235B-A22B`).
    pub fn qwen3(name: &str) -> Result<Self> {
        // (dim, layers, heads, kv heads, hidden, tied embeddings)
        let dense = match name {
            "debugmodel" => Some((256, 8, 16, 8, 3072, true)),
            "0.6B" => Some((1024, 28, 16, 8, 3072, true)),
            "1.7B" => Some((2048, 28, 16, 8, 6144, true)),
            "4B" => Some((2560, 36, 32, 8, 9728, true)),
            "8B" => Some((4096, 36, 32, 8, 12288, false)),
            "14B" => Some((5120, 40, 40, 8, 17408, false)),
            "32B" => Some((5120, 64, 64, 8, 25600, false)),
            _ => None,
        };
        // (dim, layers, heads, kv heads, expert hidden, experts, rope theta); top-8 softmax
        // routing with the chosen scores renormalised, no shared experts, untied embeddings.
        let moe = match name {
            "debugmodel_moe" => Some((256, 8, 16, 8, 768, 64, 1e6)),
            "30B-A3B" => Some((2048, 48, 32, 4, 768, 128, 1e6)),
            "235B-A22B" => Some((4096, 94, 64, 4, 1536, 128, 5e6)),
            _ => None,
        };
        let debug = name.starts_with("debugmodel");
        let base = |dim, n_layers, n_heads, kv| Self {
            family: Family::Qwen3,
            dim,
            n_layers,
            n_heads,
            n_kv_heads: Some(kv),
            vocab_size: if debug { 2048 } else { 151936 },
            multiple_of: 1,
            ffn_dim_multiplier: None,
            norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_seq_len: if debug { 4096 } else { 40960 },
            explicit_head_dim: Some(128),
            explicit_hidden_dim: None,
            qk_norm: true,
            tie_embeddings: false,
            moe: None,
            n_dense_layers: 0,
            mla: None,
        };
        match (dense, moe) {
            (Some((dim, layers, heads, kv, hidden, tie)), _) => Ok(Self {
                explicit_hidden_dim: Some(hidden),
                tie_embeddings: tie,
                ..base(dim, layers, heads, kv)
            }),
            (None, Some((dim, layers, heads, kv, hidden, experts, theta))) => Ok(Self {
                rope_theta: theta,
                moe: Some(MoeArgs {
                    num_experts: experts,
                    top_k: 8,
                    hidden_dim: hidden,
                    score_func: ScoreFunc::Softmax,
                    route_norm: true,
                    route_scale: 1.0,
                    load_balance_coeff: Some(1e-3),
                    force_load_balance: false,
                    num_shared_experts: 0,
                    num_expert_groups: None,
                    num_limited_groups: None,
                }),
                ..base(dim, layers, heads, kv)
            }),
            (None, None) => bail!(
                "unknown qwen3 flavor `{name}` (known: debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B, \
                 debugmodel_moe, 30B-A3B, 235B-A22B)"
            ),
        }
    }

    /// The flavors torchtitan 0.3.0 ships for deepseek_v3 (`torchtitan/models/deepseek_v3`):
    /// `debugmodel`, `16B`, `236B`, `671B`. Every block has multi-head latent attention with
    /// 128 + 64 query/key features (the 64 with YaRN RoPE, factor 40 over 4096 positions) and
    /// 128 value features per head; the first blocks a dense SwiGLU, the others a mixture of
    /// experts with shared experts.
    pub fn deepseek_v3(name: &str) -> Result<Self> {
        // (dim, layers, vocab, heads, q_lora_rank, expert hidden, shared experts, dense hidden,
        //  experts, dense layers, top_k, mscale)
        let (dim, layers, vocab, heads, q_lora, hidden, shared, dense, experts, n_dense, k, mscale) =
            match name {
                "debugmodel" => (256, 6, 2048, 16, 0, 256, 2, 1024, 8, 1, 3, 0.70),
                "16B" => (2048, 27, 102400, 16, 0, 1408, 2, 10944, 64, 1, 6, 0.70),
                "236B" => (5120, 60, 102400, 128, 1536, 1536, 2, 12288, 160, 1, 6, 1.0),
                "671B" => (7168, 61, 129280, 128, 1536, 2048, 1, 18432, 256, 3, 8, 1.0),
                other => bail!(
                    "unknown deepseek_v3 flavor `{other}` (known: debugmodel, 16B, 236B, 671B)"
                ),
            };
        // (score function, expert groups, limited groups, route scale, route norm)
        let (score_func, groups, limited, route_scale, route_norm) = match name {
            "236B" => (ScoreFunc::Softmax, Some(8), Some(3), 16.0, false),
            "671B" => (ScoreFunc::Sigmoid, Some(8), Some(4), 2.5, true),
            _ => (ScoreFunc::Softmax, None, None, 1.0, false),
        };
        Ok(Self {
            family: Family::DeepseekV3,
            dim,
            n_layers: layers,
            n_heads: heads,
            n_kv_heads: None,
            vocab_size: vocab,
            multiple_of: 1,
            ffn_dim_multiplier: None,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_seq_len: 4096 * 4,
            explicit_head_dim: None,
            explicit_hidden_dim: Some(dense),
            qk_norm: false,
            tie_embeddings: false,
            moe: Some(MoeArgs {
                num_experts: experts,
                top_k: k,
                hidden_dim: hidden,
                score_func,
                route_norm,
                route_scale,
                load_balance_coeff: Some(1e-3),
                force_load_balance: false,
                num_shared_experts: shared,
                num_expert_groups: groups,
                num_limited_groups: limited,
            }),
            n_dense_layers: n_dense,
            mla: Some(MlaArgs {
                q_lora_rank: q_lora,
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                mscale,
                rope_factor: 40.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_seq_len: 4096,
            }),
        })
    }

    pub fn kv_heads(&self) -> i64 {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Features per attention head RoPE rotates and the attention kernels see (a latent
    /// attention's rope features: [`MlaArgs`] has its other widths).
    pub fn head_dim(&self) -> i64 {
        match &self.mla {
            Some(m) => m.qk_rope_head_dim,
            None => self.explicit_head_dim.unwrap_or(self.dim / self.n_heads),
        }
    }

    /// The width of all query heads together (`dim` unless head_dim is given outright).
    pub fn q_dim(&self) -> i64 {
        self.n_heads * self.head_dim()
    }

    /// How RoPE rotates features in this family.
    pub fn rope_style(&self) -> RopeStyle {
        match self.family {
            Family::Llama3 => RopeStyle::Complex,
            Family::Qwen3 => RopeStyle::CosSin,
            Family::DeepseekV3 => RopeStyle::Complex,
        }
    }

    /// Parameters of transformer block `layer` ([`ModelArgs::parameters`] lists a block's
    /// together): q, k, v, o, (q_norm, k_norm,) the feed-forward's w1, w2, w3 (a mixture of
    /// experts' grouped w1, w2, w3 and its router's gate) and two norms.
    /// A latent attention has wq (or wq_a, q_norm, wq_b), wkv_a, kv_norm, wkv_b, wo, and a
    /// mixture of experts with shared experts their w1, w2, w3 too.
    pub fn layer_params(&self, layer: usize) -> usize {
        let moe = self.moe_layer(layer);
        let attention = match &self.mla {
            Some(m) if m.q_lora_rank > 0 => 7,
            Some(_) => 5,
            None => 4 + if self.qk_norm { 2 } else { 0 },
        };
        let ffn = match moe {
            Some(m) => 4 + if m.num_shared_experts > 0 { 3 } else { 0 },
            None => 3,
        };
        attention + ffn + 2
    }

    /// The mixture of experts block `layer` has in place of a dense feed-forward, if any (none
    /// in the first `n_dense_layers`).
    pub fn moe_layer(&self, layer: usize) -> Option<&MoeArgs> {
        self.moe
            .as_ref()
            .filter(|_| layer as i64 >= self.n_dense_layers)
    }

    /// torchtitan's SwiGLU hidden size: given outright (qwen3), or 2/3 of 4*dim, times the
    /// multiplier, rounded up to `multiple_of` (llama3).
    pub fn ffn_hidden_dim(&self) -> i64 {
        if let Some(h) = self.explicit_hidden_dim {
            return h;
        }
        let mut hidden = 2 * (4 * self.dim) / 3;
        if let Some(m) = self.ffn_dim_multiplier {
            hidden = (m * hidden as f64) as i64;
        }
        self.multiple_of * ((hidden + self.multiple_of - 1) / self.multiple_of)
    }

    /// Parameter count (total, of which the token embedding), from [`ModelArgs::parameters`]'
    /// shapes (no tensors needed). A tied `lm_head` is the embedding and counts once.
    pub fn num_params(&self) -> (i64, i64) {
        let specs = self.parameters();
        let numel = |p: &ParamSpec| p.shape.iter().product::<i64>();
        let embedding = specs
            .iter()
            .filter(|p| p.module == Module::Embeddings)
            .map(numel)
            .sum();
        (specs.iter().map(numel).sum(), embedding)
    }

    /// torchtitan 0.3.0's training FLOPs per token (`get_dense_model_nparams_and_flops`, and
    /// `get_moe_model_nparams_and_flops`, which agrees for a dense model):
    /// `6 * matmul params + 6 * layers * heads * (2 * head_dim) * seq_len` — the attention
    /// term counts the score and value matmuls together as `2 * head_dim`. The matmul params
    /// leave the embedding out, unless it is tied to `lm_head` (then it is the output matmul),
    /// and count the routed experts' active share only: all experts' parameters times
    /// `top_k / num_experts` (rounded down, as torchtitan's integer division), routers and
    /// shared experts whole. A latent attention's term counts `qk_nope + qk_rope + v` features
    /// per head in place of `2 * head_dim`.
    pub fn flops_per_token(&self, seq_len: i64) -> f64 {
        let (total, embedding) = self.num_params();
        let experts: i64 = self
            .parameters()
            .iter()
            .filter(|p| p.fqn.contains(".moe.routed_experts."))
            .map(|p| p.shape.iter().product::<i64>())
            .sum();
        let active_experts = match &self.moe {
            Some(m) => experts * m.top_k / m.num_experts,
            None => 0,
        };
        let matmul_params = if self.tie_embeddings {
            total
        } else {
            total - embedding
        } - experts
            + active_experts;
        let head_dims = match &self.mla {
            Some(m) => m.qk_head_dim() + m.v_head_dim,
            None => 2 * self.head_dim(),
        };
        6.0 * matmul_params as f64
            + 6.0 * (self.n_layers * self.n_heads * head_dims * seq_len) as f64
    }

    pub fn validate(&self) -> Result<()> {
        let splits =
            self.explicit_head_dim.is_some() || self.mla.is_some() || self.dim % self.n_heads == 0;
        if !splits || self.head_dim() % 2 != 0 {
            bail!(
                "model dim {} must split into {} heads of even size",
                self.dim,
                self.n_heads
            );
        }
        if self.n_heads % self.kv_heads() != 0 {
            bail!(
                "n_heads {} must be a multiple of n_kv_heads {}",
                self.n_heads,
                self.kv_heads()
            );
        }
        if let Some(m) = &self.moe
            && !(1..=m.num_experts).contains(&m.top_k)
        {
            bail!(
                "a token goes to top_k = {} of num_experts = {} experts: top_k must be 1..={}",
                m.top_k,
                m.num_experts,
                m.num_experts
            );
        }
        Ok(())
    }
}

/// How a parameter is initialised (torchtitan's `init_weights`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// `normal_(0, std)`.
    Normal { std: f64 },
    /// `trunc_normal_(0, std, a, b)`.
    TruncNormal { std: f64, a: f64, b: f64 },
    /// `ones_`.
    Ones,
}

/// Which module a parameter belongs to: what pipeline stages and FSDP units are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Module {
    /// `tok_embeddings`.
    Embeddings,
    /// Transformer block `layers.{i}`.
    Layer(usize),
    /// The final `norm` and `lm_head`.
    Head,
}

/// One parameter: its fqn, global shape, initialisation and module.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub fqn: String,
    pub shape: Vec<i64>,
    pub init: Init,
    pub module: Module,
}

/// Parameters per llama3 transformer block ([`ModelArgs::block_params`] has every family's).
pub const BLOCK_PARAMS: usize = 9;

impl ModelArgs {
    /// Every parameter in torchtitan's registration order (the order its `init_weights` draws
    /// them from the RNG): `tok_embeddings`, each block's attention q/k/v/o (and qwen3's
    /// q_norm/k_norm), feed-forward w1/w2/w3 and two norms, the final `norm`, `lm_head` — which
    /// a tied model does not have: its output layer is `tok_embeddings.weight`, listed once,
    /// as torch's `named_parameters` lists a shared parameter (and initialised as torchtitan
    /// initialises `lm_head`, drawn first).
    pub fn parameters(&self) -> Vec<ParamSpec> {
        let (d, qd, hd, kv, v, hdim) = (
            self.dim,
            self.q_dim(),
            self.ffn_hidden_dim(),
            self.kv_heads() * self.head_dim(),
            self.vocab_size,
            self.head_dim(),
        );
        let spec = |fqn: String, shape: &[i64], init: Init, module: Module| ParamSpec {
            fqn,
            shape: shape.to_vec(),
            init,
            module,
        };
        // torchtitan's qwen3 init: normal(0.02) for every linear, the embedding too.
        let normal02 = Init::Normal { std: 0.02 };
        // llama3's output init: truncated normal with std dim^-0.5.
        let final_std = (d as f64).powf(-0.5);
        let lm_head_trunc = Init::TruncNormal {
            std: final_std,
            a: -3.0 * final_std,
            b: 3.0 * final_std,
        };
        let embedding_init = match self.family {
            // torchtitan's tied llama3 (1B) skips the embedding's init: the shared weight is
            // the output layer's.
            Family::Llama3 if self.tie_embeddings => lm_head_trunc,
            Family::Llama3 | Family::DeepseekV3 => Init::Normal { std: 1.0 },
            Family::Qwen3 => normal02,
        };
        let mut out = vec![spec(
            "tok_embeddings.weight".into(),
            &[v, d],
            embedding_init,
            Module::Embeddings,
        )];
        let dsv3 = self.family == Family::DeepseekV3;
        for i in 0..self.n_layers as usize {
            let (std02, depth) = match self.family {
                Family::Llama3 | Family::DeepseekV3 => {
                    // Depth-scaled init for the output projections, as torchtitan's depth_init.
                    let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
                    let trunc = |std| Init::TruncNormal {
                        std,
                        a: -2.0,
                        b: 2.0,
                    };
                    (trunc(0.02), trunc(depth_std))
                }
                // The MoE flavors scale the residual outputs (wo, the experts' w2) by depth, as
                // Megatron does; the dense ones do not.
                Family::Qwen3 if self.moe.is_some() => (
                    normal02,
                    Init::Normal {
                        std: 0.02 / (2.0 * self.n_layers as f64).sqrt(),
                    },
                ),
                Family::Qwen3 => (normal02, normal02),
            };
            let layer = Module::Layer(i);
            let p = |n: &str| format!("layers.{i}.{n}");
            match &self.mla {
                // torchtitan's deepseek_v3 `Attention`: queries straight (`wq`) or through a
                // low rank (`wq_a`, `q_norm`, `wq_b`); keys and values down to the latent
                // rank plus the shared rope key (`wkv_a`), normalised, up per head (`wkv_b`).
                Some(m) => {
                    let (h, qk, r) = (self.n_heads, m.qk_head_dim(), m.q_lora_rank);
                    if r == 0 {
                        out.push(spec(p("attention.wq.weight"), &[h * qk, d], std02, layer));
                    } else {
                        out.extend([
                            spec(p("attention.wq_a.weight"), &[r, d], std02, layer),
                            spec(p("attention.q_norm.weight"), &[r], Init::Ones, layer),
                            spec(p("attention.wq_b.weight"), &[h * qk, r], std02, layer),
                        ]);
                    }
                    let (kvr, vd) = (m.kv_lora_rank, m.v_head_dim);
                    let kv_b = h * (m.qk_nope_head_dim + vd);
                    out.extend([
                        spec(
                            p("attention.wkv_a.weight"),
                            &[kvr + m.qk_rope_head_dim, d],
                            std02,
                            layer,
                        ),
                        spec(p("attention.kv_norm.weight"), &[kvr], Init::Ones, layer),
                        spec(p("attention.wkv_b.weight"), &[kv_b, kvr], std02, layer),
                        spec(p("attention.wo.weight"), &[d, h * vd], depth, layer),
                    ]);
                }
                None => out.extend([
                    spec(p("attention.qkv_linear.wq.weight"), &[qd, d], std02, layer),
                    spec(p("attention.qkv_linear.wk.weight"), &[kv, d], std02, layer),
                    spec(p("attention.qkv_linear.wv.weight"), &[kv, d], std02, layer),
                    spec(p("attention.wo.weight"), &[d, qd], depth, layer),
                ]),
            }
            if self.qk_norm {
                out.extend([
                    spec(p("attention.q_norm.weight"), &[hdim], Init::Ones, layer),
                    spec(p("attention.k_norm.weight"), &[hdim], Init::Ones, layer),
                ]);
            }
            let norms = [
                spec(p("attention_norm.weight"), &[d], Init::Ones, layer),
                spec(p("ffn_norm.weight"), &[d], Init::Ones, layer),
            ];
            // deepseek_v3's block registers its norms before its feed-forward.
            let norms_after = if dsv3 {
                out.extend(norms);
                None
            } else {
                Some(norms)
            };
            // deepseek_v3 scales the experts' w3 and the router by depth too.
            let (w3_init, gate_init) = if dsv3 { (depth, depth) } else { (std02, std02) };
            match self.moe_layer(i) {
                // torchtitan's `MoE`: its routed experts (one [E, F, D] / [E, D, F] tensor per
                // SwiGLU weight), its router's gate, then its shared experts' SwiGLU.
                Some(m) => {
                    let (e, f) = (m.num_experts, m.hidden_dim);
                    let experts = |n: &str| p(&format!("moe.routed_experts.inner_experts.{n}"));
                    out.extend([
                        spec(experts("w1_EFD"), &[e, f, d], std02, layer),
                        spec(experts("w2_EDF"), &[e, d, f], depth, layer),
                        spec(experts("w3_EFD"), &[e, f, d], w3_init, layer),
                        spec(p("moe.router.gate.weight"), &[e, d], gate_init, layer),
                    ]);
                    if m.num_shared_experts > 0 {
                        let sf = m.num_shared_experts * f;
                        out.extend([
                            spec(p("moe.shared_experts.w1.weight"), &[sf, d], std02, layer),
                            spec(p("moe.shared_experts.w2.weight"), &[d, sf], depth, layer),
                            spec(p("moe.shared_experts.w3.weight"), &[sf, d], depth, layer),
                        ]);
                    }
                }
                None => out.extend([
                    spec(p("feed_forward.w1.weight"), &[hd, d], std02, layer),
                    spec(p("feed_forward.w2.weight"), &[d, hd], depth, layer),
                    spec(p("feed_forward.w3.weight"), &[hd, d], depth, layer),
                ]),
            }
            out.extend(norms_after.into_iter().flatten());
        }
        out.push(spec("norm.weight".into(), &[d], Init::Ones, Module::Head));
        if !self.tie_embeddings {
            let lm_head_init = match self.family {
                Family::Llama3 | Family::DeepseekV3 => lm_head_trunc,
                Family::Qwen3 => normal02,
            };
            out.push(spec(
                "lm_head.weight".into(),
                &[v, d],
                lm_head_init,
                Module::Head,
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_grouped_by_module_in_registration_order() {
        let args = ModelArgs::flavor("debugmodel").unwrap();
        let specs = args.parameters();
        assert_eq!(specs.len(), 3 + BLOCK_PARAMS * args.n_layers as usize);
        for (k, s) in specs[1..specs.len() - 2].iter().enumerate() {
            assert_eq!(s.module, Module::Layer(k / BLOCK_PARAMS), "{}", s.fqn);
        }
        // The hand count torchtitan logs for the debug model.
        assert_eq!(args.num_params(), (6_163_712, 524_288));
    }

    /// Parameter counts and FLOPs per token at seq_len 2048 as torchtitan 0.3.0's
    /// `get_nparams_and_flops` gives them for its meta-device models (tied qwen3 sizes count
    /// the shared weight once, and as a matmul).
    #[test]
    fn counts_and_flops_are_torchtitans() {
        for (name, flavor, params, flops) in [
            ("llama3", "debugmodel", 6_163_712, 71_585_280.0),
            ("llama3", "1B", 1_235_814_400, 8_220_192_768.0),
            ("llama3", "8B", 8_030_261_248, 48_250_773_504.0),
            ("qwen3", "debugmodel", 31_987_968, 594_580_992.0),
            ("qwen3", "0.6B", 596_049_920, 4_985_585_664.0),
            ("qwen3", "8B", 8_190_735_360, 49_034_311_680.0),
        ] {
            let args = ModelArgs::of(name, flavor).unwrap();
            assert_eq!(args.num_params().0, params, "{name} {flavor}");
            assert_eq!(args.flops_per_token(2048), flops, "{name} {flavor}");
        }
        let qwen = ModelArgs::of("qwen3", "debugmodel").unwrap();
        assert_eq!(qwen.parameters().len(), 2 + 11 * 8);
        let err = ModelArgs::of("qwen3", "30B").unwrap_err().to_string();
        assert!(err.contains("30B-A3B"), "{err}");
    }

    /// The MoE flavors as torchtitan 0.3.0's meta-device models count them: every expert in
    /// the parameters, the active share (top_k of num_experts) in the FLOPs per token.
    #[test]
    fn moe_counts_and_flops_are_torchtitans() {
        let args = ModelArgs::of("qwen3", "debugmodel_moe").unwrap();
        assert_eq!(args.num_params().0, 315_758_848);
        assert_eq!(args.flops_per_token(4096), 1_111_266_816.0);
        assert_eq!(args.flops_per_token(128), 331_126_272.0);
        let specs = args.parameters();
        assert_eq!(specs.len(), 3 + 12 * 8);
        assert_eq!((0..8).map(|i| args.layer_params(i)).sum::<usize>(), 12 * 8);
        let names: Vec<&str> = specs[1..13].iter().map(|p| p.fqn.as_str()).collect();
        assert_eq!(
            names[6..10],
            [
                "layers.0.moe.routed_experts.inner_experts.w1_EFD",
                "layers.0.moe.routed_experts.inner_experts.w2_EDF",
                "layers.0.moe.routed_experts.inner_experts.w3_EFD",
                "layers.0.moe.router.gate.weight",
            ]
        );
        assert_eq!(specs[7].shape, [64, 768, 256]);
        assert_eq!(specs[8].shape, [64, 256, 768]);
    }

    /// deepseek_v3's flavors as torchtitan 0.3.0's meta-device models count them
    /// (`get_nparams_and_flops`: the attention term with qk_nope + qk_rope + v features per
    /// head, routers and shared experts whole, the routed experts' active share), and its
    /// parameters' names and order: a latent attention, the norms, then the dense
    /// feed-forward (block 0) or the mixture of experts with its shared experts.
    #[test]
    fn deepseek_v3_counts_flops_and_names_are_torchtitans() {
        for (flavor, params, flops_2048) in [
            ("debugmodel", 33_014_016, 542_934_528.0),
            ("16B", 15_706_484_224, 16_407_303_168.0),
            ("236B", 235_741_434_880, 155_308_062_720.0),
            ("671B", 671_026_404_352, 250_455_926_784.0),
        ] {
            let args = ModelArgs::of("deepseek_v3", flavor).unwrap();
            args.validate().unwrap();
            assert_eq!(args.num_params().0, params, "{flavor}");
            assert_eq!(args.flops_per_token(2048), flops_2048, "{flavor}");
            let specs = args.parameters();
            let per_layer: usize = (0..args.n_layers as usize)
                .map(|i| args.layer_params(i))
                .sum();
            assert_eq!(specs.len(), 3 + per_layer, "{flavor}");
        }
        let args = ModelArgs::of("deepseek_v3", "debugmodel").unwrap();
        assert_eq!(args.flops_per_token(128), 189_040_128.0);
        assert_eq!(args.flops_per_token(4096), 920_421_888.0);
        let specs = args.parameters();
        let names: Vec<&str> = specs.iter().map(|p| p.fqn.as_str()).collect();
        assert_eq!(
            names[..30],
            [
                "tok_embeddings.weight",
                "layers.0.attention.wq.weight",
                "layers.0.attention.wkv_a.weight",
                "layers.0.attention.kv_norm.weight",
                "layers.0.attention.wkv_b.weight",
                "layers.0.attention.wo.weight",
                "layers.0.attention_norm.weight",
                "layers.0.ffn_norm.weight",
                "layers.0.feed_forward.w1.weight",
                "layers.0.feed_forward.w2.weight",
                "layers.0.feed_forward.w3.weight",
                "layers.1.attention.wq.weight",
                "layers.1.attention.wkv_a.weight",
                "layers.1.attention.kv_norm.weight",
                "layers.1.attention.wkv_b.weight",
                "layers.1.attention.wo.weight",
                "layers.1.attention_norm.weight",
                "layers.1.ffn_norm.weight",
                "layers.1.moe.routed_experts.inner_experts.w1_EFD",
                "layers.1.moe.routed_experts.inner_experts.w2_EDF",
                "layers.1.moe.routed_experts.inner_experts.w3_EFD",
                "layers.1.moe.router.gate.weight",
                "layers.1.moe.shared_experts.w1.weight",
                "layers.1.moe.shared_experts.w2.weight",
                "layers.1.moe.shared_experts.w3.weight",
                "layers.2.attention.wq.weight",
                "layers.2.attention.wkv_a.weight",
                "layers.2.attention.kv_norm.weight",
                "layers.2.attention.wkv_b.weight",
                "layers.2.attention.wo.weight",
            ]
        );
        assert_eq!(names[names.len() - 2..], ["norm.weight", "lm_head.weight"]);
        let shape = |i: usize| specs[i].shape.as_slice();
        assert_eq!(
            [shape(1), shape(2), shape(4), shape(5)],
            [&[3072, 256][..], &[576, 256], &[4096, 512], &[256, 2048]]
        );
        assert_eq!(shape(18), [8, 256, 256]);
        assert_eq!(shape(22), [512, 256]);
        // Depth-scaled truncated normals for the residual outputs, the experts' w3 and the
        // router of block 1 (std 0.02 / sqrt(4)).
        let depth = Init::TruncNormal {
            std: 0.01,
            a: -2.0,
            b: 2.0,
        };
        for i in [15, 19, 20, 21, 23, 24] {
            assert_eq!(specs[i].init, depth, "{}", specs[i].fqn);
        }
        // 671B: low-rank queries, three dense blocks, sigmoid routing in 4 of 8 groups.
        let big = ModelArgs::of("deepseek_v3", "671B").unwrap();
        assert!(big.moe_layer(2).is_none() && big.moe_layer(3).is_some());
        assert_eq!(big.layer_params(3), 7 + 7 + 2);
        assert_eq!(big.moe.unwrap().num_limited_groups, Some(4));
        let mla = args.mla.unwrap();
        // 192^-0.5 * (0.1 * 0.7 * ln 40 + 1)^2.
        assert!((mla.softmax_scale() - 0.114_251_95).abs() < 1e-8);
    }
}
