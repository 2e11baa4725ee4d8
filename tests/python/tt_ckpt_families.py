"""Tiny torchtitan 0.3.0 models of every LLM family titan-ckpt converts (built with torchtitan's
own layer builders and state-dict adapters), and checks of titan-ckpt's conversions.

Run `make` and `check-dcp` with torch 2.15 + torchtitan (TITAN_TT_PYTHON); `check-hf` with
TITAN_PYTHON (transformers 5).

usage:
  tt_ckpt_families.py make DIR FLAVOR     FLAVOR: qwen3, qwen3_moe, deepseek_v3, deepseek_v3_qlora_mtp,
                                          gpt_oss, kimi_k2_7 (torchtitan's debugmodel: DeepSeek-V3
                                          text model + MoonViT vision encoder; transformers has no
                                          class for it, so check-hf compares tensors only),
                                          qwen3_5, qwen3_5_moe (torchtitan's debugmodel and
                                          debugmodel_moe with a 2048 vocabulary: GatedDeltaNet +
                                          full attention layers, routed + shared experts, vision
                                          encoder; check-hf compares tensors only)
      DIR/ref.safetensors          the model state dict (seeded values, torchtitan 0.3.0 names)
      DIR/dcp1/                    model-only DCP from one process
      DIR/dcp2/                    the same from 2 gloo ranks with FSDP2 fully_shard (Shard(0),
                                   so stacked experts are split on the expert dim)
      DIR/expected_hf.safetensors  the family adapter's to_hf
      DIR/hf_config.json           transformers config of the flavor
      DIR/tt_logits.safetensors    gpt_oss only: torchtitan's model's logits on LONG_TOKENS
  tt_ckpt_families.py check-hf DIR OURS... [--own-config]   each OURS (titan's HF output) holds exactly
      expected_hf's tensors bit for bit, and transformers' logits on OURS equal those on
      torchtitan's to_hf. gpt_oss (torchtitan's to_hf drops the experts): the non-expert tensors
      are expected_hf's bit for bit, the experts are ref's transposed per expert exactly, and
      transformers' logits match torchtitan's model's (see GPT_OSS_LOGITS_RTOL).
      --own-config: load OURS with its own config.json (titan's inferred one), not DIR's
  tt_ckpt_families.py check-dcp DCP DIR   dcp.load into the flavor's state dict equals ref,
      except tensors HF cannot hold (listed on stdout)
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

TOKENS = torch.arange(0, 120, 7).remainder(256).unsqueeze(0)
VOCAB, DIM = 256, 64
# gpt-oss: longer than the sliding window (128) of its even layers, so the window is exercised.
LONG_TOKENS = torch.arange(0, 160 * 7, 7).remainder(VOCAB).unsqueeze(0)
SLIDING_WINDOW = 128

# torchtitan 0.3.0's gpt-oss experts run their matmuls in bf16 whatever the model dtype
# (`x.bfloat16()`, `w.bfloat16()` in GptOssGroupedExperts.forward), and its fp32 path fails on CPU
# (the bf16 expert output meets an fp32 scatter_add), so its logits come from the model in bf16.
# transformers runs titan's fp32 weights in fp32. The bound is relative to the logits' largest
# magnitude: a few bf16 ulps (2**-8 = 0.0039 each) accumulated over the tiny model's 2 layers;
# measured 0.72% with correct weights (transformers in bf16 too: 0.70%), while swapping gate and
# up (the interleave order) moves them by 56%.
GPT_OSS_LOGITS_RTOL = 0.02


def flavor(name):
    """(model config, adapter class, HF config dict, tensors HF has no home for)."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

    emb = Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM)
    head = Linear.Config(in_features=DIM, out_features=VOCAB)
    if name in ("qwen3_5", "qwen3_5_moe"):
        return qwen3_5_flavor(name)
    if name.startswith("qwen3"):
        from torchtitan.models import qwen3 as q
        from torchtitan.models.qwen3 import Qwen3Model
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        hd, heads, kv = 16, 4, 2
        rope = CosSinRoPE.Config(dim=hd, max_seq_len=256, theta=1000000.0)
        common = dict(n_layers=2, dim=DIM, n_heads=heads, n_kv_heads=kv, head_dim=hd,
                      attn_backend="flex", rope=rope)
        hf = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=hd, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  max_position_embeddings=256, attention_bias=False, hidden_act="silu")
        if name == "qwen3":
            layers = q._build_qwen3_layers(hidden_dim=96, **common)
            cfg = Qwen3Model.Config(vocab_size=VOCAB, dim=DIM, norm=q._qwen3_norm(DIM),
                                    enable_weight_tying=True, tok_embeddings=emb, lm_head=head,
                                    layers=layers)
            hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=96,
                      tie_word_embeddings=True)
            return cfg, Qwen3StateDictAdapter, hf, []
        layers = q._build_qwen3_moe_layers(moe_hidden_dim=32, num_experts=4, top_k=2,
                                           moe_comm_backend="standard", **common)
        cfg = Qwen3Model.Config(vocab_size=VOCAB, dim=DIM, norm=q._qwen3_norm(DIM),
                                tok_embeddings=emb, lm_head=head, layers=layers)
        hf.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                  norm_topk_prob=True, tie_word_embeddings=False)
        return cfg, Qwen3StateDictAdapter, hf, ["moe.expert_bias_E"]
    if name == "gpt_oss":
        return gpt_oss_flavor(emb, head)
    if name == "kimi_k2_7":
        from torchtitan.models.kimi_k2_7 import model_registry
        from torchtitan.models.kimi_k2_7.state_dict_adapter import KimiK25StateDictAdapter

        # Kimi K2.5's HF class is remote code: the config only names it (titan copies it).
        hf = dict(architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25")
        return model_registry("debugmodel").model, KimiK25StateDictAdapter, hf, []
    from torchtitan.models import deepseek_v3 as d
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    qlora = 32 if name.endswith("qlora_mtp") else 0
    layers = d._build_dsv3_layers(
        n_layers=3, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=qlora, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=1.0,
        dense_hidden_dim=96, moe_hidden_dim=32, num_experts=4, num_shared_experts=1,
        router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=256, theta=10000.0))
    mtp = d._build_mtp_layers(layers[-1], dim=DIM, num_mtp_layers=1 if qlora else 0)
    cfg = DeepSeekV3Model.Config(vocab_size=VOCAB, dim=DIM, tok_embeddings=emb,
                                 norm=RMSNorm.Config(normalized_shape=DIM), lm_head=head,
                                 layers=layers, mtp_layers=mtp)
    hf = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB,
              hidden_size=DIM, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
              num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
              norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax",
              q_lora_rank=qlora or None, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
              num_nextn_predict_layers=1 if qlora else 0, hidden_act="silu")
    return cfg, DeepSeekV3StateDictAdapter, hf, []


