"""Prompt ids exactly as llama.cpp's: every ``tokenizer.ggml.pre`` strata accepts, SentencePiece
with and without the space prefix, special tokens parsed (llama-cli's default) and not, both real models,
and their chat templates.

The values are llama.cpp's, recorded by ``tools/make_tokenizer_reference.py`` (llama-cpp-python 0.3.36,
``vocab_only=True``) into ``tests/fixtures/tokenizer/``: these tests need no llama.cpp. Tests marked
``llama_cpp`` compare with llama.cpp itself (llama-cpp-python, the ``reference`` extra: installed by
``make test`` and CI; skipped without it on a developer machine, failed in CI - tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from strata.engine.chat import ChatTemplateError, chat_prompt
from strata.engine.cli import main as engine_main
from strata.engine.tokenizer import TokenizerError, load_tokenizer
from strata.packer.build import build_pack
from strata.packer.pack import open_pack
from strata.packer.pack_plan import BuildError
from strata.packer.tokenizer_rules import PRE_RULES
from strata.testing import TOKENIZER_CASES, tokenizer_case_kv, write_tokenizer_case

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "tokenizer"
SYNTH = json.loads((FIXTURES / "synthetic.json").read_text(encoding="utf-8"))
REAL = json.loads((FIXTURES / "real.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Every tokenizer case: its GGUF (checked against the recorded sha256) and its pack."""
    d = tmp_path_factory.mktemp("tokcases")
    out = {}
    for name in TOKENIZER_CASES:
        g = write_tokenizer_case(d / f"{name}.gguf", name)
        assert hashlib.sha256(g.read_bytes()).hexdigest() == SYNTH["cases"][name]["gguf_sha256"], (
            f"{name}: strata.testing no longer writes the vocabulary llama.cpp was run on "
            f"(regenerate with tools/make_tokenizer_reference.py)"
        )
        build_pack(g, d / name, progress=False)
        out[name] = (g, d / name)
    return out


def test_every_accepted_pre_tokenizer_has_a_case():
    bpe = {opts["pre"] for kind, opts in TOKENIZER_CASES.values() if kind == "bpe"}
    assert set(PRE_RULES) <= bpe, f"pre-tokenizers accepted without a llama.cpp comparison: {set(PRE_RULES) - bpe}"


@pytest.mark.parametrize("name", list(TOKENIZER_CASES))
def test_prompt_ids_equal_llama_cpp(cases, name):
    tok = load_tokenizer(open_pack(cases[name][1]))
    rec = SYNTH["cases"][name]
    bad = []
    for mode, special in (("special", True), ("text", False)):
        for s, want in zip(SYNTH["strings"], rec["ids"][mode]):
            got = tok.encode(s, parse_special=special)
            if got != want:
                bad.append((mode, s, got, want))
    assert not bad, f"{len(bad)} prompts differ from llama.cpp, e.g. {bad[:3]}"


@pytest.mark.parametrize("name", list(TOKENIZER_CASES))
def test_every_piece_equals_llama_cpp(cases, name):
    """Decoding is llama.cpp's token_to_piece, also for a token whose bytes are not valid UTF-8."""
    tok = load_tokenizer(open_pack(cases[name][1]))
    want = SYNTH["cases"][name]["pieces_hex"]
    assert [tok.decode_bytes([i]).hex() for i in range(tok.n_vocab)] == want


def test_rules_beyond_the_regex(cases):
    """Whole-word lookup before merges (llama3 family), default BOS per pre-tokenizer, EOS where asked."""
    q3 = load_tokenizer(open_pack(cases["bpe-llama3"][1]))
    q2 = load_tokenizer(open_pack(cases["bpe-qwen2"][1]))
    qqq = q3.hf.token_to_id("\u0120qqq")
    assert q3.encode(" qqq") == [q3.bos_id, qqq]  # one token, no BOS key: llama.cpp's llama3 default adds BOS
    assert qqq not in q2.encode(" qqq") and q2.encode(" qqq")[0] != q2.bos_id
    both = load_tokenizer(open_pack(cases["bpe-qwen2-bos-eos"][1]))
    ids = both.encode("hi")
    assert ids[0] == both.bos_id and ids[-1] == both.eos_id


