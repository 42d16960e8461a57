"""What work on the draft's core costs the target's verification on its own core.

    python -m engine.ssd.contention_measure [--devices target=cpu:0,draft=cpu:1] [--rows 2] [--forwards 150] [--passes 5]

SSD gives the draft its own core, but two cores of one CPU share the last-level cache and the
memory bus, and the target's forward streams its weights from memory (about 90 MB a token for the
default target in q4_1, against a 32 MB L3 here). So a neighbour can slow the verification it
overlaps without taking any of its core. This times the default target's verification of `--rows`
positions, one thread on the target's core, while the draft's core is
  idle    nothing runs there;
  spin    a loop that touches no memory (what a busy core alone costs);
  memory  numpy copying a 256 MB array (a pure bandwidth load);
  draft   the default draft drafting K = 4 tokens again and again (what an SSD fill does).
The phases are interleaved pass by pass, each over a fixed count of forwards; the table gives each
phase's median ms and its ratio to idle in the same pass.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import NoReturn

import numpy as np
import torch

from engine.models import load_pair
from engine.sampling import REPORTED_SAMPLING
from engine.ssd.devices import DeviceSpec, parse_devices, pin

NEIGHBOURS = ("idle", "spin", "memory", "draft")
PROMPT = "Write a short story about a robot who learns to paint, in three paragraphs."


def neighbour(kind: str, device: DeviceSpec) -> NoReturn:
    """Run `kind` on `device` until killed; print 'ready' once it runs."""
    pin(device)
    if kind == "spin":
        print("ready", flush=True)
        x = 0
        while True:
            x += 1
    if kind == "memory":
        a = np.ones(64 << 20, dtype=np.float32)
        b = np.empty_like(a)
        print("ready", flush=True)
        while True:
            np.copyto(b, a)
    pair = load_pair("default")
    target, drafter = pair.make_target(), pair.make_drafter("model")
    ids = pair.encode_prompt(PROMPT)
    target.keep_hidden = True
    target.forward(ids)
    drafter.start()
    drafter.observe_target(0, target.last_hidden)
    print("ready", flush=True)
    while True:
        drafter.propose(ids, 4, REPORTED_SAMPLING, torch.rand(4))


def _start(kind: str, devices: str) -> subprocess.Popen | None:
    if kind == "idle":
        return None
    proc = subprocess.Popen([sys.executable, "-m", "engine.ssd.contention_measure", "--neighbour", kind,
                             "--devices", devices], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the {kind} neighbour did not start (exit code {proc.wait()})")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="target=cpu:0,draft=cpu:1", help="target=cpu:N,draft=cpu:M")
    parser.add_argument("--rows", type=int, default=2, help="positions verified per forward (K + 1)")
    parser.add_argument("--forwards", type=int, default=150, help="timed forwards per phase and pass")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--neighbour", choices=NEIGHBOURS[1:], help=argparse.SUPPRESS)  # the child's role
    args = parser.parse_args()
    target_device, draft_device = parse_devices(args.devices)
    if target_device.kind != "cpu" or draft_device.kind != "cpu":
        parser.error("both devices must be CPU cores: the question is what two cores of one CPU share")
    if args.neighbour:
        neighbour(args.neighbour, draft_device)
    pin(target_device)
    pair = load_pair("default")
    target = pair.make_target()
    target.forward(pair.encode_prompt(PROMPT))
    base, feed = target.length, [42] * args.rows
    times: dict[str, list[float]] = {kind: [] for kind in NEIGHBOURS}
    for _ in range(args.passes):
        for kind in NEIGHBOURS:
            proc = _start(kind, args.devices)
            try:
                for _ in range(args.forwards // 6):  # warm-up: the neighbour is running by now
                    target.forward(feed, last_n=args.rows)
                    target.rollback(base)
                per = []
                for _ in range(args.forwards):
                    start = time.perf_counter()
                    target.forward(feed, last_n=args.rows)
                    per.append(time.perf_counter() - start)
                    target.rollback(base)
                times[kind].append(statistics.median(per) * 1e3)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    print(f"target {target.backend_label} on {target_device}, {args.rows}-row verification, "
          f"draft's core {draft_device}: median ms per pass ({args.forwards} forwards each)")
    print("| draft's core | ms per pass | / idle per pass | median / idle |")
    print("|---|---|---|---|")
    for kind in NEIGHBOURS:
        ratios = [t / i for t, i in zip(times[kind], times["idle"])]
        print(f"| {kind} | {' / '.join(f'{t:.2f}' for t in times[kind])} | {' / '.join(f'{r:.3f}' for r in ratios)} "
              f"| {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
