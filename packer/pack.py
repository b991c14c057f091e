"""A pack directory as a whole: the strict readers of its files together, and the pool layout.

:func:`open_pack` is what the engine and ``strata-pack verify`` start from (every text file read
strictly, the pool checked against pool.bin's size and refused at the first problem); :func:`read_pack`
reads the text files only, for a report of every problem (the budget audit, with
:func:`pool_layout_findings`). The file formats themselves are :mod:`strata.packer.packfmt`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import quants
from .findings import Finding, fmt_ne, trim_ne
from .gguf_file import has_gguf_magic
from .packfmt import (
    EXPERTS_FILE,
    GEOMETRY_FILE,
    INDEX_FILE,
    METADATA_FILE,
    POOL_FILE,
    NativeExperts,
    NotAPackError,
    PackFormatError,
    PackIndex,
    read_experts,
    read_geometry_params,
    read_index,
    read_metadata,
)


@dataclass
class Pack:
    """A pack directory read through the strict readers. Pool and expert offsets are
    checked against the files' sizes by :func:`open_pack`; nothing here reads weights."""

    path: Path
    index: PackIndex
    experts: NativeExperts | None
    geometry_params: dict[str, str]
    metadata: dict[str, object]

    @property
    def arch(self) -> str:
        return self.geometry_params["arch"]

    @property
    def pool_path(self) -> Path:
        return self.path / POOL_FILE

    source_dir_override: Path | None = None

    def source_path(self, name: str) -> Path:
        """Where the source shard file ``name`` is: in ``source_dir_override`` when set (``--source-dir``: there
        and nowhere else, so a copy of the sources elsewhere is what gets read, or the caller's "missing" error
        names that directory), else in the directory recorded at build time (metadata.txt
        ``strata.source_dir``) if it is there, else beside the pack. Returns the first candidate that exists,
        or the recorded one (so the caller's "missing" error names the path the pack expects)."""
        p = Path(name)
        if p.is_absolute():
            return p
        if self.source_dir_override is not None:
            return Path(self.source_dir_override) / name
        cands = []
        src_dir = self.metadata.get("strata.source_dir")
        if isinstance(src_dir, str):
            cands.append(Path(src_dir) / name)
        cands.append(self.path / name)
        for c in cands:
            if c.exists():
                return c
        return cands[0]

    def shard_path(self, k: int) -> Path:
        """Path of expert shard ``k`` (a file name in native_experts.txt), see :meth:`source_path`."""
        assert self.experts is not None
        return self.source_path(self.experts.shards[k])


def pool_layout_findings(
    index: PackIndex, pool_size: int | None, where: str = INDEX_FILE, *, contents: bool = True, gaps: bool = True
) -> list[Finding]:
    """Every pool-layout problem of ``index`` against a pool.bin of ``pool_size`` bytes (None: missing).

    Checks: pool.bin exists and has the header's size; per tensor (``contents``), ``nbytes`` equals
    its type x ne (:func:`strata.packer.quants.tensor_nbytes`) and the pool type is the source type
    (or F32 for a BF16 source, the one pack form); the offset is a multiple of ``align``, the range lies inside
    pool.bin, no two tensors overlap; with ``gaps`` (the audit's report), also that no gap of ``align``
    bytes or more separates them (the one writer, ``packer.pack_plan.layout_pool``, packs them densely: a
    gap suggests a shifted offset) and that the header's pool size is the last tensor's end padded
    to ``align``. The engine's reader (:func:`open_pack`) refuses everything but the gaps: a pack
    with a tensor line removed is refused by the contract check instead, naming the tensor.
    """
    out: list[Finding] = []

    def add(tensor, found, required, message):
        out.append(Finding(str(tensor), str(found), str(required), message, where))

    if pool_size is None:
        add(POOL_FILE, "missing", f"{index.pool_bytes} bytes", f"{POOL_FILE} is missing")
    elif pool_size != index.pool_bytes:
        add(
            POOL_FILE,
            f"{pool_size} bytes",
            f"{index.pool_bytes} bytes (index.txt header)",
            f"index says pool {index.pool_bytes} bytes, pool.bin has {pool_size}",
        )
    prev = None
    end = 0
    for e in sorted(index.entries, key=lambda e: (e.offset, e.name)):
        ne = trim_ne(e.ne)
        want = None
        try:
            want = quants.tensor_nbytes(e.type, ne, tensor=e.name) if contents else None
        except (quants.GGMLTypeError, quants.ShapeError) as x:
            add(e.name, f"type {e.type} ne {fmt_ne(ne)}", "a ggml type that can hold ne", str(x))
        if want is not None and want != e.nbytes:
            add(
                e.name,
                f"nbytes {e.nbytes}",
                f"nbytes {want} ({quants.qtype(e.type).name} x {fmt_ne(ne)})",
                f"tensor {e.name} has {e.nbytes} bytes, {quants.qtype(e.type).name} x {fmt_ne(ne)} is {want} bytes",
            )
        if contents and not (e.type == e.src_type or (e.src_type == quants.BF16.id and e.type == quants.F32.id)):
            add(
                e.name,
                f"pool type {_tname(e.type)}",
                f"pool type {_tname(e.src_type)} (the source type; F32 for BF16 sources)",
                f"tensor {e.name} is stored as {_tname(e.type)} but came from {_tname(e.src_type)}; only BF16 -> F32 "
                f"promotion is a pack form",
            )
        if e.offset % index.align:
            add(
                e.name,
                f"offset {e.offset}",
                f"a multiple of align {index.align}",
                f"tensor {e.name}: pool offset {e.offset} is not a multiple of align {index.align}",
            )
        if pool_size is not None and e.offset + e.nbytes > pool_size:
            add(
                e.name,
                f"[{e.offset}, {e.offset + e.nbytes})",
                f"inside pool.bin ({pool_size} bytes)",
                f"tensor {e.name} [{e.offset}, {e.offset + e.nbytes}) runs past the end of pool.bin ({pool_size} "
                "bytes)",
            )
        if prev is not None:
            pend = prev.offset + prev.nbytes
            if pend > e.offset:
                add(
                    e.name,
                    f"offset {e.offset}",
                    f">= {pend} (end of {prev.name})",
                    f"tensor {e.name} at {e.offset} overlaps {prev.name} [{prev.offset}, {pend})",
                )
            elif gaps and e.offset - pend >= index.align:
                add(
                    e.name,
                    f"offset {e.offset}",
                    f"offset {(pend + index.align - 1) // index.align * index.align} (first aligned byte after "
                    f"{prev.name})",
                    f"tensor {e.name}: a {e.offset - pend}-byte gap after {prev.name}: offset shifted?",
                )
        elif gaps and e.offset >= index.align:
            add(
                e.name,
                f"offset {e.offset}",
                "offset 0 (first tensor of the pool)",
                f"tensor {e.name}: the pool starts with a {e.offset}-byte gap: offset shifted?",
            )
        prev = e
        end = max(end, e.offset + e.nbytes)
    want_pool = (end + index.align - 1) // index.align * index.align
    if gaps and index.entries and index.pool_bytes != want_pool:
        add(
            INDEX_FILE,
            f"pool {index.pool_bytes}",
            f"pool {want_pool} (last tensor end {end} padded to {index.align})",
            "index.txt pool size disagrees with its tensors",
        )
    return out


