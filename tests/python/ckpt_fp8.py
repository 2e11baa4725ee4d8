"""FP8 block-quantized HF checkpoints as the DeepSeek-V3/R1, Kimi-K2 and Qwen3 -FP8 releases store
them (float8_e4m3fn weights + fp32 `<name>_scale_inv` block scales, `quantization_config` in
config.json), made with transformers' own config classes and torch's float8 dtype, and checks of
what titan-ckpt makes of them.

Run `make`, `check-hf` and `damage` with TITAN_PYTHON or TITAN_TT_PYTHON (both have torch and
transformers); `check-dcp` with TITAN_TT_PYTHON (torchtitan 0.3.0).

usage:
  ckpt_fp8.py make DIR FLAVOR    FLAVOR: deepseek_v3 (MLA with q-LoRA, a dense first layer, MoE
                                 with a shared expert and e_score_correction_bias, one MTP layer
                                 with its embed_tokens/shared_head.head copies; 128x128 blocks),
                                 qwen3_moe (64x32 blocks: not square, so rows and columns cannot be
                                 swapped unnoticed), codes (one weight holding every float8 byte,
                                 NaN and subnormals included, with tiny, huge and negative scales)
      DIR/hf/                    the FP8 checkpoint: 2 shards + index + config.json
      DIR/expected_f32.safetensors   every weight dequantized as torch computes it:
                                 `fp8.float() * scale_inv` spread over its block (edge blocks cut),
                                 other tensors `.float()`; no scales
      DIR/expected_bf16.safetensors  the same cast to bf16 (the dequantized weights; the others
                                 as stored)
  ckpt_fp8.py check-hf OURS DIR f32|bf16   OURS (titan's HF output) holds expected_*'s tensors bit
      for bit (NaN: same NaN-ness in bf16, whose NaN bits torch itself does not fix), config.json
      has no quantization_config, and (not `codes`) transformers loads OURS and its logits equal
      those of the reference model
  ckpt_fp8.py check-dcp DCP DIR FLAVOR   dcp.load into torchtitan 0.3.0's model for FLAVOR equals
      torchtitan's own from_hf of expected_f32 bit for bit, and that model's logits are within
      LOGITS_RTOL of transformers' on the dequantized checkpoint (see there)
  ckpt_fp8.py damage DIR OUT KIND TENSOR   copies DIR/hf to OUT with TENSOR's scales damaged: KIND
      nan, inf, zero (one scale), shape (one block row too few)
"""

import json
import os
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tt_ckpt_families import load_dir

TOKENS = torch.arange(0, 120, 7).remainder(256).unsqueeze(0)
VOCAB = 256
# torchtitan 0.3.0 runs the routed experts' matmuls in bf16 whatever the model dtype
# (GroupedExperts casts x and the weights with `.bfloat16()`, torchtitan/models/common/moe.py),
# so its fp32 model as shipped cannot meet transformers' fp32 logits within 1e-4. The check runs
# torchtitan's model twice: with the same expert math in fp32 (`fp32_experts`, the only change)
# its logits must be within LOGITS_RTOL of transformers' (measured 1.0e-5 deepseek_v3, 5.2e-7
# qwen3_moe); as shipped, within BF16_EXPERTS_RTOL (measured 0.14% and 0.18%). Both bounds are relative to the largest logit. The same weights with each
# matrix's block scales mirrored (a subtle dequantization error) must move them by more than
# twice the looser bound.
LOGITS_RTOL = 1e-4
BF16_EXPERTS_RTOL = 0.01


def hf_config(flavor):
    """transformers' config for FLAVOR, and the FP8 block size."""
    if flavor == "deepseek_v3":
        from transformers import DeepseekV3Config

        # hidden 192 and ranks 160/144 are not multiples of 128: every matrix has ragged blocks.
        # rms_norm_eps 1e-5: torchtitan's DeepSeek-V3 RMSNorms use their default eps.
        cfg = DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=192, intermediate_size=200, moe_intermediate_size=72,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=4, num_experts_per_tok=4, first_k_dense_replace=1, n_group=1,
            topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, q_lora_rank=160,
            kv_lora_rank=144, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            rms_norm_eps=1e-5, rope_theta=10000.0, rope_interleave=True, max_position_embeddings=256,
            tie_word_embeddings=False, attention_bias=False, num_nextn_predict_layers=1)
        return cfg, [128, 128]
    if flavor == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=160, intermediate_size=200, moe_intermediate_size=72,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
            num_experts=4, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
            max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False)
        return cfg, [64, 32]
    sys.exit(f"unknown flavor {flavor}")


