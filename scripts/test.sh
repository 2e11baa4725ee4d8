#!/usr/bin/env bash
# The whole test suite on a fresh machine: setup (idempotent), build every binary, run every test.
# Interop tests use the real PyTorch / safetensors / transformers / pyarrow from .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export TITAN_PYTHON="$root/.venv/bin/python"
# A one-shot build gains nothing from incremental caches (they were ~8 GB of target/debug).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# --tests too: one feature resolution for bins and tests, so `cargo test` reuses this build.
cargo build --workspace --bins --tests --locked
# The NCCL backend (cudarc, dynamic loading) must compile even though CI has no GPU.
cargo check -p titan-train --features nccl --lib --locked
# Every test binary runs even after one fails: a failure early on must not hide the others'.
cargo test --workspace --locked --no-fail-fast
