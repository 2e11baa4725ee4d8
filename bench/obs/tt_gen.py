"""A torchtitan-format run for benchmarks, written by torchtitan 0.3.0's own structured logger.

  tt_gen.py OUT [--ranks 256] [--steps 1000] [--procs 2] [--seed 0]

Every rank's file is written by `init_structured_logger(source="training", ...)` and
`log_trace_span` / `log_trace_scalar` / `set_step` / `add_step_tag`, with torchtitan's trainer
phase structure (torchtitan/trainer.py): `step` { `fetching_batch`, `local_valid_tokens`,
`fwd_bwd`, `optim`, `collect_dist_metrics` { `global_valid_tokens`, `loss` } }, plus
`checkpoint_save` (tag + span) every 100 steps and `eval` every 250. To write 256 ranks x 1000
steps in minutes instead of the hours the real phases would take, the logger's clock is
simulated: its `timer` (perf_counter, for span durations) and the `time.time`/`time.time_ns`
the logging module stamps records with advance by the simulated phase durations instead of
sleeping. Each worker process writes several ranks in turn (the logger is re-initialised per
rank: handler closed, `_is_initialized` reset, RANK/LOCAL_RANK/hostname set). 8 ranks per
host (`node<k>`), each host's wall clock off by a few ms; rank 17 is 1.3x slower in `fwd_bwd`.
"""

import argparse
import logging
import multiprocessing as mp
import os
import random
import socket
import time

EPOCH = 1_790_000_000.0
RANKS_PER_HOST = 8


class Clock:
    def __init__(self):
        self.now = 0.0
        self.skew = 0.0

    def timer(self):
        return self.now

    def time(self):
        return EPOCH + self.now + self.skew

    def time_ns(self):
        return int(self.time() * 1e9)


def write_ranks(out, ranks, world, steps, seed):
    clock = Clock()
    time.time = clock.time
    time.time_ns = clock.time_ns
    from torchtitan.observability import structured_logger as sl
    from torchtitan.observability.structured_logger import step_state
    from torchtitan.observability.structured_logger import structured_logging as slm

    slm.timer = clock.timer
    for rank in ranks:
        host = rank // RANKS_PER_HOST
        rng = random.Random(seed * 100_003 + rank)
        host_rng = random.Random(seed * 7 + host)
        clock.now = 0.0
        clock.skew = 0.0 if host == 0 else host_rng.uniform(-0.005, 0.005)
        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(rank % RANKS_PER_HOST)
        socket.gethostname = lambda h=host: f"node{h}"
        for h in list(slm._structured_logger.handlers):
            slm._structured_logger.removeHandler(h)
            h.close()
        slm._is_initialized = False
        # A fresh process would start without a step.
        step_state._STEP_GLOBAL = step_state._RELATIVE_STEP_GLOBAL = None
        step_state._STEP_CV.set(None)
        step_state._RELATIVE_STEP_CV.set(None)
        sl.clear_step_tags()
        sl.init_structured_logger(source="training", output_dir=out, rank=rank)
        sl.log_trace_instant("structured_logger_started")
        with sl.log_trace_span("torch_distributed_init"):
            clock.now += 1.5
        sl.log_trace_instant("training_start")
        slow = 1.3 if rank == 17 else 1.0
        for step in range(1, steps + 1):
            # Data-parallel ranks start each step together (after the previous step's
            # collectives): one step grid for all ranks, each phase jittered.
            clock.now = 2.0 + (step - 1) * 1.0
            sl.set_step(step)
            with sl.log_trace_span("step"):
                with sl.log_trace_span("fetching_batch"):
                    clock.now += 0.004 * (1 + 0.1 * rng.random())
                sl.log_trace_scalar({"local_valid_tokens": 8192 - rng.randrange(64)})
                with sl.log_trace_span("fwd_bwd"):
                    clock.now += 0.55 * slow * (1 + 0.03 * rng.random())
                with sl.log_trace_span("optim"):
                    clock.now += 0.08 * (1 + 0.03 * rng.random())
                with sl.log_trace_span("collect_dist_metrics"):
                    clock.now += 0.002
                    sl.log_trace_scalar(
                        {
                            "global_valid_tokens": 8192 * world,
                            "loss": 8.0 / (1 + step / 100) + 0.01 * rng.random(),
                        }
                    )
                if step % 100 == 0:
                    sl.add_step_tag("checkpoint_save")
                    with sl.log_trace_span("checkpoint_save"):
                        clock.now += 0.2
                if step % 250 == 0:
                    sl.add_step_tag("eval")
                    with sl.log_trace_span("eval"):
                        clock.now += 0.1
    for h in list(slm._structured_logger.handlers):
        h.close()
    logging.shutdown()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    t = time.perf_counter()
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(
            target=write_ranks,
            args=(a.out, list(range(i, a.ranks, a.procs)), a.ranks, a.steps, a.seed),
        )
        for i in range(a.procs)
    ]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
        if pr.exitcode != 0:
            raise SystemExit(f"worker exited with {pr.exitcode}")
    print(f"wrote {a.ranks} ranks x {a.steps} steps in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
