"""Broken GGUF files for the header reader's tests: one malformed file per kind in :data:`BROKEN_KINDS`.

Every kind is the small valid file of :func:`write_broken_base` with exactly one defect (bad magic
or version, truncation, overlapping or misaligned offsets, shapes that disagree with the offsets,
unknown type ids, bad alignment, lengths past the end of the file ...): each defect is one check of
strata's strict reader (:mod:`strata.packer.gguf_file`, modelled on llama.cpp's ``ggml/src/gguf.cpp``).
Written with :mod:`.gguf_writer`, whose layout gives every field's file position.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf.constants import GGUFValueType

from strata.packer import quants

from .blocks import make_random_blocks, tensor_rng
from .gguf_writer import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    KV,
    HeaderLayout,
    TensorLayout,
    align_up,
    encode_header,
    write_header_only,
)

__all__ = ["BROKEN_KINDS", "write_broken", "write_broken_base"]


#: Every kind :func:`write_broken` writes, with what is wrong. All start from :func:`write_broken_base`
#: (4 tensors: a.weight F32 [64,4], b.weight Q8_0 [64,4], c.weight F16 [32,3], d.weight Q4_K [256,2];
#: KVs general.architecture, general.name, general.alignment=32, a u32, a 10-string token array).
BROKEN_KINDS: dict[str, str] = {
    "bad_magic": "magic is b'GGUX' instead of b'GGUF'",
    "version_1": "version field is 1 (GGUF v1: unsupported)",
    "version_4": "version field is 4 (unknown future version)",
    "truncated_header": "file ends in the middle of the tensor-info section (3 bytes into b.weight's info)",
    "truncated_data": "file ends halfway through the last tensor's data (d.weight)",
    "tensor_beyond_eof": "d.weight's offset points 1 MiB past the end of the file (file length unchanged)",
    "overlapping_tensors": "b.weight's offset is a.weight's offset + 32: b starts inside a (a is 1024 B)",
    "nbytes_exceeds_span": "a.weight's ne becomes [64,5] (1280 B) but only 1024 B lie before b.weight's offset "
    "(GGUF stores no nbytes: the shape disagrees with the offsets)",
    "nbytes_below_span": "a.weight's ne becomes [64,2] (512 B) but 1024 B lie before b.weight's offset "
    "(a gap: offsets are not the running padded sum ggml requires)",
    "ne0_not_block_multiple": "b.weight (Q8_0, block 32) has ne [48,4]: ne0 not a multiple of 32",
    "element_count_overflow": "a.weight (F32) has ne [2**32, 2**31+1]: element count 2**63+2**32 > INT64_MAX",
    "unknown_type_4": "b.weight's type id is 4 (Q4_2, removed from ggml)",
    "unknown_type_99": "b.weight's type id is 99 (never a ggml type)",
    "duplicate_tensor_name": "b.weight is renamed a.weight: two tensors share a name",
    "alignment_0": "general.alignment (u32) is 0",
    "alignment_3": "general.alignment (u32) is 3 (not a power of two)",
    "string_length_beyond_eof": "general.name's u64 length is file size + 1",
    "array_length_beyond_eof": "tokenizer.ggml.tokens' u64 element count is file size + 1",
    "misaligned_offset": "c.weight's offset is 8 bytes past its aligned position (not a multiple of 32)",
    "too_many_dims": "a.weight has 5 dims ne [64,4,1,1,1] (ggml: at most 4)",
    "name_too_long": "a.weight is renamed to a 70-byte name (ggml: < 64 bytes)",
    "bad_kv_type": "general.name's value type is 13 (no such GGUF value type)",
}


def _base_decl() -> tuple[list[tuple[str, KV]], list[tuple[str, int, tuple[int, ...]]]]:
    V = GGUFValueType
    kvs = [
        ("general.architecture", KV(V.STRING, "qwen2")),
        ("general.name", KV(V.STRING, "strata-broken-base")),
        ("general.alignment", KV(V.UINT32, 32)),
        ("qwen2.block_count", KV(V.UINT32, 1)),
        ("tokenizer.ggml.tokens", KV(V.ARRAY, [f"tok{i}" for i in range(10)], V.STRING)),
    ]
    tensors = [("a.weight", 0, (64, 4)), ("b.weight", 8, (64, 4)), ("c.weight", 1, (32, 3)), ("d.weight", 12, (256, 2))]
    return kvs, tensors


def _write_raw(
    path: Path,
    kvs,
    infos: list[TensorLayout],
    payload: dict[str, np.ndarray],
    *,
    magic: bytes = GGUF_MAGIC,
    version: int = GGUF_VERSION,
    data_end: int | None = None,
) -> HeaderLayout:
    header, lay = encode_header(kvs, infos, alignment=DEFAULT_ALIGNMENT, magic=magic, version=version)
    lay.path = path
    end = data_end if data_end is not None else max(align_up(t.offset + len(payload[t.name]), 32) for t in infos)
    with open(path, "wb") as f:
        f.write(header)
        f.write(b"\0" * (lay.data_offset - len(header)))
        for t in infos:
            if t.name in payload:
                f.seek(lay.data_offset + t.offset)
                payload[t.name].tofile(f)
        f.truncate(lay.data_offset + end)
    lay.file_size = lay.data_offset + end
    return lay


def _base_payload(seed: int) -> dict[str, np.ndarray]:
    _, tensors = _base_decl()
    return {n: make_random_blocks(t, math.prod(ne), tensor_rng(seed, n)) for n, t, ne in tensors}


def write_broken_base(path: str | Path, *, seed: int = 0) -> HeaderLayout:
    """Write the small VALID file every broken kind starts from (see :data:`BROKEN_KINDS`); tensors hold
    random valid blocks. ``gguf.GGUFReader`` and llama.cpp's gguf.cpp accept it."""
    kvs, tensors = _base_decl()
    return write_header_only(path, kvs[0][1].value, dict(kvs[1:]), tensors, data=_base_payload(seed))


