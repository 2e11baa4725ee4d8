#!/usr/bin/env bash
# Issue 42: `titan-obs summary` from node figures (obs/node-<host>.figures, one per 8 ranks)
# against the rank summaries, at job scale. Writes RANKS x HOURS with bench/obs/scale.rs's
# generator (release build; a step every 30 s, 10 spans + 2 scalars per rank per step, a part
# per 600 s, rank 17 1.3x slower in forward_backward, 8 ranks per host) unless it is there,
# prints the run's files and bytes, then medians of RUNS of
#   summary --node-figures on    (the figures files, a stat and two probes per rank folder)
#   summary --node-figures off   (every rank's rank.summary: what `auto` reads below 1024 ranks)
# with wall time and peak RSS (/usr/bin/time), and the two outputs' stragglers and waits.
#
#   bash bench/obs/node_figures.sh RANKS HOURS [RUNS]   (OBS42_DIR, default /tmp/obs42)
#
# FIGURES_ONLY=1 skips the rank-summary measurement. LAYOUT=journal-sparse writes the same run
# but frees each rank's parts' disk blocks once its summaries are written (files and lengths
# kept: neither summary path reads a part's bytes; `--exact` would see zeros): a day at 16 384
# ranks is ~50 GB of parts, ~15 GB with them freed.
# Build first: cargo build --release --locked -p titan-obs --bin titan-obs &&
#              cargo bench --no-run --locked -p titan-obs-core --bench obs_scale
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKS=$1 HOURS=$2 RUNS=${3:-3}
export DIR=${OBS42_DIR:-/tmp/obs42}
mkdir -p "$DIR"
BIN=${BIN:-target/release/titan-obs}
SCALE=${SCALE:-$(ls -t target/release/deps/obs_scale-* | grep -v '\.d$' | head -1)}
LAYOUT=${LAYOUT:-journal}
RUN=$DIR/$LAYOUT-${RANKS}x${HOURS}h
# shellcheck source=bench/obs/measure.sh
source bench/obs/measure.sh
echo "# $(date -u +%H:%M) load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ ! -d "$RUN/obs" ]; then
  /usr/bin/time -f 'gen wall %e s, peak %M kB' "$SCALE" gen "$RUN" "$LAYOUT" "$RANKS" "$HOURS"
fi
files=$(find "$RUN/obs" -type f | wc -l)
echo "{\"run\":\"$RUN\",\"files\":$files,\"files_rank_0\":$(find "$RUN/obs/rank-0" -type f | wc -l),\"figures_files\":$(find "$RUN/obs" -maxdepth 1 -name 'node-*.figures' | wc -l),\"figures_bytes\":$(cat "$RUN"/obs/node-*.figures | wc -c),\"bytes\":$(du -sb "$RUN/obs" | cut -f1),\"on_disk\":$(du -s -B1 "$RUN/obs" | cut -f1)}"
measure_json "summary --node-figures on ${RANKS}x${HOURS}h" "$RUNS" "$BIN" summary "$RUN" --quiet --json --node-figures on
cp "$DIR/out.txt" "$DIR/summary-figures.json"
if [ "${FIGURES_ONLY:-0}" != 1 ]; then
  measure_json "summary --node-figures off ${RANKS}x${HOURS}h" "$RUNS" "$BIN" summary "$RUN" --quiet --json --node-figures off
  cp "$DIR/out.txt" "$DIR/summary-ranks.json"
  python3 - "$DIR/summary-figures.json" "$DIR/summary-ranks.json" <<'EOF'
import json, sys
f, r = (json.load(open(p)) for p in sys.argv[1:3])
key = lambda s: sorted((x["phase"], x["rank"]) for x in s["stragglers"])
print("figures read:", f["node_figures"])
print("stragglers: figures", key(f), "rank summaries", key(r), "same" if key(f) == key(r) else "DIFFER")
print("waits the same:", f["waits"] == r["waits"], "; median step the same:", f["median_step_ns"] == r["median_step_ns"])
for a, b in zip(f["phases"], r["phases"]):
    assert (a["name"], a["count"], a["total_ns"]) == (b["name"], b["count"], b["total_ns"]), (a, b)
print("phase counts and sums the same:", len(f["phases"]) == len(r["phases"]))
EOF
fi
echo "# $(date -u +%H:%M) load $(cut -d' ' -f1-3 /proc/loadavg)"
