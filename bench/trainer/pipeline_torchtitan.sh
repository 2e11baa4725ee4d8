#!/usr/bin/env bash
# titan-train's pipeline parallelism against torchtitan 0.3.0's own (torch 2.15's
# torch.distributed.pipelining over gloo, with the CPU shims of tests/python/tt_parity.py): PP=2
# with 1F1B and Interleaved1F1B, the debug model in fp32 at seq_len 256 and local batch 8 (8
# microbatches), the same command line for both (torchtitan's PP needs
# --training.disable_cuda_graphs; titan-train accepts it as changing nothing), one thread per
# rank (OMP_NUM_THREADS=1, as tt_parity runs torchtitan). Tokens/s per rank: the batch's tokens
# over the median step time of steps 3..STEPS (torchtitan: between its logged steps; titan-train:
# its metrics.jsonl `tps`). Markdown table on stdout.
#
# Usage: bench/trainer/pipeline_torchtitan.sh [STEPS]   (default 10)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
steps="${1:-10}"
target="${CARGO_TARGET_DIR:-$root/target}"
cargo build --locked -p titan-train >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
.venv-tt/bin/python - "$work" "$steps" "$target/debug/titan-train" <<'EOF'
import json, os, statistics, sys

sys.path.insert(0, "tests/python")
from tt_ckpt_trainer import write_assets  # noqa: E402
from tt_parity import titan, torchtitan  # noqa: E402

work, steps, binary = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def rows(path, kind=None):
    return [r for r in map(json.loads, open(path)) if kind is None or r.get("kind") == kind]


tok, data = write_assets(work)
batch, seq = 8, 256
print("| schedule (PP=2) | torchtitan 0.3.0 tokens/s | titan-train tokens/s | titan / torchtitan |")
print("|---|---|---|---|")
for schedule in ["1F1B", "Interleaved1F1B"]:
    def args(dump):
        return [
            "--module", "llama3", "--config", "llama3_debugmodel",
            "--hf_assets_path", tok, "--dataloader.dataset_path", data,
            "--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
            "--training.steps", str(steps), "--training.mixed_precision_param", "float32",
            "--validator.no-enable", "--debug.seed", "7", "--metrics.log_freq", "1",
            "--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs",
            "--parallelism.pipeline_parallel_schedule", schedule, "--dump_folder", dump,
        ]
    tt_dump = os.path.join(work, f"tt-{schedule}")
    losses = os.path.join(tt_dump, "losses.jsonl")
    torchtitan(2, args(tt_dump), losses)
    times = [r["time"] for r in rows(losses)]
    tt_tps = batch * seq / statistics.median(b - a for a, b in zip(times[2:], times[3:]))
    titan_dump = os.path.join(work, f"titan-{schedule}")
    titan(binary, 2, args(titan_dump))
    tps = [r["tps"] for r in rows(os.path.join(titan_dump, "metrics.jsonl"), "train")]
    titan_tps = statistics.median(tps[2:])
    print(f"| {schedule} | {tt_tps:.0f} | {titan_tps:.0f} | {titan_tps / tt_tps:.2f}x |")
EOF
