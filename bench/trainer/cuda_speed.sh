#!/usr/bin/env bash
# titan-train on one CUDA GPU against PyTorch eager (bench/trainer/torch_eager.py --device cuda),
# the debug model at batch B x seq_len S, 40 steps, tokens/s at step 40 (titan's console line,
# after the 10-step warmup window) and the eager script's tokens/s after 10 warmup steps.
#
# Usage: TITAN_TRAIN=path/to/titan-train LIBTORCH=path/to/torch-2.13/lib bash bench/trainer/cuda_speed.sh [B] [S]
#   LIBTORCH: the libtorch titan-train was linked against (tch 0.26 needs 2.13); python3's own
#   torch runs the eager baseline. Logs (and the titan-obs parts of the observed run) go to $OUT.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
b="${1:-8}" s="${2:-2048}"
tt="${TITAN_TRAIN:?set TITAN_TRAIN to a titan-train binary}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
sp=$(python3 -c 'import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))')
export LD_LIBRARY_PATH="${LIBTORCH:?set LIBTORCH}:$(ls -d "$sp"/nvidia/*/lib 2>/dev/null | tr '\n' ':')"
run() {
  local name="$1"; shift
  RUST_LOG=info timeout 300 "$tt" --job.dump_folder "$out/run-$name" --training.steps 40 \
    --training.device cuda --training.local_batch_size "$b" --training.seq_len "$s" \
    --validation.enable=false --metrics.log_freq 10 "$@" >"$out/$name.log" 2>&1
  printf '| titan %s | %s |\n' "$name" \
    "$(grep 'step: 40' "$out/$name.log" | sed -E 's/.*tps_mean: ([0-9.]+).*/\1/')"
  grep -E 'WARN' "$out/$name.log" | grep -v re-looping || true
}
echo "| b$b x s$s | tokens/s |"
echo "|---|---|"
run bf16_flex --observability.enable=false
run bf16_sdpa --model.attn_backend sdpa --observability.enable=false
run fp32_flex --training.mixed_precision_param float32 --observability.enable=false
run fp32_sdpa --training.mixed_precision_param float32 --model.attn_backend sdpa --observability.enable=false
run bf16_sdpa_observed --model.attn_backend sdpa
for ac in "" --autocast; do
  python3 "$root/bench/trainer/torch_eager.py" --device cuda --batch "$b" --seq_len "$s" \
    --steps 40 --warmup 10 $ac >"$out/eager$ac.json"
  python3 - "$out/eager$ac.json" <<'PY'
import json, sys
import torch
r = json.load(open(sys.argv[1]))
print("| %s (torch %s) | %.0f |" % (r["impl"], torch.__version__, r["tps"]))
PY
done
echo "phases of the observed run: titan-obs summary $out/run-bf16_sdpa_observed"
