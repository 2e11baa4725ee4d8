//! One table per model family: torchtitan 0.3.0 name <-> HF name, and what happens to the
//! tensor on the way. Read from each family's `torchtitan/models/<family>/state_dict_adapter.py`
//! (0.3.0) and the transformers model classes; adding a family means adding a table here.

use super::Family;

/// What a tensor goes through between torchtitan and HF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    /// Same bytes, new name.
    Copy,
    /// q weight: torchtitan's interleaved (complex) RoPE rows <-> HF's rotate-half rows.
    RopeQ,
    /// k weight: as [`Transform::RopeQ`] with the key/value heads.
    RopeK,
    /// torchtitan stacks all experts in one `[E, ...]` tensor; HF has one tensor per expert
    /// (`{E}` in the HF pattern).
    Experts,
    /// Stacked in both, each expert's matrix transposed: torchtitan `[E, out, in]` <-> HF
    /// `[E, in, out]` (gpt-oss).
    TransposedExperts,
    /// One of `of` equal blocks of rows of a fused HF tensor, block `index` (a vision encoder's
    /// `wqkv`: torchtitan keeps `wq`, `wk`, `wv`); the rules of one HF tensor share its pattern.
    Part { index: u64, of: u64 },
    /// Routed experts' gate (`index` 0) or up (1) projections `[E, F, D]`, which HF fuses into one
    /// `[E, D, 2F]`: each transposed per expert, gate's columns then up's (Qwen3.5's
    /// `gate_up_proj`).
    GateUp { index: u64 },
    /// One of the q, k, v parts (`index` 0, 1, 2) of a GatedDeltaNet's fused HF tensor (Qwen3.5's
    /// `in_proj_qkv`, `conv1d`): rows k, k, v, where v is the rows of the layer's `in_proj_z`.
    GdnPart { index: u64 },
    /// A patch embedding: torchtitan's Linear `[out, C T k k]` <-> HF's Conv2d `[out, C, k, k]`
    /// (`temporal` 1) or Conv3d `[out, C, T, k, k]` of `channels` = C input channels (same bytes,
    /// another shape).
    PatchEmbed { channels: u64, temporal: u64 },
}

/// One name pair.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub tt: &'static str,
    pub hf: &'static str,
    pub transform: Transform,
}

const fn r(tt: &'static str, hf: &'static str, transform: Transform) -> Rule {
    Rule { tt, hf, transform }
}

/// A family's names.
#[derive(Debug)]
pub struct Table {
    pub family: Family,
    /// torchtitan 0.3.0's names (written by default), in groups shared between families.
    pub rules: &'static [&'static [Rule]],
    /// What HF puts before the names of `rules` and `legacy` (Kimi nests its DeepSeek-V3 text
    /// model under `language_model.`).
    pub hf_prefix: &'static str,
    /// What HF layer names start with (`model.layers.`), before the layer index.
    pub hf_layers: &'static str,
    /// Rules whose HF names take no `hf_prefix` (a vision encoder beside the text model).
    pub unprefixed: &'static [Rule],
    /// Names older torchtitan releases wrote (read always, written with `--tt-names legacy`
    /// in place of the current rule with the same HF name).
    pub legacy: &'static [Rule],
    /// torchtitan tensors with no HF counterpart, and why (dropped with a warning).
    pub no_hf_home: &'static [(&'static str, &'static str)],
    /// HF tensors with no torchtitan counterpart (skipped silently: derived buffers).
    pub hf_ignored: &'static [&'static str],
    /// HF weights torchtitan's model has no place for, and why (dropped with a warning).
    pub hf_dropped: &'static [(&'static str, &'static str)],
    /// `mtp_layers.{M}.*` are HF's `model.layers.{n_layers + M}.*` (DeepSeek-V3 MTP).
    pub mtp_layers: bool,
    /// torchtitan tensors that identify this family (any one suffices), for `--adapter auto`.
    pub signature: &'static [&'static str],
}

use Transform::*;

// Rule groups several families share; a table lists the groups it has.

const TOP: &[Rule] = &[
    r("tok_embeddings.weight", "model.embed_tokens.weight", Copy),
    r("norm.weight", "model.norm.weight", Copy),
    r("lm_head.weight", "lm_head.weight", Copy),
];

