"""Saguaro sampling (ALGORITHMS.md §4.4, Def. 14): sample the draft from a downweighted distribution.

After a rejection the recovered token comes from norm(max(T − D, 0)), which puts little mass on
the tokens the draft likes — exactly the cache's guesses. Multiplying the draft's top-(F+1)
probabilities by C ∈ (0, 1] (F guesses plus the drafted token, as the released code does) moves
residual mass onto them and raises the hit rate; verification then runs the acceptance rule
against this same D', so SpS stays exact for any C.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.drafters import ProposalShape


def saguaro_distribution(probs: torch.Tensor, fanout: int, c: float) -> torch.Tensor:
    """sigma_{F,C}: scale the top-(F+1) entries of each row of `probs` [..., V] by C, renormalise."""
    if not 0.0 < c <= 1.0:
        raise ValueError(f"downweight_c (Saguaro C) must be in (0, 1], got {c}")
    if c == 1.0 or fanout <= 0:
        return probs
    top = torch.topk(probs, min(fanout + 1, probs.shape[-1]), dim=-1).indices
    scaled = probs.scatter(-1, top, probs.gather(-1, top) * c)
    return scaled / scaled.sum(dim=-1, keepdim=True)


def saguaro_shape(fanouts: Sequence[int], c: float) -> ProposalShape | None:
    """The draft-side transform for drafted position i: its F is the fan-out of fork depth i."""
    if c == 1.0:
        return None
    fanouts = list(fanouts)

    def shape(probs: torch.Tensor, position: int) -> torch.Tensor:
        return saguaro_distribution(probs, fanouts[min(position, len(fanouts) - 1)], c)

    return shape
