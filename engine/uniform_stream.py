"""`UniformStream`: the seeded uniforms a generation consumes, drawn a block at a time.

Every random choice of a round (the draft's K draws, then the acceptance tests' u_accept and the
recovered or bonus token's u_sample) reads the next numbers of one seeded stream, so the same seed
gives the same tokens. torch fills a CPU float tensor from its generator element by element, so a
block of N draws holds the very numbers N one-element calls would give, in order (a test checks
this): drawing in blocks changes no token. It takes a generator call off every round. Right after a
target forward has streamed the weights through the caches, `torch.rand(2, generator=g)` took
about 0.09 ms on AMD EPYC Zen 4 (median over 130 rounds, scratch profile): 1.3 % of an AR token.
"""

from __future__ import annotations

import torch

BLOCK = 4096  # uniforms per generator call: about a thousand rounds at K = 1


class UniformStream:
    """The uniforms of torch.Generator().manual_seed(seed), handed out in order as tensor views."""

    __slots__ = ("_generator", "_block", "_floats", "_size", "_address", "_at", "position")

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(int(seed))
        # The first block now, before the generation's clock starts: drawn at the first round's first
        # take it cost that round about 0.15 ms (a rand, a cat and a tolist with the caches cold).
        self._set_block(torch.rand(BLOCK, generator=self._generator))
        self._at = 0
        self.position = 0  # uniforms handed out so far

    def _set_block(self, block: torch.Tensor) -> None:
        # Its size and address kept as ints, its numbers as Python floats: a round then makes no torch call
        # for its draws (a torch call right after the target's forward costs 10-30 us with the caches cold).
        self._block, self._size, self._address = block, block.shape[0], block.data_ptr()
        self._floats = block.tolist()

    def skip_to(self, position: int) -> None:
        """Pass over the uniforms before `position` (another process drew them from its copy of the stream)."""
        if position < self.position:
            raise ValueError(f"the stream is already at {self.position}, past {position}")
        self.take_span(position - self.position)

    def take(self, n: int) -> torch.Tensor:
        """The next n uniforms in [0, 1) as a float32 view [n] (read-only by convention)."""
        block, at, _ = self.take_span(n)
        return block[at: at + n]

    def take_floats(self, n: int) -> list[float]:
        """`take` as Python floats (the same float32 values), for a drafter that reads them one by one."""
        _, at, _ = self.take_span(n)
        return self._floats[at: at + n]

    def take_span(self, n: int) -> tuple[torch.Tensor, int, int]:
        """The next n uniforms as (the float32 block holding them, their offset in it, the address of
        the first), without building a tensor for them: for a native caller that reads them by address."""
        if self._at + n > self._size:
            fresh = torch.rand(max(BLOCK, n), generator=self._generator)
            self._set_block(torch.cat([self._block[self._at:], fresh]))
            self._at = 0
        self._at += n
        self.position += n
        return self._block, self._at - n, self._address + 4 * (self._at - n)
