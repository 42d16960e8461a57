"""The rules of ALGORITHMS.md §1–3, checked exactly or statistically on synthetic distributions."""

import math

import pytest
import torch

from engine.acceptance import (RandomDraws, binary_kl, cactus_gamma, induced_distribution, kl_divergence,
                               tas_threshold, verify, verify_on_support)
from tests.stats import matches

V = 12


def random_dists(gen: torch.Generator, rows: int, vocab: int = V, sharp: float = 2.0) -> torch.Tensor:
    return torch.softmax(sharp * torch.randn(rows, vocab, generator=gen), dim=-1)


def draft_round(n: int, k: int, seed: int = 0):
    """n identical rounds: fixed T_1..T_{K+1}, D_1..D_K; drafted tokens sampled from D."""
    gen = torch.Generator().manual_seed(seed)
    target = random_dists(gen, k + 1)
    draft = random_dists(gen, k)
    tokens = torch.stack([torch.multinomial(draft[i], n, replacement=True, generator=gen) for i in range(k)], dim=1)
    return target, draft, tokens, gen


def emitted(result, tokens: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token emitted at 0-based `position` of the round, for rows that reached it."""
    reached = result.num_accepted >= position
    k = tokens.shape[1]
    from_draft = result.num_accepted > position
    token = torch.where(from_draft, tokens[:, min(position, k - 1)], result.next_tokens)
    return token[reached], reached


@pytest.mark.parametrize("k", [2, 3])
def test_sps_is_lossless_at_every_position(k):
    n = 200_000
    target, draft, tokens, gen = draft_round(n, k)
    result = verify("sps", target.expand(n, -1, -1), draft.expand(n, -1, -1), tokens, generator=gen)
    for pos in range(k + 1):  # the last position is the bonus token
        out, _ = emitted(result, tokens, pos)
        assert out.numel() > 1000
        assert matches(out, target[pos]), f"position {pos} deviates from the target"
    # Power check: the same statistic rejects the draft distribution.
    first, _ = emitted(result, tokens, 0)
    assert not matches(first, draft[0])


def test_sps_accepts_everything_when_draft_equals_target():
    n = 10_000
    target, _, _, gen = draft_round(n, 3)
    tokens = torch.stack([torch.multinomial(target[i], n, replacement=True, generator=gen) for i in range(3)], 1)
    result = verify("sps", target.expand(n, -1, -1), target[:3].expand(n, -1, -1), tokens, generator=gen)
    assert bool((result.num_accepted == 3).all())


def test_cactus_worked_example():
    """Cactus README: target 0.35, draft 0.8, δ ≈ 0.21 → γ ≈ 0.659, KL ≈ 0.197 nats, accept ≈ 0.82."""
    gamma = cactus_gamma(torch.tensor(0.35), 0.21)
    assert gamma.item() == pytest.approx(0.659, abs=1e-3)
    assert binary_kl(gamma, torch.tensor(0.35)).item() == pytest.approx(0.197, abs=1e-3)
    target = torch.tensor([[[0.35, 0.40, 0.25], [0.2, 0.3, 0.5]]])
    draft = torch.tensor([[[0.8, 0.1, 0.1]]])
    result = verify("cactus", target, draft, torch.tensor([[0]]), delta=0.21)
    assert result.gamma.item() == pytest.approx(0.659, abs=1e-3)
    assert result.kl.item() == pytest.approx(0.197, abs=1e-3)
    assert result.acceptance_probs.item() == pytest.approx(0.82, abs=0.01)
    sps = verify("sps", target, draft, torch.tensor([[0]]))
    assert sps.acceptance_probs.item() == pytest.approx(0.35 / 0.8)


@pytest.mark.parametrize("delta", [0.3, 1.0])
def test_cactus_frequencies_match_induced_distribution(delta):
    n = 200_000
    target, draft, tokens, gen = draft_round(n, 1, seed=3)
    result = verify("cactus", target.expand(n, -1, -1), draft.expand(n, -1, -1), tokens, generator=gen, delta=delta)
    induced = induced_distribution("cactus", target[0], draft[0], delta=delta)
    assert induced.sum().item() == pytest.approx(1.0, abs=1e-5)
    first, _ = emitted(result, tokens, 0)
    assert matches(first, induced)
    assert not matches(first, target[0])  # the rule really is lossy, and the test can tell


def test_cactus_divergence_grows_with_delta_and_vanishes_at_zero():
    gen = torch.Generator().manual_seed(7)
    target, draft = random_dists(gen, 2)
    kls = [kl_divergence(induced_distribution("cactus", target, draft, delta=d), target)
           for d in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0)]
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # float32 output
    assert all(b > a for a, b in zip(kls, kls[1:])), kls
    # Theorem 3: never more than KL of the draft itself.
    assert kls[-1] <= kl_divergence(draft, target) + 1e-6


def test_cactus_delta_zero_equals_sps_bit_for_bit():
    n = 5000
    target, draft, tokens, gen = draft_round(n, 4, seed=11)
    draws = RandomDraws.draw(n, 4, gen)
    args = (target.expand(n, -1, -1), draft.expand(n, -1, -1), tokens)
    sps = verify("sps", *args, draws=draws)
    cactus = verify("cactus", *args, draws=draws, delta=0.0)
    assert torch.equal(sps.num_accepted, cactus.num_accepted)
    assert torch.equal(sps.next_tokens, cactus.next_tokens)
    assert torch.equal(sps.acceptance_probs, cactus.acceptance_probs)
    assert bool((cactus.kl == 0).all())
    # and a positive δ accepts at least as often with the same draws
    loose = verify("cactus", *args, draws=draws, delta=0.5)
    assert bool((loose.num_accepted >= sps.num_accepted).all())
    assert loose.num_accepted.float().mean() > sps.num_accepted.float().mean()


@pytest.mark.parametrize("method", ["sps", "cactus", "tas"])
def test_verify_on_the_targets_support_equals_the_full_vocabulary(method):
    """Truncated targets (top-k) and full drafts on a wider vocabulary: restricting the rule to
    supp(T) ∪ drafted tokens gives the same tokens and statistics for the same draws."""
    from engine.sampling import SamplingParams, dense_probs, sparse_probs

    n, k, vocab = 4000, 3, 64
    gen = torch.Generator().manual_seed(3)
    support, kept = sparse_probs(2 * torch.randn(n, k + 1, vocab, generator=gen), SamplingParams(0.8, 6, 0.9))
    target = dense_probs(support, kept, vocab)
    draft = 0.6 * target[:, :k] + 0.4 * random_dists(gen, n * k, vocab).view(n, k, vocab)  # full support
    tokens = torch.multinomial(draft.view(-1, vocab), 1, generator=gen).view(n, k)
    draws = RandomDraws.draw(n, k, gen)
    full = verify(method, target, draft, tokens, draws=draws, delta=0.3)
    narrow = verify_on_support(method, target, draft, tokens, support, draws=draws, delta=0.3)
    assert full.num_accepted.float().mean() > 0.2 and torch.equal(full.num_accepted, narrow.num_accepted)
    assert torch.equal(full.next_tokens, narrow.next_tokens)
    for name in ("acceptance_probs", "kl", "target_entropy", "draft_token_probs"):
        assert torch.allclose(getattr(full, name), getattr(narrow, name), atol=1e-6), name


def test_sps_induced_distribution_is_the_target():
    gen = torch.Generator().manual_seed(5)
    target, draft = random_dists(gen, 2)
    assert torch.allclose(induced_distribution("sps", target, draft), target.double(), atol=1e-6)


def test_tas_rule_on_hand_made_distributions():
    # H(T) for [0.5, 0.3, 0.2] ≈ 1.03 nats → α e^{-H} ≈ 0.107 > ε = 0.09, so the threshold is 0.09.
    t1 = torch.tensor([0.5, 0.3, 0.2])
    assert tas_threshold(t1, 0.09, 0.3).item() == pytest.approx(0.09)
    # A flat-ish T over 3 tokens with a tiny tail token: the tail (0.05) fails, the others pass.
    t2 = torch.tensor([0.6, 0.35, 0.05])
    thr2 = tas_threshold(t2, 0.09, 0.3).item()
    assert 0.05 < thr2 < 0.35
    target = torch.stack([t1, t2, torch.tensor([0.1, 0.1, 0.8])]).unsqueeze(0)
    draft = torch.full((1, 2, 3), 1 / 3)
    # accept 1 (0.3 > 0.09), then reject 2 (0.05 < thr) → recovered = argmax T_2 = 0
    r = verify("tas", target, draft, torch.tensor([[1, 2]]))
    assert r.accepted.tolist() == [[True, False]]
    assert r.num_accepted.item() == 1 and r.next_tokens.item() == 0
    assert bool((r.kl == 0).all())  # TAS enforces no divergence constraint: there is none to report
    # Deterministic: the draft probabilities and random draws do not matter.
    r2 = verify("tas", target, torch.rand(1, 2, 3), torch.tensor([[1, 2]]), generator=torch.Generator().manual_seed(9))
    assert r2.num_accepted.item() == 1 and r2.next_tokens.item() == 0


def test_tas_bonus_is_sampled_from_the_target():
    n = 100_000
    target = torch.tensor([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]])
    tokens = torch.zeros(n, 1, dtype=torch.long)
    r = verify("tas", target.expand(n, -1, -1), torch.full((n, 1, 3), 1 / 3), tokens,
               generator=torch.Generator().manual_seed(1))
    assert bool((r.num_accepted == 1).all())
    assert matches(r.next_tokens, target[1])


def test_tas_frequencies_match_induced_distribution():
    n = 100_000
    target, draft, tokens, gen = draft_round(n, 1, seed=21)
    r = verify("tas", target.expand(n, -1, -1), draft.expand(n, -1, -1), tokens, generator=gen)
    first, _ = emitted(r, tokens, 0)
    assert matches(first, induced_distribution("tas", target[0], draft[0]))


def test_greedy_distributions_reduce_every_rule_to_argmax_matching():
    target = torch.zeros(1, 3, 5)
    target[0, 0, 2] = target[0, 1, 4] = target[0, 2, 1] = 1.0
    draft = torch.zeros(1, 2, 5)
    draft[0, 0, 2] = draft[0, 1, 3] = 1.0
    for method in ("sps", "tas", "cactus"):
        r = verify(method, target, draft, torch.tensor([[2, 3]]), delta=1.0)
        assert r.num_accepted.item() == 1, method
        assert r.next_tokens.item() == 4, method


def test_batched_rows_are_independent():
    target, draft, tokens, gen = draft_round(6, 3, seed=2)
    b_target, b_draft = target.expand(6, -1, -1), draft.expand(6, -1, -1)
    draws = RandomDraws.draw(6, 3, gen)
    batch = verify("cactus", b_target, b_draft, tokens, draws=draws, delta=0.4)
    for i in range(6):
        one = verify("cactus", target[None], draft[None], tokens[i:i + 1], delta=0.4,
                     draws=RandomDraws(draws.u_accept[i:i + 1], draws.u_sample[i:i + 1]))
        assert one.num_accepted.item() == batch.num_accepted[i].item()
        assert one.next_tokens.item() == batch.next_tokens[i].item()


@pytest.mark.parametrize("bad, match", [
    (dict(method="nope"), "unknown method"),
    (dict(delta=-0.1), "delta"),
    (dict(delta=float("nan")), "delta"),
    (dict(vocab_mismatch=True), "vocabularies must match"),
    (dict(posterior_threshold=0.0), "posterior"),
])
def test_bad_input_raises_value_error(bad, match):
    target, draft, tokens, _ = draft_round(2, 2)
    t, d = target.expand(2, -1, -1), draft.expand(2, -1, -1)
    if bad.pop("vocab_mismatch", False):
        d = torch.cat([d, torch.zeros(2, 2, 1)], dim=-1)
    method = bad.pop("method", "cactus")
    with pytest.raises(ValueError, match=match):
        verify(method, t, d, tokens, **bad)
