"""Prints {tensor key: dtype} of a DCP checkpoint as torch reads its metadata (one JSON line).

Usage: trainer_dcp_dtypes.py CHECKPOINT_DIR
"""

import json
import sys

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

meta = dcp.FileSystemReader(sys.argv[1]).read_metadata()
print(json.dumps({
    key: str(m.properties.dtype).removeprefix("torch.")
    for key, m in meta.state_dict_metadata.items()
    if isinstance(m, TensorStorageMetadata)
}))
