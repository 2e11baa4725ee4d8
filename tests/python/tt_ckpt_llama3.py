"""Fixtures written by torchtitan 0.3.0's own code (its Llama-3 debugmodel and
Llama3StateDictAdapter) and checks of titan-ckpt's conversions against them.

Run `make` and `check-dcp` with torch 2.15 + torchtitan (TITAN_TT_PYTHON); `check-hf` with any
torch + transformers (TITAN_PYTHON: transformers 5; PYTHONPATH=$TITAN_TF4_PATH: transformers 4).

usage:
  tt_ckpt_llama3.py make DIR
      DIR/dcp1/      model-only DCP of the seeded debugmodel from one process (0.3.0 names)
      DIR/dcp2/      the same model saved by 2 gloo ranks with FSDP2 fully_shard (Shard(0)
                     DTensors) plus AdamW state after one step under `optimizer.` (flattened
                     names as torchtitan's OptimizersContainer saves them)
      DIR/ref.safetensors        the model state dict (torchtitan names)
      DIR/expected_hf.safetensors  Llama3StateDictAdapter.to_hf of it
      DIR/logits.safetensors     torchtitan's model logits on fixed tokens
  tt_ckpt_llama3.py check-hf HF DIR    transformers LlamaForCausalLM loads HF with every key,
      its tensors equal expected_hf bit for bit, and its logits equal torchtitan's to 1e-4
  tt_ckpt_llama3.py check-dcp DCP DIR  dcp.load into torchtitan's model state dict equals ref
"""

import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(__file__))
from hf_load import load_llama_exactly  # noqa: E402

TOKENS = torch.arange(0, 2000, 97).remainder(2048).unsqueeze(0)


def build_model():
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = spec.model.build()
    return spec, model


def forward(model):
    """torchtitan's forward on TOKENS as one document (its flex block-causal mask)."""
    positions = torch.arange(TOKENS.shape[1]).unsqueeze(0)
    masks = model.get_attention_masks(positions)
    return model(TOKENS, positions, masks)


def seeded_state(model):
    # Deterministic, distinct values for every tensor (independent of init code paths).
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fsdp_rank(rank, world, d, port):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, StateDictOptions
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    # A forked rank: one intra-op thread, so it never enters an OpenMP pool the parent started.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _, model = build_model()
    ref = load_file(os.path.join(d, "ref.safetensors"))
    model.load_state_dict(ref)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    # One optimizer step creates its state (FlexAttention has no backward on CPU, which is also
    # why torchtitan's Trainer cannot train this model on CPU): fixed gradients, lr 0 so the
    # weights stay the reference values.
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    state = dict(model.state_dict())
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state["optimizer"] = osd
    dcp.save(state, checkpoint_id=os.path.join(d, "dcp2"))
    # Both ranks leave gloo together: a rank exiting while the other is still in a collective
    # aborts the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    # Even so, torch 2.15's rank 0 sometimes aborted the same way during interpreter
    # finalization (twice in 2026-11-27's full suites): gloo's worker threads can still hold
    # work objects whose tensors reach into Python then (pytorch/pytorch#179291). Everything is
    # written (dcp.save returns once its files are closed), so the rank leaves without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make(d):
    import socket

    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    os.makedirs(d, exist_ok=True)
    spec, model = build_model()
    ref = seeded_state(model)
    save_file(ref, os.path.join(d, "ref.safetensors"))
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(d, "dcp1"))
    adapter = Llama3StateDictAdapter(spec.model, None)
    hf = adapter.to_hf(dict(ref))
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(d, "expected_hf.safetensors"))
    with torch.no_grad():
        logits = forward(model)
    save_file({"logits": logits.contiguous()}, os.path.join(d, "logits.safetensors"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Forked, not spawned: the ranks start with torchtitan already imported.
    mp.start_processes(fsdp_rank, args=(2, d, port), nprocs=2, join=True, start_method="fork")


def check_hf(hf_dir, d):
    import transformers

    model = load_llama_exactly(hf_dir, os.path.join(d, "expected_hf.safetensors"))
    with torch.no_grad():
        out = model(TOKENS).logits
    ref = load_file(os.path.join(d, "logits.safetensors"))["logits"]
    diff = (out - ref).abs().max().item()
    if diff > 1e-4:
        sys.exit(f"transformers {transformers.__version__}: logits differ from torchtitan's by {diff:.3e}")
    print(f"ok transformers {transformers.__version__} max logit diff {diff:.2e}")


def check_dcp(dcp_dir, d):
    import torch.distributed.checkpoint as dcp

    _, model = build_model()
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=dcp_dir)
    ref = load_file(os.path.join(d, "ref.safetensors"))
    if set(sd) != set(ref):
        sys.exit(f"keys differ: {sorted(set(sd) ^ set(ref))}")
    for k, v in ref.items():
        if not torch.equal(sd[k], v):
            sys.exit(f"{k} differs after dcp.load")
    model.load_state_dict(sd, strict=True)
    print(f"ok torch {torch.__version__}: {len(sd)} tensors equal")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2])
    elif cmd == "check-hf":
        check_hf(sys.argv[2], sys.argv[3])
    elif cmd == "check-dcp":
        check_dcp(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
