"""The benchmark's competing load: a real process that lives exactly as long as its block."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.busy_core import competitor


def _spinners() -> set[int]:
    """This process's children running engine/busy_core.py (from /proc: Linux, as the project is)."""
    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if parent == os.getpid() and "busy_core.py" in command:
            found.add(int(proc.name))
    return found


def test_the_competitor_spins_in_its_own_process_only_while_its_block_runs():
    before = _spinners()
    with competitor(0.5):
        inside = _spinners() - before
        assert len(inside) == 1
    assert not _spinners() - before


def test_no_competitor_at_duty_zero_and_a_clear_error_outside_zero_to_one():
    with competitor(0.0):
        assert not _spinners()
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        with competitor(1.5):
            pass
