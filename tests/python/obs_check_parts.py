"""Checks titan-obs part files with pyarrow against obs/SCHEMA.md and the values the
recording child of tests/tests/obs_recording.rs produced.

usage: obs_check_parts.py RUN FORWARD_MS BACKWARD_MS STEPS
"""
import glob
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

run, forward_ms, backward_ms, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

DICT = pa.dictionary(pa.int32(), pa.string())
EXPECTED = [
    ("run_id", DICT, False),
    ("source", DICT, False),
    ("host", DICT, False),
    ("rank", pa.uint32(), False),
    ("local_rank", pa.uint32(), False),
    ("pid", pa.uint32(), False),
    ("thread", pa.uint32(), False),
    ("thread_name", DICT, False),
    ("seq", pa.uint64(), False),
    ("kind", DICT, False),
    ("name", DICT, False),
    ("step", pa.uint64(), True),
    ("start_ns", pa.int64(), False),
    ("dur_ns", pa.int64(), True),
    ("value", pa.float64(), True),
    ("reduce", DICT, True),
    ("depth", pa.uint16(), False),
    ("parent", pa.uint64(), True),
    ("tags", pa.list_(pa.field("item", pa.string(), nullable=False)), False),
    ("message", pa.string(), True),
    ("microbatch", pa.uint16(), True),
    ("stage", pa.uint16(), True),
]


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


parts = sorted(glob.glob(os.path.join(run, "obs", "rank-*", "part-*.parquet")))
if not parts:
    fail(f"no parts under {run}/obs")
if glob.glob(os.path.join(run, "obs", "rank-*", "*.tmp")):
    fail("temporary files left behind")

tables = []
for path in parts:
    f = pq.ParquetFile(path)
    schema = f.schema_arrow
    got = [(fld.name, fld.type, fld.nullable) for fld in schema]
    if got != EXPECTED:
        fail(f"{path}: schema\n{got}\n!=\n{EXPECTED}")
    if f.metadata.row_group(0).column(0).compression != "ZSTD":
        fail(f"{path}: not zstd: {f.metadata.row_group(0).column(0).compression}")
    meta = {k.decode(): v.decode() for k, v in f.metadata.metadata.items()}
    rank = int(os.path.basename(os.path.dirname(path)).split("-")[1])
    for key, want in [
        ("titan.schema_version", "2"),
        ("titan.rank", str(rank)),
        ("titan.world_size", "2"),
        ("titan.source", "trainer"),
        ("titan.clock_offset_ns", "1234"),
        ("titan.run_id", "run"),
    ]:
        if meta.get(key) != want:
            fail(f"{path}: footer {key} = {meta.get(key)!r}, want {want!r}")
    threads = json.loads(meta["titan.threads"])
    if not any(n == "dataloader" for n in threads.values()):
        pass  # the loader thread may have recorded into a different part
    t = f.read()
    tables.append(t)

table = pa.concat_tables(tables)
rows = table.to_pylist()
by_rank = {}
for r in rows:
    by_rank.setdefault(r["rank"], []).append(r)
if sorted(by_rank) != [0, 1]:
    fail(f"ranks {sorted(by_rank)}")

