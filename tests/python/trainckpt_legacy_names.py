"""Rewrites a titan-train DCP checkpoint as titan-train wrote it before it took torchtitan 0.3.0's
names (`layers.N.attention.wq.weight` for `layers.N.attention.qkv_linear.wq.weight`,
`output.weight` for `lm_head.weight`), in the model weights and in the optimizer's state and
param_groups keys, with torch's own DCP reader and writer. The optimizer state titan-train now
keeps under torchtitan's fused `qkv_linear.wqkv` (rows grouped per kv head) is split back into the
separate wq/wk/wv entries that generation wrote. Everything else is kept as it is.

usage: trainckpt_legacy_names.py SRC_CHECKPOINT_DIR DST_CHECKPOINT_DIR [N_HEADS N_KV_HEADS]
(the heads default to the debug model's 16 and 16)
"""

import json
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

warnings.filterwarnings("ignore")
src, dst = sys.argv[1], sys.argv[2]
n_heads, n_kv = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (16, 16)
FUSED = ".attention.qkv_linear.wqkv.weight"


def old_name(key: str) -> str:
    for new, old in ((".attention.qkv_linear.w", ".attention.w"), ("lm_head.weight", "output.weight")):
        key = key.replace(new, old)
    return key


def split_fused(key, value):
    """The separate q/k/v entries of one fused `wqkv` entry: its rows split per projection, or a
    scalar / param_group value repeated for each."""
    out = []
    for part, name in enumerate(("wq", "wk", "wv")):
        k = key.replace(FUSED, f".attention.{name}.weight")
        v = value
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            rows, cols = value.shape
            per_kv = n_heads // n_kv
            head_dim = rows // (n_kv * (per_kv + 2))
            grouped = value.reshape(n_kv, per_kv + 2, head_dim, cols)
            start, length = [(0, per_kv), (per_kv, 1), (per_kv + 1, 1)][part]
            v = grouped[:, start : start + length].reshape(-1, cols).contiguous()
        out.append((k, v))
    return out


def legacy(items):
    """(old key, value) pairs of `items` and how many keys changed name."""
    out, changed = [], 0
    for k, v in items:
        if FUSED in k:
            parts = split_fused(k, v)
            out.extend(parts)
            changed += len(parts)
        else:
            out.append((old_name(k), v))
            changed += k != old_name(k)
    return out, changed


state = {}
_load_state_dict(state, storage_reader=dcp.FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
renamed, count = {}, 0
for top, value in state.items():
    if isinstance(value, dict):
        items, changed = legacy(value.items())
        renamed[top] = dict(items)
    else:
        items, changed = legacy([(top, value)])
        renamed.update(items)
    count += changed
dcp.save(renamed, storage_writer=dcp.FileSystemWriter(dst), no_dist=True)

keys = dcp.FileSystemReader(dst).read_metadata().state_dict_metadata.keys()
assert not [k for k in keys if "qkv_linear" in k or "lm_head" in k], "new names left"
assert "output.weight" in keys and "layers.0.attention.wq.weight" in keys, sorted(keys)[:10]
print(json.dumps({"renamed": count, "keys": len(keys)}))
