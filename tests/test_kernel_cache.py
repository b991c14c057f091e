"""A kernel cache that cannot be written (``$STRATA_CACHE`` or ``$HOME`` read-only: containers, HPC; or a path
under a file) does not end in a traceback: the CPU kernels are built in a directory of the process's own, said
once on stderr, and compute the same bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata.engine.cpu import kernels as K
from strata.packer import quants
from strata.testing.blocks import make_random_blocks


def test_unwritable_cache_builds_in_a_private_directory_with_one_warning(tmp_path, monkeypatch, capsys):
    t = quants.by_name("Q8_0")
    rows, ne0 = 3, 64
    raw = make_random_blocks(t.id, rows * ne0, np.random.default_rng(0)).reshape(-1)
    x = np.random.default_rng(1).standard_normal(ne0).astype(np.float32)
    want = K.matvec(t.id, raw, rows, ne0, x, kernel="exact", threads=1)  # the normal cache
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("STRATA_CACHE", str(blocker / "cache"))
    K.library.cache_clear()
    K._private_dir.cache_clear()
    try:
        got = K.matvec(t.id, raw, rows, ne0, x, kernel="exact", threads=1)
        lib_path = Path(K.library(t.id)._name)
        err = capsys.readouterr().err
    finally:
        K.library.cache_clear()
        K._private_dir.cache_clear()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"warning: the kernel cache {blocker / 'cache' / 'kernels'} cannot be written ("
    )
    assert lines[0].endswith(f"; the CPU kernels are built in {lib_path.parent} for this run instead")
    assert lib_path.parent.name.startswith("strata-kernels-") and not str(lib_path).startswith(str(blocker))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_private_kernel_directory_is_removed_when_the_process_ends(tmp_path):
    """The warning says "for this run": the private directory is removed at exit (a user found 28 left in /tmp)."""
    import os
    import subprocess
    import sys

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = (
        "import numpy as np; from pathlib import Path; from strata.engine.cpu import kernels as K; "
        "from strata.packer import quants; t = quants.by_name('Q8_0'); "
        "from strata.testing.blocks import make_random_blocks; "
        "raw = make_random_blocks(t.id, 64, np.random.default_rng(0)).reshape(-1); "
        "K.matvec(t.id, raw, 1, 64, np.ones(64, np.float32), kernel='exact', threads=1); "
        "d = Path(K.library(t.id)._name).parent; print(d, d.is_dir())"
    )
    env = dict(os.environ, STRATA_CACHE=str(blocker / "cache"), TMPDIR=str(tmp))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    d, existed = r.stdout.split()
    assert existed == "True" and Path(d).parent == tmp and Path(d).name.startswith("strata-kernels-")
    assert list(tmp.iterdir()) == []
