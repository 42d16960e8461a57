"""`SpecConfig`: the per-session knobs, read again at the start of every round.

The UI mutates one of these while a generation runs; the loop takes a validated snapshot each
round, so a change to K, δ, the method or the sampling settings applies from the next round on.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, fields

from engine.acceptance import METHODS
from engine.sampling import SamplingParams

DECODE_METHODS = ("ar",) + METHODS
MAX_SPECULATIVE_TOKENS = 64


@dataclass
class SpecConfig:
    method: str = "sps"  # ar | sps | tas | cactus
    num_speculative_tokens: int = 4  # K
    delta: float = 1.0  # Cactus KL budget (nats); 0 = SpS
    posterior_threshold: float = 0.09  # TAS ε
    posterior_alpha: float = 0.3  # TAS α
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 128
    seed: int = 0
    inspect_top_n: int = 0  # candidates per token kept for the token inspector (0 = none)

    def validate(self) -> None:
        if self.method not in DECODE_METHODS:
            raise ValueError(f"unknown method {self.method!r}; expected one of {', '.join(DECODE_METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"K (num_speculative_tokens) must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if not (isinstance(self.delta, (int, float)) and math.isfinite(self.delta) and self.delta >= 0):
            raise ValueError(f"delta (the Cactus KL budget) must be a finite number >= 0, got {self.delta!r}")
        for name in ("posterior_threshold", "posterior_alpha"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.inspect_top_n, int) or self.inspect_top_n < 0:
            raise ValueError(f"inspect_top_n must be >= 0, got {self.inspect_top_n!r}")
        self.sampling  # SamplingParams validates temperature, top_k, top_p

    @property
    def sampling(self) -> SamplingParams:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        return SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p))

    def snapshot(self) -> "SpecConfig":
        """A validated copy; raises ValueError with a readable message on bad settings."""
        snap = copy.copy(self)
        snap.validate()
        return snap

    def as_dict(self) -> dict:
        return asdict(self)

    def changed_fields(self, other: "SpecConfig") -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))
