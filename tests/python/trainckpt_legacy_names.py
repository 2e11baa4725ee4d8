"""Rewrites a titan-train DCP checkpoint with the parameter names titan-train used before it took
torchtitan 0.3.0's (`layers.N.attention.wq.weight` for `layers.N.attention.qkv_linear.wq.weight`,
`output.weight` for `lm_head.weight`), in the model weights and in the optimizer's state and
param_groups keys, with torch's own DCP reader and writer. Everything else is kept as it is.

usage: trainckpt_legacy_names.py SRC_CHECKPOINT_DIR DST_CHECKPOINT_DIR
"""

import json
import sys
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

warnings.filterwarnings("ignore")
src, dst = sys.argv[1], sys.argv[2]


def old_name(key: str) -> str:
    for new, old in ((".attention.qkv_linear.w", ".attention.w"), ("lm_head.weight", "output.weight")):
        key = key.replace(new, old)
    return key


state = {}
_load_state_dict(state, storage_reader=dcp.FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
renamed, count = {}, 0
for top, value in state.items():
    if isinstance(value, dict):
        value = {old_name(k): v for k, v in value.items()}
        count += sum(k != old_name(k) for k in state[top])
    else:
        count += top != old_name(top)
    renamed[old_name(top)] = value
dcp.save(renamed, storage_writer=dcp.FileSystemWriter(dst), no_dist=True)

keys = dcp.FileSystemReader(dst).read_metadata().state_dict_metadata.keys()
assert not [k for k in keys if "qkv_linear" in k or "lm_head" in k], "new names left"
assert "output.weight" in keys and "layers.0.attention.wq.weight" in keys, sorted(keys)[:10]
print(json.dumps({"renamed": count, "keys": len(keys)}))
