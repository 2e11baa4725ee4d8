"""Writes a DeepSeek-V3-shaped FP8 block-quantized HF checkpoint of about --gb gigabytes, laid out as
the DeepSeek-V3/R1 release is: the 671B model's shapes (dim 7168, MLA with q-LoRA 1536 and
kv-LoRA 512, 128 heads, dense FFN 18432 in the first layer, MoE layers of 2048-wide experts with a
shared expert, router and e_score_correction_bias), float8_e4m3fn projections with fp32
`_scale_inv` scales per 128x128 block, everything else bf16, shards of about 4.3 GB with an index
and the release's quantization_config in config.json. Only the layer and expert counts are cut
down to reach the size.

Tensors are streamed straight into each shard (header first), so memory stays one tensor; the
float8 bytes come from a few seeded random blocks (finite codes only): content does not change
what the converter does per byte.

usage: fp8_gen.py OUT [--gb 10]
"""

import argparse
import json
import math
import os
import struct

import numpy as np

DIM, Q_LORA, KV_LORA, HEADS, NOPE, ROPE, V = 7168, 1536, 512, 128, 128, 64, 128
DENSE, MOE, VOCAB, BLOCK = 18432, 2048, 129280, 128
SHARD_BYTES = 4_300_000_000


def layer_tensors(layer, experts, dense):
    """(name, dtype, shape) of one decoder layer, float8 weights followed by their scales."""
    p = f"model.layers.{layer}."
    out = [(p + "input_layernorm.weight", "BF16", [DIM]),
           (p + "post_attention_layernorm.weight", "BF16", [DIM]),
           (p + "self_attn.q_a_layernorm.weight", "BF16", [Q_LORA]),
           (p + "self_attn.kv_a_layernorm.weight", "BF16", [KV_LORA])]
    fp8 = [(p + "self_attn.q_a_proj.weight", [Q_LORA, DIM]),
           (p + "self_attn.q_b_proj.weight", [HEADS * (NOPE + ROPE), Q_LORA]),
           (p + "self_attn.kv_a_proj_with_mqa.weight", [KV_LORA + ROPE, DIM]),
           (p + "self_attn.kv_b_proj.weight", [HEADS * (NOPE + V), KV_LORA]),
           (p + "self_attn.o_proj.weight", [DIM, HEADS * V])]
    if dense:
        fp8 += [(p + f"mlp.{w}.weight", s) for w, s in
                [("gate_proj", [DENSE, DIM]), ("up_proj", [DENSE, DIM]), ("down_proj", [DIM, DENSE])]]
    else:
        out += [(p + "mlp.gate.weight", "BF16", [experts, DIM]),
                (p + "mlp.gate.e_score_correction_bias", "F32", [experts])]
        for e in ["shared_experts"] + [f"experts.{i}" for i in range(experts)]:
            fp8 += [(p + f"mlp.{e}.{w}.weight", s) for w, s in
                    [("gate_proj", [MOE, DIM]), ("up_proj", [MOE, DIM]), ("down_proj", [DIM, MOE])]]
    for name, shape in fp8:
        out.append((name, "F8_E4M3", shape))
        out.append((name + "_scale_inv", "F32", [math.ceil(shape[0] / BLOCK),
                                                  math.ceil(shape[1] / BLOCK)]))
    return out


SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def nbytes(t):
    return math.prod(t[2]) * SIZE[t[1]]


def plan(gb):
    """The tensors: embedding, head, norm, one dense layer, then MoE layers of up to 256 experts
    until about `gb` GB."""
    ts = [("model.embed_tokens.weight", "BF16", [VOCAB, DIM]), ("lm_head.weight", "BF16", [VOCAB, DIM]),
          ("model.norm.weight", "BF16", [DIM])]
    ts += layer_tensors(0, 0, dense=True)
    target, layer = gb * 1e9, 1
    per_expert = 3 * MOE * DIM
    while sum(map(nbytes, ts)) < target:
        left = target - sum(map(nbytes, ts))
        experts = max(8, min(256, int(left / per_expert)))
        ts += layer_tensors(layer, experts, dense=False)
        layer += 1
    return ts, layer


def write(out, ts, n_layers):
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(7)
    # Finite e4m3fn codes only (0x7f/0xff are NaN): 0x00-0x7e with a random sign.
    pool = [(rng.integers(0, 0x7F, 64 << 20, dtype=np.uint8) | (rng.integers(0, 2, 64 << 20, dtype=np.uint8) << 7))
            for _ in range(3)]
    shards, cur, size = [], [], 0
    for t in ts:
        if cur and size + nbytes(t) > SHARD_BYTES and not t[0].endswith("_scale_inv"):
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += nbytes(t)
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in shard:
            n = math.prod(shape) * SIZE[dtype]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
            pos += n
            weight_map[name] = fname
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        with open(os.path.join(out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h)
            for k, (name, dtype, shape) in enumerate(shard):
                n = math.prod(shape)
                if dtype == "F8_E4M3":
                    src = pool[k % 3]
                    for s in range(0, n, len(src)):
                        f.write(src[: min(len(src), n - s)].tobytes())
                elif dtype == "F32":
                    # Scales of ~1e-4 (weights of ~0.05 over 448), biases small.
                    f.write((rng.random(n, dtype=np.float32) * 1e-4 + 1e-5).tobytes())
                else:
                    f.write((rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)
                            .view(np.uint32).__rshift__(16).astype(np.uint16).tobytes())
        print(f"wrote {fname}: {len(shard)} tensors", flush=True)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": DIM, "num_hidden_layers": n_layers, "q_lora_rank": Q_LORA,
        "kv_lora_rank": KV_LORA, "num_attention_heads": HEADS, "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE, "v_head_dim": V, "intermediate_size": DENSE,
        "moe_intermediate_size": MOE, "first_k_dense_replace": 1, "vocab_size": VOCAB,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]},
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gb", type=float, default=10.0)
    a = ap.parse_args()
    ts, n_layers = plan(a.gb)
    total = sum(map(nbytes, ts))
    print(f"{len(ts)} tensors, {n_layers} layers, {total / 1e9:.2f} GB", flush=True)
    write(a.out, ts, n_layers)


if __name__ == "__main__":
    main()
