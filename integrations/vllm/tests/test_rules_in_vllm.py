"""The plugin's rules inside a real vLLM engine, against the engine's own maths.

One vLLM engine with the exported draft (reduced head, K = 2) runs every job; one without
speculation gives the greedy reference. T = 0: every rule must reproduce vLLM's own greedy text.
T > 0: the first token a speculative round emits (output token 2, conditioned on the most frequent
first token, which the prefill samples) must follow `engine.acceptance.induced_distribution`, and
vLLM's acceptance counter must match the engine's exact acceptance probability at each Cactus δ.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from conftest import K, draft_dir, encode, run_engine
from engine.acceptance import induced_distribution, verify_on_support
from engine.models.embedded import embedded_target_dir
from engine.models.feature_draft import load_feature_draft
from engine.models.registry import DEFAULT_DRAFT_FILE
from engine.prompts import held_out_prompts
from tests.stats import chi2_critical, chi2_statistic

RULES = ("sps", "tas", "cactus")
SWEEP = {0.0: "sample-sps", 1.0: "sample-cactus", 4.0: "sweep-4.0"}  # Cactus with δ = 0 is SpS
# The reported sampling without top-p: vLLM's top-p sorts the whole vocabulary of every row, which
# on 2 cores would dominate the test's time; top-k alone takes vLLM's fast path.
SAMPLING = {"temperature": 0.6, "top_p": 1.0, "top_k": 20}
SAMPLES = 500
GREEDY_TOKENS = 32
PROBE_TEXT = "The sea is"  # raw text, no chat template: a 3-token prefill per sample


def _sample_job(name: str, prompt: list[int], rule: str, delta: float = 1.0) -> dict:
    # max_tokens = K + 1 so vLLM never shortens the drafts of the one speculative round we read.
    return {"name": name, "prompts": [prompt], "repeat": SAMPLES, "rule": rule, "delta": delta, "seed": 1000,
            "max_tokens": K + 1, "ignore_eos": True, **SAMPLING}


@pytest.fixture(scope="module")
def probe(tokenizer) -> list[int]:
    return list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def greedy_prompts(tokenizer) -> list[list[int]]:
    return [encode(tokenizer, p) for p in held_out_prompts(2)]


@pytest.fixture(scope="module")
def spec_results(tmp_path_factory, probe, greedy_prompts) -> dict[str, dict]:
    jobs = [{"name": f"greedy-{r}", "prompts": greedy_prompts, "rule": r, "temperature": 0.0, "max_tokens": GREEDY_TOKENS}
            for r in RULES]
    jobs += [_sample_job(f"sample-{r}", probe, r) for r in RULES]
    jobs += [_sample_job("sweep-4.0", probe, "cactus", 4.0)]
    results = run_engine(jobs, tmp_path_factory.mktemp("spec"), draft_dir("reduced"))
    return {r["name"]: r for r in results}


@pytest.fixture(scope="module")
def ar_results(tmp_path_factory, greedy_prompts) -> dict:
    job = {"name": "greedy-ar", "prompts": greedy_prompts, "temperature": 0.0, "max_tokens": GREEDY_TOKENS}
    return run_engine([job], tmp_path_factory.mktemp("ar"), None)[0]


@pytest.fixture(scope="module")
def models():
    """Our target and draft in float32, as the engine loads them (transformers, no vLLM)."""
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(embedded_target_dir(), dtype=torch.float32).eval()
    return target, load_feature_draft(DEFAULT_DRAFT_FILE, target)


@torch.inference_mode()
def round_distributions(models, context: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, D) [V] of the token after `context`, as vLLM's round sees them.

    T: the target's logits with vLLM's own temperature / top-k / top-p (the rule's input).
    D: our draft over the features of `context` (f_{j-1} with t_j at every position, the EAGLE
    recurrence), temperature only (vLLM's probabilistic drafting), zero outside the reduced head.
    """
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    target, draft = models
    ids = torch.tensor([context])
    features = target.model(ids).last_hidden_state
    logits = target.lm_head(features[:, -1]) / SAMPLING["temperature"]
    logits = apply_top_k_top_p(logits, torch.tensor([SAMPLING["top_k"]]), torch.tensor([SAMPLING["top_p"]]))
    target_probs = logits.softmax(-1)[0]
    predicted = draft.features(ids[:, 1:], features[:, :-1])[0, -1]
    draft_logits = torch.full_like(target_probs, float("-inf"))
    draft_logits[draft.vocab_ids] = F.linear(predicted, draft.head_weight[draft.vocab_ids])
    return target_probs, (draft_logits / SAMPLING["temperature"]).softmax(-1)


