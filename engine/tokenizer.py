"""Text <-> token ids for a pack, as llama.cpp does it for the same GGUF, from what the packer stored:
``vocab.parquet`` (id, token bytes, score, token_type), ``merges.parquet`` and the
``tokenizer.ggml.*`` keys of ``metadata.txt``. No GGUF is read.

The contract is ``llama_tokenize(text, add_special=True, parse_special)`` of the llama.cpp vendored
by llama-cpp-python 0.3.36 (``src/llama-vocab.cpp``), what llama-cli does with a prompt
(``parse_special = true``) and llama-cpp-python's ``Llama.tokenize(text, add_bos=True, special=...)``:

1. special tokens are cut out of the text first (``llama_vocab::impl::tokenizer_st_partition``): every
   control, user-defined and unknown token, longest text first, each splitting every remaining text
   fragment at each of its occurrences; with ``parse_special = False`` only the user-defined ones
   (control and unknown tokens are then plain text). Tokens llama.cpp strips spaces around
   (``LSTRIP``/``RSTRIP``: its phi-3 name rule) do so here. Done here in Python (:meth:`Tokenizer.partition`);
2. each text fragment is tokenized:

   - ``llama`` (SentencePiece BPE, e.g. Gemma): a space prefix on a fragment that starts the text or
     follows a special token when ``add_space_prefix`` (``llama_vocab::impl::tokenize``, SPM case),
     spaces escaped to U+2581, then bigram merging by token *score* with byte fallback
     (``llm_tokenizer_spm_session``), done here by :class:`strata.engine.spm.SpmEncoder` with llama.cpp's order: the
     highest-scoring bigram first and, among equal scores, the leftmost (a BPE model's distinct merge
     ranks cannot express that tie);
   - by Hugging Face ``tokenizers`` (no added tokens):
   - ``gpt2`` (byte-level BPE): the pre-tokenizer regexes of ``tokenizer.ggml.pre``, the whole-word
     lookup before merges where llama.cpp has it, and byte-level BPE over the stored merges
     (:data:`strata.packer.tokenizer_rules.PRE_RULES`);
3. BOS first when ``add_bos`` and EOS last when ``add_eos`` (llama.cpp's defaults per model and
   pre-tokenizer unless the GGUF's ``add_bos_token`` / ``add_eos_token`` keys say otherwise).

Decoding is llama.cpp's ``token_to_piece`` per token with ``special = false`` (control and unknown
tokens render as nothing), concatenated as bytes (what llama-cpp-python's ``detokenize`` returns),
then UTF-8 with invalid bytes replaced. A vocabulary token whose bytes are not valid UTF-8 is never
produced from text (as in llama.cpp, where no merge of valid text can form it) and decodes to what
llama.cpp's ``llama_decode_text`` gives; the builder refuses such a token if it is special.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata.packer.pack import Pack
from strata.packer.packfmt import MERGES_FILE, TOKENIZER_COLUMN_TYPES, VOCAB_FILE
from strata.packer.parquet_io import read_parquet_table
from strata.packer.tokenizer_rules import (
    MODEL_DEFAULTS,
    PRE_RULES,
    SPECIAL_TYPES,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    bytes_to_unicode,
    merge_refusal,
    pre_rule,
    tokenizer_key_refusal,
)

from .spm import SpmEncoder, SpmError

#: kept for importers: the regexes of every supported pre-tokenizer
PRE_TOKENIZER_REGEXES = {k: r.regexes for k, r in PRE_RULES.items()}
_SPACES = " \t\n\v\f\r"  # C isspace() in the "C" locale: what LSTRIP/RSTRIP strip
#: llama.cpp's special tokens found by their text when the GGUF does not name them (``llama_vocab::impl::load``,
#: "auto-detect special tokens by text"): key -> candidate texts; the one found becomes control.
_AUTO_DETECT = {
    "tokenizer.ggml.eot_token_id": (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    ),
    "tokenizer.ggml.eom_token_id": ("<|eom_id|>",),
    "tokenizer.ggml.fim_pre_token_id": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "tokenizer.ggml.fim_suf_token_id": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "tokenizer.ggml.fim_mid_token_id": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
#: llama.cpp's end-of-generation texts (same function, "maintain a list of tokens that cause end-of-generation"):
#: each present is an EOG token and becomes control.
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)
#: gpt-oss: always rendered (made user-defined)
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def _llama_attrs(tokens: list[str], types, md: dict, vocab: dict[str, int], n: int, eos: int | None):
    """Token attributes and EOG ids after llama.cpp's text-based rules (``llama_vocab::impl::load``), in its
    order: auto-detected EOT/EOM/FIM tokens become control (when the GGUF names no id; llama.cpp takes the
    first match in hash order, here the lowest id), FIM pad/repo/sep are EOG, every EOG text present is EOG
    and control, gpt-oss's channel tokens user-defined, EOS/EOT/EOM ids EOG, ``<|end|>`` not EOG beside
    ``<|return|>`` + ``<|call|>`` (or ``<|calls|>`` + ``<|flush|>``), ``</s>`` normal beside ``<|tool_response>``
    or ``<|plamo:eos|>``. Returns ``(attrs, eog)``."""
    attrs = [int(t) for t in types]
    found: dict[str, int] = {}
    for key, names in _AUTO_DETECT.items():
        v = md.get(key)
        if isinstance(v, int) and 0 <= v < n:
            found[key] = v
            continue
        hits = sorted(vocab[x] for x in names if x in vocab)
        if hits:
            found[key] = hits[0]
            attrs[hits[0]] = TOKEN_CONTROL
    eog = {
        found[k]
        for k in (
            "tokenizer.ggml.fim_pad_token_id",
            "tokenizer.ggml.fim_rep_token_id",
            "tokenizer.ggml.fim_sep_token_id",
        )
        if k in found
    }
    for x in _EOG_TEXTS:
        if x in vocab:
            eog.add(vocab[x])
            if attrs[vocab[x]] != TOKEN_CONTROL:
                attrs[vocab[x]] = TOKEN_CONTROL
    for x in _ALWAYS_RENDERED:
        if x in vocab:
            attrs[vocab[x]] = TOKEN_USER_DEFINED
    eog |= {
        i
        for i in (eos, found.get("tokenizer.ggml.eot_token_id"), found.get("tokenizer.ggml.eom_token_id"))
        if i is not None
    }
    texts = {tokens[i] for i in eog}
    if "<|end|>" in texts and (
        ("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
        or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)
    ):
        eog.discard(vocab["<|end|>"])
        attrs[vocab["<|end|>"]] = TOKEN_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(vocab["</s>"])
        attrs[vocab["</s>"]] = TOKEN_NORMAL
    return attrs, frozenset(eog)


class TokenizerError(ValueError):
    """The pack's tokenizer data cannot be turned into a tokenizer (names the key or file)."""


