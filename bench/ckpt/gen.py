"""Generate the consolidation benchmark checkpoint: torch writes DCP sharded safetensors
(HuggingFaceStorageWriter, save_distributed=True) from 4 gloo ranks on CPU.

usage: gen.py OUT [--gib 2.1] [--world-size 4]

Tensors are bf16 [4099, 2048] (~16 MiB), alternately Shard(0) (uneven rows: 4099 over 4 ranks)
and Shard(1); plus a replicated norm. Each rank creates only its local shards (DTensor.from_local),
so memory stays at about the checkpoint size over all ranks. Also writes OUT/mapping.json: every
tensor -> one of 4 output files, used by both titan-ckpt (--index-from) and torch.
"""

import argparse
import json
import math
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

ROWS, COLS = 4099, 2048


def names(gib: float):
    per = ROWS * COLS * 2
    n = max(2, math.ceil(gib * (1 << 30) / per))
    return [f"layers.{i}.{'row' if i % 2 == 0 else 'col'}.weight" for i in range(n)]


def local_range(n, world, rank):
    chunk = -(-n // world)
    start = min(n, rank * chunk)
    return start, min(n, start + chunk) - start


def run(rank, world, port, out, gib, mapping):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", list(range(world)))
    g = torch.Generator().manual_seed(100 + rank)
    sd = {}
    for name in names(gib):
        if ".row." in name:
            _, n = local_range(ROWS, world, rank)
            local = torch.randn(n, COLS, generator=g).to(torch.bfloat16)
            placement = [Shard(0)]
        else:
            _, n = local_range(COLS, world, rank)
            local = torch.randn(ROWS, n, generator=g).to(torch.bfloat16)
            placement = [Shard(1)]
        sd[name] = DTensor.from_local(local, mesh, placement, run_check=False, shape=torch.Size([ROWS, COLS]),
                                      stride=(COLS, 1))
    norm = torch.ones(COLS, dtype=torch.float32)
    sd["norm.weight"] = DTensor.from_local(norm, mesh, [Replicate()], run_check=False)
    writer = HuggingFaceStorageWriter(path=os.path.join(out, "sharded"), save_distributed=True,
                                      fqn_to_index_mapping=mapping)
    dcp.save(sd, storage_writer=writer)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--gib", type=float, default=2.1)
    p.add_argument("--world-size", type=int, default=4)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    all_names = names(a.gib) + ["norm.weight"]
    per_file = -(-len(all_names) // 4)
    mapping = {n: 1 + i // per_file for i, n in enumerate(all_names)}
    with open(os.path.join(a.out, "mapping.json"), "w") as f:
        json.dump(mapping, f)
    n_files = max(mapping.values())
    index = {"metadata": {}, "weight_map": {k: f"model-{v:05}-of-{n_files:05}.safetensors" for k, v in mapping.items()}}
    with open(os.path.join(a.out, "index.json"), "w") as f:
        json.dump(index, f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(a.world_size, port, a.out, a.gib, mapping), nprocs=a.world_size)
    print("ok")


if __name__ == "__main__":
    main()
