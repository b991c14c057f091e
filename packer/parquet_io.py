"""The one way strata reads a Parquet file (the pack's tokenizer tables, expert profiles, routing traces).

``pyarrow.parquet.read_table(..., use_threads=False)``: the files are small (a vocabulary of ~150k rows, a profile of
at most n_layer x n_expert rows), and a threaded read left pyarrow's pool threads running when a tool refused the file
and exited right after: the process then died in ``std::terminate`` ("terminate called without an active
exception", exit 134 instead of the refusal's 2) in 8 of 30 runs of ``strata-budget check --expert-profile`` on a
profile with a duplicated pair (2026-12-02); none in 30 with the single-threaded read.
"""

from __future__ import annotations

from typing import BinaryIO


def read_parquet_table(f: BinaryIO):
    """The ``pyarrow.Table`` in the open binary file ``f`` (a file object: pyarrow takes no path that is not UTF-8),
    read on the calling thread (module docstring). Raises what pyarrow raises for a file it cannot read."""
    import pyarrow.parquet as pq

    return pq.read_table(f, use_threads=False)


__all__ = ["read_parquet_table"]
