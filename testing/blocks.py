"""Random but valid blocks of any ggml type, and the per-tensor random streams.

:func:`make_random_blocks` gives valid random blocks of any type in the registry
(:data:`strata.packer.quants.QTYPES`, including ids gguf-py does not know such as 42 = Q2_0): quantized from
random normal values where gguf-py 0.19.0 has a quantizer, otherwise random bytes whose fp16 super-scale
fields are overwritten with a small positive scale (every other bit pattern of the K/IQ types decodes to a
value: their grid and sign indices span whole tables, ggml-quants.c ``dequantize_row_*`` and gguf-py
``gguf/quants.py``). :func:`pattern_fill` tiles ~64 KiB of such blocks over a whole tensor. Every stream is
seeded per tensor (:func:`tensor_rng`), so the same arguments give the same bytes on every machine.

Type sizes and scale offsets come from the one registry, :mod:`strata.packer.quants`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType

from strata.packer import quants
from strata.packer.quants import QuantType

__all__ = [
    "FLOAT_ENCODABLE",
    "GGUF_QUANTIZABLE",
    "encode_floats",
    "make_random_blocks",
    "pattern_chunks",
    "pattern_fill",
    "role_values",
    "tensor_rng",
    "to_type_id",
]


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """The random stream of tensor ``name`` under root ``seed`` (``seed`` + crc32 of the name).

    Seeded per tensor name: changing one tensor's type leaves every other tensor's bytes unchanged.
    """
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def to_type_id(v: Any) -> int:
    """A ggml type id from an id, a name (``"IQ2_XS"``) or a :class:`~strata.packer.quants.QuantType`;
    raises the registry's error for an unknown one."""
    if isinstance(v, QuantType):
        return v.id
    if isinstance(v, str):
        return quants.by_name(v).id
    return quants.qtype(int(v)).id


#: Types gguf-py 0.19.0 can quantize (the ``gguf/quants.py`` classes with ``quantize_blocks``): their blocks
#: come from real quantization of normal values, so scales and payload are consistent.
GGUF_QUANTIZABLE = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"})

#: Largest |value| / d a block can decode to for ANY payload bits (d = fp16 super-scale), from the
#: dequantization formulas (ggml-quants.c ``dequantize_row_*``, mirrored in gguf-py ``gguf/quants.py``):
#: e.g. Q6_K 128*32 (int8 sub-scale times 6-bit quant minus 32), IQ4_XS 32*127 (6-bit scale minus 32 times
#: kvalues_iq4nl), IQ2_XXS (0.5+15)*0.25*43 (4-bit scale, grid value <= 43). Second number: the same for
#: dmin / m.
_SPAN: dict[str, tuple[float, float]] = {
    "Q8_1": (128.0, 0.0),  # s is a sum field, not a scale
    "Q2_K": (15 * 3, 15),
    "Q3_K": (32 * 4, 0),
    "Q4_K": (63 * 15, 63),
    "Q5_K": (63 * 31, 63),
    "Q6_K": (128 * 32, 0),
    "IQ2_XXS": (15.5 * 0.25 * 43, 0),
    "IQ2_XS": (15.5 * 0.25 * 43, 0),
    "IQ2_S": (15.5 * 0.25 * 43, 0),
    "IQ3_XXS": (15.5 * 0.5 * 62, 0),
    "IQ3_S": (31 * 15, 0),
    "IQ1_S": (15 * 1.125, 0),
    "IQ1_M": (15 * 1.125, 0),
    "IQ4_NL": (127, 0),
    "IQ4_XS": (32 * 127, 0),
    "Q1_0": (1, 0),
    "Q2_0": (2, 0),
    "Q8_K": (128, 0),
}
#: Target bounds on decoded values: |x| <= _MAX_ABS from d, + _MAX_ABS_MIN from dmin.
_MAX_ABS = 0.2
_MAX_ABS_MIN = 0.05
_MAX_D = 0.02  # keeps 1- and 2-bit types (Q1_0, Q2_0, IQ1_*) at O(0.02-0.05) too


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


#: Types :func:`encode_floats` writes from given values: the float types and those gguf-py quantizes.
FLOAT_ENCODABLE = frozenset({"F32", "F16", "F64", "BF16"}) | GGUF_QUANTIZABLE


def encode_floats(type_id: int | str, x: np.ndarray) -> np.ndarray:
    """The bytes of the f32 values ``x`` (any shape, read in C order; its size a multiple of the type's
    block size) stored as ggml type ``type_id``: F32 / F16 / F64 cast, BF16 rounded to nearest even like
    ``ggml_compute_fp32_to_bf16`` (finite values: no NaN case; the same bits as ``gguf.quants.quantize(x,
    BF16)``, ~50x faster), the types of :data:`GGUF_QUANTIZABLE` by ``gguf.quants.quantize``. Returns a 1-D
    ``uint8`` array of whole blocks.

    Raises:
        ValueError: a type outside :data:`FLOAT_ENCODABLE` (K-quants, IQ types: gguf-py 0.19.0 has no quantizer).
        quants.ShapeError: a size that is not a multiple of the block size.
    """
    t = quants.by_name(type_id) if isinstance(type_id, str) else quants.qtype(int(type_id))
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.size % t.block_elems:
        raise quants.ShapeError(f"{t.name}: {x.size} values is not a multiple of the block size {t.block_elems}")
    if t.name in ("F32", "F16", "F64"):
        return x.astype({"F32": "<f4", "F16": "<f2", "F64": "<f8"}[t.name]).view(np.uint8)
    if t.name == "BF16":
        bits = x.view(np.uint32)
        return (
            ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
            .astype("<u2")
            .view(np.uint8)
        )
    if t.name in GGUF_QUANTIZABLE:
        out = gguf.quants.quantize(x.reshape(-1, t.block_elems), GGMLQuantizationType(t.id))
        return np.ascontiguousarray(out).view(np.uint8).reshape(-1)
    raise ValueError(f"encode_floats: no encoder for {t.name} (id {t.id}); types: {', '.join(sorted(FLOAT_ENCODABLE))}")


