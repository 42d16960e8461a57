"""Drafters: one small interface, several ways to propose tokens (cf. HF `CandidateGenerator`).

A drafter sees the full token sequence so far and returns up to K tokens together with the exact
distributions they were sampled from; verification needs those distributions to stay exact. A
neural drafter keeps its own KV cache and re-synchronises it to the accepted sequence at the
start of each proposal, so the decoding loop never manages draft state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampling import SamplingParams, logits_to_probs, sample_from


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # n <= K drafted tokens
    probs: torch.Tensor  # [n, V]: D_i, the distribution tokens[i] was sampled from


if TYPE_CHECKING:  # models.registry builds drafters; import the interface only for type checking
    from engine.models.causal_lm import CausalLM


class Drafter(ABC):
    name: str
    kind: str
    # Feature-level drafts (EAGLE-style) read the target's final hidden states; the decoding loop
    # then hands them over through `observe_target` after every target forward.
    needs_target_features: bool = False

    def start(self) -> None:
        """Forget any previous sequence (called once per generation)."""

    def observe_target(self, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states [n, H] of the committed tokens at positions start..start+n-1."""

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, params: SamplingParams, uniforms: torch.Tensor) -> Proposal:
        """Draft up to `k` tokens after `context`, drawing token i with `uniforms[i]`."""

    @property
    def forward_seconds(self) -> float:
        return 0.0


class ModelDrafter(Drafter):
    """A neural draft: any `CausalLM` (a small model, a layer subset, or the target itself)."""

    kind = "model"

    def __init__(self, lm: CausalLM, name: str) -> None:
        self.lm = lm
        self.name = name
        self._cached: list[int] = []  # tokens whose KV is in lm's cache

    def start(self) -> None:
        self.lm.reset()
        self._cached = []

    @property
    def forward_seconds(self) -> float:
        return self.lm.forward_seconds

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, uniforms: torch.Tensor) -> Proposal:
        keep = _common_prefix(self._cached, context, limit=len(context) - 1)
        self.lm.rollback(keep)
        logits = self.lm.forward(context[keep:])
        tokens: list[int] = []
        rows = []
        for i in range(k):
            probs = logits_to_probs(logits[-1], params)
            token = int(sample_from(probs, uniforms[i]))
            tokens.append(token)
            rows.append(probs)
            if i + 1 < k:
                logits = self.lm.forward([token])
        self._cached = list(context) + tokens[:-1]
        return Proposal(tokens, torch.stack(rows) if rows else torch.empty(0, self.lm.vocab_size))


class NgramDrafter(Drafter):
    """Prompt lookup (Saxena 2023; HF `prompt_lookup_num_tokens`): copy what followed the last
    earlier occurrence of the current n-gram. Its proposal distribution is a point mass, so SpS
    accepts token x with probability T(x) and stays exact."""

    kind = "ngram"

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.name = f"ngram(prompt lookup, n≤{max_ngram})"

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, uniforms: torch.Tensor) -> Proposal:
        tokens = lookup_continuation(context, k, self.max_ngram, self.min_ngram)
        probs = torch.zeros(len(tokens), self.vocab_size)
        if tokens:
            probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Proposal(tokens, probs)


def lookup_continuation(context: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest trailing n-gram."""
    seq = list(context)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + k]
    return []


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
