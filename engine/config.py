"""`SpecConfig`: the per-session knobs, read again at the start of every round.

The UI mutates one of these while a generation runs; the loop takes a validated snapshot each
round, so a change to K, δ, the method or the sampling settings applies from the next round on.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields

from engine.acceptance import METHODS
from engine.sampling import SamplingParams

DECODE_METHODS = ("ar",) + METHODS
MAX_SPECULATIVE_TOKENS = 64
SSD_FANOUT_MODES = ("uniform", "geometric")
SSD_BACKUPS = ("neural", "fast", "ngram", "adaptive")


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
    # Saguaro SSD (ALGORITHMS.md §4), read only by engine.ssd; `method` is then the acceptance rule.
    ssd_fanout: int = 3  # uniform fan-out F per position (the released engine's default)
    ssd_fanout_mode: str = "uniform"  # uniform | geometric (Theorem 12)
    ssd_budget: int = 0  # B = Σ F_k cache entries per sequence; 0 = F·(K+1)
    ssd_power_r: float = 0.0  # power-law miss exponent r (Def. 11); 0 = fitted online from hits
    downweight_c: float = 1.0  # Saguaro sampling C in (0, 1]; 1 = off (Def. 14)
    ssd_backup: str = "neural"  # neural | fast | ngram | adaptive (Theorem 17)

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
        self._validate_ssd()

    def _validate_ssd(self) -> None:
        for name in ("ssd_fanout", "ssd_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.ssd_fanout_mode not in SSD_FANOUT_MODES:
            raise ValueError(f"unknown fan-out mode {self.ssd_fanout_mode!r}; expected one of {', '.join(SSD_FANOUT_MODES)}")
        if self.ssd_backup not in SSD_BACKUPS:
            raise ValueError(f"unknown SSD backup {self.ssd_backup!r}; expected one of {', '.join(SSD_BACKUPS)}")
        if not (isinstance(self.downweight_c, (int, float)) and 0.0 < self.downweight_c <= 1.0):
            raise ValueError(f"downweight_c (Saguaro C) must be in (0, 1], got {self.downweight_c!r}")
        if not (isinstance(self.ssd_power_r, (int, float)) and math.isfinite(self.ssd_power_r) and self.ssd_power_r >= 0):
            raise ValueError(f"ssd_power_r must be a finite number >= 0 (0 = fitted online), got {self.ssd_power_r!r}")

    @property
    def ssd_cache_budget(self) -> int:
        """B: the number of cached outcomes per sequence (Σ_k F_k, §4.3)."""
        return self.ssd_budget or self.ssd_fanout * (self.num_speculative_tokens + 1)

    @property
    def sampling(self) -> SamplingParams:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        return SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p))

    def snapshot(self, previous: "SpecConfig | None" = None) -> "SpecConfig":
        """A validated copy; raises ValueError with a readable message on bad settings. Given the
        previous round's snapshot and nothing changed since, that very snapshot (already valid): a
        round whose knobs did not move then copies and checks nothing, so the loop can keep
        what it derived from it (its SamplingParams, its dict) by identity."""
        if previous is not None and previous.__dict__ == self.__dict__:
            return previous
        snap = copy.copy(self)
        snap.validate()
        return snap

    def as_dict(self) -> dict:
        """Every field is a scalar, so a flat dict is a full copy (dataclasses.asdict deep-copies
        recursively and cost ~0.2 ms per round, a per-token cost in the decode loop)."""
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    def changed_fields(self, other: "SpecConfig") -> tuple[str, ...]:
        return tuple(name for name in _FIELD_NAMES if getattr(self, name) != getattr(other, name))


_FIELD_NAMES = tuple(f.name for f in fields(SpecConfig))