@dataclass(frozen=True)
class SpecialToken:
    """A token cut out of the prompt text before tokenizing (:meth:`Tokenizer.partition`)."""

    text: str
    id: int
    user_defined: bool
    lstrip: bool = False
    rstrip: bool = False


@dataclass
class Tokenizer:
    """A pack's tokenizer: :meth:`encode` (llama.cpp's ``llama_tokenize``) and :meth:`decode`.

    ``eog_ids`` are the end-of-generation ids (EOS, EOT where present); ``control_ids`` render as
    nothing in :meth:`decode` (llama.cpp's detokenize with ``special=False``); ``special`` holds the
    tokens cut out of the text, longest first.
    """

    hf: object  # tokenizers.Tokenizer (no added tokens; gpt2), or SpmEncoder (llama)
    model: str
    n_vocab: int
    bos_id: int | None
    add_bos: bool
    eog_ids: frozenset[int]
    control_ids: frozenset[int] = field(default_factory=frozenset)
    eos_id: int | None = None
    add_eos: bool = False
    add_space_prefix: bool = False
    special: tuple[SpecialToken, ...] = ()
    pieces: tuple[bytes, ...] = ()
    texts: tuple[bytes, ...] = ()
    chat_template: str | None = None
    warnings: tuple[str, ...] = ()  # what llama.cpp warns about at load (a special id outside the vocabulary)

    def partition(self, text: str, parse_special: bool = True) -> list[str | int]:
        """``text`` split into plain-text fragments (str) and special token ids (int), as llama.cpp's
        ``tokenizer_st_partition``: per special token, longest text first, every fragment split at each
        occurrence (spaces stripped beside LSTRIP/RSTRIP tokens). Without ``parse_special`` only the
        user-defined tokens are cut out."""
        frags: list[str | int] = [text] if text else []
        for sp in self.special:
            if not parse_special and not sp.user_defined:
                continue
            out: list[str | int] = []
            n = len(sp.text)
            for f in frags:
                if isinstance(f, int) or sp.text not in f:
                    out.append(f)
                    continue
                pos = 0
                while True:
                    m = f.find(sp.text, pos)
                    if m < 0:
                        break
                    left = f[pos:m]
                    if sp.lstrip:
                        left = left.rstrip(_SPACES)
                    if left:
                        out.append(left)
                    out.append(sp.id)
                    pos = m + n
                    if sp.rstrip:
                        while pos < len(f) and f[pos] in _SPACES:
                            pos += 1
                if pos < len(f):
                    out.append(f[pos:])
            frags = out
        return frags

    def encode(self, text: str, *, parse_special: bool = True, add_special: bool = True) -> list[int]:
        """Token ids of ``text``: llama.cpp's ``llama_tokenize(text, add_special, parse_special)``
        (module docstring). ``parse_special=False`` treats control tokens' text as plain text."""
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)
        prev_special = True  # SPM: a space prefix on the first fragment and after every special token
        for f in self.partition(text, parse_special):
            if isinstance(f, int):
                ids.append(f)
                prev_special = True
                continue
            if self.model == "llama" and self.add_space_prefix and prev_special:
                f = " " + f
            if self.model == "llama":  # llama_escape_whitespace: ' ' -> U+2581
                try:
                    ids.extend(self.hf.encode_ids(f.replace(" ", "\u2581")))
                except SpmError as e:
                    raise TokenizerError(str(e)) from None
            else:
                ids.extend(self.hf.encode(f, add_special_tokens=False).ids)
            prev_special = False
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return [int(i) for i in ids]

    def decode_bytes(self, ids: list[int]) -> bytes:
        """llama.cpp's pieces of ``ids`` (``token_to_piece``, ``special = false``), concatenated."""
        return b"".join(self.pieces[int(i)] for i in ids)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """The vocabulary text of one token (what a special token looks like in a prompt or template)."""
        return self.texts[int(token_id)].decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str:
        """One token as text (``repr``-friendly), for ``--stats`` lines."""
        return self.decode([token_id]) if token_id not in self.control_ids else self.token_text(token_id)


