"""Writes a torchtitan run folder with torchtitan 0.3.0's own structured logger.

Usage: tt_obs_make_run.py OUT [--ranks 2] [--steps 6] [--straggler-rank 1]
                              [--straggler-ms 25] [--expected EXPECTED.json] [--skew-ms MS]

Every rank is a separate process (forked, RANK/LOCAL_RANK set like torchrun does) that calls
`init_structured_logger(source="training", output_dir=OUT)` exactly as torchtitan's train.py
does, then runs the trainer's phase structure (torchtitan/trainer.py): `step` around
`fetching_batch`, `fwd_bwd`, `optim`, `collect_dist_metrics`, with `metric_value` scalars,
`checkpoint_save` (tag + span, as components/checkpointer/dcp.py) every 3rd step, `eval`
(tag + span, as components/validate.py) on the last step, and one `checkpoint_save` that
raises (an `_error` record before its `_end`). Ranks meet at a barrier at the end of
`fwd_bwd` like data-parallel ranks in the gradient all-reduce, so `--straggler-rank` is slower
in `fwd_bwd` and the others wait in `optim`.

`--expected` writes an independent pairing of the JSONL (LIFO per (file, task_name), as
torchtitan's gantt_generator documents it): per phase the count and total of the `_end`
records' `value` in ns, and the tagged steps, for the Rust tests to compare against.
"""

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path


def rank_main(rank, world, out, steps, straggler_rank, straggler_ms, skew_ms, barrier):
    if skew_ms and rank >= world // 2:
        # The second half of the ranks plays a second host whose wall clock is `skew_ms`
        # ahead: the logger reads socket.gethostname() and the logging module's time.
        import socket

        socket.gethostname = lambda: "node1"
        real_time, real_time_ns = time.time, time.time_ns
        time.time = lambda: real_time() + skew_ms / 1000
        time.time_ns = lambda: real_time_ns() + int(skew_ms * 1e6)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    from torchtitan.observability import structured_logger as sl

    rng = random.Random(1234 + rank)
    sl.init_structured_logger(source="training", output_dir=out)
    sl.log_trace_instant("structured_logger_started")
    with sl.log_trace_span("torch_distributed_init"):
        time.sleep(0.002)
    sl.log_trace_instant("training_start")
    for step in range(1, steps + 1):
        sl.set_step(step, relative_step=step)
        with sl.log_trace_span("step"):
            with sl.log_trace_span("fetching_batch"):
                time.sleep(0.001 + rng.random() * 0.0005)
            sl.log_trace_scalar({"local_valid_tokens": 2048 + rank})
            with sl.log_trace_span("fwd_bwd"):
                extra = straggler_ms / 1000 if rank == straggler_rank else 0.0
                time.sleep(0.008 + extra + rng.random() * 0.001)
            barrier.wait()
            with sl.log_trace_span("optim"):
                time.sleep(0.002)
            with sl.log_trace_span("collect_dist_metrics"):
                sl.log_trace_scalar(
                    {"global_valid_tokens": 2048 * world, "loss": 10.0 / step + rank}
                )
            if step % 3 == 0:
                sl.add_step_tag("checkpoint_save")
                try:
                    with sl.log_trace_span("checkpoint_save"):
                        time.sleep(0.004)
                        if step == 3 and rank == 0:
                            raise OSError("disk full (injected)")
                except OSError:
                    pass
            if step == steps:
                sl.add_step_tag("eval")
                with sl.log_trace_span("eval"):
                    time.sleep(0.003)
    logging_shutdown()


def logging_shutdown():
    import logging

    logging.shutdown()


def independent_pairing(out):
    """Counts and totals per phase from the raw JSONL, without titan."""
    phases = defaultdict(lambda: {"count": 0, "total_ns": 0})
    tagged = defaultdict(set)
    scalars = defaultdict(int)
    for path in sorted((Path(out) / "structured_logs").glob("*.jsonl")):
        stacks = defaultdict(list)
        for line in path.read_text().splitlines():
            r = json.loads(line)
            name = r["log_type_name"]
            for t in r.get("step_tags", []):
                tagged[r["step"]].add(t)
            if r["log_type"] == "instant":
                if name == "metric_value":
                    scalars[r["event_name"]] += 1
                continue
            key = r.get("task_name")
            if name.endswith("_start"):
                stacks[key].append(name[: -len("_start")])
            elif name.endswith("_end"):
                base = stacks[key].pop()
                assert base == name[: -len("_end")], (path, base, name)
                phases[base]["count"] += 1
                phases[base]["total_ns"] += int(r["value"] * 1e6 + 0.5)
    return {
        "phases": phases,
        "tagged_steps": {str(k): sorted(v) for k, v in sorted(tagged.items())},
        "scalars": scalars,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--straggler-rank", type=int, default=1)
    p.add_argument("--straggler-ms", type=float, default=25.0)
    p.add_argument("--expected")
    p.add_argument(
        "--skew-ms",
        type=float,
        default=0.0,
        help="ranks in the second half log host `node1` with a clock this far ahead",
    )
    a = p.parse_args()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(a.ranks)
    procs = [
        ctx.Process(
            target=rank_main,
            args=(
                r,
                a.ranks,
                a.out,
                a.steps,
                a.straggler_rank,
                a.straggler_ms,
                a.skew_ms,
                barrier,
            ),
        )
        for r in range(a.ranks)
    ]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
        if pr.exitcode != 0:
            sys.exit(f"rank process exited with {pr.exitcode}")
    if a.expected:
        Path(a.expected).write_text(json.dumps(independent_pairing(a.out), indent=1))


if __name__ == "__main__":
    main()
