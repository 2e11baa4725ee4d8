"""A checkpoint written by torchtitan 0.3.0's own Trainer (train.py's main: its config registry,
FSDP2 on 2 gloo ranks, its CheckpointManager), and the references titan-ckpt's conversion must equal.

torchtitan's Trainer targets accelerators; three things stand between it and a CPU-only machine, and
this script changes exactly those, in the rank processes only:
- device selection: torchtitan falls back to "cuda" when torch sees no accelerator -> "cpu";
- FlexAttention's torch.compile'd kernel (no backward on CPU) -> eager SDPA with the same block mask
  (create_mask of the BlockMask's mask_mod); the checkpoint's tensor names, dtypes and sharding do not
  depend on the attention kernel;
- FSDP's ReduceOp.PREMUL_SUM(1.0) (torchtitan divides gradients itself), which gloo lacks -> SUM and
  FSDP's own division by 1.0 (the same values); plus torch.cpu's missing memory statistics and its
  string current_device() (torchtitan passes it to barrier(device_ids=[...])).
Model, optimizer, data loading, FSDP sharding and checkpoint saving are torchtitan's and torch's code.

Run with torch 2.15 + torchtitan 0.3.0 (TITAN_TT_PYTHON):

  tt_ckpt_trainer.py make DIR
      DIR/run/checkpoint/step-2/   the Trainer's checkpoint after 2 steps (model, optimizer,
                                   lr_scheduler, dataloader, train_state)
      DIR/ref.safetensors          the model state dict read back with dcp.load (torchtitan names)
      DIR/expected_hf.safetensors  Llama3StateDictAdapter.to_hf of it
      DIR/logits.safetensors       torchtitan's model logits on tt_ckpt_llama3.TOKENS
Then `tt_ckpt_llama3.py check-hf HF DIR` checks an HF conversion against these.

  tt_ckpt_trainer.py load DIR CHECKPOINT OUT
      torchtitan's Trainer starts from CHECKPOINT (`checkpoint.initial_load_path`, model only) and
      takes one step at learning rate 0 (AdamW then leaves every weight as it is), saving the
      model to OUT/checkpoint/step-1: what it loaded, as it loaded it. DIR holds the assets `make` wrote.
"""

import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


_PATCHED = []


def patch_for_cpu():
    """The CPU changes (the module doc lists them), once per process: before torchtitan is
    first imported, which reads the device type at import."""
    if _PATCHED:
        return
    _PATCHED.append(True)
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    torch.cpu.current_device = lambda: 0

    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.components import metrics
    from torchtitan.models.common import attention

    def eager_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        assert score_mod is None and not return_aux.lse
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out, None

    attention.FlexAttention.compiled_flex_attn = staticmethod(eager_flex)

    class CpuMemoryMonitor:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(-1.0, -1.0, -1.0, -1.0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor

    set_factor = FSDPModule.set_gradient_divide_factor

    def set_factor_gloo(self, factor):
        set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor_gloo


def rank_main(args):
    """One rank (forked by fork_ranks, or started by torch.distributed.run): torchtitan's
    train.py main with the CPU patches."""
    patch_for_cpu()
    from torchtitan import train

    sys.argv = ["torchtitan.train"] + args
    train.main()


def write_assets(d):
    """torchtitan's debugmodel reads a tokenizer folder and a local text dataset ("c4_test" layout:
    JSON lines with a "text" field); titan's embedded byte-level BPE tokenizer and corpus serve."""
    assets = os.path.join(ROOT, "trainer", "assets")
    tok = os.path.join(d, "tokenizer")
    data = os.path.join(d, "c4_test")
    os.makedirs(tok, exist_ok=True)
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(assets, "tokenizer.json"), "rb") as f:
        open(os.path.join(tok, "tokenizer.json"), "wb").write(f.read())
    json.dump(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True},
        open(os.path.join(tok, "tokenizer_config.json"), "w"),
    )
    with open(os.path.join(assets, "default_train.jsonl")) as src, open(
        os.path.join(data, "train.jsonl"), "w"
    ) as dst:
        for i, line in enumerate(src):
            if i == 200:
                break
            dst.write(line)
    return tok, data


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trainer(d, out, extra, module="llama3", config="llama3_debugmodel", nproc=2, rank_fn=rank_main):
    """torchtitan's `config` of `module` (the llama3 debugmodel unless said) on `nproc` ranks
    (each `rank_fn(args)`, forked: see fork_ranks), sized for a CPU."""
    args = [
        "--module", module, "--config", config,
        "--hf_assets_path", os.path.join(d, "tokenizer"),
        "--dataloader.dataset_path", os.path.join(d, "c4_test"),
        "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--checkpoint.enable", "--dump_folder", out, "--debug.seed", "7",
    ] + extra
    os.makedirs(out, exist_ok=True)
    fork_ranks(nproc, rank_fn, args, {"OMP_NUM_THREADS": "1"}, os.path.join(out, "torchtitan"),
               "torchtitan's Trainer")


