"""Rows of sparse distributions (token ids int64 and probabilities float32, `width` each) that native
calls write by address: the draft's D_i and the target's T_i of a round.

A round takes its rows from a larger block that is never reused (`SupportBlocks`), so it makes no
torch call for them: a torch op right after the target's forward costs 15-30 us with the caches cold,
about 0.5 % of a decode round each. Every row handed out stays readable for as long as something
holds it (an event the page inspects later), and tensors are built only when a consumer asks
(`SupportRows.tensors`).
"""

from __future__ import annotations

import torch

BLOCK_ROWS = 256  # rows a block holds: a new block every 256 decode rounds


class SupportRows:
    """Rows [start, stop) of an ids block and a probs block [rows, width], with the first row's addresses."""

    __slots__ = ("_ids", "_probs", "start", "stop", "width", "ids_address", "probs_address")

    def __init__(self, ids: torch.Tensor, probs: torch.Tensor, start: int, stop: int, width: int,
                 ids_address: int, probs_address: int) -> None:
        self._ids, self._probs, self.start, self.stop, self.width = ids, probs, start, stop, width
        self.ids_address, self.probs_address = ids_address, probs_address

    def __len__(self) -> int:
        return self.stop - self.start

    def addresses(self, i: int) -> tuple[int, int]:
        """Where the ids and the probs of the i-th of these rows start."""
        return self.ids_address + 8 * self.width * i, self.probs_address + 4 * self.width * i

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, probs) [rows, width]: views of these rows only."""
        return self._ids[self.start: self.stop], self._probs[self.start: self.stop]

    def prefix(self, n: int) -> SupportRows:
        """The first n rows."""
        return SupportRows(self._ids, self._probs, self.start, self.start + n, self.width, self.ids_address,
                           self.probs_address)


class SupportBlocks:
    """Hands out consecutive unused rows of a given width, from a new block when the current one is
    full or has another width (a change of the sampling settings)."""

    __slots__ = ("_ids", "_probs", "_width", "_rows", "_next", "_ids_address", "_probs_address")

    def __init__(self) -> None:
        self._ids = self._probs = None
        self._width = self._rows = self._next = self._ids_address = self._probs_address = 0

    def take(self, rows: int, width: int) -> SupportRows:
        if self._next + rows > self._rows or width != self._width:
            self._rows, self._width, self._next = max(BLOCK_ROWS, rows), width, 0
            self._ids = torch.empty(self._rows, width, dtype=torch.long)
            self._probs = torch.empty(self._rows, width)
            self._ids_address, self._probs_address = self._ids.data_ptr(), self._probs.data_ptr()
        start = self._next
        self._next += rows
        return SupportRows(self._ids, self._probs, start, start + rows, width,
                           self._ids_address + 8 * width * start, self._probs_address + 4 * width * start)
