"""Benchmark (not a test): `strata-pack build` of a >= 2 GiB synthetic dense GGUF against `cp`.

Writes a synthetic qwen2-shaped GGUF of Q8_0 tensors (one random 32 MiB pattern repeated,
so writing it is fast), then in one run: `cp` of the file, `strata-pack build` (in a child
process, so its peak RSS is measured alone), `cp` again. Prints seconds, the build/cp
ratio and the build's peak RSS. Goals (issue 2): ratio <= 1.5, peak RSS < 300 MB whatever
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

import numpy as np


def write_big_gguf(path: Path, target_bytes: int) -> int:
    """A dense GGUF of Q8_0 [4096, 4096] tensors (17.0 MiB each) totalling >= target_bytes.
    Returns the dense bytes."""
    import gguf
    from gguf.constants import GGMLQuantizationType as T

    ne0, rows = 4096, 4096
    nbytes = rows * ne0 // 32 * 34
    n = -(-target_bytes // nbytes)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(n)
    w.add_embedding_length(ne0)
    w.add_context_length(4096)
    w.add_feed_forward_length(4 * ne0)
    w.add_head_count(32)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list([f"t{i}" for i in range(256)])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, ne0), dtype=np.float32)
    blob = gguf.quants.quantize(x, T.Q8_0)
    for i in range(n):
        w.add_tensor_info(f"blk.{i}.ffn_up.weight", blob.shape, np.dtype(np.uint8), nbytes, raw_dtype=T.Q8_0)  # byte shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i in range(n):
        w.write_tensor_data(blob)
    w.close()
    return n * nbytes


def timed(cmd: list[str]) -> tuple[float, int]:
    """Run cmd; return (seconds, peak RSS of the child in bytes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)  # stderr shown: a failed build says why
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return dt, max(after, before) * 1024


def bench_header(d: Path) -> None:
    """Header read of the documents' model (qwen3next, 48 layers, 512 experts, 150k vocab,
    1,000+ tensors; sparse header-only file) with strata's reader, and gguf.GGUFReader on the
    cached real Gemma file (262k vocab) for comparison."""
    from strata.packer import synth
    from strata.packer.fetch import cached_path
    from strata.packer.gguf_file import read_header

    p = d / "documents.gguf"
    synth.documents_qwen3next_header_only(p)
    best = min(_time(lambda: read_header(p)) for _ in range(3))
    h = read_header(p)
    print(f"header read, documents model ({len(h.tensors)} tensors, 150k vocab): {best * 1e3:.1f} ms (goal: well under 1 s)")
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
        bench_header(d)
        src = d / "big.gguf"
        t0 = time.perf_counter()
        dense = write_big_gguf(src, int(a.gib * 2**30))
        print(f"wrote {src} ({src.stat().st_size / 2**30:.2f} GiB, {dense} dense bytes) in {time.perf_counter() - t0:.1f} s")
        t_cp1, _ = timed(["cp", str(src), str(d / "copy1")])
        os.remove(d / "copy1")
        # build in a fresh child: ru_maxrss of RUSAGE_CHILDREN is the max over children, so run it first among python children
        code = ("import sys; from strata.packer.build import build_pack; "
                f"build_pack({str(src)!r}, {str(d / 'pack')!r}, progress=False)")
        t_build, rss = timed([sys.executable, "-c", code])
        t_cp2, _ = timed(["cp", str(src), str(d / "copy2")])
        t_cp = min(t_cp1, t_cp2)
        print(f"cp:    {t_cp1:.2f} s, {t_cp2:.2f} s (best {t_cp:.2f} s, {dense / t_cp / 2**30:.2f} GiB/s)")
        print(f"build: {t_build:.2f} s ({dense / t_build / 2**30:.2f} GiB/s), ratio build/cp = {t_build / t_cp:.2f} (goal <= 1.5)")
        print(f"build peak RSS: {rss / 2**20:.1f} MiB (goal < 300 MB)")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
