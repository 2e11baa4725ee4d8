#!/usr/bin/env bash
# The full loss-parity matrix against torchtitan 0.3.0's Trainer, llama3 then dense qwen3 (CI runs a representative part:
# tests/tests/tt_parity.rs). Every layout gets torchtitan's command line; both trainers start from
# torchtitan's seed checkpoint and resume once in the middle; per-step losses and grad norms must
# agree to RTOL (relative). Prints one line per step and layout, then a JSON summary.
#
#   bash bench/trainer/parity.sh [STEPS] [RESUME_AT] [RTOL] [GRAD_RTOL]
#
# RTOL bounds the losses (default 1e-5), GRAD_RTOL the grad norms (default 1e-5: both trainers
# sum the norm of each local part in fp32, as torch's clip_grad_norm_ does; docs/training.md).
#
# Needs scripts/setup.sh's environments; builds titan-train in release unless TITAN_TRAIN names a binary.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
steps=${1:-10}
resume_at=${2:-5}
rtol=${3:-1e-5}
grad_rtol=${4:-1e-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
titan="${TITAN_TRAIN:-$root/target/release/titan-train}"
[ -x "$titan" ] || cargo build --release -p titan-train
layouts=(
  "single:1:1:"
  "dp2:2:2:"
  "dp4:4:4:"
  "hsdp2x2:4:4:--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2"
  "accum2:1:1:--training.global_batch_size 4"
  "dp2_accum2:2:2:--training.global_batch_size 8"
  "ac_full:1:1:activation_checkpoint:full"
  "tp2:2:2:--parallelism.tensor_parallel_degree 2 --parallelism.spmd_backend partial_dtensor"
  "tp2_nosp:2:2:--parallelism.tensor_parallel_degree 2 --parallelism.spmd_backend partial_dtensor --parallelism.no-enable-sequence-parallel"
  "tp4:4:4:--parallelism.tensor_parallel_degree 4 --parallelism.spmd_backend partial_dtensor"
  "fsdp2tp2:4:4:--parallelism.tensor_parallel_degree 2 --parallelism.spmd_backend partial_dtensor"
  "hsdp2x2_never:4:4:--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2 --parallelism.fsdp_reshard_after_forward never"
  # torchtitan's PP refuses CUDA graphs (on by default, even on a CPU). Its InterleavedZeroBubble
  # is left out: its weight passes leave norm.weight without a gradient (docs/distributed.md).
  "pp2_1f1b:2:2:--parallelism.pipeline_parallel_degree 2 --training.disable_cuda_graphs"
  "pp2_gpipe:2:2:--parallelism.pipeline_parallel_degree 2 --training.disable_cuda_graphs --parallelism.pipeline_parallel_schedule GPipe"
  "pp2_interleaved:2:2:--parallelism.pipeline_parallel_degree 2 --training.disable_cuda_graphs --parallelism.pipeline_parallel_schedule Interleaved1F1B"
  "pp2_dp2:4:4:--parallelism.pipeline_parallel_degree 2 --training.disable_cuda_graphs"
  "pp2_tp2:4:4:--parallelism.pipeline_parallel_degree 2 --training.disable_cuda_graphs --parallelism.tensor_parallel_degree 2 --parallelism.spmd_backend partial_dtensor"
)
.venv-tt/bin/python tests/python/tt_parity.py compare --tt-resume "$work/llama3" "$titan" "${layouts[@]}" \
  --steps "$steps" --resume-at "$resume_at" --rtol "$rtol" --grad-rtol "$grad_rtol"
# Context parallelism (CP 2, at seq 256: torchtitan's FlexAttention CP cuts 128-token blocks) with
# each load balancer and beside FSDP, TP and PP; then DeepSeek-V3's latent attention and qwen3.
cp="--parallelism.context_parallel_degree 2 --training.seq_len 256"
cp_layouts=(
  "cp2:2:2:$cp --parallelism.data_parallel_shard_degree 1"
  "cp2_ptrr:2:2:$cp --parallelism.data_parallel_shard_degree 1 --parallelism.context_parallel_load_balancer ptrr"
  "cp2_none:2:2:$cp --parallelism.data_parallel_shard_degree 1 --parallelism.context_parallel_load_balancer None"
  "cp2_fsdp2:4:4:$cp"
  "cp2_tp2:4:4:$cp --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2 --parallelism.spmd_backend partial_dtensor"
  "cp2_pp2:4:4:$cp --parallelism.data_parallel_shard_degree 1 --parallelism.pipeline_parallel_degree 2 --training.disable_cuda_graphs"
)
.venv-tt/bin/python tests/python/tt_parity.py compare --tt-resume "$work/cp" "$titan" "${cp_layouts[@]}" \
  --steps "$steps" --resume-at "$resume_at" --rtol "$rtol" --grad-rtol "$grad_rtol"
.venv-tt/bin/python tests/python/tt_parity.py compare --tt-resume "$work/dsv3_cp" "$titan" \
  "dsv3_cp2:2:2:$cp --parallelism.data_parallel_shard_degree 1" \
  --module deepseek_v3 --config deepseek_v3_debugmodel \
  --steps "$steps" --resume-at "$resume_at" --rtol "$rtol" --grad-rtol "$grad_rtol"
.venv-tt/bin/python tests/python/tt_parity.py compare --tt-resume "$work/qwen3_cp" "$titan" \
  "qwen3_cp2:2:2:$cp --parallelism.data_parallel_shard_degree 1" \
  --module qwen3 --config qwen3_debugmodel \
  --steps "$steps" --resume-at "$resume_at" --rtol "$rtol" --grad-rtol "$grad_rtol"
# Expert parallelism (torchtitan needs partial_dtensor and no CUDA graphs for EP on CPU): EP2 on 2
# ranks, EP2 x efsdp2 and EP4 on 4, HSDP 2 x EP2, PP2 x EP2 (1F1B and Interleaved1F1B), EP beside
# TP2 (2 ranks, with and without SP; FSDP2 x TP2 with EP2 and EP4) and CP2 (2 ranks; CP2 x FSDP2
# with EP4, CP2 x TP2 with EP2);
# DeepSeek-V3 and qwen3 MoE.
ep="--parallelism.spmd_backend partial_dtensor --training.disable_cuda_graphs --parallelism.expert_parallel_degree"
ep_layouts=(
  "ep2:2:2:$ep 2"
  "ep2_efsdp2:4:4:$ep 2"
  "ep4:4:4:$ep 4"
  "hsdp2_ep2:4:4:$ep 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2"
  "pp2_ep2:4:4:$ep 2 --parallelism.pipeline_parallel_degree 2"
  "pp2_interleaved_ep2:4:4:$ep 2 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B"
  "tp2_ep2:2:2:$ep 2 --parallelism.tensor_parallel_degree 2"
  "tp2_ep2_nosp:2:2:$ep 2 --parallelism.tensor_parallel_degree 2 --parallelism.no-enable-sequence-parallel"
  "fsdp2_tp2_ep2:4:4:$ep 2 --parallelism.tensor_parallel_degree 2"
  "fsdp2_tp2_ep4:4:4:$ep 4 --parallelism.tensor_parallel_degree 2"
  "cp2_ep2:2:2:$ep 2 $cp --parallelism.data_parallel_shard_degree 1"
  "cp2_fsdp2_ep4:4:4:$ep 4 $cp"
  "cp2_tp2_ep2:4:4:$ep 2 $cp --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"
)
.venv-tt/bin/python tests/python/tt_parity.py compare --tt-resume "$work/dsv3_ep" "$titan" "${ep_layouts[@]}" \
  --module deepseek_v3 --config deepseek_v3_debugmodel --buffers expert_bias_E \
  --steps "$steps" --resume-at "$resume_at" --rtol "$rtol" --grad-rtol "$grad_rtol"
.venv-tt/bin/python tests/python/tt_parity.py compare --tt-resume "$work/qwen3_moe_ep" "$titan" \
  "qwen3_moe_ep2:2:2:$ep 2" \
  --module qwen3 --config qwen3_moe_debug --buffers expert_bias_E \
  --steps "$steps" --resume-at "$resume_at" --rtol 3e-5 --grad-rtol 1e-3
# Dense qwen3 on the layouts titan-train trains it on (data parallel; its TP/PP/float8 are refused).
qwen3_layouts=(
  "qwen3_single:1:1:"
  "qwen3_dp2:2:2:"
  "qwen3_dp4:4:4:"
  "qwen3_hsdp2x2:4:4:--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2"
  "qwen3_ddp2:2:2:--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1"
  "qwen3_accum2:1:1:--training.global_batch_size 4"
  "qwen3_ac_full:1:1:activation_checkpoint:full"
)
.venv-tt/bin/python tests/python/tt_parity.py compare --tt-resume "$work/qwen3" "$titan" "${qwen3_layouts[@]}" \
  --module qwen3 --config qwen3_debugmodel \
  --steps "$steps" --resume-at "$resume_at" --rtol "$rtol" --grad-rtol "$grad_rtol"