def quantized(name, t):
    """Whether the releases store `name` in float8: the projections of attention, MLPs and
    experts; never embeddings, norms, the router, lm_head or the MTP head/projection."""
    return t.dim() == 2 and "_proj" in name and "eh_proj" not in name


def expand(scales, block, shape):
    """Each scale spread over its block, edge blocks cut to `shape`."""
    return (scales.repeat_interleave(block[0], 0)[: shape[0]]
            .repeat_interleave(block[1], 1)[:, : shape[1]])


def quantize(w, block):
    """Block-wise e4m3fn quantization as the releases use: scale = block amax / 448."""
    rows, cols = w.shape
    sr, sc = -(-rows // block[0]), -(-cols // block[1])
    scales = torch.empty(sr, sc, dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            b = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            scales[i, j] = b.abs().max().clamp(min=1e-12) / 448.0
    q = (w.float() / expand(scales, block, w.shape)).to(torch.float8_e4m3fn)
    return q, scales


def dequantize(q, scales, block):
    """torch's reference: fp8 -> fp32 exactly, times the block's scale in fp32."""
    return q.float() * expand(scales, block, q.shape)


def model_tensors(flavor, cfg):
    """The HF checkpoint's tensors in bf16 (fp32 e_score_correction_bias, as released), seeded;
    DeepSeek-V3 gets one MTP layer after the main ones (transformers has no MTP module, so its
    tensors come from a one-layer-deeper model plus the MTP-only ones)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    if flavor == "deepseek_v3":
        deeper = type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": cfg.num_hidden_layers + 1})
        deeper.rope_parameters = cfg.rope_parameters
        model = AutoModelForCausalLM.from_config(deeper)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(99)
    sd = {}
    for k, v in model.state_dict().items():
        if "rotary_emb" in k:
            continue
        v = torch.randn(v.shape, generator=g) * 0.05 + (1.0 if "norm" in k else 0.0)
        if k.endswith("e_score_correction_bias"):
            sd[k] = (v * 0.1).float()
        elif k.endswith("mlp.experts.gate_up_proj"):
            # transformers 5 fuses the experts in memory; the releases store one 2-D tensor per
            # expert and projection: gate_up_proj [E, 2F, D] is gate (rows :F) over up.
            base, f = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"] = v[e, :f].to(torch.bfloat16)
                sd[f"{base}{e}.up_proj.weight"] = v[e, f:].to(torch.bfloat16)
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                sd[f"{base}{e}.down_proj.weight"] = v[e].to(torch.bfloat16)
        else:
            sd[k] = v.to(torch.bfloat16)
    if flavor == "deepseek_v3":
        n, d = cfg.num_hidden_layers, cfg.hidden_size
        for name, shape in [("enorm.weight", [d]), ("hnorm.weight", [d]),
                            ("eh_proj.weight", [d, 2 * d]), ("shared_head.norm.weight", [d]),
                            ("embed_tokens.weight", [VOCAB, d]),
                            ("shared_head.head.weight", [VOCAB, d])]:
            v = torch.randn(shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0)
            sd[f"model.layers.{n}.{name}"] = v.to(torch.bfloat16)
    return sd


def write_hf(d, tensors, config):
    """Two shards with an index, as the releases are laid out, and config.json."""
    os.makedirs(d, exist_ok=True)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        f = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, os.path.join(d, f),
                  metadata={"format": "pt"})
        weight_map.update({k: f for k in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def make(d, flavor):
    if flavor == "codes":
        return make_codes(d)
    cfg, block = hf_config(flavor)
    sd = model_tensors(flavor, cfg)
    stored, f32, bf16 = {}, {}, {}
    for k, v in sd.items():
        if quantized(k, v):
            q, s = quantize(v, block)
            stored[k], stored[k + "_scale_inv"] = q, s
            deq = dequantize(q, s, block)
            f32[k], bf16[k] = deq, deq.to(torch.bfloat16)
        else:
            stored[k] = v
            f32[k], bf16[k] = v.float(), v
    config = cfg.to_dict()
    config["quantization_config"] = {**QUANT, "weight_block_size": block}
    write_hf(os.path.join(d, "hf"), stored, config)
    save_file(f32, os.path.join(d, "expected_f32.safetensors"))
    save_file(bf16, os.path.join(d, "expected_bf16.safetensors"))
    nq = sum(1 for k in stored if k.endswith("_scale_inv"))
    print(f"made {flavor}: {len(sd)} tensors, {nq} in float8 with {block[0]}x{block[1]} blocks")


def make_codes(d):
    """Every float8 byte (0x7f and 0xff are NaN, 0x01..0x07 subnormal) in a 40 x 300 weight of
    16 x 128 blocks (scales 3 x 3, ragged both ways), with scales that are subnormal in fp32,
    huge, negative and ordinary."""
    block = [16, 128]
    codes = (torch.arange(40 * 300) * 7).remainder(256).to(torch.uint8).reshape(40, 300)
    q = codes.view(torch.float8_e4m3fn)
    s = torch.tensor([[1e-40, 2.0 ** 100, -3.5], [0.125, 1.0, 7.0e-3],
                      [-1e-3, 3.0e30, 2.0 ** -120]], dtype=torch.float32)
    other = torch.randn(8, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    write_hf(os.path.join(d, "hf"), {"w.weight": q, "w.weight_scale_inv": s, "b.bias": other},
             {"quantization_config": {**QUANT, "weight_block_size": block},
              "torch_dtype": "bfloat16"})
    deq = dequantize(q, s, block)
    save_file({"w.weight": deq, "b.bias": other.float()},
              os.path.join(d, "expected_f32.safetensors"))
    save_file({"w.weight": deq.to(torch.bfloat16), "b.bias": other},
              os.path.join(d, "expected_bf16.safetensors"))
    print(f"made codes: 256 float8 codes, {int(deq.isnan().sum())} NaN")


def bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def same(a, b, exact_nan):
    """Bit-equal; NaN positions (bf16) only need to be NaN on both sides."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if exact_nan or a.dtype not in (torch.float32, torch.bfloat16):
        return torch.equal(bits(a), bits(b)) if a.is_floating_point() else torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan])


