"""Writes DCP native checkpoints with torch 2.13 for titan-ckpt's reader tests.

usage: dcp_torch_save.py OUT

OUT/single, OUT/single_zstd: one process, many dtypes, a scalar, an empty tensor, a transposed
view, and non-tensor state (bytes items). OUT/multi, OUT/multi_zstd: two gloo ranks saving DTensors
(Shard(0) uneven, Shard(1), Replicate) so tensors have several chunks. OUT/ref/<fqn>.bin holds each
full tensor's row-major bytes, OUT/ref/index.json dtypes, shapes and the bytes items' values.
"""

import io
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

warnings.filterwarnings("ignore")


def full_tensors():
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(5, 7, generator=g)
    return {
        "model.f32": f32,
        "model.bf16": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "model.f16": torch.randn(3, 5, generator=g).to(torch.float16),
        "model.i64": torch.arange(-20, 15, dtype=torch.int64).reshape(5, 7),
        "model.i32": torch.arange(12, dtype=torch.int32),
        "model.u8": torch.arange(200, 216, dtype=torch.uint8).reshape(4, 4),
        "model.bool": torch.tensor([True, False, False, True, True]),
        "model.f64": torch.randn(2, 3, 2, generator=g, dtype=torch.float64),
    }


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


OBJECTS = {
    "step": 1234,
    "meta.lr": 0.125,
    "meta.name": "run-α",
    "meta.milestones": [10, 20, 30],
    "meta.flags": [True, None, "x"],
}


def single_state():
    sd = dict(full_tensors())
    sd["model.scalar"] = torch.tensor(3.5)
    sd["model.empty"] = torch.zeros(0, 3)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd["model.transposed"] = base.t()
    sd.update(OBJECTS)
    return sd


def write_ref(out, sd):
    ref = os.path.join(out, "ref")
    os.makedirs(ref, exist_ok=True)
    index = {"tensors": {}, "objects": {}}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            with open(os.path.join(ref, k + ".bin"), "wb") as f:
                f.write(raw(v))
            index["tensors"][k] = {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
        else:
            index["objects"][k] = v
    with open(os.path.join(ref, "index.json"), "w") as f:
        json.dump(index, f, ensure_ascii=False)


def multi_rank(rank, world, out, port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    placements = {
        "model.f32": [Shard(0)],  # 5 rows over 2 ranks: 3 + 2
        "model.bf16": [Shard(1)],
        "model.f16": [Shard(0)],
        "model.i64": [Shard(1)],  # 7 columns: 4 + 3
        "model.i32": [Replicate()],
        "model.u8": [Shard(0)],
        "model.bool": [Shard(0)],
        "model.f64": [Shard(2)],
    }
    sd = {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items()}
    sd.update(OBJECTS)
    for name, ext in (("multi", None), ("multi_zstd", [ZStandard()])):
        dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(out, name), _extensions=ext))
    dist.barrier()
    dist.destroy_process_group()


def write_items(out):
    """Plain torch.save files: contiguous tensors (for byte comparison with our writer) and views
    that keep a larger storage (offsets, strides) for the reader's gather path."""
    items = os.path.join(out, "items")
    os.makedirs(items, exist_ok=True)
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    cases = dict(full_tensors())
    cases["scalar"] = torch.tensor(7, dtype=torch.int64)
    cases["view_offset"] = base[1:3, 2:5]
    cases["view_step"] = base[:, ::3]
    cases["view_t"] = base.t()[2:5]
    index = {}
    for name, t in cases.items():
        if name.startswith("view"):
            # Saved to a path: the zip's folder is then the file's stem, not "archive".
            torch.save(t, os.path.join(items, name + ".pt"))
        else:
            # Saved to a stream, as DCP does: folder "archive".
            buf = io.BytesIO()
            torch.save(t, buf)
            with open(os.path.join(items, name + ".pt"), "wb") as f:
                f.write(buf.getvalue())
        with open(os.path.join(items, name + ".bin"), "wb") as f:
            f.write(raw(t))
        index[name] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "contiguous_whole_storage": t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size(),
        }
    with open(os.path.join(items, "index.json"), "w") as f:
        json.dump(index, f)


def main():
    out = sys.argv[1]
    write_items(out)
    sd = single_state()
    dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(out, "single")))
    dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(out, "single_zstd"), _extensions=[ZStandard()]))
    write_ref(out, sd)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(multi_rank, args=(2, out, port), nprocs=2)


if __name__ == "__main__":
    main()
