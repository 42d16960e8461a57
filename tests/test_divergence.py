"""The one divergence the page reports: `engine.divergence` against the literal formula.

`engine.acceptance.induced_distribution` writes P(v) = D(v)·a(v) + Σ_n D(n)(1 − a(n))·g_n(v) out
term by term (and is itself held to the sampler's frequencies in test_acceptance.py); the fast
O(V log V) form must agree with it, on hand-made distributions and on the default pair's own
full-vocabulary rows, with and without truncation.
"""

import math

import numpy as np
import pytest
import torch

from engine.acceptance import induced_distribution, kl_divergence
from engine.config import SpecConfig
from engine.decoding import generate
from engine.divergence import PositionDivergence, RuleSettings, kl, position_divergence, sparse_position_divergences
from engine.divergence import induced_distribution as fast_induced
from engine.events import TokenEvent
from engine.sampling import SamplingParams, logits_to_probs

RULES = [RuleSettings("sps"), RuleSettings("tas"), RuleSettings("tas", posterior_threshold=0.3),
         RuleSettings("cactus", delta=0.0), RuleSettings("cactus", delta=0.1), RuleSettings("cactus", delta=1.0),
         RuleSettings("cactus", delta=4.0)]


def reference(rule: RuleSettings, target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    return induced_distribution(rule.method, target, draft, delta=rule.delta,
                                posterior_threshold=rule.posterior_threshold, posterior_alpha=rule.posterior_alpha)


def random_pair(gen: torch.Generator, vocab: int, truncate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for _ in range(2):
        p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 3.0, -1)
        if truncate:
            p[torch.rand(vocab, generator=gen) < 0.6] = 0.0
            p[int(torch.randint(vocab, (1,), generator=gen))] += 1e-3  # never empty
            p = p / p.sum()
        rows.append(p)
    return rows[0], rows[1]


@pytest.mark.parametrize("truncate", [False, True])
def test_fast_induced_distribution_equals_the_literal_sum(truncate):
    gen = torch.Generator().manual_seed(3 + truncate)
    for _ in range(40):
        target, draft = random_pair(gen, int(torch.randint(2, 200, (1,), generator=gen)), truncate)
        for rule in RULES:
            fast = fast_induced(rule, target.numpy(), draft.numpy())
            ref = reference(rule, target, draft).numpy()
            assert np.abs(fast - ref).max() < 1e-12, rule
            assert fast.sum() == pytest.approx(1.0, abs=1e-12)


def test_the_native_sparse_divergences_equal_the_numpy_ones_on_the_union():
    """`sparse_position_divergences` (one native call for a round's tested positions, what the page's
    live chart reads) against `position_divergence` on each position's union of supports: rows of
    random widths whose ids overlap in part or not at all, some probabilities cut to 0 by top-p, and
    drafts with mass outside the target's support (KL(D || T) = inf)."""
    if sparse_position_divergences(RULES[0], (np.zeros((1, 1), np.int64), np.ones((1, 1))),
                                   (np.zeros((1, 1), np.int64), np.ones((1, 1)))) is None:
        pytest.skip("the native kernels did not build")
    rng = np.random.default_rng(5)
    checked = infinite = 0
    for _ in range(60):
        positions, t_w, d_w, vocab = rng.integers(1, 5), rng.integers(1, 30), rng.integers(1, 30), rng.integers(30, 90)
        t_ids = np.stack([rng.choice(vocab, t_w, replace=False) for _ in range(positions)])
        d_ids = np.stack([rng.choice(vocab, d_w, replace=False) for _ in range(positions)])
        t_probs, d_probs = rng.dirichlet(np.ones(t_w) * 0.5, positions), rng.dirichlet(np.ones(d_w) * 0.5, positions)
        t_probs[:, 1:][rng.random((positions, t_w - 1)) < 0.2] = 0.0  # top-p's zeros, never the whole row
        for rule in RULES:
            native = sparse_position_divergences(rule, (t_ids, t_probs), (d_ids, d_probs))
            for pos in range(positions):
                support = np.union1d(t_ids[pos], d_ids[pos])
                target, draft = np.zeros(support.size), np.zeros(support.size)
                target[np.searchsorted(support, t_ids[pos])] = t_probs[pos]
                draft[np.searchsorted(support, d_ids[pos])] = d_probs[pos]
                expected = position_divergence(rule, target, draft)
                for got, want in ((native[pos].induced_kl, expected.induced_kl),
                                  (native[pos].draft_kl, expected.draft_kl)):
                    assert got == pytest.approx(want, rel=1e-9, abs=1e-12) if math.isfinite(want) else got == want
                infinite += math.isinf(expected.draft_kl)
                checked += 1
    assert checked > 900 and infinite > 100, (checked, infinite)


def test_kl_is_infinite_outside_the_support_and_zero_on_itself():
    t = np.array([0.5, 0.5, 0.0])
    assert kl(t, t) == 0.0
    assert kl(np.array([0.4, 0.4, 0.2]), t) == math.inf
    assert kl(t, np.array([0.25, 0.25, 0.5])) == pytest.approx(math.log(2))


def test_cactus_never_exceeds_the_draft_alone_and_grows_with_delta():
    """Theorem 3's ceiling D_f(D‖T) and its monotone Γ(δ), on the exact measure."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(20):
        target, draft = random_pair(gen, 64, truncate=False)
        kls = [position_divergence(RuleSettings("cactus", delta=d), target.numpy(), draft.numpy()).induced_kl
               for d in (0.0, 0.25, 1.0, 4.0, 100.0)]
        assert kls[0] == pytest.approx(0.0, abs=1e-12)
        assert all(a <= b + 1e-12 for a, b in zip(kls, kls[1:]))
        assert kls[-1] <= kl(draft.numpy(), target.numpy()) + 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
                                      SamplingParams(temperature=1.0, top_k=0, top_p=1.0)],
                         ids=["truncated", "full-vocabulary"])
def test_exact_measure_matches_the_reference_on_the_default_pairs_rows(default_pair, sampling):
    """Real T and D rows of the default pair (49,152 tokens), as the engine samples them."""
    target_lm, drafter = default_pair.make_target(), default_pair.make_drafter()
    ids = default_pair.encode_prompt("Write a list of twenty random, unrelated words.")
    target_lm.reset()
    target_lm.keep_hidden = drafter.needs_target_features
    target = logits_to_probs(target_lm.forward(ids)[-1:], sampling)[0].double()
    drafter.start()
    if drafter.needs_target_features:
        drafter.observe_target(0, target_lm.last_hidden)
    draft = drafter.propose(ids, 1, sampling, torch.rand(1, generator=torch.Generator().manual_seed(0))).probs[0]
    target, draft = target / target.sum(), draft.double() / draft.double().sum()  # as position_divergence does
    assert target.numel() == default_pair.vocab_size
    rules = [RuleSettings("sps"), RuleSettings("tas"), RuleSettings("cactus", delta=1.0)]
    for rule in rules:
        exact = position_divergence(rule, target.numpy(), draft.numpy())
        ref = reference(rule, target, draft)
        assert exact.induced_kl == pytest.approx(kl_divergence(ref, target), abs=1e-9), rule
        assert np.abs(fast_induced(rule, target.numpy(), draft.numpy()) - ref.numpy()).max() < 1e-12, rule
    if sampling.top_k == 0:
        assert (target > 0).all()  # nothing truncated: the whole vocabulary counts


def test_token_events_carry_the_measure_at_every_tested_position(tiny_pair):
    """The decoding loop's divergence is `position_divergence` of the round's own rows (checked
    through the inspector rows, which cover the tiny pair's whole vocabulary)."""
    cfg = SpecConfig(method="cactus", num_speculative_tokens=3, delta=0.7, temperature=1.0, top_p=1.0, top_k=0,
                     max_new_tokens=24, seed=2, inspect_top_n=tiny_pair.vocab_size)
    tokens = [e for e in generate(tiny_pair.make_target(), tiny_pair.make_drafter(), tiny_pair.tokenizer,
                                  tiny_pair.encode_prompt("hello"), cfg) if isinstance(e, TokenEvent)]
    tested = [t for t in tokens if t.draft_prob is not None]
    assert tested and all(t.divergence is None for t in tokens if t.draft_prob is None)
    rule = RuleSettings("cactus", delta=0.7)
    for t in tested:
        rows = sorted(t.candidates, key=lambda c: c.token_id)
        assert len(rows) == tiny_pair.vocab_size
        target = np.array([c.target_prob for c in rows])
        draft = np.array([c.draft_prob for c in rows])
        expected = position_divergence(rule, target, draft)
        assert isinstance(t.divergence, PositionDivergence)
        assert t.divergence.induced_kl == pytest.approx(expected.induced_kl, abs=1e-9)
        assert t.divergence.draft_kl == pytest.approx(expected.draft_kl, abs=1e-9)
