"""The per-phase part of `titan-obs summary` done with pyarrow (the Python baseline):
count, total, mean, max and t-digest p50/p95 of span durations per name over all ranks' parts."""
import sys
import time

import pyarrow.compute as pc
import pyarrow.dataset as ds

run = sys.argv[1]
t = time.perf_counter()
d = ds.dataset(f"{run}/obs", format="parquet")
table = d.to_table(columns=["kind", "name", "rank", "step", "dur_ns"], filter=ds.field("kind") == "span")
table = table.set_column(table.schema.get_field_index("name"), "name", pc.cast(table["name"], "string"))
agg = table.group_by("name").aggregate(
    [
        ("dur_ns", "count"),
        ("dur_ns", "sum"),
        ("dur_ns", "mean"),
        ("dur_ns", "max"),
        ("dur_ns", "tdigest", pc.TDigestOptions(q=[0.5, 0.95])),
    ]
)
agg = agg.sort_by([("dur_ns_sum", "descending")])
print(f"{table.num_rows} spans, {agg.num_rows} phases in {time.perf_counter() - t:.2f} s")
for row in agg.to_pylist()[:10]:
    print(row)
