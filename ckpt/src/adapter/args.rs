//! Model arguments inferred from a checkpoint's shapes (plus what the user says), and the HF
//! `config.json` for each family's transformers class, loadable by transformers 4.x and 5.x.

use serde_json::{Value, json};

use super::{Family, Naming, find_tt, main_layers, tables::Table};
use crate::error::{Error, Result};
use crate::plan::CheckpointPlan;
use titan_dcp::Dtype;

/// What the user told us about the model (anything not given is inferred from shapes or from
/// the known torchtitan flavors).
#[derive(Debug, Clone, Default)]
pub struct Hints {
    pub n_heads: Option<u64>,
    pub n_kv_heads: Option<u64>,
    pub rope_theta: Option<f64>,
    pub norm_eps: Option<f64>,
    pub max_position_embeddings: Option<u64>,
    pub experts_per_token: Option<u64>,
    /// No Llama-3.1 RoPE scaling (torchtitan's `scaling="none"`).
    pub no_rope_scaling: bool,
}

/// MoE arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeArgs {
    pub num_experts: u64,
    /// Hidden size of one expert.
    pub expert_hidden: u64,
    /// Top-k; None when neither given nor known.
    pub experts_per_token: Option<u64>,
}

/// Llama-3's RoPE frequency scaling (HF `rope_type` llama3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: u64,
}

impl Llama3Rope {
    /// Llama-3.1's (and torchtitan's): factor 8, low/high frequency factors 1 and 4, 8192
    /// original positions.
    pub const LLAMA_3_1: Llama3Rope = Llama3Rope {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
}

/// RoPE frequency scaling written to config.json.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    Llama3(Llama3Rope),
    /// YaRN as in torchtitan 0.3.0's gpt-oss and DeepSeek-V3 flavors.
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
        original_max_position_embeddings: u64,
        /// DeepSeek-V3's attention mscale (HF `mscale` and `mscale_all_dim`).
        mscale: Option<f64>,
    },
}

/// gpt-oss arguments a checkpoint does not hold: every torchtitan 0.3.0 flavor (debugmodel, 20b,
/// 120b) uses these, as do the released models.
pub const GPT_OSS_TOP_K: u64 = 4;
pub const GPT_OSS_SLIDING_WINDOW: u64 = 128;
pub const GPT_OSS_YARN: RopeScaling = RopeScaling::Yarn {
    factor: 32.0,
    beta_fast: 32.0,
    beta_slow: 1.0,
    truncate: false,
    original_max_position_embeddings: 4096,
    mscale: None,
};

/// DeepSeek-V3's MLA and MoE layout (read from the shapes) and routing (not in a checkpoint).
#[derive(Debug, Clone, PartialEq)]
pub struct MlaArgs {
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
    /// Leading dense (non-MoE) layers.
    pub first_k_dense: u64,
    pub n_shared_experts: u64,
    /// Multi-token-prediction layers after the main ones.
    pub mtp_layers: u64,
    pub routing: Dsv3Routing,
}

/// A torchtitan DeepSeek-V3 flavor's router and YaRN settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dsv3Routing {
    pub top_k: u64,
    pub n_group: u64,
    pub topk_group: u64,
    pub route_scale: f64,
    pub route_norm: bool,
    pub mscale: f64,
}

/// torchtitan 0.3.0's DeepSeek-V3 flavors by (dim, n_layers): their name and routing.
fn known_dsv3_flavor(dim: u64, n_layers: u64) -> Option<(&'static str, Dsv3Routing)> {
    let r = |top_k, n_group, topk_group, route_scale, route_norm, mscale| Dsv3Routing {
        top_k,
        n_group,
        topk_group,
        route_scale,
        route_norm,
        mscale,
    };
    match (dim, n_layers) {
        (256, 6) => Some(("debugmodel", r(3, 1, 1, 1.0, false, 0.70))),
        (2048, 27) => Some(("16B", r(6, 1, 1, 1.0, false, 0.70))),
        (5120, 60) => Some(("236B", r(6, 8, 3, 16.0, false, 1.0))),
        (7168, 61) => Some(("671B", r(8, 8, 4, 2.5, true, 1.0))),
        _ => None,
    }
}

