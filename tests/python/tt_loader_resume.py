"""torchtitan 0.3.0's own dataloader resumes from the loader state titan-train writes.

Run with torch 2.15 + torchtitan 0.3.0 (TITAN_TT_PYTHON):

  tt_loader_resume.py assets DIR
      writes DIR/tokenizer and DIR/c4_test (as tt_ckpt_trainer.py does)
  tt_loader_resume.py check DIR STEP_DIR SEQ_LEN BATCH STEPS
      loads `dataloader.dp_rank_0` from titan-train's checkpoint STEP_DIR (saved after STEPS steps
      of BATCH x SEQ_LEN, one process) into torchtitan's HuggingFaceTextDataLoader and checks that
      its next 3 batches (inputs, positions, labels) equal those of an unbroken torchtitan loader
      after STEPS batches.
"""

import io
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def loader(d, seq_len, batch):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    cfg = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=os.path.join(d, "c4_test"))
    tok = HuggingFaceTokenizer(tokenizer_path=os.path.join(d, "tokenizer"))
    return HuggingFaceTextDataLoader(
        cfg, dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=seq_len, local_batch_size=batch
    )


def check(d, step_dir, seq_len, batch, steps):
    import torch
    import torch.distributed.checkpoint as dcp

    sd = {"dataloader.dp_rank_0": io.BytesIO(), "dataloader.world_size": 0}
    dcp.load(sd, checkpoint_id=step_dir)
    raw = sd["dataloader.dp_rank_0"]
    raw = raw.getvalue() if isinstance(raw, io.BytesIO) else raw
    resumed = loader(d, seq_len, batch)
    resumed.load_state_dict({"dp_rank_0": raw, "world_size": sd["dataloader.world_size"]})
    unbroken = loader(d, seq_len, batch)
    it = iter(unbroken)
    for _ in range(steps):
        next(it)
    got_it = iter(resumed)
    for i in range(3):
        (want_in, want_lab), (got_in, got_lab) = next(it), next(got_it)
        for key in ("input", "positions"):
            assert torch.equal(want_in[key], got_in[key]), f"batch {i}: {key} differs"
        assert torch.equal(want_lab, got_lab), f"batch {i}: labels differ"
    print(f"ok torchtitan's dataloader resumed titan-train's state at step {steps}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "assets":
        from tt_ckpt_trainer import write_assets

        write_assets(sys.argv[2])
    elif len(sys.argv) == 7 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        sys.exit(__doc__)
