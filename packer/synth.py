"""Deterministic synthetic GGUF files for strata's tests and benchmarks.

Four families, all seeded (same arguments -> byte-identical files):

1. :func:`make_random_blocks` - valid random blocks of any ggml type: quantized from random
   normal values where gguf-py has a quantizer, otherwise random bytes whose fp16 super-scale
   fields are overwritten with a small positive scale (every other bit pattern of the K/IQ
   types decodes to a value, FORMATS.md section 2).
2. :func:`write_model` - small models of the four architectures strata knows (``qwen3moe``,
   ``qwen3next``, ``qwen2``, ``gemma3``) written with ``gguf.GGUFWriter``, with per-layer expert
   types, optional fused gate/up experts and llama-gguf-split style shards. The presets
   (:func:`qwen3moe_spec` ...) are loaded and run by llama.cpp (llama-cpp-python 0.3.36).
3. :func:`write_header_only` - strata's own minimal GGUF v3 writer: a real header and a sparse
   data section (a hole), so the documents' 48-layer, 512-expert model
   (:func:`documents_qwen3next_header_only`, ~47 GB logical) costs a few MB of disk. It accepts
   type ids gguf-py does not know (42 = Q2_0).
4. "Broken files" - :func:`write_broken` writes one malformed file per kind in
   :data:`BROKEN_KINDS` for the GGUF reader's tests.

Shapes are always ggml ``ne`` order (``ne[0]`` = row length, fastest). Sizes are bytes.
Type sizes come from the one registry, :mod:`strata.packer.quants`.
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from . import quants
from .quants import QuantType

__all__ = [
    "ARCHS", "BROKEN_KINDS", "DENSE_TYPES", "DOCUMENTS_EXPERT_CYCLE", "ExpertTypes", "HeaderLayout", "KV",
    "ModelDims", "ModelSpec", "PlannedTensor", "TensorLayout", "big_dense_spec", "documents_qwen3next_header_only",
    "documents_qwen3next_plan", "gemma3_spec", "make_random_blocks", "model_kv", "plan_tensors", "qwen2_spec",
    "qwen3moe_spec", "qwen3next_spec", "shard_names", "synth_tokenizer", "write_big_dense", "write_broken",
    "write_broken_base", "write_header_only", "write_model",
]

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    # Seeded per tensor name: changing one tensor's type leaves every other tensor's bytes unchanged.
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


# =====================================================================================
# 1. random blocks
# =====================================================================================

#: Types gguf-py 0.19.0 can quantize (FORMATS.md section 1): their blocks come from real
#: quantization of normal values, so scales and payload are consistent.
_GGUF_QUANTIZABLE = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"})

#: Largest |value| / d a block can decode to for ANY payload bits (d = fp16 super-scale), from the
#: dequantization formulas (FORMATS.md section 5, ggml-quants.c): e.g. Q6_K 128*32 (int8 sub-scale
#: times 6-bit quant minus 32), IQ4_XS 32*127 (6-bit scale minus 32 times kvalues_iq4nl), IQ2_XXS
#: (0.5+15)*0.25*43 (4-bit scale, grid value <= 43). Second number: the same for dmin / m.
_SPAN: dict[str, tuple[float, float]] = {
    "Q8_1": (128.0, 0.0),  # s is a sum field, not a scale
    "Q2_K": (15 * 3, 15), "Q3_K": (32 * 4, 0), "Q4_K": (63 * 15, 63), "Q5_K": (63 * 31, 63),
    "Q6_K": (128 * 32, 0),
    "IQ2_XXS": (15.5 * 0.25 * 43, 0), "IQ2_XS": (15.5 * 0.25 * 43, 0), "IQ2_S": (15.5 * 0.25 * 43, 0),
    "IQ3_XXS": (15.5 * 0.5 * 62, 0), "IQ3_S": (31 * 15, 0), "IQ1_S": (15 * 1.125, 0),
    "IQ1_M": (15 * 1.125, 0), "IQ4_NL": (127, 0), "IQ4_XS": (32 * 127, 0),
    "Q1_0": (1, 0), "Q2_0": (2, 0), "Q8_K": (128, 0),
}
#: Target bounds on decoded values: |x| <= _MAX_ABS from d, + _MAX_ABS_MIN from dmin.
_MAX_ABS = 0.2
_MAX_ABS_MIN = 0.05
_MAX_D = 0.02  # keeps 1- and 2-bit types (Q1_0, Q2_0, IQ1_*) at O(0.02-0.05) too


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def make_random_blocks(type_id: int | str, n_elements: int, rng: np.random.Generator, *, std: float = 0.02) -> np.ndarray:
    """Random but valid data for ``n_elements`` values of ggml type ``type_id``.

    Args:
        type_id: ggml type id or name (any type in :data:`strata.packer.quants.QTYPES`, incl. 42 = Q2_0).
        n_elements: number of values; must be a multiple of the type's block size.
        rng: numpy Generator (the only source of randomness).
        std: standard deviation of the normal values for types that are quantized from floats.

    Returns:
        1-D ``uint8`` array of ``quants.tensor_nbytes(type_id, (n_elements,))`` bytes: whole blocks.

    How: F32/F16/F64 are normal values (std ``std``); BF16 is their round-to-nearest-even (bit-identical
    to ``gguf.quants.quantize(x, BF16)``). Types gguf-py quantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    TQ1_0, TQ2_0, MXFP4) are ``gguf.quants.quantize`` of normal values. Every
    other type (K-quants, IQ types, Q1_0, Q2_0, Q8_1, Q8_K) is random bytes whose fp16 super-scale
    field(s) (``QuantType.fp16_scale_offsets``; dmin too) are overwritten with a positive scale
    drawn so that ANY payload decodes to |x| <= 0.25 (d*span <= 0.2 with d <= 0.02, dmin*span <= 0.05);
    IQ1_M's fp16 scale packed in nibbles, Q8_K's f32 d (+ consistent bsums) and NVFP4's four UE4M3
    scales are set the same way. Integer types are random integers.
    """
    t = quants.by_name(type_id) if isinstance(type_id, str) else quants.qtype(int(type_id))
    n = int(n_elements)
    if n < 0 or n % t.block_elems:
        raise quants.ShapeError(f"{t.name}: n_elements={n} is not a multiple of the block size {t.block_elems}")
    n_blocks = n // t.block_elems
    if t.name in ("F32", "F16", "F64"):
        dt = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}[t.name]
        return (rng.standard_normal(n, dtype=np.float32) * std).astype(dt).view(np.uint8)
    if t.name == "BF16":
        # round-to-nearest-even like ggml_compute_fp32_to_bf16 (normal values: no NaN case);
        # same bits as gguf.quants.quantize(x, BF16), ~50x faster
        bits = (rng.standard_normal(n, dtype=np.float32) * std).view(np.uint32)
        return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2").view(np.uint8)
    if t.name in ("I8", "I16", "I32", "I64"):
        dt = {"I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}[t.name]
        return rng.integers(-100, 100, size=n).astype(dt).view(np.uint8)
    if t.name in _GGUF_QUANTIZABLE:
        x = rng.standard_normal((n_blocks, t.block_elems), dtype=np.float32) * std
        out = gguf.quants.quantize(x, GGMLQuantizationType(t.id))
        return np.ascontiguousarray(out).view(np.uint8).reshape(-1)

    blocks = rng.integers(0, 256, size=(n_blocks, t.block_bytes), dtype=np.uint8)
    span, span_min = _SPAN.get(t.name, (128.0, 0.0))
    d_hi = min(_MAX_ABS / span, _MAX_D)
    d = rng.uniform(0.5 * d_hi, d_hi, size=n_blocks)
    if t.name == "IQ1_M":
        # fp16 super-scale split over the top nibbles of the 4 u16 of scales[8] at byte 48
        # (ggml-common.h block_iq1_m; gguf-py IQ1_M.dequantize_blocks).
        sc = blocks[:, 48:56].copy().view("<u2")  # (n_blocks, 4)
        bits = d.astype("<f2").view("<u2").astype(np.uint16)
        for k in range(4):
            nib = (bits >> np.uint16(4 * k)) & np.uint16(0xF)
            sc[:, k] = (sc[:, k] & np.uint16(0x0FFF)) | (nib << np.uint16(12))
        blocks[:, 48:56] = sc.view(np.uint8)
    elif t.name == "Q8_K":
        # d is f32 at byte 0, then int8 qs[256], then bsums[16] i16 = sums of 16 qs each.
        blocks[:, 0:4] = d.astype("<f4").view(np.uint8).reshape(-1, 4)
        qs = blocks[:, 4:260].view(np.int8).astype(np.int16).reshape(n_blocks, 16, 16)
        blocks[:, 260:292] = qs.sum(axis=2).astype("<i2").view(np.uint8).reshape(n_blocks, 32)
    elif t.name == "NVFP4":
        # four UE4M3 scales d[4] (value = 0.5 * (1 + m/8) * 2**(e-7)); e=2, m<=2 -> d <= 0.0195,
        # e2m1 values <= 12 (kvalues doubled) -> |x| <= 0.24.
        blocks[:, 0:4] = (np.uint8(2 << 3) | rng.integers(0, 3, size=(n_blocks, 4), dtype=np.uint8))
    else:
        offs = t.fp16_scale_offsets
        if not offs:  # a registry type added later without a rule here
            raise ValueError(f"make_random_blocks has no rule for {t.name} (id {t.id}): no fp16 scale field to set")
        blocks[:, offs[0]:offs[0] + 2] = _f16_bytes(d)
        for o in offs[1:]:
            if span_min:  # dmin of Q2_K / Q4_K / Q5_K
                m_hi = _MAX_ABS_MIN / span_min
                blocks[:, o:o + 2] = _f16_bytes(rng.uniform(0.5 * m_hi, m_hi, size=n_blocks))
            else:  # Q8_1's s = d * sum(qs): keep it consistent with the payload
                qs = blocks[:, 4:].view(np.int8).astype(np.float32)
                blocks[:, o:o + 2] = _f16_bytes(d.astype(np.float32) * qs.sum(axis=1))
    return blocks.reshape(-1)


def _pattern_bytes(type_id: int, ne: Sequence[int], rng: np.random.Generator, pattern_bytes: int = 1 << 16) -> np.ndarray:
    """Bytes of a whole tensor made by tiling ~64 KiB of valid random blocks: GB-sized files in seconds."""
    t = quants.qtype(type_id)
    nbytes = quants.tensor_nbytes(type_id, ne)
    n_blocks = nbytes // t.block_bytes
    k = max(1, min(n_blocks, pattern_bytes // t.block_bytes))
    pat = make_random_blocks(type_id, k * t.block_elems, rng)
    out = np.empty(nbytes, np.uint8)
    reps = n_blocks // k
    out[:reps * pat.size].reshape(reps, pat.size)[:] = pat  # broadcast copy, memcpy speed
    out[reps * pat.size:] = pat[:nbytes - reps * pat.size]
    return out


# =====================================================================================
# tokenizer: a small byte-level BPE vocabulary llama.cpp accepts (model "gpt2", pre "qwen2")
# =====================================================================================

def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable unicode mapping (the one byte-level BPE vocabularies use).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


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
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    vocab = set(tokens)
    words = Counter(
        tuple(b2u[b] for b in w.encode())
        for w in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", _CORPUS)
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


def _tokenizer_kv(tok: SynthTokenizer, add_bos: bool) -> list[tuple[str, int, Any, int | None]]:
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


# =====================================================================================
# 2. model specs and write_model (gguf.GGUFWriter)
# =====================================================================================

ARCHS = ("qwen3moe", "qwen3next", "qwen2", "gemma3")
MOE_ARCHS = ("qwen3moe", "qwen3next")

#: Types intended for dense (non-expert) weights: ne0 only needs to be a multiple of 32.
DENSE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0")


def _to_type_id(v: Any) -> int:
    if isinstance(v, QuantType):
        return v.id
    if isinstance(v, str):
        return quants.by_name(v).id
    return quants.qtype(int(v)).id


TypeId = Annotated[int, BeforeValidator(_to_type_id)]


class ExpertTypes(BaseModel):
    """ggml types of one layer's routed experts: ``gate_up`` for ffn_gate_exps/ffn_up_exps (or the
    fused ffn_gate_up_exps), ``down`` for ffn_down_exps. Ids or names (``"IQ2_XS"``) are accepted."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gate_up: TypeId
    down: TypeId