/// The architecture arguments of a decoder checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelArgs {
    pub family: Family,
    pub dim: u64,
    pub n_layers: u64,
    pub n_heads: u64,
    pub n_kv_heads: u64,
    pub head_dim: u64,
    pub vocab_size: u64,
    /// Dense FFN hidden size (0 when every layer is MoE).
    pub ffn_hidden: u64,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: u64,
    pub tie_word_embeddings: bool,
    pub moe: Option<MoeArgs>,
    /// gpt-oss: causal window of the even layers (the odd ones attend to everything).
    pub sliding_window: Option<u64>,
    /// DeepSeek-V3's attention and MoE layout.
    pub mla: Option<MlaArgs>,
    /// config.json values not in the checkpoint nor given, taken from the family's torchtitan
    /// flavors (`key = value`), for the log.
    pub assumed: Vec<String>,
}

/// n_heads of the torchtitan Llama-3 flavors, by (dim, n_layers).
fn known_llama3_heads(dim: u64, n_layers: u64) -> Option<u64> {
    match (dim, n_layers) {
        (256, 6) => Some(16),      // debugmodel
        (2048, 16) => Some(32),    // 1B
        (3072, 28) => Some(24),    // 3B
        (4096, 32) => Some(32),    // 8B
        (8192, 80) => Some(64),    // 70B
        (16384, 126) => Some(128), // 405B
        _ => None,
    }
}

/// Looks up tensors by their torchtitan names in a plan of either naming.
struct Shapes<'a> {
    plan: &'a CheckpointPlan,
    table: &'a Table,
    naming: Naming,
}

impl Shapes<'_> {
    /// The plan's name for torchtitan name `tt` (trying each generation the table knows).
    fn name(&self, tt: &str) -> Option<String> {
        match self.naming {
            Naming::Torchtitan => {
                if self.plan.tensors.contains_key(tt) {
                    return Some(tt.to_string());
                }
                // The older generation's name for the same HF tensor.
                super::legacy_name(self.table, tt).filter(|n| self.plan.tensors.contains_key(n))
            }
            Naming::Hf => {
                let (rule, caps) = find_tt(self.table, tt)?;
                let hf = super::hf_of(self.table, rule, caps);
                self.plan.tensors.contains_key(&hf).then_some(hf)
            }
        }
    }

    fn get(&self, tt: &str) -> Option<&[u64]> {
        let n = self.name(tt)?;
        self.plan.tensors.get(&n).map(|t| t.shape.as_slice())
    }

    fn need(&self, tt: &str, why: &str) -> Result<&[u64]> {
        self.get(tt).ok_or_else(|| {
            Error::usage(format!(
                "--adapter {}: cannot find `{tt}` (or its {} name) in {}, needed for {why}",
                self.table.family,
                match self.naming {
                    Naming::Torchtitan => "older torchtitan",
                    Naming::Hf => "HF",
                },
                self.plan.root.display()
            ))
        })
    }
}

