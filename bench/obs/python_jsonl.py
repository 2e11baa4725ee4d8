"""torchtitan's recording approach in Python: time a region with time.perf_counter_ns and
write one JSON line per record to a buffered file. Prints the median per-record cost."""
import json
import os
import statistics
import tempfile
import time

N = 200_000
runs = []
with tempfile.TemporaryDirectory() as d:
    with open(os.path.join(d, "trace.jsonl"), "w", buffering=1 << 20) as f:
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for seq in range(N):
                start = time.perf_counter_ns()
                end = time.perf_counter_ns()
                rec = {
                    "rank": 0, "thread": 0, "seq": seq, "kind": "span", "name": "forward_backward",
                    "step": 1, "start_ns": time.time_ns(), "dur_ns": end - start, "depth": 0,
                }
                f.write(json.dumps(rec) + "\n")
            runs.append((time.perf_counter_ns() - t0) / N)
print(f"python json line per span record: median {statistics.median(runs):.0f} ns "
      f"(runs: {', '.join(f'{r:.0f}' for r in runs)})")