def _to_expert_types(v: Any) -> Any:
    if isinstance(v, (tuple, list)) and len(v) == 2 and not isinstance(v[0], (dict, ExpertTypes)):
        return {"gate_up": v[0], "down": v[1]}
    return v


class ModelDims(BaseModel):
    """Hyperparameters of a synthetic model (small defaults: fast to write, accepted by llama.cpp).

    Attention: ``n_head`` query heads, ``n_head_kv`` KV heads of ``head_dim``. FFN: dense width
    ``n_ff``; routed experts ``n_expert`` of width ``n_ff_exp`` (``n_expert_used`` per token);
    qwen3next shared expert width ``n_ff_shexp``. qwen3next gated delta net: ``ssm_d_state`` (head
    k/v dim), ``ssm_n_group`` (k heads), ``ssm_dt_rank`` (v heads), ``ssm_d_conv``; layer il is
    full attention iff ``(il + 1) % full_attention_interval == 0``. gemma3: ``sliding_window`` and
    ``sliding_window_pattern`` (layer il is sliding iff ``il % pattern < pattern - 1``).
    K-quant / IQ expert types need ``n_embd`` and ``n_ff_exp`` to be multiples of 256.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    n_embd: int = 256
    n_vocab: int = 512
    context_length: int = 2048
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 256
    n_ff_shexp: int = 256
    ssm_d_conv: int = 4
    ssm_d_state: int = 64
    ssm_n_group: int = 2
    ssm_dt_rank: int = 4
    full_attention_interval: int = 4
    sliding_window: int = 128
    sliding_window_pattern: int = 2
    rope_freq_base: float = 1e6
    rms_eps: float = 1e-6

    @property
    def ssm_d_inner(self) -> int:
        """Delta-net value dim = ``ssm_d_state * ssm_dt_rank`` (key ``ssm.inner_size``)."""
        return self.ssm_d_state * self.ssm_dt_rank

    @property
    def ssm_key_dim(self) -> int:
        """``ssm_d_state * ssm_n_group``."""
        return self.ssm_d_state * self.ssm_n_group

    @property
    def ssm_conv_dim(self) -> int:
        """Conv channels = ``2 * key_dim + value_dim`` (= ne1 of attn_qkv and ssm_conv1d)."""
        return 2 * self.ssm_key_dim + self.ssm_d_inner


class ModelSpec(BaseModel):
    """Everything :func:`write_model` needs; the same spec and seed give byte-identical files.

    Attributes:
        arch: one of :data:`ARCHS`.
        name: ``general.name``.
        dims: :class:`ModelDims`.
        n_layers: ``block_count``.
        seed: root of every tensor's random stream (per tensor: seed + crc32(name)).
        expert_types: one :class:`ExpertTypes` (or ``(gate_up, down)`` pair) per layer; MoE archs only.
        dense_type: type of every 2-D non-expert weight (token_embd, output, attention, ssm, shared
            expert, dense FFN) unless ``tensor_types`` overrides it; 1-D tensors are always F32.
        tensor_types: overrides by base name (``"attn_q"``, ``"token_embd"``, ``"output"``,
            ``"ffn_gate_inp"`` (router, default F32), ``"ffn_down_shexp"`` ...), applied to every layer.
        fused_gate_up: qwen3next only: one ``ffn_gate_up_exps [n_embd, 2*n_ff_exp, n_expert]``
            (rows 0..n_ff_exp-1 gate, then up) instead of gate and up tensors.
        tied_output: no ``output.weight`` (llama.cpp then uses token_embd); gemma3 default.
        n_shards: number of files; > 1 writes ``NAME-0000i-of-0000N.gguf`` like llama-gguf-split.
        empty_first_shard: the first shard holds the KVs and no tensor (``--no-tensor-first-split``).
        fill: ``"random"`` (every tensor drawn from its own stream) or ``"pattern"`` (one ~64 KiB random
            block pattern per tensor, tiled: GB-sized files in seconds).
        weight_std: std of the normal values behind float / gguf-quantizable weights.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    arch: Literal["qwen3moe", "qwen3next", "qwen2", "gemma3"]
    name: str = "strata-synth"
    dims: ModelDims = Field(default_factory=ModelDims)
    n_layers: int = 2
    seed: int = 0
    expert_types: list[Annotated[ExpertTypes, BeforeValidator(_to_expert_types)]] = Field(default_factory=list)
    dense_type: TypeId = 8
    tensor_types: dict[str, TypeId] = Field(default_factory=dict)
    fused_gate_up: bool = False
    tied_output: bool = False
    n_shards: int = 1
    empty_first_shard: bool = False
    fill: Literal["random", "pattern"] = "random"
    weight_std: float = 0.02

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        d = self.dims
        if self.n_layers < 1:
            raise ValueError(f"n_layers={self.n_layers} < 1")
        if self.arch in MOE_ARCHS:
            if len(self.expert_types) != self.n_layers:
                raise ValueError(f"{self.arch}: expert_types has {len(self.expert_types)} entries for {self.n_layers} layers")
            if not 0 < d.n_expert_used <= d.n_expert:
                raise ValueError(f"n_expert_used={d.n_expert_used} must be in 1..n_expert={d.n_expert}")
        elif self.expert_types:
            raise ValueError(f"{self.arch} is dense: expert_types must be empty")
        if self.fused_gate_up and self.arch != "qwen3next":
            raise ValueError("fused_gate_up: only qwen3next loads ffn_gate_up_exps (llama.cpp create_tensor_gate_up_exps)")
        if self.arch == "qwen2" and d.n_head * d.head_dim != d.n_embd:
            raise ValueError(f"qwen2 needs n_head*head_dim == n_embd ({d.n_head}*{d.head_dim} != {d.n_embd})")
        if self.n_shards < 1 or (self.empty_first_shard and self.n_shards < 2):
            raise ValueError(f"n_shards={self.n_shards} (empty_first_shard needs >= 2)")
        return self


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a synthetic model: name, ggml type id, ``ne`` (ggml order) and how to fill it
    (``role``: dense, expert, norm, bias, vec, conv, ssm_a, ssm_dt)."""

    name: str
    type_id: int
    ne: tuple[int, ...]
    role: str

    @property
    def nbytes(self) -> int:
        """Bytes in the file (registry size, before alignment padding)."""
        return quants.tensor_nbytes(self.type_id, self.ne, tensor=self.name)


def _layer_is_recurrent(spec: ModelSpec, il: int) -> bool:
    return spec.arch == "qwen3next" and (il + 1) % spec.dims.full_attention_interval != 0


def plan_tensors(spec: ModelSpec) -> list[PlannedTensor]:
    """The tensors :func:`write_model` writes for ``spec``, in file order, with types and ``ne``.

    Names and shapes follow llama.cpp's loaders (``src/models/{qwen3moe,qwen3next,qwen2,gemma3}.cpp``;
    FORMATS.md section 4). Raises ``quants.ShapeError`` naming the tensor when a type's block size
    does not divide ``ne[0]``.
    """
    d = spec.dims
    E, V, hd = d.n_embd, d.n_vocab, d.head_dim
    out: list[PlannedTensor] = []

    def add(name: str, ne: Sequence[int], role: str, type_id: int | None = None) -> None:
        if type_id is None:
            base = name[:-len(".weight")] if name.endswith(".weight") else name
            base = re.sub(r"^blk\.\d+\.", "", base)
            if role == "dense":
                default = 0 if base == "ffn_gate_inp" else spec.dense_type
                type_id = spec.tensor_types.get(base, default)
            else:
                type_id = 0  # 1-D and conv tensors stay F32 (llama.cpp norms / ssm_conv need F32)
        t = PlannedTensor(name, int(type_id), tuple(int(x) for x in ne), role)
        _ = t.nbytes  # validate block divisibility now, with the tensor's name in the message
        out.append(t)

    add("token_embd.weight", (E, V), "dense")
    for il in range(spec.n_layers):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", (E,), "norm")
        if spec.arch == "qwen2":
            add(p + "attn_q.weight", (E, E), "dense")
            add(p + "attn_q.bias", (E,), "bias")
            add(p + "attn_k.weight", (E, d.n_head_kv * hd), "dense")
            add(p + "attn_k.bias", (d.n_head_kv * hd,), "bias")
            add(p + "attn_v.weight", (E, d.n_head_kv * hd), "dense")
            add(p + "attn_v.bias", (d.n_head_kv * hd,), "bias")
            add(p + "attn_output.weight", (E, E), "dense")
        elif _layer_is_recurrent(spec, il):
            add(p + "post_attention_norm.weight", (E,), "norm")
            add(p + "attn_qkv.weight", (E, d.ssm_conv_dim), "dense")
            add(p + "attn_gate.weight", (E, d.ssm_d_inner), "dense")
            add(p + "ssm_conv1d.weight", (d.ssm_d_conv, d.ssm_conv_dim), "conv")
            add(p + "ssm_dt.bias", (d.ssm_dt_rank,), "ssm_dt")
            add(p + "ssm_a", (d.ssm_dt_rank,), "ssm_a")
            add(p + "ssm_ba.weight", (E, 2 * d.ssm_dt_rank), "dense")
            add(p + "ssm_norm.weight", (d.ssm_d_state,), "norm")
            add(p + "ssm_out.weight", (d.ssm_d_inner, E), "dense")
        else:
            q_rows = 2 * d.n_head * hd if spec.arch == "qwen3next" else d.n_head * hd  # qwen3next: query + output gate
            if spec.arch == "qwen3next":
                add(p + "post_attention_norm.weight", (E,), "norm")
            add(p + "attn_q.weight", (E, q_rows), "dense")
            add(p + "attn_k.weight", (E, d.n_head_kv * hd), "dense")
            add(p + "attn_v.weight", (E, d.n_head_kv * hd), "dense")
            add(p + "attn_output.weight", (d.n_head * hd, E), "dense")
            add(p + "attn_q_norm.weight", (hd,), "norm")
            add(p + "attn_k_norm.weight", (hd,), "norm")
            if spec.arch == "gemma3":
                add(p + "post_attention_norm.weight", (E,), "norm")
        if spec.arch != "qwen3next":
            add(p + "ffn_norm.weight", (E,), "norm")
        if spec.arch in MOE_ARCHS:
            et = spec.expert_types[il]
            add(p + "ffn_gate_inp.weight", (E, d.n_expert), "dense")
            if spec.fused_gate_up:
                add(p + "ffn_gate_up_exps.weight", (E, 2 * d.n_ff_exp, d.n_expert), "expert", et.gate_up)
            else:
                add(p + "ffn_gate_exps.weight", (E, d.n_ff_exp, d.n_expert), "expert", et.gate_up)
                add(p + "ffn_up_exps.weight", (E, d.n_ff_exp, d.n_expert), "expert", et.gate_up)
            add(p + "ffn_down_exps.weight", (d.n_ff_exp, E, d.n_expert), "expert", et.down)
            if spec.arch == "qwen3next":
                add(p + "ffn_gate_inp_shexp.weight", (E,), "vec")
                add(p + "ffn_gate_shexp.weight", (E, d.n_ff_shexp), "dense")
                add(p + "ffn_up_shexp.weight", (E, d.n_ff_shexp), "dense")
                add(p + "ffn_down_shexp.weight", (d.n_ff_shexp, E), "dense")
        else:
            add(p + "ffn_gate.weight", (E, d.n_ff), "dense")
            add(p + "ffn_up.weight", (E, d.n_ff), "dense")
            add(p + "ffn_down.weight", (d.n_ff, E), "dense")
            if spec.arch == "gemma3":
                add(p + "post_ffw_norm.weight", (E,), "norm")
    add("output_norm.weight", (E,), "norm")
    if not spec.tied_output:
        add("output.weight", (E, V), "dense")
    return out


def model_kv(spec: ModelSpec) -> list[tuple[str, int, Any, int | None]]:
    """The KV pairs of ``spec`` except ``general.architecture``, as ``(key, GGUFValueType, value,
    array sub_type)``: counts are u32, floats f32 (llama.cpp reads them with those types), the
    tokenizer arrays carry explicit element types (gguf infers INT32 for int lists; FORMATS.md)."""
    V = GGUFValueType
    d, a = spec.dims, spec.arch
    u32 = lambda k, v: (k.format(a=a), V.UINT32, int(v), None)  # noqa: E731
    f32 = lambda k, v: (k.format(a=a), V.FLOAT32, float(v), None)  # noqa: E731
    kv = [
        ("general.name", V.STRING, spec.name, None),
        u32("general.quantization_version", 2),
        u32("{a}.context_length", d.context_length),
        u32("{a}.embedding_length", d.n_embd),
        u32("{a}.block_count", spec.n_layers),
        u32("{a}.feed_forward_length", d.n_ff),
        u32("{a}.attention.head_count", d.n_head),
        u32("{a}.attention.head_count_kv", d.n_head_kv),
        u32("{a}.attention.key_length", d.head_dim),
        u32("{a}.attention.value_length", d.head_dim),
        f32("{a}.rope.freq_base", d.rope_freq_base),
        f32("{a}.attention.layer_norm_rms_epsilon", d.rms_eps),
    ]
    if a in MOE_ARCHS:
        kv += [u32("{a}.expert_count", d.n_expert), u32("{a}.expert_used_count", d.n_expert_used),
               u32("{a}.expert_feed_forward_length", d.n_ff_exp)]
    if a == "qwen3next":
        kv += [
            u32("{a}.expert_shared_feed_forward_length", d.n_ff_shexp),
            u32("{a}.ssm.conv_kernel", d.ssm_d_conv),
            u32("{a}.ssm.state_size", d.ssm_d_state),
            u32("{a}.ssm.group_count", d.ssm_n_group),
            u32("{a}.ssm.time_step_rank", d.ssm_dt_rank),
            u32("{a}.ssm.inner_size", d.ssm_d_inner),
            u32("{a}.full_attention_interval", d.full_attention_interval),
            u32("{a}.rope.dimension_count", d.head_dim // 4),  # partial rotary: 0.25 * head_dim
        ]
    if a == "gemma3":
        kv += [u32("{a}.attention.sliding_window", d.sliding_window),
               u32("{a}.attention.sliding_window_pattern", d.sliding_window_pattern),
               f32("{a}.rope.freq_base_swa", 10000.0)]
    kv += _tokenizer_kv(synth_tokenizer(d.n_vocab), add_bos=(a == "gemma3"))
    return kv


def _tensor_data(spec: ModelSpec, t: PlannedTensor) -> np.ndarray:
    rng = _tensor_rng(spec.seed, t.name)
    n = math.prod(t.ne)
    if t.role == "norm":  # norm weights are stored with the +1 already applied (gemma3, qwen3next converters)
        x = 1.0 + 0.01 * rng.standard_normal(n, dtype=np.float32)
    elif t.role == "ssm_a":  # stores -exp(A_log) < 0
        x = -rng.uniform(0.5, 4.0, size=n).astype(np.float32)
    elif t.role == "conv":
        x = 0.1 * rng.standard_normal(n, dtype=np.float32)
    elif t.role in ("bias", "ssm_dt", "vec"):
        x = spec.weight_std * rng.standard_normal(n, dtype=np.float32)
    elif spec.fill == "pattern":
        return _pattern_bytes(t.type_id, t.ne, rng)
    else:
        return make_random_blocks(t.type_id, n, rng, std=spec.weight_std)
    assert t.type_id == 0
    return x.astype("<f4").view(np.uint8)


def shard_names(path: str | Path, n_shards: int) -> list[Path]:
    """File names of a model written to ``path``: ``[path]`` for one shard, else llama-gguf-split's
    ``{stem}-{i:05d}-of-{n:05d}.gguf`` (1-based) beside it."""
    path = Path(path)
    if n_shards == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i + 1:05d}-of-{n_shards:05d}.gguf") for i in range(n_shards)]


def _partition(n: int, n_shards: int, empty_first: bool) -> list[range]:
    k = n_shards - 1 if empty_first else n_shards
    if n < k:
        raise ValueError(f"{n} tensors cannot fill {k} non-empty shards")
    bounds = [round(i * n / k) for i in range(k + 1)]
    parts = [range(bounds[i], bounds[i + 1]) for i in range(k)]
    return ([range(0)] if empty_first else []) + parts


def write_model(path: str | Path, spec: ModelSpec) -> list[Path]:
    """Write the synthetic model ``spec`` with ``gguf.GGUFWriter``; returns the files written.

    One file at ``path``, or ``spec.n_shards`` files named by :func:`shard_names` laid out like
    llama-gguf-split (FORMATS.md section 3): every shard is a complete GGUF whose tensor offsets
    restart at 0; shard 0 carries all KVs plus ``split.no`` (u16), ``split.count`` (u16),
    ``split.tensors.count`` (i32); later shards carry only those three keys. Tensors are spread
    over the (non-empty) shards in order, by count. Data alignment 32 (no ``general.alignment`` key).
    Tensor data is generated and written one tensor at a time (memory ~ the largest tensor).
    """
    path = Path(path)
    plan = plan_tensors(spec)
    w = gguf.GGUFWriter(path, spec.arch)
    for key, vtype, value, sub in model_kv(spec):
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in plan:
        # Pass the element shape (numpy order) with a non-uint8 dtype and raw_dtype=type id:
        # gguf then takes the shape as is, which also works for ids the wheel does not know (42).
        try:
            raw: GGMLQuantizationType | int = GGMLQuantizationType(t.type_id)
        except ValueError:
            raw = t.type_id
        w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes, raw_dtype=raw)
    if spec.n_shards > 1:
        infos = w.tensors[0]
        names = list(infos)
        w.tensors = [{names[i]: infos[names[i]] for i in r} for r in _partition(len(names), spec.n_shards, spec.empty_first_shard)]
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in plan:
        w.write_tensor_data(_tensor_data(spec, t))
    w.close()
    return shard_names(path, spec.n_shards)


def _spec(defaults: dict[str, Any], overrides: dict[str, Any]) -> ModelSpec:
    dims = dict(defaults.pop("dims", {}))
    if "dims" in overrides:
        o = overrides.pop("dims")
        dims.update(o.model_dump() if isinstance(o, ModelDims) else o)
    return ModelSpec(**{**defaults, **overrides, "dims": ModelDims(**dims)})


def qwen3moe_spec(**overrides: Any) -> ModelSpec:
    """qwen3moe preset: 3 layers, n_embd 256, 8 experts of width 256 (2 used), 4 heads / 2 KV heads of
    64, vocab 512, dense Q8_0. Expert types differ per layer: (Q4_K, Q8_0), (IQ2_XS, IQ4_NL),
    (Q6_K, Q5_0) as (gate/up, down). Keyword arguments override ModelSpec fields (``dims`` may be a
    partial dict)."""
    return _spec(dict(arch="qwen3moe", name="strata-synth-qwen3moe", n_layers=3,
                      expert_types=[("Q4_K", "Q8_0"), ("IQ2_XS", "IQ4_NL"), ("Q6_K", "Q5_0")]), overrides)


def qwen3next_spec(**overrides: Any) -> ModelSpec:
    """qwen3next preset: 4 layers (0-2 gated delta net, 3 full attention), n_embd 256, 8 experts of
    width 256 (2 used) + a shared expert of 256, 4 heads / 2 KV heads of 64, delta net with 2 k-heads
    and 4 v-heads of 64 (conv 4), vocab 512, dense Q8_0. Experts (gate/up, down): (IQ2_XS, IQ4_NL),
    (IQ2_XXS, Q8_0), (Q4_K, Q5_0), (Q3_K, Q6_K). ``fused_gate_up=True`` writes ffn_gate_up_exps."""
    return _spec(dict(arch="qwen3next", name="strata-synth-qwen3next", n_layers=4,
                      expert_types=[("IQ2_XS", "IQ4_NL"), ("IQ2_XXS", "Q8_0"), ("Q4_K", "Q5_0"), ("Q3_K", "Q6_K")]),
                 overrides)


def qwen2_spec(**overrides: Any) -> ModelSpec:
    """qwen2 (dense) preset: 2 layers, n_embd 256, n_ff 512, 4 heads / 2 KV heads of 64 with q/k/v
    biases, vocab 512, Q8_0 weights except ffn_down Q5_0 and attn_output Q4_0, untied output."""
    return _spec(dict(arch="qwen2", name="strata-synth-qwen2", n_layers=2,
                      tensor_types={"ffn_down": "Q5_0", "attn_output": "Q4_0"}), overrides)


def gemma3_spec(**overrides: Any) -> ModelSpec:
    """gemma3 (small dense) preset: 2 layers (0 sliding window 128, 1 global), n_embd 256, n_ff 512,
    4 heads / 1 KV head of 64, vocab 512, BF16 weights with a Q8_0 token_embd, output tied to token_embd."""
    return _spec(dict(arch="gemma3", name="strata-synth-gemma3", n_layers=2, dense_type="BF16",
                      tensor_types={"token_embd": "Q8_0"}, tied_output=True, dims={"n_head_kv": 1}), overrides)


def big_dense_spec(target_bytes: int = 2 << 30, *, seed: int = 0) -> ModelSpec:
    """A qwen2 spec whose tensor data is at least ``target_bytes`` bytes (default 2 GiB), for copy
    benchmarks: n_embd 2048, n_ff 8192, 16 heads / 2 KV heads of 128, vocab 512, Q8_0, and as many
    layers as needed (~63.6 MB each). ``fill="pattern"``: writing 2 GiB takes seconds, not minutes."""
    dims = dict(n_embd=2048, n_ff=8192, n_head=16, n_head_kv=2, head_dim=128)
    base = dict(arch="qwen2", name="strata-synth-big-dense", fill="pattern", seed=seed, dims=dims)
    one = sum(t.nbytes for t in plan_tensors(_spec(dict(base), {"n_layers": 1})))
    two = sum(t.nbytes for t in plan_tensors(_spec(dict(base), {"n_layers": 2})))
    per_layer, fixed = two - one, 2 * one - two
    n_layers = max(1, -(-(int(target_bytes) - fixed) // per_layer))
    return _spec(dict(base), {"n_layers": n_layers})


def write_big_dense(path: str | Path, target_bytes: int = 2 << 30, *, seed: int = 0) -> Path:
    """Write :func:`big_dense_spec` (>= ``target_bytes`` of real, non-sparse tensor data) to ``path``."""
    return write_model(path, big_dense_spec(target_bytes, seed=seed))[0]


# =====================================================================================
# 3. strata's own minimal GGUF v3 writer (header-only / sparse data)
# =====================================================================================

class KV(NamedTuple):
    """An explicitly typed KV value for :func:`write_header_only`: ``KV(GGUFValueType.UINT16, 3)``,
    ``KV(GGUFValueType.ARRAY, [1, 2], GGUFValueType.UINT32)``."""

    vtype: int
    value: Any
    sub_type: int | None = None


_SCALAR_FMT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_ARRAY_DTYPE = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


def _infer_kv(value: Any) -> KV:
    V = GGUFValueType
    if isinstance(value, KV):
        return value
    if isinstance(value, tuple) and len(value) in (2, 3) and isinstance(value[0], GGUFValueType):
        return KV(*value)
    if isinstance(value, (bool, np.bool_)):
        return KV(V.BOOL, bool(value))
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if 0 <= v < 2**32:
            return KV(V.UINT32, v)
        return KV(V.INT32, v) if -2**31 <= v < 0 else KV(V.INT64 if v < 0 else V.UINT64, v)
    if isinstance(value, (float, np.floating)):
        return KV(V.FLOAT32, float(value))
    if isinstance(value, str):
        return KV(V.STRING, value)
    if isinstance(value, np.ndarray):
        for vt, dt in _ARRAY_DTYPE.items():
            if vt != V.BOOL and np.dtype(dt) == value.dtype.newbyteorder("<"):
                return KV(V.ARRAY, value, vt)
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(x, str) for x in value):
            return KV(V.ARRAY, value, V.STRING)
        if all(isinstance(x, bool) for x in value):
            return KV(V.ARRAY, value, V.BOOL)
        if all(isinstance(x, (int, np.integer)) for x in value):
            return KV(V.ARRAY, value, V.INT32)  # like gguf-py; use KV(ARRAY, v, UINT32) for u32
        if all(isinstance(x, (int, float, np.number)) for x in value):
            return KV(V.ARRAY, value, V.FLOAT32)
    raise TypeError(f"cannot infer a GGUF type for {type(value).__name__} {value!r:.60}; pass KV(vtype, value, sub_type)")


def _enc_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _enc_value(vtype: int, value: Any, sub_type: int | None) -> bytes:
    V = GGUFValueType
    if vtype == V.STRING:
        return _enc_str(value)
    if vtype == V.ARRAY:
        if sub_type is None or sub_type == V.ARRAY:
            raise ValueError("arrays need a non-array sub_type (ggml rejects nested arrays)")
        head = struct.pack("<IQ", int(sub_type), len(value))
        if sub_type == V.STRING:
            enc = [s.encode() for s in value]
            lens = np.fromiter((len(b) for b in enc), dtype="<u8", count=len(enc)).tobytes()
            return head + b"".join(x for i, b in enumerate(enc) for x in (lens[8 * i:8 * i + 8], b))
        return head + np.asarray(value).astype(_ARRAY_DTYPE[V(sub_type)]).tobytes()
    return struct.pack(_SCALAR_FMT[V(vtype)], value)


@dataclass
class TensorLayout:
    """Where one tensor info sits in a written file.

    ``offset`` is relative to the data section (as stored); ``abs_offset`` = data_offset + offset.
    ``info_pos``/``ne_pos``/``type_pos``/``offset_pos`` are absolute file positions of the tensor
    info's name length, first ne, type and offset fields (used to craft broken files).
    """

    name: str
    type_id: int
    ne: tuple[int, ...]
    offset: int
    nbytes: int | None
    info_pos: int = 0
    ne_pos: int = 0
    type_pos: int = 0
    offset_pos: int = 0
    abs_offset: int = 0


@dataclass
class HeaderLayout:
    """What :func:`write_header_only` wrote: header geometry and every field's file position.

    Attributes:
        path: the file.
        version / n_kv / n_tensors: header counts.
        alignment: data alignment used for padding (bytes).
        data_offset: absolute start of the data section (bytes).
        file_size: final file size (bytes; data section included, sparse or not).
        kv_pos: key -> absolute position of the value's type field (u32); the value follows it.
        tensors: :class:`TensorLayout` per tensor, in file order.
    """

    path: Path
    version: int
    n_kv: int
    n_tensors: int
    alignment: int
    data_offset: int
    file_size: int
    kv_pos: dict[str, int] = field(default_factory=dict)
    tensors: list[TensorLayout] = field(default_factory=list)

    def tensor(self, name: str) -> TensorLayout:
        """The layout of tensor ``name`` (KeyError if absent)."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def _encode_header(kvs: Sequence[tuple[str, KV]], infos: Sequence[TensorLayout], *, alignment: int,
                   magic: bytes = GGUF_MAGIC, version: int = GGUF_VERSION) -> tuple[bytes, HeaderLayout]:
    """Header bytes (magic .. tensor infos, no padding) for exactly the given KVs and tensor infos (no checks)."""
    parts = [magic, struct.pack("<IQQ", version, len(infos), len(kvs))]
    pos = 4 + 4 + 16
    lay = HeaderLayout(Path(), version, len(kvs), len(infos), alignment, 0, 0)
    for key, kv in kvs:
        kb = _enc_str(key)
        vb = struct.pack("<I", int(kv.vtype)) + _enc_value(kv.vtype, kv.value, kv.sub_type)
        lay.kv_pos[key] = pos + len(kb)
        parts += [kb, vb]
        pos += len(kb) + len(vb)
    for ti in infos:
        nb = _enc_str(ti.name)
        ti.info_pos = pos
        ti.ne_pos = pos + len(nb) + 4
        ti.type_pos = ti.ne_pos + 8 * len(ti.ne)
        ti.offset_pos = ti.type_pos + 4
        body = nb + struct.pack(f"<I{len(ti.ne)}QIQ", len(ti.ne), *ti.ne, ti.type_id, ti.offset)
        parts.append(body)
        pos += len(body)
        lay.tensors.append(ti)
    header = b"".join(parts)
    lay.data_offset = _pad(len(header), alignment)
    for ti in infos:
        ti.abs_offset = lay.data_offset + ti.offset
    return header, lay


