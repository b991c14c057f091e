"""Small synthetic models of the four architectures strata knows, written with ``gguf.GGUFWriter``.

:class:`ModelSpec` (with :class:`ModelDims` and per-layer :class:`ExpertTypes`) describes a model of
``qwen3moe``, ``qwen3next``, ``qwen2`` or ``gemma3``; :func:`plan_tensors` lists its tensors (names
and shapes from llama.cpp's loaders, ``src/models/{qwen3moe,qwen3next,qwen2,gemma3}.cpp``; FORMATS.md
section 4), :func:`model_kv` its metadata, and :func:`write_model` writes it: per-layer expert types,
optional fused gate/up experts, llama-gguf-split style shards (:func:`shard_names`). Tensor data comes
from :mod:`.blocks`, one random stream per tensor, so the same spec and seed give byte-identical
files. The presets (:func:`qwen3moe_spec` ...) are loaded and run by llama.cpp (llama-cpp-python
0.3.36); :func:`big_dense_spec` / :func:`write_big_dense` make GB-sized dense files for copy
benchmarks.

Shapes are always ggml ``ne`` order (``ne[0]`` = row length, fastest). Sizes are bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from strata.packer import quants

from .blocks import make_random_blocks, pattern_fill, tensor_rng, to_type_id
from .tokenizer import synth_tokenizer, tokenizer_kv

__all__ = [
    "ARCHS", "DENSE_TYPES", "MOE_ARCHS", "ExpertTypes", "ModelDims", "ModelSpec", "PlannedTensor", "TypeId",
    "big_dense_spec", "gemma3_spec", "model_kv", "plan_tensors", "qwen2_spec", "qwen3moe_spec", "qwen3next_spec",
    "shard_names", "write_big_dense", "write_model",
]


ARCHS = ("qwen3moe", "qwen3next", "qwen2", "gemma3")
MOE_ARCHS = ("qwen3moe", "qwen3next")

#: Types intended for dense (non-expert) weights: ne0 only needs to be a multiple of 32.
DENSE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0")


#: A ggml type id field that also accepts a type name or a QuantType (:func:`.blocks.to_type_id`).
TypeId = Annotated[int, BeforeValidator(to_type_id)]


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
    kv += tokenizer_kv(synth_tokenizer(d.n_vocab), add_bos=(a == "gemma3"))
    return kv


def _tensor_data(spec: ModelSpec, t: PlannedTensor) -> np.ndarray:
    rng = tensor_rng(spec.seed, t.name)
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
        return pattern_fill(t.type_id, t.ne, rng)
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
