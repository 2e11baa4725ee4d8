#!/usr/bin/env bash
# titan-train vs plain PyTorch eager: same debug model, batch, seq_len and thread count, run back
# to back RUNS times; prints each run and the medians (tokens/s and peak RSS) and the ratio.
# Usage: bench/trainer/run.sh [RUNS] [STEPS] [SEQ_LEN] [BATCH]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
runs="${1:-5}" steps="${2:-40}" seq="${3:-256}" batch="${4:-8}"
warmup=10
target="${CARGO_TARGET_DIR:-$root/target}"
cargo build --release --locked -p titan-train >&2
py="$root/.venv/bin/python"
threads="$("$py" -c 'import torch; print(torch.get_num_threads())')"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for i in $(seq 1 "$runs"); do
  "$py" bench/trainer/torch_eager.py --steps "$steps" --warmup "$warmup" --seq_len "$seq" \
    --batch "$batch" --threads "$threads" >> "$out/torch.jsonl"
  # titan: tps of the log windows after the warmup steps (log_freq = warmup).
  "$target/release/titan-train" --training.steps "$steps" --training.seq_len "$seq" \
    --training.local_batch_size "$batch" --metrics.log_freq "$warmup" --validation.enable=false \
    --observability.enable=false --debug.seed 0 --job.dump_folder "$out/titan$i" > /dev/null
  "$py" - "$out/titan$i/metrics.jsonl" "$warmup" >> "$out/titan.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"train"' in l]
timed = [r for r in rows if r["step"] > int(sys.argv[2])]
# Every window after warmup has the same number of tokens: the mean of window tps is wrong for
# unequal windows, so use the harmonic mean (total tokens / total time).
tps = len(timed) / sum(1 / r["tps"] for r in timed)
print(json.dumps({"impl": "titan", "tps": tps, "peak_rss_gib": rows[-1]["peak_rss_gib"]}))
PY
  echo "run $i: torch $(tail -1 "$out/torch.jsonl")  titan $(tail -1 "$out/titan.jsonl")" >&2
done
"$py" - "$out" "$threads" "$seq" "$batch" "$steps" <<'PY'
import json, statistics, sys
d = sys.argv[1]
load = lambda n: [json.loads(l) for l in open(f"{d}/{n}.jsonl")]
t, r = load("torch"), load("titan")
mt, mr = statistics.median(x["tps"] for x in t), statistics.median(x["tps"] for x in r)
print(json.dumps({
    "threads": int(sys.argv[2]), "seq_len": int(sys.argv[3]), "batch": int(sys.argv[4]),
    "steps": int(sys.argv[5]), "runs": len(t),
    "torch_tps": [round(x["tps"], 1) for x in t], "titan_tps": [round(x["tps"], 1) for x in r],
    "torch_tps_median": round(mt, 1), "titan_tps_median": round(mr, 1),
    "ratio_titan_over_torch": round(mr / mt, 3),
    "torch_peak_rss_gib_median": round(statistics.median(x["peak_rss_gib"] for x in t), 3),
    "titan_peak_rss_gib_median": round(statistics.median(x["peak_rss_gib"] for x in r), 3),
}, indent=1))
PY
