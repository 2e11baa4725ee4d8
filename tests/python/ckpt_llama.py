"""A tiny torchtitan-named Llama-3 checkpoint, and checks of its HF conversion.

usage:
  ckpt_llama.py make DIR        DIR/titan/model.safetensors (torchtitan names, f32) and
                                DIR/expected_hf.safetensors (HF names, q/k permuted per torchtitan's
                                convert_to_hf: w.view(H, D1/H/2, 2, D2).transpose(1, 2).reshape(D1, D2))
  ckpt_llama.py check HF DIR    transformers LlamaForCausalLM.from_pretrained(HF) loads with no
                                missing/unexpected keys, its weights equal expected_hf, and it runs
"""

import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from hf_load import load_llama_exactly  # noqa: E402

DIM, LAYERS, HEADS, KV_HEADS, VOCAB, FFN = 64, 2, 4, 2, 128, 192


def make(d):
    g = torch.Generator().manual_seed(7)
    hd = DIM // HEADS
    sd = {"tok_embeddings.weight": torch.randn(VOCAB, DIM, generator=g)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        sd[p + "attention.wq.weight"] = torch.randn(HEADS * hd, DIM, generator=g)
        sd[p + "attention.wk.weight"] = torch.randn(KV_HEADS * hd, DIM, generator=g)
        sd[p + "attention.wv.weight"] = torch.randn(KV_HEADS * hd, DIM, generator=g)
        sd[p + "attention.wo.weight"] = torch.randn(DIM, HEADS * hd, generator=g)
        sd[p + "feed_forward.w1.weight"] = torch.randn(FFN, DIM, generator=g)
        sd[p + "feed_forward.w2.weight"] = torch.randn(DIM, FFN, generator=g)
        sd[p + "feed_forward.w3.weight"] = torch.randn(FFN, DIM, generator=g)
        sd[p + "attention_norm.weight"] = torch.rand(DIM, generator=g)
        sd[p + "ffn_norm.weight"] = torch.rand(DIM, generator=g)
    sd["norm.weight"] = torch.rand(DIM, generator=g)
    sd["output.weight"] = torch.randn(VOCAB, DIM, generator=g)
    os.makedirs(os.path.join(d, "titan"), exist_ok=True)
    save_file(sd, os.path.join(d, "titan", "model.safetensors"))

    def permute(w, h):
        d1, d2 = w.shape
        return w.view(h, d1 // h // 2, 2, d2).transpose(1, 2).reshape(d1, d2)

    hf = {
        "model.embed_tokens.weight": sd["tok_embeddings.weight"],
        "model.norm.weight": sd["norm.weight"],
        "lm_head.weight": sd["output.weight"],
    }
    for i in range(LAYERS):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        hf[h + "self_attn.q_proj.weight"] = permute(sd[t + "attention.wq.weight"], HEADS)
        hf[h + "self_attn.k_proj.weight"] = permute(sd[t + "attention.wk.weight"], KV_HEADS)
        hf[h + "self_attn.v_proj.weight"] = sd[t + "attention.wv.weight"]
        hf[h + "self_attn.o_proj.weight"] = sd[t + "attention.wo.weight"]
        hf[h + "mlp.gate_proj.weight"] = sd[t + "feed_forward.w1.weight"]
        hf[h + "mlp.up_proj.weight"] = sd[t + "feed_forward.w3.weight"]
        hf[h + "mlp.down_proj.weight"] = sd[t + "feed_forward.w2.weight"]
        hf[h + "input_layernorm.weight"] = sd[t + "attention_norm.weight"]
        hf[h + "post_attention_layernorm.weight"] = sd[t + "ffn_norm.weight"]
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(d, "expected_hf.safetensors"))


def check(hf_dir, d):
    model = load_llama_exactly(hf_dir, os.path.join(d, "expected_hf.safetensors"))
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.intermediate_size) == (DIM, LAYERS, HEADS, KV_HEADS, VOCAB, FFN), cfg
    with torch.no_grad():
        out = model(torch.arange(8).unsqueeze(0)).logits
    assert out.shape == (1, 8, VOCAB) and torch.isfinite(out).all()
    print("ok")


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        check(sys.argv[2], sys.argv[3])