def install_fla_stubs():
    """torchtitan 0.3.0's qwen3_5 model module imports flash-linear-attention (Triton kernels, not
    installed) at load; building the model and its state-dict adapter never calls it, so empty
    stand-ins of the imported names suffice."""
    import types

    for n in ["fla", "fla.modules", "fla.modules.conv", "fla.modules.conv.triton",
              "fla.modules.conv.triton.ops", "fla.modules.conv.causal_conv1d", "fla.ops",
              "fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.chunk",
              "fla.ops.gated_delta_rule.fused_recurrent"]:
        if n in sys.modules:
            continue
        m = types.ModuleType(n)

        def attr(a, n=n):
            if a.startswith("__"):
                raise AttributeError(a)
            return type(a, (), {"__module__": n})

        m.__getattr__ = attr
        sys.modules[n] = m


def qwen3_5_flavor(name):
    install_fla_stubs()
    from torchtitan.models.qwen3_5 import model_registry
    from torchtitan.models.qwen3_5.state_dict_adapter import Qwen35StateDictAdapter

    # The debugmodel's 248320-token vocabulary would make the fixture ~1 GB; nothing in the
    # mapping depends on it.
    cfg = model_registry("debugmodel_moe" if name.endswith("moe") else "debugmodel").model
    cfg.vocab_size = 2048
    cfg.tok_embeddings.num_embeddings = 2048
    cfg.lm_head.out_features = 2048
    hf = dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5")
    # Its to_hf drops the load-balancing expert bias (no HF tensor holds it).
    return cfg, Qwen35StateDictAdapter, hf, ["moe.expert_bias_E"] if name.endswith("moe") else []


