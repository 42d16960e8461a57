"""The fast Llama backend must compute what the transformers backend computes (float32 mode)."""

from __future__ import annotations

import pytest
import torch

from engine.models import HFCausalLM, cpu_kernels, load_pair
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


@pytest.mark.slow
def test_q4_1_blocks_are_the_embedded_gguf_blocks():
    """The q4_1 format recovers its blocks from the float32 weights; for the embedded target they
    are the GGUF's own, byte for byte (Q4_1 for every linear, Q8_0 for the tied embedding)."""
    from engine.models.embedded import gguf_path
    from engine.models.gguf_weights import hf_tensors
    from engine.models.q4_1_blocks import dequantize_q4_1, dequantize_q8_0, quantize_q4_1, quantize_q8_0

    seen = set()
    for tensor in hf_tensors(gguf_path()):
        if tensor.quant_type.name not in ("Q4_1", "Q8_0"):
            continue
        raw = torch.from_numpy(tensor.data.copy())
        rows = raw.shape[0]
        if tensor.quant_type.name == "Q4_1":
            blocks = raw.view(rows, -1, 20)
            d, m = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0], blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
            nibbles = blocks[..., 4:]
            q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(rows, -1)  # GGUF: low nibbles first
            got = quantize_q4_1(dequantize_q4_1(d, m, q))
            assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float16 else a,
                                   b.view(torch.uint8) if b.dtype == torch.float16 else b)
                       for a, b in zip(got, (d, m, q))), tensor.name
        else:
            blocks = raw.view(rows, -1, 34)
            d, q = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0], blocks[..., 2:].contiguous().view(torch.int8)
            got_d, got_q = quantize_q8_0(dequantize_q8_0(d, q.reshape(rows, -1)))
            assert torch.equal(got_d.view(torch.uint8), d.view(torch.uint8)) and torch.equal(got_q, q.reshape(rows, -1))
        seen.add(tensor.quant_type.name)
    assert seen == {"Q4_1", "Q8_0"}


@pytest.mark.slow
def test_default_target_q4_1_is_float32_bit_for_bit_on_held_out_prompts():
    """Every GEMM of the default target runs on GGUF blocks, and the logits are float32's exactly:
    prefill, decoding and a 5-token verification; so greedy agreement with float32 is 100 %."""
    import json
    from pathlib import Path

    pair = load_pair("default")
    q4 = FastLlamaCausalLM(pair.target_model, "q4_1", pair.vocab_size, weight_dtype="q4_1")
    assert {getattr(layer, name).format for layer in q4.w.layers for name in ("qkv", "o", "gate_up", "down")} == {"q4_1"}
    assert q4.w.lm_head.format == "q8_0"
    prompts = json.loads((Path(__file__).parents[1] / "assets" / "prompts.json").read_text())["prompts"]
    for text in [p["text"] for p in prompts[:4]]:
        prompt = pair.encode_prompt(text)
        f32 = FastLlamaCausalLM(pair.target_model, "float32", pair.vocab_size, weight_dtype="float32")
        q4.reset()
        assert torch.equal(q4.forward(prompt, last_n=len(prompt)), f32.forward(prompt, last_n=len(prompt)))
        assert torch.equal(q4.forward([100, 101, 102, 103, 104], last_n=5), f32.forward([100, 101, 102, 103, 104], last_n=5))
        q4.reset()
        f32.reset()
        assert _greedy(q4, prompt, 24) == _greedy(f32, prompt, 24)