def fork_ranks(nproc, rank_fn, args, env, log_prefix, what, timeout=1800):
    """`rank_fn(args)` on NPROC ranks, each a fork of this process with torch and torchtitan
    already imported, in the environment torch.distributed.run gives its ranks (plus ENV;
    rank 0 serves the rendezvous store); each rank's output in `LOG_PREFIX.rank<R>.log`. A
    rank started fresh spent 10-15 s of CI's two cores importing torchtitan (and the launcher
    its own import) in every run. Exits naming the failed ranks, with their output's end,
    once any rank fails (the others, waiting in a collective for it, are killed) or after
    TIMEOUT seconds."""
    import signal

    import torch

    # What every rank imports, imported once here: torchtitan reads the device type when it is
    # first imported, so the CPU patches go first.
    if not _PATCHED and any(m.startswith("torchtitan") for m in sys.modules):
        raise RuntimeError("torchtitan was imported before patch_for_cpu(): its ranks would pick CUDA")
    patch_for_cpu()
    import torchtitan.train  # noqa: F401

    env = dict(os.environ, **env, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    logs, pids = [f"{log_prefix}.rank{r}.log" for r in range(nproc)], []
    for rank in range(nproc):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(logs[rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.clear()
                os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
                # OpenMP read OMP_NUM_THREADS when this process imported torch, not now.
                torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
                rank_fn(args)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                import atexit

                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    left, failed = dict(enumerate(pids)), []
    deadline = time.time() + timeout
    while left:
        for rank, pid in list(left.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del left[rank]
                if os.waitstatus_to_exitcode(status) != 0:
                    failed.append((rank, f"exit {os.waitstatus_to_exitcode(status)}"))
        if left and (failed or time.time() > deadline):
            if not failed:
                failed.append((min(left), f"still running after {timeout} s"))
            for pid in left.values():
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    if failed:
        tails = "\n".join(f"--- rank {r} ({why}) ---\n{open(logs[r]).read()[-6000:]}" for r, why in failed)
        sys.exit(f"{what} failed on {len(failed)} of {nproc} ranks: {' '.join(args)}\n{tails}")


def load(d, checkpoint, out):
    run_trainer(d, out, [
        "--training.steps", "1", "--optimizer.param-groups.0.optimizer-kwargs.lr", "0",
        "--checkpoint.interval", "1", "--checkpoint.last_save_model_only",
        "--checkpoint.initial_load_path", checkpoint,
    ])
    print(f"ok torchtitan Trainer loaded {checkpoint} and saved {out}/checkpoint/step-1")


def make(d):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    patch_for_cpu()  # before torchtitan's first import (fork_ranks says why)
    sys.path.insert(0, HERE)
    from tt_ckpt_llama3 import build_model, forward
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    os.makedirs(d, exist_ok=True)
    write_assets(d)
    run = os.path.join(d, "run")
    run_trainer(d, run, ["--training.steps", "2", "--checkpoint.interval", "2"])
    step = os.path.join(run, "checkpoint", "step-2")
    if not os.path.exists(os.path.join(step, ".metadata")):
        sys.exit(f"torchtitan's Trainer wrote no {step}/.metadata")

    spec, model = build_model()
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=step)
    save_file(sd, os.path.join(d, "ref.safetensors"))
    model.load_state_dict(sd, strict=True)
    hf = Llama3StateDictAdapter(spec.model, None).to_hf(dict(sd))
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(d, "expected_hf.safetensors"))
    with torch.no_grad():
        save_file({"logits": forward(model).contiguous()}, os.path.join(d, "logits.safetensors"))
    print(f"ok torchtitan Trainer checkpoint {step}: {len(sd)} model tensors")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "rank":
        rank_main(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(__doc__)
