"""Typed events the decoding loop yields. The UI and the benchmark consume the same stream.

Token `status` follows vLLM: `accepted` (draft token kept), `recovered` (sampled after a
rejection), `bonus` (sampled from the target after all K were accepted); autoregressive rounds emit
`generated` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """One row of the token inspector: a token's probability under each distribution at a position."""

    token_id: int
    text: str
    target_prob: float
    draft_prob: float
    h_prob: float  # Cactus's raised distribution (equals target_prob for the other rules)
    residual_prob: float  # normalised max(h − draft, 0): where a recovered token is drawn from


@dataclass(frozen=True)
class StartEvent:
    prompt_tokens: int
    prefill_seconds: float
    target: str
    drafter: str
    backend: str
    devices: str


@dataclass(frozen=True)
class TokenEvent:
    index: int  # position in the generated text (0-based)
    token_id: int
    text: str  # decoded piece ("" while a multi-byte character is incomplete)
    status: str  # accepted | recovered | bonus | generated
    round_index: int
    draft_position: int  # 1-based position inside the round
    target_prob: float  # T at this position, of the emitted token
    draft_prob: float | None  # D of the emitted token (None for bonus/generated)
    acceptance_prob: float | None  # P(accept) of the drafted token tested here
    gamma: float | None  # Cactus h(x) of the drafted token tested here
    kl: float  # KL(h || T) spent at this position, nats
    target_entropy: float  # H(T) at this position, nats
    candidates: tuple[Candidate, ...] = ()


@dataclass(frozen=True)
class RoundEvent:
    round_index: int
    method: str
    num_speculative_tokens: int  # K requested by the config this round
    num_draft_tokens: int  # tokens actually drafted (a prompt-lookup draft may find fewer)
    draft_token_ids: tuple[int, ...]  # what the draft proposed, including any rejected tail
    num_accepted: int
    num_emitted: int
    accepted_positions: tuple[bool, ...]  # per drafted position: passed its test (before the cut)
    rejected_token_id: int | None
    rejected_text: str | None
    kl: float  # KL spent by the emitted tokens of this round
    draft_seconds: float
    verify_seconds: float
    target_forwards: int  # 0 when the prefill already gave this round's only target position
    round_seconds: float
    elapsed_seconds: float  # since the generation started (prefill included)
    config: dict = field(default_factory=dict)
    config_changes: tuple[str, ...] = ()  # fields changed since the previous round (live tuning)

    @property
    def overhead_seconds(self) -> float:
        """Everything in the round that is not a model forward: sampling, rules, events."""
        return max(self.round_seconds - self.draft_seconds - self.verify_seconds, 0.0)


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # eos | max_new_tokens | stopped | error
    text: str
    token_ids: tuple[int, ...]
    metrics: dict
    message: str = ""