def ref_logits(d):
    """transformers' logits on the dequantized fp32 weights (torch's reference), loaded as a
    checkpoint so that transformers fuses the per-expert tensors itself."""
    import tempfile

    from transformers import AutoModelForCausalLM

    with open(os.path.join(d, "hf", "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with tempfile.TemporaryDirectory() as t:
        shutil.copy(os.path.join(d, "expected_f32.safetensors"),
                    os.path.join(t, "model.safetensors"))
        with open(os.path.join(t, "config.json"), "w") as f:
            json.dump(config, f)
        model, info = AutoModelForCausalLM.from_pretrained(
            t, torch_dtype=torch.float32, output_loading_info=True)
    check_loading(info, model.config)
    with torch.no_grad():
        return model(TOKENS).logits


def check_loading(info, config):
    """transformers loaded every weight; only the MTP layer (it has no MTP module) is left."""
    n = config.num_hidden_layers
    mtp = lambda k: k.startswith("model.layers.") and int(k.split(".")[2]) >= n
    info["unexpected_keys"] = {k for k in info.get("unexpected_keys", ()) if not mtp(k)}
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"loading info {bad}")


def check_hf(ours, d, mode):
    exp = load_file(os.path.join(d, f"expected_{mode}.safetensors"))
    got = load_dir(ours)
    if set(got) != set(exp):
        sys.exit(f"names differ: only titan {sorted(set(got) - set(exp))[:5]}, only expected "
                 f"{sorted(set(exp) - set(got))[:5]}")
    for k, v in exp.items():
        if not same(got[k], v, exact_nan=(mode == "f32")):
            diff = (got[k].float() - v.float()).abs().nan_to_num(0).max().item() \
                if got[k].shape == v.shape else "-"
            sys.exit(f"{k}: {got[k].dtype}{list(got[k].shape)} differs from torch's "
                     f"{v.dtype}{list(v.shape)} dequantization (max abs diff {diff})")
    with open(os.path.join(ours, "config.json")) as f:
        config = json.load(f)
    if "quantization_config" in config:
        sys.exit("config.json still has quantization_config")
    if "model_type" not in config:
        print(f"ok {len(exp)} tensors bit-equal to torch's dequantization ({mode})")
        return
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        ours, torch_dtype=torch.float32, output_loading_info=True)
    check_loading(info, model.config)
    with torch.no_grad():
        a = model(TOKENS).logits
    b = ref_logits(d)
    # bf16 weights differ from the fp32 reference's: only the f32 output must match exactly.
    err = (a - b).abs().max().item()
    if mode == "f32" and err != 0.0:
        sys.exit(f"transformers' logits on titan's output differ by {err:.3e}")
    print(f"ok {len(exp)} tensors bit-equal to torch's dequantization ({mode}); transformers "
          f"loads it (logits vs fp32 reference: {err:.2e})")


