"""The `vllm.general_plugins` entry point: runs in vLLM's main, engine-core and worker processes.

It installs the fixes of specplay_vllm.fixes where their bugs exist, registers the reduced-head draft
architecture, and replaces `vllm.v1.sample.rejection_sampler.rejection_sample` with a dispatcher
that keeps vLLM's own function for `sps` and runs our rule (specplay_vllm.rule) for `tas` and
`cactus`. Loading twice in one process is harmless (vLLM may do that).
"""

from __future__ import annotations

import logging

log = logging.getLogger("specplay_vllm")

DRAFT_ARCHITECTURE = "EagleSpecplayMistralForCausalLM"


def _dispatcher(original):
    import torch

    from specplay_vllm import settings
    from specplay_vllm.rule import rule_rejection_sample

    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False,
                         synthetic_conditional_rates=None, use_fp64_gumbel=False):
        current = settings.current()
        if current.rule == "sps" or synthetic_mode:
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=synthetic_mode,
                            synthetic_conditional_rates=synthetic_conditional_rates, use_fp64_gumbel=use_fp64_gumbel)
        if sampling_metadata.all_greedy:
            is_greedy = torch.ones(len(num_draft_tokens), dtype=torch.bool)
        elif sampling_metadata.all_random:
            is_greedy = None
        else:
            is_greedy = sampling_metadata.temperature == 0
        return rule_rejection_sample(current, draft_token_ids, num_draft_tokens, max_spec_len, draft_probs,
                                     target_logits, bonus_token_ids, is_greedy, sampling_metadata.generators)

    rejection_sample.specplay_original = original
    return rejection_sample


def register() -> None:
    from vllm import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from specplay_vllm import fixes, settings

    settings.current()  # a bad SPECPLAY_VLLM_* value fails at start-up, not at the first step
    if current_platform.is_cpu():
        fixes.install_expand_fix()
    fixes.install_empty_top_k_guard()
    if DRAFT_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(DRAFT_ARCHITECTURE, "specplay_vllm.draft_model:EagleSpecplayMistralForCausalLM")
    if not hasattr(rejection_sampler.rejection_sample, "specplay_original"):
        rejection_sampler.rejection_sample = _dispatcher(rejection_sampler.rejection_sample)