def first_acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor, delta: float) -> float:
    """P(the first drafted token is accepted) = Σ_x D(x) a(x), a from the engine's Cactus rule.

    Only x in supp(T) can be accepted (γ = 0 elsewhere), so a batch of those candidates suffices.
    """
    candidates = torch.nonzero(target_probs > 0).squeeze(-1)
    n = candidates.numel()
    t = target_probs.expand(n, 2, -1)
    d = draft_probs.expand(n, 1, -1)
    accept = verify_on_support("cactus", t, d, candidates[:, None], candidates, delta=delta).acceptance_probs[:, 0]
    return float((draft_probs[candidates] * accept).sum())


@pytest.mark.parametrize("rule", RULES)
def test_greedy_equals_vllm_without_speculation(rule, spec_results, ar_results):
    assert spec_results[f"greedy-{rule}"]["tokens"] == ar_results["tokens"]
    counters = spec_results[f"greedy-{rule}"]["counters"]
    assert counters["num_accepted_tokens"] > 0  # the draft really drafted and was verified by the rule


@pytest.mark.parametrize("rule", RULES)
def test_first_round_token_follows_induced_distribution(rule, spec_results, probe, models):
    tokens = spec_results[f"sample-{rule}"]["tokens"]
    first = Counter(t[0] for t in tokens).most_common(1)[0][0]
    seconds = torch.tensor([t[1] for t in tokens if t[0] == first])
    assert seconds.numel() > SAMPLES // 5
    target_probs, draft_probs = round_distributions(models, probe + [first])
    induced = induced_distribution(rule, target_probs, draft_probs, delta=1.0)
    stat, dof = chi2_statistic(seconds, induced)
    print(f"{rule}: chi2 {stat:.1f}, {dof} dof, critical {chi2_critical(max(dof, 1)):.1f}, {seconds.numel()} samples")
    assert stat < chi2_critical(max(dof, 1)), f"{rule}: chi2 {stat:.1f} with {dof} dof over {seconds.numel()} samples"


def test_acceptance_rises_with_delta_as_in_the_engine(spec_results, probe, models):
    measured, expected = {}, {}
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for delta, name in SWEEP.items():
        result = spec_results[name]
        counters = result["counters"]
        measured[delta] = counters["num_accepted_tokens_per_pos"][0] / counters["num_drafts"]
        firsts = Counter(t[0] for t in result["tokens"])
        total = sum(firsts.values())
        expected[delta] = 0.0
        for first, count in firsts.items():
            if first not in cache:
                cache[first] = round_distributions(models, probe + [first])
            expected[delta] += count / total * first_acceptance_probability(*cache[first], delta)
        sd = math.sqrt(expected[delta] * (1 - expected[delta]) / counters["num_drafts"])
        assert abs(measured[delta] - expected[delta]) < 4 * sd + 0.01, (delta, measured[delta], expected[delta])
    print("first-position acceptance, vLLM counter vs engine:", {d: (round(measured[d], 3), round(expected[d], 3))
                                                                   for d in measured})
    deltas = sorted(measured)
    assert all(expected[a] < expected[b] for a, b in zip(deltas, deltas[1:])), expected
    assert all(measured[a] < measured[b] for a, b in zip(deltas, deltas[1:])), measured
