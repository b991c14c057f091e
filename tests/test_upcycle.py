"""The real-weight MoE (strata.testing.upcycle): a dense Qwen2 file upcycled into llama.cpp's ``llama`` MoE form.

- structure: each expert is the dense FFN's bytes, the router is F32 ``[n_embd, n_expert]``, attn_q/attn_k rows
  (and biases) are permuted per head from NEOX to NORM pairs, metadata renamed;
- meaning: on strata's CPU engine the upcycled MoE computes the dense model (identical experts, renormalised
  top-k weights; the rope permutation exact): greedy tokens equal, logits within the rounding of the weighted sum;
- llama.cpp runs the same file (``llama_cpp`` marker) and its greedy tokens equal strata's up to the first step
  whose margin is within the fixture tolerance; on the real Qwen2.5 0.5B (``real``) the text is real and the
  tokens spread over the experts.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from strata import testing as synth
from strata.engine.generate import generate
from strata.engine.startup import load_engine
from strata.packer.build import build_pack
from strata.testing.upcycle import EXPERT_OF, UpcycleError, neox_to_norm_rows, write_upcycled_moe

PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [300, 2, 2, 77, 140]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(dense GGUF, dense pack, upcycled shards, upcycled pack) of the synthetic qwen2 preset."""
    d = tmp_path_factory.mktemp("upcycle")
    dense = synth.write_model(d / "dense.gguf", synth.qwen2_spec())[0]
    shards = write_upcycled_moe(dense, d / "moe.gguf", n_expert=4, n_expert_used=2, seed=3)
    build_pack(dense, d / "dense-pack", progress=False)
    build_pack(shards[0], d / "moe-pack", progress=False)
    return dense, d / "dense-pack", shards, d / "moe-pack"


def test_neox_to_norm_rows():
    assert neox_to_norm_rows(8, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(UpcycleError, match="whole heads"):
        neox_to_norm_rows(6, 4)


def test_upcycled_file_is_the_dense_ffn_n_times(pair):
    dense, _, shards, _ = pair
    assert [p.name for p in shards] == ["moe-00001-of-00002.gguf", "moe-00002-of-00002.gguf"]
    rd = gguf.GGUFReader(str(dense))
    dt = {t.name: t for t in rd.tensors}
    mt = {}
    for p in shards:
        mt.update({t.name: t for t in gguf.GGUFReader(str(p)).tensors})
    r0 = gguf.GGUFReader(str(shards[0]))
    assert r0.fields["general.architecture"].contents() == "llama"
    assert r0.fields["llama.expert_count"].contents() == 4 and r0.fields["llama.expert_used_count"].contents() == 2
    assert "llama.block_count" in r0.fields and not any(k.startswith("qwen2.") for k in r0.fields)
    n_embd = int(r0.fields["llama.embedding_length"].contents())
    hd = n_embd // int(r0.fields["llama.attention.head_count"].contents())
    for il in range(2):
        for role, exps in EXPERT_OF.items():
            src, e = dt[f"blk.{il}.{role}"], mt[f"blk.{il}.{exps}"]
            assert [int(x) for x in e.shape] == [*(int(x) for x in src.shape), 4]
            assert e.tensor_type == src.tensor_type
            one = np.asarray(src.data).view(np.uint8).reshape(-1)
            assert np.array_equal(np.asarray(e.data).view(np.uint8).reshape(-1), np.tile(one, 4))
            assert f"blk.{il}.{role}" not in mt
        router = mt[f"blk.{il}.ffn_gate_inp.weight"]
        assert [int(x) for x in router.shape] == [n_embd, 4] and router.tensor_type == gguf.GGMLQuantizationType.F32
        for role in ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias"):
            a, b = dt[f"blk.{il}.{role}"], mt[f"blk.{il}.{role}"]
            rows = int(a.shape[-1]) if len(a.shape) > 1 else int(a.shape[0])
            src = np.asarray(a.data).view(np.uint8).reshape(rows, -1)
            assert np.array_equal(np.asarray(b.data).view(np.uint8).reshape(rows, -1), src[neox_to_norm_rows(rows, hd)])
        v = f"blk.{il}.attn_v.weight"
        assert np.array_equal(np.asarray(mt[v].data), np.asarray(dt[v].data))


def test_upcycled_moe_computes_the_dense_model(pair):
    """Identical experts and renormalised top-k weights: the MoE is the dense model up to the rounding of the
    weighted sum (and the NORM rope on permuted rows is the NEOX rope); the tokens spread over the experts."""
    _, dense_pack, _, moe_pack = pair
    dense = load_engine(dense_pack, n_ctx=64)
    moe = load_engine(moe_pack, n_ctx=64, resident="half")
    assert moe.pack.arch == "llama" and moe.experts is not None
    used: set[tuple[int, int]] = set()
    moe.experts.on_route = lambda il, ids: used.update((il, e) for e in ids)
    for ids in PROMPTS:
        a = generate(dense, prompt_ids=ids, n_tokens=8, ignore_eos=True)
        b = generate(moe, prompt_ids=ids, n_tokens=8, ignore_eos=True)
        assert a.output_ids == b.output_ids
        for ta, tb in zip(a.top, b.top):
            assert ta[0][0] == tb[0][0] and abs(ta[0][1] - tb[0][1]) <= 2e-3 * max(1.0, abs(ta[0][1]))
        assert b.expert_hits > 0 and b.expert_misses > 0  # half resident: both paths ran
    assert len(used) == 2 * 4  # every expert of both layers was chosen by some token


def test_refuses_what_it_cannot_upcycle(tmp_path):
    llama = synth.write_model(tmp_path / "l.gguf", synth.llama_spec())[0]
    with pytest.raises(UpcycleError, match="architecture 'llama'"):
        write_upcycled_moe(llama, tmp_path / "x.gguf")
    with pytest.raises(UpcycleError, match="n_expert_used 5"):
        write_upcycled_moe(llama, tmp_path / "x.gguf", n_expert=4, n_expert_used=5)


def _llama_cpp_greedy(llama_cpp, path, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False)
    llm.eval(ids)
    out, margins = [], []
    for _ in range(n):
        row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float64)
        top2 = np.sort(row)[-2:]
        margins.append(float(top2[1] - top2[0]))
        out.append(int(np.argmax(row)))
        llm.eval([out[-1]])
    return out, margins


