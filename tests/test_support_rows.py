"""SupportBlocks hands out rows that native calls write by address; every row stays its own."""

import ctypes

import torch

from engine.drafters import Proposal
from engine.support_rows import BLOCK_ROWS, SupportBlocks


def _write(address: int, values: torch.Tensor) -> None:
    """Write as a native call does: raw bytes at an address."""
    ctypes.memmove(address, values.data_ptr(), values.numel() * values.element_size())


def test_rows_keep_their_values_across_blocks_and_widths():
    """Rows taken across more than two blocks and a change of width: each row written through its
    addresses reads back as written, after every later row was written too."""
    blocks, kept = SupportBlocks(), []
    generator = torch.Generator().manual_seed(3)
    for trial in range(3 * BLOCK_ROWS // 2):
        n, width = 1 + trial % 3, 20 if trial < BLOCK_ROWS else 7
        rows = blocks.take(n, width)
        ids = torch.randint(0, 1000, (n, width), generator=generator)
        probs = torch.rand(n, width, generator=generator)
        for i in range(n):
            ids_at, probs_at = rows.addresses(i)
            _write(ids_at, ids[i])
            _write(probs_at, probs[i])
        kept.append((rows, ids, probs))
    assert len({rows.tensors()[0].data_ptr() - 8 * rows.width * rows.start for rows, _, _ in kept}) > 2
    for rows, ids, probs in kept:
        got_ids, got_probs = rows.tensors()
        assert torch.equal(got_ids, ids) and torch.equal(got_probs, probs)
        assert torch.equal(rows.prefix(1).tensors()[1], probs[:1])


def test_a_proposal_of_rows_reads_like_a_sparse_one():
    """Proposal(rows=...) gives the same support, dense rows and prefix as the same tensors given directly."""
    rows = SupportBlocks().take(2, 3)
    ids = torch.tensor([[4, 1, 7], [0, 2, 5]])
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.125, 0.375, 0.5]])
    for i in range(2):
        ids_at, probs_at = rows.addresses(i)
        _write(ids_at, ids[i])
        _write(probs_at, probs[i])
    by_rows = Proposal([4, 5], rows=rows, vocab_size=9)
    direct = Proposal([4, 5], support=(ids, probs), vocab_size=9)
    assert all(torch.equal(a, b) for a, b in zip(by_rows.support, direct.support))
    assert torch.equal(by_rows.probs, direct.probs)
    assert by_rows.device.type == "cpu"
    assert torch.equal(by_rows.prefix(1).support[1], probs[:1]) and by_rows.prefix(1).tokens == [4]
