#!/usr/bin/env bash
# Issue 42: one file per part and node rollups at job scale. Writes RANKS x HOURS with
# bench/obs/scale.rs's generator (release build), then prints the run's files (all, rank 0's
# folder, node rollups) and bytes, and medians of 3 of `summary` through the node rollups
# (TITAN_OBS_NODE_ROLLUPS=1), `metrics`, and `summary` from the rank summaries (the default;
# the rollups moved aside meanwhile), and whether the two summaries print the same.
#
#   bash bench/obs/parts_and_rollups.sh RANKS HOURS      (OBS42_DIR, default /tmp/obs42)
#
# Build first: cargo build --release --locked -p titan-obs --bin titan-obs &&
#              cargo bench --no-run --locked -p titan-obs-core --bench obs_scale
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKS=$1 HOURS=$2
export DIR=${OBS42_DIR:-/tmp/obs42}
mkdir -p "$DIR"
BIN=target/release/titan-obs
SCALE=$(ls -t target/release/deps/obs_scale-* | grep -v '\.d$' | head -1)
RUN=$DIR/journal-${RANKS}x${HOURS}h
# shellcheck source=bench/obs/measure.sh
source bench/obs/measure.sh
echo "# $(date -u +%H:%M) load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ ! -d "$RUN/obs" ]; then
  /usr/bin/time -f 'gen wall %e s, peak %M kB' "$SCALE" gen "$RUN" journal "$RANKS" "$HOURS"
fi
echo "{\"run\":\"$RUN\",\"files\":$(find "$RUN/obs" -type f | wc -l),\"files_rank_0\":$(find "$RUN/obs/rank-0" -type f | wc -l),\"node_rollups\":$(find "$RUN/obs" -maxdepth 1 -name 'node-*.summary' | wc -l),\"bytes\":$(du -sb "$RUN/obs" | cut -f1)}"
# --node-figures off: from 1024 ranks `summary` reads the node figures (bench/obs/node_figures.sh).
TITAN_OBS_NODE_ROLLUPS=1 measure_json "summary through rollups ${RANKS}x${HOURS}h" 3 "$BIN" summary "$RUN" --quiet --node-figures off
cp "$DIR/out.txt" "$DIR/summary-rollup.txt"
TITAN_OBS_NODE_ROLLUPS=1 measure_json "metrics through rollups ${RANKS}x${HOURS}h" 3 "$BIN" metrics "$RUN" --quiet
mkdir -p "$DIR/aside"
mv "$RUN"/obs/node-* "$DIR/aside/"
measure_json "summary from rank summaries ${RANKS}x${HOURS}h" 3 "$BIN" summary "$RUN" --quiet --node-figures off
cp "$DIR/out.txt" "$DIR/summary-ranks.txt"
mv "$DIR"/aside/node-* "$RUN/obs/"
cmp "$DIR/summary-rollup.txt" "$DIR/summary-ranks.txt" && echo "same output with and without rollups"
echo "# $(date -u +%H:%M) load $(cut -d' ' -f1-3 /proc/loadavg)"
