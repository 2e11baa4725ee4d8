#!/usr/bin/env bash
# titan-obs on a torchtitan run vs torchtitan's own generate_gantt_trace, same files, same run:
# 256 ranks x 1000 steps written by torchtitan 0.3.0's structured logger (bench/obs/tt_gen.py).
#
#   bash bench/obs/tt_run.sh [RUNS] [GANTT_RUNS]   (defaults 5 and 3; medians reported)
#
# Environment: OBS_BENCH_DIR (default /tmp/titan-obs-bench), TITAN_TT_PYTHON (.venv-tt python).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${1:-5}
GANTT_RUNS=${2:-3}
DIR=${OBS_BENCH_DIR:-/tmp/titan-obs-bench}
PY=${TITAN_TT_PYTHON:-.venv-tt/bin/python}
TARGET=${CARGO_TARGET_DIR:-target}
cargo build --release -p titan-obs --bin titan-obs >&2
BIN=$TARGET/release/titan-obs
RUN=$DIR/tt-256x1000
mkdir -p "$DIR"
if [ ! -d "$RUN/structured_logs" ]; then
  /usr/bin/time -f 'generator: %e s wall, peak RSS %M kB' "$PY" bench/obs/tt_gen.py "$RUN"
fi
echo "run: $RUN ($(du -sh "$RUN" | cut -f1), $(ls "$RUN/structured_logs" | wc -l) files, $(cat "$RUN"/structured_logs/*.jsonl | wc -l) records)"
echo "load while measuring: $(cut -d' ' -f1-3 /proc/loadavg)"

# shellcheck source=bench/obs/measure.sh
source bench/obs/measure.sh

measure "titan-obs summary" "$RUNS" "$BIN" summary --quiet "$RUN"
measure "titan-obs summary --json" "$RUNS" "$BIN" summary --quiet --json "$RUN"
measure "torchtitan generate_gantt_trace" "$GANTT_RUNS" "$PY" bench/obs/tt_gantt.py "$RUN/structured_logs" "$DIR/gantt.json"
measure "titan-obs summary on the gantt JSON" "$RUNS" "$BIN" summary --quiet "$DIR/gantt.json"
rm -rf "$DIR/imported"
measure "titan-obs import (to titan parts)" 1 "$BIN" import --quiet "$RUN" "$DIR/imported"
measure "titan-obs summary on the imported parts" "$RUNS" "$BIN" summary --quiet "$DIR/imported"
