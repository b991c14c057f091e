"""Numerics modes of the forward pass: exact f32 (the default), or llama.cpp's CPU arithmetic.

The weights are always dequantized exactly (``gguf.quants``); what differs is what happens to
the *activations*. llama.cpp's CPU backend (the reference engine of the fixtures, llama-cpp-python
0.3.36 with its defaults: F16 KV cache, flash attention off) rounds them in four places, listed
below. Measured with llama.cpp's eval callback on Gemma 3 270M: with all four emulated, a
one-token forward pass through all 18 layers agrees with llama.cpp to 2e-5 in the logits (without
them: 3.6), and layer 0 of a 6-token prompt to 1e-7 relative. Beyond that the agreement stops
improving: a 1e-6 difference in a sum (SIMD order) moves an activation across a Q8 rounding
boundary, which costs ~1/254 of that block's range, and Gemma amplifies it through the layers.
Over the 72 teacher-forced steps of the committed fixtures both modes land at the same level
(Gemma: mean |d logit| 0.20 both, max 1.19 f32 / 0.95 llamacpp; Qwen2.5 0.5B: mean 0.057 / 0.060),
so the reference path stays exact f32, and ``"llamacpp"`` is kept as the executable definition of
llama.cpp's activation quantizers - the canonical form a GPU kernel that quantizes activations
must reproduce for CPU and GPU to agree (the hit path is all or nothing: an expert computed on
the GPU must give what the CPU path would have).

1. **Activation quantization inside quantized matmuls** (``ggml-cpu.c`` ``type_traits_cpu[].vec_dot_type``,
   recorded per weight type in the registry row: ``strata.packer.quants.QuantType.act_format``):
   weights of Q4_0/Q5_0/Q8_0/IQ4_NL/Q1_0/Q2_0/MXFP4/NVFP4 meet activations quantized to **Q8_0**
   (blocks of 32: ``amax``; ``d = fp16(amax / 127)``; ``q = round_half_even(x * (127 / amax))``,
   the AVX2 ``quantize_row_q8_0`` of ``ggml-cpu/arch/x86/quants.c``); Q4_1/Q5_1 meet Q8_1 (same
   values; its fp16 sum field is not modelled); K-quants, IQ2/IQ3/IQ1/IQ4_XS and TQ1_0/TQ2_0 meet **Q8_K**
   (blocks of 256: ``max`` = the element of largest magnitude, first on ties; ``iscale = -127 / max``;
   ``q = min(127, round_half_even(iscale * x))``; ``d = 1 / iscale`` in f32,
   ``quantize_row_q8_K_ref`` in ``ggml-quants.c``); F16 weights meet f16 activations, BF16 weights
   bf16 ones, F32 weights f32. Emulated here as ``x -> d * q`` followed by the same f32 GEMV: the
   integer dot products of llama.cpp then differ only by float summation order (~1e-7 relative).
   The CPU's ``q8`` kernels (:mod:`strata.engine.cpu.kernels`, engine/cpu/cpu_q8.c; the CPU engine's default
   kernel) compute with exactly these values - ``quantize_q8_0`` / ``quantize_q8_K`` below are their
   definition, and tests/test_engine_cpu_q8.py checks both against ggml's own quantize_row_q8_0 /
   quantize_row_q8_K bit for bit - as integer block dots, like llama.cpp; where they run, the
   activation is quantized by the kernel (in every mode), and the functions here serve the
   products they do not cover (other types, the ``exact`` and ``f32`` kernels, the GPU).
2. **F16 KV cache** (llama.cpp's default ``type_k = type_v = f16``): K and V rounded to f16 when stored.
   Not part of a numerics mode: the KV cache type is the engine's own option (``--kv f16|f32``,
   default f16 in both modes, :class:`strata.engine.layers.KVCache`), because it is also a
   memory term the budget charges (``strata-budget check --kv``).
3. **Attention in f16 operands** (``build_attn_mha`` without flash attention: ``mul_mat(k, q)`` with
   an F16 ``k`` converts ``q`` to f16; ``mul_mat(v, kq)`` with an F16 ``v`` converts the softmax
   probabilities to f16; both accumulate in f32).
4. **GELU through an fp16 table** (``vec.h`` ``GGML_GELU_FP16``: ``y = table[fp16(x)]`` for
   ``-10 < x < 10``, ``0`` below, ``x`` above; the table holds ``fp16(gelu_tanh(f))``).

``"f32"`` (the default) turns 1, 3 and 4 off: exact f32 math over what the cache holds - except, on the
CPU with its default ``q8`` kernels, item 1 inside the products of the types those kernels cover (the
engine option ``cpu_kernel="f32"`` or ``"exact"`` keeps those in f32 too).

Everything here is written against an array module ``xp`` so the GPU path can use the same
definitions (GPU and CPU paths must agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.packer import quants


def activation_format(weight_type: int) -> str:
    """``"q8_0"``, ``"q8_K"``, ``"f16"``, ``"bf16"`` or ``"f32"``: what a weight of ``weight_type``
    multiplies in llama.cpp's CPU backend - the registry row's ``act_format``
    (:attr:`strata.packer.quants.QuantType.act_format`; Q8_1 is reported as ``"q8_0"``:
    identical values). ``"f32"`` for an id the registry does not know."""
    t = quants.QTYPES.get(weight_type)
    return t.act_format if t is not None else "f32"


def quantize_q8_0(xp, x):
    """``x`` (f32, length a multiple of 32) as llama.cpp's AVX2 Q8_0 quantizer leaves it: ``fp16(d) * q``."""
    b = x.reshape(-1, 32)
    amax = xp.abs(b).max(axis=1, keepdims=True)
    nz = amax != 0
    safe = xp.where(nz, amax, xp.float32(1.0))
    inv = xp.where(nz, xp.float32(127.0) / safe, xp.float32(0.0))
    q = xp.rint(b * inv)  # _mm256_round_ps(NEAREST): half to even, like rint
    d = (amax / xp.float32(127.0)).astype(xp.float16).astype(xp.float32)
    return (d * q).reshape(x.shape)


