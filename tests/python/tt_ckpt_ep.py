"""Checkpoints written by torchtitan 0.3.0's own Trainer under expert parallelism (EP), and two
broken copies of each made by editing the real thing, for `titan-ckpt verify`'s MoE checks.

The Trainer runs as in tt_ckpt_trainer.py (its CPU patches, assets and launcher), with
`--parallelism.expert_parallel_degree 2 --parallelism.spmd_backend partial_dtensor
--training.disable_cuda_graphs` (the default spmd_types backend fails on gloo with uneven
all-to-all splits). Each EP rank writes its own experts as DCP chunks of the full `[E, ...]`
tensors; with FSDP (4 ranks) efsdp splits them further.

qwen3_moe_debug's model (8 layers of 64 experts, 1.2 GB) is cut down in the rank processes to
2 layers of 8 experts with a 64-wide expert hidden size (`_build_qwen3_moe_layers`' arguments;
the code that builds, shards and saves it is torchtitan's); deepseek_v3_debugmodel runs as is.
Each rank seeds its generator apart (`seed_each_rank`: as an accelerator's DTensor RNG would).

Run with torch 2.15 + torchtitan 0.3.0 (TITAN_TT_PYTHON):

  tt_ckpt_ep.py make DIR FLAVOR
      FLAVOR: qwen3_ep2 (2 ranks, EP 2), deepseek_v3_ep2 (2 ranks, EP 2),
              qwen3_ep2_fsdp4 (4 ranks: EP 2 x efsdp 2)
      DIR/good/     the Trainer's checkpoint after 1 step (model, optimizer, ...)
      DIR/missing/  good with rank 1's chunks of every routed-expert tensor of layer LAYER
                    (model and optimizer state) dropped from .metadata: experts [E/2, E) of that
                    layer are in no chunk. torch's dcp.load reads it without a word (checked).
      DIR/halved/   good with layer LAYER's expert tensors (model and optimizer state) saved as
                    rank 0's local experts taken for all of them: global shape [E/2, ...], rank
                    0's chunks (they tile it), while the layer's router routes to E.
      DIR/copied/   good with the bytes of every routed-expert chunk rank 1 wrote overwritten by
                    rank 0's chunk at the same place within its experts: expert E/2 + i equals
                    expert i in every layer, bit for bit (the metadata is untouched).
      DIR/info.json {"experts": E, "layer": LAYER, "expert_tensors": [...model fqns...]}
"""

import json
import os
import pickle
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tt_ckpt_trainer  # noqa: E402

FLAVORS = {
    # flavor: (module, config, ranks, extra flags)
    "qwen3_ep2": ("qwen3", "qwen3_moe_debug", 2, []),
    "deepseek_v3_ep2": ("deepseek_v3", "deepseek_v3_debugmodel", 2, []),
    "qwen3_ep2_fsdp4": ("qwen3", "qwen3_moe_debug", 4, []),
}
# The layer whose experts `missing` loses (deepseek_v3's layer 0 is dense).
LAYER = 1
EXPERT_MARK = ".moe.routed_experts."


def shrink_qwen3_moe():
    from torchtitan.models import qwen3

    build = qwen3._build_qwen3_moe_layers

    def small(**kw):
        kw.update(n_layers=2, num_experts=8, top_k=2, moe_hidden_dim=64)
        return build(**kw)

    qwen3._build_qwen3_moe_layers = small


def seed_each_rank():
    """On CPU torch's DTensor RNG tracker is off, so every rank draws its shard of a parameter
    from the same seed: EP rank 1's experts come out equal to rank 0's (and FSDP's halves of
    every weight to each other; `verify` rightly warns of such a checkpoint). An accelerator's
    tracker gives each shard its own draws; here each rank's generator gets seed + rank after
    torchtitan's set_determinism, so the checkpoint's experts differ as they would on a GPU."""
    import torch
    import torch.distributed as dist
    from torchtitan.distributed import utils

    set_determinism = utils.set_determinism

    def distinct(*args, **kwargs):
        set_determinism(*args, **kwargs)
        torch.manual_seed(torch.initial_seed() + dist.get_rank())

    utils.set_determinism = distinct


def rank_main(args):
    tt_ckpt_trainer.patch_for_cpu()
    shrink_qwen3_moe()
    seed_each_rank()
    from torchtitan import train

    sys.argv = ["torchtitan.train"] + args
    train.main()


def read_metadata(step):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(step).read_metadata()


def expert_chunks(md):
    """{fqn: [(chunk index, chunk, storage info)]} of every routed-expert tensor, in `.metadata`."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    out = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if EXPERT_MARK not in fqn or not isinstance(tmd, TensorStorageMetadata) or not tmd.size:
            continue  # (AdamW's 0-d `step` of an expert tensor is not stacked)
        for i, c in enumerate(tmd.chunks):
            info = md.storage_data[MetadataIndex(fqn, c.offsets, i)]
            out.setdefault(fqn, []).append((i, c, info))
    return out


def link_copy(good, bad):
    """`good`'s files hard-linked into `bad` (the disk holds one copy), `.metadata` copied."""
    shutil.copytree(good, bad, copy_function=os.link)
    os.unlink(os.path.join(bad, ".metadata"))
    shutil.copyfile(os.path.join(good, ".metadata"), os.path.join(bad, ".metadata"))


