#!/usr/bin/env bash
# Pipeline parallelism on this CPU: tokens/s and the bubble each schedule leaves, measured from
# titan-obs's records (`titan-obs summary --json`: per stage, 1 - time in passes / the step's
# pipeline time), next to the schedule's ideal (p-1)/(v*m+p-1), for GPipe, 1F1B, InterleavedZeroBubble and
# Interleaved1F1B at p = 2 and 4 pipeline ranks and m = 4 and 8 microbatches (microbatch size 1,
# so the local batch is m), plus one process without PP on the same batch for scale.
#
# The debug model (6 layers, dim 256) at seq_len 256; STEPS steps (default 8), tokens/s as the
# median of the logged steps after the first two, bubble as the median over the steps of each
# stage (the table shows the mean over stages and the largest). p = 4 runs 4 processes on
# however many cores the machine has: on 2 cores they take turns, which shows as bubble.
#
# Usage: bench/trainer/pipeline.sh [STEPS]   (Markdown table on stdout)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
steps="${1:-8}"
target="${CARGO_TARGET_DIR:-$root/target}"
cargo build --locked -p titan-train -p titan-obs >&2
train="$target/debug/titan-train"
obs="$target/debug/titan-obs"
py="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

run() { # name, nproc, then titan-train arguments
    local name="$1" nproc="$2"
    shift 2
    local dir="$work/$name"
    "$train" --nproc-per-node "$nproc" --job.dump_folder "$dir" --training.steps "$steps" \
        --training.seq_len 256 --validation.enable=false --metrics.log_freq 1 \
        --comm.train_timeout_seconds 300 "$@" >"$work/$name.log" 2>&1 ||
        { echo "$name failed:" >&2; tail -20 "$work/$name.log" >&2; exit 1; }
    "$obs" summary "$dir" --json >"$dir/summary.json"
    printf '%s\t%s\n' "$name" "$dir"
}

{
    for m in 4 8; do
        run "none m=$m" 1 --training.local_batch_size "$m"
        for p in 2 4; do
            for schedule in GPipe 1F1B Interleaved1F1B InterleavedZeroBubble; do
                run "$schedule p=$p m=$m" "$p" --training.local_batch_size "$m" \
                    --parallelism.pipeline_parallel_degree "$p" \
                    --parallelism.pipeline_parallel_schedule "$schedule"
            done
        done
    done
} | "$py" -c '
import json, statistics, sys
print("| schedule | p | v | m | tokens/s (median) | bubble: ideal | measured, mean of stages | measured, largest | slowest stage |")
print("|---|---|---|---|---|---|---|---|---|")
for line in sys.stdin:
    name, run = line.rstrip("\n").split("\t", 1)
    schedule, m = name.split()[0], name.split("=")[-1]
    train = [json.loads(l) for l in open(run + "/metrics.jsonl")]
    tps = [r["tps"] for r in train if r.get("kind") == "train"]
    tps = statistics.median(tps[2:] or tps)
    p = json.load(open(run + "/summary.json")).get("pipeline")
    if p is None:
        print(f"| {schedule} (no PP) | 1 | - | {m} | {tps:.0f} | - | - | - | - |")
        continue
    bubbles = [st["bubble"] for st in p["per_stage"]]
    slow = ",".join(str(s) for s in p["per_stage"][p["slowest"]]["stages"])
    pr, v, mb, ideal = p["pipeline_ranks"], p["stages_per_rank"], p["microbatches"], p["ideal_bubble"]
    mean, worst = statistics.mean(bubbles), max(bubbles)
    print(f"| {schedule} | {pr} | {v} | {mb} | {tps:.0f} | {ideal:.1%} | {mean:.1%} | {worst:.1%} | {slow} |")
'
