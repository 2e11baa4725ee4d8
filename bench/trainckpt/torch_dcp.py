"""torch.distributed.checkpoint save/load of the same state titan-train saved (the comparison
side of bench/trainckpt/run.sh): loads titan's checkpoint into a plain flat state dict with
dcp.load, then times dcp.save and dcp.load of that state dict RUNS times.

usage: torch_dcp.py SIZE CHECKPOINT_DIR OUT_DIR RUNS
"""

import json
import resource
import shutil
import statistics
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

warnings.filterwarnings("ignore")
size, src, out, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
md = dcp.FileSystemReader(src).read_metadata()
sd = {}
for k, item in md.state_dict_metadata.items():
    sd[k] = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
dcp.load(sd, checkpoint_id=src)

save_s, load_s = [], []
for i in range(runs):
    d = f"{out}/torch-{size}-{i}"
    shutil.rmtree(d, ignore_errors=True)
    t = time.perf_counter()
    dcp.save(sd, checkpoint_id=d)
    save_s.append(time.perf_counter() - t)
for i in range(runs):
    d = f"{out}/torch-{size}-{i}"
    t = time.perf_counter()
    dcp.load(sd, checkpoint_id=d)
    load_s.append(time.perf_counter() - t)
    shutil.rmtree(d, ignore_errors=True)
print(json.dumps({
    "tool": "torch.dcp",
    "size": size,
    "runs": runs,
    "save_s": statistics.median(save_s),
    "load_s": statistics.median(load_s),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
