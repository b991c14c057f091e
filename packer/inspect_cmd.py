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
            rows.append({"name": e.name, "type": quants.qtype(e.type).name, "src_type": quants.qtype(e.src_type).name,
                         "shape": ne, "bytes": e.nbytes, "location": "pool", "offset": e.offset})
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
                    rows.append({"name": f"blk.{r.layer}.ffn_{part}_exps.weight", "type": t.name, "src_type": t.name,
                                 "shape": shape, "bytes": E * nbytes, "location": f"shard{getattr(r, f'{part}_shard')}",
                                 "offset": getattr(r, f"{part}_off")})
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