TensorDecl = tuple[str, int | str, Sequence[int]]
DataMode = Literal["sparse", "random", "pattern"]


def write_header_only(path: str | Path, arch: str, kv: Mapping[str, Any], tensors: Sequence[TensorDecl], *,
                      alignment: int = DEFAULT_ALIGNMENT,
                      data: DataMode | Mapping[str, bytes | np.ndarray] = "sparse", seed: int = 0) -> HeaderLayout:
    """Write a GGUF v3 file with strata's own writer; the data section is a sparse hole by default.

    Args:
        path: output file.
        arch: ``general.architecture`` (written first).
        kv: further KVs in order. Values: ``KV(vtype, value, sub_type)`` for an exact type, or plain
            Python values typed as int -> u32 (negative -> i32), float -> f32, bool -> bool, str ->
            string, list[str] -> array of string, list[int] -> array of i32, list[float] -> array of f32,
            numpy arrays by dtype. ``general.alignment`` (u32) is added when ``alignment != 32``.
        tensors: ``(name, type id or name, ne)`` in file order; ``ne`` in ggml order. Any registry
            type id works, including ids gguf-py does not know (42 = Q2_0).
        alignment: data alignment in bytes (power of two); offsets are the running sum of
            ``pad(nbytes, alignment)``, exactly as ggml requires (gguf.cpp: no gaps, no reordering).
        data: ``"sparse"``: no tensor bytes are written, the file is extended with ``truncate`` (a hole:
            a 40 GB model costs only its header on disk; reads return zeros). ``"random"``: every
            tensor gets :func:`make_random_blocks` bytes (small files only). ``"pattern"``: a tiled
            ~64 KiB random block pattern per tensor. A mapping ``name -> bytes`` writes those tensors'
            bytes explicitly (length must equal the tensor's nbytes) and leaves the rest sparse.
        seed: root of the random streams for ``"random"`` / ``"pattern"``.

    Returns:
        :class:`HeaderLayout` with the data offset, every tensor's offset and the field positions.

    Raises:
        ValueError: duplicate / too long tensor names, more than 4 dims, bad alignment, wrong
            explicit byte counts; ``quants.ShapeError`` / ``GGMLTypeError`` for shapes / type ids.
    """
    path = Path(path)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment={alignment} is not a power of two")
    if "general.architecture" in kv:
        raise ValueError("general.architecture comes from the arch argument")
    kvs: list[tuple[str, KV]] = [("general.architecture", KV(GGUFValueType.STRING, arch))]
    if alignment != DEFAULT_ALIGNMENT and "general.alignment" not in kv:
        kvs.append(("general.alignment", KV(GGUFValueType.UINT32, alignment)))
    kvs += [(k, _infer_kv(v)) for k, v in kv.items()]

    infos: list[TensorLayout] = []
    seen: set[str] = set()
    offset = 0
    for name, type_id, ne in tensors:
        tid = _to_type_id(type_id)
        ne = tuple(int(x) for x in ne)
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        if len(name.encode()) >= 64:
            raise ValueError(f"tensor name {name!r} is {len(name.encode())} bytes (ggml: < 64)")
        if not 1 <= len(ne) <= 4:
            raise ValueError(f"{name}: {len(ne)} dims (ggml: 1..4)")
        seen.add(name)
        nb = quants.tensor_nbytes(tid, ne, tensor=name)
        infos.append(TensorLayout(name, tid, ne, offset, nb))
        offset += _pad(nb, alignment)
    header, lay = _encode_header(kvs, infos, alignment=alignment)
    lay.path = path
    lay.file_size = lay.data_offset + offset
    explicit = dict(data) if isinstance(data, Mapping) else {}
    unknown = set(explicit) - seen
    if unknown:
        raise ValueError(f"data given for unknown tensors {sorted(unknown)}")
    with open(path, "wb") as f:
        f.write(header)
        f.write(b"\0" * (lay.data_offset - len(header)))
        for ti in infos:
            if isinstance(data, str) and data in ("random", "pattern"):
                rng = _tensor_rng(seed, ti.name)
                buf = (make_random_blocks(ti.type_id, math.prod(ti.ne), rng) if data == "random"
                       else _pattern_bytes(ti.type_id, ti.ne, rng))
            elif ti.name in explicit:
                buf = np.frombuffer(bytes(explicit[ti.name]), np.uint8) if not isinstance(explicit[ti.name], np.ndarray) \
                    else explicit[ti.name].view(np.uint8).reshape(-1)
                if buf.size != ti.nbytes:
                    raise ValueError(f"{ti.name}: {buf.size} bytes given, its shape needs {ti.nbytes}")
            elif data == "sparse" or isinstance(data, Mapping):
                continue
            else:
                raise ValueError(f"data={data!r}: expected 'sparse', 'random', 'pattern' or a mapping")
            f.seek(ti.abs_offset)
            buf.tofile(f)
        f.truncate(lay.file_size)  # the sparse hole: no blocks allocated for unwritten data
    return lay


