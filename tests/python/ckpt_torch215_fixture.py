"""Writes tests/fixtures/ckpt/torch-2.15/: small DCP checkpoints saved by torch 2.15, whose
`.metadata` pickles TensorProperties as a 6-tuple (with `strides`).

Recipe (a throwaway torch 2.15 CPU environment; the repo's .venv-tt is one):
  python -m venv /tmp/t215 && /tmp/t215/bin/pip install torch==2.15.0 safetensors \
      --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
  /tmp/t215/bin/python tests/python/ckpt_torch215_fixture.py tests/fixtures/ckpt/torch-2.15

Outputs: one/ (one process: f32, bf16, int64, a 0-d tensor and a bytes item), two/ (2 gloo
ranks: DTensor Shard(0), Shard(1) and Replicate, uneven), expected.safetensors (every tensor).
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import save_file


def tensors():
    g = torch.Generator().manual_seed(215)
    return {
        "w.f32": torch.randn(7, 5, generator=g),
        "w.bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "ids.i64": torch.arange(11, dtype=torch.int64) * 3 - 7,
        "scalar.f32": torch.tensor(2.5),
    }


def rank_main(rank, world, out, port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    t = tensors()
    sd = {
        "w.f32": distribute_tensor(t["w.f32"], mesh, [Shard(0)]),
        "w.bf16": distribute_tensor(t["w.bf16"], mesh, [Shard(1)]),
        "ids.i64": distribute_tensor(t["ids.i64"], mesh, [Replicate()]),
        "scalar.f32": t["scalar.f32"],
    }
    dcp.save(sd, checkpoint_id=os.path.join(out, "two"))
    dist.destroy_process_group()


def main(out):
    assert torch.__version__.startswith("2.15"), torch.__version__
    os.makedirs(out, exist_ok=True)
    t = tensors()
    dcp.save(dict(t, step=7), checkpoint_id=os.path.join(out, "one"))
    save_file(t, os.path.join(out, "expected.safetensors"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, out, port), nprocs=2, join=True)


if __name__ == "__main__":
    main(sys.argv[1])
