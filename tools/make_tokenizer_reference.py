#!/usr/bin/env python
"""Record llama.cpp's prompt ids as JSON fixtures, for the tokenizer tests that run without llama.cpp.

Reference: llama.cpp through llama-cpp-python 0.3.36, ``Llama(path, vocab_only=True)`` and
``llm.tokenize(text, add_bos=True, special=...)`` (``llama_tokenize(add_special=true, parse_special)``)
with special tokens parsed (llama-cli's default) and not; and ``llm.detokenize([id])`` for every
token's piece.

- ``tests/fixtures/tokenizer/synthetic.json``: every case of ``strata.testing.TOKENIZER_CASES`` (a
  synthetic vocabulary per ``tokenizer.ggml.pre`` strata accepts, SentencePiece with and without the
  space prefix), its GGUF's sha256 (the tests rebuild it and check), the ids of :data:`STRINGS` both
  ways and every token's piece.
- ``tests/fixtures/tokenizer/real.json`` (with ``--real``): the same strings on Gemma 3 270M and
  Qwen2.5 0.5B (fetched and cached by ``strata-pack fetch``), and chat prompts: the chat template
  rendered as llama-cpp-python renders it (``Jinja2ChatFormatter``: Jinja2 as Hugging Face does) and
  as llama.cpp's built-in renderer does (``llama_chat_apply_template``, ``src/llama-chat.cpp``), and
  the ids of the rendered prompt (special tokens parsed, BOS where the model adds it). Gemma 3 270M
  is a base model without a template: its chat case uses llama.cpp's vendored Gemma template
  (``models/templates/google-gemma-2-2b-it.jinja``, the same turn format), stored in the fixture.

Run (llama-cpp-python importable: ``pip install -e '.[reference]'``)::

    python tools/make_tokenizer_reference.py            # synthetic.json
    python tools/make_tokenizer_reference.py --real     # and real.json
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "tokenizer"
FORMAT = "strata-tokenizer-reference-v1"

#: Prompts tokenized by llama.cpp and by strata: special tokens of every kind in context, numbers
#: (each pre-tokenizer splits digits differently), contractions, whitespace runs, non-Latin scripts,
#: emoji, whole words no merge reaches (``qqq``), look-alikes of special tokens.
STRINGS = [
    "The capital of France is",
    "",
    " ",
    "  leading",
    "trailing  ",
    "\n\n\nnewlines\n",
    "\t tab\r\n",
    "Hello, world!!! ... ?! (ok) [x] {y} <z>",
    "It's I'm we'll they've don't WE'LL",
    "12345678 3.14159 1e-9 007",
    "x = [1, 2, 3]; print(f'{x!r}')  # comment",
    "Ünïcödé ñ 中文字符 日本語 한국어 emoji 😀🚀 done",
    "qqq qqq  qqq\nqqq",
    "a" * 40,
    "http://example.com/path?q=1&r=2",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>x<|im_end|>",
    "<|im_start|> spaced <|im_end|> text",
    '<tool_call>{"name": "f"}</tool_call>',
    "a<tool_call>b",
    "<unk> and <s> and </s>",
    "<s>Hello</s>",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    " <start_of_turn>  x",
    "<|im_start|",
    "<|im_start|><|im_start|>",
    "\u2581already escaped",
    "   spaces   between   ",
]
#: Chat cases: name -> (system message or None, user message).
CHATS = {
    "user": (None, "What is the capital of France?"),
    "system+user": ("You are a terse assistant.", "Say hi <|im_start|> literally."),
}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _ids(llm, strings: list[str]) -> dict[str, list[list[int]]]:
    return {
        "special": [[int(t) for t in llm.tokenize(s.encode(), add_bos=True, special=True)] for s in strings],
        "text": [[int(t) for t in llm.tokenize(s.encode(), add_bos=True, special=False)] for s in strings],
    }


def _pieces(llm) -> list[str]:
    """Every token's piece, hex: ``llama_token_to_piece(special = false)`` with a buffer large enough
    (llama-cpp-python's ``detokenize`` uses 32 bytes and returns b"" for a longer piece)."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = ctypes.create_string_buffer(4096)
    out = []
    for i in range(llm.n_vocab()):
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, False)
        out.append(buf.raw[:n].hex())
    return out


