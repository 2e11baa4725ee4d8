#!/usr/bin/env bash
# What reading a titan run on S3 costs in requests (issue 42), counted by a local moto server
# from its request log: `titan-obs synth` writes RANKS ranks (8 a node) of STEPS steps,
# STEPS_PER_PART a part, to s3://bench/run; then
#   - `summary --node-figures off` (each rank's `rank.summary`),
#   - `summary` (from 1024 ranks: the nodes' figures objects),
#   - the TUI until its first gantt frame (the nodes' timelines) in a 160x50 tmux pane,
# each printed as one JSON line: the requests by method and the seconds (against moto on this
# machine: the counts carry over to S3, the times do not).
#
#   bash bench/obs/s3_requests.sh            # RANKS=1024 STEPS=120 STEPS_PER_PART=20
#   RELEASE=1 bash bench/obs/s3_requests.sh  # a release build
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKS=${RANKS:-1024}
STEPS=${STEPS:-120}
STEPS_PER_PART=${STEPS_PER_PART:-20}
TARGET=${CARGO_TARGET_DIR:-target}
if [ "${RELEASE:-0}" = 1 ]; then
  cargo build --release --locked -p titan-obs --bin titan-obs >&2
  BIN=$TARGET/release/titan-obs
else
  cargo build --locked --workspace --bins --tests >&2
  BIN=$TARGET/debug/titan-obs
fi
WORK=$(mktemp -d)
PORT=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
.venv/bin/moto_server -H 127.0.0.1 -p "$PORT" > /dev/null 2> "$WORK/moto.log" &
MOTO=$!
SESSION=titan-obs-s3-$$
cleanup() {
  tmux kill-session -t "$SESSION" 2> /dev/null || true
  kill "$MOTO" 2> /dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
export AWS_ENDPOINT=http://127.0.0.1:$PORT AWS_ALLOW_HTTP=true AWS_ACCESS_KEY_ID=test \
  AWS_SECRET_ACCESS_KEY=test AWS_REGION=us-east-1 TMPDIR=$WORK
until .venv/bin/python tests/python/s3_client.py "$AWS_ENDPOINT" bench mkbucket 2> /dev/null; do
  sleep 0.2
done
URL=s3://bench/run

# requests_since LINE: the requests moto logged after its log's line LINE, by method, as JSON.
requests_since() {
  tail -n +"$(($1 + 1))" "$WORK/moto.log" | sed 's/\x1b\[[0-9;]*m//g' |
    awk -F'"' 'NF > 2 {split($2, r, " "); if (r[3] ~ /^HTTP\//) n[r[1]]++}
      END {s = ""; for (m in n) s = s sprintf("%s\"%s\":%d", (s == "" ? "" : ","), m, n[m]); print "{" s "}"}'
}
log_lines() { wc -l < "$WORK/moto.log"; }

# measure LABEL CMD...: runs CMD once; its requests and seconds.
measure() {
  local label=$1 before t0 t1
  shift
  before=$(log_lines)
  t0=$(date +%s.%N)
  "$@" > /dev/null
  t1=$(date +%s.%N)
  printf '{"measure":"%s","requests":%s,"seconds":%.2f}\n' "$label" "$(requests_since "$before")" \
    "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')"
}

measure "synth ${RANKS} ranks x ${STEPS} steps, ${STEPS_PER_PART} a part" \
  "$BIN" synth "$URL" --ranks "$RANKS" --steps "$STEPS" --steps-per-part "$STEPS_PER_PART" \
  --straggler 5:forward_backward:1.4 --quiet
measure "summary --node-figures off (rank summaries)" "$BIN" summary "$URL" --node-figures off --quiet
measure "summary --node-figures on (node figures)" "$BIN" summary "$URL" --node-figures on --quiet

# tui_open LABEL: the TUI until its first gantt frame shows (as bench/obs/scale.sh waits for
# it); its worker (steps, summary, metrics) runs meanwhile, and its requests are counted too.
tui_open() {
  local before t0 t1
  before=$(log_lines)
  t0=$(date +%s.%N)
  tmux new-session -d -s "$SESSION" -x 160 -y 50 "TERM=xterm-256color $BIN $URL --detail-levels always"
  until tmux capture-pane -p -t "$SESSION" 2> /dev/null |
    awk '/ranks, .* lanes/ {h = 1} /forward_backward/ {g = 1} END {exit !(h && g)}'; do
    sleep 0.05
    tmux has-session -t "$SESSION" 2> /dev/null || { echo '{"error":"the TUI exited"}'; exit 1; }
  done
  t1=$(date +%s.%N)
  printf '{"measure":"%s","requests":%s,"seconds":%.2f}\n' "$1" \
    "$(requests_since "$before")" "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')"
  tmux kill-session -t "$SESSION" 2> /dev/null || true
}
tui_open "tui first frame (node timelines)"
# Without the timelines (a run written before them): every rank folder listed, its first and
# last part's footer read.
.venv/bin/python tests/python/s3_client.py "$AWS_ENDPOINT" bench rm-suffix run/obs .timeline
tui_open "tui first frame (rank folders listed)"
