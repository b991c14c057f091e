"""Small synthetic models of every architecture strata has a contract for, written with ``gguf.GGUFWriter``.

:class:`ModelSpec` (with :class:`ModelDims` and per-layer :class:`ExpertTypes`) describes a model of any
architecture with a manifest (``manifests/<arch>.toml``); :func:`plan_tensors` lists its tensors (names
and shapes from the manifest, i.e. from llama.cpp's loaders, ``src/models/<arch>.cpp``; docs/FORMAT.md),
:func:`model_kv` its metadata, and :func:`write_model` writes it: per-layer expert types, optional fused
gate/up experts, llama-gguf-split style shards (:func:`shard_names`). Tensor data comes from :mod:`.blocks`,
one random stream per tensor, so the same spec and seed give byte-identical files. The presets
(:func:`strata.testing.presets.qwen3moe_spec` ...) live in :mod:`.presets`.

Shapes are always ggml ``ne`` order (``ne[0]`` = row length, fastest). Sizes are bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from strata.packer import quants

from .blocks import make_random_blocks, pattern_fill, role_values, tensor_rng, to_type_id
from .routing import TokenRouting, routing_tensor_data
from .tokenizer import synth_tokenizer, tokenizer_kv

__all__ = [
    "ARCHS",
    "DENSE_TYPES",
    "MOE_ARCHS",
    "ExpertTypes",
    "ModelDims",
    "ModelSpec",
    "PlannedTensor",
    "TypeId",
    "fill_role",
    "kv_entry",
    "model_kv",
    "moe_layers",
    "partition",
    "plan_tensors",
    "shard_names",
    "spec_geometry",
    "tensor_data",
    "write_model",
]


def is_moe(arch: str) -> bool:
    """True when ``arch``'s contract can have routed experts (llama only when expert_count > 0:
    :func:`moe_layers` says it for one spec)."""
    from strata.manifests.contract import load_manifest

    return any(t.expert for t in load_manifest(arch).tensors)


#: The presets' architectures (one preset per contract, :mod:`.presets`), and those whose contract can
#: have routed experts.
ARCHS = ("qwen3moe", "qwen3next", "qwen2", "gemma3", "llama", "qwen3", "qwen2moe", "deepseek2", "gpt-oss")
MOE_ARCHS = tuple(a for a in ARCHS if is_moe(a))

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
    qwen3next / qwen2moe shared expert width ``n_ff_shexp``; deepseek2 ``n_expert_shared`` (shared
    experts of ``n_ff_exp`` each), ``n_layer_dense_lead``, ``kv_lora_rank``, ``q_lora_rank``. qwen3next
    gated delta net: ``ssm_d_state`` (head k/v dim), ``ssm_n_group`` (k heads), ``ssm_dt_rank`` (v
    heads), ``ssm_d_conv``; layer il is full attention iff ``(il + 1) % full_attention_interval == 0``.
    gemma3: ``sliding_window`` and ``sliding_window_pattern`` (layer il is sliding iff ``il % pattern < pattern - 1``).
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
    n_expert_shared: int | None = None  # deepseek2 expert_shared_count (None: not written)
    n_layer_dense_lead: int | None = None  # deepseek2 leading_dense_block_count: dense FFN layers first
    kv_lora_rank: int | None = None  # deepseek2 MLA latent width (attention.kv_lora_rank)
    q_lora_rank: int | None = None  # deepseek2 query low-rank width (None: attn_q directly, as V2-Lite)
    ssm_d_conv: int = 4
    ssm_d_state: int = 64
    ssm_n_group: int = 2
    ssm_dt_rank: int = 4
    full_attention_interval: int = 4
    sliding_window: int = 128
    sliding_window_pattern: int = 2
    rope_freq_base: float = 1e6
    rms_eps: float = 1e-6
    rope_dim: int | None = None  # rotated dims per head (rope.dimension_count); None: not written

    def _delta_width(self, name: str) -> int:
        """A qwen3next delta-net width from its manifest's ``[derived]`` (manifests/qwen3next.toml: the one
        definition), at these dims."""
        from strata.manifests.contract import derived_value

        params = {"d_state": self.ssm_d_state, "n_group": self.ssm_n_group, "dt_rank": self.ssm_dt_rank}
        return int(derived_value("qwen3next", name, params))

    @property
    def ssm_d_inner(self) -> int:
        """Delta-net value dim, the manifest's ``value_dim`` (``d_state * dt_rank``), written as key
        ``ssm.inner_size``."""
        return self._delta_width("value_dim")

    @property
    def ssm_key_dim(self) -> int:
        """The manifest's ``key_dim`` (``d_state * n_group``)."""
        return self._delta_width("key_dim")

    @property
    def ssm_conv_dim(self) -> int:
        """Conv channels, the manifest's ``conv_dim`` (``2 * key_dim + value_dim`` = ne1 of attn_qkv and
        ssm_conv1d)."""
        return self._delta_width("conv_dim")


