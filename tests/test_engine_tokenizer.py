"""The pack tokenizer (Hugging Face ``tokenizers`` built from vocab.parquet / merges.parquet /
metadata.txt) gives llama.cpp's prompt ids.

Against the committed fixtures (no llama.cpp needed): every prompt of every fixture. Against
llama.cpp itself where llama-cpp-python is installed (the ``reference`` extra): a few hundred
strings - code, prose, whitespace runs, special-token look-alikes, non-Latin scripts, emoji -
tokenized by both, plus decode round trips.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_engine_reference import load_fixture, synthetic_pack

from strata.engine.tokenizer import TokenizerError, load_tokenizer
from strata.packer.pack import open_pack


def _strings() -> list[str]:
    fixed = [
        "The capital of France is",
        "",
        " ",
        "  leading",
        "trailing  ",
        "\n\n\nnewlines\n",
        "\t tab\r\n",
        "Ünïcödé ñ 中文字符 日本語 한국어 emoji 😀🚀 done",
        "<bos> <eos> <start_of_turn>user <|im_start|> <tool_call> <table>",
        "x = [1, 2, 3]; print(f'{x!r}')  # comment",
        "It's I'm we'll they've don't",
        "12345678 3.14159 1e-9",
        "a" * 50,
        "http://example.com/path?q=1&r=2",
        "\u2581already escaped",
    ]
    src = (Path(__file__).resolve().parents[1] / "engine" / "tokenizer.py").read_text()
    rnd = random.Random(0)
    for _ in range(150):
        i = rnd.randrange(len(src))
        fixed.append(src[i : i + rnd.randrange(1, 120)])
    for _ in range(50):
        fixed.append(
            "".join(
                chr(
                    rnd.choice(
                        [
                            rnd.randrange(32, 127),
                            rnd.randrange(0xA0, 0x3000),
                            rnd.randrange(0x4E00, 0x9FFF),
                            0x1F600 + rnd.randrange(50),
                            10,
                            32,
                        ]
                    )
                )
                for _ in range(rnd.randrange(1, 30))
            )
        )
    return fixed


@pytest.mark.parametrize("name", ["synthetic-qwen3moe", "synthetic-qwen2", "synthetic-gemma3"])
def test_synthetic_prompt_ids_equal_llama_cpp(tmp_path_factory, name):
    tok = load_tokenizer(open_pack(synthetic_pack(tmp_path_factory, name)))
    for p in load_fixture(name)["prompts"]:
        assert tok.encode(p["prompt"]) == p["prompt_ids"]
        assert tok.decode(p["output_ids"]) == p["output_text"] or "\ufffd" in p["output_text"]


def test_unknown_pre_tokenizer_is_refused(tmp_path_factory, tmp_path):
    import shutil

    pack = tmp_path / "p"
    shutil.copytree(synthetic_pack(tmp_path_factory, "synthetic-qwen2"), pack)
    md = pack / "metadata.txt"
    md.write_text(md.read_text().replace("tokenizer.ggml.pre str qwen2", "tokenizer.ggml.pre str smollm"))
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.pre 'smollm' is not supported; known: "):
        load_tokenizer(open_pack(pack))


def _against_llama_cpp(llama_cpp, pack, gguf):
    tok = load_tokenizer(open_pack(pack))
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    bad = []
    for s in _strings():
        for special in (True, False):  # llama-cli parses special tokens; --no-parse-special does not
            want = [int(t) for t in llm.tokenize(s.encode(), add_bos=True, special=special)]
            got = tok.encode(s, parse_special=special)
            if got != want:
                bad.append((s, special, got[:12], want[:12]))
        got = tok.encode(s, parse_special=False)
        body = got[1:] if tok.add_bos else got
        # our detokenizer round-trips the text (SentencePiece cannot: U+2581 in the input decodes as a space)
        assert tok.decode(body) == s or "\ufffd" in s or (tok.model == "llama" and "\u2581" in s)
    assert not bad, f"{len(bad)} strings tokenized differently, e.g. {bad[:3]}"


@pytest.mark.real
@pytest.mark.llama_cpp
def test_gemma_tokenizer_equals_llama_cpp(gemma_pack, gemma_gguf, llama_cpp):
    tok = load_tokenizer(open_pack(gemma_pack))
    assert tok.add_bos and tok.bos_id == 2 and tok.model == "llama"
    for p in load_fixture("gemma3-270m")["prompts"]:
        assert tok.encode(p["prompt"]) == p["prompt_ids"]
    _against_llama_cpp(llama_cpp, gemma_pack, gemma_gguf)


@pytest.mark.real
@pytest.mark.llama_cpp
def test_qwen_tokenizer_equals_llama_cpp(qwen05_pack, qwen05_gguf, llama_cpp):
    tok = load_tokenizer(open_pack(qwen05_pack))
    assert not tok.add_bos and tok.model == "gpt2"
    for p in load_fixture("qwen2.5-0.5b")["prompts"]:
        assert tok.encode(p["prompt"]) == p["prompt_ids"]
    _against_llama_cpp(llama_cpp, qwen05_pack, qwen05_gguf)


def test_a_tokenizer_column_of_another_type_is_refused(tmp_path_factory, tmp_path):
    """merges.parquet whose merge column was rewritten as strings (not the binary the packer writes): refused
    naming the file, the column and both types - not an AttributeError deep in the merges loop."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    pack = tmp_path / "p"
    shutil.copytree(synthetic_pack(tmp_path_factory, "synthetic-qwen2"), pack)
    m = pack / "merges.parquet"
    t = pq.read_table(m)
    pq.write_table(
        pa.table(
            {"merge": pa.array([b.decode("utf-8", "replace") for b in t.column("merge").to_pylist()], pa.string())}
        ),
        m,
    )
    with pytest.raises(
        TokenizerError, match=r"merges\.parquet: column 'merge' has type string, the packer writes binary"
    ):
        load_tokenizer(open_pack(pack))


