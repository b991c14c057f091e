"""Text <-> token ids for a pack, built with Hugging Face ``tokenizers`` from what the packer
stored: ``vocab.parquet`` (id, token bytes, score, token_type), ``merges.parquet`` and the
``tokenizer.ggml.*`` keys of ``metadata.txt``. No GGUF is read.

The contract is llama.cpp's tokenizer for the same file (``llama_tokenize(text, add_special=True,
parse_special=False)``, what llama-cpp-python's ``Llama.tokenize(text, add_bos=True)`` calls), in
``src/llama-vocab.cpp`` of the llama.cpp vendored by llama-cpp-python 0.3.36:

- user-defined tokens (token_type 4) are cut out of the raw text first, control tokens
  (type 3) are not (``tokenizer_st_partition`` with ``parse_special == false``): here they are
  ``AddedToken(normalized=False)`` and control tokens are left out of the added set;
- ``llama`` (SentencePiece BPE, e.g. Gemma): spaces escaped to U+2581, a space prefix only when
  ``add_space_prefix``, then bigram merging by token *score* (highest first) with byte fallback
  (``llm_tokenizer_spm_session``). Here: a BPE model whose merge ranks are the scores of the
  merged pieces (transformers' ``GGUFLlamaConverter``/``generate_merges`` does the same), with
  ``byte_fallback``;
- ``gpt2`` (byte-level BPE): the pre-tokenizer regex of ``tokenizer.ggml.pre`` (table below,
  copied from ``llama_vocab::impl::load``), then byte-level BPE over the stored merges;
- BOS is prepended when ``tokenizer.ggml.add_bos_token`` says so (Gemma: yes, id 2; Qwen: no).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata.packer.packfmt import MERGES_FILE, VOCAB_FILE
from strata.packer.pack import Pack

# llama.cpp token types (gguf TokenType): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

#: ``tokenizer.ggml.pre`` -> the regexes llama.cpp applies in sequence (llama-vocab.cpp, ``regex_exprs``).
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "gpt2": (_GPT2,),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
}


class TokenizerError(ValueError):
    """The pack's tokenizer data cannot be turned into a tokenizer (names the key or file)."""