class ModelSpec(BaseModel):
    """Everything :func:`write_model` needs; the same spec and seed give byte-identical files.

    Attributes:
        arch: an architecture with a contract (``manifests/<arch>.toml``): names, shapes and metadata
            keys all come from it.
        name: ``general.name``.
        dims: :class:`ModelDims`.
        n_layers: ``block_count``.
        seed: root of every tensor's random stream (per tensor: seed + crc32(name)).
        expert_types: one :class:`ExpertTypes` (or ``(gate_up, down)`` pair) per layer when the geometry
            has routed experts (None for a layer without them, e.g. deepseek2's leading dense layers).
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
        choices: ``[[choices]]`` group name -> option index written (default: the first option).
        optional_tensors: roles of optional tensors to write (e.g. ``"attn_q.bias"``); other optional
            tensors are left out (the output head follows ``tied_output``).
        params: manifest param name -> value, over :data:`PARAM_VALUES` (e.g. ``rope_dim``).
        extra_kv: more metadata, GGUF key (relative to ``<arch>.``, or absolute with a leading ``/``, the
            manifests' convention) -> value, typed by :func:`kv_entry`; replaces a key the params write
            (e.g. ``{"attention.head_count": [4, 4]}``, ``{"rope.scaling.type": "yarn"}``).
        add_bos: ``tokenizer.ggml.add_bos_token`` (gemma3's preset: true).
        routing: None (the default: bytes as before), or a :class:`~.routing.TokenRouting`: routers drawn
            row by row with a stated skew and, under ``fill="pattern"``, distinct token_embd / output rows,
            so the experts chosen depend on the token (:mod:`.routing`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    arch: str
    name: str = "strata-synth"
    dims: ModelDims = Field(default_factory=ModelDims)
    n_layers: int = 2
    seed: int = 0
    expert_types: list[Annotated[ExpertTypes | None, BeforeValidator(_to_expert_types)]] = Field(default_factory=list)
    dense_type: TypeId = 8
    tensor_types: dict[str, TypeId] = Field(default_factory=dict)
    fused_gate_up: bool = False
    tied_output: bool = False
    n_shards: int = 1
    empty_first_shard: bool = False
    fill: Literal["random", "pattern"] = "random"
    weight_std: float = 0.02
    choices: dict[str, int] = Field(default_factory=dict)
    optional_tensors: tuple[str, ...] = ()
    params: dict[str, Any] = Field(default_factory=dict)
    extra_kv: dict[str, Any] = Field(default_factory=dict)
    add_bos: bool = False
    routing: TokenRouting | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        from strata.manifests.contract import known_archs

        d = self.dims
        if self.arch not in known_archs():
            raise ValueError(f"arch {self.arch!r} has no contract; known: {', '.join(known_archs())}")
        if self.n_layers < 1:
            raise ValueError(f"n_layers={self.n_layers} < 1")
        moe = moe_layers(self)
        if moe:
            if len(self.expert_types) != self.n_layers:
                raise ValueError(
                    f"{self.arch}: expert_types has {len(self.expert_types)} entries for {self.n_layers} layers"
                )
            if missing := [il for il in moe if self.expert_types[il] is None]:
                raise ValueError(f"{self.arch}: layers {missing} have routed experts, expert_types has None there")
            if not 0 < d.n_expert_used <= d.n_expert:
                raise ValueError(f"n_expert_used={d.n_expert_used} must be in 1..n_expert={d.n_expert}")
        elif any(e is not None for e in self.expert_types):
            raise ValueError(f"this {self.arch} geometry is dense: expert_types must be empty")
        if self.fused_gate_up and not any(ch.name == "gate_up_exps" for ch in _manifest(self).choices):
            raise ValueError(f"fused_gate_up: the {self.arch} contract has no fused ffn_gate_up_exps option")
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


#: How a manifest param (``manifests/<arch>.toml`` ``[params]``) gets its value from a spec: the one
#: table between the synthetic model's dimensions and the contracts' params. A param whose value is
#: None (or that is not listed) is not written; the manifest's default then applies.
PARAM_VALUES: dict[str, Any] = {
    "n_embd": lambda s: s.dims.n_embd,
    "n_layer": lambda s: s.n_layers,
    "n_ctx_train": lambda s: s.dims.context_length,
    "n_ff": lambda s: s.dims.n_ff,
    "n_head": lambda s: s.dims.n_head,
    "n_head_kv": lambda s: s.dims.n_head_kv,
    "head_dim": lambda s: s.dims.head_dim,
    "head_dim_v": lambda s: s.dims.head_dim,
    "rope_base": lambda s: s.dims.rope_freq_base,
    "rms_eps": lambda s: s.dims.rms_eps,
    "n_expert": lambda s: s.dims.n_expert,
    "n_expert_used": lambda s: s.dims.n_expert_used,
    "n_ff_exp": lambda s: s.dims.n_ff_exp,
    "n_ff_shexp": lambda s: s.dims.n_ff_shexp,
    "d_conv": lambda s: s.dims.ssm_d_conv,
    "d_state": lambda s: s.dims.ssm_d_state,
    "n_group": lambda s: s.dims.ssm_n_group,
    "dt_rank": lambda s: s.dims.ssm_dt_rank,
    "d_inner": lambda s: s.dims.ssm_d_inner,
    "full_attention_interval": lambda s: s.dims.full_attention_interval,
    "rope_dim": lambda s: s.dims.rope_dim,
    "sliding_window": lambda s: s.dims.sliding_window,
    "swa_pattern": lambda s: s.dims.sliding_window_pattern,
    "rope_base_swa": lambda s: 10000.0,
    "n_expert_shared": lambda s: s.dims.n_expert_shared,
    "n_layer_dense_lead": lambda s: s.dims.n_layer_dense_lead,
    "kv_lora_rank": lambda s: s.dims.kv_lora_rank,
    "q_lora_rank": lambda s: s.dims.q_lora_rank,
}


def _manifest(spec: ModelSpec):
    from strata.manifests.contract import load_manifest

    return load_manifest(spec.arch)


def _param_kv(spec: ModelSpec) -> list[tuple[str, int, Any, int | None]]:
    """The architecture's metadata keys, from its manifest's ``[params]`` (key, GGUF value type, value):
    counts u32, floats f32 (llama.cpp reads them with those types); ``spec.params`` overrides."""
    V = GGUFValueType
    out = []
    for name, p in _manifest(spec).params.items():
        if p.array_len or p.key.startswith("/"):
            continue  # the vocabulary size: the tokenizer's arrays say it
        fn = PARAM_VALUES.get(name)
        v = spec.params.get(name, fn(spec) if fn else None)
        if v is None:
            continue
        key = f"{spec.arch}.{p.key}"
        if p.kind == "float":
            out.append((key, V.FLOAT32, float(v), None))
        elif p.kind == "bool":
            out.append((key, V.BOOL, bool(v), None))
        elif p.kind == "str":
            out.append((key, V.STRING, str(v), None))
        elif isinstance(v, (list, tuple)):
            sub = V.BOOL if p.kind == "bool_array" else V.UINT32
            out.append((key, V.ARRAY, [bool(x) if p.kind == "bool_array" else int(x) for x in v], sub))
        else:
            out.append((key, V.UINT32, int(v), None))
    return out


def kv_entry(key: str, value: Any) -> tuple[str, int, Any, int | None]:
    """One metadata entry ``(key, GGUFValueType, value, array sub_type)`` typed by its Python value: str
    STRING, bool BOOL, float FLOAT32, int UINT32 (INT32 when negative), a list of bools / ints / floats a
    BOOL / UINT32 / FLOAT32 array (llama.cpp reads counts as u32, floats as f32); ``(GGUFValueType.X, value)``: that
    scalar type (tests of the type refusals: :func:`strata.manifests.keys.key_type_refusals`).

    Raises:
        ValueError: a value of another type, or an empty or mixed list.
    """
    V = GGUFValueType
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], GGUFValueType):
        return key, value[0], value[1], None  # a scalar of a forced type: (GGUFValueType.INT32, 48)

    def scalar(v):
        if isinstance(v, bool):
            return V.BOOL
        if isinstance(v, int):
            return V.INT32 if v < 0 else V.UINT32
        if isinstance(v, float):
            return V.FLOAT32
        if isinstance(v, str):
            return V.STRING
        raise ValueError(f"metadata {key}: value {v!r} of type {type(v).__name__}")

    if isinstance(value, (list, tuple)):
        subs = {scalar(x) for x in value}
        if len(subs) != 1:
            raise ValueError(f"metadata {key}: array {value!r} must be non-empty and of one element type")
        return key, V.ARRAY, list(value), subs.pop()
    return key, scalar(value), value, None


def _spec_kv(spec: ModelSpec) -> list[tuple[str, int, Any, int | None]]:
    """The params' keys (:func:`_param_kv`) with ``spec.extra_kv`` added, replacing keys of the same name."""
    extra = [kv_entry(k[1:] if k.startswith("/") else f"{spec.arch}.{k}", v) for k, v in spec.extra_kv.items()]
    names = {e[0] for e in extra}
    return [e for e in _param_kv(spec) if e[0] not in names] + extra


