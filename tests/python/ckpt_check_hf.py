"""Check an HF safetensors output directory against reference tensors, exactly.

usage: ckpt_check_hf.py OUT_DIR EXPECTED.safetensors [--torch-dir DIR] [--dtype bf16]

Loads every file of OUT_DIR with safetensors.torch.load_file (through the index when there is
one), and requires: the same tensor names as EXPECTED, torch.equal values (after converting the
expected floats to --dtype when given), and, with --torch-dir, equality with every tensor torch's
own consolidate_safetensors_files wrote there. Prints "ok" or exits non-zero with the reason.
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file


def load_dir(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    out = {}
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    for f in files:
        part = load_file(os.path.join(d, f))
        dup = set(part) & set(out)
        assert not dup, f"tensors in two files: {dup}"
        out.update(part)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("expected")
    p.add_argument("--torch-dir")
    p.add_argument("--dtype")
    a = p.parse_args()
    got = load_dir(a.out)
    exp = load_file(a.expected)
    if set(got) != set(exp):
        sys.exit(f"names differ: only ours {sorted(set(got) - set(exp))}, only expected {sorted(set(exp) - set(got))}")
    for k, v in exp.items():
        if a.dtype and v.dtype.is_floating_point:
            v = v.to(getattr(torch, a.dtype))
        g = got[k]
        if g.dtype != v.dtype or g.shape != v.shape or not torch.equal(g, v):
            sys.exit(f"{k}: ours {g.dtype}{tuple(g.shape)} differs from expected {v.dtype}{tuple(v.shape)}")
    if a.torch_dir:
        ref = load_dir(a.torch_dir)
        if not ref:
            sys.exit("torch wrote nothing")
        for k, v in ref.items():
            if not torch.equal(got[k], v):
                sys.exit(f"{k}: ours differs from torch's consolidation")
        print(f"torch-compared {len(ref)}")
    print(f"ok {len(got)}")


if __name__ == "__main__":
    main()