# ---- the documents' model --------------------------------------------------------------

#: (gate/up, down) expert types by layer for the documents' model: layer il uses entry il % 5.
#: Layers 0 and 1 are the documents' worked example (BRIEF.md): IQ2_XS + IQ4_NL, IQ2_XXS + Q2_0.
#: ffn_down's ne0 is 640, so down types must have 32/64/128-element blocks.
DOCUMENTS_EXPERT_CYCLE: tuple[tuple[int, int], ...] = (
    (17, 20),  # IQ2_XS  + IQ4_NL : 473,600 x 2 + 921,600 = 1,868,800 B per expert
    (16, 42),  # IQ2_XXS + Q2_0   : 422,400 x 2 + 460,800 = 1,305,600
    (18, 42),  # IQ3_XXS + Q2_0   : 627,200 x 2 + 460,800 = 1,715,200
    (18, 20),  # IQ3_XXS + IQ4_NL : 627,200 x 2 + 921,600 = 2,176,000
    (22, 2),   # IQ2_S   + Q4_0   : 524,800 x 2 + 921,600 = 1,971,200
)


def _documents_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    letters = "abcdefghijklmnopqrstuvwxyz"
    n_words = n_vocab - 256 - len(SPECIAL_TOKENS)
    for i in range(n_words):  # bijective base-26 words: unique, deterministic, 2..5 letters
        j, w = i + 26, ""
        while j:
            j, r = divmod(j - 1, 26)
            w = letters[r] + w
        tok = ("\u0120" + w) if i % 2 == 0 else w
        tokens.append(tok)
        merges.append(f"{tok[:-1]} {tok[-1]}")
    types = [1] * len(tokens) + [3] * len(SPECIAL_TOKENS)
    tokens += SPECIAL_TOKENS
    return tokens, types, merges