def spec_geometry(spec: ModelSpec, *, check: bool = False):
    """The spec's geometry through its architecture's manifest (what strata-pack build will resolve).
    Unchecked by default: tests write impossible geometries on purpose, to see them refused.

    Raises:
        ManifestError: with ``check``, dimensions the contract refuses (e.g. a GQA group that does not divide).
    """
    from strata.manifests.contract import geometry_from_metadata

    kv = {k: v for k, _t, v, sub in _spec_kv(spec) if sub is None}
    arrays = {k: v for k, _t, v, sub in _spec_kv(spec) if sub is not None}
    return geometry_from_metadata(spec.arch, kv, {"tokenizer.ggml.tokens": spec.dims.n_vocab}, arrays, check=check)


def moe_layers(spec: ModelSpec) -> list[int]:
    """The layers of ``spec`` whose geometry has routed experts (its contract's expert tensors there)."""
    return sorted({il for _n, ts, _ne, il in spec_geometry(spec).expected_tensors() if ts.expert and il is not None})


def fill_role(role: str, ne: tuple[int, ...], expert: bool) -> str:
    """How a tensor is filled, from its role: norms near 1 (converters store them +1), ``ssm_a`` < 0
    (it stores -exp(A_log)), the conv kernel, small vectors and biases of any rank, or random weight blocks."""
    if expert:
        return "expert"
    if role.endswith("norm.weight") or role == "rope_freqs.weight":
        return "norm"  # rope_freqs: per-frequency factors near 1 (llama.cpp divides each rope frequency by one)
    if role == "ssm_a":
        return "ssm_a"
    if role.startswith("ssm_conv1d"):
        return "conv"
    if len(ne) == 1 or role.endswith(".bias"):
        return "vec"
    return "dense"


