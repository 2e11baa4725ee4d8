#!/usr/bin/env bash
# titan-train vs plain PyTorch eager: same debug model, batch, seq_len and thread count, run back
# to back RUNS times: titan default (bf16 autocast) and fp32, torch eager fp32 and under
# torch.autocast(bfloat16) (fp32 master weights, same AdamW); prints each run, the medians
# (tokens/s and peak RSS) and the ratios.
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
titan_run() { # NAME EXTRA_ARGS...: one titan-train run, its post-warmup tps and peak RSS
  local name="$1"; shift
  "$target/release/titan-train" --training.steps "$steps" --training.seq_len "$seq" \
    --training.local_batch_size "$batch" --metrics.log_freq "$warmup" --validation.enable=false \
    --observability.enable=false --debug.seed 0 --job.dump_folder "$out/$name$i" "$@" > /dev/null
  # tps of the log windows after the warmup steps (log_freq = warmup). Every window has the same
  # number of tokens, so total tokens / total time is the harmonic mean of the window tps.
  "$py" - "$out/$name$i/metrics.jsonl" "$warmup" "$name" >> "$out/$name.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"train"' in l]
timed = [r for r in rows if r["step"] > int(sys.argv[2])]
tps = len(timed) / sum(1 / r["tps"] for r in timed)
print(json.dumps({"impl": sys.argv[3], "tps": tps, "peak_rss_gib": rows[-1]["peak_rss_gib"]}))
PY
}
for i in $(seq 1 "$runs"); do
  common=(--steps "$steps" --warmup "$warmup" --seq_len "$seq" --batch "$batch" --threads "$threads")
  "$py" bench/trainer/torch_eager.py "${common[@]}" >> "$out/torch_fp32.jsonl"
  "$py" bench/trainer/torch_eager.py "${common[@]}" --autocast >> "$out/torch_autocast.jsonl"
  titan_run titan_bf16
  titan_run titan_fp32 --training.mixed_precision_param float32
  echo "run $i: $(tail -qn1 "$out"/*.jsonl | tr '\n' ' ')" >&2
done
"$py" - "$out" "$threads" "$seq" "$batch" "$steps" <<'PY'
import json, statistics, sys
d = sys.argv[1]
names = ["torch_fp32", "torch_autocast", "titan_bf16", "titan_fp32"]
rows = {n: [json.loads(l) for l in open(f"{d}/{n}.jsonl")] for n in names}
med = {n: statistics.median(x["tps"] for x in r) for n, r in rows.items()}
rss = {n: statistics.median(x["peak_rss_gib"] for x in r) for n, r in rows.items()}
print(json.dumps({
    "threads": int(sys.argv[2]), "seq_len": int(sys.argv[3]), "batch": int(sys.argv[4]),
    "steps": int(sys.argv[5]), "runs": len(rows["titan_bf16"]),
    "tps": {n: [round(x["tps"], 1) for x in r] for n, r in rows.items()},
    "tps_median": {n: round(v, 1) for n, v in med.items()},
    "peak_rss_gib_median": {n: round(v, 3) for n, v in rss.items()},
    "titan_bf16_over_titan_fp32": round(med["titan_bf16"] / med["titan_fp32"], 3),
    "titan_bf16_over_torch_autocast": round(med["titan_bf16"] / med["torch_autocast"], 3),
    "titan_fp32_over_torch_fp32": round(med["titan_fp32"] / med["torch_fp32"], 3),
}, indent=1))
PY
