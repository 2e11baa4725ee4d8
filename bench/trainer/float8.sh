#!/usr/bin/env bash
# float8 against bf16 and fp32 on this machine: first the matmuls (bench/trainer/float8_matmul.py,
# in the libtorch titan-train links), then titan-train's training tokens/s for the debug model,
# each setting run RUNS times back to back, medians printed as a Markdown table with the command.
#
# Settings: fp32 (mixed_precision_param float32), bf16 (the default: FSDP's bf16 parameter cast),
# float8 tensorwise and rowwise through torch._scaled_mm, float8 tensorwise emulated; the float8
# runs keep the default bf16 parameter cast, as torchtitan's float8 runs do.
#
# Usage: bench/trainer/float8.sh [RUNS] [STEPS] [SEQ_LEN] [BATCH]    (defaults 3 20 256 8)
#   env TITAN_TRAIN: the binary (default: target/release/titan-train, built here).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
runs="${1:-3}" steps="${2:-20}" seq="${3:-256}" batch="${4:-8}"
warmup=5
py="$root/.venv/bin/python"
if [ -z "${TITAN_TRAIN:-}" ]; then
  cargo build --release --locked -p titan-train >&2
  TITAN_TRAIN="${CARGO_TARGET_DIR:-$root/target}/release/titan-train"
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

echo "## float8 matmuls"
"$py" bench/trainer/float8_matmul.py
echo

# run NAME EXTRA_ARGS...: one titan-train run; appends its post-warmup tokens/s to $out/NAME.
run() {
  local name="$1"; shift
  local dump="$out/run-$name-$i"
  "$TITAN_TRAIN" --training.steps "$steps" --training.seq_len "$seq" \
    --training.local_batch_size "$batch" --metrics.log_freq "$warmup" \
    --validation.enable=false --observability.enable=false --debug.seed 0 \
    --job.dump_folder "$dump" "$@" > /dev/null
  # Every logged window has the same tokens: total tokens / total time is the harmonic mean.
  "$py" - "$dump/metrics.jsonl" "$warmup" >> "$out/$name" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"train"' in l]
timed = [r for r in rows if r["step"] > int(sys.argv[2])]
print(len(timed) / sum(1 / r["tps"] for r in timed))
PY
  rm -rf "$dump"
}

names=(fp32 bf16 float8_tensorwise float8_rowwise float8_tensorwise_emulated)
for i in $(seq "$runs"); do
  run fp32 --training.mixed_precision_param float32
  run bf16
  run float8_tensorwise --float8.enable_float8_linear --float8.recipe_name tensorwise
  run float8_rowwise --float8.enable_float8_linear --float8.recipe_name rowwise
  run float8_tensorwise_emulated --float8.enable_float8_linear --float8.recipe_name tensorwise \
    --float8.emulate
done

echo "## titan-train debugmodel b${batch} x s${seq}, ${steps} steps (tokens/s after ${warmup} warmup steps), median of ${runs}"
echo
echo "| setting | tokens/s | vs fp32 | vs bf16 |"
echo "|---|---|---|---|"
"$py" - "$out" "${names[@]}" <<'PY'
import statistics, sys
out, names = sys.argv[1], sys.argv[2:]
med = {n: statistics.median(float(v) for v in open(f"{out}/{n}")) for n in names}
for n in names:
    print(f"| {n} | {med[n]:.0f} | {med[n] / med['fp32']:.2f}x | {med[n] / med['bf16']:.2f}x |")
PY
echo
echo "command: bench/trainer/float8.sh $runs $steps $seq $batch (TITAN_TRAIN=$TITAN_TRAIN), $(nproc) cores"
