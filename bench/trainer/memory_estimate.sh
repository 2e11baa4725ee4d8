#!/usr/bin/env bash
# titan-train's per-rank memory estimate (`--memory_estimation.enable --memory_estimation.json`)
# for llama3 8B on 8 FSDP ranks, 8B on TP 2 x FSDP 4, 70B on 64 ranks (torchtitan's llama3_70b:
# TP 8 x FSDP 8) and 70B on 64 FSDP ranks (its batch of 8, and of 1), next to the hand arithmetic: P parameters in fp32,
# their gradients and AdamW's two moments are 4 + 4 + 8 = 16 bytes per parameter, divided over
# the dp_shard x tp ranks that shard them. Printed as a Markdown table (GiB = 2^30 bytes).
# Nothing is allocated: it runs in a second on any machine.
#
# Usage: bench/trainer/memory_estimate.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
cargo build --locked -p titan-train >&2
bin="$target/debug/titan-train"
py="${PYTHON:-python3}"

estimate() { # name, nproc, then titan-train arguments
    local name="$1" nproc="$2"
    shift 2
    local json
    json="$("$bin" --memory_estimation.enable --memory_estimation.json --nproc-per-node "$nproc" "$@" | grep '^{')"
    printf '%s\t%s\n' "$name" "$json"
}

{
    estimate "8B, 8 ranks: FSDP 8" 8 --module llama3 --config llama3_8b
    estimate "8B, 8 ranks: TP 2 x FSDP 4" 8 --module llama3 --config llama3_8b \
        --parallelism.tensor_parallel_degree 2
    estimate "70B, 64 ranks: TP 8 x FSDP 8 (llama3_70b)" 64 --module llama3 --config llama3_70b
    estimate "70B, 64 ranks: FSDP 64" 64 --module llama3 --config llama3_70b \
        --parallelism.tensor_parallel_degree 1
    estimate "70B, 64 ranks: FSDP 64, local_batch_size 1" 64 --module llama3 --config llama3_70b \
        --parallelism.tensor_parallel_degree 1 --training.local_batch_size 1
} | "$py" -c '
import json, sys
G = 2**30
print("| layout (registry config: batch x seq, AC) | hand: 16 B x P / (dp_shard x tp) | estimate: shards (params + grads + AdamW) | estimate: params | grads | optimizer | activations | sum of the terms | **peak** (its phase) |")
print("|---|---|---|---|---|---|---|---|---|")
for line in sys.stdin:
    name, raw = line.rstrip("\n").split("\t", 1)
    e = json.loads(raw)
    lay, m = e["layout"], e["model"]
    hand = 16 * m["num_params"] / (lay["dp_shard"] * lay["tp"])
    shards = sum(r["bytes"] for r in e["rows"] if r["what"] in ("parameter shards", "gradient shards")) + e["optimizer_bytes"]
    ac, b, sq = e["activation_checkpointing"], e["local_batch_size"], e["seq_len"]
    cols = [hand, shards] + [e[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "terms_bytes")]
    cells = " | ".join(f"{c / G:.2f}" for c in cols)
    peak = e["peak_bytes"] / G
    phase = max(e["phases"], key=lambda p: p["bytes"])
    what, stage = phase["what"], phase["stage"]
    print(f"| {name} ({b} x {sq}, {ac}) | {cells} | **{peak:.2f}** ({what}, stage {stage}) |")
'
