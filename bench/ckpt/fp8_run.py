"""FP8 -> bf16 DCP conversion benchmark: titan-ckpt against `cp -r` of the same output size.

usage: fp8_run.py [--data /tmp/fp8-bench] [--gb 10] [--runs 3] [--threads 2]

Generates once (bench/ckpt/fp8_gen.py) a DeepSeek-V3-shaped FP8 block-quantized HF checkpoint of
about --gb GB under DATA/hf. Then per run:
  titan   titan-ckpt convert DATA/hf DATA/out --to dcp --adapter deepseek_v3 --workers THREADS
          (release build): every float8 weight dequantized to bf16 (twice the bytes), the experts
          stacked, torchtitan's names
  cp      cp -r DATA/out DATA/out-cp: the same number of bytes read and written, no work
Each command is followed by `sync` (included in its time); peak RSS is the command's own (wait4
rusage). The outputs are removed between runs. Prints the runs and the medians as JSON.
torchtitan's own path (QuantizedHuggingFaceStorageReader into a state dict) holds the whole
model in fp32 (4x the float8 bytes), which does not fit this machine at 10 GB, so it is not run.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.environ.get("TITAN_PYTHON", os.path.join(ROOT, ".venv/bin/python"))
TITAN = os.path.join(ROOT, "target/release/titan-ckpt")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import measure  # noqa: E402  (bench/ckpt/run.py: wall time incl. sync, peak RSS)


def du(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/fp8-bench")
    ap.add_argument("--gb", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--titan", default=TITAN, help="titan-ckpt binary (default: release build)")
    a = ap.parse_args()
    hf = os.path.join(a.data, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        subprocess.run([PY, os.path.join(ROOT, "bench/ckpt/fp8_gen.py"), hf, "--gb", str(a.gb)],
                       check=True)
    out, copy = os.path.join(a.data, "out"), os.path.join(a.data, "out-cp")
    runs = {"titan": [], "cp": []}
    sizes = {}
    for _ in range(a.runs):
        for d in (out, copy):
            shutil.rmtree(d, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        cmds = {
            "titan": [a.titan, "--quiet", "convert", hf, out, "--to", "dcp", "--adapter",
                      "deepseek_v3", "--workers", str(a.threads)],
            "cp": ["cp", "-r", out, copy],
        }
        for k, cmd in cmds.items():
            t, rss = measure(cmd)
            runs[k].append({"seconds": round(t, 2), "peak_rss_mib": round(rss, 1)})
            print(k, runs[k][-1], flush=True)
        sizes = {"input_bytes": du(hf), "output_bytes": du(out)}
        shutil.rmtree(copy, ignore_errors=True)
    med = {k: {"seconds": statistics.median(r["seconds"] for r in v),
               "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in v)}
           for k, v in runs.items()}
    print(json.dumps({**sizes, "runs": runs, "median": med,
                      "titan_over_cp": round(med["titan"]["seconds"] / med["cp"]["seconds"], 2)},
                     indent=1))


if __name__ == "__main__":
    main()
