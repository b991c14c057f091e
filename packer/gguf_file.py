"""A fast, strict, read-only GGUF header reader, and discovery of split shards.

Why our own reader: ``gguf.GGUFReader`` parses every tokenizer string into a numpy
object at open (5-8 s for a 150k-token vocab). Building a pack needs only the scalar
keys and the tensor table; arrays are skipped here (their position is remembered, see
:func:`read_array`) so the header of a 1,000-tensor file with a 150k vocab reads in
well under a second. ``tests/test_pack_synth.py`` (synthetic, broken and split files) and
``tests/test_pack_real.py`` (the real models) check this reader against ``GGUFReader`` (names,
types, shapes, absolute offsets).

Format: GGUF v2/v3 as in llama.cpp ``ggml/include/gguf.h`` and ``ggml/src/gguf.cpp``
(``gguf_init_from_reader``; docs/FORMAT.md "GGUF facts strata relies on"). Each check fails the
way gguf.cpp does: with the file, the
field, what was expected and what was found. Files are only ever opened read-only. Value types
are gguf-py's ``gguf.constants.GGUFValueType``, decoded with gguf-py's own tables
(:data:`SCALAR_FORMATS`, :data:`ARRAY_DTYPES`).

Split shards follow llama.cpp's ``gguf-split`` (``tools/gguf-split/gguf-split.cpp``,
loader ``src/llama-model-loader.cpp``): names ``PREFIX-%05d-of-%05d.gguf`` (1-based),
keys ``split.no`` (u16, 0-based), ``split.count`` (u16), ``split.tensors.count`` (i32).
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf.constants import GGUFValueType
from gguf.gguf_reader import GGUFReader

from . import quants

GGUF_MAGIC = b"GGUF"


def has_gguf_magic(path) -> bool:
    """Whether the regular file at ``path`` starts with the 4 bytes ``GGUF`` (False when unreadable or not
    a regular file: a FIFO is never opened)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_STRING_LEN = 1 << 30  # gguf.cpp: GGUF_MAX_STRING_LENGTH-like bound
MAX_ARRAY_LEN = 1 << 30
MAX_DIMS = 4
MAX_NAME_BYTES = 63  # GGML_MAX_NAME = 64 including the NUL

#: numpy dtype of every numeric array element type: gguf-py's reader table
#: (``GGUFReader.gguf_scalar_to_np``, public), little-endian, except that bool is read as uint8.
ARRAY_DTYPES: dict[GGUFValueType, np.dtype] = {
    vt: np.dtype(np.uint8 if vt == GGUFValueType.BOOL else t).newbyteorder("<")
    for vt, t in GGUFReader.gguf_scalar_to_np.items()
}
_STRUCT_CODE = {
    ("u", 1): "B",
    ("u", 2): "H",
    ("u", 4): "I",
    ("u", 8): "Q",
    ("i", 1): "b",
    ("i", 2): "h",
    ("i", 4): "i",
    ("i", 8): "q",
    ("f", 4): "f",
    ("f", 8): "d",
}
#: struct format (little-endian, standard sizes) of every scalar GGUF value type, from the same table
#: (bool: ``?``, one byte), so the ids and sizes are declared once.
SCALAR_FORMATS: dict[GGUFValueType, str] = {
    vt: "<" + ("?" if vt == GGUFValueType.BOOL else _STRUCT_CODE[(dt.kind, dt.itemsize)])
    for vt, dt in ARRAY_DTYPES.items()
}

SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """A GGUF file that strata refuses to read; the message names the file and the numbers."""


