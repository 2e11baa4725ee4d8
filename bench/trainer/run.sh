#!/usr/bin/env bash
# titan-train vs plain PyTorch eager, same debug model, thread count and AdamW, run back to back
# RUNS times, medians printed as a Markdown table (tokens/s after warmup, peak RSS from
# /usr/bin/time -v) with the command that reproduced them.
#
# Part 1, precision (b BATCH x s SEQ_LEN, STEPS steps): titan default (bf16 autocast), titan fp32,
#   titan training.dtype=bfloat16, torch eager fp32, torch eager under torch.autocast(bfloat16)
#   (fp32 master weights).
# Part 2, activation checkpointing (b AC_BATCH x s AC_SEQ_LEN, AC_STEPS steps, where activations
#   dominate memory): titan default precision with mode none / full / selective op / selective 2,
#   and torch eager autocast with and without torch.utils.checkpoint on every block.
# First, once: the hardware's ceiling for mixed precision (bench/trainer/matmul_ceiling.py:
#   torch.mm bf16 vs fp32 GFLOP/s at the model's matmul shapes).
#
# Usage: bench/trainer/run.sh [RUNS] [STEPS] [SEQ_LEN] [BATCH]
#   env AC_STEPS (12), AC_SEQ_LEN (1024), AC_BATCH (8); AC=0 skips part 2.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
runs="${1:-5}" steps="${2:-40}" seq="${3:-256}" batch="${4:-8}"
ac_steps="${AC_STEPS:-12}" ac_seq="${AC_SEQ_LEN:-1024}" ac_batch="${AC_BATCH:-8}" ac="${AC:-1}"
warmup=10 ac_warmup=4
target="${CARGO_TARGET_DIR:-$root/target}"
cargo build --release --locked -p titan-train >&2
py="$root/.venv/bin/python"
threads="$("$py" -c 'import torch; print(torch.get_num_threads())')"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

# Peak RSS (GiB) of the command that wrote /usr/bin/time -v output to $1.
peak_rss() { awk -F': ' '/Maximum resident set size/ {printf "%.3f", $2 / 1048576}' "$1"; }

# titan NAME STEPS WARMUP SEQ BATCH EXTRA_ARGS...: one titan-train run; appends its post-warmup
# tokens/s and peak RSS to $out/NAME.jsonl.
titan() {
  local name="$1" n="$2" w="$3" s="$4" b="$5"; shift 5
  local dump="$out/run-$name-$i"
  /usr/bin/time -v -o "$out/time" "$target/release/titan-train" --training.steps "$n" \
    --training.seq_len "$s" --training.local_batch_size "$b" --metrics.log_freq "$w" \
    --validation.enable=false --observability.enable=false --debug.seed 0 \
    --job.dump_folder "$dump" "$@" > /dev/null
  # tps of the log windows after the warmup window (log_freq = warmup). Every window has the same
  # number of tokens, so total tokens / total time is the harmonic mean of the window tps.
  "$py" - "$dump/metrics.jsonl" "$w" "$name" "$(peak_rss "$out/time")" >> "$out/$name.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"train"' in l]
timed = [r for r in rows if r["step"] > int(sys.argv[2])]
tps = len(timed) / sum(1 / r["tps"] for r in timed)
print(json.dumps({"impl": sys.argv[3], "tps": tps, "peak_rss_gib": float(sys.argv[4])}))
PY
  rm -rf "$dump"
}

# torch NAME STEPS WARMUP SEQ BATCH EXTRA_ARGS...: one torch_eager.py run, same record.
torch_eager() {
  local name="$1" n="$2" w="$3" s="$4" b="$5"; shift 5
  /usr/bin/time -v -o "$out/time" "$py" bench/trainer/torch_eager.py --steps "$n" --warmup "$w" \
    --seq_len "$s" --batch "$b" --threads "$threads" "$@" > "$out/line"
  "$py" - "$out/line" "$name" "$(peak_rss "$out/time")" >> "$out/$name.jsonl" <<'PY'
import json, sys
row = json.loads(open(sys.argv[1]).read())
print(json.dumps({"impl": sys.argv[2], "tps": row["tps"], "peak_rss_gib": float(sys.argv[3])}))
PY
}

