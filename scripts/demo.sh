#!/usr/bin/env bash
# The main job for a newcomer: setup (idempotent), build the three tools, train the debug model on the
# embedded default data with a checkpoint at the end, and print the commands to look at what it made.
# Extra arguments are passed to titan-train (e.g. --training.steps 200).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
cargo build --release --locked -p titan-train -p titan-obs -p titan-ckpt

run=outputs/demo
# titan-train resumes from the newest checkpoint in its dump folder, as torchtitan does: start afresh.
rm -rf "$run"
# A checkpoint of the model at the last step (model only, so it is small) for the conversion below.
./target/release/titan-train --job.config_file configs/debug_model.toml --job.dump_folder "$run" \
  --checkpoint.enable --checkpoint.last_save_model_only "$@"

bin=./target/release
cat <<MSG

Next — paste any of these (from $root):
  $bin/titan-obs $run                          # the per-rank gantt of this run (q quits, ? help)
  $bin/titan-obs summary $run                  # where the time went, per phase; stragglers
  $bin/titan-obs metrics $run                  # the logged loss / throughput per step
  $bin/titan-ckpt inspect $run/checkpoint      # the newest checkpoint: tensors, dtypes, parameters
  $bin/titan-ckpt convert $run/checkpoint $run/hf --to hf --adapter llama3
                                               # -> Hugging Face safetensors + config.json
  $bin/titan-obs gantt $run --svg $run/gantt.svg   # the gantt as an image
MSG
