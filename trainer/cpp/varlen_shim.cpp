// Variable-length (document-causal) attention through FlashAttention's varlen kernel:
// at::_flash_attention_forward over packed tokens with cumulative document lengths, which tch
// does not bind. It is an autograd op (its backward is at::_flash_attention_backward), so the
// output back-propagates like any other tensor. CUDA with bf16/fp16 inputs only: the caller
// falls back to SDPA with the same mask elsewhere. Errors follow shim_error.h.
#include <ATen/Functions.h>

#include <cstdint>
#include <cstring>

#include "shim_error.h"

extern "C" {

// q (T, H, D), k and v (T, H_kv, D): the tokens of all documents packed; cu_seqlens (N + 1,)
// int32: where each document starts, then T. Causal within each document. `out` receives a new
// at::Tensor* (T, H, D). Returns 0, or 1 with `*err`.
int titan_varlen_attention(void* q, void* k, void* v, void* cu_seqlens, int64_t max_len,
                           double scale, void** out, char** err) {
  return titan_shim::guarded(err, [&] {
    const auto& cu = *reinterpret_cast<at::Tensor*>(cu_seqlens);
    auto result = at::_flash_attention_forward(
        *reinterpret_cast<at::Tensor*>(q), *reinterpret_cast<at::Tensor*>(k),
        *reinterpret_cast<at::Tensor*>(v), cu, cu, max_len, max_len,
        /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false, scale);
    *out = new at::Tensor(std::move(std::get<0>(result)));
  });
}

}  // extern "C"
