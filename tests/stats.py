"""A small chi-square goodness-of-fit helper for the statistical tests (no scipy needed)."""

from __future__ import annotations

import math

import torch


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square via Wilson–Hilferty; z = 3.719 is the 1e-4 tail."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_statistic(samples: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of integer `samples` against `probs`, pooling bins with tiny expectation."""
    n = samples.numel()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    expected = probs.double() * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    if bool(((obs > 0) & ~keep).any()):
        return math.inf, int(keep.sum()) - 1
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def matches(samples: torch.Tensor, probs: torch.Tensor) -> bool:
    stat, dof = chi2_statistic(samples, probs)
    return stat < chi2_critical(max(dof, 1))