const GQA_ROPE_PERMUTED: &[Rule] = &[
    r(
        "layers.{L}.attention.qkv_linear.wq.weight",
        "model.layers.{L}.self_attn.q_proj.weight",
        RopeQ,
    ),
    r(
        "layers.{L}.attention.qkv_linear.wk.weight",
        "model.layers.{L}.self_attn.k_proj.weight",
        RopeK,
    ),
    r(
        "layers.{L}.attention.qkv_linear.wv.weight",
        "model.layers.{L}.self_attn.v_proj.weight",
        Copy,
    ),
];

const GQA: &[Rule] = &[
    r(
        "layers.{L}.attention.qkv_linear.wq.weight",
        "model.layers.{L}.self_attn.q_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.qkv_linear.wk.weight",
        "model.layers.{L}.self_attn.k_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.qkv_linear.wv.weight",
        "model.layers.{L}.self_attn.v_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.q_norm.weight",
        "model.layers.{L}.self_attn.q_norm.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.k_norm.weight",
        "model.layers.{L}.self_attn.k_norm.weight",
        Copy,
    ),
];

const MLA: &[Rule] = &[
    r(
        "layers.{L}.attention.wq.weight",
        "model.layers.{L}.self_attn.q_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.wq_a.weight",
        "model.layers.{L}.self_attn.q_a_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.q_norm.weight",
        "model.layers.{L}.self_attn.q_a_layernorm.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.wq_b.weight",
        "model.layers.{L}.self_attn.q_b_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.wkv_a.weight",
        "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.kv_norm.weight",
        "model.layers.{L}.self_attn.kv_a_layernorm.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.wkv_b.weight",
        "model.layers.{L}.self_attn.kv_b_proj.weight",
        Copy,
    ),
];

/// Output projection, dense FFN and the two norms of a decoder layer.
const BLOCK: &[Rule] = &[
    r(
        "layers.{L}.attention.wo.weight",
        "model.layers.{L}.self_attn.o_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.feed_forward.w1.weight",
        "model.layers.{L}.mlp.gate_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.feed_forward.w3.weight",
        "model.layers.{L}.mlp.up_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.feed_forward.w2.weight",
        "model.layers.{L}.mlp.down_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention_norm.weight",
        "model.layers.{L}.input_layernorm.weight",
        Copy,
    ),
    r(
        "layers.{L}.ffn_norm.weight",
        "model.layers.{L}.post_attention_layernorm.weight",
        Copy,
    ),
];

const ROUTED_EXPERTS: &[Rule] = &[
    r(
        "layers.{L}.moe.routed_experts.inner_experts.w1_EFD",
        "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
        Experts,
    ),
    r(
        "layers.{L}.moe.routed_experts.inner_experts.w3_EFD",
        "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
        Experts,
    ),
    r(
        "layers.{L}.moe.routed_experts.inner_experts.w2_EDF",
        "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
        Experts,
    ),
    r(
        "layers.{L}.moe.router.gate.weight",
        "model.layers.{L}.mlp.gate.weight",
        Copy,
    ),
];

const SHARED_EXPERTS_AND_MTP: &[Rule] = &[
    r(
        "layers.{L}.moe.shared_experts.w1.weight",
        "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.shared_experts.w3.weight",
        "model.layers.{L}.mlp.shared_experts.up_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.shared_experts.w2.weight",
        "model.layers.{L}.mlp.shared_experts.down_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.expert_bias_E",
        "model.layers.{L}.mlp.gate.e_score_correction_bias",
        Copy,
    ),
    r(
        "layers.{L}.enorm.weight",
        "model.layers.{L}.enorm.weight",
        Copy,
    ),
    r(
        "layers.{L}.hnorm.weight",
        "model.layers.{L}.hnorm.weight",
        Copy,
    ),
    r(
        "layers.{L}.eh_proj.weight",
        "model.layers.{L}.eh_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.mtp_norm.weight",
        "model.layers.{L}.shared_head.norm.weight",
        Copy,
    ),
];