# The hardware's ceiling for mixed precision: torch.mm bf16 vs fp32 at the model's shapes.
"$py" bench/trainer/matmul_ceiling.py --threads "$threads" > "$out/ceiling.json"
echo '{}' > "$out/isa.json"
if grep -qw avx512_bf16 /proc/cpuinfo && command -v cc > /dev/null; then
  cc -O2 -mavx512f -mavx512bf16 -o "$out/isa_peak" bench/trainer/isa_peak.c
  "$out/isa_peak" > "$out/isa.json"
fi

precision=(titan_bf16 titan_fp32 titan_dtype_bf16 torch_fp32 torch_autocast)
checkpointing=(titan_ac_none titan_ac_full titan_ac_op titan_ac_every2 torch_autocast_ac_none torch_autocast_ac_full)
for i in $(seq 1 "$runs"); do
  p=("$steps" "$warmup" "$seq" "$batch")
  torch_eager torch_fp32 "${p[@]}"
  torch_eager torch_autocast "${p[@]}" --autocast
  titan titan_bf16 "${p[@]}"
  titan titan_fp32 "${p[@]}" --training.mixed_precision_param float32
  titan titan_dtype_bf16 "${p[@]}" --training.dtype bfloat16
  if [ "$ac" = 1 ]; then
    a=("$ac_steps" "$ac_warmup" "$ac_seq" "$ac_batch")
    titan titan_ac_none "${a[@]}"
    titan titan_ac_full "${a[@]}" --activation_checkpoint.mode full
    titan titan_ac_op "${a[@]}" --activation_checkpoint.mode selective \
      --activation_checkpoint.selective_ac_option op
    titan titan_ac_every2 "${a[@]}" --activation_checkpoint.mode selective \
      --activation_checkpoint.selective_ac_option 2
    torch_eager torch_autocast_ac_none "${a[@]}" --autocast
    torch_eager torch_autocast_ac_full "${a[@]}" --autocast --full_ac
  fi
  echo "run $i done: $(tail -qn1 "$out"/*.jsonl | tr '\n' ' ')" >&2
done

load="$(cut -d' ' -f1-3 /proc/loadavg)"
"$py" - "$out" "$threads" "$load" "$*" \
  "$steps:$warmup:$seq:$batch" "$ac_steps:$ac_warmup:$ac_seq:$ac_batch:$ac" <<'PY'
import json, os, statistics, sys
d, threads, load, argv = sys.argv[1:5]
ceiling = json.load(open(f"{d}/ceiling.json"))
isa = json.load(open(f"{d}/isa.json"))
steps, warmup, seq, batch = map(int, sys.argv[5].split(":"))
ac_steps, ac_warmup, ac_seq, ac_batch, ac = map(int, sys.argv[6].split(":"))
label = {
    "titan_bf16": "titan-train default (bf16 autocast, fp32 weights)",
    "titan_fp32": "titan-train fp32 (`mixed_precision_param float32`)",
    "titan_dtype_bf16": "titan-train `training.dtype bfloat16` (bf16 weights + AdamW state)",
    "torch_fp32": "PyTorch eager fp32",
    "torch_autocast": "PyTorch eager, torch.autocast(bfloat16), fp32 weights",
    "titan_ac_none": "titan-train default, `activation_checkpoint.mode none`",
    "titan_ac_full": "titan-train default, `mode full`",
    "titan_ac_op": "titan-train default, `mode selective`, `selective_ac_option op`",
    "titan_ac_every2": "titan-train default, `mode selective`, `selective_ac_option 2`",
    "torch_autocast_ac_none": "PyTorch eager autocast(bf16), no checkpointing",
    "torch_autocast_ac_full": "PyTorch eager autocast(bf16), torch.utils.checkpoint per block",
}
def load_rows(name):
    return [json.loads(l) for l in open(f"{d}/{name}.jsonl")]
