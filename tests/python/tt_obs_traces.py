"""Chrome trace-event files from torchtitan 0.3.0 and torch, for titan-obs to open.

  tt_obs_traces.py gantt LOG_DIR OUT.json   torchtitan's generate_gantt_trace on a
                                            structured_logs/ folder
  tt_obs_traces.py profile OUT.json         a CPU torch.profiler trace of a few steps of a
                                            small MLP (ProfilerStep#N spans, nested aten ops)
"""

import sys


def gantt(log_dir, out):
    from torchtitan.observability.structured_logger.gantt_generator import (
        generate_gantt_trace,
    )

    generate_gantt_trace(log_dir, out)


def profile(out):
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
    ) as prof:
        for _ in range(4):
            with record_function("fwd_bwd"):
                loss = model(x).square().mean()
                loss.backward()
            with record_function("optim"):
                opt.step()
                opt.zero_grad()
            prof.step()
    prof.export_chrome_trace(out)


if __name__ == "__main__":
    if sys.argv[1] == "gantt":
        gantt(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "profile":
        profile(sys.argv[2])
    else:
        sys.exit(f"unknown command {sys.argv[1]!r}")
