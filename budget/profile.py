"""The expert profile file: routing counts per (layer, expert), one reader and one writer.

A profile is Parquet with integer columns ``layer``, ``expert``, ``count``, one row per (layer,
expert) pair that was routed to (``strata-engine profile`` writes it by counting the router's
selections over prompts). ``strata-budget check --expert-profile`` fills the planned cache with it
and reports the expected hit rate; ``strata-engine generate --expert-profile`` fills the real cache
the same way (:func:`strata.budget.formulas.fill_profile`). The file records the model it was recorded on
(:func:`model_identity`, in the Parquet schema's metadata); a profile of another model is refused by name
(:func:`check_profile_model`). A profile without that record (written by another tool, or before
2026-12-01) is accepted on its index ranges alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from strata.packer.pack_plan import is_router_tensor
from strata.packer.packfmt import GEOMETRY_FILE
from strata.packer.parquet_io import read_parquet_table

from .errors import PlanInputError

#: Columns of an expert profile (Parquet), each of an integer type.
PROFILE_COLUMNS = ("layer", "expert", "count")
#: What an expert profile must be, as the refusals say it.
PROFILE_REQUIRED = "a Parquet file with columns layer, expert, count"
#: Parquet schema-metadata keys: the identity of the model the profile was recorded on, and its name for people.
PROFILE_MODEL_KEY, PROFILE_MODEL_NAME_KEY = b"strata.model", b"strata.model_name"


def read_parquet(path: str | Path, what: str, required: str, *, schema_only: bool = False):
    """The Parquet table at ``path`` (its schema only with ``schema_only``): the one opening of the budget's
    Parquet inputs (expert profiles, routing traces). ``what`` starts the refusal (``--expert-profile P``,
    ``routing trace P``); ``required`` says what the file must be.

    Raises:
        PlanInputError: a file pyarrow cannot read as Parquet, naming it and pyarrow's reason.
    """
    import pyarrow.parquet as pq

    try:
        with open(path, "rb") as f:  # a file object: pyarrow takes no path that is not UTF-8
            return pq.read_schema(f) if schema_only else read_parquet_table(f)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise PlanInputError(
            f"{what}: not a readable Parquet file ({e})", tensor=str(path), found="not Parquet", required=required
        ) from None


def model_identity(pack) -> tuple[str, str]:
    """``(identity, name)`` of the model a pack was built from, as routing sees it: identity = the first 16 hex
    digits of the sha256 of its ``geometry.txt`` and of every router weight's bytes in ``pool.bin`` (the
    ``ffn_gate_inp`` tensors, by name: what decides which experts a token selects) - the same for every pack
    of one model, whatever the experts' quantization, different for other weights; name = ``<arch>
    '<general.name>'``. ``pack``: a :class:`strata.packer.pack.Pack`. Reads the routers once (48 x 1 MiB for a
    30B-A3B model).
    """
    import hashlib

    h = hashlib.sha256((pack.path / GEOMETRY_FILE).read_bytes())
    routers = sorted((e for e in pack.index.entries if is_router_tensor(e.name)), key=lambda e: e.name)
    if routers:
        with open(pack.pool_path, "rb") as f:
            for e in routers:
                h.update(e.name.encode() + b"\0" + os.pread(f.fileno(), e.nbytes, e.offset))
    return h.hexdigest()[:16], f"{pack.arch} {str(pack.metadata.get('general.name', '?'))!r}"


def read_profile_model(path: str | Path) -> tuple[str, str] | None:
    """The ``(identity, name)`` a profile records (:func:`model_identity`), None when it records none.

    Raises:
        PlanInputError: a file that is not readable Parquet (as :func:`read_profile`).
    """
    meta = read_parquet(path, f"--expert-profile {path}", PROFILE_REQUIRED, schema_only=True).metadata or {}
    if PROFILE_MODEL_KEY not in meta:
        return None
    return meta[PROFILE_MODEL_KEY].decode(), meta.get(PROFILE_MODEL_NAME_KEY, b"?").decode()


def check_profile_model(path: str | Path, pack) -> None:
    """Refuse a profile recorded on another model than ``pack``'s (:func:`model_identity`): its routing counts
    would fill the cache with another model's hot experts. A profile that records no model passes.

    Raises:
        PlanInputError: naming the file, the model it was recorded on and this pack's, with both identities.
    """
    got = read_profile_model(path)
    if got is None:
        return
    want = model_identity(pack)
    if got[0] != want[0]:
        raise PlanInputError(
            f"--expert-profile {path}: recorded on another model ({got[1]}, model {got[0]}); this pack is "
            f"{want[1]}, model {want[0]} - record a profile of this pack with strata-engine profile",
            tensor=str(path),
            found=f"model {got[0]} ({got[1]})",
            required=f"model {want[0]} ({want[1]})",
        )


def _once(seen: dict[tuple[int, int], int], rows: list[tuple[int, int, int]], i: int, src) -> None:
    """Row ``i``'s (layer, expert) pair has not appeared before (``seen``: pair -> first row); record it.

    Raises:
        PlanInputError: naming both rows, the pair and both counts.
    """
    layer, expert, count = rows[i]
    if (layer, expert) in seen:
        j = seen[layer, expert]
        raise PlanInputError(
            f"{src} rows {j} and {i}: the pair (layer {layer}, expert {expert}) appears twice "
            f"(counts {rows[j][2]} and {count}); each (layer, expert) pair must appear once",
            tensor=f"{src} row {i}",
            found=f"(layer {layer}, expert {expert}) again (first at row {j})",
            required="each (layer, expert) pair once",
        )
    seen[layer, expert] = i


def read_profile(path: str | Path) -> list[tuple[int, int, int]]:
    """Read an expert profile: Parquet with integer columns ``layer``, ``expert``, ``count``; one row
    per (layer, expert) pair, every value >= 0. Only integer column types are accepted: a float
    count is refused, never truncated (nor a bool, string or list column).

    Raises:
        PlanInputError: no such file, a file that is not Parquet, missing columns (naming them), a
            column of another type or with nulls (naming it and a row), no rows, a negative value or
            a duplicated (layer, expert) pair (naming the rows). Rows are numbered from 0.
    """
    import pyarrow as pa

    p = Path(path)
    if not p.exists():
        raise PlanInputError(
            f"--expert-profile {path}: no such file",
            tensor=str(path),
            found="no such file",
            required=PROFILE_REQUIRED,
        )
    if p.is_dir():
        raise PlanInputError(
            f"--expert-profile {path}: is a directory, not a Parquet file",
            tensor=str(path),
            found="a directory",
            required=PROFILE_REQUIRED,
        )
    table = read_parquet(p, f"--expert-profile {path}", PROFILE_REQUIRED)
    missing = [c for c in PROFILE_COLUMNS if c not in table.column_names]
    if missing:
        raise PlanInputError(
            f"{path}: expert profile lacks column(s) {missing}; it has {table.column_names}",
            tensor=str(path),
            found=f"columns {table.column_names}",
            required="columns layer, expert, count",
        )
    cols = []
    for c in PROFILE_COLUMNS:
        col = table.column(c)
        if not pa.types.is_integer(col.type):
            values = col.to_pylist()
            i = 0
            if pa.types.is_floating(col.type):  # show a value truncation would have changed
                i = next((k for k, v in enumerate(values) if v is not None and not float(v).is_integer()), 0)
            example = f"; row {i} holds {values[i]!r}" if values else ""
            raise PlanInputError(
                f"{path}: column {c} has type {col.type}, an expert profile needs integer columns "
                f"(int8..int64 or uint8..uint64; values are never truncated or converted){example}",
                tensor=f"{path}:{c}",
                found=str(col.type),
                required="an integer type",
            )
        if col.null_count:
            i = next(k for k, v in enumerate(col.to_pylist()) if v is None)
            raise PlanInputError(
                f"{path}: column {c} has {col.null_count} null value(s), the first at row {i}",
                tensor=f"{path}:{c}",
                found=f"{col.null_count} null(s)",
                required="no nulls",
            )
        cols.append(col.to_pylist())
    rows = list(zip(*cols))
    if not rows:
        raise PlanInputError(
            f"{path}: the expert profile has no rows",
            tensor=str(path),
            found="0 rows",
            required="one row per profiled (layer, expert) pair",
        )
    seen: dict[tuple[int, int], int] = {}
    for i, (layer, expert, count) in enumerate(rows):
        for c, v in zip(PROFILE_COLUMNS, (layer, expert, count)):
            if v < 0:
                raise PlanInputError(
                    f"{path} row {i}: {c} {v} is negative (layer {layer}, expert {expert}, count {count})",
                    tensor=f"{path} row {i}",
                    found=f"{c} {v}",
                    required=f"{c} >= 0",
                )
        _once(seen, rows, i, path)
    return rows


def write_profile(
    rows: list[tuple[int, int, int]],
    out: str | Path,
    *,
    force: bool = False,
    inputs: tuple[str | Path, ...] = (),
    model: tuple[str, str] | None = None,
) -> None:
    """Write ``(layer, expert, count)`` rows as Parquet: ``layer``, ``expert`` int32, ``count`` int64
    (what :func:`read_profile` reads back); ``model``: the ``(identity, name)`` of the model the rows were
    recorded on (:func:`model_identity`), kept in the schema's metadata.

    Raises:
        OutputError: ``out`` exists (without ``force``), is one of ``inputs``, a pack's file or a GGUF
            (:func:`strata.packer.outputs.check_overwrite`).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from strata.packer.outputs import atomic_output

    table = pa.table(
        {
            "layer": pa.array([r[0] for r in rows], pa.int32()),
            "expert": pa.array([r[1] for r in rows], pa.int32()),
            "count": pa.array([r[2] for r in rows], pa.int64()),
        }
    )
    if model is not None:
        table = table.replace_schema_metadata({PROFILE_MODEL_KEY: model[0], PROFILE_MODEL_NAME_KEY: model[1]})
    with atomic_output(out, force=force, inputs=inputs) as tmp:  # beside ``out``, renamed: nothing half-written
        with open(tmp, "wb") as f:  # a file object: pyarrow takes no path that is not UTF-8
            pq.write_table(table, f)


