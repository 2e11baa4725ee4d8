#!/usr/bin/env bash
# The whole test suite on a fresh machine: setup (idempotent), build every binary, run every test.
# Interop tests use the real PyTorch / safetensors / transformers / pyarrow from .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# The build needs only libtorch (torch 2.13 in .venv); the test packages (torch 2.15 + torchtitan
# in .venv-tt, transformers, ...: mostly download and unpacking) install while it compiles.
bash scripts/setup.sh build
export TITAN_PYTHON="$root/.venv/bin/python"
# One compute thread per process: libtest runs two tests at once on these two cores and most
# tests start processes of their own (titan-train, torch, torchtitan), so more threads only spin
# against each other (two one-process runs side by side: 22 s with 2 threads each, 14 s with 1).
# Both sides of every comparison see the same count; multi-rank launches give each rank 1 anyway.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# A one-shot build gains nothing from incremental caches (they were ~8 GB of target/debug).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# --tests too: one feature resolution for bins and tests, so `cargo test` reuses this build.
# titan-train's default `nccl` feature compiles the NCCL backend (cudarc, loaded at run time)
# here, though CI has no GPU.
cargo build --workspace --bins --tests --locked &
build=$!
trap 'kill "$build" 2>/dev/null || true' EXIT
bash scripts/setup.sh test
wait "$build"
trap - EXIT
# Every test binary runs even after one fails: a failure early on must not hide the others'.
cargo test --workspace --locked --no-fail-fast