/// Infers the model arguments of a `table.family` checkpoint named per `naming`.
pub fn infer(
    plan: &CheckpointPlan,
    table: &Table,
    naming: Naming,
    hints: &Hints,
) -> Result<ModelArgs> {
    let s = Shapes {
        plan,
        table,
        naming,
    };
    let emb = s.need("tok_embeddings.weight", "the vocabulary size and model dim")?;
    let (vocab_size, dim) = (emb[0], emb.get(1).copied().unwrap_or(0));
    let n_layers = main_layers(plan, naming, table.hf_layers);
    let hf_layers = table.hf_layers;
    let family = table.family;
    let tie_word_embeddings = match naming {
        Naming::Hf => !plan.tensors.contains_key("lm_head.weight"),
        Naming::Torchtitan => match s.name("lm_head.weight") {
            Some(head) => super::same_contents(plan, "tok_embeddings.weight", &head)?,
            None => true,
        },
    };
    if family == Family::Qwen35 {
        // Its mapping needs only the layers and the tying; its HF config (text and vision
        // models) cannot be written from shapes (`hf_config` says --hf-config).
        return Ok(ModelArgs {
            family,
            dim,
            n_layers,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim: 0,
            vocab_size,
            ffn_hidden: 0,
            norm_eps: hints.norm_eps.unwrap_or(1e-6),
            rope_theta: hints.rope_theta.unwrap_or(10_000_000.0),
            rope_scaling: RopeScaling::None,
            max_position_embeddings: hints.max_position_embeddings.unwrap_or(262_144),
            tie_word_embeddings,
            moe: None,
            sliding_window: None,
            mla: None,
            assumed: Vec::new(),
        });
    }
    let mut assumed = Vec::new();
    let mla = match family {
        Family::DeepseekV3 | Family::KimiK27 => {
            Some(infer_mla(&s, dim, n_layers, hints, &mut assumed)?)
        }
        _ => None,
    };
    let q = match family {
        Family::DeepseekV3 | Family::KimiK27 => None,
        _ => Some(s.need(
            "layers.0.attention.qkv_linear.wq.weight",
            "the attention heads",
        )?),
    };
    let (n_heads, head_dim) = match family {
        Family::Qwen3 => {
            let hd = s.need("layers.0.attention.q_norm.weight", "the head dim")?[0];
            let rows = q.map(|q| q[0]).unwrap_or(0);
            (hints.n_heads.unwrap_or(rows / hd.max(1)), hd)
        }
        // MLA: HF's head_dim is the RoPE part of a head.
        Family::DeepseekV3 | Family::KimiK27 => {
            let m = mla.as_ref().expect("inferred above");
            (m.1, m.0.qk_rope_head_dim)
        }
        // One attention sink per head.
        Family::GptOss => {
            let n = match hints.n_heads {
                Some(n) => n,
                None => s.need("layers.0.attention.sinks", "the attention heads")?[0],
            };
            let rows = q.map(|q| q[0]).unwrap_or(0);
            if n == 0 || rows % n != 0 {
                return Err(Error::usage(format!(
                    "--adapter gpt_oss: {n} heads do not divide the q projection's {rows} rows"
                )));
            }
            (n, rows / n)
        }
        Family::Qwen35 => (0, 0),
        Family::Llama3 => {
            let n = hints
                .n_heads
                .or_else(|| known_llama3_heads(dim, n_layers))
                .ok_or_else(|| {
                    Error::usage(format!(
                        "--adapter llama3: cannot tell the number of attention heads of a model \
                         with dim {dim} and {n_layers} layers (q weight `layers.0.attention.*wq*` \
                         has shape {:?}); not a known torchtitan flavor: pass --n-heads",
                        q.unwrap_or(&[])
                    ))
                })?;
            if n == 0 || dim % n != 0 {
                return Err(Error::usage(format!(
                    "--n-heads {n} does not divide dim {dim}"
                )));
            }
            (n, q.map(|q| q[0] / n).unwrap_or(dim / n))
        }
    };
    let n_kv_heads = match (hints.n_kv_heads, family) {
        (Some(k), _) => k,
        (None, Family::DeepseekV3 | Family::KimiK27) => n_heads,
        (None, _) => {
            s.need(
                "layers.0.attention.qkv_linear.wk.weight",
                "the key/value heads",
            )?[0]
                / head_dim.max(1)
        }
    };
    let ffn_hidden = (0..n_layers)
        .find_map(|l| s.get(&format!("layers.{l}.feed_forward.w1.weight")))
        .map(|w| w[0])
        .unwrap_or(0);
    let moe = (0..n_layers).find_map(|l| {
        if family == Family::GptOss {
            // torchtitan mlp2_weight_EDF [E, D, F]; HF down_proj [E, F, D].
            let w2 = s.get(&format!(
                "layers.{l}.moe.routed_experts.inner_experts.mlp2_weight_EDF"
            ))?;
            let hidden = match naming {
                Naming::Torchtitan => w2.get(2),
                Naming::Hf => w2.get(1),
            };
            return Some(MoeArgs {
                num_experts: w2[0],
                expert_hidden: *hidden?,
                experts_per_token: hints.experts_per_token,
            });
        }
        let w1 = match naming {
            Naming::Torchtitan => s
                .get(&format!(
                    "layers.{l}.moe.routed_experts.inner_experts.w1_EFD"
                ))?
                .to_vec(),
            Naming::Hf => {
                let e0 = plan
                    .tensors
                    .get(&format!("{hf_layers}{l}.mlp.experts.0.gate_proj.weight"))?;
                let count = (0..)
                    .take_while(|e| {
                        plan.tensors.contains_key(&format!(
                            "{hf_layers}{l}.mlp.experts.{e}.gate_proj.weight"
                        ))
                    })
                    .count() as u64;
                vec![count, e0.shape[0], e0.shape[1]]
            }
        };
        Some(MoeArgs {
            num_experts: w1[0],
            expert_hidden: w1[1],
            experts_per_token: hints.experts_per_token,
        })
    });
    let llama3 = if hints.no_rope_scaling {
        RopeScaling::None
    } else {
        RopeScaling::Llama3(Llama3Rope::LLAMA_3_1)
    };
    let (theta, eps, scaling) = match family {
        Family::Llama3 => (500000.0, 1e-5, llama3),
        Family::Qwen35 => (10_000_000.0, 1e-6, RopeScaling::None),
        Family::Qwen3 => (1000000.0, 1e-6, RopeScaling::None),
        Family::DeepseekV3 | Family::KimiK27 => (
            10000.0,
            1e-6,
            RopeScaling::Yarn {
                factor: 40.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: true,
                original_max_position_embeddings: 4096,
                mscale: mla.as_ref().map(|m| m.0.routing.mscale),
            },
        ),
        Family::GptOss => (150000.0, 1e-5, GPT_OSS_YARN),
    };
    let mut moe = moe;
    let mut sliding_window = None;
    if family != Family::Llama3 && family != Family::Qwen3 {
        if !hints.no_rope_scaling {
            let yarn = match family {
                Family::GptOss => "factor 32, beta_fast 32, beta_slow 1, 4096 original positions",
                _ => "factor 40, beta_fast 32, beta_slow 1, 4096 original positions",
            };
            assumed.push(format!(
                "rope_scaling = yarn ({yarn}; --no-rope-scaling for none)"
            ));
        }
        if hints.rope_theta.is_none() {
            assumed.push(format!("rope_theta = {theta}"));
        }
    }
    if family == Family::GptOss {
        if let Some(m) = moe.as_mut().filter(|m| m.experts_per_token.is_none()) {
            m.experts_per_token = Some(GPT_OSS_TOP_K);
            assumed.push(format!("num_experts_per_tok = {GPT_OSS_TOP_K}"));
        }
        sliding_window = Some(GPT_OSS_SLIDING_WINDOW);
        assumed.push(format!(
            "sliding_window = {GPT_OSS_SLIDING_WINDOW} (even layers)"
        ));
    }
    let scaling = match scaling {
        RopeScaling::Yarn { .. } if hints.no_rope_scaling => RopeScaling::None,
        other => other,
    };
    Ok(ModelArgs {
        family,
        dim,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size,
        ffn_hidden,
        norm_eps: hints.norm_eps.unwrap_or(eps),
        rope_theta: hints.rope_theta.unwrap_or(theta),
        rope_scaling: scaling,
        max_position_embeddings: hints.max_position_embeddings.unwrap_or(131072),
        tie_word_embeddings,
        moe,
        sliding_window,
        mla: mla.map(|m| m.0),
        assumed,
    })
}

