"""torchao 0.18's Float8Linear on fixed inputs, for titan-train's float8 layer test
(trainer/tests/float8_torchao.rs).

  float8_torchao.py OUT_DIR

For each recipe (tensorwise, rowwise, rowwise_with_gw_hp), each matmul path (`emulate`: fp32 mm
of the dequantised operands; `scaled`: torch._scaled_mm, which has a CPU kernel) and each input
dtype (float32, bfloat16), writes OUT_DIR/<recipe>-<path>-<dtype>.safetensors with:

  x (B, S, K), w (N, K), grad_out (B, S, N)      the inputs (the same values in every file)
  y, grad_x, grad_w                               torchao's output and gradients
  scale_x, scale_w, scale_go                      torchao's scales for the forward matmul's
                                                  operands and the grad_input matmul's grad_out
                                                  (torchao.float8.float8_utils.tensor_to_scale)

Run with torch 2.15 + torchao 0.18 (TITAN_TT_PYTHON).
"""

import dataclasses
import os
import sys

import torch
from safetensors.torch import save_file
from torchao.float8.config import Float8LinearConfig, ScalingGranularity
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_utils import tensor_to_scale

B, S, K, N = 2, 24, 64, 48


def inputs():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(B, S, K, generator=g)
    # One large entry per tensor, so tensorwise and rowwise scales differ visibly and the
    # power-of-two rounding matters.
    x[0, 3, 5] = 37.0
    w = torch.randn(N, K, generator=g) * 0.05
    w[7, 11] = -0.9
    go = torch.randn(B, S, N, generator=g) * 1e-3
    go[1, 0, 2] = 0.2
    return x, w, go


def scales(config, x, w, go):
    """torchao's own scale for each operand as the layer's forward and grad_input matmuls cast it
    (which axis the rows are: see Float8Linear's matmul_with_hp_or_float8_args)."""

    def one(t, cast, axis):
        axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        return tensor_to_scale(
            t, cast.target_dtype,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=axis if axiswise else None,
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )

    x2 = x.reshape(-1, K)
    go2 = go.reshape(-1, N)
    return {
        "scale_x": one(x2, config.cast_config_input, -1),
        # the layer casts weight.t() (K, N) along dim 0 for the output
        "scale_w": one(w.t(), config.cast_config_weight, 0),
        "scale_go": one(go2, config.cast_config_grad_output, -1),
    }


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    x0, w0, go0 = inputs()
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        for path in ("emulate", "scaled"):
            config = dataclasses.replace(
                Float8LinearConfig.from_recipe_name(recipe), emulate=(path == "emulate"))
            for dtype in (torch.float32, torch.bfloat16):
                lin = torch.nn.Linear(K, N, bias=False)
                with torch.no_grad():
                    lin.weight.copy_(w0.to(dtype))
                lin = lin.to(dtype)
                f8 = Float8Linear.from_float(lin, config=config)
                x = x0.to(dtype).clone().requires_grad_(True)
                y = f8(x)
                y.backward(go0.to(dtype))
                tensors = {
                    "x": x0.to(dtype), "w": w0.to(dtype), "grad_out": go0.to(dtype),
                    "y": y.detach(), "grad_x": x.grad, "grad_w": f8.weight.grad,
                }
                tensors.update(scales(config, x0.to(dtype), w0.to(dtype), go0.to(dtype)))
                name = f"{recipe}-{path}-{str(dtype).removeprefix('torch.')}"
                save_file({k: v.contiguous() for k, v in tensors.items()},
                          os.path.join(out, name + ".safetensors"))
                print(name, tuple(y.shape), y.dtype)


if __name__ == "__main__":
    main()
