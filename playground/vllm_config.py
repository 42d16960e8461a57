"""The vLLM `speculative_config` equivalent to the playground's settings (ECOSYSTEM.md §5).

Shown so the path from the playground to a serving engine is obvious. Where vLLM has no such rule
(Cactus anywhere, TAS on V1) the JSON says so instead of pretending.
"""

from __future__ import annotations

import json

from engine.config import SpecConfig


def speculative_config(cfg: SpecConfig, draft_model: str, drafter: str = "model") -> dict | None:
    """`LLM(..., speculative_config=...)` for these settings, or None for AR (no speculation)."""
    if cfg.method == "ar":
        return None
    k = cfg.num_speculative_tokens
    if drafter == "ngram":
        spec: dict = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    elif drafter == "eagle":
        # A feature-level draft is vLLM's EAGLE method (its checkpoint layout differs from ours).
        spec = {"method": "eagle", "model": draft_model, "num_speculative_tokens": k}
    else:
        spec = {"method": "draft_model", "model": draft_model, "num_speculative_tokens": k}
        if cfg.temperature > 0:
            spec["draft_sample_method"] = "probabilistic"  # the rules need the full draft distribution
    if cfg.method == "sps":
        spec["rejection_sample_method"] = "standard"
    elif cfg.method == "tas":
        # V1 has no typical acceptance: these are the V0 engine's names (vLLM <= 0.9).
        spec.update({"spec_decoding_acceptance_method": "typical_acceptance_sampler",
                     "typical_acceptance_sampler_posterior_threshold": cfg.posterior_threshold,
                     "typical_acceptance_sampler_posterior_alpha": cfg.posterior_alpha})
    elif cfg.method == "cactus":
        # Not upstream: the proposed Model Runner V2 fields (or Cactus's V0 monkey-patch).
        spec.update({"rejection_sample_method": "cactus", "cactus_delta": cfg.delta})
    return spec


def speculative_config_note(cfg: SpecConfig) -> str:
    notes = {
        "ar": "AR: no `speculative_config` (plain decoding).",
        "sps": "SpS: stock vLLM V1 rejection sampler.",
        "tas": "TAS: vLLM V0 only (`typical_acceptance_sampler`, removed in V1); on V1 it needs a custom rule.",
        "cactus": "Cactus: not in vLLM. Use the Cactus repo's V0 monkey-patch (vllm==0.7.3), or a V1/MRV2 "
                  "patch that swaps target probs for h before `rejection_sample`; the fields shown are that "
                  "proposal's names.",
    }
    return notes.get(cfg.method, "")


def speculative_config_text(cfg: SpecConfig, target_model: str, draft_model: str, drafter: str = "model") -> str:
    """Python snippet: the LLM(...) call with the JSON, plus sampling params."""
    spec = speculative_config(cfg, draft_model, drafter)
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k or -1,
                "max_tokens": cfg.max_new_tokens, "seed": cfg.seed}
    body = f"LLM(model={target_model!r}" + (f",\n    speculative_config={json.dumps(spec, indent=4)}" if spec else "")
    return f"# {speculative_config_note(cfg)}\n{body})\nSamplingParams(**{json.dumps(sampling)})"
