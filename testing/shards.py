"""Split GGUF files (``NAME-00001-of-0000N.gguf``) of any size written with strata's own writer.

:func:`write_split` lays out a tensor list over ``n_shards`` complete GGUF files as llama-gguf-split
does (docs/FORMAT.md "Split shards": each shard has its own header and offsets; shard 0 carries every
KV plus ``split.no`` u16, ``split.count`` u16, ``split.tensors.count`` i32, the other shards only those
three). The data is the tiled block pattern of :func:`strata.testing.blocks.pattern_chunks` (bytes
identical to :func:`strata.testing.blocks.pattern_fill`) for weight matrices above 4 MiB, random blocks
(:func:`strata.testing.blocks.make_random_blocks`) for smaller ones (routers) and the role values of
:func:`strata.testing.blocks.role_values` for norms, conv kernels and vectors, one random stream per
tensor (:func:`strata.testing.blocks.tensor_rng`), written in 64 MiB pieces and one process per shard:
the qwen3next reference model (~45 GB) in about a minute where the page cache takes the writes.

Unlike ``gguf.GGUFWriter`` (:func:`strata.testing.models.write_model`), type ids gguf-py does not
know (42 = Q2_0) are accepted, and no tensor is ever held whole in memory.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf.constants import GGUFValueType

from .blocks import make_random_blocks, pattern_chunks, role_values, tensor_rng
from .gguf_writer import (
    DEFAULT_ALIGNMENT,
    KV,
    HeaderLayout,
    TensorDecl,
    TensorLayout,
    encode_header,
    infer_kv,
    tensor_layouts,
)
from .models import fill_role, shard_names

__all__ = ["SplitFill", "split_bounds", "tensor_role", "write_split"]

SplitFill = Literal["pattern", "sparse"]


def tensor_role(name: str) -> str:
    """A tensor's role: its name without the ``blk.N.`` prefix (``blk.3.attn_q.weight`` -> ``attn_q.weight``)."""
    parts = name.split(".", 2)
    return parts[2] if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit() else name


def split_bounds(nbytes: Sequence[int], n_shards: int) -> list[range]:
    """Tensor index ranges of ``n_shards`` shards holding about equal bytes, in order (each non-empty).

    Raises:
        ValueError: fewer tensors than shards.
    """
    n = len(nbytes)
    if n < n_shards:
        raise ValueError(f"{n} tensors cannot fill {n_shards} non-empty shards")
    total = sum(nbytes)
    out, start, acc = [], 0, 0
    for k in range(1, n_shards):
        target = total * k / n_shards
        i = start
        while i < n - (n_shards - k) and (acc + nbytes[i] <= target or i == start):
            acc += nbytes[i]
            i += 1
        out.append(range(start, i))
        start = i
    out.append(range(start, n))
    return out


#: Tensors up to this many bytes are random throughout (routers, norms, small projections), larger ones the
#: tiled pattern: a router whose rows repeated with the pattern's period would send every token to the same
#: few experts, and a profile of such routing would say nothing about a cache.
RANDOM_MAX_BYTES = 4 << 20


def _tensor_bytes(ti: TensorLayout, seed: int):
    """The bytes of one tensor, in pieces: role values for norms / vectors / conv kernels, random blocks up
    to :data:`RANDOM_MAX_BYTES`, else the pattern."""
    rng = tensor_rng(seed, ti.name)
    role = tensor_role(ti.name)
    kind = fill_role(role, ti.ne, "_exps" in role)
    x = role_values(kind, math.prod(ti.ne), rng)
    if x is not None and ti.type_id == 0:
        yield x.astype("<f4").view(np.uint8)
    elif (ti.nbytes or 0) <= RANDOM_MAX_BYTES:
        yield make_random_blocks(ti.type_id, math.prod(ti.ne), rng)
    else:
        yield from pattern_chunks(ti.type_id, ti.ne, rng)


def _write_data(jobs: list[tuple[str, TensorLayout]], seed: int) -> None:
    """Write each ``(file, tensor)`` job's bytes at the tensor's absolute offset (``pwrite``)."""
    fds: dict[str, int] = {}
    try:
        for path, ti in jobs:
            if path not in fds:
                fds[path] = os.open(path, os.O_WRONLY)
            pos = ti.abs_offset
            for piece in _tensor_bytes(ti, seed):
                mv = memoryview(np.ascontiguousarray(piece)).cast("B")
                while mv:
                    k = os.pwrite(fds[path], mv, pos)
                    pos += k
                    mv = mv[k:]
            if pos != ti.abs_offset + (ti.nbytes or 0):
                raise RuntimeError(f"{ti.name}: wrote {pos - ti.abs_offset} bytes, its shape needs {ti.nbytes}")
    finally:
        for fd in fds.values():
            os.close(fd)


