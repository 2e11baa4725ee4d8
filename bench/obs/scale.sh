#!/usr/bin/env bash
# titan-obs at job scale: the journal layout (one Parquet part per rank per 600 s rotate
# interval, the default) against the previous layout (one part per rank per 2 s flush) on the
# same simulated job (bench/obs/scale.rs: a step every 30 s, 10 spans + 2 scalars per rank per
# step, rank 17 1.3x slower in forward_backward). Measures files, bytes, `titan-obs summary` wall
# time and peak RSS (/usr/bin/time), a headless load of what the TUI loads (all columns), and one
# `--follow` refresh (every rank appended one flush to its open journal) as the run grows, and
# the TUI's open time: `titan-obs RUN` started in a 160x50 tmux pane until its first frame shows
# the gantt (rank lanes and the forward_backward legend), with its peak RSS.
#
#   bash bench/obs/scale.sh [RUNS]     (median of RUNS timed runs, default 3)
#
# `summary` is measured on each run as by default (from 1024 ranks: the node figures,
# `obs/node-<host>.figures`), from the summaries the generator wrote (`--node-figures off`: one
# per rank, `rank.summary`, standing for the one next to every part), with `--exact` (every span
# decoded, as before them), and once after deleting them all (a run written before summaries:
# the parts' and the ranks' built, cached, then summarised); `metrics` from the summaries and
# with `--exact`.
#
# The run's files: all of them, rank 0's folder's (one per part and `rank.summary` since issue 42),
# and the node rollups (`obs/node-<host>.summary`).
#
# Environment: OBS_SCALE_DIR (default /tmp/titan-obs-scale), RANKS (1024), HOURS ("1 6 24"),
# PROFILE (release; dev: see below), SUMMARY_ONLY (0; 1: only the files, the three summaries and the two metrics, no load/TUI/follow),
# TUI_ONLY (0; 1: only the TUI: its first frame, the time and peak RSS until its whole-run
# results (steps, phase table, metrics) have arrived, a jump to a step then a zoom to a one-minute
# window (its `frame N ms`), and `--follow` while every rank appends: refresh read/append and
# key latency), TUI_ARGS (more arguments for the TUI, e.g. `--detail-levels always` on a run
# too small for `auto`),
# TUI_MEASURES (with TUI_ONLY: which of "open whole zoom follow" to measure), LAYOUT (journal;
# journal-sparse-top: the parts' blocks freed but those of the first 64 ranks, for a run larger
# than the disk: the TUI's first frame and zoom read only those ranks' parts; see scale.rs),
# FOLLOW_RUNS (5: follow refreshes timed; the first re-lists every rank directory),
# OLD_RANKS (16) and OLD_HOURS (2): the previous layout is generated at OLD_RANKS x OLD_HOURS
# only (1024 x 24 h of it would be 35 M files), next to the journal layout of the same size.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${1:-3}
DIR=${OBS_SCALE_DIR:-/tmp/titan-obs-scale}
RANKS=${RANKS:-1024}
HOURS=${HOURS:-"1 6 24"}
OLD_RANKS=${OLD_RANKS:-16}
OLD_HOURS=${OLD_HOURS:-2}
FOLLOW_RUNS=${FOLLOW_RUNS:-5}
SUMMARY_ONLY=${SUMMARY_ONLY:-0}
TUI_ONLY=${TUI_ONLY:-0}
TUI_ARGS=${TUI_ARGS:-}
LAYOUT=${LAYOUT:-journal}
TUI_MEASURES=${TUI_MEASURES:-"open whole zoom follow"}
TARGET=${CARGO_TARGET_DIR:-target}
# PROFILE=dev: the dev profile's build (dependencies at opt-level 2, titan's crates at 1), for
# a machine where a release build of the dependencies does not fit the time at hand.
PROFILE=${PROFILE:-release}
if [ "$PROFILE" = dev ]; then
  cargo build -p titan-obs --bin titan-obs >&2
  cargo build -p titan-obs-core --bench obs_scale >&2
  OUT_DIR=$TARGET/debug
else
  cargo build --release -p titan-obs --bin titan-obs >&2
  cargo bench -p titan-obs-core --bench obs_scale --no-run >&2
  OUT_DIR=$TARGET/release
fi
SCALE=$(ls -t "$OUT_DIR"/deps/obs_scale-* | grep -v '\.d$' | head -1)
BIN=$OUT_DIR/titan-obs
mkdir -p "$DIR"

# shellcheck source=bench/obs/measure.sh
source bench/obs/measure.sh

