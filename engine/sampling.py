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


# The sampling every default-pair number is reported at (the draft issue's setting): the
# benchmark's default, the teacher data's, and the draft's held-out acceptance score.
REPORTED_SAMPLING = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)


def sparse_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The temperature → top-k → top-p distribution in its cheapest exact form.

    Returns (ids [..., w], probs [..., w]) when greedy or top-k bounds every row's support to w < V
    tokens (ids sorted by probability, largest first; top-p may zero some of them), else
    (None, probs [..., V]). Temperature is applied after the top-k selection, which it cannot
    change, so the common top-k case touches the whole vocabulary once.
    """
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