def tt_flavor(flavor, cfg):
    """torchtitan 0.3.0's model config and adapter for the transformers config `cfg`."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

    dim, theta = cfg.hidden_size, cfg.rope_parameters["rope_theta"]
    emb = Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim)
    head = Linear.Config(in_features=dim, out_features=VOCAB)
    if flavor == "qwen3_moe":
        from torchtitan.models import qwen3 as q
        from torchtitan.models.qwen3 import Qwen3Model
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        rope = CosSinRoPE.Config(dim=cfg.head_dim, max_seq_len=256, theta=theta)
        layers = q._build_qwen3_moe_layers(
            moe_hidden_dim=cfg.moe_intermediate_size, num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok, moe_comm_backend="standard",
            n_layers=cfg.num_hidden_layers, dim=dim, n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, attn_backend="flex",
            rope=rope)
        mc = Qwen3Model.Config(vocab_size=VOCAB, dim=dim, norm=q._qwen3_norm(dim),
                               tok_embeddings=emb, lm_head=head, layers=layers)
        return mc, Qwen3StateDictAdapter
    from torchtitan.models import deepseek_v3 as dsv3
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    layers = dsv3._build_dsv3_layers(
        n_layers=cfg.num_hidden_layers, n_dense_layers=cfg.first_k_dense_replace, dim=dim,
        n_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank or 0,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, mscale=1.0,
        dense_hidden_dim=cfg.intermediate_size, moe_hidden_dim=cfg.moe_intermediate_size,
        num_experts=cfg.n_routed_experts, num_shared_experts=cfg.n_shared_experts,
        router_top_k=cfg.num_experts_per_tok, router_score_func="sigmoid",
        router_route_norm=cfg.norm_topk_prob, router_route_scale=cfg.routed_scaling_factor,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=cfg.qk_rope_head_dim, max_seq_len=256,
                                theta=theta))
    mtp = dsv3._build_mtp_layers(layers[-1], dim=dim, num_mtp_layers=1)
    mc = DeepSeekV3Model.Config(vocab_size=VOCAB, dim=dim, tok_embeddings=emb,
                                norm=RMSNorm.Config(normalized_shape=dim), lm_head=head,
                                layers=layers, mtp_layers=mtp)
    return mc, DeepSeekV3StateDictAdapter


def fp32_experts(self, x_RD, num_tokens_per_expert_E):
    """torchtitan's GroupedExperts.forward (silu(x w1^T) * (x w3^T), then w2^T, each expert on its
    run of tokens) without its casts to bf16: every row past the experts' tokens stays zero, as
    `_grouped_mm` leaves them."""
    import torch.nn.functional as F

    out = torch.zeros(x_RD.shape[0], self.w2_EDF.shape[1], dtype=x_RD.dtype)
    start = 0
    for e, n in enumerate(num_tokens_per_expert_E.tolist()):
        x = x_RD[start:start + n]
        h = F.silu(x @ self.w1_EFD[e].T) * (x @ self.w3_EFD[e].T)
        out[start:start + n] = h @ self.w2_EDF[e].T
        start += n
    return out


def tt_logits(model, experts_in_fp32=False, tokens=None):
    """torchtitan's own forward on CPU in fp32 of TOKENS (default this module's; flex attention
    eager: compiled flex needs a compiler CI does not have); with EXPERTS_IN_FP32 its routed
    experts compute in fp32."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.moe import GroupedExperts

    FlexAttention._compiled_flex_attn = flex_attention
    tokens = TOKENS if tokens is None else tokens
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    shipped = GroupedExperts.forward
    if experts_in_fp32:
        GroupedExperts.forward = fp32_experts
    try:
        with torch.no_grad():
            out = model(tokens, positions, model.get_attention_masks(positions))
    finally:
        GroupedExperts.forward = shipped
    # With MTP layers the model returns the main logits first, then each MTP layer's.
    return (out[0] if isinstance(out, (tuple, list)) else out).float()


