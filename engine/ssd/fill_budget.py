"""A cache fill sized to the verification it hides, from the worker's own online measurements.

Theorem 7 (ALGORITHMS.md §4.2) charges a hit round max(1, T_p) verifications: once the fill takes
longer than the verification (T_p > 1), every round waits for the draft, which the paper's design
never intends (§4.6: "glue + fork + tree decode must fit inside one target verification"). The
released engine fixes the fan-out and K up front; here the worker sizes every round's fill to the
time it actually has.

What it optimises: the chance that the next outcome has a cached speculation, subject to T_p <= 1.
A fill is the glue decode (g) then `depth` tree steps over B branches, each step costing
step(B) = a + b·B (fitted online, least squares over the recent steps). The window W is what the worker measures
between its reply and the next request (the verification plus the loop's own work), split over the
batch's sequences. It is kept per number of tokens the reply served, because the target verifies
those tokens plus one: on one core each verified row adds about 40 % to the verification (AMD EPYC
Zen 3: 8.5 / 11.7 / 15.3 / 18.4 ms for 2-5 rows), so a hit that serves one token leaves a far
shorter window than a miss that serves K, and one smoothed W planned fills that the request cut
short after short replies and left time unused after long ones. The plan keeps the full depth K and
takes the largest budget B <= the requested one with g + K·step(B) <= margin·W (the fan-out is the
requested plan scaled to B, so a geometric plan stays geometric); if no budget fits at depth K it
shortens the depth; if nothing fits, there is no fill and the next round takes the backup. A feature
draft's cache is never shallower than 2: its hit redraws the first token from the real features
(worker.py), so a depth-1 cache saves no draft step, and at K = 1 it does not fill at all (measured:
the fill slowed the verification it shares the machine with by 8-9 % for nothing). While filling,
the worker also stops before any step that would end after the predicted request (or once the
request is already waiting), so the cache holds the branches as far as they got: a round never waits
for the cache beyond the verification, only for the backup after a miss.

Why the output stays exact: sizing only changes which outcomes have a cached speculation and how
many tokens it has. Every served token still carries the distribution it was drawn from, and an
outcome without a cached speculation is a miss, answered by the backup; both are verified by the
unchanged rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.ssd.fanout import round_to_budget

MARGIN = 0.9  # the fill plans for this share of the measured window (measurement noise)
SMOOTHING = 0.3  # weight of the newest window / glue measurement in the running estimates
STEP_HISTORY = 8  # tree steps per branch count the step-cost fit looks back over


def min_fill_depth(needs_target_features: bool) -> int:
    """The shallowest cache worth filling: a feature draft's hit redraws its first token (worker.py),
    so its cache saves a draft step only from the second token on."""
    return 2 if needs_target_features else 1


LOCAL_NOTE = ("drafted in the target process at K = 1: a feature draft's hit redraws its first token from the real "
              "features, so a cache saves no draft step, and a draft here saves the worker's two messages")


@dataclass(frozen=True)
class FillPlan:
    fanouts: tuple[int, ...]  # F_0..F_K actually used (sum = budget used)
    depth: int  # tokens drafted per branch (0: no fill this round)
    note: str = ""  # why there is no fill, for the page

    @property
    def budget(self) -> int:
        return sum(self.fanouts) if self.depth else 0


class FillSizer:
    """Online estimates of the window, the glue decode and the tree-step cost; the plan they allow."""

    def __init__(self) -> None:
        self.window: float | None = None  # over every reply (what the page shows)
        self._windows: dict[int, float] = {}  # per number of tokens the reply served
        self.glue: float | None = None
        # Per branch count, so that the backup's one-branch steps never push the fill's sizes out.
        self._steps: dict[int, deque[float]] = {}
        self._warm: set[int] = set()
        self._glues = 0

    def observe_window(self, seconds: float, served: int | None = None) -> None:
        """The time from a reply that served `served` tokens to the next request."""
        self.window = _smooth(self.window, seconds)
        if served is not None:
            self._windows[served] = _smooth(self._windows.get(served), seconds)

    def window_for(self, served: int | None) -> float | None:
        """The window expected after a reply of `served` tokens: measured for that length; else on
        the straight line through the shortest and longest lengths measured (the verification grows
        by a row per token), never below the shortest window; else the window over every reply."""
        if served is None or not self._windows:
            return self.window
        if served in self._windows:
            return self._windows[served]
        if len(self._windows) < 2:
            return self.window
        measured = sorted(self._windows.items())
        (n0, w0), (n1, w1) = measured[0], measured[-1]
        return max(min(self._windows.values()), w0 + (w1 - w0) * (served - n0) / (n1 - n0))

    def observe_glue(self, seconds: float) -> None:
        """A glue decode's cost; the first one warms the draft up and is skipped (unless it is all there is)."""
        self.glue = seconds if self._glues == 1 else _smooth(self.glue, seconds)
        self._glues += 1

    def observe_step(self, branches: int, seconds: float) -> None:
        """One tree step's cost; the first step of each branch count warms its kernels up and is skipped."""
        if branches in self._warm:
            self._steps.setdefault(branches, deque(maxlen=STEP_HISTORY)).append(seconds)
        self._warm.add(branches)

    def step_seconds(self, branches: int) -> float | None:
        """Predicted cost of one tree step over `branches` branches (None before any was measured)."""
        points = [(n, t) for n, ts in self._steps.items() for t in ts]
        if not points:
            return None
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        spread = sum((n - mean_n) ** 2 for n, _ in points)
        if spread == 0:  # one branch count seen so far: flat below it, proportional above (cautious)
            return mean_t * max(1.0, branches / mean_n)
        slope = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in points) / spread)
        return max(mean_t + slope * (branches - mean_n), min(t for _, t in points))

    def fill_seconds(self, branches: int, depth: int) -> float | None:
        step = self.step_seconds(branches)
        if step is None or self.glue is None:
            return None
        return self.glue + depth * step

    def plan(self, fanouts: Sequence[int], sequences: int = 1, min_depth: int = 1,
             served: int | None = None) -> FillPlan:
        """The requested F_0..F_K, cut to what fits one sequence's share of the window after a reply
        of `served` tokens, at a depth of at least `min_depth` (a feature draft's hit redrafts its
        first token: a shallower cache saves no draft step, and the fill would only slow the
        verification it shares the machine with)."""
        k, requested = len(fanouts) - 1, sum(fanouts)
        if k < min_depth:
            return FillPlan(tuple(0 for _ in fanouts), 0, f"no fill at K = {k}: a feature draft's hit redraws its first token "
                            "from the real features, so a cache saves no draft step")
        if requested == 0:
            return FillPlan(tuple(fanouts), 0, "no fill: the fan-out budget is 0")
        window = self.window_for(served)
        if window is None:  # nothing measured yet: the first fill measures
            return FillPlan(tuple(fanouts), k)
        share = MARGIN * window / max(sequences, 1)
        for depth in range(k, min_depth - 1, -1):
            for budget in range(requested, 0, -1):
                cost = self.fill_seconds(budget, depth)
                if cost is None:
                    return FillPlan(tuple(fanouts), k)
                if cost <= share:
                    return FillPlan(tuple(round_to_budget(list(fanouts), budget)), depth)
        return FillPlan(tuple(0 for _ in fanouts), 0, f"no fill: a cache of {min_depth} token{'s' * (min_depth > 1)} "
                        "per branch does not fit in the verification's time")


def _smooth(estimate: float | None, seconds: float) -> float:
    """The running estimate after one more measurement (the first one is taken as it is)."""
    return seconds if estimate is None else (1 - SMOOTHING) * estimate + SMOOTHING * seconds
