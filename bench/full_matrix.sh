#!/usr/bin/env bash
# The tests CI leaves out (`#[ignore = "full matrix: ..."]` in tests/tests/): the heavier cases
# of a matrix whose representative part CI runs, such as qwen3's 316 M-parameter MoE debug model
# against torchtitan. Run before a release or after changing what they cover; the loss-parity
# layouts beyond those are in bench/trainer/parity.sh.
#
#   bash bench/full_matrix.sh [TEST-NAME-FILTER]
#
# Needs scripts/setup.sh's environments (bash scripts/test.sh runs it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export TITAN_PYTHON="$root/.venv/bin/python"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# tt_parity's layouts also resume torchtitan from its own save (CI's only resume titan-train).
export TITAN_FULL_MATRIX=1
cargo build --workspace --bins --tests --locked
# `--ignored` runs only ignored tests; the helper processes some tests start are ignored too.
cargo test --workspace --locked --test e2e --no-fail-fast -- --ignored \
  --skip journal_child --skip recorder_child ${1:+"$1"}