def test_special_tokens_are_parsed_by_default(cases):
    tok = load_tokenizer(open_pack(cases["bpe-qwen2"][1]))
    im_start = tok.hf.token_to_id("<|im_start|>")
    assert tok.encode("<|im_start|>user")[0] == im_start
    assert im_start not in tok.encode("<|im_start|>user", parse_special=False)


def test_invalid_utf8_token_loads_generates_and_decodes(cases):
    """A normal token whose bytes are not UTF-8 (b'\\xff\\xfe'): the tokenizer builds, text never produces
    it, and it decodes as llama.cpp's llama_decode_text does (no traceback)."""
    _g, pack = cases["bpe-qwen2"]
    tok = load_tokenizer(open_pack(pack))
    bad = tok.n_vocab - 1
    assert tok.texts[bad] == b"\xff\xfe" and bad not in tok.encode("\xff\xfe \ufffd\ufffe")
    assert tok.decode_bytes([bad]) == b"[UNK_BYTE_0xefbfbd\xff\xfe]" * 2
    r = CliRunner().invoke(engine_main, ["generate", str(pack), "-p", "Hello", "-n", "3"])
    assert r.exit_code == 0 and "Traceback" not in r.output


def _build_with(tmp_path, name: str, edit) -> str:
    from strata import testing as synth

    kv, n = tokenizer_case_kv(name)
    kv = edit(kv)
    spec = synth.qwen2_spec(
        n_layers=1, dims={"n_vocab": n, "n_embd": 64, "n_ff": 128, "n_head": 2, "n_head_kv": 1, "head_dim": 32}
    )
    g = synth.write_model(tmp_path / "m.gguf", spec, tokenizer=kv)[0]
    with pytest.raises(BuildError) as e:
        build_pack(g, tmp_path / "p", progress=False)
    assert not (tmp_path / "p").exists()
    return str(e.value)


def test_unsupported_pre_tokenizer_refused_by_name_at_build(tmp_path):
    def pre(value):
        return lambda kv: [(k, t, value if k == "tokenizer.ggml.pre" else v, s) for k, t, v, s in kv]

    msg = _build_with(tmp_path, "bpe-qwen2", pre("smollm"))
    assert msg == (
        f"{tmp_path / 'm.gguf'}: tokenizer.ggml.pre 'smollm' is not supported by strata's tokenizer "
        f"(supported: {', '.join(sorted(PRE_RULES))}); refusing rather than tokenizing it differently from llama.cpp"
    )
    assert "tokenizer.ggml.pre 'gpt2' is not supported" in _build_with(
        tmp_path, "bpe-qwen2", pre("gpt2")
    )  # llama.cpp: 'gpt-2'


def test_unsupported_tokenizer_model_refused_by_name_at_build(tmp_path):
    msg = _build_with(
        tmp_path, "bpe-qwen2", lambda kv: [(k, t, "bert" if k == "tokenizer.ggml.model" else v, s) for k, t, v, s in kv]
    )
    assert (
        msg == f"{tmp_path / 'm.gguf'}: tokenizer.ggml.model 'bert' is not supported by strata's tokenizer (supported: "
        "llama, gpt2)"
    )


def test_special_token_not_utf8_refused_by_id_at_build(tmp_path):
    def edit(kv):
        out = []
        for k, t, v, s in kv:
            if k == "tokenizer.ggml.token_type":
                v = list(v[:-1]) + [3]  # the b"\xff\xfe" token made a control token
            out.append((k, t, v, s))
        return out

    msg = _build_with(tmp_path, "bpe-qwen2", edit)
    assert msg == (
        f"{tmp_path / 'm.gguf'}: token 516 (type 3, special) is not valid UTF-8 (b'\\xff\\xfe'): llama.cpp would "
        f"match its bytes inside the prompt's multi-byte characters; refused"
    )


TYPE_CASES = [
    ("tokenizer.ggml.add_bos_token", "false", "str", "bool"),  # read as a bool, "false" would have been true
    ("tokenizer.ggml.add_space_prefix", 1, "int", "bool"),
    ("tokenizer.ggml.eos_token_id", "151643", "str", "int"),  # read as an id, a string would have been no id
    ("tokenizer.ggml.padding_token_id", True, "bool", "int"),
    ("tokenizer.ggml.pre", 2, "int", "str"),
]


def _with_key(key, value):
    from strata.testing.models import kv_entry

    def edit(kv):
        return [e for e in kv if e[0] != key] + [kv_entry(key, value)]

    return edit


