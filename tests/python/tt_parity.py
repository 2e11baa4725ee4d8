"""Loss parity between torchtitan 0.3.0's Trainer and titan-train, from the same seed checkpoint.

Both trainers get the same command line (torchtitan 0.3.0's: `--module llama3 --config
llama3_debugmodel --dataloader.dataset_path ...`), start from the seed checkpoint torchtitan writes
with `--checkpoint.create_seed_checkpoint`, read the same `.jsonl` data with the same
`tokenizer.json`, in fp32, and report every step's loss and grad norm at full precision:
torchtitan's through a wrapper of its MetricsProcessor.log, titan's in its metrics.jsonl.

Each layout also runs a resume: the unbroken run saves a full checkpoint every RESUME_AT steps,
and a second run, in a folder that starts with its save at RESUME_AT and its rows up to there,
resumes from it and trains to the end. Its losses must equal the unbroken run's. titan-train
always resumes; torchtitan resumes its own save only with --tt-resume (that checks torchtitan,
and the cross-back run already resumes torchtitan from a save). (--cross and --cross-back resume
the other trainer from that save the same way.) `--resume-at 0` runs no resume: each trainer
trains once, saving only at the end (a large model's full saves and reloads cost minutes).

Run with torch 2.15 + torchtitan 0.3.0 (TITAN_TT_PYTHON):

  tt_parity.py compare WORKDIR TITAN_TRAIN LAYOUT [LAYOUT ...] [--steps N] [--resume-at K] [--rtol R]
      [--cross] [--cross-back] [--config NAME] [--titan-args ARGS] [--tt-float8 emulate|scaled]
      [--clean] [--buffers PATTERN] [--seed-from DIR] [--tt-resume]
      LAYOUT is `name:torchtitan_nproc:titan_nproc:extra args`, e.g. `dp2:2:2:` (FSDP on 2 ranks
      against titan's 2 data-parallel ranks) or `tp2:2:2:--parallelism.tensor_parallel_degree 2`.
      Prints one line per step and a JSON summary as the last line; exits 1 when a loss or grad
      norm differs by more than RTOL (relative), 2 on usage errors.
      --config picks the registry function both trainers start from (the seed checkpoint is always
      llama3_debugmodel's); --titan-args go to titan-train only. --tt-float8 makes torchtitan's
      float8 converter run on a CPU: `emulate` sets its emulate=True (which torchtitan 0.3.0 turns
      into the tensorwise recipe), `emulate-fsdp-all-gather` also turns on torchao's FSDP float8
      all-gather (a key torchtitan 0.3.0 no longer has), `scaled` keeps its recipe (rowwise) and
      lets torchao call torch._scaled_mm, which has a CPU kernel (torchtitan only checks for a
      CUDA capability).

  tt_parity.py make DIR llama3-seed   torchtitan's model-only fp32 seed checkpoint of
      llama3_debugmodel in DIR/seed (what `compare --clean` makes for llama3), for --seed-from DIR:
      the tests of one binary share it instead of each launching torchtitan to make the same one.

  tt_parity.py rank ARGS...      one torchtitan rank, as torch.distributed.run would start it
"""

import argparse
import dataclasses
import atexit
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tt_ckpt_trainer import fork_ranks, free_port, patch_for_cpu, write_assets  # noqa: E402

LOSSES_ENV = "TITAN_PARITY_LOSSES"
FLOAT8_ENV = "TITAN_PARITY_FLOAT8"


def patch_float8(mode):
    """torchtitan 0.3.0's float8 converter on a CPU (see --tt-float8)."""
    import torchtitan.components.quantization.float8 as f8

    if mode == "scaled":
        f8.has_cuda_capability = lambda *a, **k: True
    elif mode in ("emulate", "emulate-fsdp-all-gather"):
        init = f8.Float8LinearConverter.__init__

        def emulated(self, config):
            config.emulate = True
            init(self, config)
            if mode == "emulate-fsdp-all-gather":
                # torchtitan 0.3.0 dropped the key; torchao 0.18 still gathers in float8.
                self.torchao_config = dataclasses.replace(
                    self.torchao_config, enable_fsdp_float8_all_gather=True)

        f8.Float8LinearConverter.__init__ = emulated


def metrics_rank(args):
    """The rank whose MetricsProcessor has the loss: 0, or under pipeline parallelism the first
    rank of the last stage (torchtitan's `_get_metrics_rank`; its other ranks log -1)."""
    pp = int(args[args.index("--parallelism.pipeline_parallel_degree") + 1]) \
        if "--parallelism.pipeline_parallel_degree" in args else 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return 0 if pp <= 1 else world - world // pp