def _read_parquet(path: Path):
    """``pyarrow.parquet.read_table`` that refuses a corrupt or empty file with its size (TokenizerError)."""
    import pyarrow as pa

    if not path.is_file():
        raise TokenizerError(f"{path}: not a file")
    try:
        with open(path, "rb") as f:  # a file object: pyarrow takes no path that is not UTF-8
            return read_parquet_table(f)
    except (pa.ArrowException, OSError):
        raise TokenizerError(f"{path}: not a valid Parquet file ({path.stat().st_size} bytes)") from None


def _column(table, path: Path, name: str):
    """Column ``name`` of a vocab/merges table, of the type the packer writes
    (:data:`strata.packer.packfmt.TOKENIZER_COLUMN_TYPES`).

    Raises:
        TokenizerError: the column is missing or of another type (file and column named).
    """
    if name not in table.column_names:
        raise TokenizerError(f"{path}: no column {name!r} (columns: {', '.join(table.column_names)})")
    col = table.column(name)
    want = TOKENIZER_COLUMN_TYPES.get(name)
    if want is not None and str(col.type) != want:
        raise TokenizerError(f"{path}: column {name!r} has type {col.type}, the packer writes {want}")
    return col


# ------------------------------------------------------------------ pieces (llama.cpp token_to_piece)


def _byte_decoder() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _decode_text(text: bytes, byte_of: dict[str, int]) -> bytes:
    """llama.cpp's ``llama_decode_text``: each code point of ``text`` (an invalid byte is U+FFFD) back
    to its byte through the byte-level map; one outside the map as ``[UNK_BYTE_0x..<text>]``."""
    out = bytearray()
    for ch in text.decode("utf-8", errors="replace"):
        b = byte_of.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode().hex().encode() + text + b"]"
    return bytes(out)


