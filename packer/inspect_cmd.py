"""``strata-pack inspect``: the tensor table of a GGUF file (or split model) or of a pack."""

from __future__ import annotations

import os
from pathlib import Path

from . import quants
from .gguf_file import open_model
from .pack import open_pack


def tensor_table(path: str | os.PathLike) -> list[dict]:
    """Rows ``{name, type, src_type, shape, bytes, location, offset}`` for a GGUF (any shard)
    or a pack directory. ``shape`` is ggml ne order; ``bytes`` is the size where it is stored
    (pool for dense pack tensors, per-expert part size x n_expert for routed experts)."""
    p = Path(path)
    rows = []
    if p.is_dir():
        pack = open_pack(p)
        for e in pack.index.entries:
            ne = list(e.ne)
            while len(ne) > 1 and ne[-1] == 1:  # as the GGUF stores it: trailing 1s dropped
                ne.pop()
            rows.append(
                {
                    "name": e.name,
                    "type": quants.qtype(e.type).name,
                    "src_type": quants.qtype(e.src_type).name,
                    "shape": ne,
                    "bytes": e.nbytes,
                    "location": "pool",
                    "offset": e.offset,
                }
            )
        if pack.experts:
            E = pack.experts.n_expert
            n_embd = int(pack.geometry_params.get("n_embd", 0))
            for r in pack.experts.layers:
                for part in ("gate", "up", "down"):
                    t = quants.qtype(getattr(r, f"{part}_type"))
                    nbytes = getattr(r, f"{part}_bytes")
                    # per-expert elements / n_embd = the other dim (n_ff_exp), from the bytes and the type
                    other = nbytes // t.block_bytes * t.block_elems // n_embd if n_embd else 0
                    shape = [n_embd, other, E] if part != "down" else [other, n_embd, E]
                    rows.append(
                        {
                            "name": f"blk.{r.layer}.ffn_{part}_exps.weight",
                            "type": t.name,
                            "src_type": t.name,
                            "shape": shape,
                            "bytes": E * nbytes,
                            "location": f"shard{getattr(r, f'{part}_shard')}",
                            "offset": getattr(r, f"{part}_off"),
                        }
                    )
        return rows
    model = open_model(p)
    for name, (k, t) in model.tensors.items():
        rows.append(
            {
                "name": name,
                "type": t.type_name,
                "src_type": t.type_name,
                "shape": list(t.ne),
                "bytes": t.nbytes,
                "location": f"shard{k}",
                "offset": t.abs_offset,
            }
        )
    return rows


COLUMNS = ("name", "type", "src_type", "shape (ne)", "bytes", "location", "offset")
_RIGHT = ("bytes", "offset")


def _cells(r: dict) -> list[str]:
    return [r["name"], r["type"], r["src_type"], str(r["shape"]), str(r["bytes"]), r["location"], str(r["offset"])]


def plain_table(rows: list[dict]) -> list[str]:
    """The table as plain text lines: a header, then one line per tensor, columns padded to their
    widest cell (two spaces apart), nothing cut whatever the width: what a pipe gets."""
    cells = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    out = []
    for c in cells:
        parts = [v.rjust(w) if COLUMNS[i] in _RIGHT else v.ljust(w) for i, (v, w) in enumerate(zip(c, widths))]
        out.append("  ".join(parts).rstrip())
    return out


def print_table(rows: list[dict], title: str, *, terminal: bool) -> None:
    """Print :func:`tensor_table` rows: on a terminal a rich table whose cells wrap (``fold``) rather
    than being cut; otherwise :func:`plain_table` (no width limit)."""
    import click

    if not terminal:
        click.echo(title)
        for line in plain_table(rows):
            click.echo(line)
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title))
    for c in COLUMNS:
        t.add_column(c, justify="right" if c in _RIGHT else "left", overflow="fold")
    for r in rows:
        t.add_row(*(escape(v) for v in _cells(r)))
    Console().print(t)


def write_parquet(
    rows: list[dict], out: str | os.PathLike, *, force: bool = False, inputs: tuple[str | os.PathLike, ...] = ()
) -> None:
    """Write :func:`tensor_table` rows as Parquet (shape as list<int64>), under a temporary name beside
    ``out`` renamed into place when complete (an interrupted write leaves nothing).

    Raises:
        OutputError: ``out`` exists (without ``force``), is one of ``inputs``, a pack's file or a GGUF
            (:func:`strata.packer.outputs.check_overwrite`).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .outputs import atomic_output

    cols = {k: [r[k] for r in rows] for k in ("name", "type", "src_type", "shape", "bytes", "location", "offset")}
    table = pa.table({k: pa.array(v, type=pa.list_(pa.int64()) if k == "shape" else None) for k, v in cols.items()})
    with atomic_output(out, force=force, inputs=inputs) as tmp:
        with open(tmp, "wb") as f:  # a file object: pyarrow takes no path that is not UTF-8
            pq.write_table(table, f)