def rank_main(args):
    """One torchtitan rank: the CPU patches, plus the rank that has the loss appends each logged
    step's loss and grad norm (full precision) to $TITAN_PARITY_LOSSES."""
    patch_for_cpu()
    if os.environ.get(FLOAT8_ENV):
        patch_float8(os.environ[FLOAT8_ENV])
    from torchtitan.components import metrics

    out = os.environ.get(LOSSES_ENV)
    log = metrics.MetricsProcessor.log

    def recording_log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if out and int(os.environ.get("RANK", "0")) == metrics_rank(args):
            with open(out, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm),
                                    "time": time.time()}) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    metrics.MetricsProcessor.log = recording_log
    if out:
        # Each rank's peak resident memory, for bench/trainer/mesh_speed.py.
        rank = os.environ.get("RANK", "0")
        atexit.register(lambda: open(f"{out}.maxrss.{rank}", "w").write(
            str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
    from torchtitan import train

    sys.argv = ["torchtitan.train"] + args
    train.main()


MODULE = ["llama3"]


def common_args(assets, steps, total_steps=None, config="llama3_debugmodel"):
    """The command line both trainers get (torchtitan 0.3.0's keys). `total_steps` fixes the lr
    schedule's length, so a run stopped early and resumed follows the unbroken run's schedule."""
    tok, data = assets
    return [
        "--module", MODULE[0], "--config", config,
        "--hf_assets_path", tok, "--dataloader.dataset_path", data,
        "--training.seq_len", "128", "--training.local_batch_size", "2",
        "--training.steps", str(steps), "--training.mixed_precision_param", "float32",
        "--validator.no-enable", "--debug.seed", "7",
    ] + (["--lr_scheduler.total_steps", str(total_steps)] if total_steps else [])


def run(cmd, env, what):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{what} failed ({p.returncode}): {shlex.join(cmd)}\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    return p


def torchtitan(nproc, args, losses):
    """torchtitan's Trainer on NPROC ranks (forked, see tt_ckpt_trainer.fork_ranks)."""
    env = dict(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **{LOSSES_ENV: losses})
    os.makedirs(os.path.dirname(os.path.abspath(losses)), exist_ok=True)
    fork_ranks(nproc, rank_main, args, env, losses, "torchtitan's Trainer")


TITAN_ARGS = []


def titan(binary, nproc, args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    run([binary] + launch + args + TITAN_ARGS, env, "titan-train")


def read_jsonl(path, kind=None):
    rows = []
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            if kind is None or r.get("kind") == kind:
                rows.append({"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"]})
    return rows


def first_leg(src, dst, step, who):
    """Starts the run in DST that resumes at STEP from the unbroken run in SRC: its checkpoint
    folder gets SRC's save at STEP (a full one: the interval is RESUME_AT) and its log the rows
    SRC logged up to STEP. Training those steps again gave the same checkpoint and rows (the same
    command line, seed and data up to there) at a third more trainer launches per layout."""
    ckpt = os.path.join(dst, "checkpoint")
    os.makedirs(ckpt)
    shutil.copytree(os.path.join(src, "checkpoint", f"step-{step}"), os.path.join(ckpt, f"step-{step}"))
    log = "parity_losses.jsonl" if who == "torchtitan" else "metrics.jsonl"
    with open(os.path.join(src, log)) as f, open(os.path.join(dst, log), "w") as out:
        for line in f:
            r = json.loads(line)
            if (who == "torchtitan" or r.get("kind") == "train") and r["step"] <= step:
                out.write(line)


def seed_checkpoint(workdir, assets, config="llama3_debugmodel", model_only=False):
    """torchtitan's seed checkpoint (one process): both trainers start from it. As the config
    saves its last step (llama3's and qwen3's registry configs: the optimizer too), or with
    MODEL_ONLY only the model in fp32 (qwen3 MoE's full seed is 3.6 GB; titan-train's
    `create_seed_checkpoint` is checked against the full one, tt_seed_init.py)."""
    seed_dir = os.path.join(workdir, "seed")
    step0 = os.path.join(seed_dir, "checkpoint", "step-0")
    if not os.path.exists(os.path.join(step0, ".metadata")):
        args = common_args(assets, 1, config=config) + [
            "--dump_folder", seed_dir, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
            "--parallelism.data_parallel_shard_degree", "1",
        ]
        if model_only:
            args += ["--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "float32"]
        torchtitan(1, args, os.path.join(workdir, "unused.jsonl"))
    return step0


def saved_buffers(dump, pattern):
    """The tensors whose keys contain PATTERN (e.g. a MoE model's `expert_bias_E`) in every
    checkpoint under DUMP, as {step: {key: [values]}}: read with torch's DCP reader."""
    import torch
    import torch.distributed.checkpoint as dcp

    out = {}
    root = os.path.join(dump, "checkpoint")
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not name.startswith("step-"):
            continue
        path = os.path.join(root, name)
        meta = dcp.FileSystemReader(path).read_metadata()
        keys = [k for k, m in meta.state_dict_metadata.items()
                if pattern in k and hasattr(m, "size")]
        sd = {k: torch.empty(meta.state_dict_metadata[k].size,
                             dtype=meta.state_dict_metadata[k].properties.dtype) for k in keys}
        if sd:
            dcp.load(sd, checkpoint_id=path, no_dist=True)
        out[name.split("-", 1)[1]] = {k: v.float().tolist() for k, v in sd.items()}
    return out


def checkpoint_args(a, seed, steps):
    """Checkpointing for a run that stops at STEPS: from the seed, a full save every RESUME_AT
    steps (a resume needs the optimizer, lr and data position). The run's last save is full
    too, unless --clean asks to spare the disk and the run trains to the end: then it holds
    only the model and its buffers, in fp32 (nothing resumes from it; a MoE model's biases are
    still compared), a third of a full save."""
    interval = a.resume_at or steps
    args = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed,
            "--checkpoint.interval", str(interval)]
    if a.clean and steps == a.steps:
        return args + ["--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "float32"]
    return args + ["--checkpoint.no-last-save-model-only"]


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def main():
    ap = argparse.ArgumentParser(prog="tt_parity.py compare")
    ap.add_argument("workdir")
    ap.add_argument("titan_train")
    ap.add_argument("layouts", nargs="+")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--resume-at", type=int, default=3,
                    help="the step the resumed runs start from; 0: no resumed runs")
    ap.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance for losses")
    ap.add_argument("--grad-rtol", type=float, default=None,
                    help="relative tolerance for grad norms (default: --rtol)")
    ap.add_argument("--only", choices=["both", "titan", "torchtitan"], default="both")
    ap.add_argument("--cross", action="store_true",
                    help="also resume titan-train from torchtitan's checkpoint at RESUME_AT (model, "
                         "optimizer, lr, data position) and compare its steps with torchtitan's")
    ap.add_argument("--cross-back", action="store_true",
                    help="also resume torchtitan from titan-train's checkpoint at RESUME_AT (model, "
                         "optimizer, lr, data position) and compare its steps with torchtitan's")
    ap.add_argument("--config", default="llama3_debugmodel",
                    help="the registry function both trainers start from")
    ap.add_argument("--module", default="llama3", help="the model family (torchtitan's --module)")
    ap.add_argument("--seed-config", default=None,
                    help="the registry function the seed checkpoint is made from (default: --config, "
                         "but llama3_debugmodel for llama3, whose float8 configs share its seed)")
    ap.add_argument("--titan-args", default="", help="arguments for titan-train only")
    ap.add_argument("--tt-float8", choices=["emulate", "emulate-fsdp-all-gather", "scaled"],
                    default=None,
                    help="how torchtitan's float8 converter runs on a CPU")
    ap.add_argument("--clean", action="store_true",
                    help="delete each run's checkpoints once its losses are read, and make a run's "
                         "final save and the seed model-only fp32 (a large model's checkpoints "
                         "would otherwise fill the disk)")
    ap.add_argument("--buffers", default=None, metavar="PATTERN",
                    help="also compare the checkpointed tensors whose keys contain PATTERN "
                         "(a MoE model's expert_bias_E) at every saved step: they must be equal")
    ap.add_argument("--seed-from", default=None, metavar="DIR",
                    help="use the seed checkpoint `make DIR llama3-seed` wrote (llama3 with --clean only)")
    ap.add_argument("--tt-resume", action="store_true",
                    help="also resume torchtitan from its own save at RESUME_AT (checks torchtitan)")
    ap.add_argument("--docs", type=int, default=None,
                    help="keep only the first N documents (a small N makes the runs re-loop the data)")
    a = ap.parse_args(sys.argv[2:])
    if a.resume_at == 0 and (a.cross or a.cross_back or a.tt_resume):
        print("--cross, --cross-back and --tt-resume resume from the save at RESUME_AT: they need "
              "--resume-at K > 0", file=sys.stderr)
        sys.exit(2)
    if not 0 <= a.resume_at < a.steps:
        print(f"--resume-at {a.resume_at}: want 0 (no resume) or a step before --steps {a.steps}",
              file=sys.stderr)
        sys.exit(2)
    if a.tt_float8:
        os.environ[FLOAT8_ENV] = a.tt_float8
    TITAN_ARGS.extend(shlex.split(a.titan_args))
    os.makedirs(a.workdir, exist_ok=True)
    assets = write_assets(a.workdir)
    if a.docs is not None:
        train = os.path.join(assets[1], "train.jsonl")
        lines = open(train).readlines()[: a.docs]
        open(train, "w").writelines(lines)
    MODULE[0] = a.module
    seed_config = a.seed_config or ("llama3_debugmodel" if a.module == "llama3" else a.config)
    if a.seed_from:
        if (seed_config, a.clean) != ("llama3_debugmodel", True):
            print("--seed-from holds llama3_debugmodel's model-only seed: it needs --clean and a "
                  f"llama3 config, not {seed_config}", file=sys.stderr)
            sys.exit(2)
        seed = os.path.join(os.path.abspath(a.seed_from), "seed", "checkpoint", "step-0")
        if not os.path.exists(os.path.join(seed, ".metadata")):
            print(f"--seed-from {a.seed_from}: no seed checkpoint at {seed}", file=sys.stderr)
            sys.exit(2)
    else:
        seed = seed_checkpoint(a.workdir, assets, seed_config, model_only=a.clean)

    summary = {"steps": a.steps, "resume_at": a.resume_at, "rtol": a.rtol, "layouts": {}}
    worst_loss = worst_grad = worst_buffer = 0.0
    compared_buffers = 0
    for spec in a.layouts:
        try:
            name, tt_n, titan_n, extra = spec.split(":", 3)
            tt_n, titan_n = int(tt_n), int(titan_n)
        except ValueError:
            print(f"layout `{spec}` is not name:torchtitan_nproc:titan_nproc:extra", file=sys.stderr)
            sys.exit(2)
        extra = shlex.split(extra)
        result = {}
        buffers = {}
        cross_dump = os.path.join(a.workdir, f"{name}-cross")
        cross_back_dump = os.path.join(a.workdir, f"{name}-cross-back")
        for who in ("torchtitan", "titan"):
            if a.only not in ("both", who):
                continue
            for mode in ("unbroken", "resumed"):
                if mode == "resumed" and (a.resume_at == 0 or (who == "torchtitan" and not a.tt_resume)):
                    continue
                dump = os.path.join(a.workdir, f"{name}-{who}-{mode}")
                losses = os.path.join(dump, "parity_losses.jsonl")
                args = (common_args(assets, a.steps, a.steps, a.config) + ["--dump_folder", dump]
                        + checkpoint_args(a, seed, a.steps) + extra)
                if who == "torchtitan":
                    torchtitan(tt_n, args, losses)
                else:
                    titan(a.titan_train, titan_n, args)
                if mode == "unbroken" and a.resume_at:
                    # The runs that resume at RESUME_AT start from this run's save there.
                    if who == "titan" or a.tt_resume:
                        first_leg(dump, os.path.join(a.workdir, f"{name}-{who}-resumed"), a.resume_at, who)
                    if who == "torchtitan" and a.cross and a.only == "both":
                        first_leg(dump, cross_dump, a.resume_at, who)
                    if who == "titan" and a.cross_back and a.only == "both":
                        first_leg(dump, cross_back_dump, a.resume_at, who)
                rows = read_jsonl(losses) if who == "torchtitan" else read_jsonl(os.path.join(dump, "metrics.jsonl"), "train")
                result[f"{who}_{mode}"] = rows
                if a.buffers:
                    buffers[f"{who}_{mode}"] = saved_buffers(dump, a.buffers)
                if a.clean:
                    shutil.rmtree(os.path.join(dump, "checkpoint"), ignore_errors=True)
        if a.cross and a.only == "both":
            # torchtitan's save at RESUME_AT (its unbroken run's, see first_leg); titan-train
            # resumes from that checkpoint in the same folder and trains on: its steps must be
            # torchtitan's unbroken run's.
            dump = cross_dump
            losses = os.path.join(dump, "parity_losses.jsonl")
            titan(a.titan_train, titan_n, common_args(assets, a.steps, a.steps, a.config) + ["--dump_folder", dump]
                  + checkpoint_args(a, seed, a.steps) + extra)
            first = [r for r in read_jsonl(losses) if r["step"] <= a.resume_at]
            rest = [r for r in read_jsonl(os.path.join(dump, "metrics.jsonl"), "train") if r["step"] > a.resume_at]
            result["torchtitan_then_titan"] = first + rest
            if a.buffers:
                buffers["torchtitan_then_titan"] = saved_buffers(dump, a.buffers)
            if a.clean:
                shutil.rmtree(os.path.join(dump, "checkpoint"), ignore_errors=True)
        if a.cross_back and a.only == "both":
            # titan-train's save at RESUME_AT (its unbroken run's); torchtitan resumes from that
            # checkpoint in the same folder and trains on: its steps must be its own unbroken run's.
            dump = cross_back_dump
            losses = os.path.join(dump, "parity_losses.jsonl")
            torchtitan(tt_n, common_args(assets, a.steps, a.steps, a.config) + ["--dump_folder", dump]
                       + checkpoint_args(a, seed, a.steps) + extra, losses)
            first = [r for r in read_jsonl(os.path.join(dump, "metrics.jsonl"), "train") if r["step"] <= a.resume_at]
            rest = [r for r in read_jsonl(losses) if r["step"] > a.resume_at]
            result["titan_then_torchtitan"] = first + rest
            if a.buffers:
                buffers["titan_then_torchtitan"] = saved_buffers(dump, a.buffers)
            if a.clean:
                shutil.rmtree(os.path.join(dump, "checkpoint"), ignore_errors=True)
        summary["layouts"][name] = result
        if a.buffers:
            # Every run's saved buffers against torchtitan's unbroken run's at the same step.
            ref_buffers = buffers.get("torchtitan_unbroken") or buffers.get("titan_unbroken") or {}
            for key, steps in buffers.items():
                for step, tensors in steps.items():
                    want = ref_buffers.get(step)
                    if want is None:
                        continue
                    if set(tensors) != set(want) or not tensors:
                        print(f"{name} {key} step {step}: saved {sorted(tensors)[:3]}..., "
                              f"torchtitan {sorted(want)[:3]}...", file=sys.stderr)
                        sys.exit(1)
                    for k, v in tensors.items():
                        d = max(abs(x - y) for x, y in zip(v, want[k]))
                        worst_buffer = max(worst_buffer, d)
                        compared_buffers += 1

        # Every run against torchtitan's unbroken run: each logged every step once (a resumed
        # run's file holds both segments), with losses and grad norms within the tolerances.
        ref = result.get("torchtitan_unbroken") or result.get("titan_unbroken")
        for key, rows in result.items():
            steps_seen = [r["step"] for r in rows]
            if steps_seen != list(range(1, a.steps + 1)):
                print(f"{name} {key}: logged steps {steps_seen}, want 1..{a.steps}", file=sys.stderr)
                sys.exit(1)
        for s in range(1, a.steps + 1):
            line = [f"{name} step {s}"]
            r0 = ref[s - 1]
            for key, rows in result.items():
                r = rows[s - 1]
                dl, dg = rel(r["loss"], r0["loss"]), rel(r["grad_norm"], r0["grad_norm"])
                worst_loss, worst_grad = max(worst_loss, dl), max(worst_grad, dg)
                line.append(f"{key} loss {r['loss']:.8f} grad_norm {r['grad_norm']:.8f} (rel {dl:.1e}, {dg:.1e})")
            print(" | ".join(line))
    grad_rtol = a.rtol if a.grad_rtol is None else a.grad_rtol
    summary.update(worst_loss_rel=worst_loss, worst_grad_norm_rel=worst_grad, grad_rtol=grad_rtol)
    if a.buffers:
        summary.update(buffers_compared=compared_buffers, worst_buffer_abs=worst_buffer)
    print(json.dumps(summary))
    ok = worst_loss <= a.rtol and worst_grad <= grad_rtol and worst_buffer == 0.0
    if not ok:
        print(f"parity failed: worst loss rel {worst_loss:.2e} (rtol {a.rtol}), worst grad norm rel "
              f"{worst_grad:.2e} (rtol {grad_rtol}), worst saved buffer difference "
              f"{worst_buffer:.2e} (must be 0)", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "rank":
        rank_main(sys.argv[2:])
    elif len(sys.argv) >= 2 and sys.argv[1] == "compare":
        main()
    elif len(sys.argv) == 4 and sys.argv[1] == "make" and sys.argv[3] == "llama3-seed":
        os.makedirs(sys.argv[2], exist_ok=True)
        seed_checkpoint(sys.argv[2], write_assets(sys.argv[2]), model_only=True)
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