def documents_qwen3next_plan(*, n_vocab: int = 150_000, indexer: bool = True,
                             expert_cycle: Sequence[tuple[int, int]] = DOCUMENTS_EXPERT_CYCLE
                             ) -> tuple[dict[str, Any], list[tuple[str, int, tuple[int, ...]]]]:
    """KVs and tensor list ``(name, type_id, ne)`` of the documents' model geometry (BRIEF.md).

    qwen3next, n_embd 2560, 48 layers, full attention every 4th layer (3, 7, ..., 47), 512 experts of
    width 640 (8 used) plus a shared expert of width 640 (an assumption: the brief gives no shared
    width), 24 heads / 2 KV heads of 256, delta net: d_conv 4, d_state 128, 16 k-heads (group_count),
    48 v-heads (time_step_rank), inner 6144, conv channels 10240; vocab ``n_vocab`` (tokens, token
    types and merges written, so the KV section is realistic: ~5 MB for 150k). Expert types: layer il
    uses ``expert_cycle[il % len]``. Dense types: token_embd Q4_K, output Q6_K, router BF16, attention
    / delta-net projections Q5_0 / Q8_0 / Q4_0, norms and ssm vectors F32.

    ``indexer`` adds, on each full-attention layer, the documents' indexer: 4 query heads and ONE
    shared key head of 128 (``indexer.attn_k [2560, 128]``, ``indexer.attn_q_b [2560, 512]``,
    ``indexer.proj [2560, 4]``, ``indexer.k_norm [128]``; names from gguf-py's DeepSeek-V3.2 indexer
    tensors; llama.cpp's qwen3next loader does not know them) and the keys
    ``qwen3next.attention.indexer.head_count`` = 4 / ``key_length`` = 128.
    """
    a, E, L, NE, FF, FFS = "qwen3next", 2560, 48, 512, 640, 640
    H, HKV, HD = 24, 2, 256
    d_state, n_group, dt_rank, d_conv = 128, 16, 48, 4
    d_inner = d_state * dt_rank
    conv_dim = 2 * d_state * n_group + d_inner
    assert (d_inner, conv_dim) == (6144, 10240)
    V = GGUFValueType
    tokens, types, merges = _documents_vocab(n_vocab)
    kv: dict[str, Any] = {
        "general.name": "strata-documents-qwen3next-48L-512E",
        "general.quantization_version": 2,
        f"{a}.context_length": 262144,
        f"{a}.embedding_length": E,
        f"{a}.block_count": L,
        f"{a}.feed_forward_length": 5120,
        f"{a}.attention.head_count": H,
        f"{a}.attention.head_count_kv": HKV,
        f"{a}.attention.key_length": HD,
        f"{a}.attention.value_length": HD,
        f"{a}.rope.freq_base": 1e7,
        f"{a}.rope.dimension_count": HD // 4,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.expert_count": NE,
        f"{a}.expert_used_count": 8,
        f"{a}.expert_feed_forward_length": FF,
        f"{a}.expert_shared_feed_forward_length": FFS,
        f"{a}.ssm.conv_kernel": d_conv,
        f"{a}.ssm.state_size": d_state,
        f"{a}.ssm.group_count": n_group,
        f"{a}.ssm.time_step_rank": dt_rank,
        f"{a}.ssm.inner_size": d_inner,
        f"{a}.full_attention_interval": 4,
    }
    if indexer:
        kv[f"{a}.attention.indexer.head_count"] = 4
        kv[f"{a}.attention.indexer.key_length"] = 128
    kv.update({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": KV(V.ARRAY, tokens, V.STRING),
        "tokenizer.ggml.token_type": KV(V.ARRAY, np.asarray(types, "<i4"), V.INT32),
        "tokenizer.ggml.merges": KV(V.ARRAY, merges, V.STRING),
        "tokenizer.ggml.eos_token_id": len(tokens) - 3,
        "tokenizer.ggml.padding_token_id": len(tokens) - 3,
        "tokenizer.ggml.add_bos_token": False,
    })
    F32, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q6_K = 0, 30, 2, 6, 8, 12, 14
    T: list[tuple[str, int, tuple[int, ...]]] = [("token_embd.weight", Q4_K, (E, n_vocab))]
    for il in range(L):
        p = f"blk.{il}."
        gu, dn = expert_cycle[il % len(expert_cycle)]
        T += [(p + "attn_norm.weight", F32, (E,)), (p + "post_attention_norm.weight", F32, (E,))]
        if (il + 1) % 4 != 0:
            T += [
                (p + "attn_qkv.weight", Q5_0, (E, conv_dim)),
                (p + "attn_gate.weight", Q5_0, (E, d_inner)),
                (p + "ssm_conv1d.weight", F32, (d_conv, conv_dim)),
                (p + "ssm_dt.bias", F32, (dt_rank,)),
                (p + "ssm_a", F32, (dt_rank,)),
                (p + "ssm_ba.weight", BF16, (E, 2 * dt_rank)),
                (p + "ssm_norm.weight", F32, (d_state,)),
                (p + "ssm_out.weight", Q8_0, (d_inner, E)),
            ]
        else:
            T += [
                (p + "attn_q.weight", Q4_0, (E, 2 * H * HD)),
                (p + "attn_k.weight", Q8_0, (E, HKV * HD)),
                (p + "attn_v.weight", Q8_0, (E, HKV * HD)),
                (p + "attn_output.weight", Q5_0, (H * HD, E)),
                (p + "attn_q_norm.weight", F32, (HD,)),
                (p + "attn_k_norm.weight", F32, (HD,)),
            ]
            if indexer:
                T += [
                    (p + "indexer.attn_q_b.weight", BF16, (E, 4 * 128)),
                    (p + "indexer.attn_k.weight", BF16, (E, 128)),  # ONE shared key head (BRIEF "round 194")
                    (p + "indexer.k_norm.weight", F32, (128,)),
                    (p + "indexer.proj.weight", BF16, (E, 4)),
                ]
        T += [
            (p + "ffn_gate_inp.weight", BF16, (E, NE)),
            (p + "ffn_gate_exps.weight", gu, (E, FF, NE)),
            (p + "ffn_up_exps.weight", gu, (E, FF, NE)),
            (p + "ffn_down_exps.weight", dn, (FF, E, NE)),
            (p + "ffn_gate_inp_shexp.weight", F32, (E,)),
            (p + "ffn_gate_shexp.weight", Q8_0, (E, FFS)),
            (p + "ffn_up_shexp.weight", Q8_0, (E, FFS)),
            (p + "ffn_down_shexp.weight", Q8_0, (FFS, E)),
        ]
    T += [("output_norm.weight", F32, (E,)), ("output.weight", Q6_K, (E, n_vocab))]
    return kv, T


