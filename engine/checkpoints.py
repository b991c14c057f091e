"""Named start-up checkpoints: wall time and resident memory of each stage.

Start-up order is part of the contract (docs/DESIGN.md "The head before the cache": the head loaded
after the expert cache ate the cache's reserve), so stages are recorded in the order they ran and a
test can assert it. Memory is the process RSS from ``/proc/self/status`` (bytes; ``ru_maxrss`` peak where
/proc is absent); the GPU path adds its device figures in ``extra``.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

from pydantic import BaseModel, Field


def proc_kib_bytes(path: str, key: str) -> int | None:
    """The ``key:`` line of a /proc file given in kB (``/proc/self/status`` ``VmRSS``, ``/proc/meminfo``
    ``MemAvailable``), in bytes (kB x 1024); None where the file or the line is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Current resident set size of this process in bytes."""
    v = proc_kib_bytes("/proc/self/status", "VmRSS")
    if v is not None:
        return v
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


class Checkpoint(BaseModel):
    """One stage: seconds it took, RSS after it and the change during it (bytes), and notes."""

    name: str
    seconds: float
    rss_bytes: int
    rss_delta_bytes: int
    extra: dict[str, float | int | str] = Field(default_factory=dict)

    def line(self) -> str:
        notes = "".join(f", {k} {v}" for k, v in self.extra.items())
        return (
            f"checkpoint {self.name}: {self.seconds * 1000:.0f} ms, rss {self.rss_bytes / 2**20:.0f} MiB "
            f"({self.rss_delta_bytes / 2**20:+.0f} MiB){notes}"
        )


class Checkpoints:
    """Records stages; ``on_done`` (e.g. a ``--verbose`` printer) sees each as it completes."""

    def __init__(self, on_done: Callable[[Checkpoint], None] | None = None):
        self.done: list[Checkpoint] = []
        self.on_done = on_done

    @contextmanager
    def stage(self, name: str):
        extra: dict = {}
        r0, t0 = rss_bytes(), time.perf_counter()
        yield extra
        r1 = rss_bytes()
        cp = Checkpoint(name=name, seconds=time.perf_counter() - t0, rss_bytes=r1, rss_delta_bytes=r1 - r0, extra=extra)
        self.done.append(cp)
        if self.on_done:
            self.on_done(cp)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.done]