def _pieces(model: str, texts: list[bytes], attrs: list[int]) -> tuple[bytes, ...]:
    """Every token's piece as llama.cpp's ``token_to_piece(special = false)`` gives it."""
    byte_of = _byte_decoder() if model == "gpt2" else {}
    out = []
    for t, a in zip(texts, attrs):
        if a in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            out.append(b"")
        elif a == TOKEN_USER_DEFINED:
            out.append(t)
        elif a == TOKEN_NORMAL:
            out.append(t.replace("\u2581".encode(), b" ") if model == "llama" else _decode_text(t, byte_of))
        elif a == TOKEN_BYTE and model == "llama" and len(t) == 6 and t.startswith(b"<0x") and t.endswith(b">"):
            out.append(bytes([int(t[3:5], 16)]))
        else:  # unused, undefined, a BPE byte token: llama.cpp renders nothing
            out.append(b"")
    return tuple(out)


def _vocab_strings(texts: list[bytes]) -> tuple[list[str], set[int]]:
    """The vocabulary as ``str`` for Hugging Face ``tokenizers``; a token that is not valid UTF-8 gets a
    placeholder no text can produce (returned in the set: no merge may form it)."""
    out, invalid = [], set()
    for i, t in enumerate(texts):
        try:
            out.append(t.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(f"\ufffe\ufffe<strata: token {i} is not valid UTF-8>")
            invalid.add(i)
    return out, invalid


def load_tokenizer(pack: Pack) -> Tokenizer:
    """Build the tokenizer of ``pack`` (see the module docstring for the contract).

    Raises:
        TokenizerError: no vocab.parquet, an unknown ``tokenizer.ggml.model`` or ``pre``,
            a gpt2 model without merges.parquet, a merge whose pieces or result are not tokens, or a vocab with
            duplicate pieces.
    """
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    md = pack.metadata
    why = tokenizer_key_refusal(md, str(Path(pack.path) / "metadata.txt"))  # the build checks the same rule
    if why:
        raise TokenizerError(why)
    vpath = Path(pack.path) / VOCAB_FILE
    if not vpath.exists():
        raise TokenizerError(f"{vpath}: missing; the pack has no tokenizer")
    table = _read_parquet(vpath)
    ids = _column(table, vpath, "id").to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise TokenizerError(f"{vpath}: ids are not 0..{len(ids) - 1} in order")
    texts = [
        bytes(t) if t else f"[EMPTY_{i}]".encode()  # llama.cpp names an empty token so
        for i, t in enumerate(_column(table, vpath, "token").to_pylist())
    ]
    n = len(texts)
    types = (
        table.column("token_type").to_numpy().astype(np.int32)
        if "token_type" in table.column_names
        else np.full(n, TOKEN_NORMAL, np.int32)
    )
    tokens, invalid = _vocab_strings(texts)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise TokenizerError(
                f"{vpath}: token {i} {t!r} duplicates token {vocab[t]} (llama.cpp refuses such a vocab too)"
            )
        vocab[t] = i

    model = md.get("tokenizer.ggml.model")
    if model not in MODEL_DEFAULTS:
        raise TokenizerError(
            f"tokenizer.ggml.model {model!r} is not supported (supported: {', '.join(map(repr, MODEL_DEFAULTS))})"
        )
    def_bos, def_eos, def_add_bos, def_space = MODEL_DEFAULTS[model]
    if model == "llama":
        if "score" not in table.column_names:
            raise TokenizerError(f"{vpath}: a SentencePiece ('llama') vocab needs the score column")
        scores = table.column("score").to_numpy().astype(np.float32)
        unk_id = md.get("tokenizer.ggml.unknown_token_id", 0)
        unk = unk_id if isinstance(unk_id, int) and 0 <= unk_id < n else None
        hf = SpmEncoder(vocab, scores, invalid, unk)
    else:
        pre = md.get("tokenizer.ggml.pre")
        try:
            rule = pre_rule(pre)
        except KeyError:
            raise TokenizerError(
                f"tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(sorted(PRE_RULES))}"
            ) from None
        def_add_bos = rule.add_bos
        mpath = Path(pack.path) / MERGES_FILE
        if not mpath.exists():
            raise TokenizerError(f"{mpath}: missing; a gpt2 (BPE) tokenizer needs its merges")
        merges = []
        for k, m in enumerate(_column(_read_parquet(mpath), mpath, "merge").to_pylist()):
            try:
                text = m.decode("utf-8")
            except UnicodeDecodeError:
                continue  # its pieces are not valid UTF-8: no text forms them, llama.cpp never applies it
            why = merge_refusal(k, text, vocab, str(mpath), n)  # the build checks the same rule
            if why:
                raise TokenizerError(why)
            cut = text.find(" ", 1)  # llama.cpp: word.find(' ', 1)
            merges.append((text[:cut], text[cut + 1 :]))
        hf = HFTokenizer(models.BPE(vocab, merges, ignore_merges=rule.ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rule.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
        )

    bos = _special_id(md, "tokenizer.ggml.bos_token_id", def_bos, n)
    eos = _special_id(md, "tokenizer.ggml.eos_token_id", def_eos, n)
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", def_add_bos))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    if add_bos and bos is None:
        raise TokenizerError("metadata: tokenizer.ggml.add_bos_token is true but there is no BOS token id")
    if add_eos and eos is None:
        raise TokenizerError("metadata: tokenizer.ggml.add_eos_token is true but there is no EOS token id")
    attrs, eog = _llama_attrs(tokens, types, md, vocab, n, eos)
    control = frozenset(i for i, a in enumerate(attrs) if a in (TOKEN_CONTROL, TOKEN_UNUSED))
    tmpl = md.get("tokenizer.chat_template")
    return Tokenizer(
        hf,
        model,
        n,
        bos,
        add_bos,
        eog,
        control,
        eos_id=eos,
        add_eos=add_eos,
        add_space_prefix=bool(md.get("tokenizer.ggml.add_space_prefix", def_space)) if model == "llama" else False,
        special=_special_tokens(tokens, attrs, invalid, md),
        pieces=_pieces(model, texts, attrs),
        texts=tuple(texts),
        chat_template=tmpl if isinstance(tmpl, str) else None,
        warnings=tuple(_special_id_warnings(md, n)),
    )


def _special_id_warnings(md: dict, n: int) -> list[str]:
    """A special-token id in the metadata outside the vocabulary (llama.cpp warns and falls back to the model's
    default, as :func:`_special_id` does): one line per key, with the id and the vocabulary size."""
    out = []
    for key in sorted(k for k in md if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")):
        v = md[key]
        if isinstance(v, int) and not 0 <= v < n:
            out.append(
                f"metadata: {key} {v} is outside the vocabulary ({n} tokens); ignored (the model's default id "
                "is used where it has one, as llama.cpp does)"
            )
    return out


def _special_id(md: dict, key: str, default: int | None, n: int) -> int | None:
    """llama.cpp's special id: the GGUF's when inside the vocabulary, else the model's default (if inside)."""
    v = md.get(key)
    if isinstance(v, int) and 0 <= v < n:
        return v
    return default if default is not None and 0 <= default < n else None


def _special_tokens(tokens: list[str], attrs: list[int], invalid: set[int], md: dict) -> tuple[SpecialToken, ...]:
    """llama.cpp's ``cache_special_tokens``: control, user-defined and unknown tokens, longest text
    first (in bytes); the LSTRIP/RSTRIP attributes of its name rules (phi-3: every special token but
    ``<unk>``, ``<s>``, ``<|endoftext|>`` strips spaces on its right)."""
    name = str(md.get("general.name", "")).lower()
    phi3 = "phi-3" in name or "phi3" in name
    out = []
    for i, (t, a) in enumerate(zip(tokens, attrs)):
        if a not in SPECIAL_TYPES or i in invalid:
            continue
        out.append(
            SpecialToken(t, i, a == TOKEN_USER_DEFINED, rstrip=phi3 and t not in ("<unk>", "<s>", "<|endoftext|>"))
        )
    out.sort(key=lambda s: -len(s.text.encode()))
    return tuple(out)


__all__ = ["PRE_TOKENIZER_REGEXES", "SpecialToken", "Tokenizer", "TokenizerError", "load_tokenizer"]
