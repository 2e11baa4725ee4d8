#!/usr/bin/env bash
# Every GPU check of issues 35 and 36 in one run, for a machine lent for a few minutes:
#   1. the NCCL backend on a 1-rank communicator (trainer/tests/nccl_cuda.rs): every collective,
#      GPU-side ordering with no host wait, the watchdog's timeout path;
#   2. tokens/s, MFU and memory of titan-train against PyTorch eager autocast on the same model,
#      batch and (plain causal) attention: the debug model at b8 and b16 x s2048, torchtitan's
#      llama3 1B at b2 x s4096; host syncs and phases of an observed run (titan-obs summary);
#   3. FSDP2, HSDP, TP2 (+SP), PP2 (four schedules) as processes sharing the one GPU over the cpu
#      backend with CUDA tensors: the same loss curves as one GPU process
#      (tests/tests/dist_train.rs with TITAN_TEST_CUDA=1);
#   4. titan-obs's GPU clock: CUDA-event twins placed where the device ran them, and the
#      caching allocator's tensor peak (tests/tests/gpu_timing.rs with TITAN_TEST_CUDA=1);
#   5. what recording costs on the GPU: the debug model at b8 x s2048 with titan-obs (and its
#      GPU clock) off and on, interleaved, REPEATS times (default 3);
#   6. where a 1B step's time goes on the GPU: llama3 1B at b2 x s4096 observed, titan-obs
#      summary with its gpu: twins.
#
# Usage: BIN=<folder with titan-train, titan-obs, nccl_cuda, e2e (tests/'s tests)> LIBTORCH=<torch 2.13
# lib folder> bash bench/trainer/cuda_checks.sh. python3's own torch runs the eager baseline and
# lends its NVIDIA libraries. Summaries go to $OUT, run folders to $WORK (default: temporary folders).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="${BIN:?set BIN to the folder of the binaries}"
# Run folders and per-run logs (many files) stay in $WORK; $OUT gets the summaries.
out="${OUT:-$(mktemp -d)}"
work="${WORK:-$(mktemp -d)}"
mkdir -p "$out" "$work"
sp=$(python3 -c 'import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))')
# cudarc opens libnccl.so (or .so.<CUDA major>); pip's NCCL wheel ships only libnccl.so.2.
nccl_dir="$work/nccl-link"
mkdir -p "$nccl_dir"
ln -sf "$(find "$sp/nvidia" -name 'libnccl.so.2' | head -1)" "$nccl_dir/libnccl.so"
export LD_LIBRARY_PATH="${LIBTORCH:?set LIBTORCH}:$nccl_dir:$(ls -d "$sp"/nvidia/*/lib "$sp"/nvidia/*/*/lib 2>/dev/null | tr '\n' ':')"
log() { printf '\n== %s (%s s)\n' "$*" "$SECONDS"; }
# CHECKS picks sections (default all); DIST_TESTS the dist_train tests of section 3.
checks="${CHECKS:-1 2 3 4}"
want() { [[ " $checks " == *" $1 "* ]]; }

log "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("eager torch", torch.__version__)'
ldd "$bin/titan-train" | grep 'not found' && echo "titan-train: libraries missing (above)"

if want 1; then
log "1. nccl backend, 1-rank communicator"
timeout 90 "$bin/nccl_cuda" --ignored --test-threads 1 --nocapture 2>&1 | tail -40
fi

want 2 && log "2. tokens/s: titan-train vs PyTorch eager autocast"
titan() {
  local name="$1" steps="$2"; shift 2
  RUST_LOG=info timeout 150 "$bin/titan-train" --job.dump_folder "$work/run-$name" \
    --training.steps "$steps" --training.device cuda --validation.enable=false \
    --metrics.log_freq 10 "$@" >"$work/$name.log" 2>&1
  local rc=$?
  printf '| titan %s | rc %s | %s |\n' "$name" "$rc" \
    "$(grep '"kind":"train"' "$work/run-$name/metrics.jsonl" 2>/dev/null | tail -1)"
  grep -E 'WARN|ERROR|error' "$work/$name.log" | grep -v re-looping | head -5
  [ "$rc" -eq 0 ] || tail -15 "$work/$name.log"
}
eager() {
  local name="$1"; shift
  timeout 150 python3 "$root/bench/trainer/torch_eager.py" --device cuda --autocast "$@" \
    >"$work/eager-$name.json" 2>"$work/eager-$name.err"
  printf '| eager %s | %s |\n' "$name" "$(cat "$work/eager-$name.json")"
  tail -3 "$work/eager-$name.err"
}
want 2 && for b in 8 16; do
  titan "b${b}_sdpa" 40 --training.local_batch_size $b --training.seq_len 2048 \
    --model.attn_backend sdpa --observability.enable=false
  titan "b${b}_varlen" 40 --training.local_batch_size $b --training.seq_len 2048 \
    --observability.enable=false
  titan "b${b}_sdpa_inline" 40 --training.local_batch_size $b --training.seq_len 2048 \
    --model.attn_backend sdpa --observability.enable=false --training.prefetch_batches 0
  eager "b${b}" --batch $b --seq_len 2048 --steps 40 --warmup 10
