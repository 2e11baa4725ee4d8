"""Reference logits from transformers' LlamaForCausalLM for titan-train's numerics test.

Builds a small Llama-3 (GQA, rope_type "llama3" with factor 8, fp32) with random weights, saves
them under HF names as `model.safetensors`, the model shape as `args.json` (titan's ModelArgs
fields) and fixed tokens with their logits as `expected.safetensors`, all into OUT_DIR.

Also `train_step.safetensors`: the mean next-token cross entropy of those tokens and every
parameter's gradient (HF names), once in fp32 (`fp32.*`) and once with forward and loss under
`torch.autocast("cpu", dtype=torch.bfloat16)` and backward outside it, as torchtitan 0.3.0 trains
without FSDP (`bf16.*`).

Usage: trainer_hf_logits.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(1234)

dim, layers, heads, kv_heads, vocab, hidden, seq = 128, 2, 8, 2, 512, 384, 48
rope = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
cfg = LlamaConfig(
    vocab_size=vocab,
    hidden_size=dim,
    intermediate_size=hidden,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv_heads,
    max_position_embeddings=16384,
    rms_norm_eps=1e-5,
    rope_parameters=rope,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    torch_dtype="float32",
)
cfg._attn_implementation = "eager"
model = LlamaForCausalLM(cfg).eval()
# Check the config really carries llama3 scaling (keyword spellings differ across versions).
rp = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None)
assert rp and rp.get("rope_type") == "llama3" and rp.get("factor") == 8.0, rp

# Weights on the scale of a trained model so every path matters in the logits.
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.ndim == 1:  # norms: around 1, not exactly 1, so a swapped norm shows
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0)
        else:
            p.normal_(0.0, p.shape[1] ** -0.5)

tokens = torch.randint(0, vocab, (2, seq), dtype=torch.int64)
with torch.no_grad():
    logits = model(input_ids=tokens).logits.float()

def train_step(autocast: bool) -> dict:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        step_logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            step_logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1)
        )
    loss.backward()
    tag = "bf16" if autocast else "fp32"
    out = {f"{tag}.loss": loss.detach().reshape(1)}
    out.update({f"{tag}.grad.{n}": p.grad.contiguous() for n, p in model.named_parameters()})
    return out


step = {**train_step(False), **train_step(True)}
save_file(step, str(out / "train_step.safetensors"))

state = {k: v.contiguous() for k, v in model.state_dict().items()}
save_file(state, str(out / "model.safetensors"))
save_file({"tokens": tokens, "logits": logits.contiguous()}, str(out / "expected.safetensors"))
args = {
    "dim": dim,
    "n_layers": layers,
    "n_heads": heads,
    "n_kv_heads": kv_heads,
    "vocab_size": vocab,
    "multiple_of": 128,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "rope_theta": rope["rope_theta"],
    "rope_scaling": {
        "factor": rope["factor"],
        "low_freq_factor": rope["low_freq_factor"],
        "high_freq_factor": rope["high_freq_factor"],
        "original_max_position_embeddings": float(rope["original_max_position_embeddings"]),
    },
    "max_seq_len": seq,
}
(out / "args.json").write_text(json.dumps(args))
print(json.dumps({"logits_abs_max": logits.abs().max().item(), "tensors": len(state)}))
