"""``strata-pack verify``: re-read a pack against its sources.

The pack is rebuilt in memory from the source GGUF (same code as ``build``) and compared
with what is on disk: every index.txt row (pool type, offsets, sizes, alignment, source
offsets), every native_experts.txt row and shard name, geometry.txt and metadata.txt; then
every dense tensor's pool bytes are compared with its source bytes (BF16 sources after
promotion to F32) in bounded chunks. The routed experts are not copied into the pack: their bytes
are checked through the build record's samples (the first and last 256 B of every expert's weights,
:mod:`strata.packer.expert_samples`; a difference is an error naming the layer); a source shard whose
size or modification time differs from build time is reported (size: an error; mtime: a warning). The
first mismatch is reported with the tensor (or file) name and both numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata.manifests.contract import geometry_from_params, geometry_params_text

from . import quants
from .build import CHUNK_BYTES, check_tokenizer
from .expert_samples import EXPERT_SAMPLE_BYTES, expert_sample_digests
from .gguf_file import GGUFError, open_model, read_array
from .pack import check_pool_layout, read_pack
from .pack_geometry import same_value
from .pack_plan import BuildError, layout_pool, metadata_items, resolve_geometry, tabulate_experts
from .packfmt import (
    GEOMETRY_VERSION_LINE,
    INDEX_FILE,
    POOL_FILE,
    NotAPackError,
    PackFormatError,
    build_record_path,
    read_kv_text,
    sources_modified,
)
from .parquet_io import read_parquet_table


class VerifyError(ValueError):
    """A pack that does not match its sources; names the tensor (or file) and both numbers."""


@dataclass
class VerifyResult:
    """What was compared: tensors and bytes (dense), layers (experts); warnings (e.g. mtime)."""

    pack: Path
    dense_tensors: int
    dense_bytes: int
    expert_layers: int
    warnings: list[str] = field(default_factory=list)


def read_pack_or_refuse(pack_dir, source_dir=None):
    """:func:`read_pack`, with a malformed pack file reported as a mismatch (:class:`VerifyError`: the
    pack is corrupt) and a path that is no pack at all left a :class:`NotAPackError` (bad input)."""
    try:
        return read_pack(pack_dir, source_dir=source_dir)
    except NotAPackError:
        raise
    except PackFormatError as e:
        raise VerifyError(str(e)) from None


def _verify_tokenizer(model, pack_dir: Path) -> None:
    """vocab.parquet (and merges.parquet) against the source's ``tokenizer.ggml.*`` arrays: present exactly
    when the source has them, readable, and equal (token bytes, scores, token types, merges).

    Raises:
        VerifyError: naming the file and the first difference (or why it cannot be read).
    """

    from .packfmt import MERGES_FILE, TOKENIZER_COLUMN_TYPES, VOCAB_FILE

    h = model.shards[0]
    for fname, key, cols in (
        (
            VOCAB_FILE,
            "tokenizer.ggml.tokens",
            (
                ("token", "tokenizer.ggml.tokens"),
                ("score", "tokenizer.ggml.scores"),
                ("token_type", "tokenizer.ggml.token_type"),
            ),
        ),
        (MERGES_FILE, "tokenizer.ggml.merges", (("merge", "tokenizer.ggml.merges"),)),
    ):
        path = pack_dir / fname
        if key not in h.kv or (fname == MERGES_FILE and "tokenizer.ggml.tokens" not in h.kv):
            if path.exists():
                raise VerifyError(f"{path}: present, but the source has no {key}")
            continue
        if not path.is_file():
            raise VerifyError(f"{path}: missing; the source has {key} (the pack's tokenizer)")
        try:
            with open(path, "rb") as f:  # a file object: pyarrow takes no path that is not UTF-8
                table = read_parquet_table(f)
        except Exception as e:  # pyarrow raises its own types for a damaged file
            raise VerifyError(f"{path}: unreadable ({e})") from None
        want_cols = (["id"] if fname == VOCAB_FILE else []) + [c for c, k in cols if k in h.kv]
        if table.column_names != want_cols:
            raise VerifyError(
                f"{path}: columns {table.column_names}, the source gives {want_cols} (as strata-pack build writes them)"
            )
        for c in want_cols:
            if str(table.column(c).type) != TOKENIZER_COLUMN_TYPES[c]:
                raise VerifyError(
                    f"{path}: column {c!r} has type {table.column(c).type}, strata-pack build writes "
                    f"{TOKENIZER_COLUMN_TYPES[c]}"
                )
        if fname == VOCAB_FILE:
            ids = table.column("id").to_numpy()
            if not np.array_equal(ids, np.arange(len(ids))):
                i = int(np.argmax(ids != np.arange(len(ids))))
                raise VerifyError(f"{path}: column id entry {i} is {int(ids[i])}, expected {i} (ids 0..{len(ids) - 1})")
        for col, k in cols:
            if k not in h.kv:
                continue
            want = read_array(h, k)
            if col not in table.column_names:
                raise VerifyError(f"{path}: no column {col!r}; the source has {k}")
            got = table.column(col).to_pylist()
            if col in ("token", "merge"):
                want = [bytes(w) if not isinstance(w, str) else w.encode() for w in want]
                got = [bytes(g) if g is not None else b"" for g in got]
            else:
                want = np.asarray(want, dtype=np.float32 if col == "score" else np.int32).tolist()
                got = np.asarray(got, dtype=np.float32 if col == "score" else np.int32).tolist()
            if len(got) != len(want):
                raise VerifyError(f"{path}: column {col} has {len(got)} entries, the source's {k} {len(want)}")
            if got != want:
                i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
                raise VerifyError(f"{path}: column {col} entry {i} is {got[i]!r}, the source's {k} gives {want[i]!r}")


def check_expert_samples(pack, paths: list[Path]) -> str | None:
    """Re-read the expert samples the build record keeps (:func:`strata.packer.expert_samples.expert_sample_digests`);
    a warning for a pack built before they were recorded, else None.

    Raises:
        VerifyError: a layer whose samples differ (the layer, its shards and both digests): a source shard was
            modified after the build.
    """
    rp = build_record_path(pack.path)
    full = json.loads(rp.read_text())
    if pack.experts is None:
        return None
    if "expert_sample_sha256" not in full:
        return (
            "the build record holds no expert samples (a pack built before they were recorded): expert bytes unchecked"
        )
    rec = full["expert_sample_sha256"]
    want = {str(L.layer) for L in pack.experts.layers}
    if (
        not isinstance(rec, dict)
        or set(rec) != want
        or not all(
            isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v) for v in rec.values()
        )
    ):
        got = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise VerifyError(
            f"{rp}: expert_sample_sha256 must map each MoE layer {sorted(want, key=int)} to a sha256 "
            f"(64 lower-case hex digits), it holds {got}; the pack is corrupt"
        )
    now = expert_sample_digests(paths, pack.experts)
    for L in pack.experts.layers:
        a, b = rec[str(L.layer)], now[str(L.layer)]
        if a != b:
            shards = sorted({pack.experts.shards[s] for s in (L.gate_shard, L.up_shard, L.down_shard)})
            raise VerifyError(
                f"experts of layer {L.layer} ({', '.join(shards)}): the first and last {EXPERT_SAMPLE_BYTES} B of "
                f"each expert's weights hash to {b[:16]}..., the build recorded {str(a)[:16]}...: the source was "
                f"modified after the pack was built; rebuild the pack (strata-pack build --force)"
            )
    return None


def _check_build_record(pack) -> None:
    """The build record (``build.json``, or an older pack's ``manifest.json``) read and held against the pack's
    own files: the architecture, the alignment, the pool's bytes, the dense tensors and every source (file name,
    bytes) as index.txt and metadata record them (the sources' recorded mtimes: :func:`sources_modified`).

    Raises:
        VerifyError: the record missing or unreadable, or a field that differs (both values): the pack is corrupt.
    """
    rp = build_record_path(pack.path)
    try:
        rec = json.loads(rp.read_text())
        srcs = [(str(x["file"]), int(x["bytes"])) for x in rec["sources"]]
        fields = {
            "arch": rec["arch"],
            "align": int(rec["align"]),
            "pool_bytes": int(rec["pool_bytes"]),
            "dense_tensors": int(rec["dense_tensors"]),
        }
    except FileNotFoundError:
        raise VerifyError(f"{rp}: missing (strata-pack build writes it); the pack is incomplete") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise VerifyError(f"{rp}: unreadable ({type(e).__name__}: {e}); the pack is corrupt") from None
    have = {
        "arch": pack.arch,
        "align": pack.index.align,
        "pool_bytes": pack.index.pool_bytes,
        "dense_tensors": len(pack.index.entries),
    }
    for k, v in fields.items():
        if v != have[k]:
            raise VerifyError(f"{rp}: {k} is {v!r}, the pack's files say {have[k]!r}; the pack is corrupt")
    if srcs != [(n, int(b)) for n, b in pack.index.sources]:
        raise VerifyError(f"{rp}: sources {srcs}, index.txt says {list(pack.index.sources)}; the pack is corrupt")


def verify_pack(
    pack_dir: str | os.PathLike, progress: bool = False, source_dir: str | os.PathLike | None = None
) -> VerifyResult:
    """Compare a pack with its source shards (see module docstring).

    Args:
        source_dir: where the source shards are now, if they moved since the build.

    Raises:
        VerifyError: first mismatch (tensor or file, both numbers); a pack file that does not
            parse (PackFormatError) is reported the same way: the pack is corrupt (the build record too:
            missing, unreadable, or disagreeing with index.txt).
        NotAPackError: the path is not a pack at all (missing, a file, a GGUF file, no index.txt).
        GGUFError: a source shard missing (moved: ``source_dir``) or unreadable; nothing compared.
    """
    from tqdm import tqdm

    pack = read_pack_or_refuse(pack_dir, source_dir)
    try:
        pool = pack.path / POOL_FILE
        if not pool.exists():
            raise PackFormatError(f"{pool}: missing")
        # offsets and sizes here; types and byte counts are compared with the source below
        check_pool_layout(pack.index, pool.stat().st_size, str(pack.path / INDEX_FILE), contents=False)
    except PackFormatError as e:
        raise VerifyError(str(e)) from None
    warnings: list[str] = []
    paths = [pack.source_path(name) for name, _size in pack.index.sources]
    for (name, size), p in zip(pack.index.sources, paths):
        if not p.exists():
            raise GGUFError(
                f"{pack.path}: source shard {name} not found at {p} "
                + (
                    "(--source-dir names the directory it is in now)"
                    if pack.source_dir_override is not None
                    else "(moved? pass --source-dir DIR)"
                )
                + "; nothing was compared"
            )
        if p.stat().st_size != size:
            raise VerifyError(f"{p}: source is {p.stat().st_size} bytes, the pack was built from {size} bytes")
    _check_build_record(pack)
    for p in sources_modified(pack.path, paths):
        warnings.append(f"{p}: modified since the pack was built (mtime differs); expert bytes are read from it")

    model = open_model(paths[0])
    names = [s.path.name for s in model.shards]
    if names != [n for n, _ in pack.index.sources]:
        raise VerifyError(
            f"index.txt sources {[n for n, _ in pack.index.sources]} differ from the model's shards {names}"
        )
    want_index = layout_pool(model, pack.index.align)
    if want_index.pool_bytes != pack.index.pool_bytes or len(want_index.entries) != len(pack.index.entries):
        raise VerifyError(
            f"index.txt: pool {pack.index.pool_bytes} B, {len(pack.index.entries)} tensors; the source gives "
            f"pool {want_index.pool_bytes} B, {len(want_index.entries)} tensors at align {pack.index.align}"
        )
    for w, g in zip(want_index.entries, pack.index.entries):
        if w != g:
            diffs = [
                f"{f}: pack {getattr(g, f)} source {getattr(w, f)}"
                for f in w.__dataclass_fields__
                if getattr(w, f) != getattr(g, f)
            ]
            raise VerifyError(f"index.txt tensor {g.name}: " + "; ".join(diffs))

    geom = resolve_geometry(model)
    want_geo = dict(geometry_params_text(geom))
    got_geo = read_kv_text(pack.path / "geometry.txt", GEOMETRY_VERSION_LINE)
    # a pack of an older (or newer) strata - params its manifest lacks or does not have - is refused with the
    # message budget and the engine's load give (ManifestError: "rebuild it"), not reported as a corrupt pack; the
    # same params with other values (one edited, even to one the manifest's rules refuse) are a corrupt pack
    if set(want_geo) != set(got_geo):
        geometry_from_params(str(got_geo.get("arch", geom.arch)), got_geo)
    if want_geo != got_geo:
        keys = sorted(k for k in set(want_geo) | set(got_geo) if want_geo.get(k) != got_geo.get(k))
        raise VerifyError(
            "geometry.txt differs from the source: "
            + "; ".join(f"{k}: pack {got_geo.get(k)} source {want_geo.get(k)}" for k in keys)
        )
    want_meta = {k: v for k, _kind, v in metadata_items(model, Path("."))}
    for k in set(want_meta) | set(pack.metadata):
        if k == "strata.source_dir":
            continue
        a, b = pack.metadata.get(k), want_meta.get(k)
        if not same_value(a, b):
            raise VerifyError(f"metadata.txt key {k}: pack {a!r} source {b!r}")

    n_layers = 0
    want_ex = tabulate_experts(model, geom)
    got_ex = pack.experts
    if (want_ex is None) != (got_ex is None):
        raise VerifyError(
            "native_experts.txt "
            + (
                "present but the source has no routed experts"
                if got_ex
                else "missing but the source has routed experts"
            )
        )
    if got_ex is not None:
        if got_ex.shards != names:
            raise VerifyError(f"native_experts.txt shards {got_ex.shards} differ from the model's shards {names}")
        for w, g in zip(want_ex.layers, got_ex.layers):
            if w != g:
                diffs = [
                    f"{f}: pack {getattr(g, f)} source {getattr(w, f)}"
                    for f in w.__dataclass_fields__
                    if getattr(w, f) != getattr(g, f)
                ]
                raise VerifyError(f"experts of layer {w.layer}: " + "; ".join(diffs))
        if len(want_ex.layers) != len(got_ex.layers) or (want_ex.total, want_ex.max_blob, want_ex.n_expert) != (
            got_ex.total,
            got_ex.max_blob,
            got_ex.n_expert,
        ):
            raise VerifyError(
                f"native_experts.txt: {len(got_ex.layers)} layers total {got_ex.total} max_blob {got_ex.max_blob} "
                f"n_expert {got_ex.n_expert}; source gives {len(want_ex.layers)} layers total {want_ex.total} "
                f"max_blob {want_ex.max_blob} n_expert {want_ex.n_expert}"
            )
        n_layers = len(got_ex.layers)

    _verify_tokenizer(model, pack.path)
    try:  # the rules the build applies to the source's tokenizer (a pack of an older build may predate one)
        check_tokenizer(model)
    except BuildError as e:
        raise VerifyError(f"{e}; the engine refuses this tokenizer at load (rebuild from a consistent GGUF)") from None
    note = check_expert_samples(pack, paths)
    if note:
        warnings.append(note)

    fds = [os.open(p, os.O_RDONLY) for p in paths]
    pfd = os.open(pack.pool_path, os.O_RDONLY)
    total = sum(e.nbytes for e in pack.index.entries)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress, leave=False) as bar:
            for e in pack.index.entries:
                bf16 = e.src_type == quants.BF16.id
                for rel in range(0, e.nbytes, CHUNK_BYTES):
                    n = min(CHUNK_BYTES, e.nbytes - rel)
                    got = os.pread(pfd, n, e.offset + rel)
                    if bf16:
                        raw = os.pread(fds[e.shard], n // 2, e.src_offset + rel // 2)
                        want = quants.bf16_to_f32_bits(np.frombuffer(raw, "<u2")).tobytes()
                    else:
                        want = os.pread(fds[e.shard], n, e.src_offset + rel)
                    if got != want:
                        a = np.frombuffer(got, np.uint8)
                        b = np.frombuffer(want, np.uint8)
                        m = min(len(a), len(b))
                        i = int(np.argmax(a[:m] != b[:m])) if m and (a[:m] != b[:m]).any() else m
                        src_byte = e.src_offset + (rel + i) // 2 if bf16 else e.src_offset + rel + i
                        raise VerifyError(
                            f"tensor {e.name}: pool byte {e.offset + rel + i} is {a[i] if i < len(a) else 'EOF'}, "
                            f"source byte {src_byte} gives {b[i] if i < len(b) else 'EOF'}"
                        )
                    bar.update(n)
    finally:
        for fd in fds:
            os.close(fd)
        os.close(pfd)
    return VerifyResult(pack.path, len(pack.index.entries), total, n_layers, warnings)