@dataclass
class Tokenizer:
    """A pack's tokenizer: ``encode`` (with BOS where the model asks for it) and ``decode``.

    ``eog_ids`` are the end-of-generation ids (EOS, EOT where present); ``control_ids`` render as
    nothing in :meth:`decode` (llama.cpp's detokenize with ``special=False``).
    """

    hf: object  # tokenizers.Tokenizer
    model: str
    n_vocab: int
    bos_id: int | None
    add_bos: bool
    eog_ids: frozenset[int]
    control_ids: frozenset[int] = field(default_factory=frozenset)

    def encode(self, text: str) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return [int(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        keep = [int(i) for i in ids if int(i) not in self.control_ids]
        return self.hf.decode(keep, skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        """One token as text (``repr``-friendly), for ``--stats`` lines."""
        return self.decode([token_id]) if token_id not in self.control_ids else self.hf.id_to_token(token_id)


def _spm_merges(vocab: dict[str, int], scores: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece-BPE scoring: every split of a piece into two
    pieces of the vocab is a merge, ranked by the merged piece's score (highest first);
    ties (pieces of equal score) by piece id, then split position (left piece longest first
    is irrelevant: two splits of one piece never compete at one position)."""
    merges: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        n = len(piece)
        if n < 2:
            continue
        s = float(scores[pid])
        for i in range(1, n):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((-s, pid, i, left, right))
    merges.sort()
    return [(m[3], m[4]) for m in merges]


def _read_parquet(path: Path):
    """``pyarrow.parquet.read_table`` that refuses a corrupt or empty file with its size (TokenizerError)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.is_file():
        raise TokenizerError(f"{path}: not a file")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError):
        raise TokenizerError(f"{path}: not a valid Parquet file ({path.stat().st_size} bytes)") from None


def _column(table, path: Path, name: str):
    if name not in table.column_names:
        raise TokenizerError(f"{path}: no column {name!r} (columns: {', '.join(table.column_names)})")
    return table.column(name)


def load_tokenizer(pack: Pack) -> Tokenizer:
    """Build the tokenizer of ``pack`` (see the module docstring for the contract).

    Raises:
        TokenizerError: no vocab.parquet, an unknown ``tokenizer.ggml.model`` or ``pre``,
            a gpt2 model without merges.parquet, or a vocab with duplicate pieces.
    """
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    md = pack.metadata
    vpath = Path(pack.path) / VOCAB_FILE
    if not vpath.exists():
        raise TokenizerError(f"{vpath}: missing; the pack has no tokenizer")
    table = _read_parquet(vpath)
    ids = _column(table, vpath, "id").to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise TokenizerError(f"{vpath}: ids are not 0..{len(ids) - 1} in order")
    tokens = [t.decode("utf-8", errors="surrogateescape") for t in _column(table, vpath, "token").to_pylist()]
    n = len(tokens)
    types = (table.column("token_type").to_numpy().astype(np.int32) if "token_type" in table.column_names
             else np.full(n, TOKEN_NORMAL, np.int32))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise TokenizerError(f"{vpath}: token {i} {t!r} duplicates token {vocab[t]} (llama.cpp refuses such a vocab too)")
        vocab[t] = i

    model = md.get("tokenizer.ggml.model")
    if model == "llama":
        if "score" not in table.column_names:
            raise TokenizerError(f"{vpath}: a SentencePiece ('llama') vocab needs the score column")
        scores = table.column("score").to_numpy().astype(np.float32)
        unk_id = md.get("tokenizer.ggml.unknown_token_id")
        hf = HFTokenizer(models.BPE(vocab, _spm_merges(vocab, scores), unk_token=tokens[unk_id] if unk_id is not None else None,
                                    fuse_unk=True, byte_fallback=True))
        norm = [normalizers.Replace(" ", "\u2581")]
        if md.get("tokenizer.ggml.add_space_prefix", True):
            # llama.cpp prefixes a space to every raw fragment that starts the text or follows a
            # special token: the normalizer runs once per fragment between added tokens, so the same.
            norm.insert(0, normalizers.Prepend(" "))
        hf.normalizer = normalizers.Sequence(norm)
        hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    elif model == "gpt2":
        pre = md.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZER_REGEXES:
            raise TokenizerError(f"tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZER_REGEXES))}")
        mpath = Path(pack.path) / MERGES_FILE
        if not mpath.exists():
            raise TokenizerError(f"{mpath}: missing; a gpt2 (BPE) tokenizer needs its merges")
        merges = []
        for k, m in enumerate(_column(_read_parquet(mpath), mpath, "merge").to_pylist()):
            parts = m.decode("utf-8", errors="surrogateescape").split(" ")
            if len(parts) != 2:
                raise TokenizerError(f"{mpath}: merge {k} {m!r} is not two pieces separated by one space")
            merges.append((parts[0], parts[1]))
        hf = HFTokenizer(models.BPE(vocab, merges, ignore_merges=False))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_REGEXES[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
    else:
        raise TokenizerError(f"tokenizer.ggml.model {model!r} is not supported (supported: 'llama', 'gpt2')")

    user = [AddedToken(tokens[i], normalized=False, special=False) for i in np.flatnonzero(types == TOKEN_USER_DEFINED)]
    if user:
        hf.add_tokens(user)
    bos = md.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", model == "llama"))
    if add_bos and bos is None:
        raise TokenizerError("metadata: tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing")
    eog = {md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if isinstance(md.get(k), int)}
    for name in ("<end_of_turn>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>"):  # llama.cpp's EOG text list (subset)
        if name in vocab and types[vocab[name]] == TOKEN_CONTROL:
            eog.add(vocab[name])
    control = frozenset(int(i) for i in np.flatnonzero((types == TOKEN_CONTROL) | (types == TOKEN_UNUSED)))
    return Tokenizer(hf, model, n, int(bos) if bos is not None else None, add_bos, frozenset(eog), control)
