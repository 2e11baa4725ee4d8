"""Makes one expert of one MoE layer the router's favourite, in a copy of a DCP checkpoint: BIAS
added to entry EXPERT of `layers.LAYER.moe.expert_bias_E`, the bias the router adds to the
experts' scores when it picks its top k (the other tensors as they are). Read and written with
torch's own DCP (no_dist), so what titan-train loads is what torch wrote.

  bias_expert.py SRC DST LAYER EXPERT BIAS
"""

import sys

import torch
import torch.distributed.checkpoint as dcp


def main():
    src, dst, layer, expert, bias = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    meta = dcp.FileSystemReader(src).read_metadata()
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if hasattr(m, "size")
    }
    dcp.load(sd, checkpoint_id=src, no_dist=True)
    key = f"layers.{layer}.moe.expert_bias_E"
    if key not in sd:
        sys.exit(f"{src} has no {key}")
    sd[key][expert] += bias
    dcp.save(sd, checkpoint_id=dst, no_dist=True)


if __name__ == "__main__":
    main()