def check_profile_pairs(
    pairs: list[tuple[int, int, int]], moe: set[int], n_expert: int, src: str = "expert profile"
) -> None:
    """Every ``(layer, expert, count)`` row names an MoE layer of ``moe`` and an expert id in ``0..n_expert-1``,
    once, with a count >= 0 (rows numbered from 0, as the file stores them). Used by the budget's plan and
    by strata-engine generate (one rule for both).

    Raises:
        PlanInputError: the first bad row (file, row, what was found and what is required).
    """
    seen: dict[tuple[int, int], int] = {}
    for i, (layer, expert, count) in enumerate(pairs):
        if layer not in moe:
            raise PlanInputError(
                f"{src} row {i}: layer {layer} has no routed experts (MoE layers: {layer_span(sorted(moe))})",
                tensor=f"{src} row {i}",
                found=f"layer {layer}",
                required=f"an MoE layer ({layer_span(sorted(moe))})",
            )
        if not 0 <= expert < n_expert:
            raise PlanInputError(
                f"{src} row {i}: layer {layer} expert {expert} is outside 0..{n_expert - 1}",
                tensor=f"{src} row {i}",
                found=f"expert {expert}",
                required=f"0..{n_expert - 1}",
            )
        if count < 0:
            raise PlanInputError(
                f"{src} row {i}: layer {layer} expert {expert} has negative count {count}",
                tensor=f"{src} row {i}",
                found=f"count {count}",
                required="a count >= 0",
            )
        _once(seen, pairs, i, src)


def layer_span(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"`` (at most 6 pieces shown)."""
    parts: list[str] = []
    for L in sorted(set(layers)):
        if parts and isinstance(parts[-1], list) and parts[-1][1] == L - 1:
            parts[-1][1] = L
        else:
            parts.append([L, L])
    text = [f"{a}" if a == b else f"{a}..{b}" for a, b in parts]
    return ", ".join(text[:6]) + (f", ... ({len(set(layers))} layers)" if len(text) > 6 else "")


__all__ = [
    "PROFILE_COLUMNS",
    "check_profile_model",
    "check_profile_pairs",
    "layer_span",
    "model_identity",
    "read_profile",
    "read_profile_model",
    "write_profile",
]