def documents_qwen3next_header_only(path: str | Path, *, n_vocab: int = 150_000, indexer: bool = True,
                                    data: DataMode | Mapping[str, bytes] = "sparse") -> HeaderLayout:
    """Write the documents' qwen3next geometry (:func:`documents_qwen3next_plan`) as a header-only GGUF.

    The data section is a sparse hole (~47 GB logical, a few MB on disk). Per-expert blob bytes
    (gate + up + down, BRIEF.md): layer 0 473,600 + 473,600 + 921,600 = 1,868,800; layer 1
    422,400 + 422,400 + 460,800 = 1,305,600. Contains Q2_0 (42), which gguf-py 0.19.0 cannot read.
    """
    kv, tensors = documents_qwen3next_plan(n_vocab=n_vocab, indexer=indexer)
    return write_header_only(path, "qwen3next", kv, tensors, data=data)


# =====================================================================================
# 4. broken files
# =====================================================================================

#: Every kind :func:`write_broken` writes, with what is wrong. All start from :func:`write_broken_base`
#: (4 tensors: a.weight F32 [64,4], b.weight Q8_0 [64,4], c.weight F16 [32,3], d.weight Q4_K [256,2];
#: KVs general.architecture, general.name, general.alignment=32, a u32, a 10-string token array).
BROKEN_KINDS: dict[str, str] = {
    "bad_magic": "magic is b'GGUX' instead of b'GGUF'",
    "version_1": "version field is 1 (GGUF v1: unsupported)",
    "version_4": "version field is 4 (unknown future version)",
    "truncated_header": "file ends in the middle of the tensor-info section (3 bytes into b.weight's info)",
    "truncated_data": "file ends halfway through the last tensor's data (d.weight)",
    "tensor_beyond_eof": "d.weight's offset points 1 MiB past the end of the file (file length unchanged)",
    "overlapping_tensors": "b.weight's offset is a.weight's offset + 32: b starts inside a (a is 1024 B)",
    "nbytes_exceeds_span": "a.weight's ne becomes [64,5] (1280 B) but only 1024 B lie before b.weight's offset "
                           "(GGUF stores no nbytes: the shape disagrees with the offsets)",
    "nbytes_below_span": "a.weight's ne becomes [64,2] (512 B) but 1024 B lie before b.weight's offset "
                         "(a gap: offsets are not the running padded sum ggml requires)",
    "ne0_not_block_multiple": "b.weight (Q8_0, block 32) has ne [48,4]: ne0 not a multiple of 32",
    "element_count_overflow": "a.weight (F32) has ne [2**32, 2**31+1]: element count 2**63+2**32 > INT64_MAX",
    "unknown_type_4": "b.weight's type id is 4 (Q4_2, removed from ggml)",
    "unknown_type_99": "b.weight's type id is 99 (never a ggml type)",
    "duplicate_tensor_name": "b.weight is renamed a.weight: two tensors share a name",
    "alignment_0": "general.alignment (u32) is 0",
    "alignment_3": "general.alignment (u32) is 3 (not a power of two)",
    "string_length_beyond_eof": "general.name's u64 length is file size + 1",
    "array_length_beyond_eof": "tokenizer.ggml.tokens' u64 element count is file size + 1",
    "misaligned_offset": "c.weight's offset is 8 bytes past its aligned position (not a multiple of 32)",
    "too_many_dims": "a.weight has 5 dims ne [64,4,1,1,1] (ggml: at most 4)",
    "name_too_long": "a.weight is renamed to a 70-byte name (ggml: < 64 bytes)",
    "bad_kv_type": "general.name's value type is 13 (no such GGUF value type)",
}


