"""Device specs for the two SSD roles: `cuda:N`, `cpu:N` or `cpu:N-M` (cores a process is pinned to).

A CPU "device" is a set of cores: the process running that role is pinned to them with
`os.sched_setaffinity` and uses as many torch threads as it has cores, so the target and the draft
really run side by side instead of fighting over the same cores.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_SPEC = re.compile(r"^(cpu|cuda):(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # cpu | cuda
    index: int  # first core (cpu) or the GPU ordinal (cuda)
    last: int  # last core (cpu), = index for cuda

    @property
    def cores(self) -> tuple[int, ...]:
        return tuple(range(self.index, self.last + 1)) if self.kind == "cpu" else ()

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(f"cuda:{self.index}")

    def __str__(self) -> str:
        if self.kind == "cuda":
            return f"cuda:{self.index}"
        return f"cpu:{self.index}" if self.last == self.index else f"cpu:{self.index}-{self.last}"

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"{self} ({torch.cuda.get_device_name(self.index)})" if torch.cuda.is_available() else str(self)
        return f"{self} ({len(self.cores)} thread{'s' if len(self.cores) > 1 else ''})"


def parse_device(text: str) -> DeviceSpec:
    """`cpu:0`, `cpu:0-3` or `cuda:1`, checked against the cores and GPUs this machine has."""
    match = _SPEC.match(str(text).strip())
    if not match:
        raise ValueError(f"device {text!r} is not of the form cpu:N, cpu:N-M or cuda:N")
    kind, first, last = match.group(1), int(match.group(2)), match.group(3)
    last = first if last is None else int(last)
    if kind == "cuda":
        if match.group(3) is not None:
            raise ValueError(f"device {text!r}: a CUDA device is one GPU (cuda:N), not a range")
        count = torch.cuda.device_count()
        if first >= count:
            raise ValueError(f"device {text!r}: this machine has {count} CUDA device(s)")
        return DeviceSpec(kind, first, first)
    if last < first:
        raise ValueError(f"device {text!r}: the core range is empty")
    available = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    missing = [c for c in range(first, last + 1) if c not in available]
    if missing:
        raise ValueError(f"device {text!r}: cores {missing} do not exist (this machine has {os.cpu_count()} cores)")
    return DeviceSpec(kind, first, last)


def parse_devices(text: str) -> tuple[DeviceSpec, DeviceSpec]:
    """`target=cpu:0,draft=cpu:1` -> (target, draft). Overlapping core sets are refused."""
    parts = dict(p.split("=", 1) for p in str(text).split(",") if "=" in p)
    if set(parts) != {"target", "draft"}:
        raise ValueError(f"devices {text!r}: expected target=<device>,draft=<device>, e.g. target=cpu:0,draft=cpu:1")
    target, draft = parse_device(parts["target"]), parse_device(parts["draft"])
    if set(target.cores) & set(draft.cores):
        raise ValueError(f"devices {text!r}: target and draft share cores; SSD needs them apart")
    return target, draft


def default_devices() -> tuple[DeviceSpec, DeviceSpec]:
    """Split the cores this process may use: the draft gets the last one, the target the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError("SSD needs two devices, and this process may use only one core")
    return DeviceSpec("cpu", cores[0], cores[-2]), DeviceSpec("cpu", cores[-1], cores[-1])


def pin(device: DeviceSpec) -> None:
    """Bind the calling process to the device's cores with one torch thread per core."""
    if device.kind == "cpu":
        os.sched_setaffinity(0, device.cores)
        torch.set_num_threads(len(device.cores))


@contextmanager
def pinned(device: DeviceSpec) -> Iterator[None]:
    """Pin for the duration of a generation, then restore the caller's cores and threads."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    pin(device)
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
