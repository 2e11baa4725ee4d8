"""torchtitan's offline DCP -> HF path for the benchmark: the model's state dict allocated from
its config (as torchtitan's convert_to_hf does), `dcp.load` of the 2-rank checkpoint,
`DeepSeekV3StateDictAdapter.to_hf` (splitting the stacked experts), and safetensors `save_file`.

usage: dsv3_torchtitan.py DCP OUT [--layers ...]   (same model flags as dsv3_gen.py)
"""

import argparse
import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dsv3_gen import config, model_flags  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dcp")
    ap.add_argument("out")
    model_flags(ap)
    a = ap.parse_args()
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    cfg = config(a)
    with torch.device("meta"):
        model = cfg.build()
    sd = {k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=a.dcp)
    hf = DeepSeekV3StateDictAdapter(cfg, None).to_hf(sd)
    os.makedirs(a.out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(a.out, "model.safetensors"))


if __name__ == "__main__":
    main()