@dataclass(frozen=True)
class ArrayRef:
    """A GGUF array value left unparsed: element type, element count and the absolute
    file offset of its first element (after the type u32 and count u64)."""

    elem_type: int
    count: int
    offset: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-info record of a GGUF file.

    Attributes:
        name: GGUF tensor name, e.g. ``blk.0.ffn_gate_exps.weight``.
        type_id: ggml type id.
        ne: shape in ggml order (``ne[0]`` = row length), trailing 1s as stored (1-4 dims).
        rel_offset: offset relative to the data section, bytes.
        abs_offset: absolute file offset, bytes (``data_offset + rel_offset``).
        nbytes: bytes the type and shape require (:func:`quants.tensor_nbytes`).
    """

    name: str
    type_id: int
    ne: tuple[int, ...]
    rel_offset: int
    abs_offset: int
    nbytes: int

    @property
    def ne4(self) -> tuple[int, int, int, int]:
        """Shape padded with 1s to four dims (ggml order)."""
        return tuple(list(self.ne) + [1] * (4 - len(self.ne)))  # type: ignore[return-value]

    @property
    def type_name(self) -> str:
        return quants.qtype(self.type_id).name


@dataclass
class GGUFHeader:
    """Everything strata reads from one GGUF file's header.

    ``kv`` holds scalars and strings as Python values and arrays as :class:`ArrayRef`
    (read them with :func:`read_array`). ``tensors`` keeps file order.
    """

    path: Path
    file_size: int
    version: int
    alignment: int
    data_offset: int
    kv: dict[str, object]
    kv_types: dict[str, int]
    tensors: list[TensorInfo]

    def get(self, key: str, default: object = None) -> object:
        return self.kv.get(key, default)

    @property
    def arch(self) -> str | None:
        a = self.kv.get("general.architecture")
        return a if isinstance(a, str) else None


class _Cursor:
    """Bounds-checked little-endian reader over a read-only buffer."""

    def __init__(self, buf, path: Path):
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"{self.path}: truncated header: reading {what} needs {n} bytes at offset {self.pos}, "
                f"file has {self.size} bytes"
            )

    def scalar(self, vtype: int, what: str):
        fmt = SCALAR_FORMATS[vtype]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str, raw: bool = False, lenient: bool = False):
        n = self.u64(f"length of {what}")
        if n > MAX_STRING_LEN or self.pos + n > self.size:
            raise GGUFError(
                f"{self.path}: {what}: string length {n} at offset {self.pos - 8} exceeds the "
                f"{self.size - self.pos} bytes left in the file"
            )
        b = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        if raw:
            return b
        if lenient:  # metadata keys and string values: llama.cpp keeps any bytes (gguf.cpp std::string); Python's
            return b.decode("utf-8", "surrogateescape")  # surrogates hold the bytes that are not UTF-8
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e})") from None

    def skip_strings(self, count: int, what: str) -> None:
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > size:
                raise GGUFError(
                    f"{self.path}: truncated header: {what}[{i}] length at offset {pos}, file has {size} bytes"
                )
            (n,) = unpack(buf, pos)
            pos += 8 + n
            if n > MAX_STRING_LEN or pos > size:
                raise GGUFError(
                    f"{self.path}: {what}[{i}]: string length {n} at offset {pos - n - 8} runs past the end of the "
                    f"file ({size} bytes)"
                )
        self.pos = pos


def _read_value(cur: _Cursor, vtype: int, key: str):
    if vtype in SCALAR_FORMATS:
        return cur.scalar(vtype, f"value of {key!r}")
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of {key!r}", lenient=True)
    if vtype == GGUFValueType.ARRAY:
        etype = cur.u32(f"array type of {key!r}")
        count = cur.u64(f"array length of {key!r}")
        if etype == GGUFValueType.ARRAY:
            raise GGUFError(f"{cur.path}: key {key!r}: nested arrays are not allowed (gguf.cpp rejects them)")
        if etype not in SCALAR_FORMATS and etype != GGUFValueType.STRING:
            raise GGUFError(f"{cur.path}: key {key!r}: unknown array element type {etype}")
        if count > MAX_ARRAY_LEN:
            raise GGUFError(f"{cur.path}: key {key!r}: array length {count} exceeds the limit {MAX_ARRAY_LEN}")
        start = cur.pos
        if etype == GGUFValueType.STRING:
            # each element needs at least its 8-byte length
            if count * 8 > cur.size - cur.pos:
                raise GGUFError(
                    f"{cur.path}: key {key!r}: array of {count} strings needs at least {count * 8} bytes at offset "
                    f"{cur.pos}, only {cur.size - cur.pos} left in the file"
                )
            cur.skip_strings(count, f"key {key!r}")
        else:
            n = count * struct.calcsize(SCALAR_FORMATS[etype])
            if n > cur.size - cur.pos:
                raise GGUFError(
                    f"{cur.path}: key {key!r}: array of {count} elements ({n} bytes) at offset {cur.pos} runs past "
                    f"the end of the file ({cur.size} bytes)"
                )
            cur.pos += n
        return ArrayRef(etype, count, start)
    raise GGUFError(f"{cur.path}: key {key!r}: unknown value type {vtype}")


def _open_map(path: Path):
    size = os.path.getsize(path)
    if size == 0:
        raise GGUFError(f"{path}: file is empty (0 bytes)")
    f = open(path, "rb")  # read-only, always
    try:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size
    finally:
        f.close()


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Read and validate the header and tensor table of one GGUF file (read-only).

    Checks (each failure raises :class:`GGUFError` naming the file and the numbers):
    magic, version in {2, 3}, string/array lengths within the file, no duplicate keys,
    ``general.alignment`` a u32 power of two, at most 4 dims, known type ids
    (:class:`quants.GGMLTypeError`), ``ne[0] % block == 0``, no int64 element overflow,
    unique tensor names, every offset a multiple of the alignment, tensor offsets equal
    to the running padded sum in file order (gguf.cpp's rule: no gaps, no overlap), and
    every tensor inside the file.
    """
    path = Path(path)
    mm, size = _open_map(path)
    try:
        return _parse(mm, size, path)
    finally:
        mm.close()


