"""DCP native checkpoints from real torch, for titan-ckpt's interop tests.

usage:
  ckpt_dcp_native.py save DIR --world-size W [--zstd]
      torch dcp.save from W gloo ranks (FileSystemWriter, optionally _extensions=[ZStandard()]) of
      the DTensors of ckpt_write_dcp_hf.full_tensors (Shard(0)/Shard(1)/Replicate) plus a bytes
      item `train_state.step` = 7; writes DIR/../expected.safetensors with the full tensors.
  ckpt_dcp_native.py load DIR EXPECTED.safetensors
      torch dcp.load (no process group) of DIR into tensors shaped like EXPECTED; every tensor
      must be torch.equal and `train_state.step` must be 7. Prints "ok N".
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DeviceMesh, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_write_dcp_hf import full_tensors, placement  # noqa: E402


def run(rank, world, port, out, zstd):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", list(range(world)))
    sd = {k: distribute_tensor(v, mesh, placement(k)) for k, v in full_tensors(0).items()}
    sd["train_state.step"] = 7
    ext = {}
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        ext["_extensions"] = [ZStandard()]
    dcp.save(sd, storage_writer=FileSystemWriter(out, **ext))
    dist.barrier()
    dist.destroy_process_group()


def main():
    if sys.argv[1] == "save":
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("dir")
        p.add_argument("--world-size", type=int, default=2)
        p.add_argument("--zstd", action="store_true")
        a = p.parse_args()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(run, args=(a.world_size, port, a.dir, a.zstd), nprocs=a.world_size)
        save_file(full_tensors(0), os.path.join(os.path.dirname(os.path.abspath(a.dir)), "expected.safetensors"))
        print("ok")
    else:
        d, expected = sys.argv[2], sys.argv[3]
        exp = load_file(expected)
        sd = {k: torch.zeros_like(v) for k, v in exp.items()}
        sd["train_state.step"] = 0
        dcp.load(sd, checkpoint_id=d)
        for k, v in exp.items():
            if not torch.equal(sd[k], v):
                sys.exit(f"{k} differs after dcp.load")
        if sd["train_state.step"] != 7:
            sys.exit(f"train_state.step = {sd['train_state.step']!r}")
        print(f"ok {len(exp)}")


if __name__ == "__main__":
    main()