def gpt_oss_flavor(emb, head):
    """torchtitan's gpt-oss layers (biased fused QKV, sinks, YaRN RoPE, sliding window on even
    layers, biased router and experts) at a tiny size: the debugmodel's 64 heads are shrunk to 4
    (2 kv heads) of dim 16 through torchtitan's own attention builder."""
    from torchtitan.models import gpt_oss as g
    from torchtitan.models.common import RMSNorm
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.gpt_oss import GptOssModel
    from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

    heads, kv, hd, n_layers = 4, 2, 16, 2
    rope = CosSinRoPE.Config(dim=hd, max_seq_len=256, theta=150000.0, scaling="yarn",
                             rope_factor=32, beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_seq_len=4096)
    # Every token goes to all 4 experts (top_k 4, as in every torchtitan gpt-oss flavor): a
    # top-k choice is discontinuous, and bf16 rounding in torchtitan's run flips near-ties.
    layers = g._build_gptoss_layers(dim=DIM, n_layers=n_layers, hidden_dim=32, num_experts=4,
                                    top_k=4, load_balance_coeff=1e-3, attn_backend="flex",
                                    fuse_qkv=True, moe_comm_backend="standard", rope=rope)
    for i, layer in enumerate(layers):
        layer.attention = g._make_gptoss_attn_config(
            dim=DIM, layer_id=i, attn_backend="flex", n_heads=heads, n_kv_heads=kv, head_dim=hd,
            sliding_window_size=SLIDING_WINDOW if i % 2 == 0 else None, fuse_qkv=True, rope=rope)
    cfg = GptOssModel.Config(vocab_size=VOCAB, dim=DIM, tok_embeddings=emb, lm_head=head,
                             norm=RMSNorm.Config(normalized_shape=DIM), layers=layers)
    hf = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=VOCAB,
              hidden_size=DIM, intermediate_size=32, num_hidden_layers=n_layers,
              num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
              num_local_experts=4, num_experts_per_tok=4, sliding_window=SLIDING_WINDOW,
              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                           for i in range(n_layers)],
              rms_norm_eps=1e-5, max_position_embeddings=256, attention_bias=True,
              tie_word_embeddings=False, swiglu_limit=7.0, rope_theta=150000.0,
              rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                truncate=False, original_max_position_embeddings=4096),
              rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                   beta_fast=32.0, beta_slow=1.0, truncate=False,
                                   original_max_position_embeddings=4096))
    return cfg, GptOssStateDictAdapter, hf, ["moe.expert_bias_E"]


# gpt-oss expert tensors: torchtitan name suffix -> (HF name suffix, transposed per expert).
GPT_OSS_EXPERTS = {
    "moe.routed_experts.inner_experts.mlp1_weight_EGD": ("mlp.experts.gate_up_proj", True),
    "moe.routed_experts.inner_experts.mlp1_bias_EG": ("mlp.experts.gate_up_proj_bias", False),
    "moe.routed_experts.inner_experts.mlp2_weight_EDF": ("mlp.experts.down_proj", True),
    "moe.routed_experts.inner_experts.mlp2_bias_ED": ("mlp.experts.down_proj_bias", False),
}


