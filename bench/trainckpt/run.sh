#!/usr/bin/env bash
# Checkpoint save/load: titan-train vs torch.distributed.checkpoint on the same state, same run.
# Usage: bench/trainckpt/run.sh   (env: RUNS=5 SIZES=debugmodel,1gb OUT=/tmp/trainckpt_bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RUNS="${RUNS:-5}" SIZES="${SIZES:-debugmodel,1gb}" OUT="${OUT:-/tmp/trainckpt_bench}"
mkdir -p "$OUT"
# Single-threaded libtorch copies on both sides keep the comparison about the I/O path.
cargo bench -p titan-train --bench trainckpt_save_load 2>/dev/null | grep '^{' | tee "$OUT/titan.jsonl"
: > "$OUT/torch.jsonl"
while read -r line; do
  size=$(echo "$line" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["size"])')
  dir=$(echo "$line" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["checkpoint"])')
  .venv/bin/python bench/trainckpt/torch_dcp.py "$size" "$dir" "$OUT" "$RUNS" | tee -a "$OUT/torch.jsonl"
done < "$OUT/titan.jsonl"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
t = {j["size"]: j for j in map(json.loads, open(f"{out}/titan.jsonl"))}
p = {j["size"]: j for j in map(json.loads, open(f"{out}/torch.jsonl"))}
print(f"{'state':<11} {'MB':>7} {'titan save':>11} {'torch save':>11} {'ratio':>6} {'titan load':>11} {'torch load':>11} {'ratio':>6} {'async block':>12} {'async total':>12} {'titan RSS':>10} {'torch RSS':>10}")
for s in t:
    a, b = t[s], p[s]
    print(f"{s:<11} {a['bytes']/1e6:>7.0f} {a['save_s']:>10.3f}s {b['save_s']:>10.3f}s {b['save_s']/a['save_s']:>5.2f}x {a['load_s']:>10.3f}s {b['load_s']:>10.3f}s {b['load_s']/a['load_s']:>5.2f}x {a['async_blocked_s']:>11.3f}s {a['async_total_s']:>11.3f}s {a['peak_rss_bytes']/2**30:>9.2f}G {b['peak_rss_bytes']/2**30:>9.2f}G")
PY
