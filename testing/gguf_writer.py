"""strata's own minimal GGUF v3 writer: a real header and a sparse (or explicit) data section.

:func:`write_header_only` writes any KVs and tensor infos exactly as given, with tensor offsets the
running sum of padded sizes (ggml ``gguf.cpp``'s rule), and by default leaves the data section a
sparse hole, so a ~47 GB model (:mod:`.reference_model`) costs a few MB of disk. Unlike
``gguf.GGUFWriter`` it accepts type ids gguf-py does not know (42 = Q2_0) and reports where every
field sits (:class:`HeaderLayout`), which :mod:`.broken` uses to craft malformed files.

Format: GGUF v3 as in llama.cpp ``ggml/include/gguf.h`` and ``ggml/src/gguf.cpp`` (docs/FORMAT.md
"File layout"). Value types are gguf-py's :class:`gguf.constants.GGUFValueType`; their encodings are the
tables strata's reader uses (:data:`strata.packer.gguf_file.SCALAR_FORMATS` / ``ARRAY_DTYPES``, both
taken from gguf-py). Type sizes come from :mod:`strata.packer.quants`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
from gguf.constants import GGUFValueType

from strata.packer import quants
from strata.packer.gguf_file import ARRAY_DTYPES, SCALAR_FORMATS

from .blocks import make_random_blocks, pattern_fill, tensor_rng, to_type_id

__all__ = [
    "DEFAULT_ALIGNMENT",
    "GGUF_MAGIC",
    "GGUF_VERSION",
    "KV",
    "DataMode",
    "HeaderLayout",
    "TensorDecl",
    "TensorLayout",
    "align_up",
    "encode_header",
    "infer_kv",
    "tensor_layouts",
    "write_header_only",
]

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32


def align_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align`` (bytes)."""
    return (n + align - 1) // align * align


class KV(NamedTuple):
    """An explicitly typed KV value for :func:`write_header_only`: ``KV(GGUFValueType.UINT16, 3)``,
    ``KV(GGUFValueType.ARRAY, [1, 2], GGUFValueType.UINT32)``."""

    vtype: int
    value: Any
    sub_type: int | None = None


def infer_kv(value: Any) -> KV:
    """The :class:`KV` a plain value is written as (see :func:`write_header_only`); a KV passes through.

    Raises:
        TypeError: a value with no GGUF type (an empty list, an object).
    """
    V = GGUFValueType
    if isinstance(value, KV):
        return value
    if isinstance(value, tuple) and len(value) in (2, 3) and isinstance(value[0], GGUFValueType):
        return KV(*value)
    if isinstance(value, (bool, np.bool_)):
        return KV(V.BOOL, bool(value))
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if 0 <= v < 2**32:
            return KV(V.UINT32, v)
        return KV(V.INT32, v) if -(2**31) <= v < 0 else KV(V.INT64 if v < 0 else V.UINT64, v)
    if isinstance(value, (float, np.floating)):
        return KV(V.FLOAT32, float(value))
    if isinstance(value, str):
        return KV(V.STRING, value)
    if isinstance(value, np.ndarray):
        for vt, dt in ARRAY_DTYPES.items():
            if vt != V.BOOL and dt == value.dtype.newbyteorder("<"):
                return KV(V.ARRAY, value, vt)
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(x, str) for x in value):
            return KV(V.ARRAY, value, V.STRING)
        if all(isinstance(x, bool) for x in value):
            return KV(V.ARRAY, value, V.BOOL)
        if all(isinstance(x, (int, np.integer)) for x in value):
            return KV(V.ARRAY, value, V.INT32)  # like gguf-py; use KV(ARRAY, v, UINT32) for u32
        if all(isinstance(x, (int, float, np.number)) for x in value):
            return KV(V.ARRAY, value, V.FLOAT32)
    raise TypeError(
        f"cannot infer a GGUF type for {type(value).__name__} {value!r:.60}; pass KV(vtype, value, sub_type)"
    )


def _enc_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _enc_value(vtype: int, value: Any, sub_type: int | None) -> bytes:
    V = GGUFValueType
    if vtype == V.STRING:
        return _enc_str(value)
    if vtype == V.ARRAY:
        if sub_type is None or sub_type == V.ARRAY:
            raise ValueError("arrays need a non-array sub_type (ggml rejects nested arrays)")
        head = struct.pack("<IQ", int(sub_type), len(value))
        if sub_type == V.STRING:
            enc = [s.encode() for s in value]
            lens = np.fromiter((len(b) for b in enc), dtype="<u8", count=len(enc)).tobytes()
            return head + b"".join(x for i, b in enumerate(enc) for x in (lens[8 * i : 8 * i + 8], b))
        return head + np.asarray(value).astype(ARRAY_DTYPES[V(sub_type)]).tobytes()
    return struct.pack(SCALAR_FORMATS[V(vtype)], value)


