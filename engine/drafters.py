"""Drafters: one small interface, several ways to propose tokens (cf. HF `CandidateGenerator`).

A drafter sees the full token sequence so far and returns up to K tokens together with the exact
distributions they were sampled from; verification needs those distributions to stay exact. A
neural drafter keeps its own KV cache and re-synchronises it to the accepted sequence at the
start of each proposal, so the decoding loop never manages draft state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.sampling import SamplingParams, dense_probs, logits_to_probs, sample_from
from engine.support_rows import SupportRows

_CPU = torch.device("cpu")


def uniform_floats(uniforms: Sequence[float], k: int) -> list[float]:
    """The first k of a drafter's uniforms as Python floats, given a list or a float tensor alike."""
    return uniforms.tolist()[:k] if isinstance(uniforms, torch.Tensor) else list(uniforms[:k])


class Proposal:
    """n <= K drafted tokens and D_i, the distribution tokens[i] was sampled from.

    Given as dense rows `probs` [n, V], or (from a drafter whose rows have a small support) as the
    same rows in sparse form `support` = (ids, probs) [n, w] plus the vocabulary size: the
    acceptance rule reads that form directly, and the dense rows are built only if someone reads
    `probs` (a [V] row per token was most of a round's drafting overhead). A native drafter gives
    the sparse rows as `rows` (`SupportRows`, written by address), the native rule reads them by
    address, and `support` builds their tensors only when read.
    """

    def __init__(self, tokens: list[int], probs: torch.Tensor | None = None, *,
                 support: tuple[torch.Tensor, torch.Tensor] | None = None, rows: SupportRows | None = None,
                 vocab_size: int = 0) -> None:
        if (probs is not None) + (support is not None) + (rows is not None) != 1:
            raise ValueError("a Proposal takes dense probs, a sparse support or support rows, exactly one of them")
        if probs is None and not vocab_size:
            raise ValueError("a sparse Proposal needs the vocabulary size")
        self.tokens = tokens
        self.rows = rows
        self._support = support
        self._probs = probs
        self.vocab_size = probs.shape[-1] if probs is not None else vocab_size

    @property
    def support(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, probs) [n, w] of a sparse proposal (None for dense rows)."""
        if self._support is None and self.rows is not None:
            self._support = self.rows.tensors()
        return self._support

    @property
    def probs(self) -> torch.Tensor:
        """[n, V]: the dense rows (built from `support` on first read)."""
        if self._probs is None:
            ids, probs = self.support
            self._probs = dense_probs(ids, probs, self.vocab_size)
        return self._probs

    def prefix(self, k: int) -> "Proposal":
        """The first k tokens and their rows, in this proposal's own form (sparse stays sparse)."""
        if self.rows is not None:
            return Proposal(self.tokens[:k], rows=self.rows.prefix(k), vocab_size=self.vocab_size)
        if self.support is None:
            return Proposal(self.tokens[:k], self._probs[:k])
        ids, probs = self.support
        return Proposal(self.tokens[:k], support=(ids[:k], probs[:k]), vocab_size=self.vocab_size)

    @property
    def device(self) -> torch.device:
        if self.rows is not None:  # blocks on the CPU; no torch attribute read
            return _CPU
        return (self._probs if self._probs is not None else self.support[1]).device

    def __repr__(self) -> str:
        return f"Proposal(tokens={self.tokens}, {'dense' if self._probs is not None else 'sparse'})"


# Saguaro sampling (ALGORITHMS.md §4.4): maps the draft distribution of drafted position i
# (0-based, rows [..., V]) to the distribution the token is actually sampled from.
ProposalShape = Callable[[torch.Tensor, int], torch.Tensor]

