#!/usr/bin/env bash
# Bit flips in a journal, as a careless disk would make them: CASES times, flip FLIPS random
# bits of RUN's journal-000000.arrows (a fresh copy each time), run `BIN summary --json` and
# `BIN export --chrome` on it, and count the outcomes: panics (exit 101), other failures,
# damage named in `--json` (`damage`, `corrupt_parts`, `truncated_tails`), and the share of the
# journal's records still exported.
#
#   bash bench/obs/flips.sh BIN RUN [CASES] [FLIPS]      (defaults 300 cases, 1 flip)
#
# RUN: a run whose rank 0 holds an open journal (e.g. left by a killed recorder; the
# `journal_child` helper of tests/tests/obs_journal.rs in `rate` mode writes one). Remove its
# `journal-000000.checks` to measure a journal written before checks existed.
set -euo pipefail
BIN=$1
RUN=$2
CASES=${3:-300}
FLIPS=${4:-1}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
count() { # records in a Chrome export
  python3 -c 'import json,sys; print(sum(1 for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") in ("X","i","I","C")))' "$1"
}
"$BIN" export "$RUN" --chrome "$WORK/clean.json" -q
total=$(count "$WORK/clean.json")
panics=0 failed=0 named=0 unnamed_loss=0 kept=0
for i in $(seq "$CASES"); do
  rm -rf "$WORK/run"
  cp -r "$RUN" "$WORK/run"
  python3 - "$WORK/run/obs/rank-0/journal-000000.arrows" "$i" "$FLIPS" <<'EOF'
import random, sys
path, seed, flips = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
b = bytearray(open(path, "rb").read())
r = random.Random(seed)
for _ in range(flips):
    i = r.randrange(len(b))
    b[i] ^= 1 << r.randrange(8)
open(path, "wb").write(b)
EOF
  set +e
  "$BIN" summary "$WORK/run" --json >"$WORK/s.json" 2>"$WORK/err"
  rc=$?
  "$BIN" export "$WORK/run" --chrome "$WORK/out.json" -q 2>/dev/null
  erc=$?
  set -e
  if [ $rc -eq 101 ] || grep -q panicked "$WORK/err"; then
    panics=$((panics + 1))
    continue
  fi
  if [ $rc -ne 0 ] || [ $erc -ne 0 ]; then
    failed=$((failed + 1))
    continue
  fi
  n=$(count "$WORK/out.json")
  kept=$((kept + n))
  if python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d.get("damage") or d["corrupt_parts"] or d["truncated_tails"] else 1)' "$WORK/s.json"; then
    named=$((named + 1))
  elif [ "$n" -ne "$total" ]; then
    unnamed_loss=$((unnamed_loss + 1))
  fi
done
echo "{\"cases\":$CASES,\"flips\":$FLIPS,\"records\":$total,\"panics\":$panics,\"failed\":$failed,\"damage_named\":$named,\"records_lost_unnamed\":$unnamed_loss,\"records_kept_share\":$(python3 -c "print(round($kept / ($total * $CASES), 4))")}"
