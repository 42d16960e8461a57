"""How many bonus-token guesses to cache per acceptance length: uniform F, or Theorem 12.

The cache holds B = Σ_k F_k outcomes. Under the power-law miss model 1 − p_hit(F) = F^{−r}
(Def. 11) and a capped-geometric acceptance length P(k) = (1 − a) a^k (k < K), P(K) = a^K,
maximising Σ_k P(k)(1 − F_k^{−r}) gives F_k ∝ P(k)^{1/(1+r)} (ALGORITHMS.md §4.3).
The acceptance rate a and the exponent r are estimated online from the rounds seen so far.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

DEFAULT_ACCEPTANCE = 0.5  # prior acceptance rate before any round was verified
DEFAULT_POWER_R = 1.0  # prior exponent before enough informative lookups
MIN_R_OBSERVATIONS = 8
_R_GRID = np.logspace(-2, 1, 300)  # the r values the maximum-likelihood fit picks from (a round reads it)


def round_to_budget(weights: Sequence[float], budget: int) -> list[int]:
    """Integers >= 0 proportional to `weights` that sum exactly to `budget` (largest remainder)."""
    total = sum(weights)
    if budget < 0 or total <= 0:
        raise ValueError(f"need a budget >= 0 and positive weights, got {budget} and {list(weights)}")
    exact = [budget * w / total for w in weights]
    out = [math.floor(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: (out[i] - exact[i], i))
    for i in order[: budget - sum(out)]:
        out[i] += 1
    return out


def uniform_fanout(budget: int, k: int) -> list[int]:
    """The released engine's default: the same F at every k (B spread evenly over K+1 positions)."""
    return round_to_budget([1.0] * (k + 1), budget)


def geometric_weights(acceptance: float, r: float, k: int) -> list[float]:
    """Theorem 12's unnormalised F_k: a^{k/(1+r)} for k < K, a^{K/(1+r)} (1 − a)^{−1/(1+r)} for K."""
    a = min(max(acceptance, 1e-3), 1 - 1e-3)  # a = 1 makes the capped term infinite
    e = 1.0 / (1.0 + r)
    return [a ** (j * e) for j in range(k)] + [a ** (k * e) * (1.0 - a) ** (-e)]


def geometric_fanout(budget: int, acceptance: float, r: float, k: int) -> list[int]:
    """Capped geometric allocation of a budget B (Theorem 12), rounded to integers summing to B."""
    return round_to_budget(geometric_weights(acceptance, r, k), budget)


class FanoutPlanner:
    """Online estimates of the acceptance rate a and the power-law exponent r, and the plan they give.

    a = accepted / drafted tokens over the rounds seen (with a one-round prior at 0.5); r is the
    maximum-likelihood fit of miss ~ Bernoulli(F^{−r}) over lookups whose true k had F >= 2
    (F = 1 makes the power law predict a certain miss, so those lookups carry no information
    about r), unless the user fixes r.
    """

    def __init__(self) -> None:
        self.accepted = 0
        self.drafted = 0
        self.lookups: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # F -> [hits, lookups]

    def observe_round(self, num_accepted: int, num_drafted: int) -> None:
        self.accepted += num_accepted
        self.drafted += num_drafted

    def observe_lookup(self, fanout: int, hit: bool) -> None:
        self.lookups[fanout][0] += int(hit)
        self.lookups[fanout][1] += 1

    @property
    def acceptance(self) -> float:
        return (self.accepted + DEFAULT_ACCEPTANCE) / (self.drafted + 1)

    def fitted_r(self) -> float | None:
        data = [(f, h, n) for f, (h, n) in self.lookups.items() if f >= 2]
        if sum(n for _, _, n in data) < MIN_R_OBSERVATIONS:
            return None
        loglik = np.zeros_like(_R_GRID)
        for f, hits, n in data:
            miss_logp = -_R_GRID * math.log(f)
            loglik += hits * np.log1p(-np.minimum(np.exp(miss_logp), 1 - 1e-12)) + (n - hits) * miss_logp
        return float(_R_GRID[loglik.argmax()])

    def power_r(self, user_r: float) -> float:
        if user_r > 0:
            return user_r
        fitted = self.fitted_r()
        return DEFAULT_POWER_R if fitted is None else fitted

    def plan(self, mode: str, budget: int, k: int, user_r: float = 0.0) -> list[int]:
        """F_0..F_K for the next cache fill."""
        if mode == "uniform":
            return uniform_fanout(budget, k)
        if mode == "geometric":
            return geometric_fanout(budget, self.acceptance, self.power_r(user_r), k)
        raise ValueError(f"unknown fan-out mode {mode!r}; expected uniform or geometric")