if TYPE_CHECKING:  # models.registry builds drafters; import the interface only for type checking
    from engine.models.causal_lm import CausalLM, FeatureRows


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

    def target_feature_rows(self) -> FeatureRows | None:
        """Where the target may write its hidden states itself (then `observe_target_rows` instead
        of `observe_target`), or None: this drafter takes them as tensors only."""
        return None

    def observe_target_rows(self, start: int, n: int) -> None:
        """`observe_target` for n rows from position `start` the target wrote into `target_feature_rows`."""
        raise NotImplementedError(f"{type(self).__name__} offers no feature rows")

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, params: SamplingParams, uniforms: Sequence[float]) -> Proposal:
        """Draft up to `k` tokens after `context`, drawing token i with `uniforms[i]` (floats: a list, or a
        float tensor [k])."""

    def score(self, context: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Draft logits [len(tokens)+1, V] after `context + tokens[:i]`, i = 0..len(tokens).

        SSD's "glue decode" (ALGORITHMS.md §4.6): the fork candidates of the speculation cache are
        the top-F tokens of these rows. Only the ranking matters, so the default takes the log of
        `propose`'s temperature-1 distribution one position at a time; neural drafters override it
        with a single forward.
        """
        rows = []
        for i in range(len(tokens) + 1):
            step = self.propose(list(context) + list(tokens[:i]), 1, SamplingParams(1.0), torch.zeros(1))
            rows.append(step.probs[0].log() if step.tokens else torch.zeros(step.probs.shape[-1]))
        return torch.stack(rows)

    def propose_branches(self, context: Sequence[int], speculation: Sequence[int], forks: Sequence[tuple[int, int]],
                         k: int, params: SamplingParams, uniforms: torch.Tensor,
                         shape: ProposalShape | None = None, stop: Callable[[], bool] | None = None) -> list[Proposal]:
        """Draft `k` tokens for every fork of a speculation: SSD's speculation-cache fill (§4.6).

        Fork `(d, y)` (0 <= d <= len(speculation)) is the verification outcome "d drafted tokens
        accepted, then token y": its branch continues `context + speculation[:d] + [y]`. Branch j
        draws token i with `uniforms[j, i]` ([len(forks), k]) from `shape(D_i, i)` (Saguaro
        sampling) or from D_i itself when `shape` is None; each returned Proposal carries the
        exact distributions its tokens were drawn from, so verification stays lossless.

        `stop` (SSD's fill sized to the verification) is asked before each unit of work; once it
        says True the fill ends, so the result covers a prefix of `forks`, each branch with at
        least one token, all of them cut to the depth reached.

        This default loops over the branches with `propose` (correct for every drafter, one branch
        at a time); `ModelDrafter` overrides it with one batched tree pass per depth.
        """
        if k < 1:
            raise ValueError(f"each branch needs k >= 1 drafted tokens, got {k}")
        out = []
        for (d, y), u in zip(forks, uniforms):
            if stop is not None and stop():
                break
            prefix = list(context) + list(speculation[:d]) + [int(y)]
            if shape is None:
                out.append(self.propose(prefix, k, params, u))
                continue
            tokens: list[int] = []
            rows = []
            for i in range(k):
                step = self.propose(prefix + tokens, 1, params, u[i:i + 1])
                if not step.tokens:
                    break
                rows.append(shape(step.probs[0], i))
                tokens.append(int(sample_from(rows[-1], u[i])))
            out.append(Proposal(tokens, torch.stack(rows) if rows else step.probs[:0]))
        return out

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

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, uniforms: Sequence[float]) -> Proposal:
        keep = _common_prefix(self._cached, context, limit=len(context) - 1)
        self.lm.rollback(keep)
        logits = self.lm.forward(context[keep:])
        tokens: list[int] = []
        rows = []
        for i in range(k):
            probs = logits_to_probs(logits[-1], params)
            token = int(sample_from(probs, torch.as_tensor(uniforms[i])))
            tokens.append(token)
            rows.append(probs)
            if i + 1 < k:
                logits = self.lm.forward([token])
        self._cached = list(context) + tokens[:-1]
        return Proposal(tokens, torch.stack(rows) if rows else torch.empty(0, self.lm.vocab_size))

    def score(self, context: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One forward over the uncached tail of `context + tokens` (the glue decode)."""
        keep = _common_prefix(self._cached, context, limit=len(context) - 1)
        self.lm.rollback(keep)
        logits = self.lm.forward(list(context[keep:]) + list(tokens), last_n=len(tokens) + 1)
        self._cached = list(context) + list(tokens)
        return logits

    def propose_branches(self, context: Sequence[int], speculation: Sequence[int], forks: Sequence[tuple[int, int]],
                         k: int, params: SamplingParams, uniforms: torch.Tensor,
                         shape: ProposalShape | None = None, stop: Callable[[], bool] | None = None) -> list[Proposal]:
        """All branches in one tree forward per depth, sharing the prefix KV (SSD tree decode, §4.6).

        The KV cache holds `context + speculation` (the glue); step i feeds one token per branch
        into scratch slots past it, each branch attending to its fork's prefix and its own earlier
        tokens only. Backends without a tree forward (transformers) use the per-branch default.
        """
        if not self.lm.supports_tree or not forks:
            return super().propose_branches(context, speculation, forks, k, params, uniforms, shape, stop)
        if k < 1:
            raise ValueError(f"each branch needs k >= 1 drafted tokens, got {k}")
        glue = list(context) + list(speculation)
        keep = _common_prefix(self._cached, glue, limit=len(glue))
        self.lm.rollback(keep)
        if keep < len(glue):
            self.lm.forward(glue[keep:])
        self._cached = glue
        n, base = len(forks), len(glue)
        depth = torch.tensor([d for d, _ in forks])
        if depth.min() < 0 or depth.max() > len(speculation):
            raise ValueError(f"fork depths must be in [0, {len(speculation)}]")
        feed = torch.tensor([int(y) for _, y in forks])
        # Key j is visible to branch b iff it is in b's prefix (j < len(context) + d_b) or it is
        # one of b's own tree slots (base + i*n + b for earlier steps i).
        visible = torch.arange(base)[None, :] < (len(context) + depth)[:, None]  # [n, base]
        own = torch.zeros(n, 0, dtype=torch.bool)
        eye = torch.eye(n, dtype=torch.bool)
        tokens, rows = [], []
        for i in range(k):
            if stop is not None and stop():
                break
            own = torch.cat([own, eye], dim=1)
            logits = self.lm.forward_tree(feed.tolist(), (len(context) + depth + i).tolist(), base + i * n,
                                          torch.cat([visible, own], dim=1))
            probs = logits_to_probs(logits, params)
            if shape is not None:
                probs = shape(probs, i)
            feed = sample_from(probs, uniforms[:, i])
            tokens.append(feed)
            rows.append(probs)
        return branch_proposals(tokens, rows)


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

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, uniforms: Sequence[float]) -> Proposal:
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


def branch_proposals(tokens: list[torch.Tensor], rows: list[torch.Tensor], ids: list[torch.Tensor] | None = None,
                     vocab_size: int = 0) -> list[Proposal]:
    """Per-branch proposals from a tree pass's per-depth draws ([n] tokens, [n, V] rows each, or
    [n, w] rows over the token ids `ids` [n, w] each: the sparse form, kept sparse)."""
    if not tokens:
        return []
    tokens_t, probs_t = torch.stack(tokens, dim=1).tolist(), torch.stack(rows, dim=1)  # [n, depth], [n, depth, V or w]
    if ids is None:
        return [Proposal(t, p) for t, p in zip(tokens_t, probs_t)]
    ids_t = torch.stack(ids, dim=1)
    return [Proposal(t, support=(i, p), vocab_size=vocab_size) for t, i, p in zip(tokens_t, ids_t, probs_t)]


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
