"""A competing load for the benchmark: another process that keeps a share of one core busy.

Why: the engine rarely has its cores to itself. A browser on the same machine takes about half a
core while the playground streams (`playground.browser_bench`'s Chromium column), and a Space or a
workshop laptop runs other programs. Under OpenMP the fast backend split every GEMM evenly over its
threads, so a thread that lost its core held up the other at the end of each of the forward's ~150
parallel regions (session 36: -30 %); its own work pool (engine/models/work_pool.h) lets the
running thread take the rest. `python -m engine.bench --competitor 0.5` measures that reproducibly:
for the whole timed part, a process spins for `duty` of every 8 ms and sleeps for the rest, on
whichever core the OS gives it (as a browser would).

Run alone (`python engine/busy_core.py DUTY`) it spins until it is killed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

PERIOD_SECONDS = 0.008  # a few scheduler ticks: the length of a browser's frame work, not of a whole run


def spin(duty: float, period: float = PERIOD_SECONDS) -> None:
    """Busy for duty·period, asleep for the rest, forever."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < duty * period:
            pass
        if duty < 1:
            time.sleep((1 - duty) * period)


@contextmanager
def competitor(duty: float) -> Iterator[None]:
    """A `spin(duty)` process alive for the duration of the block (none for duty 0)."""
    if not 0 <= duty <= 1:
        raise ValueError(f"the competitor's duty must lie in [0, 1], got {duty}")
    if duty == 0:
        yield
        return
    # This file as a script, not `-m engine.busy_core`: the package's import (torch) would take a
    # whole core for a second or two of the first timed repeat.
    proc = subprocess.Popen([sys.executable, __file__, str(duty)])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    spin(float(sys.argv[1]))
