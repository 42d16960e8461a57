"""Weights copied into a huge-page arena are the same bytes, and land on huge pages where Linux offers them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import cpu_kernels, load_pair
from engine.models.fast_llama import fast_weights
from engine.models.huge_pages import HUGE_PAGE, arena_copies, huge_page_bytes

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_offered() -> bool:
    """Transparent huge pages on request: the setting reads `[always]` or `[madvise]`."""
    return THP.exists() and "[never]" not in THP.read_text()


def test_arena_copies_are_equal_separate_and_aligned():
    originals = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randint(0, 255, (1000,), dtype=torch.uint8),
                 torch.randn(4, 2).to(torch.bfloat16)]
    copies = arena_copies(originals)
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    for original, copy in zip(originals, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original) and copy.data_ptr() % 64 == 0
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert all(end <= start for end, start in zip(ends, [c.data_ptr() for c in copies[1:]]))  # no overlap
    originals[0].zero_()
    assert copies[0].abs().sum() > 0
    assert arena_copies([]) == []


@pytest.mark.skipif(not _thp_offered(), reason="this kernel offers no transparent huge pages")
def test_an_arena_is_backed_by_huge_pages():
    (copy,) = arena_copies([torch.ones(4 * HUGE_PAGE, dtype=torch.uint8)])
    assert huge_page_bytes(copy) >= HUGE_PAGE


@pytest.mark.skipif(not cpu_kernels.available(), reason="the native kernels did not build")
def test_a_models_gemm_weights_share_one_arena():
    weights = fast_weights(load_pair("tiny").target_model, "float16")
    gemms = [getattr(layer, name).weight for layer in weights.layers for name in cpu_kernels.NativeDecoder.GEMMS]
    extent = sorted((w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()) for w in gemms)
    assert extent[0][0] % HUGE_PAGE == 0
    assert all(end <= start < end + 64 for (_, end), (start, _) in zip(extent, extent[1:]))  # back to back