@pytest.mark.llama_cpp
def test_llama_cpp_runs_the_upcycled_file_as_strata_does(pair, llama_cpp):
    _, _, shards, moe_pack = pair
    eng = load_engine(moe_pack, n_ctx=64)
    compared = 0
    for ids in PROMPTS:
        want, margins = _llama_cpp_greedy(llama_cpp, shards[0], ids, 8)
        got = generate(eng, prompt_ids=ids, n_tokens=8, ignore_eos=True).output_ids
        first_low = next((s for s, m in enumerate(margins) if m <= 0.03), len(margins))
        assert got[:first_low] == want[:first_low]
        compared += first_low
    assert compared >= 8


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.llama_cpp
def test_real_upcycled_qwen_text_equals_llama_cpp(qwen05_gguf, tmp_path, llama_cpp):
    """Qwen2.5 0.5B upcycled (4 experts, 2 used): strata's greedy tokens equal llama.cpp's on the same split file up
    to the first step whose llama.cpp margin is within the real fixture's tolerance (0.3), and the text is the
    dense model's; the routers spread the tokens (every expert of some layer chosen)."""
    shards = write_upcycled_moe(qwen05_gguf, tmp_path / "qwen-moe.gguf")
    build_pack(shards[0], tmp_path / "pack", progress=False)
    eng = load_engine(tmp_path / "pack", n_ctx=128)
    ids = eng.tokenizer.encode("The capital of France is")
    used: set[tuple[int, int]] = set()
    eng.experts.on_route = lambda il, sel: used.update((il, e) for e in sel)
    r = generate(eng, prompt_ids=ids, n_tokens=12, ignore_eos=True)
    want, margins = _llama_cpp_greedy(llama_cpp, shards[0], ids, 12)
    first_low = next((s for s, m in enumerate(margins) if m <= 0.3), len(margins))
    assert first_low >= 1 and r.output_ids[:first_low] == want[:first_low]
    assert "Paris" in eng.tokenizer.decode(r.output_ids[:3])
    assert {e for il, e in used if il == 0} == {0, 1, 2, 3}


def test_command_line_writes_the_shards_and_refuses_with_exit_2(pair, tmp_path):
    """``python -m strata.testing.upcycle DENSE OUT`` (what make demo runs): the shard paths on stdout, exit 0; a bad
    request exits 2 with the reason."""
    import subprocess
    import sys

    dense = pair[0]
    run = [sys.executable, "-m", "strata.testing.upcycle", str(dense), str(tmp_path / "cli.gguf")]
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / f"cli-0000{i}-of-00002.gguf") for i in (1, 2)]
    r = subprocess.run([*run, "--used", "9"], capture_output=True, text=True)
    assert r.returncode == 2 and "n_expert_used 9 must be in 1..n_expert (4)" in r.stderr


def test_an_interrupted_upcycle_leaves_nothing_behind(pair, tmp_path, monkeypatch):
    """A failure while the tensors are written (here the third tensor write raises): no shard at the output and no
    temporary directory beside it - the shards appear only when complete."""
    dense = pair[0]
    out = tmp_path / "out"
    out.mkdir()
    calls = []
    real = gguf.GGUFWriter.write_tensor_data

    def failing(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, *a, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    with pytest.raises(OSError, match="No space left"):
        write_upcycled_moe(dense, out / "moe.gguf")
    assert len(calls) == 3 and list(out.iterdir()) == []
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", real)
    paths = write_upcycled_moe(dense, out / "moe.gguf")
    assert sorted(out.iterdir()) == paths  # complete shards, nothing else
