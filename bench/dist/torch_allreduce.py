"""The PyTorch reference for titan's all_reduce benchmark: torch.distributed with gloo on CPU,
same sizes (f32), same timing (barrier, then one all_reduce; median over iterations of the
slowest rank), busbw as nccl-tests defines it.

usage: torch_allreduce.py --ranks 2,4 --max-mb 256 --iters 5 [--json]
"""
import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def sizes(max_mb):
    mb = 1
    while mb <= max_mb:
        yield mb << 20
        mb *= 4


def worker(rank, world, port, max_mb, iters, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for nbytes in sizes(max_mb):
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        dist.all_reduce(t)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        if rank == 0:
            out.put((world, nbytes, med.item()))
    dist.destroy_process_group()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--max-mb", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{'ranks':>5} {'size':>9} {'time_ms':>10} {'algbw':>10} {'busbw':>10}  (torch {torch.__version__} gloo)")
    for world in [int(r) for r in a.ranks.split(",")]:
        q = ctx.Queue()
        mp.start_processes(worker, args=(world, free_port(), a.max_mb, a.iters, q), nprocs=world,
                           start_method="spawn", join=True)
        while not q.empty():
            n, nbytes, secs = q.get()
            algbw = nbytes / secs / 1e9
            busbw = algbw * 2 * (n - 1) / n
            if a.json:
                print(json.dumps(dict(ranks=n, bytes=nbytes, time_s=secs, algbw_gbps=algbw, busbw_gbps=busbw)))
            else:
                print(f"{n:>5} {nbytes >> 20:>7}MB {secs * 1e3:>10.2f} {algbw:>8.2f}GB/s {busbw:>6.2f}GB/s")


if __name__ == "__main__":
    main()