def plan_tensors(spec: ModelSpec) -> list[PlannedTensor]:
    """The tensors :func:`write_model` writes for ``spec``, in file order, with types and ``ne``: the
    architecture's contract (``manifests/<arch>.toml``) resolved for the spec's dimensions
    (:func:`spec_geometry`), one option of every ``[[choices]]`` group (``spec.choices``, else the
    first; ``fused_gate_up`` picks the fused expert tensor), optional tensors left out except the
    output head (unless ``tied_output``) and ``spec.optional_tensors``. Order: token_embd, every layer's
    tensors, then the rest. Types: routed experts ``spec.expert_types[il]``, 1-D and conv tensors F32, a
    role whose contract allows only F32 F32 (gpt-oss's expert biases), the router F32 unless
    ``tensor_types`` says otherwise, every other weight ``tensor_types[base]`` or ``dense_type``.

    Raises:
        quants.ShapeError: a type whose block size does not divide ``ne[0]`` (naming the tensor).
        ManifestError: dimensions the contract refuses.
    """
    g = spec_geometry(spec)
    m = g.manifest
    pick = dict(spec.choices)
    if spec.fused_gate_up:
        pick["gate_up_exps"] = 1
    keep_roles: set[str] = set()
    for ch in m.choices:
        i = pick.get(ch.name, 0)
        if not 0 <= i < len(ch.options):
            raise ValueError(f"choice {ch.name}: option {i} of {len(ch.options)}")
        keep_roles.update(ch.options[i])
    in_choice = {r for ch in m.choices for opt in ch.options for r in opt}
    first, layers, last = [], [], []
    for name, ts, ne, il in g.expected_tensors():
        if ts.role in in_choice and ts.role not in keep_roles:
            continue
        wanted = ts.role in spec.optional_tensors or (ts.role == "output.weight" and not spec.tied_output)
        if ts.optional and not wanted:
            continue
        if ts.role == "ssm_conv1d.weight" or len(ne) == 1 or ts.types == ["F32"]:
            type_id = 0  # norms, biases and the conv kernel stay F32 (llama.cpp norms / ssm_conv need F32)
        elif ts.expert is not None:
            et = spec.expert_types[il]
            type_id = et.down if ts.expert == "down" else et.gate_up
        else:
            base = ts.role[: -len(".weight")] if ts.role.endswith(".weight") else ts.role
            type_id = spec.tensor_types.get(base, 0 if base == "ffn_gate_inp" else spec.dense_type)
        t = PlannedTensor(name, int(type_id), tuple(int(x) for x in ne), fill_role(ts.role, ne, ts.expert is not None))
        _ = t.nbytes  # validate block divisibility now, with the tensor's name in the message
        (first if name == "token_embd.weight" else layers if il is not None else last).append((il, t))
    layers.sort(key=lambda x: x[0])  # stable: manifest order within a layer
    return [t for _, t in first + layers + last]


