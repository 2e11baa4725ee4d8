#!/usr/bin/env bash
# `summary` of a large local run read from its node figures, as written, then with every rank
# live (a journal after its last part written into every rank folder, as a running recorder has
# one), then restored (the journals removed, the folders' mtimes put back, so the run's node
# files describe it again). Issue 42.
#
#   bash bench/obs/live_summary.sh RUN [JOURNAL_INDEX]   # JOURNAL_INDEX: each rank's last part + 1
#
# e.g. on bench/obs/scale.sh's 16 384 x 24 h run: RUN=/tmp/obs43/journal-sparse-top-16384x24h, 144.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=$1
NEXT=$(printf '%06d' "${2:-144}")
OBS=$RUN/obs
cargo build --release --locked -p titan-obs --bin titan-obs >&2
BIN=${CARGO_TARGET_DIR:-target}/release/titan-obs
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
# shellcheck source=bench/obs/measure.sh
source bench/obs/measure.sh
measure "summary, as written" 3 "$BIN" summary "$RUN" --quiet
grep -E "read from node figures|live:" "$DIR/out.txt" || true
python3 - "$OBS" "$NEXT" "$DIR/mtimes.json" <<'PY'
import json, os, sys
obs, nxt, keep = sys.argv[1:]
saved = {}
for e in os.scandir(obs):
    if e.name.startswith("rank-"):
        saved[e.name] = os.stat(e.path).st_mtime_ns
json.dump(saved, open(keep, "w"))
for name in saved:
    with open(os.path.join(obs, name, f"journal-{nxt}.arrows"), "wb") as f:
        f.write(b"appended")
PY
measure "summary, every rank live" 3 "$BIN" summary "$RUN" --quiet
grep -E "read from node figures|live:|ranks \(world" "$DIR/out.txt" || true
python3 - "$OBS" "$NEXT" "$DIR/mtimes.json" <<'PY'
import json, os, sys
obs, nxt, keep = sys.argv[1:]
for name, ns in json.load(open(keep)).items():
    os.remove(os.path.join(obs, name, f"journal-{nxt}.arrows"))
    os.utime(os.path.join(obs, name), ns=(ns, ns))
PY
measure "summary, restored" 1 "$BIN" summary "$RUN" --quiet
grep -E "read from node figures|live:" "$DIR/out.txt" || true
