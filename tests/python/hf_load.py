"""The first check of the HF conversion tests: transformers loads a converted Llama directory with
no missing, unexpected or mismatched key, and every weight equals the expected one bit for bit.

Imported by ckpt_llama.py (titan-ckpt's own fixture) and tt_ckpt_llama3.py (torchtitan's).
"""

import os
import sys

import torch
from safetensors.torch import load_file


def load_llama_exactly(hf_dir, expected):
    """LlamaForCausalLM.from_pretrained(hf_dir), once its loading info is empty and each tensor of
    the `expected` safetensors file equals the loaded weight of that name; exits naming the first
    that is not."""
    import transformers
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"transformers {transformers.__version__} loading info: {bad}")
    got = model.state_dict()
    for k, v in load_file(expected).items():
        if k not in got or not torch.equal(got[k], v):
            sys.exit(f"{k}: transformers loaded another value than {os.path.basename(expected)} holds")
    return model