def model_kv(spec: ModelSpec) -> list[tuple[str, int, Any, int | None]]:
    """The KV pairs of ``spec`` except ``general.architecture``, as ``(key, GGUFValueType, value,
    array sub_type)``: ``general.name``, ``general.quantization_version``, every param of the
    architecture's manifest with a value (:data:`PARAM_VALUES`, :func:`_param_kv`), ``spec.extra_kv``
    (:func:`kv_entry`), and the synthetic tokenizer's keys (its arrays with explicit element types: gguf
    infers INT32 for int lists)."""
    V = GGUFValueType
    own = _spec_kv(spec)
    names = {e[0] for e in own}
    kv = [
        e
        for e in (("general.name", V.STRING, spec.name, None), ("general.quantization_version", V.UINT32, 2, None))
        if e[0] not in names
    ] + own
    kv += tokenizer_kv(synth_tokenizer(spec.dims.n_vocab), add_bos=spec.add_bos)
    return kv


def tensor_data(spec: ModelSpec, t: PlannedTensor) -> np.ndarray:
    """The bytes :func:`write_model` writes for tensor ``t`` of ``spec`` (``uint8``, ``t.nbytes``), from the
    tensor's own stream (:func:`.blocks.tensor_rng`): by fill role, :class:`~.routing.TokenRouting`, then
    ``spec.fill``."""
    rng = tensor_rng(spec.seed, t.name)
    n = math.prod(t.ne)
    # norm weights are stored with the +1 already applied (gemma3, qwen3next converters); ssm_a < 0
    x = role_values(t.role, n, rng, spec.weight_std)
    if x is None:
        if spec.routing is not None:
            data = routing_tensor_data(spec.routing, t.name, t.type_id, t.ne, rng, spec.weight_std, spec.fill)
            if data is not None:
                return data
        if spec.fill == "pattern":
            return pattern_fill(t.type_id, t.ne, rng)
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


