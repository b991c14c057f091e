"""The routing trace: which experts every position routed to, layer by layer, in the order they were chosen.

A trace is what an expert cache sees, so any cache policy can be replayed on it offline
(:mod:`strata.budget.replay`). ``strata-engine`` records it through its routing hook
(:func:`strata.engine.routing.trace_routing`); the file is Parquet with integer columns ``seq`` (the
prompt, from 0), ``position`` (in its sequence: prompt positions, then generated ones), ``layer`` and
``expert``, one row per selected expert, in selection order: a position's MoE layers in order, each
layer's ``n_expert_used`` choices in the router's order. Summing a trace per (layer, expert) gives the
expert profile (:func:`trace_counts`, the rows :func:`strata.budget.profile.write_profile` writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import PlanInputError
from .profile import read_parquet

#: Columns of a routing trace (Parquet), each of an integer type.
TRACE_COLUMNS = ("seq", "position", "layer", "expert")


@dataclass(frozen=True)
class RoutingTrace:
    """One row per routed expert selection, in the order the router made them: four int64 arrays of one
    length ``n`` (numpy order, ``(n,)``). A *step* is one (seq, position): consecutive rows with the same
    pair; :meth:`steps` numbers them."""

    seq: np.ndarray
    position: np.ndarray
    layer: np.ndarray
    expert: np.ndarray

    def __post_init__(self) -> None:
        cols = [np.asarray(getattr(self, c), dtype=np.int64).reshape(-1) for c in TRACE_COLUMNS]
        if len({c.size for c in cols}) != 1:
            raise ValueError(f"routing trace: columns of different lengths {[c.size for c in cols]}")
        for name, c in zip(TRACE_COLUMNS, cols):
            object.__setattr__(self, name, c)

    @classmethod
    def from_rows(cls, rows: list[tuple[int, int, int, int]]) -> RoutingTrace:
        """A trace from ``(seq, position, layer, expert)`` tuples, in order."""
        a = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
        return cls(a[:, 0], a[:, 1], a[:, 2], a[:, 3])

    @classmethod
    def concat(cls, traces: list[RoutingTrace]) -> RoutingTrace:
        """The traces one after the other, ``seq`` renumbered so each trace's sequences follow the previous
        trace's (a cache that lives across them sees them in this order)."""
        parts, base = [], 0
        for t in traces:
            parts.append((t.seq + base, t.position, t.layer, t.expert))
            base += int(t.seq.max()) + 1 if len(t) else 0
        if not parts:
            return cls(*(np.zeros(0, np.int64) for _ in TRACE_COLUMNS))
        return cls(*(np.concatenate([p[i] for p in parts]) for i in range(4)))

    def __len__(self) -> int:
        return int(self.seq.size)

    def steps(self) -> np.ndarray:
        """Step index of every row (int64 ``(n,)``, from 0): it grows by one where (seq, position) changes."""
        if not len(self):
            return np.zeros(0, np.int64)
        change = (self.seq[1:] != self.seq[:-1]) | (self.position[1:] != self.position[:-1])
        return np.concatenate([[0], np.cumsum(change)]).astype(np.int64)

    @property
    def n_steps(self) -> int:
        """Number of steps (positions routed), 0 for an empty trace."""
        return int(self.steps()[-1]) + 1 if len(self) else 0

    def n_expert_used(self) -> int:
        """Most selections one layer made at one step (the model's ``n_expert_used``), 0 for an empty trace."""
        if not len(self):
            return 0
        key = self.steps() * (int(self.layer.max()) + 1) + self.layer
        return int(np.unique(key, return_counts=True)[1].max())

    def select(self, seqs: list[int] | np.ndarray) -> RoutingTrace:
        """The rows of the sequences ``seqs`` (their ``seq`` kept), in trace order."""
        m = np.isin(self.seq, np.asarray(seqs, dtype=np.int64))
        return RoutingTrace(self.seq[m], self.position[m], self.layer[m], self.expert[m])


def trace_counts(trace: RoutingTrace) -> list[tuple[int, int, int]]:
    """The expert profile of ``trace``: ``(layer, expert, count)`` rows sorted by layer, expert, one per pair
    selected at least once (what ``strata-engine profile`` counts over the same prompts)."""
    if not len(trace):
        return []
    pairs, counts = np.unique(np.stack([trace.layer, trace.expert], axis=1), axis=0, return_counts=True)
    return [(int(L), int(e), int(c)) for (L, e), c in zip(pairs, counts)]


def write_trace(
    trace: RoutingTrace, out: str | Path, *, force: bool = False, inputs: tuple[str | Path, ...] = ()
) -> None:
    """Write ``trace`` as Parquet: ``seq``, ``position`` int32, ``layer``, ``expert`` int16 (what
    :func:`read_trace` reads back), in trace order.

    Raises:
        OutputError: ``out`` exists (without ``force``), is one of ``inputs``, a pack's file or a GGUF
            (:func:`strata.packer.outputs.check_overwrite`).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from strata.packer.outputs import atomic_output

    types = {"seq": pa.int32(), "position": pa.int32(), "layer": pa.int16(), "expert": pa.int16()}
    table = pa.table({c: pa.array(getattr(trace, c), types[c]) for c in TRACE_COLUMNS})
    with atomic_output(out, force=force, inputs=inputs) as tmp:
        pq.write_table(table, tmp)


def read_trace(path: str | Path) -> RoutingTrace:
    """Read a routing trace written by :func:`write_trace` (integer columns ``seq``, ``position``, ``layer``,
    ``expert``; other columns are ignored).

    Raises:
        PlanInputError: no such file, not Parquet, a missing column (naming it), a column that is not of an
            integer type or holds nulls, or a negative value (naming the column and the first row).
    """
    import pyarrow as pa

    p = Path(path)
    req = "a Parquet file with integer columns seq, position, layer, expert"
    if not p.is_file():
        raise PlanInputError(
            f"routing trace {path}: no such file", tensor=str(path), found="no such file", required=req
        )
    table = read_parquet(p, f"routing trace {path}", req)
    missing = [c for c in TRACE_COLUMNS if c not in table.column_names]
    if missing:
        raise PlanInputError(
            f"routing trace {path}: lacks column(s) {missing}; it has {table.column_names}",
            tensor=str(path),
            found=f"columns {table.column_names}",
            required=req,
        )
    cols = []
    for c in TRACE_COLUMNS:
        col = table.column(c)
        if not pa.types.is_integer(col.type) or col.null_count:
            raise PlanInputError(
                f"routing trace {path}: column {c} has type {col.type} with {col.null_count} null(s); "
                f"a trace needs integer columns without nulls",
                tensor=f"{path}:{c}",
                found=f"{col.type}, {col.null_count} null(s)",
                required="an integer type, no nulls",
            )
        a = col.to_numpy().astype(np.int64)
        if a.size and a.min() < 0:
            i = int(np.argmax(a < 0))
            raise PlanInputError(
                f"routing trace {path} row {i}: {c} {int(a[i])} is negative",
                tensor=f"{path} row {i}",
                found=f"{c} {int(a[i])}",
                required=f"{c} >= 0",
            )
        cols.append(a)
    return RoutingTrace(*cols)


__all__ = ["TRACE_COLUMNS", "RoutingTrace", "read_trace", "trace_counts", "write_trace"]
