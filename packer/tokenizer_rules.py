"""What strata's tokenizer supports, with llama.cpp's rules for each value: read by the pack builder
(an unsupported value is refused by name at build, never tokenized wrongly) and by the engine's
tokenizer (:mod:`strata.engine.tokenizer`).

Source: ``src/llama-vocab.cpp`` of the llama.cpp vendored by llama-cpp-python 0.3.36
(``llama_vocab::impl::load``: defaults per ``tokenizer.ggml.model`` and per ``tokenizer.ggml.pre``;
``llm_tokenizer_bpe::llm_tokenizer_bpe``: the pre-tokenizer regexes per pre type;
``llm_tokenizer_bpe_session::tokenize``: the whole-word lookup before merges, ``ignore_merges``).

- ``llama`` (SentencePiece): BOS added by default (``add_bos = true``), default ids BOS 1, EOS 2,
  UNK 0; a space prefix by default (``add_space_prefix = true``); ``tokenizer.ggml.pre`` is not
  used (only BPE vocabularies have pre-tokenizers).
- ``gpt2`` (byte-level BPE): no BOS by default, default ids BOS = EOS = 11; the pre-tokenizer is
  one of :data:`PRE_RULES` (a missing ``tokenizer.ggml.pre`` is ``default``, as llama.cpp).

The ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` / ``add_space_prefix`` keys override the
defaults; the id keys override the default ids when inside the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

# llama.cpp token types (gguf TokenType): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
#: Token types llama.cpp cuts out of the prompt text before tokenizing the rest (``cache_special_tokens``):
#: user-defined always, control and unknown when special tokens are parsed (``tokenizer_st_partition``).
SPECIAL_TYPES = (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)

_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreRule:
    """llama.cpp's rules for one ``tokenizer.ggml.pre`` value of a byte-level BPE vocabulary.

    ``regexes``: applied in sequence, each splitting the pieces of the one before
    (``llm_tokenizer_bpe``'s ``regex_exprs``). ``ignore_merges``: a pre-tokenized word that is itself
    a token is that token, merges not consulted. ``add_bos``: BOS added when the GGUF has no
    ``tokenizer.ggml.add_bos_token`` key. ``pre_type``: llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_*``.
    """

    pre_type: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_RULE_QWEN2 = PreRule("QWEN2", (_QWEN2,))
_RULE_LLAMA3 = PreRule("LLAMA3", (_LLAMA3,), ignore_merges=True, add_bos=True)

#: ``tokenizer.ggml.pre`` -> llama.cpp's rules (``llama_vocab::impl::load``); every value accepted is
#: checked against llama.cpp on a synthetic vocabulary (tests/test_tokenizer_llama_cpp.py).
PRE_RULES: dict[str, PreRule] = {
    "default": PreRule("DEFAULT", _DEFAULT),
    "qwen2": _RULE_QWEN2,
    "deepseek-r1-qwen": _RULE_QWEN2,
    "llama3": _RULE_LLAMA3,
    "llama-v3": _RULE_LLAMA3,
    "llama-bpe": _RULE_LLAMA3,
    "gpt-2": PreRule("GPT2", (_GPT2,)),
}
DEFAULT_PRE = "default"

#: ``tokenizer.ggml.model`` -> (default BOS id, default EOS id, default add_bos, default add_space_prefix)
MODEL_DEFAULTS: dict[str, tuple[int, int, bool, bool]] = {
    "llama": (1, 2, True, True),
    "gpt2": (11, 11, False, False),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE vocabularies (llama.cpp ``unicode.cpp``
    ``unicode_byte_to_utf8_map``): printable Latin-1 bytes map to themselves, the others to U+0100...."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def pre_rule(pre: str | None) -> PreRule:
    """The rules of ``pre`` (None or "" is ``default``, as llama.cpp). KeyError for an unsupported value."""
    return PRE_RULES[pre or DEFAULT_PRE]


def merge_refusal(k: int, text: str, vocab, where: str, n: int) -> str | None:
    """Why BPE merge ``k`` (its text, UTF-8 decoded) cannot be used, or None: it is not two pieces split at the first
    space after the first character (llama.cpp's ``word.find(' ', 1)``, src/llama-vocab.cpp), or a piece or the
    merged piece is not a token of ``vocab`` (a container of token strings; ``n`` tokens): the BPE model cannot
    represent it. The one rule of ``strata-pack build`` and the engine's tokenizer."""
    cut = text.find(" ", 1)
    if cut < 0:
        return f"{where}: merge {k} {text!r} is not two pieces separated by a space"
    a, b = text[:cut], text[cut + 1 :]
    for piece in (a, b, a + b):  # a merge names two tokens and forms a third
        if piece not in vocab:
            return (
                f"{where}: merge {k} ({a!r} + {b!r}) needs the token {piece!r}, which is not in the vocabulary "
                f"({n} tokens): the GGUF's tokenizer.ggml.merges do not match its tokenizer.ggml.tokens"
            )
    return None


#: The GGUF value class llama.cpp reads each scalar tokenizer key as (src/llama-vocab.cpp ``llama_vocab::impl::load``
#: through ``llama_model_loader::get_key``, whose ``GGUFMeta`` getter refuses a key of another type with "key ... has
#: wrong type ... but expected type ..."): the model and pre-tokenizer names and the chat template are strings, every
#: ``*_token_id`` an unsigned id, every ``add_*`` and ``remove_extra_whitespaces`` flag a bool.
TOKENIZER_KEY_CLASSES = {"tokenizer.ggml.model": "str", "tokenizer.ggml.pre": "str", "tokenizer.chat_template": "str"}


def tokenizer_key_class(key: str) -> str | None:
    """The value class (``str`` | ``int`` | ``bool``) llama.cpp reads tokenizer key ``key`` as, None for a key it
    does not read as a scalar (:data:`TOKENIZER_KEY_CLASSES`, ``tokenizer.ggml.*_token_id``: ``int``,
    ``tokenizer.ggml.add_*`` and ``tokenizer.ggml.remove_extra_whitespaces``: ``bool``)."""
    if key in TOKENIZER_KEY_CLASSES:
        return TOKENIZER_KEY_CLASSES[key]
    if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
        return "int"
    if key.startswith("tokenizer.ggml.add_") or key == "tokenizer.ggml.remove_extra_whitespaces":
        return "bool"
    return None


def _value_class(v) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, (str, bytes)):
        return "str"
    return "array" if isinstance(v, (list, tuple)) or hasattr(v, "shape") else type(v).__name__


def tokenizer_key_refusal(kv: dict, where: str) -> str | None:
    """Why a scalar tokenizer key's value has another GGUF value class than llama.cpp reads it as (one line naming
    ``where``, the key, the class found and the class expected), or None. llama.cpp refuses such a model at load;
    strata refuses it at build and at the tokenizer's load, rather than reading ``"false"`` as true or an id
    given as a string as no id. The one rule of ``strata-pack build`` and the engine's tokenizer."""
    for key in sorted(kv):
        want = tokenizer_key_class(key)
        if want is None:
            continue
        got = _value_class(kv[key])
        if got != want:
            return (
                f"{where}: {key} is a {got} ({kv[key]!r}), but llama.cpp reads it as a {want} and refuses the model "
                f'("key has wrong type"); refused'
            )
    return None


def tokenizer_refusal(kv: dict, tokens: list[bytes] | None, types: list[int] | None, where: str) -> str | None:
    """Why strata cannot tokenize like llama.cpp for these ``tokenizer.ggml.*`` values (one line naming
    ``where``, the key and the value, or the token id), or None.

    Refused: a tokenizer key of another value class than llama.cpp reads (:func:`tokenizer_key_refusal`); a
    ``tokenizer.ggml.model`` other than :data:`MODEL_DEFAULTS`'s; for ``gpt2`` a
    ``tokenizer.ggml.pre`` outside :data:`PRE_RULES`; a special token (control, user-defined or
    unknown) whose bytes are not valid UTF-8 (llama.cpp matches such bytes inside the prompt's
    multi-byte characters, splitting them). Normal tokens with such bytes are kept: no text can
    produce them and they decode to their bytes, as in llama.cpp.
    """
    why = tokenizer_key_refusal(kv, where)
    if why:
        return why
    model = kv.get("tokenizer.ggml.model")
    if tokens is None or model is None:
        return None  # no vocabulary to run (the engine refuses a pack without a tokenizer model by name)
    if model not in MODEL_DEFAULTS:
        return (
            f"{where}: tokenizer.ggml.model {model!r} is not supported by strata's tokenizer "
            f"(supported: {', '.join(MODEL_DEFAULTS)})"
        )
    if model == "gpt2":
        pre = kv.get("tokenizer.ggml.pre")
        if (pre or DEFAULT_PRE) not in PRE_RULES:
            return (
                f"{where}: tokenizer.ggml.pre {pre!r} is not supported by strata's tokenizer "
                f"(supported: {', '.join(sorted(PRE_RULES))}); refusing rather than tokenizing it differently "
                f"from llama.cpp"
            )
    if types is not None:
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in SPECIAL_TYPES:
                try:
                    t.decode("utf-8")
                except UnicodeDecodeError:
                    return (
                        f"{where}: token {i} (type {ty}, special) is not valid UTF-8 ({t!r}): llama.cpp would match "
                        f"its bytes inside the prompt's multi-byte characters; refused"
                    )
    return None


__all__ = [
    "TOKENIZER_KEY_CLASSES",
    "merge_refusal",
    "tokenizer_key_class",
    "tokenizer_key_refusal",
    "DEFAULT_PRE",
    "MODEL_DEFAULTS",
    "PRE_RULES",
    "PreRule",
    "SPECIAL_TYPES",
    "TOKEN_BYTE",
    "TOKEN_CONTROL",
    "TOKEN_NORMAL",
    "TOKEN_UNKNOWN",
    "TOKEN_UNUSED",
    "TOKEN_USER_DEFINED",
    "bytes_to_unicode",
    "pre_rule",
    "tokenizer_refusal",
]