/// DeepSeek-V3's MLA layout from the shapes: `kv_norm` [kv_lora], `wkv_a` [kv_lora + rope, D],
/// q (`wq`, or `wq_b` after `wq_a`/`q_norm` [q_lora]) [n (nope + rope), ..], `wkv_b`
/// [n (nope + v), kv_lora], `wo` [D, n v]; so n rope = q - wkv_b + wo. Returns it with the head
/// count; the routing comes from the torchtitan flavor of the same dim and depth, else the
/// debugmodel's (noted in `assumed`).
fn infer_mla(
    s: &Shapes,
    dim: u64,
    n_layers: u64,
    hints: &Hints,
    assumed: &mut Vec<String>,
) -> Result<(MlaArgs, u64)> {
    let bad = |what: String| {
        Error::usage(format!(
            "--adapter deepseek_v3: {what} in {}: not an MLA layout",
            s.plan.root.display()
        ))
    };
    let kv_lora = s.need("layers.0.attention.kv_norm.weight", "kv_lora_rank")?[0];
    let wkv_a = s.need("layers.0.attention.wkv_a.weight", "qk_rope_head_dim")?[0];
    let rope = wkv_a
        .checked_sub(kv_lora)
        .filter(|r| *r > 0)
        .ok_or_else(|| {
            bad(format!(
                "wkv_a has {wkv_a} rows for a kv_lora_rank of {kv_lora}"
            ))
        })?;
    let q_lora = s.get("layers.0.attention.q_norm.weight").map(|q| q[0]);
    let q = match q_lora {
        Some(_) => s.need("layers.0.attention.wq_b.weight", "the heads")?[0],
        None => s.need("layers.0.attention.wq.weight", "the heads")?[0],
    };
    let kv_b = s.need("layers.0.attention.wkv_b.weight", "the heads")?[0];
    let wo = s.need("layers.0.attention.wo.weight", "v_head_dim")?;
    let o = wo.get(1).copied().unwrap_or(0);
    let n = match hints.n_heads {
        Some(n) => n,
        None => (q + o)
            .checked_sub(kv_b)
            .filter(|x| x % rope == 0)
            .map(|x| x / rope)
            .ok_or_else(|| bad(format!("q {q}, wkv_b {kv_b}, wo {o} rows/cols")))?,
    };
    if n == 0 || q % n != 0 || o % n != 0 || q / n < rope {
        return Err(bad(format!(
            "{n} heads do not divide q's {q} rows and wo's {o} columns"
        )));
    }
    let (v, nope) = (o / n, q / n - rope);
    if kv_b != n * (nope + v) {
        return Err(bad(format!(
            "wkv_b has {kv_b} rows, not {n} heads x ({nope} + {v})"
        )));
    }
    let first_k_dense = (0..n_layers)
        .take_while(|l| {
            s.get(&format!("layers.{l}.feed_forward.w1.weight"))
                .is_some()
        })
        .count() as u64;
    let moe_hidden = s
        .get(&format!(
            "layers.{first_k_dense}.moe.routed_experts.inner_experts.w1_EFD"
        ))
        .map(|w| w[1]);
    let moe_hidden = match (moe_hidden, s.naming) {
        (Some(f), _) => Some(f),
        (None, Naming::Hf) => s
            .plan
            .tensors
            .get(&format!(
                "{}{first_k_dense}.mlp.experts.0.gate_proj.weight",
                s.table.hf_layers
            ))
            .map(|t| t.shape[0]),
        (None, Naming::Torchtitan) => None,
    };
    let n_shared_experts = match (
        s.get(&format!(
            "layers.{first_k_dense}.moe.shared_experts.w1.weight"
        )),
        moe_hidden,
    ) {
        (Some(w), Some(f)) if f > 0 => w[0] / f,
        _ => 0,
    };
    let mtp_layers = match s.naming {
        Naming::Torchtitan => s
            .plan
            .tensors
            .keys()
            .filter_map(|k| super::tt_layer(k, "mtp_layers."))
            .collect::<std::collections::BTreeSet<_>>()
            .len() as u64,
        Naming::Hf => {
            s.plan
                .tensors
                .keys()
                .filter_map(|k| super::tt_layer(k, s.table.hf_layers))
                .collect::<std::collections::BTreeSet<_>>()
                .len() as u64
                - n_layers
        }
    };
    let routing = match known_dsv3_flavor(dim, n_layers) {
        Some((_, r)) => r,
        None => {
            let (_, r) = known_dsv3_flavor(256, 6).expect("debugmodel");
            if hints.experts_per_token.is_none() {
                assumed.push(format!(
                    "num_experts_per_tok = {} (debugmodel's; --experts-per-token to set)",
                    r.top_k
                ));
            }
            assumed.push(format!(
                "n_group = {}, topk_group = {}, routed_scaling_factor = {}, norm_topk_prob = {} \
                 (debugmodel's: dim {dim} x {n_layers} layers is no torchtitan flavor)",
                r.n_group, r.topk_group, r.route_scale, r.route_norm
            ));
            r
        }
    };
    let routing = Dsv3Routing {
        top_k: hints.experts_per_token.unwrap_or(routing.top_k),
        ..routing
    };
    Ok((
        MlaArgs {
            q_lora_rank: q_lora,
            kv_lora_rank: kv_lora,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rope,
            v_head_dim: v,
            first_k_dense,
            n_shared_experts,
            mtp_layers,
            routing,
        },
        n,
    ))
}

