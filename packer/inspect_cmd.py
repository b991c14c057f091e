"""``strata-pack inspect``: the tensor table of a GGUF file (or split model) or of a pack."""

from __future__ import annotations

import os
from pathlib import Path

from . import quants
from .gguf_file import open_model
from .packfmt import open_pack


def tensor_table(path: str | os.PathLike) -> list[dict]:
    """Rows ``{name, type, src_type, shape, bytes, location, offset}`` for a GGUF (any shard)
    or a pack directory. ``shape`` is ggml ne order; ``bytes`` is the size where it is stored
    (pool for dense pack tensors, per-expert part size x n_expert for routed experts)."""
    p = Path(path)
    rows = []
    if p.is_dir():
        pack = open_pack(p)
        for e in pack.index.entries:
            rows.append({"name": e.name, "type": quants.qtype(e.type).name, "src_type": quants.qtype(e.src_type).name,
                         "shape": [d for d in e.ne], "bytes": e.nbytes, "location": "pool", "offset": e.offset})
        if pack.experts:
            E = pack.experts.n_expert
            for r in pack.experts.layers:
                for part in ("gate", "up", "down"):
                    t = getattr(r, f"{part}_type")
                    rows.append({"name": f"blk.{r.layer}.ffn_{part}_exps", "type": quants.qtype(t).name,
                                 "src_type": quants.qtype(t).name, "shape": [], "bytes": E * getattr(r, f"{part}_bytes"),
                                 "location": f"shard{getattr(r, f'{part}_shard')}", "offset": getattr(r, f"{part}_off")})
        return rows
    model = open_model(p)
    for name, (k, t) in model.tensors.items():
        rows.append({"name": name, "type": t.type_name, "src_type": t.type_name, "shape": list(t.ne), "bytes": t.nbytes,
                     "location": f"shard{k}", "offset": t.abs_offset})
    return rows


def write_parquet(rows: list[dict], out: str | os.PathLike) -> None:
    """Write :func:`tensor_table` rows as Parquet (shape as list<int64>)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {k: [r[k] for r in rows] for k in ("name", "type", "src_type", "shape", "bytes", "location", "offset")}
    table = pa.table({k: pa.array(v, type=pa.list_(pa.int64()) if k == "shape" else None) for k, v in cols.items()})
    pq.write_table(table, out)
