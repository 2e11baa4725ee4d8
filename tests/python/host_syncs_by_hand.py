"""Host syncs and data loading per step of a titan-train run, computed by hand from its Parquet
parts with pyarrow (not with titan-obs's code), for tests/tests/trainer_host_syncs.rs.

usage: host_syncs_by_hand.py RUN

Prints one JSON object:
- syncs: per step, the largest `trainer/host_syncs` scalar over ranks;
- log_steps: the steps with a `training/loss` scalar (the steps that logged);
- data_loading_share: per step, the largest share over ranks of the `step` span spent in its
  `data_loading` span (on the thread of the step span: the training thread).
"""
import collections
import glob
import json
import os
import sys

import pyarrow.parquet as pq

COLUMNS = ["rank", "thread", "kind", "name", "step", "dur_ns", "value"]
run = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(run, "obs", "rank-*", "part-*.parquet"))):
    rows.extend(pq.read_table(path, columns=COLUMNS).to_pylist())
rows = [r for r in rows if r["step"] is not None]

syncs = collections.defaultdict(float)
log_steps = set()
step_ns = {}
loading_ns = collections.defaultdict(int)
for r in rows:
    if r["kind"] == "scalar" and r["name"] == "trainer/host_syncs":
        syncs[r["step"]] = max(syncs[r["step"]], r["value"])
    elif r["kind"] == "scalar" and r["name"] == "training/loss":
        log_steps.add(r["step"])
    elif r["kind"] == "span" and r["name"] == "step":
        step_ns[(r["rank"], r["step"])] = (r["thread"], r["dur_ns"])
for r in rows:
    if r["kind"] == "span" and r["name"] == "data_loading":
        thread, _ = step_ns.get((r["rank"], r["step"]), (None, 0))
        if r["thread"] == thread:
            loading_ns[(r["rank"], r["step"])] += r["dur_ns"]
share = collections.defaultdict(float)
for (rank, step), (_, dur) in step_ns.items():
    if dur > 0:
        share[step] = max(share[step], loading_ns[(rank, step)] / dur)

print(
    json.dumps(
        {
            "syncs": {str(s): v for s, v in sorted(syncs.items())},
            "log_steps": sorted(log_steps),
            "data_loading_share": {str(s): v for s, v in sorted(share.items())},
        }
    )
)
