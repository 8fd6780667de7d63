"""Timing on the device's clock: CUDA events on the GPU, the host's perf_counter on the CPU (where copies and compute
are synchronous). One home for "time this", used by the pacer's budgets, the probes, calibrate, run and bench."""

from __future__ import annotations

import time
from typing import Any, Callable


class HostStamp:
    """A CPU stand-in for a timing event: the host time when recorded."""

    __slots__ = ("t",)

    def __init__(self):
        self.t = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.t is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "HostStamp") -> float:
        """Milliseconds from this stamp to `other`, like torch.cuda.Event.elapsed_time."""
        return (other.t - self.t) * 1e3


def timing_event(cuda: bool):
    """A timing event of the device's clock."""
    if cuda:
        import torch

        return torch.cuda.Event(enable_timing=True)
    return HostStamp()


class EventPool:
    """Reusable timing events, handed out in order; `reset()` starts over (the previous ones are overwritten)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.events: list = []
        self.n = 0

    def next(self):
        if self.n == len(self.events):
            self.events.append(timing_event(self.cuda))
        self.n += 1
        return self.events[self.n - 1]

    def used(self) -> list:
        return self.events[: self.n]

    def reset(self) -> None:
        self.n = 0


def time_on(cuda: bool, fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), seconds it took on the device): CUDA events around it then a wait for the end event on the GPU,
    perf_counter on the CPU. Synchronizes: for measurement, never the runtime's hot path."""
    a, b = timing_event(cuda), timing_event(cuda)
    a.record()
    out = fn()
    b.record()
    b.synchronize()
    return out, a.elapsed_time(b) / 1e3