def check_dcp(dcp_dir, d, flavor):
    import torch.distributed.checkpoint as dcp

    cfg, _ = hf_config(flavor)
    mc, adapter_cls = tt_flavor(flavor, cfg)
    with torch.device("cpu"):
        model = mc.build()
    exp = load_file(os.path.join(d, "expected_f32.safetensors"))
    # What torchtitan's own from_hf makes of the dequantized weights (it raises on the MTP
    # layer's embed_tokens/shared_head.head copies, which titan drops with a warning).
    n = cfg.num_hidden_layers
    copies = (f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight")
    want = adapter_cls(mc, None).from_hf({k: v for k, v in exp.items() if k not in copies})
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    if set(want) - set(sd):
        sys.exit(f"from_hf names not in the model: {sorted(set(want) - set(sd))[:4]}")
    sd = {k: v for k, v in sd.items() if k in want}
    dcp.load(sd, checkpoint_id=dcp_dir)
    for k, v in sd.items():
        if not torch.equal(bits(v), bits(want[k].contiguous())):
            sys.exit(f"{k}: titan's DCP differs from torchtitan's from_hf of the dequantized "
                     f"weights")
    not_loaded = sorted(set(model.state_dict()) - set(sd))
    model.load_state_dict(sd, strict=False)
    hf = ref_logits(d)
    rel = lambda tt: ((tt - hf).abs().max() / hf.abs().max()).item()
    err = rel(tt_logits(model, experts_in_fp32=True))
    if not err <= LOGITS_RTOL:
        sys.exit(f"torchtitan's logits (experts in fp32) on titan's DCP differ from transformers' "
                 f"by {err:.2e} of the largest logit (bound {LOGITS_RTOL:.0e})")
    shipped_err = rel(tt_logits(model))
    if not shipped_err <= BF16_EXPERTS_RTOL:
        sys.exit(f"torchtitan's logits (experts in bf16, as shipped) on titan's DCP differ from "
                 f"transformers' by {shipped_err:.3%} of the largest logit (bound "
                 f"{BF16_EXPERTS_RTOL:.0%})")
    # The bound tells a wrong dequantization apart: every matrix's scales mirrored.
    stored = load_dir(os.path.join(d, "hf"))
    block = json.load(open(os.path.join(d, "hf", "config.json")))["quantization_config"][
        "weight_block_size"]
    wrong = dict(exp)
    for k, v in stored.items():
        if k + "_scale_inv" in stored:
            wrong[k] = dequantize(v, stored[k + "_scale_inv"].flip(0).flip(1), block)
    wrong = adapter_cls(mc, None).from_hf({k: v for k, v in wrong.items() if k not in copies})
    model.load_state_dict(wrong, strict=False)
    bad = rel(tt_logits(model))
    if not bad > 2 * BF16_EXPERTS_RTOL:
        sys.exit(f"mirrored scales move the logits only {bad:.2%}: the bound cannot tell")
    print(f"ok {len(sd)} tensors equal to torchtitan's from_hf; torchtitan's logits within "
          f"{err:.2e} of transformers' with its experts in fp32, {shipped_err:.3%} as shipped "
          f"(mirrored scales: {bad:.1%}); not in the checkpoint: {not_loaded}")


def damage(d, out, kind, tensor):
    shutil.copytree(os.path.join(d, "hf"), out)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        file = json.load(f)["weight_map"][tensor]
    path = os.path.join(out, file)
    with safe_open(path, "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    s = tensors[tensor]
    if kind == "shape":
        s = s[:-1].contiguous()
    else:
        s = s.clone()
        s[-1, -1] = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0}[kind]
    tensors[tensor] = s
    save_file(tensors, path, metadata={"format": "pt"})
    print(f"damaged {tensor} ({kind}) in {file}")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2], sys.argv[3])
    elif cmd == "check-hf":
        check_hf(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "check-dcp":
        check_dcp(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "damage":
        damage(*sys.argv[2:6])
    else:
        sys.exit(__doc__)
