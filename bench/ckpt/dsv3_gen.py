"""A DeepSeek-V3-shaped MoE checkpoint for the conversion benchmark (bench/ckpt/dsv3_run.py).

usage: dsv3_gen.py OUT [--layers 6] [--experts 64] [--dim 1024] [--moe-hidden 512]

torchtitan 0.3.0's DeepSeek-V3 layer builders give the tensor names and shapes (MLA with q-LoRA,
1 dense layer, then MoE layers with stacked routed experts `w1_EFD`/`w2_EDF`/`w3_EFD`, shared
experts, router, expert bias; one MTP layer); values are seeded random bf16. 2 gloo ranks save it
with torch DCP, every tensor a DTensor sharded on dim 0 as FSDP2 does (the stacked experts split
on the expert dim). Defaults give ~2.3 GB.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def config(a):
    from torchtitan.models import deepseek_v3 as d
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    layers = d._build_dsv3_layers(
        n_layers=a.layers, n_dense_layers=1, dim=a.dim, n_heads=8, q_lora_rank=256,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, mscale=1.0,
        dense_hidden_dim=4 * a.dim, moe_hidden_dim=a.moe_hidden, num_experts=a.experts,
        num_shared_experts=1, router_top_k=4, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=32, max_seq_len=4096, theta=10000.0))
    return DeepSeekV3Model.Config(
        vocab_size=32768, dim=a.dim,
        tok_embeddings=Embedding.Config(num_embeddings=32768, embedding_dim=a.dim),
        norm=RMSNorm.Config(normalized_shape=a.dim),
        lm_head=Linear.Config(in_features=a.dim, out_features=32768),
        layers=layers, mtp_layers=d._build_mtp_layers(layers[-1], dim=a.dim, num_mtp_layers=1))


def rank_main(rank, world, a, port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = config(a).build()
    g = torch.Generator().manual_seed(1000 + rank)
    sd = {}
    for name, p in model.state_dict().items():
        shape = list(p.shape)
        local = shape.copy()
        rows = shape[0]
        per = (rows + world - 1) // world
        local[0] = max(0, min(per, rows - rank * per))
        t = (torch.randn(local, generator=g) * 0.02).to(torch.bfloat16)
        sd[name] = DTensor.from_local(t, mesh, [Shard(0)], shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())
    dcp.save(sd, checkpoint_id=a.out)
    dist.destroy_process_group()


def model_flags(ap):
    """The model-size flags this script and dsv3_torchtitan.py share."""
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--moe-hidden", type=int, default=512)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    model_flags(ap)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, a, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
