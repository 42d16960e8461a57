"""The fused native round (cpu_kernels.c `verify_logits`: sampling transform + rule on the kept
support) against the torch references it replaces (`torch_sparse_probs` + `verify_on_support`).

The same draws must give the same tokens: over randomized rounds (every rule, K = 0..3, four
sampling settings, dense and sparse drafts) the kept count, the next token and the per-position
test agree, and the per-position statistics agree to float32 rounding.
"""

import pytest
import torch

from engine.acceptance import RandomDraws, verify_logits, verify_on_support
from engine.drafters import Proposal
from engine.sampling import SamplingParams, dense_probs, native_width, sample_from, torch_sparse_probs

VOCAB = 4096
SETTINGS = [SamplingParams(0.6, 20, 0.95), SamplingParams(1.0, 20, 1.0), SamplingParams(0.0),
            SamplingParams(0.8, 50, 0.9)]


def _native_available() -> bool:
    return native_width(SETTINGS[0], torch.zeros(1, VOCAB)) is not None


@pytest.mark.skipif(not _native_available(), reason="native sampling kernels not built on this machine")
@pytest.mark.parametrize("method", ["sps", "tas", "cactus"])
def test_native_round_gives_the_reference_tokens_and_statistics(method):
    generator = torch.Generator().manual_seed(7)
    rounds = 0
    for trial in range(240):
        k = trial % 4
        params = SETTINGS[trial % len(SETTINGS)]
        scale = (1.0, 3.0, 6.0)[trial % 3]
        logits = torch.randn(k + 1, VOCAB, generator=generator) * scale
        draft_logits = logits[:k] + torch.randn(k, VOCAB, generator=generator) * 2
        draft_ids, draft_support_probs = torch_sparse_probs(draft_logits, params)
        draft = dense_probs(draft_ids, draft_support_probs, VOCAB)
        tokens = sample_from(draft, torch.rand(k, generator=generator)).tolist() if k else []
        draws = RandomDraws.draw(1, k, generator)

        ids, probs = torch_sparse_probs(logits, params)
        target = dense_probs(ids, probs, VOCAB)
        reference = verify_on_support(method, target.unsqueeze(0), draft.unsqueeze(0), torch.tensor([tokens], dtype=torch.long),
                                      ids, draws=draws, delta=0.7)
        proposals = [Proposal(tokens, draft)]
        if draft_ids is not None:
            proposals.append(Proposal(tokens, support=(draft_ids, draft_support_probs), vocab_size=VOCAB))
        for proposal in proposals:
            _, verdict = verify_logits(method, logits, params, proposal, draws, delta=0.7)
            rounds += 1
            assert verdict.accepted_count == int(reference.num_accepted[0]), (trial, k)
            assert verdict.next_token == int(reference.next_tokens[0]), (trial, k)
            assert verdict.passed == reference.accepted[0].tolist(), (trial, k)
            for name, values in zip(("target_token_probs", "draft_token_probs", "gamma", "acceptance_probs"),
                                    (verdict.target_token_probs, verdict.draft_token_probs, verdict.gamma_values,
                                     verdict.acceptance_probs_values)):
                expected = getattr(reference, name)[0].tolist()
                assert values == pytest.approx(expected, abs=1e-5), (name, trial, k)
    assert rounds > 240
