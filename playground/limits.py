"""Request limits and the model-pair allow-list: what a public demo must refuse before it runs.

Every limit is checked before the engine starts, so bad input gets one clear sentence instead of a
traceback or a hung session; the wall-clock limit is also enforced inside the loop (via the stop
Event), since a request can be slow without being large.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SSD_BACKUPS, SSD_FANOUT_MODES, SpecConfig

ALLOWED_PAIRS = ("tiny", "default")  # no free-text model names: see ECOSYSTEM.md §4
UI_METHODS = ("ar", "sps", "tas", "cactus", "ssd")
METHOD_LABELS = {"ar": "AR (baseline)", "sps": "SpS (lossless)", "tas": "TAS (typical)", "cactus": "Cactus (KL budget)",
                 "ssd": "SSD (Saguaro, async draft)"}
SSD_RULES = ("sps", "tas", "cactus")  # the acceptance rule SSD verifies with
MAX_SSD_BUDGET = 64
DEFAULT_PROMPT = "Write a short poem about the sea."
# The Generate tab's starting values; the start-up AR reference is measured with the same ones.
DEFAULT_SETTINGS = {"method": "cactus", "delta": 1.0, "temperature": 0.8, "top_p": 0.95, "top_k": 40,
                    "posterior_threshold": 0.09, "posterior_alpha": 0.3, "max_new_tokens": 96, "seed": 0}


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 512
    max_new_tokens: int = 256
    max_k: int = 16
    max_seconds: float = 120.0  # wall clock per request (generation, compare or sweep)
    max_compare_methods: int = 5
    max_sweep_points: int = 8
    max_sweep_new_tokens: int = 64
    max_temperature: float = 2.0
    max_delta: float = 10.0
    max_seed: int = 2**31 - 1
    concurrency: int = 2  # engine jobs running at once (all tabs share one queue)
    queue_size: int = 32  # waiting requests before new ones are refused

    @staticmethod
    def for_device(gpu: bool) -> "Limits":
        return Limits(max_new_tokens=1024, max_prompt_tokens=2048) if gpu else Limits()


def check_pair(name: str) -> str:
    if name not in ALLOWED_PAIRS:
        raise ValueError(f"model pair {name!r} is not on the allow-list ({', '.join(ALLOWED_PAIRS)})")
    return name


def build_config(limits: Limits, *, method: str, k: float, delta: float, posterior_threshold: float,
                 posterior_alpha: float, temperature: float, top_p: float, top_k: float, max_new_tokens: float,
                 seed: float, inspect_top_n: int = 0, ssd_rule: str = "sps", fanout_mode: str = "uniform",
                 budget: float = 15, downweight_c: float = 1.0, backup: str = "neural") -> SpecConfig:
    """A validated SpecConfig from raw UI values (sliders send floats), or ValueError saying what is wrong.

    For method "ssd" the config's `method` is the acceptance rule SSD verifies with (`ssd_rule`);
    the caller runs it through the SSD engine (see `is_ssd`).
    """
    if method not in UI_METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(UI_METHODS)}")
    if method == "ssd":
        if ssd_rule not in SSD_RULES:
            raise ValueError(f"SSD verifies with one of {', '.join(SSD_RULES)}, got {ssd_rule!r}")
        if fanout_mode not in SSD_FANOUT_MODES or backup not in SSD_BACKUPS:
            raise ValueError(f"SSD fan-out must be one of {', '.join(SSD_FANOUT_MODES)} and the backup one of "
                             f"{', '.join(SSD_BACKUPS)}")
        if budget is None or float(budget) != int(float(budget)) or not 1 <= int(float(budget)) <= MAX_SSD_BUDGET:
            raise ValueError(f"the SSD cache budget B must be a whole number between 1 and {MAX_SSD_BUDGET}, "
                             f"got {budget!r}")
        if downweight_c is None or not 0 < float(downweight_c) <= 1:
            raise ValueError(f"the Saguaro down-weight C must be in (0, 1], got {downweight_c!r}")
    values = {"K": k, "max new tokens": max_new_tokens, "top-k": top_k, "seed": seed}
    for label, value in values.items():
        if value is None or float(value) != int(float(value)):
            raise ValueError(f"{label} must be a whole number, got {value!r}")
    k, max_new_tokens, top_k, seed = (int(float(v)) for v in values.values())
    if not 1 <= k <= limits.max_k:
        raise ValueError(f"K must be between 1 and {limits.max_k}, got {k}")
    if not 1 <= max_new_tokens <= limits.max_new_tokens:
        raise ValueError(f"max new tokens must be between 1 and {limits.max_new_tokens}, got {max_new_tokens}")
    if not 0 <= seed <= limits.max_seed:
        raise ValueError(f"seed must be between 0 and {limits.max_seed}, got {seed}")
    if temperature is None or not 0 <= float(temperature) <= limits.max_temperature:
        raise ValueError(f"temperature must be between 0 and {limits.max_temperature}, got {temperature!r}")
    if delta is None or not 0 <= float(delta) <= limits.max_delta:
        raise ValueError(f"δ must be between 0 and {limits.max_delta} nats, got {delta!r}")
    cfg = SpecConfig(method=ssd_rule if method == "ssd" else method, num_speculative_tokens=k, delta=float(delta),
                     posterior_threshold=float(posterior_threshold), posterior_alpha=float(posterior_alpha),
                     temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                     max_new_tokens=max_new_tokens, seed=seed, inspect_top_n=inspect_top_n)
    if method == "ssd":
        # A budget below K+1 leaves some depths without guesses: that is the user's choice to make.
        cfg = SpecConfig(**{**cfg.as_dict(), "ssd_fanout_mode": fanout_mode, "ssd_budget": int(float(budget)),
                            "ssd_fanout": max(int(float(budget)) // (k + 1), 1), "downweight_c": float(downweight_c),
                            "ssd_backup": backup})
    cfg.validate()
    return cfg


def check_prompt_tokens(limits: Limits, prompt_ids: list[int]) -> list[int]:
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise ValueError(f"the prompt is {len(prompt_ids)} tokens (chat template included); "
                         f"the limit is {limits.max_prompt_tokens}. Shorten it.")
    return prompt_ids


def inspector_width(vocab_size: int, top_k: int) -> int:
    """Inspector rows kept per token: the whole vocabulary when small, else enough to cover top-k twice.

    Only what the inspector and the Learn tab show: the divergences are computed on the full
    distributions (`engine.divergence`), never on these rows.
    """
    if 0 < top_k <= 64:
        return min(vocab_size, 2 * top_k)
    return vocab_size if vocab_size <= 512 else 64
