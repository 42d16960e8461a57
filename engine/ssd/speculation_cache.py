"""The speculation cache (ALGORITHMS.md §4.3, §4.6): verification outcome (k, y) -> next speculation.

For a speculation x_1..x_n the outcome "k accepted, then y" has y drawn from the residual at
position k+1 (k < n) or from T_{n+1} (k = n). Under SpS, Cactus and TAS a rejected x_{k+1} can
never be the recovered token (its residual max(h − D, 0) is 0 once D(x) > h(x) caused the
rejection; TAS recovers argmax T, which always passes its own test), so the guesses for k < n are
the draft's top-F_k tokens *excluding* x_{k+1}; for k = n they are its top-F_n tokens after x_n.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.drafters import Proposal

Key = tuple[int, int]  # (num_accepted k, next token y)
Support = tuple[torch.Tensor, torch.Tensor]  # one sparse row: (ids [w], probs [w])


def fork_keys(logits: torch.Tensor, speculation: Sequence[int], fanouts: Sequence[int]) -> list[Key]:
    """Cache keys from the draft's logits [n+1, V] along the speculation (its glue decode).

    Depth d < n uses F_d guesses; the bonus depth d = n uses the last fan-out entry (F_K), so a
    speculation shorter than K (prompt lookup, the end of the budget) still gets its bonus guesses.
    """
    n = len(speculation)
    if logits.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} logit rows for a speculation of {n} tokens, got {logits.shape[0]}")
    keys: list[Key] = []
    for d in range(n + 1):
        f = min(fanouts[d] if d < n else fanouts[-1], logits.shape[-1] - 1)
        if f <= 0:
            continue
        row = logits[d].float().clone()
        if d < n:
            row[speculation[d]] = float("-inf")
        keys.extend((d, int(y)) for y in torch.topk(row, f).indices.tolist())
    return keys


@dataclass
class SpeculationCache:
    """One sequence's cache for one round: rebuilt from scratch each round (old entries dropped)."""

    entries: dict[Key, Proposal] = field(default_factory=dict)
    fanouts: tuple[int, ...] = ()

    def lookup(self, key: Key, k: int) -> Proposal | None:
        """The cached speculation for outcome `key`, cut to the current K; None on a miss."""
        hit = self.entries.get(key)
        if hit is None:
            return None
        return hit.prefix(k)

    def keys(self) -> tuple[Key, ...]:
        return tuple(self.entries)

    @property
    def depth(self) -> int:
        """Tokens per cached speculation (every branch of a fill reaches the same depth)."""
        return min((len(p.tokens) for p in self.entries.values()), default=0)


def couple_first_token(fresh: torch.Tensor | Support, cached: torch.Tensor | Support, token: int,
                       uniforms: torch.Tensor) -> tuple[int, bool]:
    """A draw from `fresh` (D) that keeps the cached `token`, drawn from `cached` (D~), when it can.

    The speculative-sampling coupling between two drafts: keep x~ with probability
    min(1, D(x~)/D~(x~)), else draw from norm(max(D − D~, 0)). The result is distributed exactly
    as D and equals x~ with probability 1 − TV(D, D~), the most any coupling allows. Rows are
    dense [V] or sparse (ids [w], probs [w]); the residual is drawn over its tokens in vocabulary
    order, so either form gives the same token. Returns (token, kept); `uniforms` holds the two
    uniforms [2] it uses.
    """
    if not (isinstance(fresh, tuple) and isinstance(cached, tuple)):
        return _couple_dense(fresh, cached, token, uniforms)
    d, d_tilde = _as_dict(fresh), _as_dict(cached)
    if float(uniforms[0]) * d_tilde.get(token, 0.0) < d.get(token, 0.0):
        return token, True
    residual = sorted((i, p - d_tilde.get(i, 0.0)) for i, p in d.items() if p > d_tilde.get(i, 0.0))
    total = sum(p for _, p in residual)
    if total <= 0:  # D = D~ up to rounding: x~ is already a draw from D
        return token, True
    target, cdf = min(float(uniforms[1]), 1.0 - 1e-12) * total, 0.0
    for i, p in residual:  # inverse CDF, as sample_from: the first token whose CDF passes the target
        cdf += p
        if cdf > target:
            return i, False
    return residual[-1][0], False


def _as_dict(row: Support) -> dict[int, float]:
    """token -> probability over a sparse row's nonzero entries (a few dozen under top-k)."""
    ids, probs = row
    return {i: p for i, p in zip(ids.tolist(), probs.tolist()) if p > 0}


def _couple_dense(fresh: torch.Tensor | Support, cached: torch.Tensor | Support, token: int,
                  uniforms: torch.Tensor) -> tuple[int, bool]:
    """`couple_first_token` where a row is dense: the same arithmetic vectorised (float64, the
    residual's CDF summed left to right in vocabulary order), since a dense row without top-k
    holds the whole reduced vocabulary (16k tokens: 6-16 ms a hit through Python dicts, 1 ms here;
    the sparse path stays in Python, 0.04 ms against 0.35 ms vectorised for a 40-token row)."""
    if float(uniforms[0]) * _prob(cached, token) < _prob(fresh, token):
        return token, True
    ids = (fresh[0] if isinstance(fresh, tuple) else fresh.nonzero().flatten()).unique()  # ascending
    d, d_tilde = _prob_at(fresh, ids), _prob_at(cached, ids)
    keep = d > d_tilde
    ids, cdf = ids[keep], (d - d_tilde)[keep].cumsum(0)
    if not len(ids):  # D = D~ up to rounding: x~ is already a draw from D
        return token, True
    target = min(float(uniforms[1]), 1.0 - 1e-12) * float(cdf[-1])
    return int(ids[min(int(torch.searchsorted(cdf, target, right=True)), len(ids) - 1)]), False


def _prob_at(row: torch.Tensor | Support, ids: torch.Tensor) -> torch.Tensor:
    """The row's float64 probabilities at `ids` (0 where it has none)."""
    if not isinstance(row, tuple):
        return row[ids].double()
    row_ids, probs = row
    return ((ids[:, None] == row_ids[None, :]) * probs[None, :].double()).sum(1)


def _prob(row: torch.Tensor | Support, token: int) -> float:
    return float(_prob_at(row, torch.tensor([token]))[0])
