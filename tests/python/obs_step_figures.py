"""The figures `titan-obs summary` and `titan-obs metrics` print, computed by hand from a
titan run's Parquet parts with pyarrow (not with titan-obs's code), for tests/tests/obs_figures.rs.

usage: obs_step_figures.py RUN

Prints one JSON object:
- median_step_ns: per untagged step, the slowest rank's step time (its main thread's top-level
  spans of the step: the `step` span, and the teardown beside the last one); the median over
  steps (the mean of the two middle values for an even count);
- depth0_share: the sum over depth-0 phases of their time in `step`-span time on the thread
  that recorded the rank's `step` spans, over all `step` time (1.0 when the step is all);
- background_ns: time of spans on a rank's other threads during steps;
- tokens: per step, the sum over ranks of the `training/tokens` scalar;
- tps: per step, the mean over ranks of the `trainer_throughput/tps` scalar;
- last_step: per rank, its last step with a `step` span;
- errors: per rank, the messages of its error records.
"""
import collections
import glob
import json
import os
import statistics
import sys

import pyarrow as pa
import pyarrow.parquet as pq

COLUMNS = ["rank", "thread", "kind", "name", "step", "dur_ns", "depth", "tags", "value", "message"]
run = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(run, "obs", "rank-*", "part-*.parquet"))):
    rows.extend(pq.read_table(path, columns=COLUMNS).to_pylist())
# A killed process's open journal (Arrow IPC stream): every complete batch, up to a torn tail.
for path in sorted(glob.glob(os.path.join(run, "obs", "rank-*", "journal-*.arrows"))):
    with open(path, "rb") as f:
        reader = pa.ipc.open_stream(f)
        while True:
            try:
                b = reader.read_next_batch()
            except (StopIteration, pa.ArrowInvalid, OSError, EOFError):
                break
            rows.extend(b.select(COLUMNS).to_pylist())

spans = [r for r in rows if r["kind"] == "span" and r["step"] is not None]
step_spans = [r for r in spans if r["name"] == "step"]
main_thread = {}
for r in step_spans:
    main_thread.setdefault(r["rank"], r["thread"])

step_time = collections.defaultdict(int)
tagged = set()
for r in spans:
    if r["depth"] == 0 and r["thread"] == main_thread.get(r["rank"]):
        step_time[(r["step"], r["rank"])] += r["dur_ns"]
for r in rows:
    if r["step"] is not None and r["tags"]:
        tagged.add(r["step"])
steps = sorted({s for (s, _) in step_time})
slowest = [max(v for (s2, _), v in step_time.items() if s2 == s) for s in steps if s not in tagged]
median_step_ns = statistics.median(slowest) if slowest else 0

total_step = sum(step_time.values())
depth0 = sum(
    r["dur_ns"] for r in spans if r["depth"] == 0 and r["thread"] == main_thread.get(r["rank"])
)
background = sum(r["dur_ns"] for r in spans if r["thread"] != main_thread.get(r["rank"]))

tokens = collections.defaultdict(float)
tps = collections.defaultdict(list)
for r in rows:
    if r["kind"] != "scalar" or r["step"] is None:
        continue
    if r["name"] == "training/tokens":
        tokens[r["step"]] += r["value"]
    elif r["name"] == "trainer_throughput/tps":
        tps[r["step"]].append(r["value"])

last_step = collections.defaultdict(int)
for r in step_spans:
    last_step[r["rank"]] = max(last_step[r["rank"]], r["step"])
errors = collections.defaultdict(list)
for r in rows:
    if r["kind"] == "error":
        errors[r["rank"]].append(r["message"])

print(
    json.dumps(
        {
            "median_step_ns": median_step_ns,
            "depth0_share": depth0 / total_step if total_step else None,
            "background_ns": background,
            "tokens": {str(s): v for s, v in sorted(tokens.items())},
            "tps": {str(s): sum(v) / len(v) for s, v in sorted(tps.items())},
            "last_step": {str(r): s for r, s in sorted(last_step.items())},
            "errors": {str(r): m for r, m in sorted(errors.items())},
        }
    )
)