done
if want 2; then
titan b8_sdpa_observed 40 --training.local_batch_size 8 --training.seq_len 2048 \
  --model.attn_backend sdpa
"$bin/titan-obs" summary "$work/run-b8_sdpa_observed" | head -24
"$bin/titan-obs" summary --json "$work/run-b8_sdpa_observed" >"$out/summary_b8.json" 2>&1
python3 - "$out/summary_b8.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except Exception as e:
    print("summary unreadable:", e, open(sys.argv[1]).read()[:2000]); sys.exit()
print("host_syncs:", json.dumps(s.get("host_syncs")))
print("median step ms:", (s.get("median_step_ns") or 0) / 1e6)
for p in s.get("phases", [])[:24]:
    share = p.get("share_of_step") or p.get("concurrent_share_of_step") or 0
    print("%-22s %-4s depth %d count %4d p50 %9.3f ms share %.3f" % (
        p["name"], p.get("clock", "?"), p["depth"], p["count"], p["p50_ns"] / 1e6, share))
PY
titan 1B_sdpa 30 --model.flavor 1B --training.local_batch_size 2 --training.seq_len 4096 \
  --model.attn_backend sdpa --observability.enable=false
eager 1B --flavor 1B --batch 2 --seq_len 4096 --steps 30 --warmup 10
fi

# titan_tests finds titan-train and titan-obs beside its test folder and runs from the
# workspace root the test binary was built in.
mkdir -p /tmp/tt/p/deps && cp "$bin/titan-train" "$bin/titan-obs" /tmp/tt/p/
mkdir -p /work && [ -e /work/main ] || ln -s "$root" /work/main
if want 3; then
log "3. layouts sharing the GPU over the cpu backend (CUDA tensors)"
cp "$bin/e2e" /tmp/tt/p/deps/
# pyarrow (for the span counts) is the machine's.
TITAN_PYTHON="$(command -v python3)" TITAN_TEST_CUDA=1 timeout 240 /tmp/tt/p/deps/e2e \
  --test-threads 1 ${DIST_TESTS:-dist_train::multi_rank_loss_curves_match_one_rank \
  dist_train::tensor_parallel_loss_curves_match_one_rank \
  dist_train::pipeline_parallel_loss_curves_match_one_rank} \
  2>&1 | tail -40
fi
if want 4; then
log "4. GPU clock: CUDA-event twins in titan-obs"
cp "$bin/e2e" /tmp/tt/p/deps/
TITAN_TEST_CUDA=1 timeout 120 /tmp/tt/p/deps/e2e gpu_timing:: --test-threads 1 --nocapture 2>&1 |
  tail -30
titan b8_sdpa_observed_again 40 --training.local_batch_size 8 --training.seq_len 2048 \
  --model.attn_backend sdpa
"$bin/titan-obs" summary "$work/run-b8_sdpa_observed_again" | sed -n '/^phases/,/^stragglers/p' | head -30
fi
if want 5; then
log "5. titan-obs on (with the GPU clock) vs off, b8 x s2048, interleaved"
for r in $(seq "${REPEATS:-3}"); do
  titan "b8_obs_off_$r" 40 --training.local_batch_size 8 --training.seq_len 2048 \
    --model.attn_backend sdpa --observability.enable=false
  titan "b8_obs_on_$r" 40 --training.local_batch_size 8 --training.seq_len 2048 \
    --model.attn_backend sdpa
done
fi
if want 6; then
log "6. llama3 1B observed: host and GPU time per phase"
titan 1B_observed 30 --model.flavor 1B --training.local_batch_size 2 --training.seq_len 4096 \
  --model.attn_backend sdpa
"$bin/titan-obs" summary "$work/run-1B_observed" | sed -n '/^phases/,/^stragglers/p' | head -30
fi
log "done"
