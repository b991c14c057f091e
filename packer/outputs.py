"""Writing outputs so that a failure names the output and nothing half-written is left.

Every strata command that writes a file writes it under a temporary name beside its target and
renames it into place only when complete (:func:`atomic_output`); an error while writing is reported
naming the target the user gave, not the temporary name, with the bytes needed and available when
the disk is full (:func:`write_error`); a large output checks the free space first
(:func:`check_free_space`).
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .gguf_file import has_gguf_magic

#: errno values of a failed write (full disk, quota, read-only or forbidden target, file too large):
#: reported naming the output the user gave (:func:`write_error`), never a temporary name
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


class OutputError(OSError):
    """An output that cannot be written; the message names the target (and the bytes, when the disk is full)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``directory`` (statvfs)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:,.1f} MiB)"


def check_free_space(target: str | os.PathLike, needed: int, what: str = "") -> None:
    """Refuse before writing when the filesystem of ``target``'s parent has fewer than ``needed`` bytes free.

    Raises:
        OutputError: naming ``target``, the bytes needed and the bytes available.
    """
    parent = Path(os.path.abspath(target)).parent
    try:
        free = free_bytes(parent)
    except OSError:
        return  # no statvfs here: the write itself reports a full disk
    if free < needed:
        raise OutputError(
            errno.ENOSPC,
            f"{target}: not enough free space: {what or 'the output'} needs {_mib(needed)}, "
            f"{_mib(free)} free on the filesystem of {parent}; nothing was written",
        )


def write_error(e: OSError, target: str | os.PathLike, needed: int | None = None) -> OutputError:
    """``e`` (raised while writing ``target`` or a temporary file beside it) as one line naming ``target``:
    a full disk with the bytes needed and available, a read-only or forbidden directory with its name."""
    parent = Path(os.path.abspath(target)).parent
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{_mib(free_bytes(parent))} free now"
        except OSError:
            free = "free space unknown"
        need = f"needs {_mib(needed)}, " if needed is not None else ""
        return OutputError(
            e.errno,
            f"{target}: no space left on the device: the output {need}{free} on the "
            f"filesystem of {parent}; nothing was written",
        )
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return OutputError(
            e.errno,
            f"{target}: cannot write here: {parent} is "
            f"{'on a read-only filesystem' if e.errno == errno.EROFS else 'not writable'} "
            f"({e.strerror}); nothing was written",
        )
    return OutputError(e.errno, f"{target}: cannot write: {e.strerror or e}; nothing was written")


def check_overwrite(
    target: str | os.PathLike, *, force: bool = False, inputs: tuple[str | os.PathLike, ...] = ()
) -> None:
    """Refuse to write over what must not be lost: an existing ``target`` without ``force``; and, even
    with ``force``, a directory, anything inside a pack directory (one holding index.txt and pool.bin:
    a pack holds only its own files), something that is not a regular file (a FIFO would block), one of
    the command's ``inputs`` or a GGUF file (its first 4 bytes ``GGUF``).

    Raises:
        OutputError: naming ``target`` and the reason; nothing is written.
    """
    t = Path(target)
    if t.is_dir():
        raise OutputError(errno.EISDIR, f"{t}: is a directory; give a file name for the output")
    d = Path(os.path.abspath(t)).parent
    if (d / "index.txt").is_file() and (d / "pool.bin").is_file():
        raise OutputError(
            errno.EEXIST,
            f"{t}: is inside the pack {d}; a pack directory holds only the pack's files "
            "(strata-pack build --force replaces it whole): write the output elsewhere",
        )
    if not t.exists():
        return
    if not t.is_file():
        raise OutputError(
            errno.EEXIST, f"{t}: exists and is not a regular file (a FIFO, socket or device); refusing to write there"
        )
    for p in inputs:
        try:
            if os.path.samefile(t, p):
                raise OutputError(errno.EEXIST, f"{t}: is this command's input; refusing to write over it")
        except FileNotFoundError:
            pass
    if has_gguf_magic(t):
        raise OutputError(errno.EEXIST, f"{t}: is a GGUF file; refusing to write over it")
    if not force:
        raise OutputError(errno.EEXIST, f"{t} already exists; pass --force to replace it")


#: Longest file name most file systems take (bytes; NAME_MAX of ext4, xfs, btrfs, tmpfs).
NAME_MAX_BYTES = 255
#: Characters ``tempfile.mkdtemp`` appends to a prefix.
_MKDTEMP_RANDOM = 8


def sidecar_name(out: Path, suffix: str, after: int = 0) -> str:
    """The name of a file beside ``out`` that belongs to its build (``suffix``: ``.tmp-`` and ``.old-`` prefixes of
    temporary directories, ``.lock``): ``.NAME{suffix}``, or, where that (plus mkdtemp's 8 random characters) would
    pass :data:`NAME_MAX_BYTES` - a legal 250-byte output name - the name cut short with a hash of the whole name,
    ``.{start}~{sha8}{suffix}``, so that every build of ``out`` finds the same names. ``after``: bytes the caller
    adds after the random characters (``.partial``: :func:`atomic_output`)."""
    import hashlib

    name = out.name
    full = f".{name}{suffix}"
    if len(os.fsencode(full)) + _MKDTEMP_RANDOM + after <= NAME_MAX_BYTES:
        return full
    tag = hashlib.sha256(os.fsencode(name)).hexdigest()[:8]
    room = NAME_MAX_BYTES - _MKDTEMP_RANDOM - after - len(os.fsencode(f".~{tag}{suffix}"))
    raw = os.fsencode(name)[:room]
    start = raw.decode("utf-8", "ignore") or "x"
    return f".{start}~{tag}{suffix}"


@contextmanager
def atomic_output(
    target: str | os.PathLike,
    needed: int | None = None,
    *,
    force: bool = False,
    inputs: tuple[str | os.PathLike, ...] = (),
) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success rename it to ``target`` (``os.replace``),
    on any failure or interruption remove it. Write errors come out as :func:`write_error`. What
    :func:`check_overwrite` refuses (an existing target without ``force``, an input, a pack's file, a
    GGUF) is refused before anything is written."""
    check_overwrite(target, force=force, inputs=inputs)
    target = Path(target)
    try:
        fd, name = tempfile.mkstemp(
            prefix=sidecar_name(target, ".", after=len(".partial")),
            suffix=".partial",
            dir=Path(os.path.abspath(target)).parent,
        )
    except OSError as e:
        raise write_error(e, target, needed) from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; an output is an ordinary file
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OutputError):
            raise
        raise write_error(e, target, needed) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = [
    "WRITE_ERRNOS",
    "OutputError",
    "atomic_output",
    "check_free_space",
    "check_overwrite",
    "free_bytes",
    "sidecar_name",
    "write_error",
]
