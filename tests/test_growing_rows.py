"""GrowingRows: rows read and written by address keep their values when the buffer grows."""

import ctypes

import torch

from engine.growing_rows import GrowingRows


def _row_at(address: int, width: int) -> list[float]:
    return list((ctypes.c_float * width).from_address(address))


def test_rows_written_by_address_survive_growth_and_the_addresses_follow():
    rows = GrowingRows(width=3, capacity=2)
    for i in range(9):  # grows 2 -> 4 -> 8 -> 16, each time past the rows written so far
        rows.hold(i + 1, i)
        (ctypes.c_float * 3).from_address(rows.address(i))[:] = [i, i + 0.5, -i]
        assert rows.rows[i].tolist() == [i, i + 0.5, -i]
    assert rows.capacity == 16
    assert rows.rows[:9].tolist() == [[i, i + 0.5, -i] for i in range(9)]
    assert all(_row_at(rows.address(i), 3) == [i, i + 0.5, -i] for i in range(9))


def test_growth_keeps_only_the_rows_below_the_bound():
    rows = GrowingRows(width=2, capacity=4)
    rows.rows[:4] = torch.arange(8.0).view(4, 2)
    rows.hold(4, 4)  # fits: nothing moves
    assert rows.capacity == 4 and rows.rows[3].tolist() == [6.0, 7.0]
    rows.hold(5, 2)  # grows to max(5, 8), carrying rows 0 and 1 only
    assert rows.capacity == 8
    assert rows.rows[:2].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    rows.hold(20, 2)  # a jump past twice the capacity grows to exactly the end
    assert rows.capacity == 20 and rows.rows[:2].tolist() == [[0.0, 1.0], [2.0, 3.0]]
