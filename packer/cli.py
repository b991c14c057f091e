"""``strata-pack``: build, verify and inspect packs (thin click layer over the library).

Exit codes (one contract for the three tools, :mod:`strata.packer.exits`): 0 success, 1 the pack
does not match its source or is corrupt (verify) / the download failed (fetch), 2 bad input
(unreadable GGUF, not a pack, bad arguments, refused build, unwritable output), 128 + N a signal
(130 SIGINT, 143 SIGTERM), 141 stdout closed. With ``--json`` a failure also prints
``{"ok": false, "error": ...}`` on stdout.
"""

from __future__ import annotations

import json
import os
import sys

import click

from strata.manifests.contract import ManifestError

from .build import build_pack
from .exits import StrataGroup, interrupted
from .gguf_file import GGUFError
from .pack_plan import BuildError
from .packfmt import PackFormatError
from .quants import GGMLTypeError, ShapeError

INPUT_ERRORS = (GGUFError, BuildError, ManifestError, PackFormatError, GGMLTypeError, ShapeError, OSError, MemoryError)


def _fail(msg: str, code: int = 2, as_json: bool = False) -> None:
    if as_json:
        click.echo(json.dumps({"ok": False, "error": msg}))
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    if isinstance(e, MemoryError):
        return "out of memory"
    return str(e)


@click.group(cls=StrataGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata")
def main() -> None:
    """strata-pack: GGUF shards -> pack (pool.bin, index.txt, native_experts.txt, geometry.txt).

    \b
    Exit codes (the same for strata-budget and strata-engine):
      0    ok
      1    verify: the pack differs from its sources or is corrupt; fetch: the download failed
      2    bad input or refused (one `error:` line naming the file and the numbers)
      130  interrupted by SIGINT (Ctrl-C); 143 by SIGTERM; 129 by SIGHUP: nothing half-written
      141  stdout was closed (`| head`)
    """


@main.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.option(
    "-o", "--out", "out", required=True, type=click.Path(), help="Pack directory to create (its parent must exist)."
)
@click.option("--align", default=64, show_default=True, help="Pool alignment in bytes (power of two, 16..1048576).")
@click.option(
    "--force", is_flag=True, help="Replace an existing pack (only a strata pack holding no source is ever replaced)."
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr (when it is a terminal).")
def build(src, out, align, force, as_json, progress):
    """Build a pack from SRC (a .gguf file or any shard of NAME-0000K-of-0000N.gguf).

    The pack is written to a temporary directory beside OUT and renamed into place only when
    complete and verified; sources are opened read-only.
    """

    def warn(text: str) -> None:
        click.echo(f"warning: {text}", err=True)

    try:
        r = build_pack(src, out, align=align, force=force, progress=progress and sys.stderr.isatty(), on_warning=warn)
    except INPUT_ERRORS as e:
        _fail(_describe(e), 2, as_json)
    except KeyboardInterrupt as e:
        raise interrupted(e, f"nothing was written (the temporary directory beside {out} was removed)") from None
    if as_json:
        click.echo(json.dumps({"ok": True, **r.to_dict()}, indent=1))
    else:
        click.echo(
            f"packed {r.arch} from {len(r.shards)} shard(s) into {r.pack}: {r.dense_tensors} dense tensors, "
            f"pool {r.pool_bytes} B ({r.pool_bytes / 2**20:.2f} MiB), {r.bf16_promoted} BF16 promoted to F32; "
            f"{r.expert_layers} expert layers, {r.expert_total_bytes} B of experts left in the shards "
            f"(max blob {r.max_blob} B); {r.seconds:.2f} s"
        )


@main.command()
@click.argument("pack", type=click.Path())
@click.option("--source-dir", type=click.Path(file_okay=False), help="Where the source shards are now, if they moved.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def verify(pack, source_dir, as_json):
    """Compare PACK with its sources: every index/expert row, geometry and metadata, and every dense byte.

    \b
    Exit codes:
      0  identical
      1  a mismatch, or a pack file that is corrupt (named, with both numbers)
      2  not a pack (missing, empty, a GGUF file), a source shard moved or unreadable
         (pass --source-dir), bad input: nothing was compared
    """
    from .verify import VerifyError, verify_pack

    if source_dir is not None and not os.path.isdir(source_dir):
        _fail(f"--source-dir {source_dir}: no such directory; nothing was compared", 2, as_json)
    try:
        r = verify_pack(pack, progress=sys.stderr.isatty(), source_dir=source_dir)
    except VerifyError as e:
        _fail(str(e), 1, as_json)
    except INPUT_ERRORS as e:
        _fail(_describe(e), 2, as_json)
    for w in r.warnings:
        click.echo(f"warning: {w}", err=True)
    d = {
        "ok": True,
        "pack": str(r.pack),
        "dense_tensors": r.dense_tensors,
        "dense_bytes": r.dense_bytes,
        "expert_layers": r.expert_layers,
        "warnings": r.warnings,
    }
    click.echo(
        json.dumps(d)
        if as_json
        else f"ok: {r.dense_tensors} dense tensors ({r.dense_bytes} B) equal their source; index, geometry, "
        f"metadata and {r.expert_layers} expert layers match the shards"
        + (" (experts' bytes: the first and last 256 B of each expert, as sampled at build)" if r.expert_layers else "")
    )


@main.command()
@click.argument("path", type=click.Path())
@click.option(
    "--parquet",
    type=click.Path(dir_okay=False),
    help="Also write the table as Parquet (a new file; never over the input, a pack's file or a GGUF).",
)
@click.option("--force", is_flag=True, help="Replace an existing --parquet file.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def inspect(path, parquet, force, as_json):
    """Print the tensor table of a GGUF file or a pack directory (name, type, shape in ggml ne order, bytes).

    Piped (stdout not a terminal): one plain line per tensor, columns padded, never cut, so
    `| grep blk.3.ffn_down` finds its rows. On a terminal: a table whose cells wrap, never cut.
    """
    from .inspect_cmd import print_table, tensor_table, write_parquet

    try:
        if parquet:
            from .outputs import check_overwrite

            check_overwrite(parquet, force=force, inputs=(path,))
        rows = tensor_table(path)
        if parquet:
            write_parquet(rows, parquet, force=force, inputs=(path,))
    except INPUT_ERRORS as e:
        _fail(_describe(e), 2, as_json)
    if as_json:
        click.echo(json.dumps(rows))
        return
    print_table(rows, f"{path}: {len(rows)} tensors", terminal=sys.stdout.isatty())


from .fetch import fetch_cmd as _fetch_cmd  # noqa: E402  (strata-pack fetch NAME)

main.add_command(_fetch_cmd, name="fetch")


if __name__ == "__main__":
    main()
