"""Times torch's side of ckpt/benches/dcp_native.rs on the same files.

usage: dcp_bench_torch.py DIR   (DIR from DCP_BENCH_KEEP=DIR cargo bench --bench dcp_native)

Prints medians of 5 runs of dcp.load (single process, into preallocated tensors) for DIR/plain
and DIR/zstd, and of pickle.load of DIR/many/.metadata, plus peak RSS.
"""

import pickle
import resource
import statistics
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

warnings.filterwarnings("ignore")


def median_time(fn, n=5):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    root = sys.argv[1]
    torch.set_num_threads(1)
    for name in ("plain", "zstd"):
        sd = {f"layers.{t}.weight": torch.empty(2048, 1024) for t in range(8)}
        sd["step"] = 0
        t = median_time(lambda: dcp.load(sd, checkpoint_id=f"{root}/{name}"))
        print(f"torch dcp.load {name}: {t * 1e3:.1f} ms ({64 / t:.0f} MiB/s)")
    path = f"{root}/many/.metadata"

    def load_md():
        with open(path, "rb") as f:
            pickle.load(f)

    t = median_time(load_md, 20)
    print(f"torch pickle.load .metadata (5000 tensors): {t * 1e3:.2f} ms")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
