"""A prompt chunk's NumPy work split by rows over the CPU path's threads (docs/DESIGN.md "Prompts in chunks").

Between the C kernels' OpenMP regions a CPU prompt chunk runs NumPy: the attention's products and softmax, the
FFN's activation. NumPy's loops and single-threaded BLAS calls release the GIL, so row ranges run in a thread pool
side by side. Every function given to :func:`run` computes its rows exactly as it would alone (elementwise or
row-wise work, each row's arithmetic unchanged), so the split changes no bit - only how many cores do it.

The thread count is set for the duration of a chunk by :func:`row_threads` (the CPU weights' ``threads``, which
the kernels use too); outside one it is 1 and :func:`run` calls the function on all rows in the caller's thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

_N = [1]
_LOCK = threading.Lock()
_POOL: list[ThreadPoolExecutor | None] = [None]
_POOL_N = [0]


@contextlib.contextmanager
def row_threads(n: int) -> Iterator[None]:
    """Within the block :func:`run` splits rows over ``n`` threads (at least 1)."""
    prev = _N[0]
    _N[0] = max(1, int(n))
    try:
        yield
    finally:
        _N[0] = prev


def threads() -> int:
    """Threads :func:`run` uses now (1 outside :func:`row_threads`)."""
    return _N[0]


def _pool(n: int) -> ThreadPoolExecutor:
    with _LOCK:
        if _POOL[0] is None or _POOL_N[0] < n:
            if _POOL[0] is not None:
                _POOL[0].shutdown(wait=True)
            _POOL[0], _POOL_N[0] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="strata-rows"), n
        return _POOL[0]


def run(tasks: list[tuple[int, int]], fn: Callable[[int, int], None]) -> None:
    """``fn(a, b)`` for every row range ``(a, b)`` of ``tasks``: on :func:`threads` threads, each taking the next task
    as it frees (tasks of unequal work balance), or in order in this thread when that is 1 or there is one task.
    ``fn`` writes its rows' results itself (disjoint rows). An exception in a task is raised here."""
    n = min(_N[0], len(tasks))
    if n <= 1:
        for a, b in tasks:
            fn(a, b)
        return
    for f in [_pool(n).submit(fn, a, b) for a, b in tasks]:
        f.result()


def ranges(n_rows: int, parts: int | None = None, min_rows: int = 16) -> list[tuple[int, int]]:
    """``range(n_rows)`` in ``parts`` (default :func:`threads`) contiguous ranges of near-equal size, fewer when a part
    would hold less than ``min_rows`` rows; ``[(0, n_rows)]`` when one is all there is."""
    parts = threads() if parts is None else parts
    parts = max(1, min(parts, n_rows // max(1, min_rows)))
    step = -(-n_rows // parts) if n_rows else 1
    return [(a, min(n_rows, a + step)) for a in range(0, n_rows, step)] or [(0, 0)]


__all__ = ["ranges", "row_threads", "run", "threads"]
