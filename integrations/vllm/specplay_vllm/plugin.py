"""The `vllm.general_plugins` entry point: runs in vLLM's main, engine-core and worker processes.

It installs the fixes of specplay_vllm.fixes where their bugs exist, registers the reduced-head draft
architecture, and replaces `vllm.v1.sample.rejection_sampler.rejection_sample` with a dispatcher:
a step whose requests all use `sps` runs vLLM's own function; any other step runs our rules
(specplay_vllm.rule), each request with its own (SpS rows then go through the engine's SpS, the
same distribution as vLLM's).

A request's rule travels in `SamplingParams.extra_args` (specplay_vllm.settings.REQUEST_KEYS).
`rejection_sample` only sees the batch's `SamplingMetadata`, so the worker's `InputBatch` records
each request's overrides when it is added and hands them, in batch-row order, to every
`SamplingMetadata` it builds (`specplay_overrides`); vLLM rebuilds that metadata whenever requests
join, leave or move, as it does for its own per-row tensors. Bad values are refused when the
SamplingParams are built (in the caller's process), not in the engine.
Loading twice in one process is harmless (vLLM may do that).
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
        overrides = getattr(sampling_metadata, "specplay_overrides", None) or [{}] * len(num_draft_tokens)
        rules = [settings.for_request(o, current) for o in overrides]
        if all(r.rule == "sps" for r in rules) or synthetic_mode:
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=synthetic_mode,
                            synthetic_conditional_rates=synthetic_conditional_rates, use_fp64_gumbel=use_fp64_gumbel)
        if sampling_metadata.all_greedy:
            is_greedy = torch.ones(len(num_draft_tokens), dtype=torch.bool)
        elif sampling_metadata.all_random:
            is_greedy = None
        else:
            is_greedy = sampling_metadata.temperature == 0
        return rule_rejection_sample(rules, draft_token_ids, num_draft_tokens, max_spec_len, draft_probs,
                                     target_logits, bonus_token_ids, is_greedy, sampling_metadata.generators)

    rejection_sample.specplay_original = original
    return rejection_sample


def _track_request_rules() -> None:
    """Give every SamplingMetadata the batch rows' rule overrides (see the module docstring)."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from specplay_vllm.settings import request_overrides

    if hasattr(InputBatch, "specplay_tracked"):
        return
    add, remove, make = InputBatch.add_request, InputBatch.remove_request, InputBatch._make_sampling_metadata

    def add_request(self, request):
        params = request.sampling_params
        overrides = request_overrides(params.extra_args) if params is not None else {}
        self.__dict__.setdefault("specplay_overrides", {})[request.req_id] = overrides
        return add(self, request)

    def remove_request(self, req_id):
        self.__dict__.get("specplay_overrides", {}).pop(req_id, None)
        return remove(self, req_id)

    def _make_sampling_metadata(self):
        metadata = make(self)
        known = self.__dict__.get("specplay_overrides", {})
        metadata.specplay_overrides = [known.get(req_id, {}) for req_id in self.req_ids[:self.num_reqs]]
        return metadata

    InputBatch.add_request, InputBatch.remove_request = add_request, remove_request
    InputBatch._make_sampling_metadata = _make_sampling_metadata
    InputBatch.specplay_tracked = True


def _validate_request_rules() -> None:
    """Refuse bad `specplay_*` extra_args where SamplingParams are built (HTTP 400 on the server)."""
    from vllm.sampling_params import SamplingParams

    from specplay_vllm import settings

    verify = SamplingParams._verify_extra_args
    if hasattr(verify, "specplay_original"):
        return

    def _verify_extra_args(self) -> None:
        verify(self)
        settings.for_request(settings.request_overrides(self.extra_args), settings.current())

    _verify_extra_args.specplay_original = verify
    SamplingParams._verify_extra_args = _verify_extra_args


def register() -> None:
    from vllm import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from specplay_vllm import fixes, settings

    settings.current()  # a bad SPECPLAY_VLLM_* value fails at start-up, not at the first step
    if current_platform.is_cpu():
        fixes.install_expand_fix()
    fixes.install_empty_top_k_guard()
    _validate_request_rules()
    _track_request_rules()
    if DRAFT_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(DRAFT_ARCHITECTURE, "specplay_vllm.draft_model:EagleSpecplayMistralForCausalLM")
    if not hasattr(rejection_sampler.rejection_sample, "specplay_original"):
        rejection_sampler.rejection_sample = _dispatcher(rejection_sampler.rejection_sample)
