"""strata-pack on the real models: header reader vs gguf.GGUFReader, and the Gemma pack byte for byte."""

import os
import subprocess
import sys

import gguf
import pytest

from strata.packer.gguf_file import open_model, read_header
from strata.packer.pack import open_pack

pytestmark = pytest.mark.real


def _assert_same_table(path):
    ours = read_header(path)
    ref = gguf.GGUFReader(path, "r")
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.type_id == int(b.tensor_type), a.name
        assert list(a.ne) == [int(x) for x in b.shape], a.name
        assert a.abs_offset == int(b.data_offset), a.name
        assert a.nbytes == int(b.n_bytes), a.name
    assert ours.alignment == ref.alignment
    assert ours.data_offset == ref.data_offset
    return ours


@pytest.mark.parametrize("which", ["gemma_gguf", "qwen05_gguf"])
def test_header_reader_matches_gguf_reader(which, request):
    path = request.getfixturevalue(which)
    h = _assert_same_table(path)  # (speed of the header read: bench/bench_pack.py)
    assert len(h.tensors) == {"gemma_gguf": 236, "qwen05_gguf": 291}[which]


def test_gemma_pack_every_tensor_once_and_bytes_equal(gemma_gguf, gemma_pack):
    model = open_model(gemma_gguf)
    pack = open_pack(gemma_pack)
    assert pack.experts is None  # dense model: no native_experts.txt
    names = [e.name for e in pack.index.entries]
    assert sorted(names) == sorted(model.tensors) and len(names) == len(set(names)) == 236
    assert pack.index.sources == [("gemma-3-270m-q4_k_m.gguf", 253_113_024)]
    with open(gemma_gguf, "rb") as src, open(pack.pool_path, "rb") as pool:
        for e in pack.index.entries:
            k, t = model.tensors[e.name]
            assert (e.type, e.src_type, e.nbytes, e.src_offset) == (t.type_id, t.type_id, t.nbytes, t.abs_offset)
            assert e.offset % 64 == 0
            src.seek(t.abs_offset)
            pool.seek(e.offset)
            assert pool.read(e.nbytes) == src.read(t.nbytes), e.name
    # pool = dense bytes each padded to 64: exact size from the tensor table
    end = max(e.offset + e.nbytes for e in pack.index.entries)
    assert pack.index.pool_bytes == (end + 63) // 64 * 64 == os.path.getsize(pack.pool_path)
    assert pack.geometry_params["n_layer"] == "18" and pack.geometry_params["sliding_window"] == "512"


def test_cli_build_verify_inspect(gemma_gguf, tmp_path):
    out = tmp_path / "p"
    run = lambda *a: subprocess.run([sys.executable, "-m", "strata.packer.cli", *a], capture_output=True, text=True)  # noqa: E731
    r = run("build", str(gemma_gguf), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    import json

    d = json.loads(r.stdout)
    assert d["dense_tensors"] == 236 and d["arch"] == "gemma3" and d["expert_layers"] == 0
    r = run("build", str(gemma_gguf), "-o", str(out))
    assert r.returncode == 2 and "already exists" in r.stderr
    r = run("verify", str(out), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["dense_bytes"] == sum(
        e.nbytes for e in open_pack(out).index.entries
    )
    pq_path = tmp_path / "t.parquet"
    r = run("inspect", str(out), "--parquet", str(pq_path), "--json")
    assert r.returncode == 0
    import pyarrow.parquet as pq

    t = pq.read_table(pq_path)
    assert t.num_rows == 236 and set(t.column("name").to_pylist()) == {e.name for e in open_pack(out).index.entries}
    # corrupt one pool byte: verify reports the tensor and exits 1
    e = open_pack(out).index.entries[5]
    with open(out / "pool.bin", "r+b") as f:
        f.seek(e.offset + 7)
        b = f.read(1)
        f.seek(e.offset + 7)
        f.write(bytes([b[0] ^ 0xFF]))
    r = run("verify", str(out))
    assert r.returncode == 1 and e.name in r.stderr and str(e.offset + 7) in r.stderr
