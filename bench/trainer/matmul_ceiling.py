"""What bf16 can buy on this CPU: torch.mm GFLOP/s in float32 and bfloat16 at the debug model's
matmul shapes and at 2048^3, with the same thread count as the training runs.

Mixed precision can only speed training up as far as the bf16 kernels outrun the fp32 ones. On a
CPU with AMX (amx_bf16 in /proc/cpuinfo and granted by the kernel) oneDNN's bf16 matmul is several
times faster than fp32; with AVX512-BF16 alone (vdpbf16ps) it is at best even with fp32 FMA, and
the bf16 matmul pays for packing and conversions on top. Prints one JSON line.
"""

import argparse
import json
import time

import torch

# (m, k, n) of the debug model's matmuls at batch 8 x seq_len 256: attention projections,
# feed-forward up/down, output projection; and a large square one.
SHAPES = [(2048, 256, 256), (2048, 256, 768), (2048, 768, 256), (2048, 256, 2048), (2048, 2048, 2048)]


def gflops(m, k, n, dtype):
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    reps = max(3, int(4e10 / (2 * m * k * n)))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * m * k * n * reps / sorted(times)[2] / 1e9


def cpu_flags():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    flags = cpu_flags()
    rows = []
    for m, k, n in SHAPES:
        f32, bf16 = gflops(m, k, n, torch.float32), gflops(m, k, n, torch.bfloat16)
        rows.append({"mkn": [m, k, n], "fp32_gflops": round(f32, 1), "bf16_gflops": round(bf16, 1),
                     "bf16_over_fp32": round(bf16 / f32, 2)})
    print(json.dumps({
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "matmuls": rows,
    }))


if __name__ == "__main__":
    main()
