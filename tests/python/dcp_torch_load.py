"""Loads a DCP checkpoint written by titan-ckpt with torch.distributed.checkpoint and checks it.

usage: dcp_torch_load.py CKPT_DIR REF_DIR

REF_DIR/index.json lists tensors (dtype, shape; bytes in REF_DIR/<fqn>.bin) and objects (the values
of bytes items). Loads into a state dict of zeros with dcp.load (single process), compares every
tensor's bytes and every object, then runs format_utils.dcp_to_torch_save and compares again.
Prints a JSON summary; exits 1 on any mismatch.
"""

import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

warnings.filterwarnings("ignore")


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def main():
    ckpt, ref = sys.argv[1], sys.argv[2]
    with open(os.path.join(ref, "index.json")) as f:
        index = json.load(f)
    sd = {}
    for k, m in index["tensors"].items():
        sd[k] = torch.zeros(m["shape"], dtype=getattr(torch, m["dtype"]))
    for k in index["objects"]:
        sd[k] = None
    dcp.load(sd, checkpoint_id=ckpt)
    errors = []

    def check(where, got):
        for k, m in index["tensors"].items():
            with open(os.path.join(ref, k + ".bin"), "rb") as f:
                want = f.read()
            t = got[k]
            if str(t.dtype).removeprefix("torch.") != m["dtype"] or list(t.shape) != m["shape"]:
                errors.append(f"{where}: {k} is {t.dtype} {list(t.shape)}")
            elif raw(t) != want:
                errors.append(f"{where}: {k} bytes differ")
        for k, v in index["objects"].items():
            if got[k] != v:
                errors.append(f"{where}: {k} = {got[k]!r}, want {v!r}")

    check("dcp.load", sd)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(ckpt, path)
        full = torch.load(path, weights_only=False)
        check("dcp_to_torch_save", full)
    print(json.dumps({"tensors": len(index["tensors"]), "objects": len(index["objects"]), "errors": errors}))
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
