"""The per-sequence memory of strata's engine: the KV cache's rings per attention layer and the
recurrent state per recurrent layer (bytes; "elements" are tensor values).

Type sizes come from the one registry, :mod:`strata.packer.quants`. llama.cpp's own cache sizing (its
cells, padded) is the budget's model of that engine: :mod:`strata.budget.formulas`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from strata.packer import quants

from .buffers import F32_BYTES

#: ``--kv`` choices -> the ggml type one cached K or V row is stored as. ``f16``: 2 B per element
#: (llama.cpp's default ``--cache-type-k/v f16``, and strata's engine default); ``f32``: 4 B;
#: ``int8``: ggml Q8_0 blocks (an fp16 scale + 32 int8 = 34 B per 32 elements), the layout of
#: llama.cpp's ``--cache-type-k/v q8_0``; head_dim must be a multiple of 32.
KV_CACHE_TYPES: dict[str, int] = {"f16": quants.F16.id, "int8": quants.by_name("Q8_0").id, "f32": quants.F32.id}
#: The ``--kv`` choices strata's own engine implements (K/V arrays of float16 or float32; int8 is
#: budgeted for the reference C++ engine only).
ENGINE_KV_TYPES: tuple[str, ...] = ("f16", "f32")
#: Prompt positions strata's engine processes per step: its prompt path is the decode path, one position at
#: a time (docs/DESIGN.md "The prompt goes through the decode path"), so a sliding-window layer needs its
#: window only.
ENGINE_PREFILL_CHUNK = 1


# ----------------------------------------------------------------------------- KV cache


def kv_row_bytes(elements: int, kv: str) -> int:
    """Bytes of one token's K (or V) row of ``elements`` values in the cache (``kv``: ``f16`` | ``int8``).

    Raises:
        KeyError: unknown ``kv``; quants.ShapeError: ``int8`` with ``elements`` not a multiple of 32.
    """
    if kv not in KV_CACHE_TYPES:
        raise KeyError(f"unknown KV cache type {kv!r}; known: {', '.join(KV_CACHE_TYPES)}")
    if elements == 0:
        return 0
    return quants.tensor_nbytes(KV_CACHE_TYPES[kv], (elements,), tensor=f"KV row of {elements} elements")


@dataclass(frozen=True)
class KVLayer:
    """One attention layer's per-token cache in elements: ``k`` and ``v`` = n_head_kv x head_dim
    (n_head_kv, never n_head), ``indexer_k`` = a sparse-attention indexer's ONE shared key head
    (docs/DESIGN.md "Every budget term twice"), ``window`` = sliding window in tokens (None: the
    whole context). Multi-head latent attention (deepseek2) is the same two terms: ``k`` = the latent + the rope key
    (kv_lora_rank + rope dims, ONE "head"), ``v`` = 0 (llama.cpp allocates no V cache under MLA:
    llama-kv-cache.cpp ``has_v = !is_mla``); the manifest's [state] says so (manifests/deepseek2.toml)."""

    layer: int
    k: int
    v: int
    indexer_k: int = 0
    window: int | None = None


def kv_bytes_per_token(layer: KVLayer, kv: str) -> int:
    """Bytes one token adds to one layer's cache: K row + V row (+ the indexer's key row), at ``kv``."""
    return kv_row_bytes(layer.k, kv) + kv_row_bytes(layer.v, kv) + kv_row_bytes(layer.indexer_k, kv)


def kv_tokens(n_ctx: int, window: int | None, chunk: int, kv_resident: int | None = None) -> int:
    """Tokens one layer's cache holds in VRAM for one sequence. strata's engine sizes its KV arrays
    with this function (``chunk`` = :data:`ENGINE_PREFILL_CHUNK`): a sliding-window layer is a ring
    buffer of exactly this many positions (position ``p`` in slot ``p % kv_tokens``).

    - Full-context layer: ``n_ctx``, or ``kv_resident`` if smaller (the C++ engine's ``--kv-resident``:
      the resident window; older positions stream from the host).
    - Sliding-window layer: ``min(n_ctx, window + max(chunk, 1) - 1)``: a position p attends to the
      ``window`` positions ``p - window + 1 .. p`` (llama.cpp ``llama_hparams::is_masked_swa``,
      LLAMA_SWA_TYPE_STANDARD: masked when ``p1 - p0 >= n_swa``), so a chunk of ``c`` positions starting
      at p0 needs ``p0 - window + 1 .. p0 + c - 1``: the window plus what the prompt path adds.
      (llama.cpp allocates a little more, ``n_swa + n_ubatch`` padded; this is the engine's need.)
    """
    n = n_ctx if window is None else min(n_ctx, window + max(chunk, 1) - 1)
    if kv_resident is not None and window is None:  # a sliding layer keeps its window whatever N is
        n = min(n, kv_resident)
    return max(n, 0)


def kv_cache_bytes(
    layers: Iterable[KVLayer], n_ctx: int, chunk: int, kv: str, batch: int, kv_resident: int | None = None
) -> int:
    """KV cache for ``batch`` sequences of up to ``n_ctx`` tokens: attention layers only (recurrent
    layers hold no KV), each at :func:`kv_tokens` tokens x :func:`kv_bytes_per_token`."""
    per_seq = sum(kv_bytes_per_token(L, kv) * kv_tokens(n_ctx, L.window, chunk, kv_resident) for L in layers)
    return per_seq * batch


# ----------------------------------------------------------------------------- recurrent state


@dataclass(frozen=True)
class RecurrentLayer:
    """One recurrent layer's per-sequence state in f32 elements: the conv tail
    ``(d_conv - 1) x conv channels`` and the SSM / delta-net state ``d_state x d_inner``
    (llama.cpp ``n_embd_r`` / ``n_embd_s``, llama-hparams.cpp:208-260)."""

    layer: int
    conv: int
    ssm: int


def recurrent_state_bytes_per_seq(layers: Iterable[RecurrentLayer]) -> int:
    """Recurrent state of one sequence: ``4 x (conv + ssm)`` per recurrent layer. Independent of the
    context length (llama-memory-recurrent.cpp:76-107: one row per sequence, no rollback snapshots)."""
    return sum(F32_BYTES * (L.conv + L.ssm) for L in layers)


def recurrent_state_bytes(layers: Iterable[RecurrentLayer], batch: int) -> int:
    """Recurrent state for ``batch`` sequences (linear in ``batch``, constant in the context)."""
    return recurrent_state_bytes_per_seq(layers) * batch
