"""A labelled projection: this run's speed with a dedicated draft device (never a measurement).

On a machine whose cores are split between the target and the draft, SSD's target verifies at
the speed of its share. The paper's setting adds the draft device instead. From the run's own
trace this computes the speed the same run would have there, with Theorem 7's round time
(ALGORITHMS.md §4.2) in seconds:

    round = serve + message + max(verify + loop, fill)      tokens/s = emitted / (prefill + Σ round)

Assumptions (one line, shown with the number): the target verifies at its full-machine speed
(measured side by side with its pinned speed for the same row counts), the draft keeps its
measured speed, and hits, accepted lengths, fills and the loop's own work stay as measured.
With the target at the speed it ran at (scale 1), the same formula is a model of the run itself,
which is checked against the measured tokens/s (`model_tokens_per_s`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ASSUMPTIONS = ("projected, dedicated draft device: target at its full-machine speed (measured), draft at its "
               "measured speed, hits, accepted lengths and loop work as measured")


PHASES = ("serve", "message", "verify", "loop", "fill")  # RoundTiming's seconds, in the order of a round


@dataclass
class RoundTiming:
    emitted: int
    verify: float  # target forwards this round (pinned)
    verify_full: float  # the same forwards at full-machine speed (calibrated ratio per row count)
    loop: float  # the main process's own work between the reply and the next request, verify excluded
    serve: float  # the worker's serve (lookup, first-token redraft, backup)
    message: float  # the wait for the reply beyond the serve (pipe, pickling, scheduling)
    fill: float  # the cache fill that overlapped this round's verification


@dataclass
class ProjectionTrace:
    prefill: float = 0.0
    prefill_full: float = 0.0
    rounds: list[RoundTiming] = field(default_factory=list)
    # Running sums of Theorem 7's round times (target pinned, at full speed) and of the tokens: each
    # round's event reads both speeds, and a sum over every round so far would grow with the run.
    _seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _emitted: int = 0

    def add(self, r: RoundTiming) -> None:
        self.rounds.append(r)
        wait = r.serve + r.message
        self._seconds[0] += wait + max(r.verify + r.loop, r.fill)
        self._seconds[1] += wait + max(r.verify_full + r.loop, r.fill)
        self._emitted += r.emitted

    def tokens_per_s(self, full_machine: bool) -> float | None:
        """Emitted tokens over Theorem 7's round times, target pinned (False) or at full speed (True)."""
        if not self.rounds:
            return None
        total = (self.prefill_full if full_machine else self.prefill) + self._seconds[int(full_machine)]
        return self._emitted / total if total > 0 else None

    def phase_ms(self) -> dict[str, float | None]:
        """Mean ms per round of each term of the round time: where an SSD round goes (the wait for
        the reply is serve + message; verify + loop runs while the fill does)."""
        n = len(self.rounds)
        return {f"round_{name}_ms": 1e3 * sum(getattr(r, name) for r in self.rounds) / n if n else None
                for name in PHASES}

    def summary(self) -> dict:
        return {"projected_tokens_per_s": self.tokens_per_s(True), "model_tokens_per_s": self.tokens_per_s(False),
                "projection_assumptions": ASSUMPTIONS} | self.phase_ms()
