#!/usr/bin/env bash
# all_reduce bus bandwidth: titan's cpu backend vs torch.distributed gloo, same sizes, same run.
# usage: bash bench/dist/run.sh [--ranks 2,4] [--max-mb 256] [--iters 5]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
echo "== titan cpu backend (trainer/benches/dist_allreduce.rs)"
cargo bench -p titan-train --bench dist_allreduce -- "$@"
echo "== torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') gloo"
.venv/bin/python bench/dist/torch_allreduce.py "$@"
