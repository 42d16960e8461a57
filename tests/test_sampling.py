import pytest
import torch

from engine.sampling import SamplingParams, entropy, logits_to_probs, sample_from
from tests.stats import matches


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_and_top_p_keep_the_expected_sets():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    top_k = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top_k, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    # top-p 0.65: 0.4 < 0.65, 0.4 + 0.3 >= 0.65 → keep the first two tokens
    top_p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.65))
    assert torch.allclose(top_p, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    # top-p applies to the renormalised top-k survivors [4/9, 3/9, 2/9]: 4/9 >= 0.4 keeps one
    both = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.4))
    assert torch.allclose(both, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0])
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert cold[0] > hot[0] > 0.5


def test_inverse_cdf_sampling_matches_probs_and_skips_zero_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(0)
    samples = sample_from(probs.expand(100_000, -1), torch.rand(100_000, generator=gen))
    assert matches(samples, probs)
    edge = sample_from(probs.expand(2, -1), torch.tensor([0.0, 1.0]))
    assert edge.tolist() == [1, 4]


def test_entropy_in_nats():
    assert torch.isclose(entropy(torch.full((4,), 0.25)), torch.log(torch.tensor(4.0)))


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
