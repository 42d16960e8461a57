"""Run state: the reducer that folds the engine's events into what the UI draws.

One `RunState` per run (per session, per compared method). Chart builders and the token inspector
are pure functions of it, so they can be tested without a browser and redrawn at any rate. The
exact divergence at each tested position (`engine.divergence`, on the full support of T and D) is
read here from the round's token events, on the UI thread that folds them, never the engine's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.divergence import PositionDivergence
from engine.events import FinishEvent, RoundEvent, SSDRoundEvent, StartEvent, TokenEvent, WorkerEvent
from engine.metrics import DivergenceTally

# Colours shared by the token view, the legend and every chart.
STATUS_COLOURS = {
    "accepted": "#2ca02c",
    "recovered": "#ff7f0e",
    "bonus": "#1f77b4",
    "generated": "#9e9e9e",
}
STATUS_MEANING = {
    "accepted": "draft token kept by the rule",
    "recovered": "drawn from the residual after a rejection",
    "bonus": "drawn from the target after all K drafts were kept",
    "generated": "plain autoregressive token",
}
# Knobs only the SSD engine reads: a change to them is not marked on a synchronous run's charts.
SSD_ONLY_FIELDS = frozenset({"ssd_fanout", "ssd_fanout_mode", "ssd_budget", "ssd_power_r", "downweight_c", "ssd_backup"})
EMPTY_TOKEN_TEXT = "·"  # a byte that is not yet a whole character still gets a clickable cell


@dataclass(frozen=True)
class ConfigChange:
    """A live-tuning change, as the engine applied it (at the start of `round_index`)."""

    round_index: int
    token_index: int  # first token produced under the new settings
    elapsed_seconds: float
    changes: dict  # field -> (old, new)

    @property
    def label(self) -> str:
        names = {"delta": "δ", "num_speculative_tokens": "K", "temperature": "T", "top_p": "top-p",
                 "top_k": "top-k", "posterior_threshold": "ε", "posterior_alpha": "α", "method": "method",
                 "ssd_fanout_mode": "fan-out", "ssd_budget": "B", "ssd_fanout": "F", "downweight_c": "C",
                 "ssd_backup": "backup"}
        return ", ".join(f"{names.get(k, k)} {old}→{new}" for k, (old, new) in self.changes.items())


@dataclass
class RunState:
    method: str = ""
    config: dict = field(default_factory=dict)
    start: StartEvent | None = None
    tokens: list[TokenEvent] = field(default_factory=list)
    rounds: list[RoundEvent] = field(default_factory=list)
    changes: list[ConfigChange] = field(default_factory=list)
    divergence: dict[int, PositionDivergence] = field(default_factory=dict)  # tested token index -> divergence
    tally: DivergenceTally = field(default_factory=DivergenceTally)
    finish: FinishEvent | None = None
    ssd_rounds: list[SSDRoundEvent] = field(default_factory=list)  # SSD only: cache and timeline per round
    worker_events: list[WorkerEvent] = field(default_factory=list)  # SSD only: worker started / degraded
    error: str = ""
    paused: bool = False  # parked at a round boundary (Pause / Step), set by the engine loop's handle
    paused_seconds: float = 0.0  # time spent parked, left out of the page's tok/s
    max_concurrent: int = 1  # most runs that took turns on the engine thread with this one, itself included
    started_at: float = field(default_factory=time.time)
    version: int = 0  # bumped by every event, so redraws can be skipped when nothing changed
    _pending: list[TokenEvent] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.start is not None and self.finish is None and not self.error

    @property
    def completed(self) -> bool:
        """Ended by the engine on its own (EOS or the token limit), not stopped and not failed."""
        return self.finish is not None and self.finish.reason != "stopped" and not self.error

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    def round_of(self, round_index: int) -> RoundEvent | None:
        return self.rounds[round_index] if 0 <= round_index < len(self.rounds) else None


def reduce(state: RunState, event: StartEvent | TokenEvent | RoundEvent | SSDRoundEvent | WorkerEvent | FinishEvent
           ) -> RunState:
    """Fold one engine event into `state` (in place; returned for chaining)."""
    if isinstance(event, SSDRoundEvent):
        state.ssd_rounds.append(event)
    elif isinstance(event, WorkerEvent):
        state.worker_events.append(event)
    elif isinstance(event, StartEvent):
        state.start = event
    elif isinstance(event, TokenEvent):
        state.tokens.append(event)
        state._pending.append(event)
    elif isinstance(event, RoundEvent):
        changed = [n for n in event.config_changes if state.method == "ssd" or n not in SSD_ONLY_FIELDS]
        if changed:
            previous = state.rounds[-1].config if state.rounds else state.config
            first = state._pending[0].index if state._pending else len(state.tokens)
            state.changes.append(ConfigChange(
                event.round_index, first, event.elapsed_seconds - event.round_seconds,
                {name: (previous.get(name), event.config.get(name)) for name in changed},
            ))
        for token in state._pending:
            divergence = token.divergence
            if divergence is not None:
                state.divergence[token.index] = divergence
                state.tally.add(token)
        state._pending.clear()
        state.rounds.append(event)
    elif isinstance(event, FinishEvent):
        state.finish = event
    state.version += 1
    return state


def highlighted_tokens(state: RunState) -> list[tuple[str, str | None]]:
    """`gr.HighlightedText` value: one (text, status) cell per generated token, in order.

    Cells map 1:1 to `state.tokens`, so the index a click reports is the token index.
    """
    return [(t.text or EMPTY_TOKEN_TEXT, t.status) for t in state.tokens]


def summary(state: RunState) -> dict:
    """The numbers a run is judged by (vLLM metric names), live while it runs and final after."""
    if state.finish is not None:
        metrics = dict(state.finish.metrics)
    else:
        drafted = sum(r.num_draft_tokens for r in state.rounds)
        accepted = sum(r.num_accepted for r in state.rounds)
        drafts = sum(1 for r in state.rounds if r.num_draft_tokens)
        elapsed = state.rounds[-1].elapsed_seconds if state.rounds else 0.0
        prefill = state.start.prefill_seconds if state.start is not None else 0.0
        metrics = {
            "new_tokens": len(state.tokens),
            "num_rounds": len(state.rounds),
            "draft_acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "constraint_kl_total": sum(r.constraint_kl for r in state.rounds),
            "elapsed_seconds": elapsed,
            "prefill_seconds": prefill,
            "tokens_per_s": len(state.tokens) / elapsed if elapsed > 0 else None,
        }
        # The final line's rate, so far: tokens over the decode (elapsed after the prefill), which is
        # what "× AR" divides (the reference is a decode rate too). Shown from the first round that
        # ran a verification: AR's round 0 runs none (its token is the prefill's last row), and one
        # token over its microseconds would read thousands of tok/s.
        if any(r.verify_seconds > 0 for r in state.rounds[:2]) and elapsed > prefill:
            metrics["decode_tokens_per_s"] = len(state.tokens) / (elapsed - prefill)
        if state.ssd_rounds:
            last = state.ssd_rounds[-1]
            metrics.update(cache_hit_rate=last.hit_rate, theoretical_speedup=last.theoretical_speedup,
                           measured_speedup=last.measured_speedup)
    if state.paused_seconds > 0:  # time parked by Pause / Step is not the engine's: out of the rates
        running = metrics["elapsed_seconds"] - state.paused_seconds
        decode = running - metrics.get("prefill_seconds", 0.0)
        metrics.update(paused_seconds=state.paused_seconds,
                       tokens_per_s=metrics["new_tokens"] / running if running > 0 else None)
        if "decode_tokens_per_s" in metrics:
            metrics["decode_tokens_per_s"] = metrics["new_tokens"] / decode if decode > 0 else None
    kept = [k for r in state.ssd_rounds for k in r.first_kept if k is not None]
    if kept:  # a feature draft's hits: the first token redrafted from the real target features
        metrics.update(first_tokens_redrafted=len(kept), first_token_kept_rate=sum(kept) / len(kept))
    metrics.update(state.tally.summary())
    return metrics
