#!/usr/bin/env bash
# titan-obs benchmarks: summary on a synthetic 256 ranks x 1000 steps x 40 spans run (10.3 M
# spans), against the per-phase aggregation in pyarrow; the recording hot path (criterion)
# against torchtitan-style JSON lines (Rust in the same criterion run, and Python); the TUI
# frame render on 10 M spans (criterion).
#
#   bash bench/obs/run.sh [RUNS]      (RUNS of each timed command, default 5; medians reported)
#
# Environment: OBS_BENCH_DIR (default /tmp/titan-obs-bench), CARGO_TARGET_DIR as usual.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${1:-5}
DIR=${OBS_BENCH_DIR:-/tmp/titan-obs-bench}
PY=.venv/bin/python
TARGET=${CARGO_TARGET_DIR:-target}
cargo build --release -p titan-obs --bin titan-obs >&2
BIN=$TARGET/release/titan-obs
RUN=$DIR/run-256x1000x40

if [ ! -d "$RUN/obs" ]; then
  mkdir -p "$DIR"
  "$BIN" synth "$RUN" --ranks 256 --steps 1000 --spans-per-step 40 --steps-per-part 250 \
    --straggler 17:forward_backward:1.3 --straggler 200:data_loading:2.0
fi
echo "run: $RUN ($(du -sh "$RUN" | cut -f1) on disk, $(find "$RUN" -name 'part-*.parquet' | wc -l) parts)"

# shellcheck source=bench/obs/measure.sh
source bench/obs/measure.sh

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
measure "titan-obs summary" "$RUNS" "$BIN" summary "$RUN" --quiet
head -30 "$DIR/out.txt"
measure "titan-obs summary --json" "$RUNS" "$BIN" summary "$RUN" --quiet --json
measure "pyarrow group_by (count/sum/mean/max/tdigest p50,p95 per phase)" "$RUNS" $PY bench/obs/pyarrow_summary.py "$RUN"
cat "$DIR/out.txt" | head -5

# Criterion runs kept short (1 s warm-up, 3 s measurement per benchmark); medians printed.
CRITERION_ARGS=(--noplot --warm-up-time 1 --measurement-time 3)
echo "--- load: $(cut -d' ' -f1-3 /proc/loadavg) ---"
echo "--- recording hot path (criterion) ---"
cargo bench -p titan-obs-core --bench record -- "${CRITERION_ARGS[@]}" 2>&1 | grep -E "^record/|time:" || true
echo "--- torchtitan-style JSON line per record in Python ---"
$PY bench/obs/python_jsonl.py
echo "--- TUI frame render, 10 M spans, 200x60 (criterion) ---"
cargo bench -p titan-obs --bench frame -- "${CRITERION_ARGS[@]}" 2>&1 \
  | grep -E "^built|^frame_|time:" || true
echo "--- load: $(cut -d' ' -f1-3 /proc/loadavg) ---"