def make_random_blocks(
    type_id: int | str, n_elements: int, rng: np.random.Generator, *, std: float = 0.02
) -> np.ndarray:
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
    if t.name in FLOAT_ENCODABLE:
        return encode_floats(t.id, rng.standard_normal(n, dtype=np.float32) * std)
    if t.name in ("I8", "I16", "I32", "I64"):
        dt = {"I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}[t.name]
        return rng.integers(-100, 100, size=n).astype(dt).view(np.uint8)

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
        blocks[:, 0:4] = np.uint8(2 << 3) | rng.integers(0, 3, size=(n_blocks, 4), dtype=np.uint8)
    else:
        offs = t.fp16_scale_offsets
        if not offs:  # a registry type added later without a rule here
            raise ValueError(f"make_random_blocks has no rule for {t.name} (id {t.id}): no fp16 scale field to set")
        blocks[:, offs[0] : offs[0] + 2] = _f16_bytes(d)
        for o in offs[1:]:
            if span_min:  # dmin of Q2_K / Q4_K / Q5_K
                m_hi = _MAX_ABS_MIN / span_min
                blocks[:, o : o + 2] = _f16_bytes(rng.uniform(0.5 * m_hi, m_hi, size=n_blocks))
            else:  # Q8_1's s = d * sum(qs): keep it consistent with the payload
                qs = blocks[:, 4:].view(np.int8).astype(np.float32)
                blocks[:, o : o + 2] = _f16_bytes(d.astype(np.float32) * qs.sum(axis=1))
    return blocks.reshape(-1)


def _pattern(
    type_id: int, ne: Sequence[int], rng: np.random.Generator, pattern_bytes: int, std: float = 0.02
) -> tuple[np.ndarray, int]:
    """(the tile of whole random blocks, the tensor's bytes) of :func:`pattern_fill`."""
    t = quants.qtype(type_id)
    nbytes = quants.tensor_nbytes(type_id, ne)
    n_blocks = nbytes // t.block_bytes
    k = max(1, min(n_blocks, pattern_bytes // t.block_bytes))
    return make_random_blocks(type_id, k * t.block_elems, rng, std=std), nbytes


def pattern_fill(
    type_id: int, ne: Sequence[int], rng: np.random.Generator, pattern_bytes: int = 1 << 16, *, std: float = 0.02
) -> np.ndarray:
    """Bytes of a whole tensor of type ``type_id`` and shape ``ne`` made by tiling ~``pattern_bytes``
    (64 KiB) of valid random blocks (:func:`make_random_blocks`, normal values of std ``std`` where the
    type is quantized from floats): GB-sized files in seconds."""
    pat, nbytes = _pattern(type_id, ne, rng, pattern_bytes, std)
    out = np.empty(nbytes, np.uint8)
    reps = nbytes // pat.size
    out[: reps * pat.size].reshape(reps, pat.size)[:] = pat  # broadcast copy, memcpy speed
    out[reps * pat.size :] = pat[: nbytes - reps * pat.size]
    return out


def pattern_chunks(
    type_id: int, ne: Sequence[int], rng: np.random.Generator, pattern_bytes: int = 1 << 16, chunk_bytes: int = 64 << 20
):
    """The bytes of :func:`pattern_fill` (same arguments, same bytes) as a sequence of ``uint8`` arrays
    of at most ~``chunk_bytes`` each, so a writer never holds a whole tensor (a 471 MB expert tensor of
    the reference model is written from one 64 MiB buffer). Yields views of one reused buffer:
    write each before asking for the next."""
    pat, nbytes = _pattern(type_id, ne, rng, pattern_bytes)
    per = max(1, chunk_bytes // pat.size)
    buf = np.empty(per * pat.size, np.uint8)
    buf.reshape(per, pat.size)[:] = pat
    left = nbytes
    while left >= buf.size:
        yield buf
        left -= buf.size
    full = left // pat.size * pat.size
    if full:
        yield buf[:full]
    if left - full:
        yield pat[: left - full]


def role_values(role: str, n: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray | None:
    """f32 values of a tensor that is not a weight matrix, by its fill role (``norm``: near 1, as converters
    store RMS-norm weights +1; ``ssm_a``: negative, it stores -exp(A_log); ``conv``: the conv kernel;
    ``vec`` / ``bias`` / ``ssm_dt``: small values), drawn from ``rng``; None for other roles (weights:
    random blocks). The one rule of :func:`strata.testing.models.write_model` and
    :func:`strata.testing.reference_model.write_reference_model`."""
    if role == "norm":
        return 1.0 + 0.01 * rng.standard_normal(n, dtype=np.float32)
    if role == "ssm_a":
        return -rng.uniform(0.5, 4.0, size=n).astype(np.float32)
    if role == "conv":
        return 0.1 * rng.standard_normal(n, dtype=np.float32)
    if role in ("bias", "ssm_dt", "vec"):
        return std * rng.standard_normal(n, dtype=np.float32)
    return None
