"""Run metrics with vLLM's names, accumulated from round events (ECOSYSTEM.md §2.5).

`mean_acceptance_length` = 1 + accepted / drafts (counts the recovered/bonus token);
`draft_acceptance_rate` = accepted / drafted; `acceptance_histogram[j]` = rounds that accepted
exactly j drafts; `per_position_acceptance_rate[i]` = rounds whose position i+1 was kept / drafts.
Divergence is `DivergenceTally`'s: the exact KL(induced ‖ target) per tested position
(`engine.divergence`), read from the token events by whoever reports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.events import RoundEvent, TokenEvent
from engine.ssd.theory import ssd_speedup

# Where a round's wall time goes, in loop order. The two *_forward phases are the models' own
# forwards (drafter.forward_seconds, target.forward_seconds); everything else is the overhead the
# benchmark's `overhead_fraction` counts: the work that closed the round before (building its
# RoundEvent and adding it to the metrics, `handoff`), the drafter's and the verify call's work
# around their forwards (the draft's own sampling is in draft_other), the sampling transform of the
# verified rows with the acceptance rule on their kept support (one native call where the kernels
# built), the KV rollback and feature hand-over, building the round's token events, and the loop's
# bookkeeping. What no round counts is the time the generator is suspended (the consumer's own work
# on the events, other runs on a shared engine thread, a pause) and the last round's closing.
ROUND_PHASES = ("handoff", "draft_forward", "draft_other", "verify_forward", "verify_other", "sampling_rule",
                "rollback", "events", "bookkeeping")


class PhaseClock:
    """Wall time per phase of one round: `lap(phase)` charges the time since the previous lap, the
    first one since `since` (when the loop got control back from the consumer). `handoff`: the
    seconds the loop spent closing the round before (see ROUND_PHASES)."""

    __slots__ = ("seconds", "_last")

    def __init__(self, since: float, handoff: float = 0.0) -> None:
        self.seconds = dict.fromkeys(ROUND_PHASES, 0.0)
        self.seconds["handoff"] = handoff
        self._last = since

    @property
    def last_lap(self) -> float:
        """When the last lap ended."""
        return self._last

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def split(self, phase: str, forward_phase: str, forward_seconds: float) -> None:
        """Lap `phase`, then move the model's own forward time out of it into `forward_phase`."""
        self.lap(phase)
        self.seconds[phase] -= forward_seconds
        self.seconds[forward_phase] += forward_seconds

    def move(self, phase: str, to_phase: str, seconds: float) -> None:
        """Charge `seconds` of what `phase` holds to `to_phase` instead (a call that did both)."""
        self.seconds[phase] -= seconds
        self.seconds[to_phase] += seconds

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class SpecMetrics:
    new_tokens: int = 0
    num_rounds: int = 0
    target_forwards: int = 0  # after prefill
    num_drafts: int = 0  # rounds that verified at least one drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    emitted_in_drafted_rounds: int = 0
    slots_in_drafted_rounds: int = 0  # Σ (k + 1) over drafted rounds, for system_efficiency
    accepted_per_pos: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)
    constraint_kl_total: float = 0.0  # Cactus: Σ KL(h‖T) over tested positions
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    round_seconds: float = 0.0
    phase_seconds: dict = field(default_factory=lambda: dict.fromkeys(ROUND_PHASES, 0.0))

    def add_round(self, event: RoundEvent) -> None:
        for phase, seconds in event.phase_seconds.items():
            self.phase_seconds[phase] += seconds
        self.new_tokens += event.num_emitted
        self.num_rounds += 1
        self.target_forwards += event.target_forwards
        self.constraint_kl_total += event.constraint_kl
        self.draft_seconds += event.draft_seconds
        self.verify_seconds += event.verify_seconds
        self.round_seconds += event.round_seconds
        k = event.num_draft_tokens
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += event.num_accepted
        self.emitted_in_drafted_rounds += event.num_emitted
        self.slots_in_drafted_rounds += k + 1
        _grow(self.accepted_per_pos, k)
        for i in range(event.num_accepted):
            self.accepted_per_pos[i] += 1
        _grow(self.histogram, k + 1)
        self.histogram[event.num_accepted] += 1

    def summary(self, elapsed_seconds: float, prefill_seconds: float) -> dict:
        drafts = self.num_drafts
        decode_seconds = max(elapsed_seconds - prefill_seconds, 1e-9)
        overhead = max(self.round_seconds - self.draft_seconds - self.verify_seconds, 0.0)
        return {
            "new_tokens": self.new_tokens,
            "num_rounds": self.num_rounds,
            "num_drafts": drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "draft_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
            "mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else None,
            "per_position_acceptance_rate": [n / drafts for n in self.accepted_per_pos] if drafts else [],
            "acceptance_histogram": list(self.histogram),
            "system_efficiency": self.emitted_in_drafted_rounds / self.slots_in_drafted_rounds if drafts else None,
            "target_forwards": self.target_forwards,
            "target_forwards_per_token": self.target_forwards / self.new_tokens if self.new_tokens else None,
            "constraint_kl_total": self.constraint_kl_total,
            "elapsed_seconds": elapsed_seconds,
            "prefill_seconds": prefill_seconds,
            "tokens_per_s": self.new_tokens / elapsed_seconds if elapsed_seconds > 0 else None,
            "decode_tokens_per_s": self.new_tokens / decode_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "overhead_seconds": overhead,
            "overhead_fraction": overhead / self.round_seconds if self.round_seconds > 0 else None,
            "phase_seconds": dict(self.phase_seconds),
            # decoding time outside every round: the consumer's work on the events, the last round's closing
            "between_rounds_seconds": max(decode_seconds - self.round_seconds, 0.0),
        }


