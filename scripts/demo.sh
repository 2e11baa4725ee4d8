#!/usr/bin/env bash
# The main job for a newcomer: setup (idempotent), build titan-train, and train the debug model on
# the embedded default data. Extra arguments are passed to titan-train (e.g. --training.steps 50).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
cargo build --release --locked -p titan-train -p titan-obs-tui -p titan-ckpt
exec ./target/release/titan-train --job.config_file configs/debug_model.toml "$@"