def write_broken(path: str | Path, kind: str, *, seed: int = 0) -> Path:
    """Write a file of kind ``kind`` (a key of :data:`BROKEN_KINDS`) to ``path`` and return ``path``.

    Every kind is the base file of :func:`write_broken_base` with exactly one defect; tensor data
    stays at the base offsets (relative to the data section), so only the described field differs.
    """
    if kind not in BROKEN_KINDS:
        raise KeyError(f"unknown broken kind {kind!r}; known: {', '.join(BROKEN_KINDS)}")
    path = Path(path)
    kvs, tensors = _base_decl()
    payload = _base_payload(seed)
    infos, off = [], 0
    for n, t, ne in tensors:
        nb = quants.tensor_nbytes(t, ne)
        infos.append(TensorLayout(n, t, tuple(ne), off, nb))
        off += align_up(nb, DEFAULT_ALIGNMENT)
    by = {t.name: t for t in infos}
    magic, version, data_end = GGUF_MAGIC, GGUF_VERSION, off
    post: list[Callable[[HeaderLayout], tuple[int, bytes]]] = []
    cut: Callable[[HeaderLayout], int] | None = None

    if kind == "bad_magic":
        magic = b"GGUX"
    elif kind in ("version_1", "version_4"):
        version = int(kind[-1])
    elif kind == "truncated_header":
        cut = lambda lay: lay.tensor("b.weight").info_pos + 3  # noqa: E731
    elif kind == "truncated_data":
        cut = lambda lay: lay.data_offset + lay.tensor("d.weight").offset + by["d.weight"].nbytes // 2  # noqa: E731
    elif kind == "tensor_beyond_eof":
        by["d.weight"].offset = off + (1 << 20)
    elif kind == "overlapping_tensors":
        by["b.weight"].offset = by["a.weight"].offset + DEFAULT_ALIGNMENT
    elif kind == "nbytes_exceeds_span":
        by["a.weight"].ne = (64, 5)
    elif kind == "nbytes_below_span":
        by["a.weight"].ne = (64, 2)
    elif kind == "ne0_not_block_multiple":
        by["b.weight"].ne = (48, 4)
    elif kind == "element_count_overflow":
        by["a.weight"].ne = (2**32, 2**31 + 1)
    elif kind.startswith("unknown_type_"):
        by["b.weight"].type_id = int(kind.rsplit("_", 1)[1])
    elif kind == "duplicate_tensor_name":
        by["b.weight"].name = "a.weight"
    elif kind in ("alignment_0", "alignment_3"):
        kvs[2] = ("general.alignment", KV(GGUFValueType.UINT32, int(kind[-1])))
    elif kind == "string_length_beyond_eof":
        post.append(lambda lay: (lay.kv_pos["general.name"] + 4, struct.pack("<Q", lay.file_size + 1)))
    elif kind == "array_length_beyond_eof":
        post.append(lambda lay: (lay.kv_pos["tokenizer.ggml.tokens"] + 8, struct.pack("<Q", lay.file_size + 1)))
    elif kind == "misaligned_offset":
        by["c.weight"].offset += 8
    elif kind == "too_many_dims":
        by["a.weight"].ne = (64, 4, 1, 1, 1)
    elif kind == "name_too_long":
        by["a.weight"].name = "a." + "x" * 61 + ".weight"
    elif kind == "bad_kv_type":
        post.append(lambda lay: (lay.kv_pos["general.name"], struct.pack("<I", 13)))
    else:  # pragma: no cover - BROKEN_KINDS and this chain must list the same kinds
        raise AssertionError(kind)

    payload = {t.name: payload[n] for t, (n, _, _) in zip(infos, tensors)}
    if kind == "duplicate_tensor_name":
        payload = {"a.weight": _base_payload(seed)["a.weight"]}
    lay = _write_raw(path, kvs, infos, payload, magic=magic, version=version, data_end=data_end)
    if kind == "duplicate_tensor_name":  # both payloads at their base offsets
        base = _base_payload(seed)
        with open(path, "r+b") as f:
            f.seek(lay.data_offset + infos[1].offset)
            base["b.weight"].tofile(f)
    with open(path, "r+b") as f:
        for fix in post:
            pos, b = fix(lay)
            f.seek(pos)
            f.write(b)
        if cut is not None:
            f.truncate(cut(lay))
    return path
