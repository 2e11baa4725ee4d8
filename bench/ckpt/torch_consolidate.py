"""torch's own consolidation, for the benchmark: consolidate_safetensors_files(IN, OUT, mapping, THREADS)."""

import json
import os
import sys

from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

inp, out, mapping, threads = sys.argv[1:]
os.makedirs(out, exist_ok=True)
with open(mapping) as f:
    m = json.load(f)
consolidate_safetensors_files(inp, out, m, num_threads=int(threads))
