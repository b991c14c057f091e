"""A memory-mapped file changed under a running engine (strata.engine.mapped): the next step is refused with the file
and both sizes (a GenerateError: exit 2 on the command line), never a SIGBUS ("Bus error", exit 135) from a page
past the truncated end (issue: shards truncated or rewritten while generate runs)."""

from __future__ import annotations

import os

import pytest

from strata import testing as synth
from strata.engine.errors import GenerateError, MappedFileChanged
from strata.engine.generate import generate
from strata.engine.mapped import MappedFile
from strata.engine.startup import load_engine
from strata.packer.build import build_pack


@pytest.fixture
def moe(tmp_path):
    shards = synth.write_model(tmp_path / "m.gguf", synth.qwen3moe_spec(n_shards=2))
    build_pack(shards[0], tmp_path / "pack", progress=False)
    return shards, tmp_path / "pack"


def truncate_after(path, position: int):
    """An on_step hook that truncates ``path`` in place to half its size once ``position`` has run."""

    def hook(st):
        if st.position == position:
            os.truncate(path, os.path.getsize(path) // 2)

    return hook


@pytest.mark.parametrize("which", ["shard", "pool"])
def test_a_file_truncated_while_generating_stops_the_next_step(moe, which):
    shards, pack = moe
    path = shards[1] if which == "shard" else pack / "pool.bin"
    size = os.path.getsize(path)
    eng = load_engine(pack, n_ctx=32)
    with pytest.raises(MappedFileChanged) as e:
        generate(eng, prompt_ids=[1, 2, 3], n_tokens=8, ignore_eos=True, on_step=truncate_after(path, 3))
    assert isinstance(e.value, GenerateError)  # a refusal: exit 2 on the command line
    assert str(e.value).startswith(
        f"{path}: changed size while the engine runs ({size} B at start-up, {size // 2} B now)"
    )


def test_unchanged_files_pass_and_a_rename_is_not_a_change(moe, tmp_path):
    shards, pack = moe
    f = MappedFile(shards[1])
    f.check()
    # replaced by rename (a new, shorter file at the path): the mapping and the descriptor keep the old inode,
    # whose pages stay readable - not a change of what the engine reads
    os.replace(shards[1], tmp_path / "old.gguf")
    shards[1].write_bytes(b"short")
    f.check()
    assert f.size == os.path.getsize(tmp_path / "old.gguf")
    f.close()