/// gpt-oss attention: biased q/k/v/o projections and per-head sinks (no RoPE permutation:
/// torchtitan's gpt-oss uses rotate-half RoPE like HF).
const GPT_OSS_ATTENTION: &[Rule] = &[
    r(
        "layers.{L}.attention.qkv_linear.wq.weight",
        "model.layers.{L}.self_attn.q_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.qkv_linear.wq.bias",
        "model.layers.{L}.self_attn.q_proj.bias",
        Copy,
    ),
    r(
        "layers.{L}.attention.qkv_linear.wk.weight",
        "model.layers.{L}.self_attn.k_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.qkv_linear.wk.bias",
        "model.layers.{L}.self_attn.k_proj.bias",
        Copy,
    ),
    r(
        "layers.{L}.attention.qkv_linear.wv.weight",
        "model.layers.{L}.self_attn.v_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention.qkv_linear.wv.bias",
        "model.layers.{L}.self_attn.v_proj.bias",
        Copy,
    ),
    r(
        "layers.{L}.attention.wo.bias",
        "model.layers.{L}.self_attn.o_proj.bias",
        Copy,
    ),
    r(
        "layers.{L}.attention.sinks",
        "model.layers.{L}.self_attn.sinks",
        Copy,
    ),
];

/// gpt-oss experts: stacked on both sides, gate/up interleaved in the same order (gate in the
/// even rows of torchtitan's `mlp1_weight_EGD`, in the even columns of HF's `gate_up_proj`), so
/// the weights are transposed per expert and the biases copied. torchtitan 0.3.0's own adapter
/// looks for `mlp1_weight` etc. and drops all four.
const GPT_OSS_EXPERTS: &[Rule] = &[
    r(
        "layers.{L}.moe.routed_experts.inner_experts.mlp1_weight_EGD",
        "model.layers.{L}.mlp.experts.gate_up_proj",
        TransposedExperts,
    ),
    r(
        "layers.{L}.moe.routed_experts.inner_experts.mlp1_bias_EG",
        "model.layers.{L}.mlp.experts.gate_up_proj_bias",
        Copy,
    ),
    r(
        "layers.{L}.moe.routed_experts.inner_experts.mlp2_weight_EDF",
        "model.layers.{L}.mlp.experts.down_proj",
        TransposedExperts,
    ),
    r(
        "layers.{L}.moe.routed_experts.inner_experts.mlp2_bias_ED",
        "model.layers.{L}.mlp.experts.down_proj_bias",
        Copy,
    ),
    r(
        "layers.{L}.moe.router.gate.weight",
        "model.layers.{L}.mlp.router.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.router.gate.bias",
        "model.layers.{L}.mlp.router.bias",
        Copy,
    ),
];

const ROTARY_INV_FREQ: &[&str] = &["model.layers.{L}.self_attn.rotary_emb.inv_freq"];

pub static LLAMA3: Table = Table {
    family: Family::Llama3,
    rules: &[TOP, GQA_ROPE_PERMUTED, BLOCK],
    hf_prefix: "",
    hf_layers: "model.layers.",
    unprefixed: &[],
    legacy: &[
        r("output.weight", "lm_head.weight", Copy),
        r(
            "layers.{L}.attention.wq.weight",
            "model.layers.{L}.self_attn.q_proj.weight",
            RopeQ,
        ),
        r(
            "layers.{L}.attention.wk.weight",
            "model.layers.{L}.self_attn.k_proj.weight",
            RopeK,
        ),
        r(
            "layers.{L}.attention.wv.weight",
            "model.layers.{L}.self_attn.v_proj.weight",
            Copy,
        ),
    ],
    no_hf_home: &[],
    hf_ignored: ROTARY_INV_FREQ,
    hf_dropped: &[],
    mtp_layers: false,
    signature: &[],
};

pub static QWEN3: Table = Table {
    family: Family::Qwen3,
    rules: &[TOP, GQA, BLOCK, ROUTED_EXPERTS],
    hf_prefix: "",
    hf_layers: "model.layers.",
    unprefixed: &[],
    legacy: &[],
    no_hf_home: &[(
        "layers.{L}.moe.expert_bias_E",
        "Qwen3MoeForCausalLM has no expert-bias (load balancing) tensor",
    )],
    hf_ignored: ROTARY_INV_FREQ,
    hf_dropped: &[],
    mtp_layers: false,
    signature: &["layers.0.attention.q_norm.weight"],
};