# tui_until LABEL RUN READY WHAT [ARGS...]: RUNS times, starts the TUI (with ARGS) in a 160x50
# tmux pane, waits until the pane passes the test READY (a function reading the pane on stdin),
# then quits: the median seconds from start, and the peak RSS of the sessions. WHAT names what
# was awaited, for the error when the TUI exits first.
tui_until() {
  local label=$1 run=$2 ready=$3 what=$4 session=titan-obs-scale-$$
  shift 4
  local times=() rss=()
  for _ in $(seq "$RUNS"); do
    rm -f "$DIR/tui_time.txt"
    local t0 t1
    t0=$(date +%s.%N)
    tmux new-session -d -s "$session" -x 160 -y 50 \
      "TERM=xterm-256color /usr/bin/time -f '%e %M' -o $DIR/tui_time.txt $BIN $run $* $TUI_ARGS"
    until tmux capture-pane -p -t "$session" 2>/dev/null | "$ready"; do
      sleep 0.05
      if ! tmux has-session -t "$session" 2>/dev/null; then
        echo "{\"measure\":\"$label\",\"error\":\"the TUI exited before $what\"}"
        return
      fi
    done
    t1=$(date +%s.%N)
    tmux send-keys -t "$session" q
    while [ ! -s "$DIR/tui_time.txt" ]; do sleep 0.05; done
    times+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}')")
    rss+=("$(awk '{print $2}' "$DIR/tui_time.txt")")
    tmux kill-session -t "$session" 2>/dev/null || true
  done
  json_line "$label" "${times[*]}" "$(printf '%s\n' "${rss[@]}" | maximum)"
}

gantt_drawn() { awk '/ranks, .* lanes/ {h = 1} /forward_backward/ {g = 1} END {exit !(h && g)}'; }
whole_arrived() { grep -q 'summary, metrics'; }

# tui_open LABEL RUN: median seconds from starting the TUI to its first gantt frame on screen.
tui_open() { tui_until "$1" "$2" gantt_drawn "drawing the gantt"; }

# tui_whole LABEL RUN: the TUI until everything the whole run needs has arrived (steps, the
# summary's phase table, metrics: computed by a worker behind the first frame; with --follow,
# whose status line says what has arrived, nothing being appended): median seconds from
# start, and the peak RSS of the whole session.
tui_whole() { tui_until "$1" "$2" whole_arrived "the whole-run results" --follow; }

# tui_zoom LABEL RUN: opens the TUI, then RUNS times jumps from the whole run to a step (`g N`,
# a ~30 s window: what it shows is read then) and zooms out once (`-`, a ~1 min window); the
# TUI's own `frame N ms` (reading what the frame shows, and drawing it) of each, medians.
tui_zoom() {
  local label=$1 run=$2 session=titan-obs-zoom-$$ jumps=() zooms=()
  tmux new-session -d -s "$session" -x 160 -y 50 "TERM=xterm-256color $BIN $run $TUI_ARGS"
  until tmux capture-pane -p -t "$session" | grep -q 'frame [0-9]* ms'; do sleep 0.1; done
  frame_after() {  # frame_after KEYS...: sends KEYS, waits for the window to change, then
    # moves the cursor one cell (no read) so the status shows the frame the keys drew.
    local before
    before=$(tmux capture-pane -p -t "$session" | grep -oE ' window [^)]*\)')
    tmux send-keys -t "$session" "$@"
    until [ "$(tmux capture-pane -p -t "$session" | grep -oE ' window [^)]*\)')" != "$before" ]; do
      sleep 0.05
    done
    sleep 0.3
    tmux send-keys -t "$session" l
    sleep 0.3
    tmux capture-pane -p -t "$session" | grep -oE 'frame [0-9]+ ms' | grep -oE '[0-9]+'
  }
  for i in $(seq "$RUNS"); do
    tmux send-keys -t "$session" f
    sleep 0.5
    jumps+=("$(frame_after g $((i * 700)) Enter)")
    zooms+=("$(frame_after -)")
  done
  tmux send-keys -t "$session" q
  tmux kill-session -t "$session" 2>/dev/null || true
  echo "{\"measure\":\"$label\",\"jump_to_step_ms\":$(printf '%s\n' "${jumps[@]}" | median),\"zoom_to_1min_ms\":$(printf '%s\n' "${zooms[@]}" | median),\"all_jumps\":\"${jumps[*]}\",\"all_zooms\":\"${zooms[*]}\"}"
}

# tui_follow LABEL RUN RANKS: the TUI with --follow while every rank appends one flush to its
# journal every second, FOLLOW_RUNS times: each refresh's read (worker) and append (UI
# thread) from its status line, and how fast `?` is answered meanwhile (help on screen).
tui_follow() {
  local label=$1 run=$2 ranks=$3 session=titan-obs-follow-$$ reads=() appends=() keys=()
  tmux new-session -d -s "$session" -x 160 -y 50 "TERM=xterm-256color $BIN $run --follow $TUI_ARGS"
  until tmux capture-pane -p -t "$session" | grep -q 'following'; do sleep 0.1; done
  "$SCALE" append "$run" "$ranks" "$FOLLOW_RUNS" 1 > "$DIR/append.out" &
  local writer=$! last=""
  while kill -0 "$writer" 2>/dev/null; do
    local t0 t1 status
    t0=$(date +%s.%N)
    tmux send-keys -t "$session" '?'
    until tmux capture-pane -p -t "$session" | grep -q "keys (? or Esc closes)"; do sleep 0.005; done
    t1=$(date +%s.%N)
    tmux send-keys -t "$session" Escape
    keys+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.0f", (b - a) * 1000}')")
    status=$(tmux capture-pane -p -t "$session" | head -1 | grep -oE 'read [0-9.]+ ms, appended [0-9.]+ ms' || true)
    if [ -n "$status" ] && [ "$status" != "$last" ]; then
      last=$status
      reads+=("$(echo "$status" | awk '{print $2}')")
      appends+=("$(echo "$status" | awk '{print $5}')")
    fi
    sleep 0.2
  done
  tmux send-keys -t "$session" q
  tmux kill-session -t "$session" 2>/dev/null || true
  echo "{\"measure\":\"$label\",\"refreshes_seen\":${#reads[@]},\"read_ms\":$(printf '%s\n' "${reads[@]}" | median),\"append_ms\":$(printf '%s\n' "${appends[@]}" | median),\"key_ms\":$(printf '%s\n' "${keys[@]}" | median),\"key_max_ms\":$(printf '%s\n' "${keys[@]}" | maximum),\"all_reads\":\"${reads[*]}\",\"all_appends\":\"${appends[*]}\"}"
}

