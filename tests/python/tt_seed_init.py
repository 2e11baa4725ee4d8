"""titan-train's initialisation against torchtitan 0.3.0's, and the two seed checkpoints.

1. torchtitan writes its seed checkpoint (`--checkpoint.create_seed_checkpoint`, one process)
   and titan-train writes its own from the same command line; both are read with plain torch
   DCP: the same keys, shapes and dtypes.
2. titan-train's seed checkpoints for SEEDS seeds (`--debug.seed s`), and torchtitan's own
   `init_states` of its llama3 debugmodel for as many seeds, pooled per parameter: mean, std,
   smallest and largest value, and the fraction of values exactly 1. Printed as one JSON line
   for tests/tests/trainer_seed_init.rs, which compares them (the two draw from different RNG
   streams, so only the distributions can agree).

Run with torch 2.15 + torchtitan 0.3.0 (TITAN_TT_PYTHON).

usage: tt_seed_init.py WORKDIR TITAN_TRAIN SEEDS
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tt_parity import common_args, run, seed_checkpoint  # noqa: E402
from tt_ckpt_trainer import write_assets  # noqa: E402

warnings.filterwarnings("ignore")
workdir, titan_train, seeds = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(workdir, exist_ok=True)
assets = write_assets(workdir)


def keys_of(step0):
    return set(dcp.FileSystemReader(step0).read_metadata().state_dict_metadata)


def read_checkpoint(step0):
    md = dcp.FileSystemReader(step0).read_metadata()
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=step0)
    return state


def titan_seed(seed):
    dump = os.path.join(workdir, f"titan-{seed}")
    args = common_args(assets, 1) + [
        "--dump_folder", dump, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
        "--debug.seed", str(seed),
    ]
    p = run([titan_train] + args, dict(os.environ, OMP_NUM_THREADS="1"), "titan-train")
    steps = os.listdir(os.path.join(dump, "checkpoint"))
    assert steps == ["step-0"], f"titan-train's seed checkpoint folder holds {steps}"
    assert not os.path.exists(os.path.join(dump, "metrics.jsonl")) or \
        os.path.getsize(os.path.join(dump, "metrics.jsonl")) == 0, "a seed run trained a step"
    return read_checkpoint(os.path.join(dump, "checkpoint", "step-0")), p


# 1. The two seed checkpoints hold the same keys, and the same tensors (shape, dtype; the
#    optimizer state torch's DCP initialises before a first step: zero moments, step 1). The
#    registry's debugmodel sets last_save_model_only = false, so both are full checkpoints.
#    titan-train adds its RNG state (`rng_state.*`), which torchtitan does not save.
tt_step0 = seed_checkpoint(workdir, assets)
tt_seed = read_checkpoint(tt_step0)
titan_first, _ = titan_seed(0)
titan_step0 = os.path.join(workdir, "titan-0", "checkpoint", "step-0")
tt_keys = keys_of(tt_step0)
titan_keys = {k for k in keys_of(titan_step0) if not k.startswith("rng_state.")}
layout = lambda s: {k: (tuple(v.shape), str(v.dtype)) for k, v in s.items()}  # noqa: E731
tt_layout, titan_layout = layout(tt_seed), layout(titan_first)
only_tt = sorted(tt_keys - titan_keys)
only_titan = sorted(titan_keys - tt_keys)
differ = sorted(k for k in tt_layout.keys() & titan_layout.keys() if tt_layout[k] != titan_layout[k])
differ += sorted(
    k for k in tt_layout.keys() & titan_layout.keys()
    if k.startswith("optimizer.state.") and not torch.equal(tt_seed[k], titan_first[k])
)
params = sorted(k for k in tt_layout if not k.startswith(("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")))


# 2. Pooled statistics per parameter over the seeds. The tails are counted beyond 2 and 3 of
#    torchtitan's standard deviations for that parameter (the same thresholds for both), so a
#    truncation that bites (lm_head's, at 3 sigma) or one that is missing shows there.
class Pool:
    def __init__(self, sigma=None):
        self.n = 0
        self.sum = 0.0
        self.sq = 0.0
        self.lo = float("inf")
        self.hi = float("-inf")
        self.ones = 0
        self.sigma = sigma
        self.tail2 = 0
        self.tail3 = 0

    def add(self, t):
        t = t.detach().double().flatten()
        self.n += t.numel()
        self.sum += t.sum().item()
        self.sq += (t * t).sum().item()
        self.lo = min(self.lo, t.min().item())
        self.hi = max(self.hi, t.max().item())
        self.ones += (t == 1.0).sum().item()
        if self.sigma:
            # Every initialisation here has mean 0: tails are counted around 0.
            self.tail2 += (t.abs() > 2 * self.sigma).sum().item()
            self.tail3 += (t.abs() > 3 * self.sigma).sum().item()

    def stats(self):
        mean = self.sum / self.n
        return {
            "n": self.n, "mean": mean, "std": max(self.sq / self.n - mean * mean, 0.0) ** 0.5,
            "min": self.lo, "max": self.hi, "ones": self.ones / self.n,
            "tail2": self.tail2 / self.n, "tail3": self.tail3 / self.n,
        }


def pooled(states, sigmas=None):
    pools = {}
    for state in states:
        for k, v in state.items():
            pools.setdefault(k, Pool(sigmas[k] if sigmas else None)).add(v)
    return {k: p.stats() for k, p in pools.items()}


def titan_states():
    for s in range(seeds):
        state = titan_first if s == 0 else titan_seed(s)[0]
        yield {k: v for k, v in state.items() if k in params}


def torchtitan_states():
    from torchtitan.models.llama3 import llama3_configs

    for s in range(seeds):
        torch.manual_seed(1000 + s)
        model = llama3_configs["debugmodel"](attn_backend="flex").build()
        model.init_states()
        yield {k: v for k, v in model.state_dict().items() if k in params}


# torchtitan's deviations first (its draws are cheap to make twice), then both sides' tails.
sigmas = {k: v["std"] for k, v in pooled(torchtitan_states()).items()}
print(json.dumps({
    "only_torchtitan": only_tt,
    "only_titan": only_titan,
    "layout_differs": differ,
    "params": len(params),
    "titan": pooled(titan_states(), sigmas),
    "torchtitan": pooled(torchtitan_states(), sigmas),
}))
