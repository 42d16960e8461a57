"""The kernels' own threads (engine/models/work_pool.h): whichever thread computes an item, however
often an item is computed twice, and whoever else calls the kernels meanwhile, a forward gives the
bits one thread alone gives."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from engine.busy_core import competitor
from engine.models import cpu_kernels
from engine.models.fast_llama import FastLlamaCausalLM

native = pytest.mark.skipif(not cpu_kernels.available(), reason="native kernels need cc and an AVX2/FMA/F16C CPU")
LONG_PROMPT = "Once upon a time a dragon learned to fly over the sea"  # bytes: a wide prefill (>= 24 rows)


def _logits(lm: FastLlamaCausalLM, prompt: list[int]) -> torch.Tensor:
    """A prefill, three decode steps and a five-token verification, as one tensor of logits."""
    out = [lm.forward(prompt, last_n=len(prompt))]
    out += [lm.forward([t]) for t in (11, 12, 13)]
    out.append(lm.forward([14, 15, 16, 17, 18], last_n=5))
    return torch.cat(out)


def _counts() -> tuple[int, int, int]:
    """(items stolen, stolen copies that lost the commit, jobs a helper joined), since the library loaded."""
    out = (ctypes.c_int64 * 3)()
    cpu_kernels._library().kernel_pool_counts(out)
    return tuple(out)


@pytest.fixture
def threads():
    """Set torch's (and so the kernels') thread count inside the test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@native
@pytest.mark.parametrize("weight_dtype", ["q4_1_a16", "float16"])  # the default; one with a wide prefill
def test_stolen_items_give_the_bits_of_one_thread(default_pair, weight_dtype, threads):
    """With no grace before stealing, a thread that runs out of items recomputes every item the other
    has open, and a busy core preempts either at any point: commits race on every phase. The
    default target: its items take long enough (tens of microseconds) to be found open."""
    pair = default_pair
    prompt = pair.encode_prompt(LONG_PROMPT)
    assert len(prompt) >= cpu_kernels.WIDE_MIN_ROWS
    threads(1)
    want = _logits(FastLlamaCausalLM(pair.target_model, "one", pair.vocab_size, weight_dtype=weight_dtype), prompt)
    threads(2)
    lib = cpu_kernels._library()
    default_grace = lib.kernel_steal_grace(0)
    try:
        before = _counts()
        with competitor(0.9):
            got = [_logits(FastLlamaCausalLM(pair.target_model, "two", pair.vocab_size, weight_dtype=weight_dtype),
                           prompt) for _ in range(4)]
    finally:
        lib.kernel_steal_grace(default_grace)
    assert all(torch.equal(g, want) for g in got)
    stolen, _, joined = (after - b for after, b in zip(_counts(), before))
    assert joined == 0 or stolen > 0  # where a helper took part, the idle thread stole from it (~140 here)


@native
def test_concurrent_callers_each_get_the_bits_of_one_thread(tiny_pair, threads):
    """Callers on several Python threads at once: one has the pool, the others run their jobs alone."""
    prompt = tiny_pair.encode_prompt(LONG_PROMPT)
    threads(1)
    want = _logits(FastLlamaCausalLM(tiny_pair.target_model, "one", tiny_pair.vocab_size), prompt)
    threads(2)
    got: dict[int, torch.Tensor] = {}

    def caller(k: int) -> None:
        lm = FastLlamaCausalLM(tiny_pair.target_model, f"caller {k}", tiny_pair.vocab_size)
        runs = []
        for _ in range(3):
            lm.rollback(0)
            runs.append(_logits(lm, prompt))
        got[k] = torch.cat(runs)

    callers = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert sorted(got) == [0, 1, 2]
    assert all(torch.equal(g, want.repeat(3, 1)) for g in got.values())


@native
@pytest.mark.parametrize("n_threads", [1, 2])
def test_an_output_larger_than_an_item_is_split_into_items_and_comes_out_whole(n_threads, threads):
    """40 rows x 30,000 channels is more than one item's result (ITEM_FLOATS, 2^20 floats), so the
    GEMM takes more items than the threads alone would ask for: every channel must still arrive."""
    threads(n_threads)
    torch.manual_seed(0)
    weight, x = torch.randn(30_000, 64) * 0.05, torch.randn(40, 64)
    y = cpu_kernels.panel_linear(x, cpu_kernels.pack_panels(weight, torch.float32), 30_000, "float32")
    torch.testing.assert_close(y, x @ weight.T, atol=1e-4, rtol=0)