def _parse(buf, size: int, path: Path) -> GGUFHeader:
    cur = _Cursor(buf, path)
    cur.need(4, "magic")
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: bad magic {magic!r}, expected {GGUF_MAGIC!r} (not a GGUF file)")
    cur.pos = 4
    version = cur.u32("version")
    swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in SUPPORTED_VERSIONS and swapped in SUPPORTED_VERSIONS:
        raise GGUFError(
            f"{path}: this GGUF file is big-endian (its version {version} read byte-swapped is {swapped}); "
            f"strata reads little-endian GGUF only (gguf-py's gguf-convert-endian converts it)"
        )
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: unsupported GGUF version {version}, supported: {list(SUPPORTED_VERSIONS)}")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("kv count")
    if n_tensors > size // 24 + 1:  # each tensor info takes >= 8+1+4+8+4+8 bytes
        raise GGUFError(f"{path}: tensor count {n_tensors} cannot fit in a file of {size} bytes")
    if n_kv > size // 13 + 1:
        raise GGUFError(f"{path}: kv count {n_kv} cannot fit in a file of {size} bytes")

    kv: dict[str, object] = {}
    kv_types: dict[str, int] = {}
    for i in range(n_kv):
        key = cur.string(f"key #{i}", lenient=True)
        vtype = cur.u32(f"type of key {key!r}")
        if key in kv:
            raise GGUFError(f"{path}: duplicate key {key!r}")
        kv[key] = _read_value(cur, vtype, key)
        kv_types[key] = vtype

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in kv:
        a = kv["general.alignment"]
        if kv_types["general.alignment"] != GGUFValueType.UINT32:
            raise GGUFError(f"{path}: general.alignment must be a u32, found GGUF type {kv_types['general.alignment']}")
        if a == 0 or (a & (a - 1)):
            raise GGUFError(f"{path}: general.alignment {a} is not a power of two")
        alignment = int(a)

    raw = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        if len(name.encode()) > MAX_NAME_BYTES:
            raise GGUFError(f"{path}: tensor #{i} name {name!r} is {len(name.encode())} bytes, max {MAX_NAME_BYTES}")
        if name in names:
            raise GGUFError(f"{path}: duplicate tensor name {name!r}")
        names.add(name)
        n_dims = cur.u32(f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dims, allowed 1..{MAX_DIMS}")
        ne = tuple(int(cur.u64(f"ne[{d}] of tensor {name!r}")) for d in range(n_dims))
        type_id = cur.u32(f"type of tensor {name!r}")
        rel = cur.u64(f"offset of tensor {name!r}")
        raw.append((name, type_id, ne, rel))

    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    tensors: list[TensorInfo] = []
    expected = 0
    for name, type_id, ne, rel in raw:
        t = quants.qtype(type_id, tensor=name, file=str(path))
        try:
            nbytes = quants.tensor_nbytes(type_id, ne, tensor=name)
        except quants.ShapeError as e:
            raise GGUFError(f"{path}: {e}") from None
        if rel % alignment:
            raise GGUFError(f"{path}: tensor {name!r} offset {rel} is not a multiple of the alignment {alignment}")
        if rel != expected:
            kind = "overlaps the previous tensor" if rel < expected else "leaves a gap after the previous tensor"
            raise GGUFError(
                f"{path}: tensor {name!r} ({t.name} {list(ne)}) offset {rel} {kind}: expected {expected} "
                f"(running sum of padded sizes; the previous tensor's type and shape require that many bytes)"
            )
        end = data_offset + rel + nbytes
        if end > size:
            raise GGUFError(
                f"{path}: tensor {name!r} ({t.name} {list(ne)}, {nbytes} bytes at {data_offset + rel}) ends at {end}, "
                f"beyond the end of the file ({size} bytes): truncated data"
            )
        tensors.append(TensorInfo(name, type_id, ne, rel, data_offset + rel, nbytes))
        expected = rel + (nbytes + alignment - 1) // alignment * alignment
    if data_offset > size and n_tensors:
        raise GGUFError(f"{path}: data section starts at {data_offset}, beyond the end of the file ({size} bytes)")
    return GGUFHeader(path, size, version, alignment, data_offset, kv, kv_types, tensors)


def read_array(header: GGUFHeader, key: str):
    """Read an array value that :func:`read_header` skipped.

    Returns a numpy array for numeric element types (bool as uint8) or a list of
    ``bytes`` for string arrays. Raises KeyError if the key is absent, TypeError if
    it is not an array.
    """
    ref = header.kv[key]
    if not isinstance(ref, ArrayRef):
        raise TypeError(f"{header.path}: key {key!r} is not an array")
    with open(header.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if ref.elem_type == GGUFValueType.STRING:
            out = []
            pos = ref.offset
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(ref.count):
                (n,) = unpack(mm, pos)
                out.append(mm[pos + 8 : pos + 8 + n])
                pos += 8 + n
            return out
        dt = ARRAY_DTYPES[ref.elem_type]
        return np.frombuffer(mm, dtype=dt, count=ref.count, offset=ref.offset).copy()
    finally:
        mm.close()


# --------------------------------------------------------------------------- shards


@dataclass
class GGUFModel:
    """A model as one or more GGUF shards.

    ``shards[k]`` is shard k (0-based ``split.no``); ``kv`` is shard 0's metadata;
    ``tensors`` maps each tensor name to ``(shard index, TensorInfo)`` in shard order.
    """

    shards: list[GGUFHeader]
    tensors: dict[str, tuple[int, TensorInfo]] = field(default_factory=dict)

    @property
    def kv(self) -> dict[str, object]:
        return self.shards[0].kv

    @property
    def arch(self) -> str:
        a = self.shards[0].arch
        if not a:
            raise GGUFError(f"{self.shards[0].path}: no general.architecture key")
        return a

    @property
    def paths(self) -> list[Path]:
        return [s.path for s in self.shards]


def shard_paths(path: str | os.PathLike) -> list[Path]:
    """All shard paths of the model ``path`` belongs to (``[path]`` for a single file).

    A name ``PREFIX-0000K-of-0000N.gguf`` yields the N sibling names, 1-based, in order.
    Raises GGUFError when a sibling is missing, naming it.
    """
    p = Path(path)
    m = SPLIT_RE.match(p.name)
    if not m:
        return [p]
    count = int(m.group("count"))
    no = int(m.group("no"))
    if count < 1 or not 1 <= no <= count:
        raise GGUFError(f"{p}: shard number {no} of {count} in the file name is impossible")
    out = [p.with_name(f"{m.group('prefix')}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [str(q) for q in out if not q.exists()]
    if missing:
        raise GGUFError(f"{p}: missing shard(s) of {count}: {', '.join(missing)}")
    return out


def open_model(path: str | os.PathLike) -> GGUFModel:
    """Open a single GGUF file or every shard of a split model (any shard path finds its siblings).

    Checks, each a :class:`GGUFError` naming the shard: missing or zero-byte shards; each
    shard's ``split.no`` equals its position and ``split.count`` the shard count;
    ``split.tensors.count`` agrees across shards and equals the tensors found; a shard whose
    ``general.architecture`` differs from shard 0's (a foreign shard); a tensor name in two
    shards (a duplicated shard).
    """
    paths = shard_paths(path)
    shards = [read_header(p) for p in paths]
    n = len(shards)
    first = shards[0]
    if n == 1 and not SPLIT_RE.match(paths[0].name):
        sc = first.get("split.count")
        if sc is not None and int(sc) > 1:
            raise GGUFError(
                f"{first.path}: split.count is {sc} but the file name is not NAME-0000K-of-0000N.gguf; "
                f"cannot find the other shards"
            )
    model = GGUFModel(shards)
    if n > 1 or "split.count" in first.kv:
        total = first.get("split.tensors.count")
        for k, s in enumerate(shards):
            no, cnt, tot = s.get("split.no"), s.get("split.count"), s.get("split.tensors.count")
            if no is None or cnt is None:
                raise GGUFError(f"{s.path}: not a split shard (no split.no / split.count keys)")
            if int(no) != k:
                raise GGUFError(
                    f"{s.path}: split.no is {no} but the file name says shard {k} (0-based): duplicated or renamed "
                    "shard"
                )
            if int(cnt) != n:
                raise GGUFError(f"{s.path}: split.count is {cnt}, expected {n} (shard from a different split)")
            if tot is not None and total is not None and int(tot) != int(total):
                raise GGUFError(
                    f"{s.path}: split.tensors.count is {tot} but shard 0 says {total}: shard of a different model"
                )
            a = s.arch
            if k > 0 and a is not None and first.arch is not None and a != first.arch:
                raise GGUFError(
                    f"{s.path}: general.architecture {a!r} differs from shard 0's {first.arch!r}: foreign shard"
                )
    for k, s in enumerate(shards):
        for t in s.tensors:
            if t.name in model.tensors:
                other = shards[model.tensors[t.name][0]].path
                raise GGUFError(f"{s.path}: tensor {t.name!r} also in {other}: duplicated or foreign shard")
            model.tensors[t.name] = (k, t)
    total = first.get("split.tensors.count")
    if total is not None and int(total) != len(model.tensors):
        raise GGUFError(
            f"{first.path}: split.tensors.count is {total} but the {n} shard(s) hold {len(model.tensors)} tensors"
        )
    return model
