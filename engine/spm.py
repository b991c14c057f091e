"""SentencePiece-BPE tokenization as llama.cpp's ``llm_tokenizer_spm_session`` (the ``llama`` tokenizer model of
:mod:`strata.engine.tokenizer`)."""

from __future__ import annotations

import numpy as np


class SpmError(ValueError):
    """A character with no token, no byte token and no unknown token to fall back to."""


class SpmEncoder:
    """SentencePiece-BPE tokenization as llama.cpp's ``llm_tokenizer_spm_session::tokenize`` (src/llama-vocab.cpp).

    The text (spaces already escaped to U+2581) is split into characters; every adjacent pair whose concatenation
    is a token is a candidate bigram scored by that token's score (f32); the best candidate is merged - the highest
    score, and among equal scores the one whose left symbol starts first - and the new symbol's pairs with its
    neighbours become candidates; a candidate whose symbols changed since is dropped. Each final symbol is its
    token, or (a character that is no token) its UTF-8 bytes as ``<0xXX>`` tokens (llama.cpp's ``byte_to_token``),
    else the unknown token. Tokens in ``skip`` (placeholders of non-UTF-8 tokens) are never merge results.

    ``vocab``: token text -> id; ``scores``: f32 per id. ``encode_ids(text)`` -> token ids.
    """

    def __init__(self, vocab: dict[str, int], scores: np.ndarray, skip: set[int], unk: int | None):
        self.vocab = vocab
        self.scores = [float(s) for s in np.asarray(scores, dtype=np.float32)]
        self.skip = skip
        self.unk = unk
        self.bytes = [vocab.get(f"<0x{b:02X}>", vocab.get(chr(b)) if b < 128 else None) for b in range(256)]

    def token_to_id(self, text: str) -> int | None:
        return self.vocab.get(text)

    def _merge_id(self, text: str) -> int | None:
        tid = self.vocab.get(text)
        return None if tid is None or tid in self.skip else tid

    def encode_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` (escaped: U+2581 for spaces), as llama.cpp's SPM session (class docstring)."""
        import heapq

        sym = list(text)
        n = len(sym)
        if n == 0:
            return []
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []

        def add(a: int, b: int) -> None:
            if a < 0 or b < 0:
                return
            t = sym[a] + sym[b]
            tid = self._merge_id(t)
            if tid is not None:  # llama.cpp's comparator: score descending, then left index ascending
                heapq.heappush(heap, (-self.scores[tid], a, b, len(t)))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _s, a, b, size = heapq.heappop(heap)
            if not sym[a] or not sym[b] or len(sym[a]) + len(sym[b]) != size:
                continue  # one of its symbols was merged since
            sym[a], sym[b] = sym[a] + sym[b], ""
            nxt[a] = nxt[b]
            if nxt[a] >= 0:
                prv[nxt[a]] = a
            add(prv[a], a)
            add(a, nxt[a])
        out: list[int] = []
        i = 0
        while i >= 0:
            tid = self.vocab.get(sym[i])
            if tid is not None:
                out.append(tid)
            else:
                for byte in sym[i].encode("utf-8"):
                    bt = self.bytes[byte]
                    if bt is not None:
                        out.append(bt)
                    elif self.unk is not None:
                        out.append(self.unk)
                    else:
                        raise SpmError(
                            f"character {sym[i]!r}: no token, no <0x{byte:02X}> byte token and no unknown token"
                        )
            i = nxt[i]
        return out


__all__ = ["SpmEncoder", "SpmError"]