for rank, recs in by_rank.items():
    for r in recs:
        if r["kind"] not in ("span", "instant", "scalar", "error"):
            fail(f"kind {r['kind']}")
        if r["run_id"] != "run" or r["source"] != "trainer" or r["local_rank"] != rank:
            fail(f"constant columns wrong: {r}")
        if (r["dur_ns"] is None) != (r["kind"] != "span"):
            fail(f"dur_ns null-ness wrong: {r}")
        if (r["value"] is None) != (r["kind"] != "scalar"):
            fail(f"value null-ness wrong: {r}")
        if (r["reduce"] is None) != (r["kind"] != "scalar"):
            fail(f"reduce null-ness wrong: {r}")
        if (r["message"] is None) != (r["kind"] != "error"):
            fail(f"message null-ness wrong: {r}")
        # This recording runs no pipeline: no record has a pipeline slot.
        if r["microbatch"] is not None or r["stage"] is not None:
            fail(f"pipeline slot on a record outside a pipeline: {r}")
    spans = [r for r in recs if r["kind"] == "span"]
    by_key = {(r["thread"], r["seq"]): r for r in recs}
    if len(by_key) != len(recs):
        fail("(thread, seq) is not unique")
    names = [r["name"] for r in spans]
    for init in ["tokenizer", "dataloader", "model_build", "parallelism", "optimizer", "checkpoint"]:
        if not any(r["name"] == init and r["step"] is None and r["depth"] == 0 for r in spans):
            fail(f"rank {rank}: init phase {init} missing")
    if names.count("forward") != 2 * steps or names.count("step") != steps:
        fail(f"rank {rank}: counts {names.count('forward')} forward, {names.count('step')} step")
    for r in spans:
        if r["name"] == "forward" and r["dur_ns"] < forward_ms * 1_000_000:
            fail(f"forward shorter than {forward_ms} ms: {r['dur_ns']}")
        if r["name"] == "backward" and r["dur_ns"] < backward_ms * 1_000_000:
            fail(f"backward shorter than {backward_ms} ms: {r['dur_ns']}")
        if r["parent"] is not None:
            p = by_key[(r["thread"], r["parent"])]
            if p["kind"] != "span" or p["depth"] != r["depth"] - 1:
                fail(f"bad parent {p} of {r}")
            if not (p["start_ns"] <= r["start_ns"] and r["start_ns"] + r["dur_ns"] <= p["start_ns"] + p["dur_ns"]):
                fail(f"child outside parent: {r} in {p}")
            if r["name"] == "forward" and p["name"] != "microbatch":
                fail(f"forward's parent is {p['name']}")
        elif r["depth"] != 0:
            fail(f"top-level span with depth {r['depth']}")
    # The loader thread's spans are on their own thread with its name.
    pre = [r for r in spans if r["name"] == "prefetch"]
    if len(pre) != 3 or any(r["thread_name"] != "dataloader" for r in pre):
        fail(f"rank {rank}: prefetch spans {pre}")
    if len({r["thread"] for r in pre} | {r["thread"] for r in spans if r["name"] == "step"}) != 2:
        fail("loader and main thread share a thread id")
    # Step tags: every record of step 3 that was closed after the tag carries it; the step-3
    # checkpoint span certainly does, and an instant named after the tag exists.
    ck = [r for r in spans if r["name"] == "checkpoint" and r["step"] == 3]
    if len(ck) != 1 or ck[0]["tags"] != ["checkpoint"] or ck[0]["dur_ns"] < 20_000_000:
        fail(f"checkpoint span {ck}")
    step3 = [r for r in spans if r["name"] == "step" and r["step"] == 3][0]
    if step3["tags"] != ["checkpoint"]:
        fail(f"step 3 span tags {step3['tags']}")
    if [r["tags"] for r in spans if r["name"] == "step" and r["step"] == 2][0] != []:
        fail("step 2 has tags")
    if not any(r["kind"] == "instant" and r["name"] == "validation" and r["step"] == 4 for r in recs):
        fail("validation tag instant missing")
    # Scalars with reduce.
    sc = {(r["name"], r["step"]): r for r in recs if r["kind"] == "scalar"}
    for step in range(1, steps + 1):
        loss = sc[("training/loss", step)]
        if loss["value"] != 10.0 - step + rank or loss["reduce"] != "mean":
            fail(f"loss {loss}")
        if sc[("training/grad_norm", step)]["reduce"] != "max":
            fail("grad_norm reduce")
    if sc[("validation/loss", 4)]["value"] != 5.0 + rank:
        fail("validation loss")
    # The error inside the collectives span.
    errs = [r for r in recs if r["kind"] == "error"]
    if len(errs) != 1 or errs[0]["message"] != "all_reduce timed out on rank 1" or errs[0]["step"] != 5:
        fail(f"errors {errs}")
    parent = by_key[(errs[0]["thread"], errs[0]["parent"])]
    if parent["name"] != "collectives" or errs[0]["depth"] != parent["depth"] + 1:
        fail(f"error parent {parent}")
    # Times are epoch ns and ordered sensibly.
    starts = [r["start_ns"] for r in recs]
    if not (1_600_000_000_000_000_000 < min(starts) <= max(starts) < 4_000_000_000_000_000_000):
        fail("start_ns is not Unix epoch ns")

print(f"ok: {len(parts)} parts, {len(rows)} records")