def table(names, base):
    rows = {n: load_rows(n) for n in names}
    med = {n: statistics.median(x["tps"] for x in r) for n, r in rows.items()}
    rss = {n: statistics.median(x["peak_rss_gib"] for x in r) for n, r in rows.items()}
    print(f"| run | tokens/s (median of {len(rows[names[0]])}) | vs {base} | peak RSS GiB | all runs tokens/s |")
    print("|---|---|---|---|---|")
    for n in names:
        runs = ", ".join(f"{x['tps']:.0f}" for x in rows[n])
        print(f"| {label[n]} | {med[n]:.0f} | {med[n] / med[base]:.2f}x | {rss[n]:.3f} | {runs} |")
    return med, rss
env = f"AC_STEPS={ac_steps} AC_SEQ_LEN={ac_seq} AC_BATCH={ac_batch}" if ac else "AC=0"
print(f"\n`{env} bench/trainer/run.sh {argv}` ({threads} threads, load average at the end {load})\n")
print(f"Precision: debugmodel b{batch} x s{seq}, {steps} steps, tokens/s of steps {warmup + 1}-{steps}\n")
med, rss = table(["titan_bf16", "titan_fp32", "titan_dtype_bf16", "torch_fp32", "torch_autocast"], "titan_fp32")
summary = {
    "titan_bf16_over_titan_fp32": med["titan_bf16"] / med["titan_fp32"],
    "titan_bf16_over_torch_autocast": med["titan_bf16"] / med["torch_autocast"],
    "titan_fp32_over_torch_fp32": med["titan_fp32"] / med["torch_fp32"],
}
print(f"\nThe ceiling: torch.mm GFLOP/s, torch {ceiling['torch']}, {ceiling['threads']} threads, "
      f"avx512_bf16 {ceiling['avx512_bf16']}, amx_bf16 {ceiling['amx_bf16']} "
      "(`bench/trainer/matmul_ceiling.py`)\n")
print("| m x k x n | fp32 | bf16 | bf16 / fp32 |")
print("|---|---|---|---|")
for r in ceiling["matmuls"]:
    m, k, n = r["mkn"]
    print(f"| {m} x {k} x {n} | {r['fp32_gflops']:.0f} | {r['bf16_gflops']:.0f} | {r['bf16_over_fp32']:.2f}x |")
if isa:
    print(f"\nOne core's arithmetic peak (`bench/trainer/isa_peak.c`): fp32 FMA "
          f"{isa['fp32_fma_gflops_per_core']:.0f} GFLOP/s, bf16 dot product (vdpbf16ps) "
          f"{isa['bf16_dot_gflops_per_core']:.0f} GFLOP/s")
    summary["bf16_dot_over_fp32_fma_peak"] = isa["bf16_dot_gflops_per_core"] / isa["fp32_fma_gflops_per_core"]
summary["bf16_mm_over_fp32_mm_median"] = statistics.median(r["bf16_over_fp32"] for r in ceiling["matmuls"])
if ac:
    print(f"\nActivation checkpointing: debugmodel b{ac_batch} x s{ac_seq}, {ac_steps} steps, tokens/s of steps {ac_warmup + 1}-{ac_steps}\n")
    med, rss = table(["titan_ac_none", "titan_ac_full", "titan_ac_op", "titan_ac_every2",
                      "torch_autocast_ac_none", "torch_autocast_ac_full"], "titan_ac_none")
    summary["titan_full_ac_rss_saved_gib"] = rss["titan_ac_none"] - rss["titan_ac_full"]
    summary["torch_full_ac_rss_saved_gib"] = rss["torch_autocast_ac_none"] - rss["torch_autocast_ac_full"]
print("\n" + json.dumps({k: round(v, 3) for k, v in summary.items()}))
PY
