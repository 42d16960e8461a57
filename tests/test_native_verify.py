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


@pytest.mark.skipif(not _native_available(), reason="native sampling kernels not built on this machine")
def test_every_round_keeps_its_own_rows_across_output_blocks():
    """One NativeRule writes a generation's rounds into shared output blocks (`TargetRows`): read
    after 300 rounds of K = 0..3 (more rows than a block holds), each round's rows are still the
    sampling transform of its own logits."""
    from engine.acceptance import NativeRule
    from engine.support_rows import BLOCK_ROWS

    generator = torch.Generator().manual_seed(11)
    params = SETTINGS[0]
    rule = NativeRule.for_settings("sps", params, VOCAB)
    kept = []
    for trial in range(300):
        k = trial % 4
        logits = torch.randn(k + 1, VOCAB, generator=generator) * 3
        draft = torch.softmax(torch.randn(k, VOCAB, generator=generator), dim=-1)
        tokens = sample_from(draft, torch.rand(k, generator=generator)).tolist() if k else []
        rule.prepare(Proposal(tokens, draft), RandomDraws.draw(1, k, generator))
        rule.run(logits)
        rows, _ = rule.verdict()
        kept.append((logits, rows))
    assert sum(logits.shape[0] for logits, _ in kept) > 2 * BLOCK_ROWS
    for trial, (logits, rows) in enumerate(kept):
        ids, probs = rows.tensors()
        expected_ids, expected_probs = torch_sparse_probs(logits, params)
        assert torch.equal(ids, expected_ids), trial
        torch.testing.assert_close(probs, expected_probs, rtol=0, atol=1e-6)


@pytest.mark.skipif(not _native_available(), reason="native sampling kernels not built on this machine")
@pytest.mark.parametrize("levels", [None, 40, 3])
def test_native_top_k_of_a_full_vocabulary_row_is_the_stable_one(levels):
    """Over the default pair's vocabulary size (cpu_kernels.c top_k_row, which skips blocks of 64 at
    once): the kept ids are the k largest logits, equal values in ascending id (a stable descending
    sort), also where most values tie."""
    from engine.sampling import native_support

    generator = torch.Generator().manual_seed(5)
    vocab = 49152
    logits = torch.randn(4, vocab, generator=generator) * 3
    if levels is not None:
        logits = torch.randint(levels, (4, vocab), generator=generator).float()
    for top_k in (1, 20, 64):
        ids, _ = native_support(logits, SamplingParams(0.7, top_k, 1.0))
        expected = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
        assert torch.equal(ids, expected), (levels, top_k)


@pytest.fixture(scope="module")
def tiny():
    from engine.models import load_pair

    return load_pair("tiny")


