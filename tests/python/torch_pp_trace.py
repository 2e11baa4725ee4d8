"""A real `torch.distributed.pipelining` run (gloo, CPU) under `torch.profiler`, as torchtitan's
PP runs with its profiler on: 2 ranks, 4 stages (a looped schedule: stages r and r+2 on rank
r), 8 microbatches, 3 steps of which the profiler keeps the last 2, one Chrome trace per rank.
Its schedule runtime names every action `PP:<stage><type><microbatch>`; `titan-obs summary`
reads the pipeline from them.

Run with torch 2.15 under torchrun: torch_pp_trace.py SCHEDULE OUT_DIR
(SCHEDULE: Interleaved1F1B or InterleavedZeroBubble)
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.profiler import ProfilerActivity, profile, schedule

MICROBATCHES, DIM = 8, 256
schedule_name, out = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")
torch.manual_seed(0)
n_stages = 2 * world
layers = [torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU()) for _ in range(n_stages)]
stages = [
    PipelineStage(layers[s], s, n_stages, torch.device("cpu"))
    for s in range(n_stages)
    if s % world == rank
]
cls = {
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
}[schedule_name]
pipe = cls(stages, n_microbatches=MICROBATCHES, loss_fn=lambda o, t: ((o - t) ** 2).mean())
x, target = torch.randn(4 * MICROBATCHES, DIM), torch.randn(4 * MICROBATCHES, DIM)


def save(p):
    p.export_chrome_trace(os.path.join(out, f"rank{rank}.json"))


with profile(
    activities=[ProfilerActivity.CPU],
    schedule=schedule(wait=0, warmup=1, active=2),
    on_trace_ready=save,
) as prof:
    for _ in range(3):
        if rank == 0:
            pipe.step(x, target=target)
        else:
            pipe.step(target=target)
        prof.step()
dist.destroy_process_group()