@pytest.mark.parametrize("key,value,got,want", TYPE_CASES)
def test_tokenizer_key_of_another_type_refused_by_name_at_build(tmp_path, key, value, got, want):
    """A scalar tokenizer key whose GGUF value type is not the one llama.cpp reads it as: refused at build, naming the
    key, the value, the class found and the class llama.cpp expects (llama.cpp refuses the model: test below)."""
    msg = _build_with(tmp_path, "bpe-qwen2", _with_key(key, value))
    assert msg == (
        f"{tmp_path / 'm.gguf'}: {key} is a {got} ({value!r}), but llama.cpp reads it as a {want} and refuses the "
        'model ("key has wrong type"); refused'
    )


def test_tokenizer_key_of_another_type_refused_at_load(tmp_path):
    """The engine's tokenizer checks the same rule on the pack's metadata.txt (a pack edited after its build)."""
    from strata import testing as synth

    kv, n = tokenizer_case_kv("bpe-qwen2")
    spec = synth.qwen2_spec(
        n_layers=1, dims={"n_vocab": n, "n_embd": 64, "n_ff": 128, "n_head": 2, "n_head_kv": 1, "head_dim": 32}
    )
    g = synth.write_model(tmp_path / "m.gguf", spec, tokenizer=kv)[0]
    build_pack(g, tmp_path / "p", progress=False)
    md = tmp_path / "p" / "metadata.txt"
    text = md.read_text(encoding="utf-8")
    assert "tokenizer.ggml.add_bos_token" not in text
    md.write_text(text + "tokenizer.ggml.add_bos_token str false\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"metadata.txt: tokenizer.ggml.add_bos_token is a str \('false'\), but "):
        load_tokenizer(open_pack(tmp_path / "p"))


@pytest.mark.llama_cpp
@pytest.mark.parametrize("key,value,got,want", TYPE_CASES[:3])
def test_llama_cpp_refuses_a_tokenizer_key_of_another_type(llama_cpp, tmp_path, key, value, got, want):
    """The reference: llama.cpp does not load such a model (its GGUFMeta getter: "key ... has wrong type")."""
    from strata import testing as synth

    kv, n = tokenizer_case_kv("bpe-qwen2")
    spec = synth.qwen2_spec(
        n_layers=1, dims={"n_vocab": n, "n_embd": 64, "n_ff": 128, "n_head": 2, "n_head_kv": 1, "head_dim": 32}
    )
    g = synth.write_model(tmp_path / "m.gguf", spec, tokenizer=_with_key(key, value)(kv))[0]
    with pytest.raises(ValueError):
        llama_cpp.Llama(model_path=str(g), vocab_only=True, verbose=False)


# ------------------------------------------------------------------ real models, chat templates


def _real(pack, name):
    tok = load_tokenizer(open_pack(pack))
    rec = REAL["models"][name]
    for mode, special in (("special", True), ("text", False)):
        for s, want in zip(REAL["strings"], rec["ids"][mode]):
            assert tok.encode(s, parse_special=special) == want, (name, mode, s)
    if rec["chat_template_injected"]:
        assert (
            tok.chat_template is None
        )  # a base model: --chat is refused (test below); the test uses llama.cpp's template
        tok.chat_template = rec["chat_template_injected"]
    for cname, c in rec["chats"].items():
        if "error" in c:
            with pytest.raises(ChatTemplateError, match=c["error"]):
                chat_prompt(tok, c["user"], c["system"])
            continue
        text = chat_prompt(tok, c["user"], c["system"])
        bos = tok.token_text(tok.bos_id)
        want = c["jinja2_text"][len(bos) :] if tok.add_bos and c["jinja2_text"].startswith(bos) else c["jinja2_text"]
        assert text == want
        if c["system"] is not None or rec["chat_template_injected"]:
            assert text == c["builtin_text"]  # llama.cpp's own renderer agrees (Qwen's adds no default system message)
        assert tok.encode(text) == c["ids"], (name, cname)


@pytest.mark.real
def test_gemma_prompt_and_chat_ids_equal_llama_cpp(gemma_pack):
    _real(gemma_pack, "gemma3-270m")


@pytest.mark.real
def test_qwen_prompt_and_chat_ids_equal_llama_cpp(qwen05_pack):
    _real(qwen05_pack, "qwen2.5-0.5b")


@pytest.mark.real
def test_chat_cli_prompt_ids(qwen05_pack, gemma_pack):
    c = REAL["models"]["qwen2.5-0.5b"]["chats"]["system+user"]
    r = CliRunner().invoke(
        engine_main,
        ["generate", str(qwen05_pack), "--chat", "-p", c["user"], "--system", c["system"], "-n", "1", "--json"],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompt_ids"] == c["ids"]
    r = CliRunner().invoke(engine_main, ["generate", str(gemma_pack), "--chat", "-p", "Hi", "-n", "1"])
    assert r.exit_code == 2
    assert r.stderr == (
        f"error: {gemma_pack} has no tokenizer.chat_template (a base model, not an instruct one?): "
        f"--chat needs the model's template; give the text with --prompt alone\n"
    )


def test_system_needs_chat(cases):
    r = CliRunner().invoke(engine_main, ["generate", str(cases["bpe-qwen2"][1]), "-p", "Hi", "--system", "x"])
    assert (
        r.exit_code == 2
        and r.stderr == "error: --system needs --chat (the system message goes through the model's chat template)\n"
    )
    r = CliRunner().invoke(
        engine_main, ["generate", str(cases["bpe-qwen2"][1]), "-p", "Hi", "--chat", "--no-parse-special"]
    )
    assert (
        r.exit_code == 2
        and "--no-parse-special with --chat would make the chat template's own markers plain text" in r.stderr
    )


def test_chat_template_kept_in_the_pack(tmp_path):
    """tokenizer.chat_template (a multi-line string with quotes and braces) survives metadata.txt."""
    from gguf.constants import GGUFValueType

    from strata import testing as synth

    tmpl = REAL["models"]["qwen2.5-0.5b"]["chat_template_injected"] or (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}{%- "
        "endfor %}\n"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
    )
    kv, n = tokenizer_case_kv("bpe-qwen2")
    kv = kv + [("tokenizer.chat_template", GGUFValueType.STRING, tmpl, None)]
    spec = synth.qwen2_spec(
        n_layers=1, dims={"n_vocab": n, "n_embd": 64, "n_ff": 128, "n_head": 2, "n_head_kv": 1, "head_dim": 32}
    )
    g = synth.write_model(tmp_path / "m.gguf", spec, tokenizer=kv)[0]
    build_pack(g, tmp_path / "p", progress=False)
    tok = load_tokenizer(open_pack(tmp_path / "p"))
    assert tok.chat_template == tmpl
    text = chat_prompt(tok, "Hello")
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    r = CliRunner().invoke(engine_main, ["generate", str(tmp_path / "p"), "--chat", "-p", "Hello", "-n", "1", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["prompt_ids"] == tok.encode(text)


# ------------------------------------------------------------------ llama.cpp itself


def _random_strings(n: int = 150) -> list[str]:
    rnd = random.Random(0)
    pool = [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<tool_call>",
        "<unk>",
        "<s>",
        "</s>",
        "<start_of_turn>",
        "<end_of_turn>",
        "qqq",
        " ",
        "  ",
        "\n",
        "\t",
        "'s",
        "'LL",
        "123",
        "4567",
        "x",
        "The",
        " capital",
        "中文",
        "😀",
        "!!",
        "...",
        "é",
        "\u2581",
        "\r\n",
    ]
    return ["".join(rnd.choice(pool) for _ in range(rnd.randrange(1, 12))) for _ in range(n)]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", list(TOKENIZER_CASES))
def test_random_prompts_equal_llama_cpp_live(cases, name, llama_cpp):
    g, pack = cases[name]
    tok = load_tokenizer(open_pack(pack))
    llm = llama_cpp.Llama(model_path=str(g), vocab_only=True, verbose=False)
    bad = []
    for s in _random_strings() + SYNTH["strings"]:
        for special in (True, False):
            want = [int(t) for t in llm.tokenize(s.encode(), add_bos=True, special=special)]
            if tok.encode(s, parse_special=special) != want:
                bad.append((s, special))
    assert not bad, f"{len(bad)} prompts differ from llama.cpp, e.g. {bad[:3]}"


def test_cli_parses_special_tokens_unless_told_not_to(cases):
    pack = str(cases["bpe-qwen2"][1])
    tok = load_tokenizer(open_pack(pack))
    ids = {}
    for flag in ("--parse-special", "--no-parse-special"):
        r = CliRunner().invoke(engine_main, ["generate", pack, "-p", "<|im_start|>user", "-n", "1", "--json", flag])
        assert r.exit_code == 0, r.output
        ids[flag] = json.loads(r.stdout)["prompt_ids"]
    assert ids["--parse-special"] == tok.encode("<|im_start|>user") and ids["--parse-special"][0] == tok.hf.token_to_id(
        "<|im_start|>"
    )
    assert ids["--no-parse-special"] == tok.encode("<|im_start|>user", parse_special=False) != ids["--parse-special"]


def test_generation_block_renders_its_body():
    """Hugging Face's ``{% generation %}`` block (transformers' AssistantTracker: it marks the assistant's tokens for a
    mask and renders its body as is) renders its body; an unknown tag is still refused with the template error."""
    from strata.engine.chat import render_chat

    t = (
        "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo {{x}}"}]
    assert render_chat(t, msgs) == "<user>hi</s><assistant>yo {{x}}</s><assistant>"
    nested = "{% for m in messages %}{%- generation -%}\n[{{ m.content }}]\n{%- endgeneration %}{% endfor %}"
    assert render_chat(nested, msgs) == "[hi][yo {{x}}]"
    with pytest.raises(ChatTemplateError, match="TemplateSyntaxError"):
        render_chat("{% tracked %}x{% endtracked %}", msgs)


def _spm_tied(tmp_path, bucket: int):
    """The ``spm`` case with its pieces' scores in buckets of ``bucket`` (every piece of a bucket the same score):
    merges of equal score compete everywhere. Returns (GGUF, pack)."""
    import math

    from strata import testing as synth

    kv, n = tokenizer_case_kv("spm")
    out = []
    for k, t, v, s in kv:
        if k == "tokenizer.ggml.scores":
            v = [float(-math.floor(-x / bucket)) if x < 0 else x for x in v]
        out.append((k, t, v, s))
    spec = synth.qwen2_spec(
        n_layers=1, dims={"n_vocab": n, "n_embd": 64, "n_ff": 128, "n_head": 2, "n_head_kv": 1, "head_dim": 32}
    )
    g = synth.write_model(tmp_path / "tied.gguf", spec, tokenizer=out)[0]
    build_pack(g, tmp_path / "tied", progress=False)
    return g, tmp_path / "tied"


def test_spm_equal_scores_merge_leftmost_first():
    """llama.cpp's SPM order at equal scores: the leftmost bigram first, whatever the pieces' ids (``bc`` has the
    lower id, ``ab`` starts first); a higher score still wins anywhere; no byte token and no unknown: refused."""
    from strata.engine.spm import SpmEncoder, SpmError

    vocab = {"a": 0, "b": 1, "c": 2, "bc": 3, "ab": 4, "<0x61>": 5}
    enc = SpmEncoder(vocab, np.zeros(6, np.float32), set(), None)
    assert enc.encode_ids("abc") == [4, 2]
    assert enc.encode_ids("abcbc") == [4, 2, 3]
    assert enc.encode_ids("cabc") == [2, 4, 2]
    enc = SpmEncoder(vocab, np.array([0, 0, 0, 1, 0, 0], np.float32), set(), None)
    assert enc.encode_ids("abc") == [0, 3]
    with pytest.raises(SpmError, match="character 'z': no token, no <0x7A> byte token and no unknown token"):
        enc.encode_ids("z")


@pytest.mark.llama_cpp
@pytest.mark.parametrize("bucket", [10**6, 7, 2])
def test_spm_equal_scores_equal_llama_cpp_live(tmp_path, llama_cpp, bucket):
    """SentencePiece merging when many pieces share a score (buckets of ``bucket`` consecutive scores; 10**6: all
    equal) gives llama.cpp's ids on every random and recorded prompt."""
    g, pack = _spm_tied(tmp_path, bucket)
    tok = load_tokenizer(open_pack(pack))
    llm = llama_cpp.Llama(model_path=str(g), vocab_only=True, verbose=False)
    bad = []
    for s in _random_strings() + SYNTH["strings"]:
        want = [int(t) for t in llm.tokenize(s.encode(), add_bos=True, special=True)]
        if tok.encode(s) != want:
            bad.append((s, tok.encode(s), want))
    assert not bad, f"{len(bad)} prompts differ from llama.cpp, e.g. {bad[:2]}"
