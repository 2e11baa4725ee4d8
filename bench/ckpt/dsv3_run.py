"""DeepSeek-V3-shaped MoE conversion benchmark: titan-ckpt vs torchtitan's DCP -> HF path.

usage: dsv3_run.py [--data /tmp/dsv3-bench] [--runs 3] [--threads 2] [--experts 128]

Generates once (bench/ckpt/dsv3_gen.py, torch 2.15 + torchtitan 0.3.0 from .venv-tt) a ~2.5 GB
bf16 DCP checkpoint of a DeepSeek-V3-shaped model (MLA + q-LoRA, 6 layers, 128 routed experts per
MoE layer, shared experts, MTP) saved by 2 gloo ranks with every tensor Shard(0) (experts split
on the expert dim). Then per run, alternating order:
  titan   titan-ckpt convert DCP OUT --to hf --adapter deepseek_v3 (release build, --workers THREADS)
  tt      bench/ckpt/dsv3_torchtitan.py: dcp.load into the model's state dict, the family
          adapter's to_hf, safetensors save_file (torch threads = THREADS)
Each command is followed by `sync` (included in its time); peak RSS is the command's own (wait4
rusage). The first outputs are compared with `titan-ckpt diff` (must be identical). Prints
medians and the ratio as JSON.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TT_PY = os.environ.get("TITAN_TT_PYTHON", os.path.join(ROOT, ".venv-tt/bin/python"))
TITAN = os.path.join(ROOT, "target/release/titan-ckpt")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import measure  # noqa: E402  (bench/ckpt/run.py: wall time incl. sync, peak RSS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/dsv3-bench")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--titan", default=TITAN, help="titan-ckpt binary (default: release build)")
    a = ap.parse_args()
    dcp = os.path.join(a.data, "dcp")
    model = ["--experts", str(a.experts)]
    if not os.path.exists(os.path.join(dcp, ".metadata")):
        subprocess.run([TT_PY, os.path.join(ROOT, "bench/ckpt/dsv3_gen.py"), dcp] + model, check=True)
    size = sum(os.path.getsize(os.path.join(dcp, f)) for f in os.listdir(dcp))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    cmds = {
        "titan": [a.titan, "--quiet", "convert", dcp, None, "--to", "hf", "--adapter", "deepseek_v3",
                  "--workers", str(a.threads)],
        "tt": [TT_PY, os.path.join(ROOT, "bench/ckpt/dsv3_torchtitan.py"), dcp, None] + model,
    }
    runs = {k: [] for k in cmds}
    for i in range(a.runs):
        order = list(cmds) if i % 2 == 0 else list(reversed(cmds))
        for k in order:
            out = os.path.join(a.data, f"out-{k}")
            shutil.rmtree(out, ignore_errors=True)
            cmd = [out if c is None else c for c in cmds[k]]
            t, rss = measure(cmd, env)
            runs[k].append({"seconds": round(t, 2), "peak_rss_mib": round(rss, 1)})
            print(k, runs[k][-1], flush=True)
        if i == 0:
            subprocess.run([a.titan, "--quiet", "diff", os.path.join(a.data, "out-titan"),
                            os.path.join(a.data, "out-tt")], check=True)
        for k in cmds:
            shutil.rmtree(os.path.join(a.data, f"out-{k}"), ignore_errors=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("seconds", "peak_rss_mib")}
           for k, v in runs.items()}
    print(json.dumps({
        "titan": a.titan, "checkpoint_bytes": size, "threads": a.threads, "median": med,
        "time_ratio_tt_over_titan": round(med["tt"]["seconds"] / med["titan"]["seconds"], 2),
        "runs": runs, "loadavg": os.getloadavg(),
    }, indent=1))


if __name__ == "__main__":
    main()