def test_a_merge_whose_result_is_not_a_token_is_refused_at_load(tmp_path_factory, tmp_path):
    """A GGUF whose merges do not match its tokens (one flipped bit in a merge: "Be Rl" forms "BeRl", no token)
    packs and verifies (the pack matches its source), and the engine refuses it at load naming the merge and the
    missing token - not the tokenizers library's 'Error while initializing BPE' traceback."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    pack = tmp_path / "p"
    shutil.copytree(synthetic_pack(tmp_path_factory, "synthetic-qwen2"), pack)
    m = pack / "merges.parquet"
    merges = pq.read_table(m).column("merge").to_pylist()
    k = next(i for i, b in enumerate(merges) if b" " in b[1:])
    a, b = merges[k].split(b" ", 1)
    merges[k] = a + b" " + b + b"\xc2\xa7"  # the same first piece; the second and the result are not tokens
    pq.write_table(pa.table({"merge": pa.array(merges, pa.binary())}), m)
    with pytest.raises(
        TokenizerError,
        match=rf"merges\.parquet: merge {k} \(.* needs the token .*which is not in the "
        r"vocabulary \(\d+ tokens\)",
    ):
        load_tokenizer(open_pack(pack))


def test_a_special_id_outside_the_vocabulary_is_warned_and_ignored(tmp_path_factory, tmp_path):
    """eos_token_id = n_vocab (one past the end) or 2^32 - 1: llama.cpp warns and keeps the model's default; so
    does strata, and the warning reaches the engine's on_warning with the key, the id and the vocabulary size."""
    import shutil

    from strata.engine.startup import load_engine

    pack = tmp_path / "p"
    shutil.copytree(synthetic_pack(tmp_path_factory, "synthetic-qwen2"), pack)
    base = load_tokenizer(open_pack(pack))
    n = base.n_vocab
    md = pack / "metadata.txt"
    lines = md.read_text().splitlines()
    assert any(ln.startswith("tokenizer.ggml.eos_token_id ") for ln in lines)
    md.write_text(
        "\n".join(
            f"tokenizer.ggml.eos_token_id int {n}" if ln.startswith("tokenizer.ggml.eos_token_id ") else ln
            for ln in lines
        )
        + "\n"
    )
    tok = load_tokenizer(open_pack(pack))
    assert tok.warnings == (
        f"metadata: tokenizer.ggml.eos_token_id {n} is outside the vocabulary ({n} tokens); "
        "ignored (the model's default id is used where it has one, as llama.cpp does)",
    )
    assert tok.eos_id != n
    seen: list[str] = []
    load_engine(pack, n_ctx=32, on_warning=seen.append)
    assert tok.warnings[0] in seen
