"""Which acceptance rule the plugin applies: a process default from the environment, and per request.

vLLM loads general plugins in the main, engine-core and worker processes, and the environment is
the one channel that reaches all three unchanged; vLLM's own `speculative_config` rejects fields it
does not know. In-process engines (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) can also switch the default
between `generate()` calls with `use()`. A request overrides the default through
`SamplingParams(extra_args={"specplay_rule": "cactus", "specplay_delta": 1.0})` (the OpenAI server's
`vllm_xargs`); the keys it leaves out keep the default's values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.acceptance import METHODS
from engine.peers.vllm_peer import ENV_DELTA, ENV_POSTERIOR_ALPHA, ENV_POSTERIOR_THRESHOLD, ENV_RULE


@dataclass(frozen=True)
class RuleSettings:
    """`rule`: sps (vLLM's own rejection sampler, untouched), tas or cactus; the rest as in SpecConfig."""

    rule: str = "sps"
    delta: float = 1.0
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.rule not in METHODS:
            raise ValueError(f"{ENV_RULE} / specplay_rule must be one of {', '.join(METHODS)}, got {self.rule!r}")
        if not (self.delta >= 0 and math.isfinite(self.delta)):
            raise ValueError(f"{ENV_DELTA} / specplay_delta (the Cactus KL budget) must be a finite number >= 0, "
                             f"got {self.delta}")
        if not (0 < self.posterior_threshold <= 1 and 0 < self.posterior_alpha <= 1):
            raise ValueError(f"{ENV_POSTERIOR_THRESHOLD} / specplay_posterior_threshold and {ENV_POSTERIOR_ALPHA} / "
                             "specplay_posterior_alpha must be in (0, 1]")

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> "RuleSettings":
        env = os.environ if env is None else env
        default = RuleSettings()
        return RuleSettings(
            rule=env.get(ENV_RULE, default.rule).strip().lower(),
            delta=float(env.get(ENV_DELTA, default.delta)),
            posterior_threshold=float(env.get(ENV_POSTERIOR_THRESHOLD, default.posterior_threshold)),
            posterior_alpha=float(env.get(ENV_POSTERIOR_ALPHA, default.posterior_alpha)),
        )

    def env(self) -> dict[str, str]:
        """The environment variables that select these settings (for subprocesses and docs)."""
        return {ENV_RULE: self.rule, ENV_DELTA: repr(self.delta),
                ENV_POSTERIOR_THRESHOLD: repr(self.posterior_threshold), ENV_POSTERIOR_ALPHA: repr(self.posterior_alpha)}


# SamplingParams.extra_args keys a request may set, and the RuleSettings field each overrides.
REQUEST_KEYS = {"specplay_rule": "rule", "specplay_delta": "delta",
                "specplay_posterior_threshold": "posterior_threshold", "specplay_posterior_alpha": "posterior_alpha"}


def request_overrides(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The RuleSettings fields a request's `extra_args` sets (other keys belong to others: ignored)."""
    out: dict[str, Any] = {}
    for key, field in REQUEST_KEYS.items():
        if extra_args and key in extra_args:
            value = extra_args[key]
            if field == "rule":
                if not isinstance(value, str):
                    raise ValueError(f"specplay_rule must be a string, got {value!r}")
                out[field] = value.strip().lower()
            else:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{key} must be a number, got {value!r}")
                out[field] = float(value)
    return out


def for_request(overrides: Mapping[str, Any], default: RuleSettings) -> RuleSettings:
    """`default` with a request's overrides applied (raises ValueError on a bad combination)."""
    return replace(default, **overrides) if overrides else default


_current: RuleSettings | None = None


def current() -> RuleSettings:
    global _current
    if _current is None:
        _current = RuleSettings.from_env()
    return _current


def use(settings: RuleSettings) -> None:
    """Switch the rule of this process's engine (takes effect at its next verification step)."""
    global _current
    _current = settings