def quantize_q8_K(xp, x):
    """``x`` (f32, length a multiple of 256) as ``quantize_row_q8_K_ref`` leaves it: ``d * q``."""
    b = x.reshape(-1, 256)
    i = xp.abs(b).argmax(axis=1)
    mx = xp.take_along_axis(b, i[:, None], axis=1)
    nz = mx != 0
    iscale = xp.where(nz, xp.float32(-127.0) / xp.where(nz, mx, xp.float32(1.0)), xp.float32(0.0))
    # nearest_int() adds 1.5 * 2^23: round half to even, like rint
    q = xp.minimum(xp.float32(127.0), xp.rint(iscale * b))
    d = xp.where(nz, xp.float32(1.0) / xp.where(nz, iscale, xp.float32(1.0)), xp.float32(0.0))
    return (d * q).reshape(x.shape)


def _to_bf16(xp, x):
    u = x.astype(xp.float32).view(xp.uint32)
    r = (u + xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1))) & xp.uint32(0xFFFF0000)
    return r.view(xp.float32)


def quantize_activation(xp, x, weight_type: int):
    """The activation a weight of ``weight_type`` actually meets in llama.cpp's CPU backend (f32 array)."""
    fmt = activation_format(weight_type)
    if fmt == "q8_0" and x.shape[-1] % 32 == 0:
        return quantize_q8_0(xp, x)
    if fmt == "q8_K" and x.shape[-1] % 256 == 0:
        return quantize_q8_K(xp, x)
    if fmt == "f16":
        return x.astype(xp.float16).astype(xp.float32)
    if fmt == "bf16":
        return _to_bf16(xp, x)
    return x


def f16_round(xp, x):
    return x.astype(xp.float16).astype(xp.float32)


@dataclass(frozen=True)
class Numerics:
    """Which of llama.cpp's activation roundings the forward pass reproduces (module docstring)."""

    name: str
    act_quant: bool
    attn_f16: bool
    gelu_f16_table: bool


#: The numerics modes by name (``strata-engine generate --numerics``).
NUMERICS_MODES: dict[str, Numerics] = {
    "llamacpp": Numerics("llamacpp", act_quant=True, attn_f16=True, gelu_f16_table=True),
    "f32": Numerics("f32", act_quant=False, attn_f16=False, gelu_f16_table=False),
}
DEFAULT_NUMERICS = "f32"


def numerics(name: str | Numerics) -> Numerics:
    """A numerics mode by name (:data:`NUMERICS_MODES`). Raises ValueError naming the known ones."""
    if isinstance(name, Numerics):
        return name
    try:
        return NUMERICS_MODES[name]
    except KeyError:
        raise ValueError(f"unknown numerics mode {name!r}; known: {', '.join(sorted(NUMERICS_MODES))}") from None