@dataclass
class DivergenceTally:
    """The exact divergence of a run's output, over the positions where a rule tested a draft.

    `mean_induced_kl` is the headline: the mean over tested positions of KL(P ‖ T), P the
    distribution the rule emits there. Bonus and AR tokens are drawn from T itself (KL 0) and are not
    counted. `mean_draft_kl` is KL(D ‖ T) at the same positions: what sampling the draft alone would
    cost, Cactus Theorem 3's ceiling D_f(D‖T) on the induced divergence.
    """

    tested_positions: int = 0
    induced_kl_total: float = 0.0
    draft_kl_total: float = 0.0

    def add(self, token: TokenEvent) -> None:
        divergence = token.divergence
        if divergence is None:
            return
        self.tested_positions += 1
        self.induced_kl_total += divergence.induced_kl
        self.draft_kl_total += divergence.draft_kl

    def summary(self) -> dict:
        n = self.tested_positions
        return {
            "tested_positions": n,
            "induced_kl_total": self.induced_kl_total,
            "mean_induced_kl": self.induced_kl_total / n if n else None,
            "mean_draft_kl": self.draft_kl_total / n if n else None,
        }


def _grow(counts: list[int], size: int) -> None:
    counts.extend([0] * (size - len(counts)))


@dataclass
class SSDMetrics:
    """Speculation-cache counters for Theorem 7 (ALGORITHMS.md §4.2), one per SSD generation.

    A lookup is a sequence-round whose previous outcome was searched in a cache (the first round of
    each sequence is a forced miss and not a lookup). Latencies are per round: T_p = cache fill
    time / the round's verification time; T_b = serve time of rounds that ran a backup / the same.
    """

    lookups: int = 0
    hits: int = 0
    rows_by_source: dict = field(default_factory=dict)  # source -> [rounds, tokens] per sequence-round
    rounds: int = 0
    new_tokens: int = 0
    verify_seconds: float = 0.0
    fill_seconds: float = 0.0
    fill_rounds: int = 0
    backup_seconds: float = 0.0
    backup_rounds: int = 0
    round_seconds: float = 0.0
    verifications: int = 0  # sequence-rounds verified by the target

    def add_row(self, source: str, looked_up: bool, emitted: int) -> None:
        if looked_up:
            self.lookups += 1
            self.hits += source == "cache"
        counts = self.rows_by_source.setdefault(source, [0, 0])
        counts[0] += 1
        counts[1] += emitted
        self.new_tokens += emitted
        self.verifications += 1

    def add_round(self, verify_seconds: float, round_seconds: float, backup_seconds: float | None) -> None:
        self.rounds += 1
        self.verify_seconds += verify_seconds
        self.round_seconds += round_seconds
        if backup_seconds is not None:
            self.backup_seconds += backup_seconds
            self.backup_rounds += 1

    def add_fill(self, seconds: float) -> None:
        self.fill_seconds += seconds
        self.fill_rounds += 1

    def _tokens_per_round(self, sources: tuple[str, ...]) -> float | None:
        rounds = sum(self.rows_by_source.get(s, [0, 0])[0] for s in sources)
        tokens = sum(self.rows_by_source.get(s, [0, 0])[1] for s in sources)
        return tokens / rounds if rounds else None

    def rates(self) -> dict:
        """The inputs of Theorem 7 / Theorem 17 measured so far (None where nothing was seen)."""
        verify = self.verify_seconds / self.rounds if self.rounds else None
        # A miss is a lookup the cache did not answer (its backup drafted). Rounds drafted in the target
        # process ("local" by choice, "sync" once the worker is gone) looked nothing up.
        misses = tuple(s for s in self.rows_by_source if s not in ("cache", "local", "sync"))
        return {
            "p_hit": self.hits / self.lookups if self.lookups else None,
            "e_hit": self._tokens_per_round(("cache",)),
            "e_miss": self._tokens_per_round(misses),
            "e_miss_neural": self._tokens_per_round(("neural",)),
            "e_miss_fast": self._tokens_per_round(("fast",)),
            "t_p": self.fill_seconds / self.fill_rounds / verify if verify and self.fill_rounds else None,
            "t_b": self.backup_seconds / self.backup_rounds / verify if verify and self.backup_rounds else None,
        }

    def theoretical_speedup(self, rates: dict | None = None) -> float | None:
        """Theorem 7 at the measured rates (`rates`: this round's `rates()`, when the caller has them)."""
        r = rates if rates is not None else self.rates()
        if r["p_hit"] is None or r["t_p"] is None:
            return None
        e_hit = r["e_hit"] if r["e_hit"] is not None else 0.0
        e_miss = r["e_miss"] if r["e_miss"] is not None else 1.0
        return ssd_speedup(r["p_hit"], e_hit, e_miss, r["t_p"], r["t_b"] or 0.0)

    def measured_speedup(self) -> float | None:
        """Tokens per verification-time: the measured counterpart of Theorem 7's speedup."""
        if not self.round_seconds or not self.verifications:
            return None
        return self.new_tokens * (self.verify_seconds / self.verifications) / self.round_seconds

    def summary(self) -> dict:
        r = self.rates()
        return {
            "cache_hit_rate": r["p_hit"],
            "cache_lookups": self.lookups,
            "cache_hits": self.hits,
            "tokens_per_round_hit": r["e_hit"],
            "tokens_per_round_miss": r["e_miss"],
            "rounds_by_source": {s: c[0] for s, c in self.rows_by_source.items()},
            "t_p": r["t_p"],
            "t_b": r["t_b"],
            "theoretical_speedup": self.theoretical_speedup(r),
            "measured_speedup": self.measured_speedup(),
        }
