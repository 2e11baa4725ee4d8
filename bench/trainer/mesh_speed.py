"""Throughput and per-rank peak memory of titan-train against torchtitan 0.3.0's Trainer on the
same mesh layouts, on this CPU (gloo for torchtitan, titan's cpu backend), same command line,
same seed checkpoint and data, fp32.

  .venv-tt/bin/python bench/trainer/mesh_speed.py TITAN_TRAIN [--steps N] [--seq-len S] [--batch B]
      [--repeats R] [--module M --config C] [LAYOUT ...]

LAYOUT is tt_parity.py's `name:torchtitan_nproc:titan_nproc:extra args`; the default set is 1
process, FSDP on 2 and 4 ranks, TP2 and FSDP2 x TP2. `--module`/`--config` pick the model (default
llama3's debug model; e.g. `--module qwen3 --config qwen3_moe_debug`, both trainers from that
config's own seed checkpoint). Per run: tokens/s per rank (median over the
steps after the first two; titan's from its metrics.jsonl, torchtitan's from the wall time between
its logged steps, each counting local_batch x seq_len tokens per step and dividing them, as
torchtitan's own figure does, by the ranks that share a data-parallel rank's batch, cp x tp x pp)
and rank 0's peak RSS.
Medians over R repeats. Prints a markdown table and the command line.
"""

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))

import tt_parity  # noqa: E402
from tt_parity import common_args, seed_checkpoint, titan, torchtitan, write_assets  # noqa: E402

DEFAULT_LAYOUTS = [
    "single:1:1:",
    "fsdp2:2:2:",
    "fsdp4:4:4:",
    "tp2:2:2:--parallelism.tensor_parallel_degree 2 --parallelism.spmd_backend partial_dtensor",
    "fsdp2tp2:4:4:--parallelism.tensor_parallel_degree 2 --parallelism.spmd_backend partial_dtensor",
]


def model_parallel(extra):
    """cp x tp x pp of a layout's arguments: the ranks one data-parallel rank's tokens are shared
    by (torchtitan's `non_data_parallel_size`, by which it divides its tokens/s)."""
    args = shlex.split(extra)
    n = 1
    for key in ("context", "tensor", "pipeline"):
        flag = f"--parallelism.{key}_parallel_degree"
        if flag in args:
            n *= int(args[args.index(flag) + 1])
    return n


def rows(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def main():
    ap = argparse.ArgumentParser(prog="mesh_speed.py")
    ap.add_argument("titan_train")
    ap.add_argument("layouts", nargs="*", default=DEFAULT_LAYOUTS)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--module", default="llama3")
    ap.add_argument("--config", default="llama3_debugmodel")
    a = ap.parse_args()
    tt_parity.MODULE[0] = a.module
    work = tempfile.mkdtemp(prefix="mesh-speed-")
    assets = write_assets(work)
    seed = seed_checkpoint(work, assets, a.config)
    tokens = a.seq_len * a.batch
    table = []
    for spec in a.layouts:
        name, tt_n, titan_n, extra = spec.split(":", 3)
        results = {"torchtitan": [], "titan": []}
        for rep in range(a.repeats):
            for who in ("torchtitan", "titan"):
                dump = os.path.join(work, f"{name}-{who}-{rep}")
                args = common_args(assets, a.steps, config=a.config) + [
                    "--dump_folder", dump, "--checkpoint.enable", "--checkpoint.initial_load_path", seed,
                    "--checkpoint.interval", str(a.steps + 1), "--training.seq_len", str(a.seq_len),
                    "--training.local_batch_size", str(a.batch), "--metrics.log_freq", "1",
                ] + shlex.split(extra)
                if who == "torchtitan":
                    log = os.path.join(dump, "steps.jsonl")
                    torchtitan(int(tt_n), args, log)
                    r = rows(log)
                    dts = [b["time"] - x["time"] for x, b in zip(r, r[1:])][2:]
                    tps = statistics.median(tokens / dt for dt in dts) / model_parallel(extra)
                    rss = int(open(f"{log}.maxrss.0").read())
                else:
                    titan(a.titan_train, int(titan_n), args + ["--observability.enable=false"])
                    r = [x for x in rows(os.path.join(dump, "metrics.jsonl")) if x.get("kind") == "train"]
                    tps = statistics.median(x["tps"] for x in r[3:])
                    rss = int(r[-1]["peak_rss_gib"] * (1 << 30))
                results[who].append((tps, rss))
                # A large model's checkpoints fill the disk: only the figures are kept.
                shutil.rmtree(os.path.join(dump, "checkpoint"), ignore_errors=True)
        med = {w: (statistics.median(t for t, _ in v), statistics.median(m for _, m in v)) for w, v in results.items()}
        table.append((name, med))
        print(f"{name}: {med}", file=sys.stderr)
    print("| layout | torchtitan tok/s/rank | titan tok/s/rank | ratio | torchtitan peak RSS (rank 0) | titan peak RSS (rank 0) |")
    print("|---|---|---|---|---|---|")
    for name, med in table:
        (tt, tm), (ti, im) = med["torchtitan"], med["titan"]
        print(f"| {name} | {tt:.0f} | {ti:.0f} | {ti / tt:.2f}x | {tm / 2**20:.0f} MiB | {im / 2**20:.0f} MiB |")
    print(f"\n`.venv-tt/bin/python bench/trainer/mesh_speed.py {a.titan_train} --steps {a.steps} "
          f"--seq-len {a.seq_len} --batch {a.batch} --repeats {a.repeats} --module {a.module} "
          f"--config {a.config}`")


if __name__ == "__main__":
    main()
