"""``strata-pack build``: GGUF shards -> pack directory.

Flow: open every shard read-only (:func:`gguf_file.open_model`), resolve the geometry
through the architecture's manifest, lay out the dense tensors in an aligned pool,
tabulate the routed experts per layer (they stay inside the shards; the plan: :mod:`.pack_plan`), write everything
into a temporary directory beside the target, verify it, and only then rename it into
place. Any failure removes the temporary directory; the sources are never written.

The copy streams: non-BF16 tensors go through ``os.copy_file_range`` (kernel-side, no user
memory) with a bounded read/write fallback, BF16 tensors are promoted to F32 in chunks of
:data:`CHUNK_BYTES`, so peak RSS does not grow with the model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.manifests.contract import geometry_params_text

from . import quants
from .expert_samples import expert_sample_digests
from .gguf_file import GGUFModel, open_model, read_array
from .outputs import WRITE_ERRNOS, OutputError, check_free_space, sidecar_name, write_error
from .pack import open_pack
from .pack_plan import (
    BuildError,
    check_source,
    is_router_tensor,
    layout_pool,
    metadata_items,
    resolve_geometry,
    tabulate_experts,
)
from .packfmt import (
    BUILD_FILE,
    EXPERTS_FILE,
    GEOMETRY_FILE,
    INDEX_FILE,
    LEGACY_BUILD_FILE,
    MERGES_FILE,
    METADATA_FILE,
    PACK_FILES,
    POOL_FILE,
    VOCAB_FILE,
    PackIndex,
    write_experts,
    write_geometry,
    write_index,
    write_metadata,
)
from .tokenizer_rules import merge_refusal, tokenizer_refusal

CHUNK_BYTES = 8 << 20
DEFAULT_ALIGN = 64


@dataclass
class BuildResult:
    """Summary of a build (sizes in bytes)."""

    pack: Path
    arch: str
    shards: list[str]
    dense_tensors: int
    pool_bytes: int
    bf16_promoted: int
    expert_layers: int
    expert_total_bytes: int
    max_blob: int
    seconds: float

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["pack"] = str(self.pack)
        return d


def check_tokenizer(model: GGUFModel) -> None:
    """Refuse a tokenizer strata cannot run exactly as llama.cpp (an unsupported ``tokenizer.ggml.model``
    or ``tokenizer.ggml.pre``, named; a special token that is not valid UTF-8, by id):
    :func:`strata.packer.tokenizer_rules.tokenizer_refusal`. A GGUF without a vocabulary is packed.

    Raises:
        BuildError: one line naming the file and the key and value (or the token id).
    """
    h = model.shards[0]
    if "tokenizer.ggml.tokens" not in h.kv:
        return
    tokens = read_array(h, "tokenizer.ggml.tokens")
    types = read_array(h, "tokenizer.ggml.token_type").tolist() if "tokenizer.ggml.token_type" in h.kv else None
    why = tokenizer_refusal(h.kv, tokens, types, str(h.path))
    if why:
        raise BuildError(why)
    if h.kv.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" in h.kv:
        vocab = set()
        for t in tokens:
            try:
                vocab.add(bytes(t).decode("utf-8"))
            except UnicodeDecodeError:
                continue  # no text forms it: never a merge's piece
        for k, m in enumerate(read_array(h, "tokenizer.ggml.merges")):
            try:
                text = bytes(m).decode("utf-8")
            except UnicodeDecodeError:
                continue  # no text forms its pieces: llama.cpp never applies it
            why = merge_refusal(k, text, vocab, f"{h.path}: tokenizer.ggml.merges", len(tokens))
            if why:  # the engine would refuse the pack at load: refused before anything is written
                raise BuildError(why)


def _write_tokenizer(model: GGUFModel, out: Path) -> None:
    """vocab.parquet (id, token bytes, score, token_type) and merges.parquet (merge text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    h = model.shards[0]
    if "tokenizer.ggml.tokens" not in h.kv:
        return
    tokens = read_array(h, "tokenizer.ggml.tokens")
    n = len(tokens)
    cols = {"id": pa.array(np.arange(n, dtype=np.int32)), "token": pa.array(tokens, type=pa.binary())}
    for key, col, dt in (
        ("tokenizer.ggml.scores", "score", np.float32),
        ("tokenizer.ggml.token_type", "token_type", np.int32),
    ):
        if key in h.kv:
            a = read_array(h, key)
            if len(a) != n:
                raise BuildError(f"{h.path}: {key} has {len(a)} entries, tokenizer.ggml.tokens has {n}")
            cols[col] = pa.array(np.asarray(a, dtype=dt))
    with open(out / VOCAB_FILE, "wb") as f:  # file objects: pyarrow takes no path that is not UTF-8
        pq.write_table(pa.table(cols), f)
    if "tokenizer.ggml.merges" in h.kv:
        merges = read_array(h, "tokenizer.ggml.merges")
        with open(out / MERGES_FILE, "wb") as f:
            pq.write_table(pa.table({"merge": pa.array(merges, type=pa.binary())}), f)


def _copy_range(src_fd: int, dst_fd: int, src_off: int, nbytes: int, buf: bytearray) -> None:
    """Copy ``nbytes`` from ``src_off`` in src to the current position of dst (bounded memory)."""
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < nbytes:
                n = os.copy_file_range(src_fd, dst_fd, nbytes - done, src_off + done)
                if n == 0:
                    raise BuildError(f"source ended after {src_off + done} bytes while copying {nbytes} from {src_off}")
                done += n
            return
        except OSError:
            pass  # e.g. EXDEV on old kernels: fall back to read/write
    mv = memoryview(buf)
    while done < nbytes:
        want = min(len(buf), nbytes - done)
        n = os.preadv(src_fd, [mv[:want]], src_off + done)
        if n <= 0:
            raise BuildError(f"source ended after {src_off + done} bytes while copying {nbytes} from {src_off}")
        os.write(dst_fd, mv[:n])
        done += n


def _copy_bf16_as_f32(src_fd: int, dst_fd: int, src_off: int, n_elems: int) -> None:
    """Read BF16 values and write them as F32 (``u32 = u16 << 16``: exact), chunked."""
    step = CHUNK_BYTES // 4
    done = 0
    while done < n_elems:
        k = min(step, n_elems - done)
        raw = os.pread(src_fd, 2 * k, src_off + 2 * done)
        if len(raw) != 2 * k:
            raise BuildError(f"source ended while reading BF16 data at {src_off + 2 * done}")
        os.write(dst_fd, quants.bf16_to_f32_bits(np.frombuffer(raw, dtype="<u2")).tobytes())
        done += k


def write_pool(model: GGUFModel, index: PackIndex, pool_path: Path, progress: bool = True, only=None) -> None:
    """Stream every dense tensor into ``pool_path`` at its index offset, zero padding between. ``only`` (a predicate
    on tensor names): copy those tensors alone into a sparse pool of the full size (holes elsewhere, no disk used
    for them: :func:`header_pack`)."""
    from tqdm import tqdm

    if only is not None:
        _write_sparse_pool(model, index, pool_path, only)
        return
    total = sum(e.nbytes for e in index.entries)
    fds = [os.open(s.path, os.O_RDONLY) for s in model.shards]
    buf = bytearray(CHUNK_BYTES)
    try:
        with (
            open(pool_path, "wb") as f,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="pool",
                disable=not progress,
                leave=False,
            ) as bar,
        ):
            dst = f.fileno()
            pos = 0
            for e in index.entries:
                if e.offset > pos:
                    os.write(dst, bytes(e.offset - pos))
                    pos = e.offset
                if e.src_type == quants.BF16.id:
                    _copy_bf16_as_f32(fds[e.shard], dst, e.src_offset, e.nbytes // 4)
                else:
                    _copy_range(fds[e.shard], dst, e.src_offset, e.nbytes, buf)
                pos += e.nbytes
                os.lseek(dst, pos, os.SEEK_SET)
                bar.update(e.nbytes)
            if index.pool_bytes > pos:
                os.write(dst, bytes(index.pool_bytes - pos))
            os.fsync(dst)
    finally:
        for fd in fds:
            os.close(fd)


def _write_sparse_pool(model: GGUFModel, index: PackIndex, pool_path: Path, only) -> None:
    fds = [os.open(s.path, os.O_RDONLY) for s in model.shards]
    buf = bytearray(CHUNK_BYTES)
    try:
        with open(pool_path, "wb") as f:
            dst = f.fileno()
            for e in index.entries:
                if not only(e.name):
                    continue
                os.lseek(dst, e.offset, os.SEEK_SET)
                if e.src_type == quants.BF16.id:
                    _copy_bf16_as_f32(fds[e.shard], dst, e.src_offset, e.nbytes // 4)
                else:
                    _copy_range(fds[e.shard], dst, e.src_offset, e.nbytes, buf)
            os.ftruncate(dst, index.pool_bytes)
    finally:
        for fd in fds:
            os.close(fd)


def _sample_check(model: GGUFModel, pack_dir: Path, index: PackIndex) -> None:
    """Cheap post-copy check: the first and last 4 KiB of every tensor equal the source
    (BF16 compared after promotion). The full byte comparison is ``strata-pack verify``."""
    fds = [os.open(s.path, os.O_RDONLY) for s in model.shards]
    pfd = os.open(pack_dir / POOL_FILE, os.O_RDONLY)
    try:
        for e in index.entries:
            for rel in {0, max(0, e.nbytes - 4096)}:
                n = min(4096, e.nbytes - rel)
                got = os.pread(pfd, n, e.offset + rel)
                if e.src_type == quants.BF16.id:
                    raw = os.pread(fds[e.shard], n // 2, e.src_offset + rel // 2)
                    want = quants.bf16_to_f32_bits(np.frombuffer(raw, "<u2")).tobytes()
                else:
                    want = os.pread(fds[e.shard], n, e.src_offset + rel)
                if got != want:
                    raise BuildError(
                        f"pool check failed: tensor {e.name} bytes at pool offset {e.offset + rel} differ from source"
                    )
    finally:
        for fd in fds:
            os.close(fd)
        os.close(pfd)


MIN_ALIGN, MAX_ALIGN = 16, 1 << 20


def check_target(out: Path, source_paths: list[Path], force: bool) -> None:
    """Refuse an output directory that could destroy data.

    ``out`` must not exist unless ``force`` is given, and then it must be a pack (it holds
    ``index.txt`` and ``build.json`` (``manifest.json`` before the rename)) and must not be, or contain, a
    directory holding a source shard. Its parent must exist (like ``cp``: no silent ``mkdir -p``).

    Raises:
        BuildError: naming the directory and the reason.
    """
    out_abs = Path(os.path.abspath(out))
    if not out_abs.parent.is_dir():
        blocker = next((a for a in out_abs.parents if a.exists() and not a.is_dir()), None)
        if blocker is not None:
            raise BuildError(f"{out}: {blocker} is a file, not a directory")
        raise BuildError(f"{out}: parent directory {out_abs.parent} does not exist")
    for d in (out_abs.parent, *out_abs.parent.parents):  # a pack directory holds only the pack's own files
        if (d / INDEX_FILE).is_file() and (d / "pool.bin").is_file():
            raise BuildError(
                f"{out}: is inside the pack {d}; a pack directory holds only the pack's files "
                "(strata-pack build --force replaces it whole): build the pack elsewhere"
            )
    for p in source_paths:
        if out_abs == (src_dir := Path(os.path.abspath(p)).parent) or out_abs in src_dir.parents:
            raise BuildError(f"{out}: the output directory holds the source {p}; choose another directory")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():  # --force replaces packs only: no hint that leads nowhere
            raise BuildError(f"{out} exists and is not a directory; refusing to replace it (choose another path)")
        is_pack = (out / INDEX_FILE).is_file() and ((out / BUILD_FILE).is_file() or (out / LEGACY_BUILD_FILE).is_file())
        if not is_pack:  # --force replaces packs only: the hint would lead nowhere
            raise BuildError(
                f"{out} exists and is not a strata pack (no {INDEX_FILE} and {BUILD_FILE}); refusing to replace it"
                + (" even with --force" if force else " (choose another path; --force replaces packs only)")
            )
        if not force:
            raise BuildError(f"{out} already exists; pass --force to replace it")
        foreign = sorted(p.name for p in out.iterdir() if p.name not in PACK_FILES)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise BuildError(
                f"{out} holds files that are not the pack's ({shown}); --force replaces a pack "
                f"directory as a whole, so it refuses one that holds anything else"
            )


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails if ``dst`` exists (Linux renameat2 RENAME_NOREPLACE, else check+rename)."""
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        AT_FDCWD, RENAME_NOREPLACE = -100, 1
        r = renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE)
        if r == 0:
            return
        e = ctypes.get_errno()
        if e == errno.EEXIST:
            raise BuildError(
                f"{dst} appeared while the pack was being built (another build?); pass --force to replace it"
            )
        if e not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(e, os.strerror(e), str(dst))
    if dst.exists():
        raise BuildError(f"{dst} appeared while the pack was being built (another build?); pass --force to replace it")
    os.rename(src, dst)


@contextlib.contextmanager
def build_lock(out: Path):
    """Hold the build lock of ``out`` for the block: an exclusive ``flock`` on ``.NAME.lock`` beside it, created for
    the block and removed after it (removed before it is released; a build that locked a file already removed finds
    the path no longer names its file and refuses, so two builds never both hold "the" lock). Two builds into one
    output cannot both write it, nor take the other's live temporary directory for an interrupted build's.

    Raises:
        BuildError: another process holds the lock (the lock file and that process's pid named).
        OutputError: the lock file cannot be created (a read-only directory), via :func:`write_error`.
    """
    import fcntl

    path = Path(os.path.abspath(out)).parent / sidecar_name(out, ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise write_error(e, out, 0) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise BuildError(
                f"{out}: another strata-pack build is writing it (lock {path} held by pid {pid}); wait for it to "
                "finish or choose another output"
            ) from None
        st = os.fstat(fd)
        try:
            cur = os.stat(path)
        except FileNotFoundError:
            cur = None
        if cur is None or (cur.st_ino, cur.st_dev) != (st.st_ino, st.st_dev):
            raise BuildError(f"{out}: another strata-pack build finished or started meanwhile (lock {path}); try again")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)  # releases the lock


def stale_temp_dirs(out: Path) -> list[Path]:
    """Temporary directories of earlier interrupted builds of ``out`` (``.NAME.tmp-*`` beside it)."""
    parent = Path(os.path.abspath(out)).parent
    if not parent.is_dir():
        return []
    prefix = sidecar_name(out, ".tmp-")
    return sorted(p for p in parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


def write_tables(d: Path, model: GGUFModel, geom, index: PackIndex, experts) -> None:
    """The pack's tables into directory ``d``: index.txt (the pool's layout), native_experts.txt (when the model has
    routed experts), geometry.txt and metadata.txt (with the directory the user named the shards in). What
    :func:`build_pack` writes beside pool.bin and the vocabulary, and :func:`header_pack` too (docs/FORMAT.md)."""
    write_index(d / INDEX_FILE, index)
    if experts is not None:
        write_experts(d / EXPERTS_FILE, experts)
    write_geometry(d / GEOMETRY_FILE, geometry_params_text(geom))
    # the directory the user named the shards in, symlinks NOT followed: a Hugging Face cache holds
    # snapshots/REV/NAME.gguf -> ../../blobs/HASH, and the pack finds NAME.gguf in snapshots/REV only
    src_dir = Path(os.path.abspath(model.shards[0].path)).parent
    write_metadata(d / METADATA_FILE, metadata_items(model, src_dir))


def header_pack(src: str | os.PathLike, out: str | os.PathLike, *, align: int = DEFAULT_ALIGN) -> Path:
    """The tables of the pack ``src`` would build, from the GGUF headers alone, into the new directory ``out``
    (which must not exist): :func:`write_tables`, the vocabulary and a SPARSE pool.bin of the pool's size holding the
    router weights alone (:func:`strata.packer.pack_plan.is_router_tensor`; holes elsewhere), so that
    ``strata-budget check`` audits and plans a GGUF before a pack is built - the same code on the same tables as the
    built pack, hence the same terms and the same model identity. Nothing else may read its pool (zeros outside
    the routers).

    Raises:
        GGUFError, BuildError, ManifestError, KeysRefusedError: as :func:`build_pack` refuses the same source.
    """
    out = Path(out)
    model = open_model(src)
    geom = resolve_geometry(model)
    check_source(model, geom)
    index = layout_pool(model, align)
    experts = tabulate_experts(model, geom)
    check_tokenizer(model)
    out.mkdir()
    write_tables(out, model, geom, index, experts)
    _write_tokenizer(model, out)
    # the router weights alone are copied (they identify the model's routing: an expert profile recorded on the pack
    # is checked against them); every other byte of the pool is a hole
    write_pool(model, index, out / POOL_FILE, progress=False, only=is_router_tensor)
    return out


def build_pack(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    align: int = DEFAULT_ALIGN,
    force: bool = False,
    progress: bool = True,
    on_warning=None,
) -> BuildResult:
    """Build a pack from ``src`` (a GGUF file or any shard of a split model) into directory ``out``.

    The pack is written into a temporary directory beside ``out`` and renamed into place
    only after it re-reads cleanly (strict readers, pool layout, sampled bytes). Without
    ``force`` the final rename refuses to replace anything (RENAME_NOREPLACE). With ``force``
    an existing pack is moved aside, the new one renamed in, then the old one deleted; only
    a directory that is a pack and holds no source is ever replaced (:func:`check_target`).

    One build of ``out`` at a time (:func:`build_lock`); ``on_warning`` hears of temporary directories left by
    interrupted builds of ``out`` (found with the lock held, so never a running build's).

    Raises:
        GGUFError: unreadable or inconsistent source (names the file and numbers).
        BuildError: a pack that cannot be built (target exists without ``force``, target not a
            pack, alignment out of range, layer count disagreeing with the tensors, another build of ``out``
            running, a parent directory missing).
        ManifestError: metadata that does not satisfy the architecture's manifest.
        KeysRefusedError: a metadata key whose value strata does not implement (file, key, value named).
        OutputError: the output cannot be written (disk full: the bytes needed and free; read-only or
            forbidden directory), naming ``out``; the temp dir is removed. A disk with less free
            space than pool.bin needs is refused before anything is copied.
    """
    out = Path(out)
    if not Path(os.path.abspath(out)).parent.is_dir():  # nothing to lock: refused below, naming what is missing
        return _build_pack(src, out, align=align, force=force, progress=progress)
    with build_lock(out):
        for stale in stale_temp_dirs(out):  # the lock is held: no build of out is running, these are left over
            if on_warning is not None:
                on_warning(f"{stale} is left from an interrupted build; remove it")
        return _build_pack(src, out, align=align, force=force, progress=progress)


def _build_pack(src: str | os.PathLike, out: Path, *, align: int, force: bool, progress: bool) -> BuildResult:
    """:func:`build_pack` under the build lock."""
    t0 = time.perf_counter()
    if not MIN_ALIGN <= align <= MAX_ALIGN or align & (align - 1):
        raise BuildError(f"pack alignment {align} must be a power of two in [{MIN_ALIGN}, {MAX_ALIGN}]")
    if (out.exists() or out.is_symlink()) and not force:  # refused before the source is read
        check_target(out, [], force)
    model = open_model(src)
    check_target(out, model.paths, force)
    geom = resolve_geometry(model)
    check_source(model, geom)
    check_tokenizer(model)
    index = layout_pool(model, align)
    experts = tabulate_experts(model, geom)
    needed = index.pool_bytes + TABLES_ALLOWANCE_BYTES
    check_free_space(
        out,
        needed,
        f"the pack (pool.bin {index.pool_bytes:,} bytes + up to {TABLES_ALLOWANCE_BYTES >> 20} MiB of tables)",
    )
    try:
        tmp = Path(tempfile.mkdtemp(prefix=sidecar_name(out, ".tmp-"), dir=Path(os.path.abspath(out)).parent))
    except OSError as e:
        raise write_error(e, out, needed) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a pack is an ordinary directory
    try:
        write_pool(model, index, tmp / POOL_FILE, progress=progress)
        write_tables(tmp, model, geom, index, experts)
        _write_tokenizer(model, tmp)
        result = BuildResult(
            pack=out,
            arch=geom.arch,
            shards=[str(p.resolve()) for p in model.paths],
            dense_tensors=len(index.entries),
            pool_bytes=index.pool_bytes,
            bf16_promoted=sum(1 for e in index.entries if e.src_type == quants.BF16.id),
            expert_layers=experts.n_layer if experts else 0,
            expert_total_bytes=experts.total if experts else 0,
            max_blob=experts.max_blob if experts else 0,
            seconds=0.0,
        )
        record = {
            "format": "strata pack v1",
            "arch": geom.arch,
            "geometry": dict(geometry_params_text(geom)),
            "sources": [
                {
                    "file": s.path.name,
                    "path": str(s.path.resolve()),
                    "bytes": s.file_size,
                    "mtime_ns": s.path.stat().st_mtime_ns,
                }
                for s in model.shards
            ],
            "align": align,
            "pool_bytes": index.pool_bytes,
            "dense_tensors": len(index.entries),
            "expert_layers": result.expert_layers,
            "expert_total_bytes": result.expert_total_bytes,
            "max_blob": result.max_blob,
            "bf16_promoted": result.bf16_promoted,
            "expert_sample_sha256": expert_sample_digests(model.paths, experts) if experts else {},
        }
        with open(tmp / BUILD_FILE, "w") as f:
            json.dump(record, f, indent=1)
        # verify what was written before it becomes visible
        reread = open_pack(tmp)
        if reread.index.entries != index.entries or (experts and reread.experts.layers != experts.layers):
            raise BuildError("re-read of the written index/experts differs from what was meant to be written")
        _sample_check(model, tmp, index)
        if force and out.exists():
            check_target(out, model.paths, force)  # still a pack, still not holding a source
            trash = Path(tempfile.mkdtemp(prefix=sidecar_name(out, ".old-"), dir=tmp.parent))
            os.rename(out, trash / "old")
            try:
                _rename_noreplace(tmp, out)
            except BaseException:
                os.rename(trash / "old", out)  # put the previous pack back
                raise
            finally:
                shutil.rmtree(trash, ignore_errors=True)
        else:
            _rename_noreplace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, OutputError) and e.errno in WRITE_ERRNOS:
            raise write_error(e, out, needed) from None
        raise
    result.seconds = time.perf_counter() - t0
    return result


#: Room kept for the pack's small files beside pool.bin (index, experts, geometry, metadata, vocab.parquet,
#: build.json: a 150k-token vocabulary's parquet is ~3 MiB) when the free space is checked before a build.
TABLES_ALLOWANCE_BYTES = 16 << 20


__all__ = [
    "BuildResult",
    "build_pack",
    "check_target",
    "check_tokenizer",
    "stale_temp_dirs",
    "build_lock",
    "write_pool",
    "write_tables",
    "header_pack",
]