def _balance(jobs: list[tuple[str, TensorLayout]], workers: int) -> list[list[tuple[str, TensorLayout]]]:
    """``jobs`` dealt to ``workers`` lists of about equal bytes (largest first, to the lightest list)."""
    out: list[list[tuple[str, TensorLayout]]] = [[] for _ in range(workers)]
    load = [0] * workers
    for job in sorted(jobs, key=lambda j: -(j[1].nbytes or 0)):
        k = load.index(min(load))
        out[k].append(job)
        load[k] += job[1].nbytes or 0
    return [o for o in out if o]


def write_split(
    path: str | Path,
    arch: str,
    kv: Mapping[str, Any],
    tensors: Sequence[TensorDecl],
    *,
    n_shards: int = 2,
    seed: int = 0,
    fill: SplitFill = "pattern",
    groups: Sequence[Sequence[int]] | None = None,
    only: set[int] | None = None,
    workers: int | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> list[HeaderLayout]:
    """Write ``tensors`` as ``n_shards`` split GGUF files named by :func:`strata.testing.models.shard_names`.

    Args:
        path: the model's name (``x.gguf`` -> ``x-00001-of-00002.gguf`` ...; one shard: ``x.gguf`` itself).
        arch: ``general.architecture`` (shard 0).
        kv: the model's KVs (shard 0), typed as :func:`strata.testing.gguf_writer.write_header_only` types them.
        tensors: ``(name, type, ne)`` declarations.
        groups: the tensor indices of each shard, in file order (default: consecutive runs of about equal
            bytes, :func:`split_bounds`); every tensor in exactly one shard.
        fill: ``"pattern"`` (module docstring) or ``"sparse"`` (headers only, the data a hole).
        only: write these shard numbers only (0-based) and leave the others' files alone: a variant that
            differs in one shard reuses (links) the others, whose bytes depend only on their own tensors.
        workers: writer processes (forked; default: the CPUs this process may use, at most 8), each
            writing whole tensors with ``pwrite``.
        alignment: data alignment (``general.alignment`` is written when it is not 32).

    Returns:
        One :class:`HeaderLayout` per shard (``path`` set), shard order (also for shards not written).

    Raises:
        ValueError: as :func:`strata.testing.gguf_writer.tensor_layouts`, fewer tensors than shards, groups
            that do not cover every tensor once, a bad ``fill``; RuntimeError: a writer process failed.
    """
    if fill not in ("pattern", "sparse"):
        raise ValueError(f"fill={fill!r}: expected 'pattern' or 'sparse'")
    if n_shards < 1:
        raise ValueError(f"n_shards={n_shards} < 1")
    if "general.architecture" in kv:
        raise ValueError("general.architecture comes from the arch argument")
    names = shard_names(path, n_shards)
    decls = list(tensors)
    infos, _ = tensor_layouts(decls, alignment)  # validates every declaration once
    if groups is None:
        groups = split_bounds([ti.nbytes or 0 for ti in infos], n_shards)
    if len(groups) != n_shards or sorted(i for g in groups for i in g) != list(range(len(decls))):
        raise ValueError(f"groups must give {n_shards} shards covering each of the {len(decls)} tensors once")
    base: list[tuple[str, KV]] = [("general.architecture", KV(GGUFValueType.STRING, arch))]
    if alignment != DEFAULT_ALIGNMENT:
        base.append(("general.alignment", KV(GGUFValueType.UINT32, alignment)))
    base += [(k, infer_kv(v)) for k, v in kv.items()]
    layouts: list[HeaderLayout] = []
    jobs: list[tuple[str, TensorLayout]] = []
    for no, group in enumerate(groups):
        split = (
            []
            if n_shards == 1
            else [
                ("split.no", KV(GGUFValueType.UINT16, no)),
                ("split.count", KV(GGUFValueType.UINT16, n_shards)),
                ("split.tensors.count", KV(GGUFValueType.INT32, len(decls))),
            ]
        )
        kvs = (base + split) if no == 0 else split
        shard_infos, size = tensor_layouts([decls[i] for i in group], alignment)
        header, lay = encode_header(kvs, shard_infos, alignment=alignment)
        lay.path, lay.file_size = names[no], lay.data_offset + size
        layouts.append(lay)
        if only is not None and no not in only:
            continue
        with open(names[no], "wb") as f:
            f.write(header)
            f.write(b"\0" * (lay.data_offset - len(header)))
            f.truncate(lay.file_size)  # the data section: a hole until written
        jobs += [(str(names[no]), ti) for ti in lay.tensors]
    if fill == "sparse" or not jobs:
        return layouts
    if workers is None:
        workers = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    parts = _balance(jobs, max(1, workers))
    if len(parts) == 1:
        _write_data(parts[0], seed)
        return layouts
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_data, args=(part, seed)) for part in parts]
    for p in procs:
        p.start()
    failed = []
    for p in procs:
        p.join()
        if p.exitcode != 0:
            failed.append(p.exitcode)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(procs)} writer processes of {path} failed (exit codes {failed})")
    return layouts
