"""Sampling transforms shared by the draft and the target.

Speculative sampling is exact with respect to the *transformed* target distribution, so both
models must go through the same temperature → top-k → top-p pipeline (the order Hugging Face and
vLLM use). Temperature 0 means greedy: the distribution becomes one-hot at the argmax, which makes
every acceptance rule reduce to greedy matching without a special code path.

Tokens are drawn by inverse-CDF sampling from explicit uniforms instead of `torch.multinomial`, so
a caller can hand the same random draws to several methods (compare mode) and a round consumes a
fixed number of draws whatever the method does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class SamplingParams:
    """`temperature` 0 = greedy; `top_k` 0 = off; `top_p` 1.0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# The sampling every default-pair number is reported at (the draft issue's setting): the
# benchmark's default, the teacher data's, and the draft's held-out acceptance score.
REPORTED_SAMPLING = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)


def sparse_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The temperature → top-k → top-p distribution in its cheapest exact form.

    Returns (ids [..., w], probs [..., w]) when greedy or top-k bounds every row's support to w < V
    tokens (ids sorted by probability, largest first; top-p may zero some of them), else
    (None, probs [..., V]). Temperature is applied after the top-k selection, which it cannot
    change, so the common top-k case touches the whole vocabulary once. Greedy and small top-k
    run in one native pass per row where the kernels built (`native_support`), else in torch
    (`torch_sparse_probs`, the reference it follows).
    """
    support = native_support(logits, params)
    return support if support is not None else torch_sparse_probs(logits, params)


def torch_sparse_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`sparse_probs` in torch ops: the reference, and the path for large or no top-k."""
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.greedy:
        ids = logits.argmax(dim=-1, keepdim=True)
        return ids, torch.ones(ids.shape, device=ids.device)
    bounded = 0 < params.top_k < vocab
    if not bounded and params.top_p >= 1.0:
        return None, torch.softmax(logits / params.temperature, dim=-1)
    if bounded:
        values, ids = torch.topk(logits, params.top_k, dim=-1)  # sorted, largest first
    else:
        values, ids = torch.sort(logits, dim=-1, descending=True)
    kept = torch.softmax(values / params.temperature, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
        mass_before = torch.cumsum(kept, dim=-1) - kept
        kept = kept.masked_fill(mass_before >= params.top_p, 0.0)
        kept = kept / kept.sum(dim=-1, keepdim=True)
    return (ids, kept) if bounded else (None, torch.zeros_like(logits).scatter_(-1, ids, kept))


def native_support(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`sparse_probs` for greedy (w = 1) or top-k <= 64 on CPU logits, in one native
    pass per row (cpu_kernels.c `sample_support`: the same steps as `torch_sparse_probs`, equal to
    float32 rounding); None where that does not apply or the kernels did not build."""
    width = native_width(params, logits)
    if width is None:
        return None
    vocab = logits.shape[-1]
    rows = logits.detach().float().reshape(-1, vocab).contiguous()
    ids = torch.empty(*logits.shape[:-1], width, dtype=torch.long)
    probs = torch.empty(*logits.shape[:-1], width)
    temperature, top_p = native_temperature_top_p(params)
    _kernels().sample_support(rows.data_ptr(), rows.shape[0], vocab, width, temperature, top_p, ids.data_ptr(),
                              probs.data_ptr())
    return ids, probs


def native_width(params: SamplingParams, logits: torch.Tensor) -> int | None:
    """The support width the native kernels sample `logits` with under `params` (1 greedy, else
    top-k), or None where they do not apply (no or a large top-k, not CPU, no kernels built)."""
    return native_width_for(params, logits.shape[-1]) if logits.is_cpu else None


def native_width_for(params: SamplingParams, vocab: int) -> int | None:
    """`native_width` for CPU logits over `vocab` tokens."""
    if _kernels() is None:
        return None
    width = 1 if params.greedy else params.top_k
    return width if (params.greedy or 0 < width < vocab) and width <= _MAX_NATIVE_TOP_K else None


def native_temperature_top_p(params: SamplingParams) -> tuple[float, float]:
    """Temperature and top-p as the native kernels take them (greedy: their width-1 support at T = 1)."""
    return (1.0, 1.0) if params.greedy else (params.temperature, params.top_p)


@lru_cache(maxsize=64)
def native_draw_settings(params: SamplingParams, vocab: int) -> tuple[int, float, float] | None:
    """(support width, temperature, top-p) of a native draw over `vocab` logits at `params`, or None where
    the kernels do not apply: worked out once per settings, not every round (the checks cost 7-25 us with
    the caches cold after a forward)."""
    width = native_width_for(params, vocab)
    return None if width is None else (width, *native_temperature_top_p(params))


def draw_support(ids: torch.Tensor, probs: torch.Tensor, uniform: float) -> int:
    """`sample_from` on one sparse row (ids [w] in any order, probs [w]): the token the same uniform
    draws from the row's dense form, since the draw runs over the ids in vocabulary order."""
    lib = _kernels()
    if lib is None:
        order = ids.argsort()
        return int(ids[order][sample_from(probs[order], torch.tensor(uniform))])
    ids, probs = ids.contiguous(), probs.float().contiguous()
    return int(lib.draw_support(ids.data_ptr(), probs.data_ptr(), ids.numel(), uniform))


def sample_sparse(logits: torch.Tensor, params: SamplingParams, uniform: float,
                  id_map: torch.Tensor | None = None) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """Draw one token from one row of logits ([V'] or [1, V']) through a sparse support: (token, ids [1, w],
    probs [1, w]), ids mapped through `id_map` (a reduced head's token ids) when given. One native
    call where `native_width` applies (the same as `sparse_probs` then `draw_support`); None where
    the support is not small (no top-k), for the caller's dense path."""
    width = native_width(params, logits)
    if width is None:
        ids, probs = sparse_probs(logits.reshape(1, -1), params)
        if ids is None:
            return None
        ids = ids if id_map is None else id_map[ids]
        return draw_support(ids[0], probs[0], uniform), ids, probs
    if logits.dtype != torch.float32 or not logits.is_contiguous():  # each no-op cast costs ~10 us cold
        logits = logits.detach().float().contiguous()
    ids = torch.empty(1, width, dtype=torch.long)
    probs = torch.empty(1, width)
    temperature, top_p = native_temperature_top_p(params)
    token = _kernels().sample_draw(logits.data_ptr(), logits.shape[-1], width, temperature, top_p,
                                   None if id_map is None else id_map.data_ptr(), uniform, ids.data_ptr(),
                                   probs.data_ptr())
    return int(token), ids, probs


_MAX_NATIVE_TOP_K = 64  # the kernel keeps its top-k by insertion: beyond this torch.topk is faster
_NATIVE: list = []


def _kernels():
    """engine.models.cpu_kernels' sampling kernels, looked up on first use (importing them at module
    load would import engine.models, whose registry imports the drafters, which import this module)."""
    if not _NATIVE:
        from engine.models import cpu_kernels

        _NATIVE.append(cpu_kernels.sampling_library())
    return _NATIVE[0]


def dense_probs(ids: torch.Tensor | None, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """`sparse_probs`'s result as full-vocabulary probabilities [..., vocab]."""
    if ids is None:
        return probs
    return torch.zeros(*probs.shape[:-1], vocab, device=probs.device).scatter_(-1, ids, probs)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits [..., V] into the float32 probabilities both models are sampled from."""
    return dense_probs(*sparse_probs(logits, params), logits.shape[-1])


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample one token per row of `probs` [..., V] using `uniforms` [...] in [0, 1).

    Rows need not be normalised. The cumulative sum runs in float64 so that the search is exact
    enough for a 49k vocabulary; `right=True` skips zero-probability tokens.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    # Clamping u below 1 keeps the search inside the last token with positive mass.
    target = (uniforms.double().clamp(0.0, 1.0 - 1e-12) * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last dimension (0 · log 0 = 0)."""
    return torch.special.entr(probs).sum(dim=-1)
