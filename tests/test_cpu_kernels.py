"""The native CPU kernels (engine/models/cpu_kernels.c) against their torch definitions, in every
build this CPU runs (`isa`: the one it selects, AVX-512 here, and AVX2, which it runs too)."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from engine.models import cpu_kernels, fast_llama, q4_1_blocks
from engine.models.fast_llama import FastLlamaCausalLM, _TorchGlue

native = pytest.mark.skipif(not cpu_kernels.available(), reason="native kernels need cc and an AVX2/FMA/F16C CPU")


@pytest.fixture(params=list(cpu_kernels.ISAS))
def isa(request, monkeypatch):
    """Run the test on one build of the kernels; builds this CPU cannot run are skipped."""
    if request.param not in cpu_kernels.runnable_isas():
        pytest.skip(f"this CPU does not run the {request.param} kernels")
    lib = cpu_kernels.load(request.param)
    assert lib is not None and lib.kernel_vector_width() == cpu_kernels.ISAS[request.param].vector_width
    monkeypatch.setattr(cpu_kernels, "_library", lambda: lib)
    return request.param


def test_kernels_build_where_they_can():
    """CI installs a compiler on an AVX2 machine: a broken build must fail here, not fall back silently.
    The widest build the CPU runs is the one selected."""
    if shutil.which("cc") and cpu_kernels.runnable_isas():
        assert cpu_kernels.available()
        assert cpu_kernels.selected_isa() == cpu_kernels.runnable_isas()[0]
        assert all(cpu_kernels.load(isa) is not None for isa in cpu_kernels.runnable_isas())


def test_isa_can_be_forced(monkeypatch):
    monkeypatch.setenv("SPECPLAY_KERNEL_ISA", "avx2")
    if "avx2" in cpu_kernels.runnable_isas():
        assert cpu_kernels.selected_isa() == "avx2"
    monkeypatch.setenv("SPECPLAY_KERNEL_ISA", "no-such-isa")
    with pytest.raises(RuntimeError, match="SPECPLAY_KERNEL_ISA"):
        cpu_kernels.selected_isa()


@native
@pytest.mark.parametrize("n, k", [(300, 576), (70, 40)])  # 40 is not a multiple of the group: padded
def test_q8_linear_matches_dequantized_weights_and_rows_are_independent(n, k, isa):
    weight = torch.randn(n, k) * 0.05
    q, scales = cpu_kernels.quantize_q8(weight)
    x = torch.randn(11, k)  # more rows than one tile of 8
    y = cpu_kernels.q8_linear(x, q, scales)
    reference = x @ cpu_kernels.dequantize_q8(q, scales)[:, :k].T
    torch.testing.assert_close(y, reference, atol=2e-4, rtol=0)  # int16 activation rounding only
    assert (y - x @ weight.T).abs().max() < 0.05  # the int8 weights' own error
    # A row's result never depends on the rows it shares a call with (verification == decoding).
    for i in (0, 5, 10):
        assert torch.equal(cpu_kernels.q8_linear(x[i:i + 1], q, scales)[0], y[i])


@native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(70, 40), (96, 64)])  # N = 70: a zero-padded last panel; K = 40: padded to 64
def test_panel_linear_matches_the_stored_weights_and_rows_are_independent(n, k, dtype, isa):
    weight = torch.randn(n, k) * 0.05
    panels = cpu_kernels.pack_panels(weight, dtype)
    x = torch.randn(11, k)  # tiles of 1-3 panels and of up to 5 rows, split evenly (11 = 4 + 4 + 3)
    y = cpu_kernels.panel_linear(x, panels, n)
    torch.testing.assert_close(y, x @ weight.to(dtype).float().T, atol=1e-5, rtol=1e-5)
    # Each (row, channel) is one fp32 chain over k, whatever the tile: verification == decoding.
    for m in range(1, 11):
        assert torch.equal(cpu_kernels.panel_linear(x[:m], panels, n), y[:m])
    for i in (0, 4, 10):
        assert torch.equal(cpu_kernels.panel_linear(x[i:i + 1], panels, n)[0], y[i])


@native
@pytest.mark.parametrize("weight_dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("m, k, n", [(1, 40, 32), (31, 600, 48), (64, 96, 70)])
def test_linear_wide_matches_the_stored_weights(m, k, n, weight_dtype, isa):
    """The prefill GEMM: 6-row tiles, 256-wide k blocks, and N = 70 (not a multiple of its
    16-channel panels) falling back to the batch-invariant kernels."""
    weight = torch.randn(n, k) * 0.05
    x = torch.randn(m, k)
    if weight_dtype == "int8":
        q, scales = cpu_kernels.quantize_q8(weight)
        y, stored = cpu_kernels.linear_wide(x, q, n, scales), cpu_kernels.dequantize_q8(q, scales)[:, :k]
        tol = 1e-4 if n % 16 == 0 else 1e-2  # the fallback (N = 70) quantizes activations to int16
    else:
        dtype = getattr(torch, weight_dtype)
        stored = weight.to(dtype).float()
        y, tol = cpu_kernels.linear_wide(x, cpu_kernels.pack_panels(weight, dtype), n), 1e-5
    torch.testing.assert_close(y, x @ stored.T, atol=tol, rtol=tol)


@native
def test_q8_linear_torch_fallback_computes_the_same_product(monkeypatch):
    q, scales = cpu_kernels.quantize_q8(torch.randn(64, 96))
    x = torch.randn(3, 96)
    y = cpu_kernels.q8_linear(x, q, scales)
    monkeypatch.setattr(cpu_kernels, "_library", lambda: None)
    torch.testing.assert_close(cpu_kernels.q8_linear(x, q, scales), y, atol=1e-5, rtol=0)


@native
@pytest.mark.parametrize("weight_format", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(70, 64), (96, 576)])  # N = 70: zero-padded last panel (zero blocks are exact)
def test_gguf_blocks_compute_exactly_what_their_float32_panels_compute(n, k, weight_format, isa):
    """Q4_1 / Q8_0 blocks widen to exactly gguf's dequantised float32 values, and every (row,
    channel) sum is the same fp32 chain as the float32 panels': bit-identical results for every
    row count, in the decode kernel and in the prefill GEMM."""
    weight = torch.randn(n, k) * 0.05
    if weight_format == "q4_1":
        weight = q4_1_blocks.round_to_q4_1(weight)
    else:
        weight = q4_1_blocks.dequantize_q8_0(*q4_1_blocks.quantize_q8_0(weight))
    got_format, blocks = q4_1_blocks.exact_blocks(weight)
    assert got_format == weight_format
    bytes_per_weight = blocks.numel() / (-(-n // 16) * 16 * k)  # GGUF's own: 20 or 34 bytes a block of 32
    assert bytes_per_weight == (34 / 32 if weight_format == "q8_0" else 20 / 32)
    floats = cpu_kernels.pack_panels(weight, torch.float32)
    x = torch.randn(13, k)  # two tiles of rows in either build
    for m in (1, 2, 3, 5, 8, 13):
        want = cpu_kernels.panel_linear(x[:m], floats, n)
        assert torch.equal(cpu_kernels.panel_linear(x[:m], blocks, n, weight_format), want)
        assert torch.equal(cpu_kernels.linear_wide(x[:m], blocks, n, None, weight_format),
                           cpu_kernels.linear_wide(x[:m], floats, n))
    torch.testing.assert_close(want, x @ weight.T, atol=1e-5, rtol=1e-5)


def _gguf_rounded(weight: torch.Tensor, weight_format: str) -> torch.Tensor:
    if weight_format == "q4_1":
        return q4_1_blocks.round_to_q4_1(weight)
    return q4_1_blocks.dequantize_q8_0(*q4_1_blocks.quantize_q8_0(weight))


@native
@pytest.mark.parametrize("weight_format", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(70, 64), (96, 576), (40, 1536)])
def test_int16_activation_blocks_are_the_blocks_times_the_rounded_activations(n, k, weight_format, isa):
    """q4_1_a16 / q8_0_a16: the GGUF blocks (GGUF's bytes a weight) times x rounded to int16 per row
    and group of 32 as `quantize_activations` rounds it; the integer products are exact, so only
    float summation order separates the kernel from torch. Rows stay independent (every tile shape)."""
    weight = _gguf_rounded(torch.randn(n, k) * 0.05, weight_format)
    got_format, blocks = q4_1_blocks.exact_blocks(weight, int16_activations=True)
    assert got_format == weight_format + "_a16"
    assert blocks.numel() / (-(-n // 16) * 16 * k) == (34 / 32 if weight_format == "q8_0" else 20 / 32)
    x = torch.randn(13, k) * torch.logspace(-2, 1, k)  # groups of very different scales
    y = cpu_kernels.panel_linear(x, blocks, n, got_format)
    rounded_x = cpu_kernels.dequantize_q8(*cpu_kernels.quantize_activations(x))
    torch.testing.assert_close(y, rounded_x @ weight.T, atol=1e-5, rtol=1e-5)
    assert not torch.equal(rounded_x, x)
    for m in range(1, 13):
        assert torch.equal(cpu_kernels.panel_linear(x[:m], blocks, n, got_format), y[:m])
    for i in (0, 6, 12):
        assert torch.equal(cpu_kernels.panel_linear(x[i:i + 1], blocks, n, got_format)[0], y[i])
    assert torch.equal(cpu_kernels.linear_wide(x, blocks, n, None, got_format), y)  # prefills take the same kernel


@native
def test_int16_activation_blocks_give_the_same_bits_in_every_build():
    """The integer dot products are exact with VNNI (vpdpwssd) or without (vpmaddwd + vpaddd), and the
    fp32 chain over blocks is the same at 8 or 16 floats a vector."""
    weight = q4_1_blocks.round_to_q4_1(torch.randn(80, 576) * 0.05)
    got_format, blocks = q4_1_blocks.exact_blocks(weight, int16_activations=True)
    x = torch.randn(5, 576)
    results = []
    for name in cpu_kernels.runnable_isas():
        lib = cpu_kernels.load(name)
        results.append(torch.empty(5, 80))
        lib.panel_linear(x.data_ptr(), 5, 576, blocks.data_ptr(), 80, results[-1].data_ptr(),
                         cpu_kernels.FORMAT_CODES[got_format])
    assert results and all(torch.equal(r, results[0]) for r in results)


def test_exact_blocks_keep_weights_no_blocks_hold_in_float32():
    weight = torch.randn(48, 64)
    assert q4_1_blocks.exact_blocks(weight)[0] == "float32"
    rounded = q4_1_blocks.round_to_q4_1(weight)
    assert (rounded - weight).abs().max() > 1e-3 and q4_1_blocks.exact_blocks(rounded)[0] == "q4_1"
    rounded[0, 0] += 1e-3  # one weight off its block's grid
    assert q4_1_blocks.exact_blocks(rounded)[0] == "float32"


@native
def test_glue_ops_match_torch(isa):
    x, y, w = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64) + 0.5
    x1, x2 = x.clone(), x.clone()
    torch.testing.assert_close(cpu_kernels.add_rms_norm(x1, y, w, 1e-5), _TorchGlue.add_rms_norm(x2, y, w, 1e-5))
    torch.testing.assert_close(x1, x2)  # the residual stream is updated in place by both
    torch.testing.assert_close(cpu_kernels.add_rms_norm(x1, None, w, 1e-5), _TorchGlue.add_rms_norm(x2, None, w, 1e-5))
    gate_up = torch.randn(4, 2 * 172)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), _TorchGlue.silu_mul(gate_up))


@native
@pytest.mark.parametrize("n, masked, hd, pos", [(1, False, 64, 9), (4, False, 64, 9), (5, True, 64, 9), (3, True, 16, 9),
                                                (2, False, 128, 9), (1, False, 64, 40), (3, True, 64, 40)])
def test_attention_matches_torch(n, masked, hd, pos, isa):
    """pos 40: enough keys for the vectorised softmax of either vector width."""
    heads, kv_heads, cap = 4, 2, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd)
    angles = torch.rand(n, hd // 2) * 6
    rope = torch.stack([angles.cos(), angles.sin()], dim=-1)
    caches = [torch.randn(kv_heads, cap, hd) for _ in range(2)]
    mask = None
    if masked:  # a tree: each new token sees the prefix and a random subset of the new ones
        visible = torch.cat([torch.ones(n, pos, dtype=torch.bool), torch.rand(n, n) < 0.5], dim=1)
        visible[:, pos:] |= torch.eye(n, dtype=torch.bool)
        mask = torch.zeros(n, pos + n).masked_fill_(~visible, float("-inf"))
    theirs = [c.clone() for c in caches]
    got = cpu_kernels.attention(qkv, rope, caches[0], caches[1], pos, mask, heads, kv_heads)
    want = _TorchGlue.attention(qkv, rope, theirs[0], theirs[1], pos, mask, heads, kv_heads)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for mine, ref in zip(caches, theirs):
        torch.testing.assert_close(mine[:, : pos + n], ref[:, : pos + n], atol=1e-6, rtol=0)


@native
def test_native_and_torch_glue_give_the_same_float32_model(tiny_pair, monkeypatch, isa):
    prompt = tiny_pair.encode_prompt("Once upon a time")
    lm = FastLlamaCausalLM(tiny_pair.target_model, "native", tiny_pair.vocab_size)
    got = torch.cat([lm.forward(prompt, last_n=len(prompt)), lm.forward([5, 6, 7], last_n=3)])
    monkeypatch.setattr(fast_llama, "_glue", lambda: _TorchGlue)
    ref_lm = FastLlamaCausalLM(tiny_pair.target_model, "torch", tiny_pair.vocab_size)
    want = torch.cat([ref_lm.forward(prompt, last_n=len(prompt)), ref_lm.forward([5, 6, 7], last_n=3)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@native
@pytest.mark.parametrize("weight_dtype", ["int8", "float16", "bfloat16", "float32"])
def test_verification_is_bit_identical_to_decoding(tiny_pair, weight_dtype, isa):
    """Why greedy SpS equals AR exactly on the native formats: the logits of a token do not depend
    on how many tokens share its forward (no batch-dependent scales or summation orders)."""
    prompt = tiny_pair.encode_prompt("Bit for bit")
    lm = FastLlamaCausalLM(tiny_pair.target_model, "native", tiny_pair.vocab_size, weight_dtype=weight_dtype)
    lm.forward(prompt)
    together = lm.forward([11, 12, 13, 14, 15], last_n=5)
    lm.rollback(len(prompt))
    one_by_one = torch.cat([lm.forward([t]) for t in (11, 12, 13, 14, 15)])
    assert torch.equal(together, one_by_one)


@native
@pytest.mark.parametrize("weight_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_a_long_prefill_into_an_empty_cache_takes_the_wide_gemm(tiny_pair, weight_dtype, isa):
    """A prompt of >= WIDE_MIN_ROWS tokens prefilled at once runs linear_wide; compare a prefill
    split at token 1 (the batch-invariant kernels for the rest). Panel formats: the wide GEMM's
    k blocks continue each (row, channel) chain in the same order, so the two agree bit for bit.
    int8: the wide GEMM meets float32 activations (q8_linear quantizes them to int16), so the two
    agree to that rounding but not bit for bit -- the sign that the wide path ran."""
    prompt = tiny_pair.encode_prompt("Bit for bit")
    assert len(prompt) > cpu_kernels.WIDE_MIN_ROWS
    lm = FastLlamaCausalLM(tiny_pair.target_model, "wide", tiny_pair.vocab_size, weight_dtype=weight_dtype)
    whole = lm.forward(prompt, last_n=len(prompt))[1:]
    lm.reset()
    lm.forward(prompt[:1])
    split = lm.forward(prompt[1:], last_n=len(prompt) - 1)
    if weight_dtype == "int8":
        torch.testing.assert_close(whole, split, atol=2e-2, rtol=2e-2)
        assert not torch.equal(whole, split)
    else:
        assert torch.equal(whole, split)


@native
@pytest.mark.parametrize("weight_dtype", ["int8", "float16", "bfloat16", "float32"])
@pytest.mark.parametrize("tree", [False, True])
def test_native_decoder_is_the_per_op_path_in_one_call(tiny_pair, monkeypatch, tree, weight_dtype, isa):
    """The fused decoder_forward runs the same kernels in the same order as the Python layer loop,
    so the logits agree bit for bit (causal prefill, a decode step, and a tree forward)."""
    prompt = tiny_pair.encode_prompt("One call")
    visible = torch.tensor([[True] * len(prompt) + row for row in ([True, False, False], [True, True, False],
                                                                   [True, False, True])])

    def run(lm):
        out = [lm.forward(prompt, last_n=len(prompt)), lm.forward([9, 10], last_n=2)]
        if tree:
            out.append(lm.forward_tree([3, 4, 5], [len(prompt) + 2, len(prompt) + 3, len(prompt) + 3],
                                       lm.length, torch.cat([torch.ones(3, 2, dtype=torch.bool), visible], 1)))
        return torch.cat(out)

    fused = FastLlamaCausalLM(tiny_pair.target_model, "fused", tiny_pair.vocab_size, weight_dtype=weight_dtype)
    assert fused.w.native_decoder is not None
    got = run(fused)
    monkeypatch.setattr(fused.w, "native_decoder", None)
    assert torch.equal(run(FastLlamaCausalLM(tiny_pair.target_model, "per-op", tiny_pair.vocab_size,
                                             weight_dtype=weight_dtype)), got)


@native
@pytest.mark.parametrize("weight_dtype", ["float32", "float16", "bfloat16"])
def test_float_formats_fall_back_to_onednn_or_fbgemm_without_the_native_kernels(monkeypatch, weight_dtype):
    weight, x = torch.randn(96, 64) * 0.05, torch.randn(3, 64)
    native_linear = fast_llama.PackedLinear(weight, weight_dtype)
    assert native_linear.native
    expected = native_linear(x)
    monkeypatch.setattr(cpu_kernels, "_library", lambda: None)
    fallback = fast_llama.PackedLinear(weight, weight_dtype)
    assert not fallback.native
    torch.testing.assert_close(fallback(x), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_q4_1_model(tiny_pair):
    """The tiny target with its layers' weights rounded to Q4_1 and its head to Q8_0, as the embedded
    GGUF's are: the q4_1 format then stores them as blocks (down's K = 172 is not a whole number of
    blocks, so down stays float32 panels: a model mixing formats)."""
    model = copy.deepcopy(tiny_pair.target_model)
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                linear.weight.copy_(q4_1_blocks.round_to_q4_1(linear.weight))
        model.lm_head.weight.copy_(q4_1_blocks.dequantize_q8_0(*q4_1_blocks.quantize_q8_0(model.lm_head.weight)))
    return model


@native
def test_q4_1_format_is_the_float32_format_bit_for_bit(tiny_pair, tiny_q4_1_model, isa):
    """Prefill (the wide GEMM), decoding, verification and a tree forward: the q4_1 format's logits
    are float32's exactly, while its GEMMs run on Q4_1 and Q8_0 blocks."""
    prompt = tiny_pair.encode_prompt("Bit for bit")
    assert len(prompt) >= cpu_kernels.WIDE_MIN_ROWS
    visible = torch.ones(3, len(prompt) + 5, dtype=torch.bool)
    visible[1, -3] = visible[2, -2] = False

    def run(weight_dtype):
        lm = FastLlamaCausalLM(tiny_q4_1_model, weight_dtype, tiny_pair.vocab_size, weight_dtype=weight_dtype)
        out = [lm.forward(prompt, last_n=len(prompt)), lm.forward([9], last_n=1), lm.forward([3, 4, 5, 6], last_n=4)]
        lm.rollback(len(prompt) + 2)
        out.append(lm.forward_tree([7, 8, 9], [len(prompt) + 2] * 3, lm.length, visible))
        return lm, torch.cat(out)

    lm, got = run("q4_1")
    formats = {name: {getattr(layer, name).format for layer in lm.w.layers} for name in ("qkv", "o", "gate_up", "down")}
    assert formats == {"qkv": {"q4_1"}, "o": {"q4_1"}, "gate_up": {"q4_1"}, "down": {"float32"}}
    assert lm.w.lm_head.format == "q8_0"
    assert torch.equal(got, run("float32")[1])