def _base_decl() -> tuple[list[tuple[str, KV]], list[tuple[str, int, tuple[int, ...]]]]:
    V = GGUFValueType
    kvs = [
        ("general.architecture", KV(V.STRING, "qwen2")),
        ("general.name", KV(V.STRING, "strata-broken-base")),
        ("general.alignment", KV(V.UINT32, 32)),
        ("qwen2.block_count", KV(V.UINT32, 1)),
        ("tokenizer.ggml.tokens", KV(V.ARRAY, [f"tok{i}" for i in range(10)], V.STRING)),
    ]
    tensors = [("a.weight", 0, (64, 4)), ("b.weight", 8, (64, 4)), ("c.weight", 1, (32, 3)), ("d.weight", 12, (256, 2))]
    return kvs, tensors


def _write_raw(path: Path, kvs, infos: list[TensorLayout], payload: dict[str, np.ndarray], *,
               magic: bytes = GGUF_MAGIC, version: int = GGUF_VERSION,
               data_end: int | None = None) -> HeaderLayout:
    header, lay = _encode_header(kvs, infos, alignment=DEFAULT_ALIGNMENT, magic=magic, version=version)
    lay.path = path
    end = data_end if data_end is not None else max(_pad(t.offset + len(payload[t.name]), 32) for t in infos)
    with open(path, "wb") as f:
        f.write(header)
        f.write(b"\0" * (lay.data_offset - len(header)))
        for t in infos:
            if t.name in payload:
                f.seek(lay.data_offset + t.offset)
                payload[t.name].tofile(f)
        f.truncate(lay.data_offset + end)
    lay.file_size = lay.data_offset + end
    return lay