describe() {
  echo "{\"run\":\"$1\",\"files\":$(find "$1/obs" -type f | wc -l),\"files_rank_0\":$(find "$1/obs/rank-0" -type f | wc -l),\"node_rollups\":$(find "$1/obs" -maxdepth 1 -name 'node-*.summary' | wc -l),\"bytes\":$(du -sb "$1/obs" | cut -f1)}"
}

one() {  # one LAYOUT RANKS HOURS
  local run=$DIR/$1-$2x$3h
  [ -d "$run/obs" ] || "$SCALE" gen "$run" "$1" "$2" "$3"
  describe "$run"
  if [ "$TUI_ONLY" = 1 ]; then
    case " $TUI_MEASURES " in *" open "*) tui_open "tui open $1 $2x$3h" "$run" ;; esac
    case " $TUI_MEASURES " in *" whole "*) tui_whole "tui whole-run results $1 $2x$3h" "$run" ;; esac
    case " $TUI_MEASURES " in *" zoom "*) tui_zoom "tui zoom $1 $2x$3h" "$run" ;; esac
    case " $TUI_MEASURES " in *" follow "*) tui_follow "tui follow $1 $2x$3h" "$run" "$2" ;; esac
    return
  fi
  # The summary as by default (from 1024 ranks up: the node figures, issue 42), from the rank
  # summaries (--node-figures off), from every span (--exact: what `summary` did before
  # summaries), through the node rollups (opt-in: TITAN_OBS_NODE_ROLLUPS=1), then with the
  # rollups and figures moved aside (the rank summaries again, as a check), and without rank
  # summaries either (every part's summary read from its footer; they are rebuilt and cached,
  # then the summary is the second line's). The rollups are moved to $DIR/rollups and not put back (the rank summaries
  # rebuilt changed the rank folders, so they no longer describe them): the headless load,
  # the TUI and `--follow` below then read the rank summaries; TUI_ONLY=1 on a fresh run
  # measures the TUI with its rollups.
  measure_json "summary $1 $2x$3h" "$RUNS" "$BIN" summary "$run" --quiet
  measure_json "summary --node-figures off $1 $2x$3h" "$RUNS" "$BIN" summary "$run" --quiet \
    --node-figures off
  measure_json "summary --exact $1 $2x$3h" "$RUNS" "$BIN" summary "$run" --quiet --exact
  TITAN_OBS_NODE_ROLLUPS=1 measure_json "summary through node rollups $1 $2x$3h" "$RUNS" \
    "$BIN" summary "$run" --quiet --node-figures off
  # `metrics` reads the summaries' scalar sections the same way.
  measure_json "metrics $1 $2x$3h" "$RUNS" "$BIN" metrics "$run" --quiet
  measure_json "metrics --exact $1 $2x$3h" "$RUNS" "$BIN" metrics "$run" --quiet --exact
  mkdir -p "$DIR/rollups"
  find "$run/obs" -maxdepth 1 -name 'node-*' -exec mv {} "$DIR/rollups/" \;
  measure_json "summary without node rollups $1 $2x$3h" "$RUNS" "$BIN" summary "$run" --quiet
  find "$run/obs" \( -name 'part-*.summary' -o -name rank.summary \) -delete
  measure_json "summary, first open without rank summaries $1 $2x$3h" 1 "$BIN" summary "$run" --quiet
  if [ "$SUMMARY_ONLY" = 1 ]; then return; fi
  "$SCALE" load "$run" "$RUNS"
  tui_open "tui open $1 $2x$3h" "$run"
  if [ "$1" = journal ]; then "$SCALE" follow "$run" "$2" "$FOLLOW_RUNS"; fi
}

echo "# machine: $(nproc) cores; other processes: $(ps -eo pcpu= | awk '{s+=$1} END{print s}')% CPU in use at start"
if [ "$OLD_HOURS" != 0 ]; then
  one old "$OLD_RANKS" "$OLD_HOURS"
  one journal "$OLD_RANKS" "$OLD_HOURS"
fi
for h in $HOURS; do one "$LAYOUT" "$RANKS" "$h"; done