@dataclass
class TensorLayout:
    """Where one tensor info sits in a written file.

    ``offset`` is relative to the data section (as stored); ``abs_offset`` = data_offset + offset.
    ``info_pos``/``ne_pos``/``type_pos``/``offset_pos`` are absolute file positions of the tensor
    info's name length, first ne, type and offset fields (used to craft broken files).
    """

    name: str
    type_id: int
    ne: tuple[int, ...]
    offset: int
    nbytes: int | None
    info_pos: int = 0
    ne_pos: int = 0
    type_pos: int = 0
    offset_pos: int = 0
    abs_offset: int = 0


@dataclass
class HeaderLayout:
    """What :func:`write_header_only` wrote: header geometry and every field's file position.

    Attributes:
        path: the file.
        version / n_kv / n_tensors: header counts.
        alignment: data alignment used for padding (bytes).
        data_offset: absolute start of the data section (bytes).
        file_size: final file size (bytes; data section included, sparse or not).
        kv_pos: key -> absolute position of the value's type field (u32); the value follows it.
        tensors: :class:`TensorLayout` per tensor, in file order.
    """

    path: Path
    version: int
    n_kv: int
    n_tensors: int
    alignment: int
    data_offset: int
    file_size: int
    kv_pos: dict[str, int] = field(default_factory=dict)
    tensors: list[TensorLayout] = field(default_factory=list)

    def tensor(self, name: str) -> TensorLayout:
        """The layout of tensor ``name`` (KeyError if absent)."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def encode_header(
    kvs: Sequence[tuple[str, KV]],
    infos: Sequence[TensorLayout],
    *,
    alignment: int,
    magic: bytes = GGUF_MAGIC,
    version: int = GGUF_VERSION,
) -> tuple[bytes, HeaderLayout]:
    """Header bytes (magic .. tensor infos, no padding) for exactly the given KVs and tensor infos (no
    checks: :mod:`.broken` uses it to write malformed headers). Fills each info's field positions."""
    parts = [magic, struct.pack("<IQQ", version, len(infos), len(kvs))]
    pos = 4 + 4 + 16
    lay = HeaderLayout(Path(), version, len(kvs), len(infos), alignment, 0, 0)
    for key, kv in kvs:
        kb = _enc_str(key)
        vb = struct.pack("<I", int(kv.vtype)) + _enc_value(kv.vtype, kv.value, kv.sub_type)
        lay.kv_pos[key] = pos + len(kb)
        parts += [kb, vb]
        pos += len(kb) + len(vb)
    for ti in infos:
        nb = _enc_str(ti.name)
        ti.info_pos = pos
        ti.ne_pos = pos + len(nb) + 4
        ti.type_pos = ti.ne_pos + 8 * len(ti.ne)
        ti.offset_pos = ti.type_pos + 4
        body = nb + struct.pack(f"<I{len(ti.ne)}QIQ", len(ti.ne), *ti.ne, ti.type_id, ti.offset)
        parts.append(body)
        pos += len(body)
        lay.tensors.append(ti)
    header = b"".join(parts)
    lay.data_offset = align_up(len(header), alignment)
    for ti in infos:
        ti.abs_offset = lay.data_offset + ti.offset
    return header, lay


TensorDecl = tuple[str, int | str, Sequence[int]]
DataMode = Literal["sparse", "random", "pattern"]


def tensor_layouts(tensors: Sequence[TensorDecl], alignment: int = DEFAULT_ALIGNMENT) -> tuple[list[TensorLayout], int]:
    """Tensor infos for ``(name, type, ne)`` declarations in file order: offsets the running sum of
    ``pad(nbytes, alignment)`` (ggml gguf.cpp's rule); returns them and the data section's size (bytes).

    Raises:
        ValueError: a duplicate name, a name of 64 bytes or more, not 1..4 dims;
            ``quants.ShapeError`` / ``GGMLTypeError`` for shapes / type ids.
    """
    infos: list[TensorLayout] = []
    seen: set[str] = set()
    offset = 0
    for name, type_id, ne in tensors:
        tid = to_type_id(type_id)
        ne = tuple(int(x) for x in ne)
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        if len(name.encode()) >= 64:
            raise ValueError(f"tensor name {name!r} is {len(name.encode())} bytes (ggml: < 64)")
        if not 1 <= len(ne) <= 4:
            raise ValueError(f"{name}: {len(ne)} dims (ggml: 1..4)")
        seen.add(name)
        nb = quants.tensor_nbytes(tid, ne, tensor=name)
        infos.append(TensorLayout(name, tid, ne, offset, nb))
        offset += align_up(nb, alignment)
    return infos, offset