/// The released DeepSeek-V3/R1 and Kimi-K2 checkpoints give each MTP layer its own copy of the
/// embedding and the output head; torchtitan 0.3.0's MTP layers use the main model's (its
/// `from_hf` raises a KeyError on them).
const DSV3_MTP_COPIES: &[(&str, &str)] = &[
    (
        "model.layers.{L}.embed_tokens.weight",
        "an MTP layer's copy of the embedding: torchtitan's MTP layers use tok_embeddings.weight",
    ),
    (
        "model.layers.{L}.shared_head.head.weight",
        "an MTP layer's copy of the output head: torchtitan's MTP layers use lm_head.weight",
    ),
];

pub static DEEPSEEK_V3: Table = Table {
    family: Family::DeepseekV3,
    rules: &[TOP, MLA, BLOCK, ROUTED_EXPERTS, SHARED_EXPERTS_AND_MTP],
    hf_prefix: "",
    hf_layers: "model.layers.",
    unprefixed: &[],
    legacy: &[],
    no_hf_home: &[],
    hf_ignored: ROTARY_INV_FREQ,
    hf_dropped: DSV3_MTP_COPIES,
    mtp_layers: true,
    signature: &["layers.0.attention.wkv_a.weight"],
};

pub static GPT_OSS: Table = Table {
    family: Family::GptOss,
    rules: &[TOP, GPT_OSS_ATTENTION, BLOCK, GPT_OSS_EXPERTS],
    hf_prefix: "",
    hf_layers: "model.layers.",
    unprefixed: &[],
    legacy: &[],
    no_hf_home: &[(
        "layers.{L}.moe.expert_bias_E",
        "GptOssForCausalLM has no expert-bias (load balancing) tensor",
    )],
    hf_ignored: ROTARY_INV_FREQ,
    hf_dropped: &[],
    mtp_layers: false,
    signature: &["layers.0.attention.sinks"],
};

