"""Loads a titan-train DCP checkpoint with torch.distributed.checkpoint into a plain state dict
and checks it against the expected values (a safetensors file of state key -> tensor).

Also loads its optimizer keys into a real torch.optim.AdamW through
set_optimizer_state_dict(flatten_optimizer_state_dict=True), as torchtitan does.

usage: trainckpt_torch_load.py CHECKPOINT_DIR EXPECTED.safetensors
"""

import json
import pickle
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

warnings.filterwarnings("ignore")
ckpt_dir, expected_path = sys.argv[1], sys.argv[2]
expected = load_file(expected_path)
md = dcp.FileSystemReader(ckpt_dir).read_metadata()

sd = {}
for key, item in md.state_dict_metadata.items():
    if isinstance(item, TensorStorageMetadata):
        sd[key] = torch.empty(item.size, dtype=item.properties.dtype)
    else:
        assert isinstance(item, BytesStorageMetadata), (key, item)
        sd[key] = None
dcp.load(sd, checkpoint_id=ckpt_dir)

# The RNG state is torch.get_rng_state()'s format: torch's own generator takes it.
rng = sd.pop("rng_state.cpu.rank_0")
assert rng.dtype == torch.uint8 and rng.shape == (5056,), (rng.dtype, rng.shape)
torch.set_rng_state(rng)
tensor_keys = {
    k for k, v in md.state_dict_metadata.items()
    if isinstance(v, TensorStorageMetadata) and not k.startswith("rng_state.")
}
missing = tensor_keys - expected.keys()
assert not missing, f"checkpoint tensors not expected: {sorted(missing)[:5]}"
assert not (expected.keys() - tensor_keys), f"missing from the checkpoint: {sorted(expected.keys() - tensor_keys)[:5]}"
for key, want in expected.items():
    got = sd[key]
    assert got.dtype == want.dtype and got.shape == want.shape, (key, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got, want), f"{key} differs"

# torchtitan 0.3.0's TrainState: plain ints.
assert isinstance(sd["train_state.step"], int) and sd["train_state.ntokens_seen"] == 192, sd["train_state.ntokens_seen"]
step = sd["train_state.step"]
assert sd["lr_scheduler.last_epoch"] == step, sd["lr_scheduler.last_epoch"]
assert sd["dataloader.world_size"] == 1
# torchtitan's own format: a pickled torchdata StatefulDataLoader state (titan wrote it, so
# unpickling it here, in the test, is safe) around the dataset's buffers and position.
loader = pickle.loads(sd["dataloader.dp_rank_0"])
ds = loader["dataset_state"]
assert ds["sample_idx"] > 0 and len(ds["inputs_buffer"]) == len(ds["positions_buffer"]), loader
assert loader["_num_yielded"] >= step, loader

# A module tree with the optimizer's parameter fqns (torchtitan 0.3.0's: the q/k/v projections
# are one fused `qkv_linear.wqkv.weight`), and a real AdamW loading our flattened state.
opt_keys = sorted(
    k[len("optimizer.state."):-len(".exp_avg")]
    for k in tensor_keys
    if k.startswith("optimizer.state.") and k.endswith(".exp_avg")
)
assert any(k.endswith(".qkv_linear.wqkv.weight") for k in opt_keys), opt_keys[:5]
root = torch.nn.Module()
for fqn in opt_keys:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(sd[f"optimizer.state.{fqn}.exp_avg"])))
assert set(root.state_dict().keys()) == set(opt_keys)
opt = torch.optim.AdamW(root.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
# torchtitan builds a LambdaLR on the optimizer, which adds `initial_lr` to the param groups.
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
options = StateDictOptions(flatten_optimizer_state_dict=True)
flat = {k[len("optimizer."):]: v for k, v in sd.items() if k.startswith("optimizer.")}
set_optimizer_state_dict(root, opt, optim_state_dict=flat, options=options)
back = get_optimizer_state_dict(root, opt, options=options)
assert set(back.keys()) == set(flat.keys()), sorted(set(back.keys()) ^ set(flat.keys()))[:5]
for k, v in back.items():
    if isinstance(v, torch.Tensor):
        assert torch.equal(v, flat[k]), f"optimizer {k} differs after set_optimizer_state_dict"
# The optimizer really steps from the loaded state (bias correction uses the loaded step).
for p in root.parameters():
    p.grad = torch.ones_like(p)
opt.step()
assert all(int(s["step"]) == step + 1 for s in opt.state.values())
print(f"OK: {len(tensor_keys)} tensors and {len(sd) - len(tensor_keys)} objects match; AdamW resumed at step {step}")