def write_metadata(step, md):
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def make_missing(good, bad):
    """Drops the chunks rank 1 wrote (`__1_*.distcp`) of layer LAYER's expert tensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    link_copy(good, bad)
    md = read_metadata(bad)
    gone = {}
    for fqn, chunks in expert_chunks(md).items():
        if f"layers.{LAYER}." not in fqn:
            continue
        keep = [(i, c, info) for i, c, info in chunks if not info.relative_path.startswith("__1_")]
        assert len(keep) < len(chunks), f"rank 1 wrote no chunk of {fqn}"
        gone[fqn] = [c for _, c, info in chunks if info.relative_path.startswith("__1_")]
        for i, c, _ in chunks:
            del md.storage_data[MetadataIndex(fqn, c.offsets, i)]
        md.state_dict_metadata[fqn].chunks = [c for _, c, _ in keep]
        for j, (_, c, info) in enumerate(keep):
            md.storage_data[MetadataIndex(fqn, c.offsets, j)] = info
    write_metadata(bad, md)
    # What makes this dangerous: torch reads it without complaint, leaving the missing experts
    # at whatever the destination held.
    name, lost = next((f, c) for f, c in gone.items() if f.startswith(f"layers.{LAYER}."))
    t = md.state_dict_metadata[name]
    sd = {name: torch.full(tuple(t.size), 7.0, dtype=t.properties.dtype)}
    dcp.load(sd, checkpoint_id=bad, no_dist=True)
    for c in lost:
        part = sd[name][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))]
        assert (part == 7.0).all(), "dcp.load filled experts no chunk holds"
    return sum(len(c) for c in gone.values())


def make_halved(good, bad):
    """Layer LAYER's expert tensors as a save of rank 0's local experts as if they were all: the
    global shape `[E/2, ...]`, rank 0's chunks only (they tile it; the router still routes to E)."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    link_copy(good, bad)
    md = read_metadata(bad)
    for fqn, chunks in expert_chunks(md).items():
        if f"layers.{LAYER}." not in fqn:
            continue
        tmd = md.state_dict_metadata[fqn]
        tmd.size = torch.Size([tmd.size[0] // 2, *tmd.size[1:]])
        keep = [(c, info) for _, c, info in chunks if c.offsets[0] < tmd.size[0]]
        for i, c, _ in chunks:
            del md.storage_data[MetadataIndex(fqn, c.offsets, i)]
        tmd.chunks = [c for c, _ in keep]
        for j, (c, info) in enumerate(keep):
            md.storage_data[MetadataIndex(fqn, c.offsets, j)] = info
    write_metadata(bad, md)


def make_copied(good, bad):
    """Overwrites each routed-expert item of rank 1 with rank 0's at the same place within its
    experts (offsets with dim 0 shifted down by E/2), as torch.save bytes of the same length."""
    import io

    import torch

    link_copy(good, bad)
    for f in os.listdir(bad):
        if f.startswith("__1_"):
            os.unlink(os.path.join(bad, f))
            shutil.copyfile(os.path.join(good, f), os.path.join(bad, f))
    md = read_metadata(bad)
    copied = 0
    for fqn, chunks in expert_chunks(md).items():
        n = md.state_dict_metadata[fqn].size[0]
        by_place = {(tuple(c.offsets), tuple(c.sizes)): info for _, c, info in chunks}
        for _, c, info in chunks:
            if not info.relative_path.startswith("__1_"):
                continue
            src_offsets = (c.offsets[0] - n // 2, *c.offsets[1:])
            src = by_place[(src_offsets, tuple(c.sizes))]
            assert src.relative_path.startswith("__0_"), (fqn, c, src)
            with open(os.path.join(bad, src.relative_path), "rb") as f:
                f.seek(src.offset)
                tensor = torch.load(io.BytesIO(f.read(src.length)), weights_only=True)
            buf = io.BytesIO()
            torch.save(tensor.clone(), buf)
            data = buf.getvalue()
            assert len(data) == info.length, (fqn, len(data), info.length)
            with open(os.path.join(bad, info.relative_path), "r+b") as f:
                f.seek(info.offset)
                f.write(data)
            copied += 1
    return copied


def make(d, flavor):
    module, config, ranks, extra = FLAVORS[flavor]
    os.makedirs(d, exist_ok=True)
    tt_ckpt_trainer.write_assets(d)
    run = os.path.join(d, "run")
    tt_ckpt_trainer.run_trainer(
        d, run,
        ["--training.steps", "1", "--checkpoint.interval", "1",
         "--parallelism.expert_parallel_degree", "2",
         "--parallelism.spmd_backend", "partial_dtensor", "--training.disable_cuda_graphs"]
        + extra,
        module=module, config=config, nproc=ranks, rank_fn=rank_main,
    )
    step = os.path.join(run, "checkpoint", "step-1")
    if not os.path.exists(os.path.join(step, ".metadata")):
        sys.exit(f"torchtitan's Trainer wrote no {step}/.metadata")
    good = os.path.join(d, "good")
    shutil.move(step, good)
    shutil.rmtree(run)
    md = read_metadata(good)
    chunks = expert_chunks(md)
    files = sorted({info.relative_path for cs in chunks.values() for _, _, info in cs})
    assert any(f.startswith("__1_") for f in files), f"rank 1 wrote no experts: {files}"
    experts = {md.state_dict_metadata[f].size[0] for f in chunks}
    assert len(experts) == 1, experts
    dropped = make_missing(good, os.path.join(d, "missing"))
    make_halved(good, os.path.join(d, "halved"))
    copied = make_copied(good, os.path.join(d, "copied"))
    model = sorted(f for f in chunks if not f.startswith("optimizer"))
    json.dump({"experts": experts.pop(), "layer": LAYER, "expert_tensors": model},
              open(os.path.join(d, "info.json"), "w"))
    print(f"ok {flavor}: {len(chunks)} expert tensors in {files}; missing: {dropped} chunks "
          f"dropped; copied: {copied} items overwritten")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "rank":
        rank_main(sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
