"""A small deterministic byte-level BPE tokenizer for synthetic models, and its GGUF KVs.

:func:`synth_tokenizer` learns BPE merges on a fixed built-in English text, so every machine gets
the same vocabulary; llama.cpp accepts it as ``tokenizer.ggml.model = "gpt2"`` with pre-tokenizer
``"qwen2"`` (ids 0-255 are the byte tokens in GPT-2's byte-to-unicode order, then the merged
tokens, then the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``).
:func:`tokenizer_kv` gives the ``tokenizer.ggml.*`` keys a synthetic model carries.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from gguf.constants import GGUFValueType

from strata.packer.tokenizer_rules import bytes_to_unicode  # one definition (llama.cpp unicode.cpp)

__all__ = [
    "BPE_EXTRA_TOKENS",
    "SPECIAL_TOKENS",
    "SPM_EXTRA_TOKENS",
    "SynthTokenizer",
    "TOKENIZER_CASES",
    "bytes_to_unicode",
    "synth_tokenizer",
    "tokenizer_case_kv",
    "tokenizer_kv",
]


_CORPUS = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
A mixture of experts model routes every token to a few experts out of many; the router picks the
top experts and the layer adds their outputs weighted by the router's probabilities. The expert
cache keeps the most frequently used experts in the memory of the graphics card and the other
experts run on the processor. Every tensor in the file has a name, a type, a shape and an offset.
The quick brown fox jumps over the lazy dog while the engine writes the next token of the answer.
In the beginning the model reads the prompt, then it generates one token after another until it
reaches the end of the text or the maximum number of tokens. Numbers like 0 1 2 3 4 5 6 7 8 9 10
100 1000 and words such as hello, world, model, layer, token, expert, weight, memory appear here.
def forward(self, x): return self.down(self.act(self.gate(x)) * self.up(x))
"""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class SynthTokenizer:
    """A deterministic byte-level BPE vocabulary.

    Attributes:
        tokens: token strings; ids 0-255 are the 256 byte tokens (id = byte value, GPT-2 byte-to-unicode
            characters), then merged tokens, then reserved fillers, then :data:`SPECIAL_TOKENS`.
        token_types: llama.cpp token types (1 normal, 3 control), one per token.
        merges: ``"a b"`` merge rules, in rank order; every result ``a+b`` is a token.
        bos_id / eos_id / pad_id: ids of ``<|endoftext|>`` (bos = eos = pad as in Qwen2).
    """

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    pad_id: int

    @property
    def n_vocab(self) -> int:
        """Number of tokens (= ``ne[1]`` of ``token_embd``)."""
        return len(self.tokens)


@lru_cache(maxsize=8)
def synth_tokenizer(n_vocab: int = 512) -> SynthTokenizer:
    """A byte-level BPE tokenizer of exactly ``n_vocab`` tokens (``n_vocab >= 259``).

    Merges are learned by plain BPE on a fixed built-in English text (ties broken by the
    lexicographically smallest pair), so the result is the same on every machine. If the text
    runs out of pairs, the vocabulary is filled with ``<|reserved_N|>`` control tokens.
    """
    n_special = len(SPECIAL_TOKENS)
    if n_vocab < 256 + n_special:
        raise ValueError(f"n_vocab={n_vocab} < {256 + n_special} (256 byte tokens + {n_special} special tokens)")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    vocab = set(tokens)
    words = Counter(
        tuple(b2u[b] for b in w.encode()) for w in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", _CORPUS)
    )
    merges: list[str] = []
    budget = n_vocab - n_special
    while len(tokens) < budget:
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(f"{best[0]} {best[1]}")
        new = best[0] + best[1]
        if new not in vocab:
            vocab.add(new)
            tokens.append(new)
        merged: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    types = [1] * len(tokens)
    i = 0
    while len(tokens) < budget:
        tokens.append(f"<|reserved_{i}|>")
        types.append(3)
        i += 1
    eos = len(tokens)
    tokens.extend(SPECIAL_TOKENS)
    types.extend([3] * n_special)
    return SynthTokenizer(tuple(tokens), tuple(types), tuple(merges), bos_id=eos, eos_id=eos, pad_id=eos)


def tokenizer_kv(tok: SynthTokenizer, add_bos: bool) -> list[tuple[str, int, Any, int | None]]:
    """The ``tokenizer.ggml.*`` KVs of ``tok`` as ``(key, GGUFValueType, value, array sub_type)``: model
    ``gpt2`` / pre ``qwen2``, the token, token-type (i32) and merge arrays, bos / eos / padding ids (u32)
    and ``add_bos_token``."""
    V = GGUFValueType
    return [
        ("tokenizer.ggml.model", V.STRING, "gpt2", None),
        ("tokenizer.ggml.pre", V.STRING, "qwen2", None),
        ("tokenizer.ggml.tokens", V.ARRAY, list(tok.tokens), V.STRING),
        ("tokenizer.ggml.token_type", V.ARRAY, list(tok.token_types), V.INT32),
        ("tokenizer.ggml.merges", V.ARRAY, list(tok.merges), V.STRING),
        ("tokenizer.ggml.eos_token_id", V.UINT32, tok.eos_id, None),
        ("tokenizer.ggml.bos_token_id", V.UINT32, tok.bos_id, None),
        ("tokenizer.ggml.padding_token_id", V.UINT32, tok.pad_id, None),
        ("tokenizer.ggml.add_bos_token", V.BOOL, add_bos, None),
    ]


# ------------------------------------------------------------------ tokenizer cases (llama.cpp comparisons)

