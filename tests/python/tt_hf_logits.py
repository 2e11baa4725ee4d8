"""transformers runs titan-train's HF export as torchtitan 0.3.0 runs the same weights.

usage: tt_hf_logits.py DCP_DIR MODULE:FLAVOR HF_DIR

DCP_DIR is a titan-train DCP checkpoint (model weights and buffers), HF_DIR titan-train's HF
export of the same weights (`checkpoint.last_save_in_hf`, with its config.json). torchtitan's own
model for MODULE:FLAVOR loads DCP_DIR with `dcp.load` and computes logits on a fixed token row;
transformers 5 loads HF_DIR with `AutoModelForCausalLM` (its config.json alone says what model
that is: RoPE and YaRN, routing, tied embeddings) and computes logits on the same row. Both in
fp32, torchtitan's routed experts too (its GroupedExperts casts them to bf16: the same math
without the casts is swapped in, as tests/python/ckpt_fp8.py does); they must agree within
LOGITS_RTOL of the largest logit. qwen3 MoE's routing bias is zeroed in torchtitan's model
(HF has none: the export leaves it out); a softmax-routed deepseek_v3 flavor gets a softmax
router in transformers (see there). Prints one JSON line.

Run with torch 2.15 + torchtitan 0.3.0 + transformers 5 (TITAN_TT_PYTHON).
"""

import json
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp

import ckpt_fp8

LOGITS_RTOL = 1e-4
TOKENS = torch.arange(3, 1900, 61).unsqueeze(0)

warnings.filterwarnings("ignore")
dcp_dir, spec, hf_dir = sys.argv[1], sys.argv[2], sys.argv[3]
module, _, flavor = spec.partition(":")
kwargs = {"attn_backend": "flex"}
if module == "qwen3":
    from torchtitan.models.qwen3 import qwen3_configs as configs
elif module == "deepseek_v3":
    from torchtitan.models.deepseek_v3 import deepseekv3_configs as configs
    kwargs["moe_comm_backend"] = "standard"
else:
    sys.exit(f"tt_hf_logits.py: no module {module}")

with torch.device("cpu"):
    model = configs[flavor](**kwargs).build()
sd = model.state_dict()
dcp.load(sd, checkpoint_id=dcp_dir)
# Qwen3MoeForCausalLM has no load-balancing bias (the export leaves `expert_bias_E` out, as
# torchtitan's to_hf does): torchtitan's routing without it is what the HF model computes.
if module == "qwen3":
    sd = {k: (v.zero_() if k.endswith("expert_bias_E") else v) for k, v in sd.items()}
model.load_state_dict(sd, strict=True)
model.eval()
tt = ckpt_fp8.tt_logits(model, experts_in_fp32=True, tokens=TOKENS)

from transformers import AutoModelForCausalLM  # noqa: E402

# transformers' DeepseekV3 router scores with a sigmoid (DeepSeek-V3's and torchtitan's 671B);
# torchtitan's other deepseek_v3 flavors score with a softmax, which no config.json can say:
# for those the router's score function is swapped (everything else comes from config.json).
score_funcs = {m.router.score_func for m in model.modules() if hasattr(m, "router")}
softmax_router = module == "deepseek_v3" and score_funcs == {"softmax"}
if softmax_router:
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as dsv3

    sigmoid_router = dsv3.DeepseekV3TopkRouter.forward

    def softmax_router_forward(self, hidden_states):
        sigmoid = torch.Tensor.sigmoid
        torch.Tensor.sigmoid = lambda t: t.softmax(dim=-1)
        try:
            return sigmoid_router(self, hidden_states)
        finally:
            torch.Tensor.sigmoid = sigmoid

    dsv3.DeepseekV3TopkRouter.forward = softmax_router_forward

hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
hf_model.eval()
with torch.no_grad():
    hf = hf_model(TOKENS).logits.float()
err = ((tt - hf).abs().max() / hf.abs().max()).item()
print(json.dumps({"model": spec, "architecture": type(hf_model).__name__, "logits_rel": err,
                  "softmax_router_swapped_in": softmax_router}))
if not err <= LOGITS_RTOL:
    sys.exit(f"{spec}: transformers' logits on titan's HF export differ from torchtitan's on its "
             f"DCP checkpoint by {err:.2e} of the largest logit (bound {LOGITS_RTOL:.0e})")
