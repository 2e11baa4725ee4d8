#!/usr/bin/env bash
# Does the TUI answer keys while `--follow` rebuilds a large run's timeline? Opens
# `titan-obs RUN --follow` in a 160x50 tmux pane on a simulated 1024-rank x HOURS journal run
# (bench/obs/scale.rs), then has every rank append to its journal for a while (`obs_scale follow`,
# so the TUI reloads and rebuilds repeatedly) and, every 0.5 s for SECONDS, times `?` (help shown)
# and Esc. Prints one line per probe (time, latency, the TUI's follow status) and the summary.
#
#   bash bench/obs/tui_follow_keys.sh [HOURS] [SECONDS]     (defaults 6 and 60)
#
# Environment: OBS_SCALE_DIR (default /tmp/titan-obs-scale), as bench/obs/scale.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
HOURS=${1:-6}
SECONDS_PROBED=${2:-60}
DIR=${OBS_SCALE_DIR:-/tmp/titan-obs-scale}
TARGET=${CARGO_TARGET_DIR:-target}
cargo build --release -p titan-obs --bin titan-obs >&2
cargo bench -p titan-obs-core --bench obs_scale --no-run >&2
SCALE=$(ls -t "$TARGET"/release/deps/obs_scale-* | grep -v '\.d$' | head -1)
BIN=$TARGET/release/titan-obs
RUN=$DIR/journal-1024x${HOURS}h
mkdir -p "$DIR"
[ -d "$RUN/obs" ] || "$SCALE" gen "$RUN" journal 1024 "$HOURS" >&2
# shellcheck source=bench/obs/measure.sh
source bench/obs/measure.sh

session=titan-obs-keys-$$
trap 'tmux kill-session -t "$session" 2>/dev/null || true' EXIT
tmux new-session -d -s "$session" -x 160 -y 50 "TERM=xterm-256color $BIN $RUN --follow"
until tmux capture-pane -p -t "$session" | grep -q following; do sleep 0.5; done
echo "# opened $(date +%T); every rank now appends to its journal"
"$SCALE" follow "$RUN" 1024 400 > "$DIR/follow.out" &
writer=$!
help_shown() { tmux capture-pane -p -t "$session" | grep -q "keys (? or Esc closes)"; }
latencies=()
end=$(($(date +%s) + SECONDS_PROBED))
while [ "$(date +%s)" -lt "$end" ]; do
  t0=$(date +%s.%N)
  tmux send-keys -t "$session" '?'
  until help_shown; do sleep 0.005; done
  t1=$(date +%s.%N)
  tmux send-keys -t "$session" Escape
  while help_shown; do sleep 0.005; done
  ms=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.0f", (b - a) * 1000}')
  latencies+=("$ms")
  status=$(tmux capture-pane -p -t "$session" | head -1 | grep -oE 'following: [^│]*' || true)
  echo "$(date +%T) ? answered in $ms ms | $status"
  sleep 0.5
done
wait "$writer"
echo "{\"probes\":${#latencies[@]},\"median_ms\":$(printf '%s\n' "${latencies[@]}" | median),\"max_ms\":$(printf '%s\n' "${latencies[@]}" | maximum)}"