/// MoonViT (Kimi K2.5/K2.7's vision encoder) and its projector, as torchtitan 0.3.0's
/// `kimi_k2_7/state_dict_adapter.py` maps them: pre-attention/pre-MLP norms `norm0`/`norm1` are
/// torchtitan's `norm1`/`norm2`, the fused `wqkv` is split in three, the Conv2d patch embedding is
/// a Linear. The Kimi-VL projector spelling (`multi_modal_projector.linear_1/2`) is read too;
/// the K2.5 one (`mm_projector.proj.0/2`) is written.
const KIMI_VISION: &[Rule] = &[
    r(
        "vision_encoder.patch_embed.weight",
        "vision_tower.patch_embed.proj.weight",
        PatchEmbed {
            channels: 3,
            temporal: 1,
        },
    ),
    r(
        "vision_encoder.patch_embed.bias",
        "vision_tower.patch_embed.proj.bias",
        Copy,
    ),
    r(
        "vision_encoder.pos_embed",
        "vision_tower.patch_embed.pos_emb.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.norm1.weight",
        "vision_tower.encoder.blocks.{L}.norm0.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.norm1.bias",
        "vision_tower.encoder.blocks.{L}.norm0.bias",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.norm2.weight",
        "vision_tower.encoder.blocks.{L}.norm1.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.norm2.bias",
        "vision_tower.encoder.blocks.{L}.norm1.bias",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.attn.wq.weight",
        "vision_tower.encoder.blocks.{L}.wqkv.weight",
        Part { index: 0, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wk.weight",
        "vision_tower.encoder.blocks.{L}.wqkv.weight",
        Part { index: 1, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wv.weight",
        "vision_tower.encoder.blocks.{L}.wqkv.weight",
        Part { index: 2, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wq.bias",
        "vision_tower.encoder.blocks.{L}.wqkv.bias",
        Part { index: 0, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wk.bias",
        "vision_tower.encoder.blocks.{L}.wqkv.bias",
        Part { index: 1, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wv.bias",
        "vision_tower.encoder.blocks.{L}.wqkv.bias",
        Part { index: 2, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.proj.weight",
        "vision_tower.encoder.blocks.{L}.wo.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.attn.proj.bias",
        "vision_tower.encoder.blocks.{L}.wo.bias",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.mlp.linear_fc1.weight",
        "vision_tower.encoder.blocks.{L}.mlp.fc0.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.mlp.linear_fc1.bias",
        "vision_tower.encoder.blocks.{L}.mlp.fc0.bias",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.mlp.linear_fc2.weight",
        "vision_tower.encoder.blocks.{L}.mlp.fc1.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.mlp.linear_fc2.bias",
        "vision_tower.encoder.blocks.{L}.mlp.fc1.bias",
        Copy,
    ),
    r(
        "vision_encoder.final_norm.weight",
        "vision_tower.encoder.final_layernorm.weight",
        Copy,
    ),
    r(
        "vision_encoder.final_norm.bias",
        "vision_tower.encoder.final_layernorm.bias",
        Copy,
    ),
    r(
        "vision_encoder.projector.pre_norm.weight",
        "mm_projector.pre_norm.weight",
        Copy,
    ),
    r(
        "vision_encoder.projector.pre_norm.bias",
        "mm_projector.pre_norm.bias",
        Copy,
    ),
    r(
        "vision_encoder.projector.linear_1.weight",
        "mm_projector.proj.0.weight",
        Copy,
    ),
    r(
        "vision_encoder.projector.linear_1.bias",
        "mm_projector.proj.0.bias",
        Copy,
    ),
    r(
        "vision_encoder.projector.linear_2.weight",
        "mm_projector.proj.2.weight",
        Copy,
    ),
    r(
        "vision_encoder.projector.linear_2.bias",
        "mm_projector.proj.2.bias",
        Copy,
    ),
    // Read only: find_tt takes the first rule of a torchtitan name, the K2.5 spelling above.
    r(
        "vision_encoder.projector.pre_norm.weight",
        "multi_modal_projector.pre_norm.weight",
        Copy,
    ),
    r(
        "vision_encoder.projector.pre_norm.bias",
        "multi_modal_projector.pre_norm.bias",
        Copy,
    ),
    r(
        "vision_encoder.projector.linear_1.weight",
        "multi_modal_projector.linear_1.weight",
        Copy,
    ),
    r(
        "vision_encoder.projector.linear_1.bias",
        "multi_modal_projector.linear_1.bias",
        Copy,
    ),
    r(
        "vision_encoder.projector.linear_2.weight",
        "multi_modal_projector.linear_2.weight",
        Copy,
    ),
    r(
        "vision_encoder.projector.linear_2.bias",
        "multi_modal_projector.linear_2.bias",
        Copy,
    ),
];

pub static KIMI_K2_7: Table = Table {
    family: Family::KimiK27,
    rules: &[TOP, MLA, BLOCK, ROUTED_EXPERTS, SHARED_EXPERTS_AND_MTP],
    hf_prefix: "language_model.",
    hf_layers: "language_model.model.layers.",
    unprefixed: KIMI_VISION,
    legacy: &[],
    no_hf_home: &[],
    hf_ignored: &[
        "language_model.model.layers.{L}.self_attn.rotary_emb.inv_freq",
        "vision_tower.encoder.blocks.{L}.rotary_emb.inv_freq",
    ],
    hf_dropped: &[
        (
            "language_model.model.layers.{L}.embed_tokens.weight",
            "an MTP layer's copy of the embedding: torchtitan's MTP layers use tok_embeddings.weight",
        ),
        (
            "language_model.model.layers.{L}.shared_head.head.weight",
            "an MTP layer's copy of the output head: torchtitan's MTP layers use lm_head.weight",
        ),
    ],
    mtp_layers: true,
    // The vision encoder (torchtitan) or the `language_model.` nesting (HF): a Kimi checkpoint
    // without either is a DeepSeek-V3 one.
    signature: &[
        "vision_encoder.patch_embed.weight",
        "language_model.model.embed_tokens.weight",
    ],
};

/// Qwen3.5's text model under `model.language_model.` (HF names relative to it): full attention
/// layers (gated q: `wq` holds twice the heads' rows) and GatedDeltaNet layers, whose fused
/// `in_proj_qkv` / `conv1d` torchtitan keeps as q, k, v.
const QWEN3_5_TEXT: &[Rule] = &[
    r("tok_embeddings.weight", "embed_tokens.weight", Copy),
    r("norm.weight", "norm.weight", Copy),
    r(
        "layers.{L}.attn.wq.weight",
        "layers.{L}.self_attn.q_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.wk.weight",
        "layers.{L}.self_attn.k_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.wv.weight",
        "layers.{L}.self_attn.v_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.wo.weight",
        "layers.{L}.self_attn.o_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.q_norm.weight",
        "layers.{L}.self_attn.q_norm.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.k_norm.weight",
        "layers.{L}.self_attn.k_norm.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.in_proj_q.weight",
        "layers.{L}.linear_attn.in_proj_qkv.weight",
        GdnPart { index: 0 },
    ),
    r(
        "layers.{L}.attn.in_proj_k.weight",
        "layers.{L}.linear_attn.in_proj_qkv.weight",
        GdnPart { index: 1 },
    ),
    r(
        "layers.{L}.attn.in_proj_v.weight",
        "layers.{L}.linear_attn.in_proj_qkv.weight",
        GdnPart { index: 2 },
    ),
    r(
        "layers.{L}.attn.conv_q.weight",
        "layers.{L}.linear_attn.conv1d.weight",
        GdnPart { index: 0 },
    ),
    r(
        "layers.{L}.attn.conv_k.weight",
        "layers.{L}.linear_attn.conv1d.weight",
        GdnPart { index: 1 },
    ),
    r(
        "layers.{L}.attn.conv_v.weight",
        "layers.{L}.linear_attn.conv1d.weight",
        GdnPart { index: 2 },
    ),
    r(
        "layers.{L}.attn.in_proj_z.weight",
        "layers.{L}.linear_attn.in_proj_z.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.in_proj_a.weight",
        "layers.{L}.linear_attn.in_proj_a.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.in_proj_b.weight",
        "layers.{L}.linear_attn.in_proj_b.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.A_log",
        "layers.{L}.linear_attn.A_log",
        Copy,
    ),
    r(
        "layers.{L}.attn.dt_bias",
        "layers.{L}.linear_attn.dt_bias",
        Copy,
    ),
    r(
        "layers.{L}.attn.norm.weight",
        "layers.{L}.linear_attn.norm.weight",
        Copy,
    ),
    r(
        "layers.{L}.attn.out_proj.weight",
        "layers.{L}.linear_attn.out_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.feed_forward.w1.weight",
        "layers.{L}.mlp.gate_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.feed_forward.w3.weight",
        "layers.{L}.mlp.up_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.feed_forward.w2.weight",
        "layers.{L}.mlp.down_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.attention_norm.weight",
        "layers.{L}.input_layernorm.weight",
        Copy,
    ),
    r(
        "layers.{L}.ffn_norm.weight",
        "layers.{L}.post_attention_layernorm.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.router.gate.weight",
        "layers.{L}.mlp.gate.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.shared_experts.w1.weight",
        "layers.{L}.mlp.shared_expert.gate_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.shared_experts.w3.weight",
        "layers.{L}.mlp.shared_expert.up_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.shared_experts.w2.weight",
        "layers.{L}.mlp.shared_expert.down_proj.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.shared_experts.gate.weight",
        "layers.{L}.mlp.shared_expert_gate.weight",
        Copy,
    ),
    r(
        "layers.{L}.moe.routed_experts.inner_experts.w1_EFD",
        "layers.{L}.mlp.experts.gate_up_proj",
        GateUp { index: 0 },
    ),
    r(
        "layers.{L}.moe.routed_experts.inner_experts.w3_EFD",
        "layers.{L}.mlp.experts.gate_up_proj",
        GateUp { index: 1 },
    ),
    r(
        "layers.{L}.moe.routed_experts.inner_experts.w2_EDF",
        "layers.{L}.mlp.experts.down_proj",
        TransposedExperts,
    ),
];

/// Qwen3.5's vision encoder and merger (`model.visual.`) and the untied output head.
const QWEN3_5_VISION: &[Rule] = &[
    r("lm_head.weight", "lm_head.weight", Copy),
    r(
        "vision_encoder.patch_embed.weight",
        "model.visual.patch_embed.proj.weight",
        PatchEmbed {
            channels: 3,
            temporal: 2,
        },
    ),
    r(
        "vision_encoder.patch_embed.bias",
        "model.visual.patch_embed.proj.bias",
        Copy,
    ),
    r(
        "vision_encoder.pos_embed",
        "model.visual.pos_embed.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.norm1.weight",
        "model.visual.blocks.{L}.norm1.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.norm1.bias",
        "model.visual.blocks.{L}.norm1.bias",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.norm2.weight",
        "model.visual.blocks.{L}.norm2.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.norm2.bias",
        "model.visual.blocks.{L}.norm2.bias",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.attn.wq.weight",
        "model.visual.blocks.{L}.attn.qkv.weight",
        Part { index: 0, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wk.weight",
        "model.visual.blocks.{L}.attn.qkv.weight",
        Part { index: 1, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wv.weight",
        "model.visual.blocks.{L}.attn.qkv.weight",
        Part { index: 2, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wq.bias",
        "model.visual.blocks.{L}.attn.qkv.bias",
        Part { index: 0, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wk.bias",
        "model.visual.blocks.{L}.attn.qkv.bias",
        Part { index: 1, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.wv.bias",
        "model.visual.blocks.{L}.attn.qkv.bias",
        Part { index: 2, of: 3 },
    ),
    r(
        "vision_encoder.layers.{L}.attn.proj.weight",
        "model.visual.blocks.{L}.attn.proj.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.attn.proj.bias",
        "model.visual.blocks.{L}.attn.proj.bias",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.mlp.linear_fc1.weight",
        "model.visual.blocks.{L}.mlp.linear_fc1.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.mlp.linear_fc1.bias",
        "model.visual.blocks.{L}.mlp.linear_fc1.bias",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.mlp.linear_fc2.weight",
        "model.visual.blocks.{L}.mlp.linear_fc2.weight",
        Copy,
    ),
    r(
        "vision_encoder.layers.{L}.mlp.linear_fc2.bias",
        "model.visual.blocks.{L}.mlp.linear_fc2.bias",
        Copy,
    ),
    r(
        "vision_encoder.merger.norm.weight",
        "model.visual.merger.norm.weight",
        Copy,
    ),
    r(
        "vision_encoder.merger.norm.bias",
        "model.visual.merger.norm.bias",
        Copy,
    ),
    r(
        "vision_encoder.merger.linear_fc1.weight",
        "model.visual.merger.linear_fc1.weight",
        Copy,
    ),
    r(
        "vision_encoder.merger.linear_fc1.bias",
        "model.visual.merger.linear_fc1.bias",
        Copy,
    ),
    r(
        "vision_encoder.merger.linear_fc2.weight",
        "model.visual.merger.linear_fc2.weight",
        Copy,
    ),
    r(
        "vision_encoder.merger.linear_fc2.bias",
        "model.visual.merger.linear_fc2.bias",
        Copy,
    ),
];

pub static QWEN3_5: Table = Table {
    family: Family::Qwen35,
    rules: &[QWEN3_5_TEXT],
    hf_prefix: "model.language_model.",
    hf_layers: "model.language_model.layers.",
    unprefixed: QWEN3_5_VISION,
    legacy: &[],
    no_hf_home: &[(
        "layers.{L}.moe.expert_bias_E",
        "Qwen3.5's HF MoE has no expert-bias (load balancing) tensor",
    )],
    hf_ignored: &["model.language_model.layers.{L}.self_attn.rotary_emb.inv_freq"],
    hf_dropped: &[],
    mtp_layers: false,
    signature: &[
        "layers.0.attn.in_proj_z.weight",
        "model.language_model.embed_tokens.weight",
    ],
};

/// Every family's table, most specific signature first (Kimi holds a DeepSeek-V3 text model;
/// DeepSeek-V3 with q-LoRA has a `q_norm` too; llama3 last: it has none).
pub static TABLES: [&Table; 6] = [
    &QWEN3_5,
    &KIMI_K2_7,
    &GPT_OSS,
    &DEEPSEEK_V3,
    &QWEN3,
    &LLAMA3,
];

impl Table {
    /// Every current rule, group after group, then the unprefixed ones.
    pub fn current(&self) -> impl Iterator<Item = &'static Rule> + '_ {
        self.rules
            .iter()
            .flat_map(|g| g.iter())
            .chain(self.unprefixed)
    }

    /// Whether `rule`'s HF names take [`Table::hf_prefix`].
    pub fn is_prefixed(&self, rule: &Rule) -> bool {
        !self.unprefixed.iter().any(|u| std::ptr::eq(u, rule))
    }
}
