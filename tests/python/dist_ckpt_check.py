"""Loads a multi-rank titan-train DCP checkpoint with torch.distributed.checkpoint (no process
group: a plain state dict of full tensors) and checks its multi-rank structure.

Prints JSON: {"files": [...], "exp_avg_chunks": {fqn: n}, "dp_ranks": [...]}.

usage: dist_ckpt_check.py CHECKPOINT_DIR WORLD_SIZE
"""

import json
import pickle
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

warnings.filterwarnings("ignore")
ckpt_dir, world = sys.argv[1], int(sys.argv[2])
md = dcp.FileSystemReader(ckpt_dir).read_metadata()

sd = {}
for key, item in md.state_dict_metadata.items():
    if isinstance(item, TensorStorageMetadata):
        dtype = item.properties.dtype
        fill = float("nan") if dtype.is_floating_point else 0
        sd[key] = torch.full(item.size, fill, dtype=dtype)
    else:
        assert isinstance(item, BytesStorageMetadata), (key, item)
        sd[key] = None
dcp.load(sd, checkpoint_id=ckpt_dir)

for key, item in md.state_dict_metadata.items():
    if isinstance(item, TensorStorageMetadata) and item.properties.dtype.is_floating_point:
        assert not torch.isnan(sd[key]).any(), f"{key}: part of the tensor was never loaded"
    if key.startswith("optimizer.state.") and key.endswith(".exp_avg"):
        fqn = key[len("optimizer.state."):-len(".exp_avg")]
        if fqn.endswith(".qkv_linear.wqkv.weight"):
            # torchtitan 0.3.0's fused q/k/v parameter: the three projections' rows.
            base = fqn[: -len("wqkv.weight")]
            parts = [md.state_dict_metadata[f"{base}{p}.weight"].size for p in ("wq", "wk", "wv")]
            assert tuple(item.size) == (sum(p[0] for p in parts), parts[0][1]), key
        else:
            assert tuple(item.size) == tuple(md.state_dict_metadata[fqn].size), key

assert sd["dataloader.world_size"] == world, sd["dataloader.world_size"]
ranks = []
for r in range(world):
    # torchtitan's format (a pickled StatefulDataLoader state that titan wrote); each rank its own.
    state = pickle.loads(sd[f"dataloader.dp_rank_{r}"])
    assert state["dataset_state"]["sample_idx"] > 0, state
    ranks.append(r)

chunks = {
    k[len("optimizer.state."):-len(".exp_avg")]: len(v.chunks)
    for k, v in md.state_dict_metadata.items()
    if k.startswith("optimizer.state.") and k.endswith(".exp_avg")
}
print(json.dumps({
    "files": sorted(f for f in os.listdir(ckpt_dir) if not f.startswith(".") or f == ".metadata"),
    "exp_avg_chunks": chunks,
    "dp_ranks": ranks,
    "step": int(sd["train_state.step"]),
}))
