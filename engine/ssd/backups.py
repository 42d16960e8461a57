"""Backup speculators for a cache miss (ALGORITHMS.md §4.5).

`neural` drafts just in time with the draft model itself (E_miss ≈ E_SD, T_b ≈ T_SD); `fast`
proposes uniformly random tokens as the paper does (T_b ≈ 0, E_miss ≈ 1); `ngram` copies what
followed the last match of the context's tail (prompt lookup, the paper's suggested improvement);
`adaptive` picks neural or fast per round with Theorem 17 from the measured rates. Random and
prompt-lookup tokens are point masses, for which SpS accepts x with probability T(x): still exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.drafters import lookup_continuation
from engine.ssd.theory import best_backup

NGRAM_MAX = 3


def fast_backup(k: int, vocab_size: int, generator: torch.Generator) -> list[int]:
    """k uniformly random tokens (the released engine's argmax of uniform-random logits)."""
    return torch.randint(vocab_size, (k,), generator=generator).tolist()


def ngram_backup(context: Sequence[int], k: int) -> list[int]:
    """Up to k tokens by prompt lookup; fewer (even none) when the tail never occurred before."""
    return lookup_continuation(context, k, NGRAM_MAX, 1)


def resolve_backup(kind: str, batch: int, rates: dict) -> str:
    """The backup actually used this round: `adaptive` applies Theorem 17 once rates are measured.

    `rates` holds p_hit, e_hit, e_miss_neural, e_miss_fast, t_p, t_b (None while unmeasured);
    before a neural miss was measured it stays neural (E_SD unknown), and it assumes E_fast = 1.
    """
    if kind != "adaptive":
        return kind
    needed = ("p_hit", "e_hit", "e_miss_neural", "t_p", "t_b")
    if any(rates.get(name) is None for name in needed):
        return "neural"
    e_fast = rates.get("e_miss_fast") or 1.0
    return best_backup(batch, rates["p_hit"], rates["e_hit"], rates["e_miss_neural"], e_fast, rates["t_p"], rates["t_b"])