def partition(n: int, n_shards: int, empty_first: bool) -> list[range]:
    """``n`` tensors (in order) over ``n_shards`` files by count, llama-gguf-split style: ranges of tensor indices per
    shard; ``empty_first``: the first shard holds none (``--no-tensor-first-split``).

    Raises:
        ValueError: fewer tensors than non-empty shards.
    """
    k = n_shards - 1 if empty_first else n_shards
    if n < k:
        raise ValueError(f"{n} tensors cannot fill {k} non-empty shards")
    bounds = [round(i * n / k) for i in range(k + 1)]
    parts = [range(bounds[i], bounds[i + 1]) for i in range(k)]
    return ([range(0)] if empty_first else []) + parts


def write_model(
    path: str | Path, spec: ModelSpec, tokenizer: list[tuple[str, int, Any, int | None]] | None = None
) -> list[Path]:
    """Write the synthetic model ``spec`` with ``gguf.GGUFWriter``; returns the files written.

    One file at ``path``, or ``spec.n_shards`` files named by :func:`shard_names` laid out like
    llama-gguf-split (docs/FORMAT.md "Split shards"): every shard is a complete GGUF whose tensor offsets
    restart at 0; shard 0 carries all KVs plus ``split.no`` (u16), ``split.count`` (u16),
    ``split.tensors.count`` (i32); later shards carry only those three keys. Tensors are spread
    over the (non-empty) shards in order, by count. Data alignment 32 (no ``general.alignment`` key).
    Tensor data is generated and written one tensor at a time (memory ~ the largest tensor).
    ``tokenizer``: ``tokenizer.*`` KVs written instead of the synthetic tokenizer's (e.g.
    :func:`strata.testing.tokenizer.tokenizer_case_kv`; ``spec.dims.n_vocab`` must be its token count).
    """
    path = Path(path)
    plan = plan_tensors(spec)
    w = gguf.GGUFWriter(path, spec.arch)
    kvs = model_kv(spec)
    if tokenizer is not None:
        kvs = [kv for kv in kvs if not kv[0].startswith("tokenizer.")] + list(tokenizer)
    for key, vtype, value, sub in kvs:
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
        w.tensors = [
            {names[i]: infos[names[i]] for i in r} for r in partition(len(names), spec.n_shards, spec.empty_first_shard)
        ]
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in plan:
        w.write_tensor_data(tensor_data(spec, t))
    w.close()
    return shard_names(path, spec.n_shards)
