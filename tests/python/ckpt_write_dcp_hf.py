"""Write a DCP sharded-safetensors checkpoint (HuggingFaceStorageWriter, save_distributed=True)
from W gloo ranks on CPU, with DTensors placed Shard(0), Shard(1) and Replicate (uneven splits,
bf16/f16/f32/int64), plus the full tensors for comparison.

usage: ckpt_write_dcp_hf.py OUT --world-size W [--mapping] [--scale-mb N] [--torch-consolidate]

OUT/sharded/            the shards torch writes
OUT/expected.safetensors the full tensors (written by rank 0 with safetensors.torch)
OUT/torch/              torch's consolidate_safetensors_files output of the float tensors
                        (torch 2.13 crashes on integer dtypes), with --torch-consolidate
OUT/mapping.json        the fqn -> file index mapping used (with --mapping)
"""

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor


def full_tensors(scale_mb: int) -> dict:
    """Deterministic full tensors; `scale_mb` > 0 makes big row- and column-sharded matrices."""
    g = torch.Generator().manual_seed(1234)
    t = {}
    if scale_mb == 0:
        t["row.bf16"] = (torch.randn(13, 7, generator=g)).to(torch.bfloat16)
        t["col.f32"] = torch.randn(5, 11, generator=g)
        t["rep.f16"] = torch.randn(6, 3, generator=g).to(torch.float16)
        t["row.i64"] = torch.randint(-(2**40), 2**40, (9, 4), generator=g, dtype=torch.int64)
        t["col.i64"] = torch.randint(-1000, 1000, (3, 10), generator=g, dtype=torch.int64)
        t["row3d.f32"] = torch.randn(7, 3, 2, generator=g)
        t["col3d.bf16"] = torch.randn(2, 9, 3, generator=g).to(torch.bfloat16)
        t["vec.f32"] = torch.randn(17, generator=g)
        t["rep.i64"] = torch.arange(10, dtype=torch.int64)
        return t
    # Benchmark data: `scale_mb` MB in bf16 matrices, half row-sharded, half column-sharded.
    dim = 4096
    rows = 1024
    per = rows * dim * 2
    n = max(2, scale_mb * 1024 * 1024 // per)
    for i in range(n):
        kind = "row" if i % 2 == 0 else "col"
        t[f"layers.{i}.{kind}.weight"] = torch.randn(rows + 3, dim, generator=g).to(torch.bfloat16)
    t["norm.weight"] = torch.randn(dim, generator=g)
    return t


def placement(name: str):
    if name.startswith("rep") or name.startswith("norm"):
        return [Replicate()]
    if ".col" in name or name.startswith("col"):
        return [Shard(1)]
    return [Shard(0)]


def run(rank: int, world: int, port: int, out: str, mapping, scale_mb: int):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", list(range(world)))
    full = full_tensors(scale_mb)
    sd = {k: distribute_tensor(v, mesh, placement(k)) for k, v in full.items()}
    writer = HuggingFaceStorageWriter(
        path=os.path.join(out, "sharded"),
        save_distributed=True,
        fqn_to_index_mapping=mapping,
    )
    dcp.save(sd, storage_writer=writer)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mapping", action="store_true")
    p.add_argument("--scale-mb", type=int, default=0)
    p.add_argument("--torch-consolidate", action="store_true")
    p.add_argument("--no-expected", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    full = full_tensors(a.scale_mb)
    mapping = None
    if a.mapping:
        names = sorted(full)
        mapping = {k: 1 + (i % 3) for i, k in enumerate(names)}
        with open(os.path.join(a.out, "mapping.json"), "w") as f:
            json.dump(mapping, f)
    mp.spawn(run, args=(a.world_size, free_port(), a.out, mapping, a.scale_mb), nprocs=a.world_size)
    if not a.no_expected:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(a.out, "expected.safetensors"))
    if a.torch_consolidate:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        floats = {k: (mapping or {}).get(k, 1) for k, v in full.items() if v.dtype.is_floating_point}
        # Only float tensors: torch 2.13 crashes on integer dtypes (torch.finfo).
        # consolidate_safetensors_files globs every shard; entries not in the mapping are skipped.
        os.makedirs(os.path.join(a.out, "torch"), exist_ok=True)
        consolidate_safetensors_files(os.path.join(a.out, "sharded"), os.path.join(a.out, "torch"), floats)
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
