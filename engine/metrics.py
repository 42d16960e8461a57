"""Run metrics with vLLM's names, accumulated from round events (ECOSYSTEM.md §2.5).

`mean_acceptance_length` = 1 + accepted / drafts (counts the recovered/bonus token);
`draft_acceptance_rate` = accepted / drafted; `acceptance_histogram[j]` = rounds that accepted
exactly j drafts; `per_position_acceptance_rate[i]` = rounds whose position i+1 was kept / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.events import RoundEvent


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
    kl_total: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    round_seconds: float = 0.0

    def add_round(self, event: RoundEvent) -> None:
        self.new_tokens += event.num_emitted
        self.num_rounds += 1
        self.target_forwards += event.target_forwards
        self.kl_total += event.kl
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
            "kl_total": self.kl_total,
            "mean_kl_per_token": self.kl_total / self.new_tokens if self.new_tokens else 0.0,
            "elapsed_seconds": elapsed_seconds,
            "prefill_seconds": prefill_seconds,
            "tokens_per_s": self.new_tokens / elapsed_seconds if elapsed_seconds > 0 else None,
            "decode_tokens_per_s": self.new_tokens / decode_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "overhead_seconds": overhead,
            "overhead_fraction": overhead / self.round_seconds if self.round_seconds > 0 else None,
        }


def _grow(counts: list[int], size: int) -> None:
    counts.extend([0] * (size - len(counts)))