#: Tokens added to the byte-level vocabulary of :func:`tokenizer_case_kv`'s BPE cases, with their types:
#: a user-defined token (cut out of text even without special parsing), an unknown-type token, two whole
#: words no merge reaches (what llama.cpp's whole-word lookup before merges finds), and a token whose
#: bytes are not valid UTF-8 (never produced from text; it must load and decode as llama.cpp does).
BPE_EXTRA_TOKENS: tuple[tuple[bytes, int], ...] = (
    (b"<tool_call>", 4),
    (b"<unk>", 2),
    ("\u0120qqq".encode(), 1),
    (b"qqq", 1),
    (b"\xff\xfe", 1),
)
#: SentencePiece case: control and user-defined tokens beyond ``<unk>``, ``<s>``, ``</s>``.
SPM_EXTRA_TOKENS: tuple[tuple[str, int], ...] = (("<start_of_turn>", 3), ("<end_of_turn>", 3), ("<tool_call>", 4))


def _bpe_case(pre: str | None, add_bos: bool | None, add_eos: bool | None):
    V = GGUFValueType
    tok = synth_tokenizer(512)
    tokens = [t.encode() for t in tok.tokens] + [t for t, _ in BPE_EXTRA_TOKENS]
    types = list(tok.token_types) + [ty for _, ty in BPE_EXTRA_TOKENS]
    kv = [("tokenizer.ggml.model", V.STRING, "gpt2", None)]
    if pre is not None:
        kv.append(("tokenizer.ggml.pre", V.STRING, pre, None))
    kv += [
        ("tokenizer.ggml.tokens", V.ARRAY, tokens, V.STRING),
        ("tokenizer.ggml.token_type", V.ARRAY, types, V.INT32),
        ("tokenizer.ggml.merges", V.ARRAY, list(tok.merges), V.STRING),
        ("tokenizer.ggml.eos_token_id", V.UINT32, tok.eos_id, None),
        ("tokenizer.ggml.bos_token_id", V.UINT32, tok.bos_id, None),
    ]
    if add_bos is not None:
        kv.append(("tokenizer.ggml.add_bos_token", V.BOOL, add_bos, None))
    if add_eos is not None:
        kv.append(("tokenizer.ggml.add_eos_token", V.BOOL, add_eos, None))
    return kv, len(tokens)


def _spm_case(add_space_prefix: bool | None):
    """A SentencePiece-BPE vocabulary from the synthetic merges: ``<unk> <s> </s>``, the 256 byte tokens,
    the printable ASCII characters and U+2581, then every merged piece that is valid text (spaces as
    U+2581), scored by merge order (earlier = higher), then :data:`SPM_EXTRA_TOKENS`."""
    V = GGUFValueType
    tok = synth_tokenizer(512)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    pieces: list[str] = []
    seen: set[str] = set()

    def add(p: str) -> None:
        if p not in seen:
            seen.add(p)
            pieces.append(p)

    for c in ["\u2581"] + [chr(i) for i in range(33, 127)]:
        add(c)
    for m in tok.merges:
        a, b = m.split(" ")
        try:
            text = bytes(byte_of[c] for c in a + b).decode("utf-8")
        except UnicodeDecodeError:
            continue
        add(text.replace(" ", "\u2581"))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + [t for t, _ in SPM_EXTRA_TOKENS]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [ty for _, ty in SPM_EXTRA_TOKENS]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * len(SPM_EXTRA_TOKENS)
    kv = [
        ("tokenizer.ggml.model", V.STRING, "llama", None),
        ("tokenizer.ggml.pre", V.STRING, "default", None),
        ("tokenizer.ggml.tokens", V.ARRAY, tokens, V.STRING),
        ("tokenizer.ggml.scores", V.ARRAY, scores, V.FLOAT32),
        ("tokenizer.ggml.token_type", V.ARRAY, types, V.INT32),
        ("tokenizer.ggml.bos_token_id", V.UINT32, 1, None),
        ("tokenizer.ggml.eos_token_id", V.UINT32, 2, None),
        ("tokenizer.ggml.unknown_token_id", V.UINT32, 0, None),
    ]
    if add_space_prefix is not None:
        kv.append(("tokenizer.ggml.add_space_prefix", V.BOOL, add_space_prefix, None))
    return kv, len(tokens)


#: Every tokenizer case compared with llama.cpp: name -> (kind, options). The BPE cases cover every
#: ``tokenizer.ggml.pre`` strata accepts (:data:`strata.packer.tokenizer_rules.PRE_RULES`), with no
#: ``add_bos_token`` key so llama.cpp's per-pre default applies, plus a missing pre key and explicit BOS/EOS.
TOKENIZER_CASES: dict[str, tuple[str, dict]] = {
    **{
        f"bpe-{pre}": ("bpe", {"pre": pre, "add_bos": None, "add_eos": None})
        for pre in ("default", "qwen2", "deepseek-r1-qwen", "llama3", "llama-v3", "llama-bpe", "gpt-2")
    },
    "bpe-no-pre": ("bpe", {"pre": None, "add_bos": None, "add_eos": None}),
    "bpe-qwen2-bos-eos": ("bpe", {"pre": "qwen2", "add_bos": True, "add_eos": True}),
    "spm": ("spm", {"add_space_prefix": None}),
    "spm-no-space-prefix": ("spm", {"add_space_prefix": False}),
}


def tokenizer_case_kv(name: str) -> tuple[list[tuple[str, int, Any, int | None]], int]:
    """The ``tokenizer.*`` KVs of case ``name`` of :data:`TOKENIZER_CASES` and its token count."""
    kind, opts = TOKENIZER_CASES[name]
    return _bpe_case(**opts) if kind == "bpe" else _spm_case(**opts)
