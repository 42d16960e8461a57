"""The block-drawn uniform stream hands out exactly the generator's own sequence."""

import pytest
import torch

from engine.acceptance import RandomDraws
from engine.uniform_stream import BLOCK, UniformStream


def test_the_stream_is_the_generators_sequence_across_block_boundaries():
    sizes = [1, 2, 1, 5, 3] * 500 + [BLOCK + 7, 1, 2]  # crosses several blocks, one take longer than a block
    stream = UniformStream(123)
    taken = torch.cat([stream.take(n) for n in sizes])
    generator = torch.Generator().manual_seed(123)
    one_by_one = torch.cat([torch.rand(n, generator=generator) for n in sizes])
    assert torch.equal(taken, one_by_one)


def test_the_streams_floats_are_its_float32_numbers_across_block_boundaries():
    """A drafter's draws come as Python floats (`take_floats`): the very float32 numbers `take` gives."""
    sizes = [1, 3, 2] * (BLOCK // 3) + [BLOCK + 5, 1]
    floats, tensors = UniformStream(11), UniformStream(11)
    for n in sizes:
        mine, theirs = floats.take_floats(n), tensors.take(n)
        assert torch.equal(torch.tensor(mine, dtype=torch.float32), theirs) and mine == theirs.tolist()
    assert floats.position == tensors.position


def test_a_rounds_draws_from_the_stream_equal_the_generator_draws():
    stream, generator = UniformStream(7), torch.Generator().manual_seed(7)
    for k in (0, 1, 4, 2):
        mine, theirs = RandomDraws.take(stream, k), RandomDraws.draw(1, k, generator)
        assert torch.equal(mine.u_accept, theirs.u_accept) and torch.equal(mine.u_sample, theirs.u_sample)
        assert mine.u_accept.shape == (1, k) and mine.u_sample.shape == (1,)


def test_a_rounds_draws_are_read_by_address_across_block_boundaries():
    """The native rule reads u_accept and u_sample by the addresses the stream keeps as ints
    (`RandomDraws.addresses`): they point at the very numbers the tensors hold, also after a refill."""
    import ctypes

    stream = UniformStream(5)
    for round_index in range(3 * BLOCK // 3):
        k = round_index % 3
        draws = RandomDraws.take(stream, k)
        accept_at, sample_at = draws.addresses()
        assert list((ctypes.c_float * k).from_address(accept_at)) == draws.u_accept.flatten().tolist()
        assert ctypes.c_float.from_address(sample_at).value == draws.u_sample.item()


def test_two_copies_of_a_stream_share_it_by_position():
    """SSD's worker drafts with the draws at a position of the sequence's stream that the main
    process passes over: skipping to a position gives the same numbers as taking up to it."""
    main, worker = UniformStream(9), UniformStream(9)
    main.take(5)
    worker.skip_to(main.position)
    assert main.position == worker.position == 5
    assert torch.equal(worker.take(BLOCK + 3), main.take(BLOCK + 3))
    with pytest.raises(ValueError, match="already at"):
        worker.skip_to(2)
