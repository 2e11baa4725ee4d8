"""Tiny torchtitan 0.3.0 models of every LLM family titan-ckpt converts (built with torchtitan's
own layer builders and state-dict adapters), and checks of titan-ckpt's conversions.

Run `make` and `check-dcp` with torch 2.15 + torchtitan (TITAN_TT_PYTHON); `check-hf` with
TITAN_PYTHON (transformers 5).

usage:
  tt_ckpt_families.py make DIR FLAVOR     FLAVOR: qwen3, qwen3_moe, deepseek_v3, deepseek_v3_qlora_mtp
      DIR/ref.safetensors          the model state dict (seeded values, torchtitan 0.3.0 names)
      DIR/dcp1/                    model-only DCP from one process
      DIR/dcp2/                    the same from 2 gloo ranks with FSDP2 fully_shard (Shard(0),
                                   so stacked experts are split on the expert dim)
      DIR/expected_hf.safetensors  the family adapter's to_hf
      DIR/hf_config.json           transformers config of the flavor
  tt_ckpt_families.py check-hf OURS DIR   OURS (titan's HF output) holds exactly expected_hf's
      tensors bit for bit, and transformers' logits on OURS equal those on torchtitan's to_hf
  tt_ckpt_families.py check-dcp DCP DIR   dcp.load into the flavor's state dict equals ref,
      except tensors HF cannot hold (listed on stdout)
"""

import json
import os
import socket
import sys

import torch
from safetensors.torch import load_file, save_file

TOKENS = torch.arange(0, 120, 7).remainder(256).unsqueeze(0)
VOCAB, DIM = 256, 64


def flavor(name):
    """(model config, adapter class, HF config dict, tensors HF has no home for)."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

    emb = Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM)
    head = Linear.Config(in_features=DIM, out_features=VOCAB)
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
              norm_topk_prob=True, routed_scaling_factor=1.0, scoring_func="softmax",
              q_lora_rank=qlora or None, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
              num_nextn_predict_layers=1 if qlora else 0, hidden_act="silu")
    return cfg, DeepSeekV3StateDictAdapter, hf, []


def build(name):
    cfg, adapter_cls, hf, no_home = flavor(name)
    with torch.device("cpu"):
        model = cfg.build()
    return cfg, model, adapter_cls, hf, no_home


def seeded(model):
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0))
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def fsdp_rank(rank, world, d, name, port):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _, model, _, _, _ = build(name)
    model.load_state_dict(load_file(os.path.join(d, "ref.safetensors")))
    mesh = init_device_mesh("cpu", (world,))
    for layer in list(model.layers.values()) + list(getattr(model, "mtp_layers", {}).values() if hasattr(getattr(model, "mtp_layers", None), "values") else []):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(d, "dcp2"))
    dist.destroy_process_group()


def make(d, name):
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    os.makedirs(d, exist_ok=True)
    cfg, model, adapter_cls, hf_cfg, _ = build(name)
    ref = seeded(model)
    save_file(ref, os.path.join(d, "ref.safetensors"))
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(d, "dcp1"))
    hf = adapter_cls(cfg, None).to_hf(dict(ref))
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(d, "expected_hf.safetensors"))
    with open(os.path.join(d, "hf_config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(fsdp_rank, args=(2, d, name, port), nprocs=2, join=True)
    print(f"made {name}: {len(ref)} torchtitan tensors, {len(hf)} HF tensors")


def hf_logits(path, cfg_path):
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as t:
        if os.path.isdir(path):
            for f in os.listdir(path):
                shutil.copy(os.path.join(path, f), t)
        else:
            shutil.copy(path, os.path.join(t, "model.safetensors"))
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
            return model(TOKENS).logits


def check_hf(ours, d):
    from safetensors import safe_open

    exp = load_file(os.path.join(d, "expected_hf.safetensors"))
    got = {}
    files = [os.path.join(ours, f) for f in os.listdir(ours) if f.endswith(".safetensors")]
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():
                got[k] = h.get_tensor(k)
    if set(got) != set(exp):
        sys.exit(f"names differ: only titan {sorted(set(got) - set(exp))[:5]}, only torchtitan {sorted(set(exp) - set(got))[:5]}")
    for k, v in exp.items():
        if got[k].dtype != v.dtype or not torch.equal(got[k], v):
            sys.exit(f"{k} differs from torchtitan's to_hf")
    cfg = os.path.join(d, "hf_config.json")
    a = hf_logits(ours, cfg)
    b = hf_logits(os.path.join(d, "expected_hf.safetensors"), cfg)
    if not torch.equal(a, b):
        sys.exit(f"logits differ by {(a - b).abs().max().item():.3e}")
    print(f"ok {len(exp)} tensors bit-equal, logits equal")


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
        check_hf(sys.argv[2], sys.argv[3])
    elif cmd == "check-dcp":
        check_dcp(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(__doc__)
