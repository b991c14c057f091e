"""A prompt chunk's NumPy work split by rows over the CPU path's threads (docs/DESIGN.md "Prompts in chunks").

Between the C kernels' OpenMP regions a CPU prompt chunk runs NumPy: the attention's products and softmax, the
FFN's activation. NumPy's loops and single-threaded BLAS calls release the GIL, so row ranges run in a thread pool
side by side. Every function given to :func:`run` computes its rows exactly as it would alone (elementwise or
row-wise work, each row's arithmetic unchanged), so the split changes no bit - only how many cores do it.

The thread count is set for the duration of a chunk by :func:`row_threads` (the CPU weights' ``threads``, which
the kernels use too). It belongs to the calling thread: two engines chunking in two threads each keep their own
count, and a thread that set none (the GPU path, a pool worker) runs :func:`run`'s tasks itself, in order. Each
count has its own pool of exactly that many workers (created once, kept for the process), so at most that many
tasks run at once; a :func:`run` inside a task runs in that task's thread (no pool waits on itself).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

_LOCAL = threading.local()  # n: this thread's count (absent: 1); worker: this thread is a pool worker
_LOCK = threading.Lock()
_POOLS: dict[int, ThreadPoolExecutor] = {}


@contextlib.contextmanager
def row_threads(n: int) -> Iterator[None]:
    """Within the block, in this thread, :func:`run` splits rows over ``n`` threads (at least 1)."""
    prev = getattr(_LOCAL, "n", 1)
    _LOCAL.n = max(1, int(n))
    try:
        yield
    finally:
        _LOCAL.n = prev


def threads() -> int:
    """Threads :func:`run` uses now in this thread (1 outside :func:`row_threads`, and in a pool worker)."""
    return 1 if getattr(_LOCAL, "worker", False) else getattr(_LOCAL, "n", 1)


def _mark_worker() -> None:
    _LOCAL.worker = True


def _pool(n: int) -> ThreadPoolExecutor:
    with _LOCK:
        if n not in _POOLS:
            _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix=f"strata-rows{n}", initializer=_mark_worker)
        return _POOLS[n]


def run(tasks: list[tuple[int, int]], fn: Callable[[int, int], None]) -> None:
    """``fn(a, b)`` for every row range ``(a, b)`` of ``tasks``: on :func:`threads` threads, each taking the next task
    as it frees (tasks of unequal work balance), or in order in this thread when that is 1 or there is one task.
    ``fn`` writes its rows' results itself (disjoint rows). The first task's exception (in task order) is raised here
    after every task has ended."""
    n = min(threads(), len(tasks))
    if n <= 1:
        for a, b in tasks:
            fn(a, b)
        return
    futures = [_pool(threads()).submit(fn, a, b) for a, b in tasks]
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


def ranges(n_rows: int, parts: int | None = None, min_rows: int = 16) -> list[tuple[int, int]]:
    """``range(n_rows)`` in ``parts`` (default :func:`threads`) contiguous ranges of near-equal size, fewer when a part
    would hold less than ``min_rows`` rows; ``[(0, n_rows)]`` when one is all there is."""
    parts = threads() if parts is None else parts
    parts = max(1, min(parts, n_rows // max(1, min_rows)))
    step = -(-n_rows // parts) if n_rows else 1
    return [(a, min(n_rows, a + step)) for a in range(0, n_rows, step)] or [(0, 0)]


__all__ = ["ranges", "row_threads", "run", "threads"]