def _tname(t: int) -> str:
    q = quants.QTYPES.get(t)
    return q.name if q else f"type id {t}"


def check_pool_layout(index: PackIndex, pool_size: int, where: str, *, contents: bool = True) -> None:
    """:func:`pool_layout_findings` without the gap checks, refusing the first (``contents=False``:
    offsets, ranges and sizes only; ``strata-pack verify`` compares the rest with the source).

    Raises:
        PackFormatError: ``{where}: {the finding's message}``.
    """
    found = pool_layout_findings(index, pool_size, where, contents=contents, gaps=False)
    if found:
        raise PackFormatError(f"{where}: {found[0].message}")


def not_a_pack(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a pack directory (one line naming it), or None when it may be one.

    A GGUF file (its first bytes are ``GGUF``) gets the way forward: build a pack from it first.
    """
    p = Path(path)
    if p.is_file():
        if has_gguf_magic(p):
            return (
                f"{p}: this is a GGUF file, not a pack directory: build a pack first with strata-pack build {p} -o PACK"
            )
    if not p.is_dir():
        return f"{p}: not a pack directory"
    if not (p / INDEX_FILE).exists():
        return f"{p}: not a strata pack (no {INDEX_FILE})"
    return None


def read_pack(path: str | os.PathLike, source_dir: str | os.PathLike | None = None) -> Pack:
    """Read a pack directory's text files strictly (index.txt, native_experts.txt if present,
    geometry.txt, metadata.txt) without checking pool.bin: what a report of every problem (the
    budget audit) starts from. :func:`open_pack` adds the pool checks.

    Raises:
        NotAPackError: not a directory (a GGUF file is named as one), no index.txt (:func:`not_a_pack`).
        PackFormatError: any file missing or malformed.
    """
    path = Path(path)
    why = not_a_pack(path)
    if why:
        raise NotAPackError(why)
    index = read_index(path / INDEX_FILE)
    experts = read_experts(path / EXPERTS_FILE) if (path / EXPERTS_FILE).exists() else None
    geometry = read_geometry_params(path / GEOMETRY_FILE)
    metadata = read_metadata(path / METADATA_FILE)
    return Pack(path, index, experts, geometry, metadata, Path(source_dir) if source_dir is not None else None)


def open_pack(path: str | os.PathLike, source_dir: str | os.PathLike | None = None) -> Pack:
    """Open a pack directory: read index.txt, native_experts.txt (if present), geometry.txt
    and metadata.txt strictly, and check the pool layout against pool.bin's size.
    ``source_dir`` overrides where the source shards are looked up (see :meth:`Pack.source_path`).

    Raises:
        PackFormatError: any file missing or malformed, or a pool layout error.
    """
    pack = read_pack(path, source_dir)
    pool = pack.path / POOL_FILE
    if not pool.exists():
        raise PackFormatError(f"{pool}: missing")
    check_pool_layout(pack.index, pool.stat().st_size, str(pack.path / INDEX_FILE))
    return pack


__all__ = ["Pack", "check_pool_layout", "not_a_pack", "open_pack", "pool_layout_findings", "read_pack"]
