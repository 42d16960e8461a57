"""`GrowingRows`: float32 rows by position, in one buffer that doubles when full, read by address.

A feature draft keeps two sequences of hidden-state rows: the target's features f_j (written by the
target's own forward, `causal_lm.FeatureRows`) and its own outputs f̂_j (written by its native step).
Native calls read and write them by address, so a decode round builds no tensor for them: a torch op
right after the target's forward costs 15-30 us with the caches cold (about 0.5 % of a round each),
and appending by concatenation would copy the whole history every round.
"""

from __future__ import annotations

import torch


class GrowingRows:
    """Rows [capacity, width] of float32; `hold` grows the buffer (doubling) and keeps the rows below a bound."""

    __slots__ = ("rows", "capacity", "_address", "_row_bytes")

    def __init__(self, width: int, capacity: int = 256) -> None:
        self._set(torch.empty(capacity, width))

    def _set(self, rows: torch.Tensor) -> None:
        self.rows, self.capacity = rows, rows.shape[0]
        self._address, self._row_bytes = rows.data_ptr(), rows.stride(0) * rows.element_size()

    def hold(self, end: int, kept: int) -> None:
        """Make room for rows [0, end), rows [0, kept) carried over if the buffer moves. Addresses taken
        before a `hold` may be stale after it."""
        if end > self.capacity:
            grown = torch.empty(max(end, 2 * self.capacity), self.rows.shape[1])
            grown[:kept] = self.rows[:kept]
            self._set(grown)

    def address(self, row: int) -> int:
        """Where row `row` starts."""
        return self._address + row * self._row_bytes
