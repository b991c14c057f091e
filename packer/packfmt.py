"""The pack format: the one writer and the one strict reader of ``index.txt``,
``native_experts.txt``, ``geometry.txt`` and ``metadata.txt``, used by all three tools.

A pack directory holds:

- ``pool.bin``: dense tensors, each at a multiple of the pack alignment; source bytes
  unchanged except BF16, stored promoted to F32 (``bf16 << 16``, exact).
- ``index.txt``: one line per dense tensor (columns :data:`INDEX_COLUMNS`).
- ``native_experts.txt``: one line per MoE layer: types, per-expert blob size, arena
  offset and absolute byte offsets/strides of the expert weights inside the GGUF shards
  (columns :data:`EXPERT_COLUMNS`). Expert ``e``'s gate bytes are
  ``[gate_off + e * gate_stride, + gate_bytes)`` in shard ``gate_shard``; likewise up/down.
  ``gate_bytes == gate_stride`` except for a fused ``ffn_gate_up_exps`` tensor, whose gate and
  up halves interleave per expert (stride = both halves, bytes = one half).
- ``geometry.txt``: ``key value`` lines, every number a kernel depends on (see
  :mod:`strata.manifests.contract`).
- ``metadata.txt``: every scalar GGUF key as ``key type value`` (strings escaped), and the
  architecture's numeric arrays (comma-separated), so no tool needs the GGUF metadata after packing.
- ``vocab.parquet`` / ``merges.parquet``: the tokenizer arrays; ``build.json``: a summary
  for people and Python tools (never read on the weight path).

Readers are strict by design (the engine's lesson: a parser whose failure mode is a wrong
byte offset decodes to plausible weights): the version line must match, ``# columns``
must list exactly the expected columns in order, and any other line shape is refused
with :class:`PackFormatError` naming the file and the line number.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

INDEX_VERSION_LINE = "# strata pack index v1"
EXPERTS_VERSION_LINE = "# strata native experts v1"
GEOMETRY_VERSION_LINE = "# strata geometry v1"
METADATA_VERSION_LINE = "# strata metadata v1"

INDEX_COLUMNS = ("name", "type", "src_type", "offset", "nbytes", "ne0", "ne1", "ne2", "ne3", "shard", "src_offset")
EXPERT_COLUMNS = (
    "layer",
    "gate_type",
    "up_type",
    "down_type",
    "blob_bytes",
    "arena_offset",
    "gate_shard",
    "gate_off",
    "gate_stride",
    "up_shard",
    "up_off",
    "up_stride",
    "down_shard",
    "down_off",
    "down_stride",
    "gate_bytes",
    "up_bytes",
    "down_bytes",
)

POOL_FILE = "pool.bin"
INDEX_FILE = "index.txt"
EXPERTS_FILE = "native_experts.txt"
GEOMETRY_FILE = "geometry.txt"
METADATA_FILE = "metadata.txt"
VOCAB_FILE = "vocab.parquet"
#: The Arrow type of each column of vocab.parquet (id, token, score, token_type) and merges.parquet (merge), as
#: strata-pack build writes them; score and token_type only where the GGUF has tokenizer.ggml.scores / .token_type.
TOKENIZER_COLUMN_TYPES = {"id": "int32", "token": "binary", "score": "float", "token_type": "int32", "merge": "binary"}
MERGES_FILE = "merges.parquet"
BUILD_FILE = "build.json"
#: The build record's name before 2026-11-30 ("manifest" also named the contracts): read, never written.
LEGACY_BUILD_FILE = "manifest.json"
#: Every file a pack directory may hold (what strata-pack build writes; the legacy build record too).
PACK_FILES = frozenset(
    {
        POOL_FILE,
        INDEX_FILE,
        EXPERTS_FILE,
        GEOMETRY_FILE,
        METADATA_FILE,
        VOCAB_FILE,
        MERGES_FILE,
        BUILD_FILE,
        LEGACY_BUILD_FILE,
    }
)


def build_record_path(pack_dir) -> Path:
    """The pack's build record: ``build.json``, or ``manifest.json`` in a pack built before the rename
    (the path of ``build.json`` when neither exists)."""
    from pathlib import Path

    d = Path(pack_dir)
    return (
        d / LEGACY_BUILD_FILE if not (d / BUILD_FILE).exists() and (d / LEGACY_BUILD_FILE).exists() else d / BUILD_FILE
    )


def sources_modified(pack_dir: str | os.PathLike, paths: list[Path]) -> list[Path]:
    """The source shards among ``paths`` whose modification time differs from the build record's (``build.json``;
    matched by file name): the expert bytes the engine reads from them may have changed since the build (``strata-pack
    verify`` re-reads the experts' samples). A record that is missing or unreadable gives [] (verify reports it)."""
    try:
        rec = json.loads(build_record_path(Path(pack_dir)).read_text())
        mtimes = {str(x["file"]): x.get("mtime_ns") for x in rec["sources"]}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    out = []
    for p in paths:
        t = mtimes.get(Path(p).name)
        try:
            if t is not None and Path(p).stat().st_mtime_ns != int(t):
                out.append(Path(p))
        except (OSError, ValueError, TypeError):
            continue
    return out


def sources_retargeted(pack_dir: str | os.PathLike, paths: list[Path]) -> list[Path]:
    """The source shards among ``paths`` that now resolve to another file than the one the build read (the build
    record's ``path``, symlinks resolved; matched by file name): a symlink pointed elsewhere, or sources moved
    (``--source-dir``, a copied Hugging Face cache). Whether the bytes are the same is for the expert samples to say
    (:func:`strata.packer.verify.check_expert_samples`). A record that is missing or unreadable gives []."""
    try:
        rec = json.loads(build_record_path(Path(pack_dir)).read_text())
        where = {str(x["file"]): x.get("path") for x in rec["sources"]}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    out = []
    for p in paths:
        w = where.get(Path(p).name)
        try:
            if isinstance(w, str) and str(Path(p).resolve()) != w:
                out.append(Path(p))
        except OSError:
            continue
    return out


class PackFormatError(ValueError):
    """A pack file that does not follow the format; names the file, the line and the numbers."""


class NotAPackError(PackFormatError):
    """The path is not a pack directory at all (missing, a file, a GGUF file, a directory without
    ``index.txt``): bad input, never "a corrupt pack" (``strata-pack verify`` exits 2, not 1)."""


@dataclass(frozen=True)
class IndexEntry:
    """One dense tensor in the pool.

    ``type`` is the ggml type id of the pool bytes, ``src_type`` the type in the GGUF;
    ``offset``/``nbytes`` locate it in pool.bin (bytes); ``ne`` is ggml order padded to 4
    dims; ``shard`` (0-based) and ``src_offset`` (absolute, bytes) locate the source bytes.
    """

    name: str
    type: int
    src_type: int
    offset: int
    nbytes: int
    ne0: int
    ne1: int
    ne2: int
    ne3: int
    shard: int
    src_offset: int

    @property
    def ne(self) -> tuple[int, int, int, int]:
        return (self.ne0, self.ne1, self.ne2, self.ne3)


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's routed experts as they sit in the GGUF shards (all sizes in bytes)."""

    layer: int
    gate_type: int
    up_type: int
    down_type: int
    blob_bytes: int
    arena_offset: int
    gate_shard: int
    gate_off: int
    gate_stride: int
    up_shard: int
    up_off: int
    up_stride: int
    down_shard: int
    down_off: int
    down_stride: int
    gate_bytes: int
    up_bytes: int
    down_bytes: int

    def ranges(self, e: int) -> list[tuple[str, int, int, int]]:
        """``(part, shard, absolute offset, bytes)`` of expert ``e``'s gate, up and down weights."""
        return [
            ("gate", self.gate_shard, self.gate_off + e * self.gate_stride, self.gate_bytes),
            ("up", self.up_shard, self.up_off + e * self.up_stride, self.up_bytes),
            ("down", self.down_shard, self.down_off + e * self.down_stride, self.down_bytes),
        ]


@dataclass
class PackIndex:
    """Contents of index.txt: sources ``(file name, size bytes)`` per shard, alignment, pool bytes, entries."""

    sources: list[tuple[str, int]]
    align: int
    pool_bytes: int
    entries: list[IndexEntry]

    def by_name(self) -> dict[str, IndexEntry]:
        return {e.name: e for e in self.entries}


@dataclass
class NativeExperts:
    """Contents of native_experts.txt (sizes in bytes; ``max_blob`` is in source form)."""

    n_expert: int
    total: int
    max_blob: int
    shards: list[str]
    layers: list[ExpertLayer] = field(default_factory=list)

    @property
    def n_layer(self) -> int:
        return len(self.layers)


# ------------------------------------------------------------------ writers


def _atomic_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def _file_name_field(name: str) -> tuple[str, str]:
    """A source or shard file name as a header line holds it: ``("", name)`` when it is one plain token, else
    ``("-x", escaped)`` for the ``# source-x`` / ``# shard-x`` lines (:func:`_escape`; non-UTF-8 names, held as
    surrogates, too). Raises PackFormatError on an empty name."""
    if not name:
        raise PackFormatError("an empty file name; the pack format cannot hold it")
    plain = not any(c.isspace() or c == "\\" or not c.isprintable() for c in name)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        plain = False
    return ("", name) if plain else ("-x", _escape(name))


def _file_name_read(kind: str, field: str) -> str:
    """The file name of a ``# source`` / ``# shard`` line (``kind`` "source" / "shard") or of its escaped form."""
    return _unescape(field) if kind.endswith("-x") else field


def write_index(path: Path, index: PackIndex) -> None:
    """Write index.txt (file names that are not one plain token in the escaped ``# source-x`` form). Raises
    PackFormatError on a tensor name with whitespace or an empty file name."""
    lines = [INDEX_VERSION_LINE]
    for name, size in index.sources:
        x, field = _file_name_field(name)
        lines.append(f"# source{x} {field} {size}")
    lines.append(f"# align {index.align} pool {index.pool_bytes} tensors {len(index.entries)}")
    lines.append("# columns " + " ".join(INDEX_COLUMNS))
    for e in index.entries:
        _check_token(e.name, "tensor name")
        lines.append(" ".join(str(getattr(e, c)) for c in INDEX_COLUMNS))
    _atomic_text(path, "\n".join(lines) + "\n")


def write_experts(path: Path, ne: NativeExperts) -> None:
    """Write native_experts.txt."""
    lines = [
        EXPERTS_VERSION_LINE,
        f"# n_expert {ne.n_expert} n_layer {ne.n_layer} total {ne.total} max_blob {ne.max_blob}",
    ]
    for k, name in enumerate(ne.shards):
        x, field = _file_name_field(name)
        lines.append(f"# shard{x} {k} {field}")
    lines.append("# columns " + " ".join(EXPERT_COLUMNS))
    for row in ne.layers:
        lines.append(" ".join(str(getattr(row, c)) for c in EXPERT_COLUMNS))
    _atomic_text(path, "\n".join(lines) + "\n")


def write_geometry(path: Path, rows: list[tuple[str, str]]) -> None:
    """Write geometry.txt from ``(key, value)`` pairs (values already formatted, no whitespace)."""
    lines = [GEOMETRY_VERSION_LINE]
    for k, v in rows:
        _check_token(k, "geometry key")
        _check_token(v, f"geometry value of {k}")
        lines.append(f"{k} {v}")
    _atomic_text(path, "\n".join(lines) + "\n")


def _escape(s: str) -> str:
    if not s:
        return '""'
    return s.encode("unicode_escape").decode("ascii").replace(" ", "\\x20").replace('"', "\\x22")


def _unescape(s: str) -> str:
    return "" if s == '""' else codecs.decode(s, "unicode_escape")


def write_metadata(path: Path, items: list[tuple[str, str, object]]) -> None:
    """Write metadata.txt: ``key type value`` per GGUF key; ``type`` is one of int/float/bool/str, or
    int_array/float_array/bool_array (values comma-separated, bools 0/1, ``-`` for an empty array);
    strings are escaped (unicode_escape, spaces as ``\\x20``)."""
    lines = [METADATA_VERSION_LINE]
    for key, kind, v in items:
        _check_token(key, "metadata key")
        if kind in _ARRAY_KINDS:
            val = ",".join(repr(float(x)) if kind == "float_array" else str(int(x)) for x in v) or "-"
        elif kind == "str":
            val = _escape(str(v))
        elif kind == "bool":
            val = "true" if v else "false"
        elif kind == "float":
            val = repr(float(v))
        else:
            val = str(int(v))
        lines.append(f"{key} {kind} {val}")
    _atomic_text(path, "\n".join(lines) + "\n")


def _check_token(s: str, what: str) -> None:
    if not s or any(c.isspace() for c in s):
        raise PackFormatError(f"{what} {s!r} is empty or contains whitespace; the pack format cannot hold it")


# ------------------------------------------------------------------ readers


def _lines(path: Path) -> list[str]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return _check_text(path, f.read())
    except (FileNotFoundError, IsADirectoryError) as e:
        why = "missing" if isinstance(e, FileNotFoundError) else "a directory, not the pack's text file"
        raise PackFormatError(f"{path}: {why}") from None
    except UnicodeDecodeError as e:
        raise PackFormatError(f"{path}: not UTF-8 text ({e})") from None


def _check_text(path: Path, text: str) -> list[str]:
    """Split into lines; refuse CR characters (CRLF files were edited by another tool) and a missing final newline."""
    if "\r" in text:
        lineno = text[: text.index("\r")].count("\n") + 1
        raise PackFormatError(f"{path}:{lineno}: carriage return (CRLF line ending); pack files use LF only")
    if text and not text.endswith("\n"):
        raise PackFormatError(f"{path}: no newline at the end of the last line (truncated file?)")
    return text.split("\n")


def _int(tok: str, path: Path, lineno: int, col: str) -> int:
    """A non-negative decimal integer exactly as the writer writes it (no sign, '_', leading zero, non-ASCII digit)."""
    if not tok.isascii() or not tok.isdigit() or (len(tok) > 1 and tok[0] == "0"):
        raise PackFormatError(f"{path}:{lineno}: column {col}: {tok!r} is not a non-negative decimal integer")
    return int(tok)


def _expect_version(lines: list[str], version_line: str, path: Path) -> None:
    if not lines or lines[0] != version_line:
        found = lines[0] if lines else ""
        raise PackFormatError(f"{path}:1: expected {version_line!r}, found {found!r}")


def _columns(line: str, expected: tuple[str, ...], path: Path, lineno: int) -> None:
    cols = tuple(line.split()[2:])
    if cols != expected:
        raise PackFormatError(
            f"{path}:{lineno}: columns are {' '.join(cols)!r}, this reader needs exactly {' '.join(expected)!r}"
        )


def _table_lines(
    path: Path,
    version_line: str,
    columns: tuple[str, ...],
    first: str,
    header: Callable[[list[str], int], bool],
    ready: Callable[[], bool],
    *,
    quote_early_line: bool,
) -> Iterator[tuple[int, list[str]]]:
    """The header loop index.txt and native_experts.txt share: the version line, then ``# `` header lines up to
    the ``# columns`` line, then data lines. Yields each data line as ``(lineno, tokens)`` with exactly
    ``len(columns)`` space-separated tokens, once ``ready()`` says the file's own header (``# first ...``) was
    read. ``header(tokens, lineno)`` reads one file-specific ``# `` line and returns False for one it does not
    know. ``quote_early_line``: the "data line before" error quotes the line (index.txt's message does).

    Raises:
        PackFormatError: wrong version line, a header line after the columns line, an unknown header line,
            unexpected columns, a data line before the headers, a wrong field count, or a missing header
            (each naming the file and line number), and whatever ``header`` raises.
    """
    lines = _lines(path)
    _expect_version(lines, version_line, path)
    cols_seen = False
    for lineno, line in enumerate(lines[1:], start=2):
        if line == "" and lineno == len(lines):
            break
        tok = line.split(" ")
        if line.startswith("# "):
            if cols_seen:
                raise PackFormatError(f"{path}:{lineno}: header line after the columns line: {line!r}")
            if tok[1] == "columns":
                _columns(line, columns, path, lineno)
                cols_seen = True
            elif not header(tok, lineno):
                raise PackFormatError(f"{path}:{lineno}: unknown header line {line!r}")
            continue
        if not cols_seen or not ready():
            quoted = f": {line!r}" if quote_early_line else ""
            raise PackFormatError(f"{path}:{lineno}: data line before the '# {first}' and '# columns' lines{quoted}")
        if len(tok) != len(columns):
            raise PackFormatError(f"{path}:{lineno}: {len(tok)} fields, expected {len(columns)}: {line!r}")
        yield lineno, tok
    if not ready() or not cols_seen:
        raise PackFormatError(f"{path}: missing '# {first} ...' or '# columns ...' header line")


def read_index(path: str | os.PathLike) -> PackIndex:
    """Read index.txt strictly.

    Raises:
        PackFormatError: wrong version line, unexpected columns, a malformed or unknown
            line, a duplicate tensor name, or a tensor count that disagrees with the header
            (each naming the file and line number).
    """
    path = Path(path)
    sources: list[tuple[str, int]] = []
    head: dict[str, int] = {}

    def header(tok: list[str], lineno: int) -> bool:
        if tok[1] in ("source", "source-x") and len(tok) == 4:
            sources.append((_file_name_read(tok[1], tok[2]), _int(tok[3], path, lineno, "size")))
        elif tok[1] == "align" and len(tok) == 7 and tok[3] == "pool" and tok[5] == "tensors":
            head["align"] = _int(tok[2], path, lineno, "align")
            head["pool"] = _int(tok[4], path, lineno, "pool")
            head["count"] = _int(tok[6], path, lineno, "tensors")
        else:
            return False
        return True

    entries: list[IndexEntry] = []
    names: set[str] = set()
    rows = _table_lines(
        path, INDEX_VERSION_LINE, INDEX_COLUMNS, "align", header, lambda: bool(head), quote_early_line=True
    )
    for lineno, tok in rows:
        name = tok[0]
        if name in names:
            raise PackFormatError(f"{path}:{lineno}: duplicate tensor {name!r}")
        names.add(name)
        vals = [_int(t, path, lineno, c) for t, c in zip(tok[1:], INDEX_COLUMNS[1:])]
        entries.append(IndexEntry(name, *vals))
    align, pool, count = head["align"], head["pool"], head["count"]
    if align == 0 or align & (align - 1):
        raise PackFormatError(f"{path}: align {align} is not a power of two")
    if count != len(entries):
        raise PackFormatError(f"{path}: header says {count} tensors, found {len(entries)} lines")
    if not sources:
        raise PackFormatError(f"{path}: no '# source' line")
    return PackIndex(sources, align, pool, entries)


def read_experts(path: str | os.PathLike) -> NativeExperts:
    """Read native_experts.txt strictly (see :func:`read_index` for the errors)."""
    path = Path(path)
    head: list[int] = []
    shards: dict[int, str] = {}

    def header(tok: list[str], lineno: int) -> bool:
        if tok[1] == "n_expert" and len(tok) == 9 and tok[3:9:2] == ["n_layer", "total", "max_blob"]:
            head[:] = [_int(tok[i], path, lineno, tok[i - 1]) for i in (2, 4, 6, 8)]
        elif tok[1] in ("shard", "shard-x") and len(tok) == 4:
            k = _int(tok[2], path, lineno, "shard")
            if k != len(shards):
                raise PackFormatError(f"{path}:{lineno}: shard {k} out of order, expected {len(shards)}")
            shards[k] = _file_name_read(tok[1], tok[3])
        else:
            return False
        return True

    rows: list[ExpertLayer] = []
    lines = _table_lines(
        path, EXPERTS_VERSION_LINE, EXPERT_COLUMNS, "n_expert", header, lambda: bool(head), quote_early_line=False
    )
    for lineno, tok in lines:
        vals = [_int(t, path, lineno, c) for t, c in zip(tok, EXPERT_COLUMNS)]
        row = ExpertLayer(*vals)
        if rows and row.layer <= rows[-1].layer:
            raise PackFormatError(
                f"{path}:{lineno}: layer {row.layer} after layer {rows[-1].layer}: layers must increase"
            )
        for part in ("gate", "up", "down"):
            sh = getattr(row, f"{part}_shard")
            if sh not in shards:
                raise PackFormatError(f"{path}:{lineno}: layer {row.layer} {part}_shard {sh} has no '# shard' line")
        rows.append(row)
    n_expert, n_layer, total, max_blob = head
    if n_layer != len(rows):
        raise PackFormatError(f"{path}: header says n_layer {n_layer}, found {len(rows)} lines")
    return NativeExperts(n_expert, total, max_blob, [shards[k] for k in range(len(shards))], rows)


def read_kv_text(path: str | os.PathLike, version_line: str) -> dict[str, str]:
    """Read a ``key value`` file (geometry.txt) strictly: one space-separated pair per line,
    unique keys. Raises PackFormatError naming file and line."""
    path = Path(path)
    lines = _lines(path)
    _expect_version(lines, version_line, path)
    out: dict[str, str] = {}
    for lineno, line in enumerate(lines[1:], start=2):
        if line == "" and lineno == len(lines):
            break
        tok = line.split(" ")
        if len(tok) != 2 or not tok[0] or not tok[1]:
            raise PackFormatError(f"{path}:{lineno}: expected 'key value', found {line!r}")
        if tok[0] in out:
            raise PackFormatError(f"{path}:{lineno}: duplicate key {tok[0]!r}")
        out[tok[0]] = tok[1]
    return out


def read_geometry_params(path: str | os.PathLike) -> dict[str, str]:
    """geometry.txt as ``{key: value-text}`` (``arch`` included)."""
    d = read_kv_text(path, GEOMETRY_VERSION_LINE)
    if "arch" not in d:
        raise PackFormatError(f"{path}: no 'arch' line")
    return d


_ARRAY_KINDS = ("int_array", "float_array", "bool_array")


def _read_array_value(kind: str, val: str) -> list:
    """A metadata.txt array value (``1,2,3``; ``-`` empty) as a list of int / float / bool."""
    if val == "-":
        return []
    parts = val.split(",")
    if kind == "float_array":
        return [float(x) for x in parts]
    for x in parts:
        body = x[1:] if x.startswith("-") else x
        if not (body.isascii() and body.isdigit()):
            raise ValueError(f"{kind} element {x!r} is not a decimal integer")
    if kind == "bool_array":
        if any(x not in ("0", "1") for x in parts):
            raise ValueError(f"bool_array value {val!r}: elements must be 0 or 1")
        return [x == "1" for x in parts]
    return [int(x) for x in parts]


def read_metadata(path: str | os.PathLike) -> dict[str, object]:
    """metadata.txt as ``{key: value}`` with Python types restored."""
    path = Path(path)
    lines = _lines(path)
    _expect_version(lines, METADATA_VERSION_LINE, path)
    out: dict[str, object] = {}
    for lineno, line in enumerate(lines[1:], start=2):
        if line == "" and lineno == len(lines):
            break
        tok = line.split(" ")
        if len(tok) != 3:
            raise PackFormatError(f"{path}:{lineno}: expected 'key type value', found {line!r}")
        key, kind, val = tok
        try:
            if kind == "int":
                out[key] = int(val)
                if not (val.lstrip("-").isascii() and val.lstrip("-").isdigit()) or val.startswith("+"):
                    raise ValueError(f"int value {val!r} is not a decimal integer")
            elif kind == "float":
                out[key] = float(val)
            elif kind == "bool":
                if val not in ("true", "false"):
                    raise ValueError(f"bool value {val!r} is not true/false")
                out[key] = val == "true"
            elif kind == "str":
                out[key] = _unescape(val)
            elif kind in _ARRAY_KINDS:
                out[key] = _read_array_value(kind, val)
            else:
                raise ValueError(f"unknown type {kind!r}")
        except ValueError as e:
            raise PackFormatError(f"{path}:{lineno}: {e}") from None
    return out
