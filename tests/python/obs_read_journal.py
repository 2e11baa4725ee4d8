"""Reads a titan-obs journal (Arrow IPC stream, zstd buffers) with pyarrow, the way a user's
script would: every complete batch, stopping at a torn tail. Prints JSON: rows, batches, the
footer's rank, kinds and whether the tail was torn.

usage: obs_read_journal.py JOURNAL
"""
import json
import sys

import pyarrow as pa

path = sys.argv[1]
rows = batches = 0
kinds = {}
torn = False
with open(path, "rb") as f:
    reader = pa.ipc.open_stream(f)
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    while True:
        try:
            b = reader.read_next_batch()
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError, EOFError):
            torn = True
            break
        batches += 1
        rows += b.num_rows
        for k in b.column("kind").to_pylist():
            kinds[k] = kinds.get(k, 0) + 1
print(json.dumps({"rows": rows, "batches": batches, "rank": int(meta["titan.rank"]),
                  "part": int(meta["titan.part"]), "kinds": kinds, "torn": torn}))
