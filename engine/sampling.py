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


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits [..., V] into the float32 probabilities both models are sampled from."""
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p_filter(logits, params.top_p, params.top_k)
    return torch.softmax(logits, dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches `top_p` (always at least one).

    When top-k already ran, only its k survivors can be kept, so sorting those is enough; a full
    49k-entry sort per row is the expensive path and is taken only without top-k.
    """
    vocab = logits.shape[-1]
    width = top_k if 0 < top_k < vocab else vocab
    sorted_logits, sorted_idx = torch.topk(logits, width, dim=-1)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = torch.ones_like(logits, dtype=torch.bool) if width < vocab else torch.zeros_like(logits, dtype=torch.bool)
    drop.scatter_(-1, sorted_idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


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
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)
