"""Loads titan-train's HF export with transformers' LlamaForCausalLM and prints the mean
next-token cross entropy on a fixed batch.

usage: trainckpt_hf_loss.py HF_DIR BATCH.json   (BATCH: {"tokens": [...], "shape": [B, S+1]})
"""

import json
import sys
import warnings

import torch
import transformers
from transformers import LlamaForCausalLM

warnings.filterwarnings("ignore")
hf_dir, batch_path = sys.argv[1], sys.argv[2]
batch = json.load(open(batch_path))
tokens = torch.tensor(batch["tokens"], dtype=torch.long).view(*batch["shape"])
model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
# Each major version reads RoPE from its own keys (and keeps the other's as an unused attribute):
# check the one this version builds the model from.
if int(transformers.__version__.split(".")[0]) >= 5:
    rp = model.config.rope_parameters
else:
    rp = dict(model.config.rope_scaling or {}, rope_theta=model.config.rope_theta)
assert rp and rp.get("rope_type") == "llama3" and rp.get("rope_theta") != 10000.0, (transformers.__version__, rp)
with torch.no_grad():
    logits = model(tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
print(f"loss {loss.item():.10f}")
