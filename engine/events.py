"""Typed events the decoding loop yields. The UI and the benchmark consume the same stream.

Token `status` follows vLLM: `accepted` (draft token kept), `recovered` (sampled after a
rejection), `bonus` (sampled from the target after all K were accepted); autoregressive rounds emit
`generated` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.divergence import PositionDivergence


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
class PositionTest:
    """The acceptance test at one drafted position, with every number needed to redo it by hand."""

    position: int  # 1-based position inside the round
    token_id: int  # the drafted token x
    text: str
    target_prob: float  # T(x)
    draft_prob: float  # D(x)
    gamma: float | None  # the mass the test grants x: T(x) for SpS, Cactus's γ = h(x); None for TAS
    acceptance_prob: float  # P(accept x) = min(1, γ/D(x)); 1 or 0 for TAS
    u: float | None  # the uniform the test drew, kept iff u < P(accept); None for TAS (deterministic)
    threshold: float | None  # TAS only: min(ε, α·e^(−H(T))) with Medusa's H, kept iff T(x) > it
    passed: bool  # the test's outcome (positions after the first rejection are tested but not kept)


@dataclass(frozen=True)
class StartEvent:
    prompt_tokens: int
    prefill_seconds: float
    target: str
    drafter: str
    backend: str
    devices: str


class TokenDetails:
    """What a token event computes only when a consumer asks: its decoded text, its inspector
    candidates, the exact divergence at its position and the round's acceptance tests. Building
    them for every token cost more than the rule itself, and the benchmark never reads them; the
    decoding loop hands each round's tokens one shared instance, computed on the reader's thread."""

    def text(self, index: int) -> str:
        """The decoded piece of generated token `index`."""
        return ""

    def candidates(self, position: int) -> tuple[Candidate, ...]:
        """Inspector rows of the round's token at 0-based `position`."""
        return ()

    def divergence(self, position: int) -> PositionDivergence | None:
        """The exact divergences at 0-based `position` when it was tested, else None."""
        return None

    def tests(self) -> tuple[PositionTest, ...]:
        """The round's acceptance test at every drafted position, in order."""
        return ()

    def token_text(self, token_id: int) -> str:
        """One token decoded alone (the round's rejected draft)."""
        return ""


# The per-round events are plain slotted dataclasses, not frozen ones: a frozen dataclass sets each
# field through object.__setattr__, and built every round that took 4.4x as long (1.9 against 0.43 us a
# TokenEvent, warm). Nothing assigns to an event once it is built.
@dataclass(slots=True)
class TokenEvent:
    index: int  # position in the generated text (0-based)
    token_id: int
    status: str  # accepted | recovered | bonus | generated
    round_index: int
    draft_position: int  # 1-based position inside the round
    target_prob: float  # T at this position, of the emitted token
    draft_prob: float | None  # D of the emitted token (None for bonus/generated)
    acceptance_prob: float | None  # P(accept) of the drafted token tested here
    gamma: float | None  # Cactus h(x) of the drafted token tested here
    constraint_kl: float  # Cactus: KL(h || T) of the tested draft, the per-step constraint δ bounds; 0 otherwise
    target_entropy: float  # H(T) at this position, nats
    sequence: int = 0  # row of the batch (SSD decodes several sequences together)
    details: TokenDetails = field(default_factory=TokenDetails, repr=False, compare=False)

    @property
    def text(self) -> str:
        """Decoded piece ("" while a multi-byte character is incomplete), decoded on first read."""
        return self.details.text(self.index)

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """Top candidates for the token inspector (() unless the config's inspect_top_n asked)."""
        return self.details.candidates(self.draft_position - 1)

    @property
    def divergence(self) -> PositionDivergence | None:
        """KL(induced ‖ T) and KL(D ‖ T) at this position (None unless the rule tested a draft here)."""
        return self.details.divergence(self.draft_position - 1)

    @property
    def round_tests(self) -> tuple[PositionTest, ...]:
        """The acceptance tests of this token's round (shared by the round's tokens)."""
        return self.details.tests()


