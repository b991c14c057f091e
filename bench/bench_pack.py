"""Benchmark (not a test): `strata-pack build` of a >= 2 GiB synthetic dense GGUF against `cp`.

Writes a synthetic qwen2-shaped GGUF of Q8_0 tensors (``synth.write_big_dense``: a tiled
random block pattern, so writing it is fast), then in one run: `cp` of the file, `strata-pack build` (in a child
process, so its peak RSS is measured alone), `cp` again. Prints seconds, the build/cp
ratio and the build's peak RSS. Goals: ratio <= 1.5, peak RSS < 300 MB whatever
the model size.

    python bench/bench_pack.py [--gib 2.0] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str]) -> tuple[float, int]:
    """Run cmd; return (seconds, peak RSS of the child in bytes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)  # stderr shown: a failed build says why
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return dt, max(after, before) * 1024


def bench_header(d: Path) -> None:
    """Header read of the qwen3next reference model (qwen3next, 48 layers, 512 experts, 150k vocab,
    1,000+ tensors; sparse header-only file) with strata's reader, and gguf.GGUFReader on the
    cached real Gemma file (262k vocab) for comparison."""
    from strata import testing as synth
    from strata.packer.fetch import cached_path
    from strata.packer.gguf_file import read_header

    p = d / "reference-qwen3next.gguf"
    synth.reference_model_header_only(p)
    best = min(_time(lambda: read_header(p)) for _ in range(3))
    h = read_header(p)
    print(
        f"header read, qwen3next reference model ({len(h.tensors)} tensors, 150k vocab): {best * 1e3:.1f} ms "
        "(goal: well under 1 s)"
    )
    g = cached_path("gemma3-270m")
    if g is not None:
        import gguf

        ours = min(_time(lambda: read_header(g)) for _ in range(3))
        ref = _time(lambda: gguf.GGUFReader(g))
        print(f"header read, gemma-3-270m (262k vocab): strata {ours * 1e3:.1f} ms, gguf.GGUFReader {ref:.2f} s")
    os.remove(p)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="strata-bench-", dir=a.dir))
    try:
        src = d / "big.gguf"
        t0 = time.perf_counter()
        # written by a child process, so this process stays small: a forked child's ru_maxrss
        # starts from the parent's RSS, which would inflate the build's figure
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from strata.testing import write_big_dense; "
                f"write_big_dense({str(src)!r}, {int(a.gib * 2**30)})",
            ],
            check=True,
        )
        from strata.packer.gguf_file import read_header

        dense = sum(t.nbytes for t in read_header(src).tensors)
        print(
            f"wrote {src} ({src.stat().st_size / 2**30:.2f} GiB, {dense} dense bytes) in "
            f"{time.perf_counter() - t0:.1f} s"
        )
        t_cp1, _ = timed(["cp", str(src), str(d / "copy1")])
        os.remove(d / "copy1")
        # build in a fresh child: ru_maxrss of RUSAGE_CHILDREN is the max over children, so run it first among
        # python children
        code = (
            "import sys; from strata.packer.build import build_pack; "
            f"build_pack({str(src)!r}, {str(d / 'pack')!r}, progress=False)"
        )
        t_build, rss = timed([sys.executable, "-c", code])
        t_cp2, _ = timed(["cp", str(src), str(d / "copy2")])
        t_cp = min(t_cp1, t_cp2)
        print(f"cp:    {t_cp1:.2f} s, {t_cp2:.2f} s (best {t_cp:.2f} s, {dense / t_cp / 2**30:.2f} GiB/s)")
        print(
            f"build: {t_build:.2f} s ({dense / t_build / 2**30:.2f} GiB/s), ratio build/cp = {t_build / t_cp:.2f} "
            "(goal <= 1.5)"
        )
        print(f"build peak RSS: {rss / 2**20:.1f} MiB (goal < 300 MB)")
        bench_header(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