def _base_payload(seed: int) -> dict[str, np.ndarray]:
    _, tensors = _base_decl()
    return {n: make_random_blocks(t, math.prod(ne), _tensor_rng(seed, n)) for n, t, ne in tensors}


def write_broken_base(path: str | Path, *, seed: int = 0) -> HeaderLayout:
    """Write the small VALID file every broken kind starts from (see :data:`BROKEN_KINDS`); tensors hold
    random valid blocks. ``gguf.GGUFReader`` and llama.cpp's gguf.cpp accept it."""
    kvs, tensors = _base_decl()
    return write_header_only(path, kvs[0][1].value, dict(kvs[1:]), tensors, data=_base_payload(seed))


def write_broken(path: str | Path, kind: str, *, seed: int = 0) -> Path:
    """Write a file of kind ``kind`` (a key of :data:`BROKEN_KINDS`) to ``path`` and return ``path``.

    Every kind is the base file of :func:`write_broken_base` with exactly one defect; tensor data
    stays at the base offsets (relative to the data section), so only the described field differs.
    """
    if kind not in BROKEN_KINDS:
        raise KeyError(f"unknown broken kind {kind!r}; known: {', '.join(BROKEN_KINDS)}")
    path = Path(path)
    kvs, tensors = _base_decl()
    payload = _base_payload(seed)
    infos, off = [], 0
    for n, t, ne in tensors:
        nb = quants.tensor_nbytes(t, ne)
        infos.append(TensorLayout(n, t, tuple(ne), off, nb))
        off += _pad(nb, DEFAULT_ALIGNMENT)
    by = {t.name: t for t in infos}
    magic, version, data_end = GGUF_MAGIC, GGUF_VERSION, off
    post: list[Callable[[HeaderLayout], tuple[int, bytes]]] = []
    cut: Callable[[HeaderLayout], int] | None = None

    if kind == "bad_magic":
        magic = b"GGUX"
    elif kind in ("version_1", "version_4"):
        version = int(kind[-1])
    elif kind == "truncated_header":
        cut = lambda lay: lay.tensor("b.weight").info_pos + 3  # noqa: E731
    elif kind == "truncated_data":
        cut = lambda lay: lay.data_offset + lay.tensor("d.weight").offset + by["d.weight"].nbytes // 2  # noqa: E731
    elif kind == "tensor_beyond_eof":
        by["d.weight"].offset = off + (1 << 20)
    elif kind == "overlapping_tensors":
        by["b.weight"].offset = by["a.weight"].offset + DEFAULT_ALIGNMENT
    elif kind == "nbytes_exceeds_span":
        by["a.weight"].ne = (64, 5)
    elif kind == "nbytes_below_span":
        by["a.weight"].ne = (64, 2)
    elif kind == "ne0_not_block_multiple":
        by["b.weight"].ne = (48, 4)
    elif kind == "element_count_overflow":
        by["a.weight"].ne = (2**32, 2**31 + 1)
    elif kind.startswith("unknown_type_"):
        by["b.weight"].type_id = int(kind.rsplit("_", 1)[1])
    elif kind == "duplicate_tensor_name":
        by["b.weight"].name = "a.weight"
    elif kind in ("alignment_0", "alignment_3"):
        kvs[2] = ("general.alignment", KV(GGUFValueType.UINT32, int(kind[-1])))
    elif kind == "string_length_beyond_eof":
        post.append(lambda lay: (lay.kv_pos["general.name"] + 4, struct.pack("<Q", lay.file_size + 1)))
    elif kind == "array_length_beyond_eof":
        post.append(lambda lay: (lay.kv_pos["tokenizer.ggml.tokens"] + 8, struct.pack("<Q", lay.file_size + 1)))
    elif kind == "misaligned_offset":
        by["c.weight"].offset += 8
    elif kind == "too_many_dims":
        by["a.weight"].ne = (64, 4, 1, 1, 1)
    elif kind == "name_too_long":
        by["a.weight"].name = "a." + "x" * 61 + ".weight"
    elif kind == "bad_kv_type":
        post.append(lambda lay: (lay.kv_pos["general.name"], struct.pack("<I", 13)))
    else:  # pragma: no cover - BROKEN_KINDS and this chain must list the same kinds
        raise AssertionError(kind)

    payload = {t.name: payload[n] for t, (n, _, _) in zip(infos, tensors)}
    if kind == "duplicate_tensor_name":
        payload = {"a.weight": _base_payload(seed)["a.weight"]}
    lay = _write_raw(path, kvs, infos, payload, magic=magic, version=version, data_end=data_end)
    if kind == "duplicate_tensor_name":  # both payloads at their base offsets
        base = _base_payload(seed)
        with open(path, "r+b") as f:
            f.seek(lay.data_offset + infos[1].offset)
            base["b.weight"].tofile(f)
    with open(path, "r+b") as f:
        for fix in post:
            pos, b = fix(lay)
            f.seek(pos)
            f.write(b)
        if cut is not None:
            f.truncate(cut(lay))
    return path