/// The RoPE settings in both spellings: transformers 4 reads `rope_theta` + `rope_scaling`,
/// transformers 5 reads `rope_parameters` (and ignores the old keys' absence silently, as 4 does
/// the new one's: writing both is what makes one file right for both).
fn rope_keys(args: &ModelArgs) -> [(&'static str, Value); 3] {
    let params = match args.rope_scaling {
        RopeScaling::Llama3(r) => json!({
            "rope_type": "llama3",
            "rope_theta": args.rope_theta,
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        }),
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            truncate,
            original_max_position_embeddings,
            mscale,
        } => {
            let mut p = json!({
                "rope_type": "yarn",
                "rope_theta": args.rope_theta,
                "factor": factor,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "truncate": truncate,
                "original_max_position_embeddings": original_max_position_embeddings,
            });
            if let Some(m) = mscale {
                // torchtitan scales the softmax by the YaRN mscale squared, as HF does with
                // mscale_all_dim; equal mscale leaves HF's cos/sin unscaled, as torchtitan's.
                p["mscale"] = json!(m);
                p["mscale_all_dim"] = json!(m);
            }
            p
        }
        RopeScaling::None => json!({ "rope_type": "default", "rope_theta": args.rope_theta }),
    };
    // transformers 4 warns about `rope_theta` inside `rope_scaling`: it lives at the top there.
    let scaling = match (&params, args.rope_scaling != RopeScaling::None) {
        (Value::Object(p), true) => {
            let mut p = p.clone();
            p.remove("rope_theta");
            Value::Object(p)
        }
        _ => Value::Null,
    };
    [
        ("rope_theta", json!(args.rope_theta)),
        ("rope_scaling", scaling),
        ("rope_parameters", params),
    ]
}

