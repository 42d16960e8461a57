"""A small chi-square goodness-of-fit helper for the statistical tests (no scipy needed)."""

from __future__ import annotations

import math

import torch


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square via Wilson–Hilferty; z = 3.719 is the 1e-4 tail."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_statistic(samples: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of integer `samples` against `probs`, pooling bins with tiny expectation.

    The pooled tail is a cell of its own only if it too expects `min_expected` samples; otherwise it
    joins the smallest kept cell (a tail expecting 0.07 samples turned one legitimate draw into 13.3).
    A sample where `probs` is 0 is impossible: the statistic is then infinite.
    """
    n = samples.numel()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    expected = probs.double() * n
    if bool(((counts > 0) & (expected <= 0)).any()):
        return math.inf, 0
    big = expected >= min_expected
    obs, exp = counts[big], expected[big]
    tail_obs, tail_exp = counts[~big].sum(), expected[~big].sum()
    if tail_exp >= min_expected or obs.numel() == 0:
        obs, exp = torch.cat([obs, tail_obs.view(1)]), torch.cat([exp, tail_exp.view(1)])
    elif tail_exp > 0:
        smallest = int(exp.argmin())
        obs[smallest] += tail_obs
        exp[smallest] += tail_exp
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, obs.numel() - 1


def matches(samples: torch.Tensor, probs: torch.Tensor) -> bool:
    stat, dof = chi2_statistic(samples, probs)
    return stat < chi2_critical(max(dof, 1))