@pytest.mark.slow
def test_default_target_q4_1_a16_stays_within_activation_rounding_of_float32():
    """The default format: the same GGUF blocks on int16 activations. Held-out prompts: every logit
    within 0.05 of float32's (they span about 30), the mean KL(float32 || q4_1_a16) below 1e-6 (bfloat16:
    ~5e-5), and the same 24 greedy tokens."""
    import json
    from pathlib import Path

    pair = load_pair("default")
    a16 = FastLlamaCausalLM(pair.target_model, "q4_1_a16", pair.vocab_size, weight_dtype="q4_1_a16")
    assert {getattr(layer, name).format for layer in a16.w.layers
            for name in ("qkv", "o", "gate_up", "down")} == {"q4_1_a16"}
    assert a16.w.lm_head.format == "q8_0_a16"
    f32 = FastLlamaCausalLM(pair.target_model, "float32", pair.vocab_size, weight_dtype="float32")
    prompts = json.loads((Path(__file__).parents[1] / "assets" / "prompts.json").read_text())["prompts"]
    for text in [p["text"] for p in prompts[:4]]:
        prompt = pair.encode_prompt(text)
        a16.reset()
        f32.reset()
        got, want = a16.forward(prompt, last_n=len(prompt)), f32.forward(prompt, last_n=len(prompt))
        assert (got - want).abs().max() < 0.05 and not torch.equal(got, want)
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
        assert kl.sum(-1).mean() < 1e-6
        a16.reset()
        f32.reset()
        assert _greedy(a16, prompt, 24) == _greedy(f32, prompt, 24)


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16", "int8", "q4_1", "q4_1_a16"])
def test_one_native_call_per_forward_gives_the_same_bits(tiny, weight_dtype):
    """`cpu_kernels.TargetStep` (the embedding rows, the layers and the head in one call) against the same
    steps one call at a time: identical logits and hidden states through a long prefill (the wide GEMMs),
    decodes, a verify, the cache's growth and a rollback; a bad token id is refused before any work."""
    fused, plain = (FastLlamaCausalLM(tiny.target_model, "fast", tiny.vocab_size, weight_dtype=weight_dtype,
                                      max_length=16) for _ in range(2))
    if fused._step is None:
        pytest.skip("the native kernels did not build")
    plain._step = None
    prompt = tiny.encode_prompt("The quick brown fox jumps over the lazy dog. " * 3)
    assert len(prompt) >= cpu_kernels.WIDE_MIN_ROWS
    steps = [(prompt, 3), ([65], 1), ([66], 1), ([70, 71, 72, 73, 74], 5), ("rollback", 2), ([75, 76], 1)]
    for tokens, last_n in steps:
        if tokens == "rollback":
            fused.rollback(fused.length - last_n)
            plain.rollback(plain.length - last_n)
            continue
        a, b = fused.forward(tokens, last_n), plain.forward(tokens, last_n)
        assert a.shape == (last_n, tiny.vocab_size) and torch.equal(a, b), (weight_dtype, tokens)
        assert torch.equal(fused.last_hidden, plain.last_hidden)
    assert fused.length == plain.length and fused.num_forwards == plain.num_forwards
    with pytest.raises(IndexError, match="token ids"):
        fused.forward([fused.w.embed.shape[0]])
    assert fused.length == plain.length


def test_generate_sizes_the_cache_once_before_the_prefill(tiny):
    """The engine reserves a run's positions (prompt + max_new_tokens) up front: a target made per
    run stays cheap (a small cache) and no round stops to grow it by doubling."""
    from engine.config import SpecConfig
    from engine.decoding import generate

    prompt = tiny.encode_prompt("Once upon a time")
    target = FastLlamaCausalLM(tiny.target_model, "fast", tiny.vocab_size, max_length=4)
    cfg = SpecConfig(method="sps", num_speculative_tokens=3, max_new_tokens=23, temperature=0.0)
    events = list(generate(target, tiny.make_drafter("model"), tiny.tokenizer, prompt, cfg))
    assert len(events[-1].token_ids) == 23
    assert target.max_length == len(prompt) + 23


def test_forward_after_a_kept_row_is_the_row_then_the_forward_in_one_buffer(tiny):
    """The first round's logits: the prefill's kept last row, then the verify's rows. The native step
    writes its rows after a copy of the kept one (no torch op after the forward); the bits, the hidden
    states and the cache are what concatenating a plain forward's logits gives."""
    written, concatenated = (FastLlamaCausalLM(tiny.target_model, "fast", tiny.vocab_size) for _ in range(2))
    if written._step is None:
        pytest.skip("the native kernels did not build")
    written.keep_hidden = concatenated.keep_hidden = True
    prompt = tiny.encode_prompt("Once upon a time")
    kept = written.forward(prompt)
    assert torch.equal(kept, concatenated.forward(prompt))
    rows = written.forward_after(kept.double(), [65, 66, 67])  # a row in another dtype is converted first
    expected = torch.cat([kept, concatenated.forward([65, 66, 67], last_n=3)])
    assert rows.shape == (4, tiny.vocab_size) and torch.equal(rows, expected)
    assert torch.equal(written.last_hidden, concatenated.last_hidden)
    assert written.length == concatenated.length == len(prompt) + 3
    assert written.num_forwards == concatenated.num_forwards