@dataclass(slots=True)
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
    constraint_kl: float  # Σ of the round's tokens' constraint_kl (Cactus only)
    draft_seconds: float
    verify_seconds: float
    target_forwards: int  # 0 when the prefill already gave this round's only target position
    round_seconds: float
    elapsed_seconds: float  # since the generation started (prefill included)
    config: dict = field(default_factory=dict)
    config_changes: tuple[str, ...] = ()  # fields changed since the previous round (live tuning)
    sequence: int = 0
    phase_seconds: dict = field(default_factory=dict)  # wall time per round phase (metrics.ROUND_PHASES)
    details: TokenDetails = field(default_factory=TokenDetails, repr=False, compare=False)  # its tokens' details

    @property
    def rejected_text(self) -> str | None:
        """The rejected draft token's text, decoded on first read (None when no draft was rejected)."""
        return None if self.rejected_token_id is None else self.details.token_text(self.rejected_token_id)

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
    sequence: int = 0


@dataclass(frozen=True)
class TimelineSpan:
    """One busy interval of an SSD round, in seconds since the generation started."""

    lane: str  # draft (serve / fill) | target (verify) | wait (target idle, waiting for the draft)
    label: str
    start: float
    end: float


@dataclass(frozen=True)
class SSDRoundEvent:
    """Per SSD round: what the speculation cache did for each sequence, and the round's timeline.

    The lookup of round r searches the cache filled during round r−1's verification; its keys
    (k, y) and fan-out per depth are reported here. `rates` are the running Theorem-7 inputs.
    """

    round_index: int
    sequences: tuple[int, ...]  # the batch rows still decoding; the per-row tuples follow this order
    hits: tuple[bool, ...]
    sources: tuple[str, ...]  # cache | neural | fast | ngram | local (drafted here) | sync (degraded) per sequence
    lookup_keys: tuple[tuple[int, int] | None, ...]  # the verified outcome (k, y) looked up
    cache_keys: tuple[tuple[tuple[int, int], ...], ...]  # per sequence: the keys the cache held
    fanouts: tuple[int, ...]  # F_0..F_K the searched cache was built with
    num_emitted: tuple[int, ...]
    timeline: tuple[TimelineSpan, ...]
    hit_rate: float | None  # running, over all lookups so far
    theoretical_speedup: float | None  # Theorem 7 with the measured rates
    measured_speedup: float | None  # tokens per verification-time, measured
    rates: dict = field(default_factory=dict)
    backup: str = ""  # the backup this round actually used on a miss (what `adaptive` chose)
    cache_key_texts: tuple[tuple[str, ...], ...] = ()  # per sequence: each cache key's token as text
    lookup_texts: tuple[str, ...] = ()  # per sequence: the looked-up outcome's token as text ("" without a lookup)
    budget_requested: int = 0  # Σ F_k the settings asked for
    budget_used: int = 0  # Σ F_k the searched cache was actually filled with (fill sized to the verify)
    cache_depth: int = 0  # tokens per branch the searched cache reached (< K: the fill was cut)
    first_kept: tuple[bool | None, ...] = ()  # feature draft, per sequence: cached first token kept by the redraft
    next_fill: tuple[int, int, bool] = (0, 0, False)  # the fill made during this round: branches, depth, cut
    fill_window_seconds: float | None = None  # the worker's estimate of the time a fill has (reply to request)
    fill_note: str = ""  # why the worker made no fill this round (empty when it filled)
    projected_tokens_per_s: float | None = None  # running projection, dedicated draft device (not a measurement)
    model_tokens_per_s: float | None = None  # the same model at the target's measured speed (checks it)


@dataclass(frozen=True)
class WorkerEvent:
    """The draft worker's life: started, or lost (the loop degraded to synchronous drafting)."""

    kind: str  # started | degraded
    message: str
    devices: str = ""