def tt_logits(model, tokens):
    """torchtitan's own forward on CPU: flex attention eager (compiled flex on CPU cannot return
    the log-sum-exp the sinks need) and the model in bf16 (see GPT_OSS_LOGITS_RTOL)."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = flex_attention
    model = model.to(torch.bfloat16)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(tokens, positions, model.get_attention_masks(positions)).float()


def build(name):
    cfg, adapter_cls, hf, no_home = flavor(name)
    with torch.device("cpu"):
        model = cfg.build()
    return cfg, model, adapter_cls, hf, no_home


def seeded(model, no_home):
    """Seeded values for every tensor; those HF cannot hold are zero (gpt-oss's load-balancing
    expert bias steers torchtitan's routing, so a nonzero one would make its logits differ from
    any HF model's)."""
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0))
                if name.startswith("layers.") and any(name.endswith(s) for s in no_home):
                    p.zero_()
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def fsdp_rank(rank, world, d, name, store):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # A forked rank: one intra-op thread, so it never enters an OpenMP pool the parent started.
    torch.set_num_threads(1)
    # A file store, not a TCP port: tests make several fixtures at once, and a free port picked
    # here can be taken by another fixture before rank 0 binds it.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    _, model, _, _, _ = build(name)
    model.load_state_dict(load_file(os.path.join(d, "ref.safetensors")))
    mesh = init_device_mesh("cpu", (world,))
    for layer in list(model.layers.values()) + list(getattr(model, "mtp_layers", {}).values() if hasattr(getattr(model, "mtp_layers", None), "values") else []):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(d, "dcp2"))
    # Both ranks leave gloo together: a rank exiting while the other is still in a collective
    # aborts the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    # Even so, torch 2.15's rank 0 sometimes aborted the same way during interpreter
    # finalization (twice in 2026-11-27's full suites): gloo's worker threads can still hold
    # work objects whose tensors reach into Python then (pytorch/pytorch#179291). Everything is
    # written (dcp.save returns once its files are closed), so the rank leaves without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make(d, name):
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    os.makedirs(d, exist_ok=True)
    cfg, model, adapter_cls, hf_cfg, no_home = build(name)
    ref = seeded(model, no_home if name == "gpt_oss" else [])
    save_file(ref, os.path.join(d, "ref.safetensors"))
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(d, "dcp1"))
    hf = adapter_cls(cfg, None).to_hf(dict(ref))
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(d, "expected_hf.safetensors"))
    with open(os.path.join(d, "hf_config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=1)
    store = os.path.join(d, "gloo.store")
    if os.path.exists(store):
        os.remove(store)
    # Forked, not spawned: the ranks start with torchtitan already imported (a spawned rank
    # imports torch and torchtitan again, ~10 s each on CI's two cores).
    mp.start_processes(fsdp_rank, args=(2, d, name, store), nprocs=2, join=True, start_method="fork")
    if name == "gpt_oss":
        save_file({"logits": tt_logits(model, LONG_TOKENS)}, os.path.join(d, "tt_logits.safetensors"))
    print(f"made {name}: {len(ref)} torchtitan tensors, {len(hf)} HF tensors")


def hf_logits(path, cfg_path, tokens=TOKENS):
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as t:
        if os.path.isdir(path):
            for f in os.listdir(path):
                shutil.copy(os.path.join(path, f), t)
        else:
            shutil.copy(path, os.path.join(t, "model.safetensors"))
        if cfg_path is not None:
            shutil.copy(cfg_path, os.path.join(t, "config.json"))
        config = AutoConfig.from_pretrained(t)
        model, info = AutoModelForCausalLM.from_pretrained(t, config=config, output_loading_info=True)
        # transformers has no MTP module: DeepSeek-V3's MTP layers (after the main layers, as in
        # the released checkpoints) are expected to be left unused.
        n = config.num_hidden_layers
        mtp = lambda k: k.startswith("model.layers.") and int(k.split(".")[2]) >= n
        info["unexpected_keys"] = {k for k in info.get("unexpected_keys", ()) if not mtp(k)}
        bad = {k: v for k, v in info.items() if v}
        if bad:
            sys.exit(f"{path}: loading info {bad}")
        with torch.no_grad():
            return model(tokens).logits


def load_dir(path):
    from safetensors import safe_open

    got = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as h:
                for k in h.keys():
                    got[k] = h.get_tensor(k)
    return got


def check_hf(ours, d, own_config=False):
    exp = load_file(os.path.join(d, "expected_hf.safetensors"))
    got = load_dir(ours)
    cfg = None if own_config else os.path.join(d, "hf_config.json")
    if os.path.exists(os.path.join(d, "tt_logits.safetensors")):
        return check_hf_gpt_oss(ours, d, exp, got, cfg)
    if set(got) != set(exp):
        sys.exit(f"names differ: only titan {sorted(set(got) - set(exp))[:5]}, only torchtitan {sorted(set(exp) - set(got))[:5]}")
    for k, v in exp.items():
        if got[k].dtype != v.dtype or got[k].shape != v.shape or not torch.equal(got[k], v):
            sys.exit(f"{k} differs from torchtitan's to_hf")
    with open(os.path.join(d, "hf_config.json")) as f:
        if json.load(f)["model_type"] in ("kimi_k25", "qwen3_5"):
            # Kimi's HF model is remote code; Qwen3.5's GatedDeltaNet wants flash-linear-attention.
            print(f"ok {len(exp)} tensors bit-equal (tensors only, no logits)")
            return
    a = hf_logits(ours, cfg)
    b = hf_logits(os.path.join(d, "expected_hf.safetensors"), os.path.join(d, "hf_config.json"))
    if not torch.equal(a, b):
        sys.exit(f"logits differ by {(a - b).abs().max().item():.3e}")
    print(f"ok {len(exp)} tensors bit-equal, logits equal")


def check_hf_gpt_oss(ours, d, exp, got, cfg):
    import shutil
    import tempfile

    ref = load_file(os.path.join(d, "ref.safetensors"))
    # torchtitan's to_hf holds every tensor but the experts: those must be bit-equal ...
    for k, v in exp.items():
        if k not in got or got[k].dtype != v.dtype or not torch.equal(got[k], v):
            sys.exit(f"{k} missing or differs from torchtitan's to_hf")
    # ... and the experts, which it drops, ref's exactly (transposed per expert where HF keeps
    # [E, in, out]).
    want = {}
    for k, v in ref.items():
        for tt, (hf, transposed) in GPT_OSS_EXPERTS.items():
            if k.endswith(tt):
                layer = k.split(".")[1]
                want[f"model.layers.{layer}.{hf}"] = v.transpose(1, 2) if transposed else v
    if set(got) != set(exp) | set(want):
        sys.exit(f"names differ: {sorted(set(got) ^ (set(exp) | set(want)))[:6]}")
    for k, v in want.items():
        if not torch.equal(got[k], v):
            sys.exit(f"{k} is not torchtitan's expert tensor (transposed per expert)")
    tt = load_file(os.path.join(d, "tt_logits.safetensors"))["logits"]
    ours_logits = hf_logits(ours, cfg, LONG_TOKENS)
    err = ((ours_logits - tt).abs().max() / tt.abs().max()).item()
    if not err <= GPT_OSS_LOGITS_RTOL:
        sys.exit(f"transformers' logits differ from torchtitan's model's by {err:.2%} of the "
                 f"largest logit (bound {GPT_OSS_LOGITS_RTOL:.0%})")
    # The bound tells a wrong expert layout apart: gate and up swapped must fail it.
    with tempfile.TemporaryDirectory() as t:
        swapped = {}
        for k, v in got.items():
            if k.endswith("gate_up_proj") or k.endswith("gate_up_proj_bias"):
                v = v.unflatten(-1, (-1, 2)).flip(-1).flatten(-2).contiguous()
            swapped[k] = v
        save_file(swapped, os.path.join(t, "model.safetensors"))
        shutil.copy(cfg or os.path.join(ours, "config.json"), os.path.join(t, "config.json"))
        bad = ((hf_logits(t, None, LONG_TOKENS) - tt).abs().max() / tt.abs().max()).item()
    if not bad > 2 * GPT_OSS_LOGITS_RTOL:
        sys.exit(f"gate/up swapped moves the logits only {bad:.2%}: the bound cannot tell")
    print(f"ok {len(exp)} tensors bit-equal to torchtitan's to_hf, {len(want)} expert tensors "
          f"equal to the model's; logits within {err:.3%} of torchtitan's model "
          f"(gate/up swapped: {bad:.1%})")


def check_dcp(dcp_dir, d, name):
    import torch.distributed.checkpoint as dcp

    _, model, _, _, no_home = build(name)
    ref = load_file(os.path.join(d, "ref.safetensors"))
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()
          if not any(k.endswith(s) for s in no_home)}
    dcp.load(sd, checkpoint_id=dcp_dir)
    for k, v in sd.items():
        if not torch.equal(v, ref[k]):
            sys.exit(f"{k} differs after dcp.load")
    print(f"ok {len(sd)} tensors equal; not in HF: {sorted(set(ref) - set(sd))}")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2], sys.argv[3])
    elif cmd == "check-hf":
        own = "--own-config" in sys.argv[4:]
        for ours in (a for a in sys.argv[3:] if a != "--own-config"):
            print(f"{ours}:", end=" ", flush=True)
            check_hf(ours, sys.argv[2], own_config=own)
    elif cmd == "check-dcp":
        check_dcp(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(__doc__)
