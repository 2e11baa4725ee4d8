"""Consolidation benchmark: titan-ckpt vs torch's consolidate_safetensors_files vs `cp -r`.

usage: run.py [--data /tmp/titan-ckpt-bench] [--runs 3] [--threads 2] [--gib 2.1] [--keep-data]

Generates a >= 2 GiB dcp-hf checkpoint with torch from 4 ranks once (bench/ckpt/gen.py; row- and
column-sharded bf16 tensors), then per run, in rotating order: `cp -r` of the shard files,
titan-ckpt consolidate (release build, --workers THREADS, --index-from the same 4-file mapping),
and torch consolidate_safetensors_files (num_threads=THREADS, same mapping). Every command is
followed by `sync`, which is included in its time; peak RSS is the command's own (wait4 rusage).
Prints medians, ratios and the runs as JSON. The first titan output is checked against torch's
with `titan-ckpt diff` (must be identical). Outputs are deleted after each run; the data too
unless --keep-data.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(cmd, env=None):
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        sys.exit(f"{cmd} failed with status {status}")
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t0, ru.ru_maxrss / 1024.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/titan-ckpt-bench")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gib", type=float, default=2.1)
    ap.add_argument("--keep-data", action="store_true")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/titan-ckpt"))
    a = ap.parse_args()
    py = os.path.join(ROOT, ".venv/bin/python")
    sharded = os.path.join(a.data, "sharded")
    if not os.path.isdir(sharded):
        subprocess.run([py, os.path.join(ROOT, "bench/ckpt/gen.py"), a.data, "--gib", str(a.gib)], check=True)
    size = sum(os.path.getsize(os.path.join(sharded, f)) for f in os.listdir(sharded))
    print(f"input: {len(os.listdir(sharded))} shard files, {size / 2**30:.2f} GiB", flush=True)
    out = os.path.join(a.data, "out")
    tools = {
        "cp": ["cp", "-r", sharded, out],
        "titan-ckpt": [a.bin, "--quiet", "consolidate", sharded, out, "--index-from",
                       os.path.join(a.data, "index.json"), "--workers", str(a.threads)],
        "torch": [py, os.path.join(ROOT, "bench/ckpt/torch_consolidate.py"), sharded, out,
                  os.path.join(a.data, "mapping.json"), str(a.threads)],
    }
    results = {k: [] for k in tools}
    checked = False
    order = list(tools)
    for r in range(a.runs):
        for name in order[r % 3:] + order[: r % 3]:
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            secs, rss = measure(tools[name])
            results[name].append({"seconds": secs, "peak_rss_mib": rss})
            print(f"run {r + 1} {name:10s} {secs:7.2f} s  peak RSS {rss:7.1f} MiB", flush=True)
            if name == "titan-ckpt" and not checked:
                keep = out + ".titan"
                shutil.rmtree(keep, ignore_errors=True)
                os.rename(out, keep)
                ref = out + ".torch"
                shutil.rmtree(ref, ignore_errors=True)
                subprocess.run([py, os.path.join(ROOT, "bench/ckpt/torch_consolidate.py"), sharded, ref,
                                os.path.join(a.data, "mapping.json"), str(a.threads)], check=True)
                d = subprocess.run([a.bin, "--quiet", "diff", keep, ref])
                shutil.rmtree(keep, ignore_errors=True)
                shutil.rmtree(ref, ignore_errors=True)
                if d.returncode != 0:
                    sys.exit("titan-ckpt's output differs from torch's")
                print("check: titan-ckpt output == torch output (titan-ckpt diff)", flush=True)
                checked = True
    shutil.rmtree(out, ignore_errors=True)
    med = {k: {"seconds": statistics.median(x["seconds"] for x in v),
               "peak_rss_mib": statistics.median(x["peak_rss_mib"] for x in v)} for k, v in results.items()}
    print()
    print(f"| tool | median s (incl. sync) | GiB/s | median peak RSS MiB |")
    print(f"|---|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v['seconds']:.2f} | {size / 2**30 / v['seconds']:.2f} | {v['peak_rss_mib']:.0f} |")
    print()
    t = med["titan-ckpt"]["seconds"]
    print(f"titan-ckpt / cp = {t / med['cp']['seconds']:.2f}x; torch / titan-ckpt = {med['torch']['seconds'] / t:.2f}x")
    print(json.dumps({"bytes": size, "threads": a.threads, "runs": results, "medians": med}))
    if not a.keep_data:
        shutil.rmtree(a.data, ignore_errors=True)


if __name__ == "__main__":
    main()
