"""torchtitan 0.3.0's generate_gantt_trace on a structured_logs/ folder (the benchmark's
baseline for `titan-obs summary` on the same files).

  tt_gantt.py LOG_DIR OUT.json
"""

import sys

from torchtitan.observability.structured_logger.gantt_generator import generate_gantt_trace

trace = generate_gantt_trace(sys.argv[1], sys.argv[2])
print(f"{len(trace['traceEvents'])} events")