def write_header_only(
    path: str | Path,
    arch: str,
    kv: Mapping[str, Any],
    tensors: Sequence[TensorDecl],
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    data: DataMode | Mapping[str, bytes | np.ndarray] = "sparse",
    seed: int = 0,
) -> HeaderLayout:
    """Write a GGUF v3 file with strata's own writer; the data section is a sparse hole by default.

    Args:
        path: output file.
        arch: ``general.architecture`` (written first).
        kv: further KVs in order. Values: ``KV(vtype, value, sub_type)`` for an exact type, or plain
            Python values typed as int -> u32 (negative -> i32), float -> f32, bool -> bool, str ->
            string, list[str] -> array of string, list[int] -> array of i32, list[float] -> array of f32,
            numpy arrays by dtype. ``general.alignment`` (u32) is added when ``alignment != 32``.
        tensors: ``(name, type id or name, ne)`` in file order; ``ne`` in ggml order. Any registry
            type id works, including ids gguf-py does not know (42 = Q2_0).
        alignment: data alignment in bytes (power of two); offsets are the running sum of
            ``pad(nbytes, alignment)``, exactly as ggml requires (gguf.cpp: no gaps, no reordering).
        data: ``"sparse"``: no tensor bytes are written, the file is extended with ``truncate`` (a hole:
            a 40 GB model costs only its header on disk; reads return zeros). ``"random"``: every
            tensor gets :func:`make_random_blocks` bytes (small files only). ``"pattern"``: a tiled
            ~64 KiB random block pattern per tensor. A mapping ``name -> bytes`` writes those tensors'
            bytes explicitly (length must equal the tensor's nbytes) and leaves the rest sparse.
        seed: root of the random streams for ``"random"`` / ``"pattern"``.

    Returns:
        :class:`HeaderLayout` with the data offset, every tensor's offset and the field positions.

    Raises:
        ValueError: duplicate / too long tensor names, more than 4 dims, bad alignment, wrong
            explicit byte counts; ``quants.ShapeError`` / ``GGMLTypeError`` for shapes / type ids.
    """
    path = Path(path)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment={alignment} is not a power of two")
    if "general.architecture" in kv:
        raise ValueError("general.architecture comes from the arch argument")
    kvs: list[tuple[str, KV]] = [("general.architecture", KV(GGUFValueType.STRING, arch))]
    if alignment != DEFAULT_ALIGNMENT and "general.alignment" not in kv:
        kvs.append(("general.alignment", KV(GGUFValueType.UINT32, alignment)))
    kvs += [(k, infer_kv(v)) for k, v in kv.items()]

    infos, offset = tensor_layouts(tensors, alignment)
    seen = {ti.name for ti in infos}
    header, lay = encode_header(kvs, infos, alignment=alignment)
    lay.path = path
    lay.file_size = lay.data_offset + offset
    explicit = dict(data) if isinstance(data, Mapping) else {}
    unknown = set(explicit) - seen
    if unknown:
        raise ValueError(f"data given for unknown tensors {sorted(unknown)}")
    with open(path, "wb") as f:
        f.write(header)
        f.write(b"\0" * (lay.data_offset - len(header)))
        for ti in infos:
            if isinstance(data, str) and data in ("random", "pattern"):
                rng = tensor_rng(seed, ti.name)
                buf = (
                    make_random_blocks(ti.type_id, math.prod(ti.ne), rng)
                    if data == "random"
                    else pattern_fill(ti.type_id, ti.ne, rng)
                )
            elif ti.name in explicit:
                buf = (
                    np.frombuffer(bytes(explicit[ti.name]), np.uint8)
                    if not isinstance(explicit[ti.name], np.ndarray)
                    else explicit[ti.name].view(np.uint8).reshape(-1)
                )
                if buf.size != ti.nbytes:
                    raise ValueError(f"{ti.name}: {buf.size} bytes given, its shape needs {ti.nbytes}")
            elif data == "sparse" or isinstance(data, Mapping):
                continue
            else:
                raise ValueError(f"data={data!r}: expected 'sparse', 'random', 'pattern' or a mapping")
            f.seek(ti.abs_offset)
            buf.tofile(f)
        f.truncate(lay.file_size)  # the sparse hole: no blocks allocated for unwritten data
    return lay
