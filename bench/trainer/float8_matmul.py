"""float8 matmul speed against bf16 and fp32 in the libtorch titan-train links (.venv's torch).

  float8_matmul.py [--reps N] [--shapes M,K,N ...] [--device cpu|cuda]

For each shape (default: the debug model's w1 at batch 8 x seq 256, and an 8B-sized one) prints
the median time and GFLOP/s of:
  fp32 mm, bf16 mm,
  float8 torch._scaled_mm on operands already in float8 (tensorwise e4m3 x e4m3, bf16 out),
  float8 as a linear pays for it: amax + scale + cast of both operands, then _scaled_mm,
  float8 emulated: the same casts, then an fp32 mm of the dequantised operands (torchao's
  emulate=True, titan's float8.emulate),
and each one's speed relative to fp32 mm (the kernels run round-robin, medians of REPS rounds). The casts read bf16 operands, as float8 linears do under
bf16 mixed precision. Prints one Markdown table.
"""

import argparse
import statistics
import time

import torch

E4 = torch.float8_e4m3fn
E4_MAX = torch.finfo(E4).max


def cast(t):
    amax = t.abs().max().to(torch.float64).clamp(min=1e-12)
    scale = (E4_MAX / amax).to(torch.float32)
    return (t.float() * scale).clamp(-E4_MAX, E4_MAX).to(E4), scale


def timed(fns, reps, device):
    """Median seconds of each of `fns`, run round-robin (one call of each per round), so that a
    shared machine's load falls on all of them alike."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = [[] for _ in fns]
    for r in range(reps + 1):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            sync()
            if r > 0:  # the first round warms up
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--shapes", nargs="*", default=["2048,256,768", "2048,4096,4096"])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, median of {a.reps}")
    print()
    print("| M,K,N | kernel | ms | GFLOP/s | vs fp32 mm |")
    print("|---|---|---|---|---|")
    for spec in a.shapes:
        m, k, n = (int(v) for v in spec.split(","))
        torch.manual_seed(0)
        x = torch.randn(m, k, device=a.device)
        w = torch.randn(n, k, device=a.device) * 0.02
        xb, wb = x.bfloat16(), w.bfloat16()
        qx, sx = cast(x)
        qw, sw = cast(w)
        qwt = qw.t()
        one = torch.ones((), device=a.device)

        def scaled_only():
            return torch._scaled_mm(qx, qwt, scale_a=one / sx, scale_b=one / sw, out_dtype=torch.bfloat16)

        def scaled_linear():
            a_, s_a = cast(xb)
            b_, s_b = cast(wb)
            return torch._scaled_mm(a_, b_.t(), scale_a=s_a.reciprocal(), scale_b=s_b.reciprocal(),
                                    out_dtype=torch.bfloat16)

        def emulated_linear():
            a_, s_a = cast(xb)
            b_, s_b = cast(wb)
            return torch.mm(a_.float() / s_a, (b_.float() / s_b).t()).bfloat16()

        flop = 2 * m * k * n
        rows = [
            ("fp32 mm", lambda: torch.mm(x, w.t())),
            ("bf16 mm", lambda: torch.mm(xb, wb.t())),
            ("float8 _scaled_mm (operands already float8)", scaled_only),
            ("float8 linear: casts + _scaled_mm", scaled_linear),
            ("float8 linear, emulated: casts + fp32 mm", emulated_linear),
        ]
        medians = timed([fn for _, fn in rows], a.reps, a.device)
        for (name, _), t in zip(rows, medians):
            print(f"| {spec} | {name} | {t * 1e3:.2f} | {flop / t / 1e9:.1f} | {medians[0] / t:.2f}x |")


if __name__ == "__main__":
    main()