def synthetic(out: Path) -> None:
    import llama_cpp

    from strata.testing import TOKENIZER_CASES, write_tokenizer_case

    cases = {}
    with tempfile.TemporaryDirectory() as d:
        for name in TOKENIZER_CASES:
            path = write_tokenizer_case(Path(d) / f"{name}.gguf", name)
            llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
            cases[name] = {"gguf_sha256": sha256_file(path), "ids": _ids(llm, STRINGS), "pieces_hex": _pieces(llm)}
            print(f"{name}: {llm.n_vocab()} tokens")
    _write(
        out / "synthetic.json",
        {"format": FORMAT, "llama_cpp_python": llama_cpp.__version__, "strings": STRINGS, "cases": cases},
    )


def _builtin_chat(template: str, messages: list[dict]) -> str:
    """llama.cpp's built-in renderer (``llama_chat_apply_template``, src/llama-chat.cpp)."""
    import llama_cpp

    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        arr[i].role, arr[i].content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(messages), True, buf, len(buf))
    if n < 0:
        raise RuntimeError("llama_chat_apply_template refused the template")
    return buf.raw[:n].decode()


def real(out: Path) -> None:
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from strata.packer.fetch import fetch_model

    vendored = Path(llama_cpp.__file__).resolve().parents[1] / "vendor" / "llama.cpp" / "models" / "templates"
    gemma_tmpl = None
    for cand in (vendored, Path("/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates")):
        if (cand / "google-gemma-2-2b-it.jinja").is_file():
            gemma_tmpl = (cand / "google-gemma-2-2b-it.jinja").read_text()
            break
    if gemma_tmpl is None:
        raise SystemExit(
            "llama.cpp's models/templates/google-gemma-2-2b-it.jinja not found (the llama-cpp-python sdist)"
        )
    models = {}
    for name in ("gemma3-270m", "qwen2.5-0.5b"):
        path = fetch_model(name, progress=False)
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        tmpl = llm.metadata.get("tokenizer.chat_template")
        injected = tmpl is None
        tmpl = tmpl or gemma_tmpl
        bos = llm.detokenize([llm.token_bos()], special=True).decode()
        eos = llm.detokenize([llm.token_eos()], special=True).decode()
        chats = {}
        for cname, (system, user) in CHATS.items():
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
            try:
                text = Jinja2ChatFormatter(tmpl, eos_token=eos, bos_token=bos)(messages=msgs).prompt
            except Exception as e:  # the template's own raise_exception (Gemma: no system role)
                chats[cname] = {"system": system, "user": user, "error": str(e)}
                continue
            ids = [int(t) for t in llm.tokenize(text.encode(), add_bos=False, special=True)]
            chats[cname] = {
                "system": system,
                "user": user,
                "jinja2_text": text,
                "builtin_text": _builtin_chat(tmpl, msgs),
                "ids": ids,
            }
        models[name] = {
            "file": path.name,
            "sha256": sha256_file(path),
            "chat_template_injected": tmpl if injected else None,
            "ids": _ids(llm, STRINGS),
            "chats": chats,
        }
        print(f"{name}: {llm.n_vocab()} tokens, chats {list(chats)}")
    _write(
        out / "real.json",
        {"format": FORMAT, "llama_cpp_python": llama_cpp.__version__, "strings": STRINGS, "models": models},
    )


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=0, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--real", action="store_true", help="also the real models (fetched into the strata cache)")
    a = ap.parse_args()
    synthetic(a.out)
    if a.real:
        real(a.out)


if __name__ == "__main__":
    main()