@native
def test_q4_1_a16_runs_the_blocks_on_int16_activations(tiny_pair, tiny_q4_1_model, isa):
    """The same blocks as q4_1 (down stays float32 panels), with activations rounded to int16:
    close to float32's logits but not equal to them, and a long prefill equals a split one bit
    for bit (prefills run the decode kernel)."""
    prompt = tiny_pair.encode_prompt("Bit for bit")
    lm = FastLlamaCausalLM(tiny_q4_1_model, "q4_1_a16", tiny_pair.vocab_size, weight_dtype="q4_1_a16")
    formats = {name: {getattr(layer, name).format for layer in lm.w.layers} for name in ("qkv", "o", "gate_up", "down")}
    assert formats == {"qkv": {"q4_1_a16"}, "o": {"q4_1_a16"}, "gate_up": {"q4_1_a16"}, "down": {"float32"}}
    assert lm.w.lm_head.format == "q8_0_a16"
    whole = lm.forward(prompt, last_n=len(prompt))
    reference = FastLlamaCausalLM(tiny_q4_1_model, "q4_1", tiny_pair.vocab_size, weight_dtype="q4_1")
    want = reference.forward(prompt, last_n=len(prompt))
    torch.testing.assert_close(whole, want, atol=1e-3, rtol=0)
    assert not torch.equal(whole, want)
    lm.reset()
    lm.forward(prompt[:1])
    assert torch.equal(lm.forward(prompt[1:], last_n=len(prompt) - 1), whole[1:])


@native
@pytest.mark.parametrize("weight_dtype", ["q4_1", "q4_1_a16"])
def test_q4_1_verification_is_bit_identical_to_decoding(tiny_pair, tiny_q4_1_model, weight_dtype, isa):
    prompt = tiny_pair.encode_prompt("Bit for bit")
    lm = FastLlamaCausalLM(tiny_q4_1_model, weight_dtype, tiny_pair.vocab_size, weight_dtype=weight_dtype)
    lm.forward(prompt)
    together = lm.forward([11, 12, 13, 14, 15, 16, 17, 18, 19], last_n=9)
    lm.rollback(len(prompt))
    assert torch.equal(together, torch.cat([lm.forward([t]) for t in range(11, 20)]))