/// HF `config.json` for the family's transformers class; None for families whose arguments
/// cannot be inferred from shapes (pass `--hf-config`). The one writer of config.json:
/// titan-ckpt's conversions and titan-train's HF export both use it.
pub fn hf_config(args: &ModelArgs, dtype: Dtype) -> Result<Option<Value>> {
    let mut v = json!({
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "tie_word_embeddings": args.tie_word_embeddings,
        "torch_dtype": dtype.torch_name(),
        "dtype": dtype.torch_name(),
    });
    let o = v.as_object_mut().expect("object");
    for (k, val) in rope_keys(args) {
        o.insert(k.into(), val);
    }
    match (args.family, &args.moe) {
        (Family::Llama3, _) => {
            o.insert("architectures".into(), json!(["LlamaForCausalLM"]));
            o.insert("model_type".into(), json!("llama"));
            o.insert("intermediate_size".into(), json!(args.ffn_hidden));
            o.insert("mlp_bias".into(), json!(false));
        }
        (Family::Qwen3, None) => {
            o.insert("architectures".into(), json!(["Qwen3ForCausalLM"]));
            o.insert("model_type".into(), json!("qwen3"));
            o.insert("intermediate_size".into(), json!(args.ffn_hidden));
        }
        (Family::Qwen3, Some(m)) => {
            let k = m.experts_per_token.ok_or_else(|| {
                Error::usage(
                    "--adapter qwen3: the number of experts per token is not in the checkpoint: \
                     pass --experts-per-token (or --hf-config)",
                )
            })?;
            o.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
            o.insert("model_type".into(), json!("qwen3_moe"));
            o.insert(
                "intermediate_size".into(),
                json!(args.ffn_hidden.max(m.expert_hidden)),
            );
            o.insert("moe_intermediate_size".into(), json!(m.expert_hidden));
            o.insert("num_experts".into(), json!(m.num_experts));
            o.insert("num_experts_per_tok".into(), json!(k));
            o.insert("decoder_sparse_step".into(), json!(1));
            o.insert("mlp_only_layers".into(), json!([]));
            o.insert("norm_topk_prob".into(), json!(true));
        }
        (Family::GptOss, moe) => {
            let m = moe.as_ref().ok_or_else(|| {
                Error::usage(
                    "--adapter gpt_oss: no expert weights (`mlp2_weight_EDF` / `down_proj`) found",
                )
            })?;
            o.insert("architectures".into(), json!(["GptOssForCausalLM"]));
            o.insert("model_type".into(), json!("gpt_oss"));
            o.insert("attention_bias".into(), json!(true));
            o.insert("intermediate_size".into(), json!(m.expert_hidden));
            o.insert("num_local_experts".into(), json!(m.num_experts));
            o.insert(
                "num_experts_per_tok".into(),
                json!(m.experts_per_token.unwrap_or(GPT_OSS_TOP_K)),
            );
            // torchtitan: sliding window on layers 0, 2, 4, ...; HF reads layer_types.
            let window = args.sliding_window.unwrap_or(GPT_OSS_SLIDING_WINDOW);
            o.insert("sliding_window".into(), json!(window));
            let types: Vec<&str> = (0..args.n_layers)
                .map(|l| {
                    if l % 2 == 0 {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            o.insert("layer_types".into(), json!(types));
            // torchtitan's swiglu: alpha 1.702, clamp 7.0.
            o.insert("swiglu_limit".into(), json!(7.0));
            o.insert("swiglu_alpha".into(), json!(1.702));
        }
        // Kimi K2.7's HF class is remote code with its own vision config: --hf-config.
        (Family::KimiK27 | Family::Qwen35, _) => return Ok(None),
        (Family::DeepseekV3, moe) => {
            let (Some(m), Some(moe)) = (&args.mla, moe) else {
                return Ok(None);
            };
            let r = m.routing;
            o.insert("architectures".into(), json!(["DeepseekV3ForCausalLM"]));
            o.insert("model_type".into(), json!("deepseek_v3"));
            o.insert("intermediate_size".into(), json!(args.ffn_hidden));
            o.insert("moe_intermediate_size".into(), json!(moe.expert_hidden));
            o.insert("n_routed_experts".into(), json!(moe.num_experts));
            o.insert("n_shared_experts".into(), json!(m.n_shared_experts));
            o.insert("num_experts_per_tok".into(), json!(r.top_k));
            o.insert("first_k_dense_replace".into(), json!(m.first_k_dense));
            o.insert("n_group".into(), json!(r.n_group));
            o.insert("topk_group".into(), json!(r.topk_group));
            o.insert("routed_scaling_factor".into(), json!(r.route_scale));
            o.insert("norm_topk_prob".into(), json!(r.route_norm));
            o.insert("q_lora_rank".into(), json!(m.q_lora_rank));
            o.insert("kv_lora_rank".into(), json!(m.kv_lora_rank));
            o.insert("qk_nope_head_dim".into(), json!(m.qk_nope_head_dim));
            o.insert("qk_rope_head_dim".into(), json!(m.qk_rope_head_dim));
            o.insert("v_head_dim".into(), json!(m.v_head_dim));
            // transformers 4 reads num_nextn_predict_layers, 5 num_mtp_layers.
            o.insert("num_nextn_predict_layers".into(), json!(m.mtp_layers));
            o.insert("num_mtp_layers".into(), json!(m.mtp_layers));
            // torchtitan's complex RoPE pairs adjacent dims, as HF's rope_interleave.
            o.insert("rope_interleave".into(), json!(true));
        }
    }
    Ok(Some(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama3(rope_scaling: RopeScaling) -> ModelArgs {
        ModelArgs {
            family: Family::Llama3,
            dim: 256,
            n_layers: 2,
            n_heads: 16,
            n_kv_heads: 4,
            head_dim: 16,
            vocab_size: 2048,
            ffn_hidden: 768,
            norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling,
            max_position_embeddings: 8192,
            tie_word_embeddings: false,
            moe: None,
            sliding_window: None,
            mla: None,
            assumed: Vec::new(),
        }
    }

    /// transformers 4 reads `rope_theta` at the top and the scaling from `rope_scaling` (it
    /// warns about a `rope_theta` inside it); transformers 5 reads `rope_parameters`, theta
    /// included. Both load the same file (tests/tests/ckpt_torchtitan.rs and
    /// trainer/tests/ckpt_torch_interop.rs check with each version).
    #[test]
    fn llama3_rope_keys_for_transformers_4_and_5() {
        let rope = Llama3Rope {
            factor: 16.0,
            ..Llama3Rope::LLAMA_3_1
        };
        let cfg = hf_config(&llama3(RopeScaling::Llama3(rope)), Dtype::BF16)
            .unwrap()
            .unwrap();
        assert_eq!(cfg["rope_theta"], 500000.0);
        assert_eq!(
            cfg["rope_scaling"],
            json!({
                "rope_type": "llama3",
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            })
        );
        assert_eq!(cfg["rope_parameters"]["rope_theta"], 500000.0);
        assert_eq!(cfg["rope_parameters"]["factor"], 16.0);
        assert_eq!(cfg["torch_dtype"], "bfloat16");
        assert_eq!(cfg["architectures"], json!(["LlamaForCausalLM"]));

        let plain = hf_config(&llama3(RopeScaling::None), Dtype::F32)
            .unwrap()
            .unwrap();
        assert_eq!(plain["rope_scaling"], Value::Null);
        assert_eq!(
            plain["rope_parameters"],
            json!({"rope_type": "default", "rope_theta": 500000.0})
        );
    }
}
