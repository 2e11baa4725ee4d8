"""Reads titan-train's TensorBoard event files with TensorBoard's own EventAccumulator and with
tbparse, and checks every scalar against metrics.jsonl (the values of the console line, as
float32 like TensorBoard's simple_value).

Run with the Python that has tensorboard and tbparse (TITAN_TT_PYTHON).
usage: trainer_tensorboard.py DUMP_FOLDER RUN_DIR
"""

import json
import sys
from pathlib import Path

import numpy as np
from tbparse import SummaryReader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

dump, run_dir = Path(sys.argv[1]), sys.argv[2]
files = sorted(Path(run_dir).glob("events.out.tfevents.*"))
assert len(files) == 1, files

# What the console line showed, per (tag, step).
want = {}
for line in (dump / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    if row["kind"] == "train":
        want[("training/loss_mean", row["step"])] = row["loss"]
        want[("training/grad_norm_max", row["step"])] = row["grad_norm"]
        want[("trainer_throughput/tps_mean", row["step"])] = row["tps"]
        want[("training/lr_max", row["step"])] = row["lr"]
        want[("training/tokens_sum", row["step"])] = row["tokens"]
        want[("trainer_memory/tensor_peak_gib_max", row["step"])] = row["tensor_peak_gib"]
    elif row["kind"] == "validation":
        want[("validation/loss_mean", row["step"])] = row["loss"]
        want[("validation/tokens_sum", row["step"])] = row["tokens"]

acc = EventAccumulator(run_dir)
acc.Reload()
tags = acc.Tags()["scalars"]
seen = 0
for (tag, step), value in want.items():
    assert tag in tags, (tag, tags)
    events = {e.step: e.value for e in acc.Scalars(tag)}
    assert step in events, (tag, step, sorted(events))
    assert events[step] == np.float32(value), (tag, step, events[step], value)
    seen += 1

df = SummaryReader(run_dir, pivot=False).scalars
by_key = {(r.tag, int(r.step)): r.value for r in df.itertuples()}
for key, value in want.items():
    assert by_key[key] == np.float32(value), (key, by_key.get(key), value)
print(json.dumps({"tags": sorted(tags), "checked": seen, "tbparse_rows": len(df)}))
