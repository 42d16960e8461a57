"""The fast Llama backend must compute what the transformers backend computes (float32 mode)."""

from __future__ import annotations

import pytest
import torch

from engine.models import HFCausalLM, load_pair
from engine.models.fast_llama import FastLlamaCausalLM, fast_backend_supported

ATOL = 1e-4  # tiny-model logits are O(10); float32 reordering differences are ~1e-5


@pytest.fixture(scope="module")
def tiny():
    return load_pair("tiny")


def _pair(pair, **kwargs):
    model = pair.target_model
    return HFCausalLM(model, "hf", pair.vocab_size), FastLlamaCausalLM(model, "fast", pair.vocab_size, **kwargs)


def _greedy(lm, prompt, steps):
    out = []
    logits = lm.forward(prompt)
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits = lm.forward([out[-1]])
    return out


def test_supported(tiny):
    assert fast_backend_supported(tiny.target_model)
    assert fast_backend_supported(tiny.draft_model)
    assert not fast_backend_supported(torch.nn.Linear(2, 2))


def test_logits_match_hf_prefill_decode_verify(tiny):
    hf, fast = _pair(tiny, max_length=8)  # small cache: also exercises growth
    prompt = tiny.encode_prompt("The quick brown fox jumps over the lazy dog.")
    a, b = hf.forward(prompt, last_n=len(prompt)), fast.forward(prompt, last_n=len(prompt))
    assert a.shape == b.shape == (len(prompt), tiny.vocab_size)
    torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    for token in (65, 66, 67, 10):
        torch.testing.assert_close(fast.forward([token]), hf.forward([token]), atol=ATOL, rtol=0)
    keep = len(prompt) + 2
    hf.rollback(keep)
    fast.rollback(keep)
    draft = [70, 71, 72, 73, 74]
    torch.testing.assert_close(fast.forward(draft, last_n=5), hf.forward(draft, last_n=5), atol=ATOL, rtol=0)
    torch.testing.assert_close(fast.forward(draft, last_n=2), hf.forward(draft, last_n=2), atol=ATOL, rtol=0)
    assert fast.length == hf.length == keep + 10


def test_rollback_matches_fresh_run(tiny):
    prompt = tiny.encode_prompt("Rollback test")
    _, used = _pair(tiny)
    used.forward(prompt)
    used.forward([1, 2, 3, 4, 5, 6], last_n=6)  # rejected drafts: overwrite then drop
    used.rollback(len(prompt))
    got = used.forward([80, 81, 82], last_n=3)
    _, fresh = _pair(tiny)
    fresh.forward(prompt)
    torch.testing.assert_close(got, fresh.forward([80, 81, 82], last_n=3), atol=0, rtol=0)
    used.reset()
    assert used.length == 0
    torch.testing.assert_close(used.forward(prompt), _pair(tiny)[1].forward(prompt), atol=0, rtol=0)


def test_greedy_matches_hf(tiny):
    hf, fast = _pair(tiny)
    prompt = tiny.encode_prompt("Once upon a time")
    assert _greedy(fast, prompt, 30) == _greedy(hf, prompt, 30)


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "int8"])
def test_low_precision_modes_run_close(tiny, weight_dtype):
    hf, fast = _pair(tiny, weight_dtype=weight_dtype)
    prompt = tiny.encode_prompt("Low precision")
    a, b = hf.forward(prompt, last_n=3), fast.forward(prompt, last_n=3)
    assert b.dtype == torch.float32 and b.shape == a.shape
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl < 0.05


def test_errors(tiny):
    model = tiny.target_model
    with pytest.raises(ValueError, match="weight_dtype"):
        FastLlamaCausalLM(model, weight_dtype="float8")
    fast = FastLlamaCausalLM(model, max_length=4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        fast.forward([1] * (model.config.max_position_embeddings + 1))
    with pytest.raises(ValueError, match="last_n"):
        fast.forward([1, 2], last_n=3)


def test_weights_are_shared(tiny):
    a, b = FastLlamaCausalLM(tiny.target_model), FastLlamaCausalLM(tiny.target_model)
    assert a.w is b.w and a.k is not b.k


@pytest.mark.slow
def test_default_target_matches_hf():
    pair = load_pair("default")
    for text in ("What is the capital of France?", "Write a haiku about the sea."):
        hf, fast = _pair(pair)
        prompt = pair.encode_prompt(text)
        a, b = hf.forward(prompt, last_n=4), fast.forward(prompt, last_n=4)
        torch.testing.assert_close(b, a, atol=5e-4, rtol=0)  # logits are O(30) here
        assert _greedy(fast, prompt, 32) == _greedy(hf, prompt, 32)