@pytest.mark.skipif(not _native_available(), reason="native sampling kernels not built on this machine")
@pytest.mark.parametrize("method", ["sps", "tas", "cactus"])
@pytest.mark.parametrize("tied_columns", [False, True])
def test_the_rule_inside_the_forward_call_gives_what_the_forward_then_the_rule_give(tiny, method, tied_columns):
    """`CausalLM.forward_with_rule` (cpu_kernels.c target_forward running verify_logits on the rows it
    wrote) against a plain forward and the rule's own call, on two copies of the tiny target fed the
    same rounds: the same logits, support rows and verdict, bit for bit, and the forward booked alike.
    `tied_columns`: the head's second half repeats its first, so the kept rows hold equal logits far
    apart (in different threads' columns of the head) and their order is compared too."""
    import copy

    from engine.acceptance import NativeRule
    from engine.models.fast_llama import FastLlamaCausalLM

    model = tiny.target_model
    half = tiny.vocab_size // 2
    if tied_columns:
        model = copy.deepcopy(model)
        with torch.no_grad():
            model.lm_head.weight[half: 2 * half] = model.lm_head.weight[:half]
    fused, plain = (FastLlamaCausalLM(model, "fast", tiny.vocab_size, weight_dtype="q4_1_a16") for _ in range(2))
    fused.keep_hidden = plain.keep_hidden = True  # (without, the fused call leaves last_hidden None)
    ties = 0
    if fused._step is None:
        pytest.skip("the native kernels did not build")
    vocab = tiny.vocab_size
    generator = torch.Generator().manual_seed(3)
    prompt = tiny.encode_prompt("Tell me about the sea.")
    for lm in (fused, plain):
        lm.forward(prompt)
    for trial in range(24):
        k, params = trial % 4, SETTINGS[trial % len(SETTINGS)]
        draft_ids, draft_support = torch_sparse_probs(torch.randn(k, vocab, generator=generator) * 3, params)
        draft = dense_probs(draft_ids, draft_support, vocab)
        tokens = sample_from(draft, torch.rand(k, generator=generator)).tolist() if k else []
        proposal = (Proposal(tokens, support=(draft_ids, draft_support), vocab_size=vocab)
                    if draft_ids is not None and trial % 2 else Proposal(tokens, draft))
        draws = RandomDraws.draw(1, k, generator)
        feed = [int(torch.randint(vocab, (1,), generator=generator))] + tokens
        rule, reference_rule = (NativeRule.for_settings(method, params, vocab, 0.7) for _ in range(2))
        rule.prepare(proposal, draws)
        logits = fused.forward_with_rule(feed, rule)
        rows, verdict = rule.verdict()
        ids, probs = rows.tensors()
        expected_logits = plain.forward(feed, last_n=len(feed))
        reference_rule.prepare(proposal, draws)
        reference_rule.run(expected_logits)
        expected_rows, expected = reference_rule.verdict()
        expected_ids, expected_probs = expected_rows.tensors()
        assert torch.equal(logits, expected_logits) and torch.equal(fused.last_hidden, plain.last_hidden), trial
        assert torch.equal(ids, expected_ids) and torch.equal(probs, expected_probs), trial
        assert vars(verdict) | {"draws": None} == vars(expected) | {"draws": None}, trial
        assert rule.seconds > 0.0
        for row_ids, row_probs in zip(expected_ids.tolist(), expected_probs.tolist()):  # equal logits kept
            kept = dict(zip(row_ids, row_probs))
            ties += sum(kept.get(t + half) == p > 0 for t, p in kept.items())
        keep = len(prompt) + trial + 1  # keep one more token each round, as a round would
        fused.rollback(keep)
        plain.rollback(keep)
    assert fused.length == plain.length and fused.num_forwards == plain.num_forwards
    assert (ties > 10) == tied_columns


@pytest.mark.skipif(not _native_available(), reason="native sampling kernels not built on this machine")
def test_a_generation_is_the_same_with_the_rule_inside_the_forward_call(tiny, monkeypatch):
    """The decoding loop on the tiny pair, sampled (top-k 20, so the native rule applies), with the
    rule inside the verify forward and with it called after: the same tokens and round outcomes."""
    from engine.config import SpecConfig
    from engine.decoding import generate
    from engine.events import RoundEvent
    from engine.models.fast_llama import FastLlamaCausalLM

    target, drafter = tiny.make_target(), tiny.make_drafter()
    if not isinstance(target, FastLlamaCausalLM) or target._step is None:
        pytest.skip("the fast backend's native forward is not available")
    prompt = tiny.encode_prompt("Tell me about the sea.")

    def run(method: str) -> list:
        cfg = SpecConfig(method=method, num_speculative_tokens=2, temperature=0.8, top_k=20, top_p=0.9,
                         max_new_tokens=24, seed=5)
        return [(e.num_accepted, e.draft_token_ids, e.accepted_positions) if isinstance(e, RoundEvent) else e.token_ids
                for e in generate(target, drafter, tiny.tokenizer, prompt, cfg)
                if isinstance(e, RoundEvent) or hasattr(e, "token_ids")]

    fused = {method: run(method) for method in ("ar", "sps", "cactus")}
    calls = []
    monkeypatch.setattr(FastLlamaCausalLM, "forward_with_rule", lambda self, tokens, rule: calls.append(1))
    assert {method: run(method) for method in ("ar", "sps", "cactus")} == fused
    assert calls  # the second runs did take the plain path
