"""Loads a titan-train DCP checkpoint into torchtitan 0.3.0's own Llama-3 model, the way its
checkpointer does (`dcp.load` into the model's state dict, then `load_state_dict`), and checks
every weight bit for bit against the checkpoint's tensors read by plain torch DCP.

torchtitan 0.3.0's debugmodel trains a fused `qkv_linear.wqkv` parameter; its state dict hooks
split it into `qkv_linear.{wq,wk,wv}.weight` on save and merge on load, so the round trip through
the model also checks that titan's q/k/v rows are laid out as torchtitan expects.

Run with torch 2.15 + torchtitan 0.3.0 (TITAN_TT_PYTHON).
With HF_DIR (titan-train's HF export of the same weights), torchtitan's own
`Llama3StateDictAdapter.to_hf` of the loaded model must equal that export bit for bit: the q/k
rows titan wrote are where torchtitan's RoPE expects them, not only under the right names.

FLAVOR is llama3's (`debugmodel`), or MODULE:FLAVOR for another family (`qwen3:debugmodel`,
`qwen3:debugmodel_moe`, `deepseek_v3:debugmodel`): its own model and state-dict adapter.

usage: tt_train_load.py CHECKPOINT_DIR [MODULE:]FLAVOR [HF_DIR]
"""

import json
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torchtitan
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from safetensors.torch import load_file

warnings.filterwarnings("ignore")
ckpt_dir, flavor = sys.argv[1], sys.argv[2]
hf_dir = sys.argv[3] if len(sys.argv) > 3 else None
module, _, flavor = flavor.rpartition(":")
if module in ("", "llama3"):
    from torchtitan.models.llama3 import Llama3StateDictAdapter as Adapter, llama3_configs as configs
elif module == "qwen3":
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter as Adapter, qwen3_configs as configs
elif module == "deepseek_v3":
    from torchtitan.models.deepseek_v3 import (DeepSeekV3StateDictAdapter as Adapter,
                                               deepseekv3_configs as configs)
else:
    sys.exit(f"tt_train_load.py: no module {module}")

# deepseek_v3's flavors also take the MoE token dispatch backend.
kwargs = {"attn_backend": "flex"}
if module == "deepseek_v3":
    kwargs["moe_comm_backend"] = "standard"

torch.manual_seed(0)
model = configs[flavor](**kwargs).build()
want_keys = set(model.state_dict().keys())

md = dcp.FileSystemReader(ckpt_dir).read_metadata()
stored = {
    k: torch.empty(v.size, dtype=v.properties.dtype)
    for k, v in md.state_dict_metadata.items()
    if isinstance(v, TensorStorageMetadata)
}
missing = want_keys - stored.keys()
assert not missing, f"torchtitan {torchtitan.__version__} needs keys the checkpoint lacks: {sorted(missing)[:5]}"
raw = {k: stored[k] for k in want_keys}
dcp.load(raw, checkpoint_id=ckpt_dir)

# What torchtitan's CheckpointManager does for the model part.
sd = model.state_dict()
dcp.load(sd, checkpoint_id=ckpt_dir)
model.load_state_dict(sd, strict=True)

differs = [
    k for k, v in model.state_dict().items()
    if v.dtype != raw[k].dtype or v.shape != raw[k].shape or not torch.equal(v, raw[k])
]
assert not differs, f"weights differ after loading into torchtitan's model: {differs[:5]}"

hf_checked = 0
if hf_dir is not None:
    config = configs[flavor](**kwargs)
    hf = Adapter(config, None).to_hf(dict(model.state_dict()))
    exported = {}
    for f in sorted(__import__("glob").glob(f"{hf_dir}/*.safetensors")):
        exported.update(load_file(f))
    assert exported.keys() == hf.keys(), sorted(exported.keys() ^ hf.keys())[:5]
    bad = [k for k, v in hf.items() if not torch.equal(v.contiguous(), exported[k])]
    assert not bad, f"torchtitan's to_hf differs from titan's HF export: {bad[:5]}"
    hf_checked = len(hf)

print(json.dumps({
    "torchtitan": torchtitan.__version__,
    "torch": torch.__version__,
    "weights": len(want_keys),
    "hf_checked": hf_checked,
}))
