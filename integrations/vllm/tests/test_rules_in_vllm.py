"""The plugin's rules inside a real vLLM engine, against the engine's own maths.

One vLLM engine with the exported draft (reduced head, K = 2) runs every job; one without
speculation gives the greedy reference. T = 0: every rule, set as the process default, must
reproduce vLLM's own greedy text. T > 0: one batch of samples of one prompt mixes four request
rules through `extra_args` (SpS as the default, TAS, Cactus δ = 1 and δ = 4). For each rule the
first two output tokens (the prefill's token, then the first token a speculative round emits) must
follow T(first) · induced(second | first), and vLLM's per-request count of first-round acceptances
must match the engine's exact acceptance probability at δ = 0, 1 and 4.

Why the pair and not the second token alone: conditioned on one first token, TAS's induced
distribution put 0.99984 on one token, so the chi-square's pooled tail expected 0.066 samples and a
single legitimate draw of the other accepted token read 13.3 against a 1e-4 critical of 16.2 (an
artefact of the tiny expectation; vLLM's T and D there match our rebuild to 5e-6). The joint
distribution over (first, second) uses every sample and spreads the tail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import K, draft_dir, encode, run_engine
from engine import divergence
from engine.acceptance import verify_on_support
from engine.models.embedded import embedded_target_dir
from engine.models.feature_draft import load_feature_draft
from engine.models.registry import DEFAULT_DRAFT_FILE
from engine.prompts import held_out_prompts
from tests.stats import chi2_critical, chi2_statistic

RULES = ("sps", "tas", "cactus")
# The rules one sampling batch mixes, as (rule, δ) -> the request's extra_args (None: the default, sps).
# In that batch the SpS rows run the engine's SpS; a second batch of default-only requests runs
# vLLM's own rejection sampler (group KERNEL_SPS).
KERNEL_SPS = ("sps-vllm", 0.0)
GROUPS = {("sps", 0.0): None, ("tas", 1.0): {"specplay_rule": "tas"},
          ("cactus", 1.0): {"specplay_rule": "cactus", "specplay_delta": 1.0},
          ("cactus", 4.0): {"specplay_rule": "cactus", "specplay_delta": 4.0}}
# The reported sampling without top-p: vLLM's top-p sorts the whole vocabulary of every row, which
# on 2 cores would dominate the test's time; top-k alone takes vLLM's fast path.
SAMPLING = {"temperature": 0.6, "top_p": 1.0, "top_k": 20}
SAMPLES = 400  # per rule
GREEDY_TOKENS = 32
PROBE_TEXT = "The sea is"  # raw text, no chat template: a 3-token prefill per sample


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
    # max_tokens = K + 1 so vLLM never shortens the drafts of the one speculative round we read.
    jobs += [{"name": "sample", "prompts": [probe], "repeat": SAMPLES * len(GROUPS), "rule": "sps", "seed": 1000,
              "extra_args": list(GROUPS.values()), "max_tokens": K + 1, "ignore_eos": True, **SAMPLING},
             {"name": "sample-sps-vllm", "prompts": [probe], "repeat": SAMPLES, "rule": "sps", "seed": 2000,
              "max_tokens": K + 1, "ignore_eos": True, **SAMPLING}]
    results = run_engine(jobs, tmp_path_factory.mktemp("spec"), draft_dir("reduced"))
    return {r["name"]: r for r in results}


@pytest.fixture(scope="module")
def samples(spec_results) -> dict[tuple[str, float], dict]:
    """Each group's requests: from the mixed batch (request i has group i mod len(GROUPS)), and KERNEL_SPS."""
    result = spec_results["sample"]
    out = {group: {"tokens": result["tokens"][i::len(GROUPS)], "rounds": result["accepted_per_round"][i::len(GROUPS)]}
           for i, group in enumerate(GROUPS)}
    kernel = spec_results["sample-sps-vllm"]
    return out | {KERNEL_SPS: {"tokens": kernel["tokens"], "rounds": kernel["accepted_per_round"]}}


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


@pytest.fixture(scope="module")
def contexts(models, probe) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """T of the prefill's token, and (T, D) of the round after each first token T allows."""
    first_probs, _ = round_distributions(models, probe)
    firsts = torch.nonzero(first_probs > 0).squeeze(-1).tolist()
    return first_probs, {f: round_distributions(models, probe + [f]) for f in firsts}


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


@pytest.mark.parametrize("group", [KERNEL_SPS, *GROUPS], ids=lambda g: f"{g[0]}-{g[1]:g}")
def test_first_two_tokens_follow_target_then_induced_distribution(group, samples, contexts):
    """(first, second) against T(first) · induced(second | first), the rule's own for each request."""
    rule, delta = ("sps", 0.0) if group == KERNEL_SPS else group
    first_probs, rounds = contexts
    firsts = sorted(rounds)
    vocab = first_probs.numel()
    settings = divergence.RuleSettings(rule, delta)
    # engine.divergence's induced distribution: exact, and held to engine.acceptance's literal
    # O(|supp D|·V) formula by tests/test_divergence.py; the literal one costs ~30 s per first token here.
    joint = torch.cat([first_probs[f].double() * torch.from_numpy(
        divergence.induced_distribution(settings, rounds[f][0].numpy(), rounds[f][1].numpy())) for f in firsts])
    tokens = samples[group]["tokens"]
    assert all(t[0] in rounds for t in tokens), "a first token outside the target's top-k"
    pairs = torch.tensor([firsts.index(t[0]) * vocab + t[1] for t in tokens])
    assert bool((joint[pairs] > 0).all()), "a second token the rule cannot emit after its first token"
    stat, dof = chi2_statistic(pairs, joint)
    print(f"{group[0]} δ={delta:g}: chi2 {stat:.1f}, {dof} dof, critical {chi2_critical(max(dof, 1)):.1f}, "
          f"{pairs.numel()} samples")
    assert stat < chi2_critical(max(dof, 1)), f"{group[0]} δ={delta:g}: chi2 {stat:.1f} with {dof} dof"


def test_acceptance_rises_with_delta_as_in_the_engine(spec_results, samples, contexts):
    """vLLM's per-request first-round acceptance (SpS is Cactus at δ = 0) against the exact value."""
    _, by_first = contexts
    measured, expected = {}, {}
    for (rule, delta), group in samples.items():
        if rule not in ("sps", "cactus"):  # TAS has no δ; the kernel's SpS is checked by the chi-square
            continue
        drafted = [(t[0], per_round[0]) for t, per_round in zip(group["tokens"], group["rounds"]) if per_round]
        measured[delta] = sum(a > 0 for _, a in drafted) / len(drafted)
        expected[delta] = sum(first_acceptance_probability(*by_first[f], delta) for f, _ in drafted) / len(drafted)
        sd = math.sqrt(expected[delta] * (1 - expected[delta]) / len(drafted))
        assert abs(measured[delta] - expected[delta]) < 4 * sd + 0.01, (delta, measured[delta], expected[delta])
    print("first-position acceptance, vLLM vs engine:", {d: (round(measured[d], 3), round(expected[d], 3))
                                                         for d in measured})
    deltas = sorted(measured)
    assert all(expected[a] < expected[b] for a, b in zip(deltas, deltas[1:])), expected
    assert all(measured[a] < measured[b] for a, b in zip(deltas, deltas[1:])), measured
    # The per-request counts are vLLM's own counters, split by request.
    counters = spec_results["sample"]["counters"]
    per_request = spec_results["sample"]["accepted_per_round"]
    assert (sum(map(len, per_request)), sum(map(sum, per_request))) == (counters["num_drafts"],
                                                                       counters["num_accepted_tokens"])
