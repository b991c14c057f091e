"""Geometry contracts: one TOML file per architecture in ``manifests/``, validated with pydantic.

A manifest says, for one architecture:

- ``extends``: the shared parts it builds on (``manifests/bases/<name>.toml``: ``decoder`` for what
  every decoder has, ``moe`` for routed experts); see :func:`merge_manifest` for the merge rules;
- ``[params]``: every number a kernel depends on and the GGUF metadata key it comes from
  (``key`` is relative to ``{arch}.`` unless it starts with ``/``), with an optional default
  expression; ``array_len = true`` takes an array's length (e.g. the vocab size from
  ``/tokenizer.ggml.tokens``);
- ``[derived]``: numbers computed from params, each defined exactly once (no second list);
- ``[layers] kind``: an expression of ``il`` (layer index) giving each layer's kind, e.g.
  ``'attention'`` / ``'recurrent'`` for qwen3next, ``'swa'`` / ``'global'`` for gemma3;
- ``[[tensors]]``: every tensor by its *role* (its GGUF name without the ``blk.N.`` prefix, checked
  against the one name table, :mod:`strata.manifests.names`), its shape as expressions in ggml ne
  order, the layer kinds it exists on, its allowed ggml types, and whether it is optional or one
  option of a ``[[choices]]`` group (e.g. fused ``attn_qkv`` vs ``attn_q/k/v``);
- ``[state]`` / ``[state_from_tensors]``: every budget term twice (:class:`StateSpec`);
- ``[keys]``: every GGUF metadata key llama.cpp's loader reads for the architecture, honoured (the
  param it feeds), refused (the values strata implements) or inert (why nothing depends on it):
  :mod:`strata.manifests.keys`.

Expressions are :mod:`strata.manifests.expr`'s safe subset of Python. Sources of every formula are
cited in the manifest files (llama.cpp file:line).
"""

from __future__ import annotations

import math
import tomllib
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .expr import ManifestError, evaluate, names_in, parse
from .keys import KeySpec, KeysRefusedError, collapse_per_layer, key_refusals
from .names import TensorNameError, is_per_layer, name_pattern, tensor_name

MANIFEST_DIR = Path(__file__).resolve().parent
#: Shared manifest parts (``extends = [...]``): not architectures.
BASES_DIR = MANIFEST_DIR / "bases"


# ----------------------------------------------------------------------- schema

#: Upper bound for any integer geometry number (layers, heads, widths, vocab, context): 2**31.
MAX_PARAM = 1 << 31
#: Upper bound for the layer count (before anything iterates over layers).
MAX_LAYERS = 4096


class ParamSpec(BaseModel):
    """Where one geometry number comes from in the GGUF metadata."""

    model_config = ConfigDict(extra="forbid")
    key: str
    kind: Literal["int", "float", "bool", "str", "int_array", "bool_array"] = "int"
    default: str | int | float | bool | None = None
    optional: bool = False
    array_len: bool = False
    min: int | float | None = None  # smallest allowed value; default 1 for int, > 0 and finite for float
    doc: str = ""

    def check(self, name: str, v: Any, where: str, key: str | None = None) -> None:
        """Refuse an impossible value (0 heads, 0 context, NaN epsilon): ManifestError naming the key."""
        key = key or self.key
        if v is None or isinstance(v, (bool, str, list)):
            return
        if self.kind == "float":
            lo = self.min
            if not math.isfinite(v) or (v <= 0 if lo is None else v < lo):
                bound = "> 0" if lo is None else f">= {lo}"
                raise ManifestError(f"{where}: {key} (param {name}) is {v}, must be finite and {bound}")
        elif self.kind in ("int", "int_array"):
            lo = 1 if self.min is None else self.min
            if v < lo:
                raise ManifestError(f"{where}: {key} (param {name}) is {v}, must be >= {lo}")
            if v > MAX_PARAM:
                raise ManifestError(f"{where}: {key} (param {name}) is {v}, larger than any real model ({MAX_PARAM})")


class TensorSpec(BaseModel):
    """One tensor role (its GGUF name without ``blk.N.``, e.g. ``attn_q.weight``), its ne-order shape
    expressions, where it exists, allowed types."""

    model_config = ConfigDict(extra="forbid")
    role: str
    shape: list[str | int]
    kinds: list[str] | None = None  # layer kinds it exists on; None = every layer (or global if no {il})
    types: list[str] | None = None  # allowed ggml type names; None = any engine-supported type
    optional: bool = False
    choice: str | None = None  # name of a [[choices]] group this tensor belongs to
    expert: Literal["gate", "up", "down", "gate_up"] | None = None
    when: str | None = None  # extra condition expression (e.g. "n_head_kv > 0")

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        try:
            is_per_layer(v)
        except TensorNameError as e:
            raise ValueError(str(e)) from None
        return v

    @property
    def per_layer(self) -> bool:
        """True when the role exists once per layer (``blk.{il}.<role>``)."""
        return is_per_layer(self.role)

    @property
    def name(self) -> str:
        """The GGUF name pattern (``blk.{il}.attn_q.weight``)."""
        return name_pattern(self.role)

    def name_at(self, il: int | None) -> str:
        """The GGUF name in layer ``il`` (None for a global role)."""
        return tensor_name(self.role, il if self.per_layer else None)


class ChoiceSpec(BaseModel):
    """Exactly one of ``options`` (lists of tensor roles) must be present on each layer it applies to."""

    model_config = ConfigDict(extra="forbid")
    name: str
    options: list[list[str]]


class LayerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = "'block'"
    kinds: list[str] = ["block"]
    attention_kinds: list[str] = []  # kinds that hold a KV cache
    window: str | None = None  # expression of il: KV window in tokens for a layer (None = full context)
    recurrent_kinds: list[str] = []
    # kinds of draft blocks (NextN / MTP heads, bases/nextn.toml): loaded as the drafter, not run as layers
    draft_kinds: list[str] = []


class StateSpec(BaseModel):
    """Per-token KV and per-sequence recurrent state, as expressions (elements, not bytes).

    Evaluated per layer, with ``il`` and ``kind`` (the layer's kind) bound: the KV terms on the
    ``attention_kinds`` layers, the recurrent terms on the ``recurrent_kinds`` layers, the
    activation and logits terms on every layer (the budget takes the largest). The budget
    formulas that turn elements into bytes live in ``strata.budget.formulas``. The indexer's key
    term is the one of docs/DESIGN.md "Every budget term twice": ONE shared head.
    """

    model_config = ConfigDict(extra="forbid")
    k_per_token: str = "0"  # elements of K per token per attention layer
    v_per_token: str = "0"
    indexer_k_per_token: str = "0"  # elements of a sparse-attention indexer's cached key per token (ONE head)
    conv_state: str = "0"  # f32 elements per sequence per recurrent layer
    ssm_state: str = "0"
    act_per_token: str = "0"  # f32 activation elements one chunk position keeps live in one layer step
    logits_per_token: str = "0"  # f32 logits per position that emits logits (the vocabulary)


class Manifest(BaseModel):
    """A geometry contract for one architecture (see module docstring)."""

    model_config = ConfigDict(extra="forbid")
    arch: str
    source: str
    params: dict[str, ParamSpec]
    derived: dict[str, str] = Field(default_factory=dict)
    layers: LayerSpec = Field(default_factory=LayerSpec)
    state: StateSpec = Field(default_factory=StateSpec)
    # The same terms again, from the pack's tensor shapes (ne()/has()) where a tensor holds the
    # number; a budget term is only trusted when both derivations agree
    # (docs/DESIGN.md "Every budget term twice").
    state_from_tensors: StateSpec = Field(default_factory=StateSpec)
    tensors: list[TensorSpec]
    choices: list[ChoiceSpec] = Field(default_factory=list)
    checks: list[str] = Field(default_factory=list)  # relations between params that must hold
    # every metadata key llama.cpp reads for the architecture, relative to "{arch}." ("/" = absolute)
    keys: dict[str, KeySpec] = Field(default_factory=dict)

    @field_validator("derived")
    @classmethod
    def _exprs_parse(cls, v: dict[str, str]) -> dict[str, str]:
        for _k, e in v.items():
            parse(e)
        return v

    @model_validator(mode="after")
    def _keys_match_params(self) -> Manifest:
        for key, spec in self.keys.items():
            spec.validate_for(key, self.params)
        return self

    @model_validator(mode="after")
    def _every_term_twice(self) -> Manifest:
        for name in StateSpec.model_fields:
            for spec in (self.state, self.state_from_tensors):
                parse(getattr(spec, name))
            if getattr(self.state, name) != "0" and name not in self.state_from_tensors.model_fields_set:
                raise ValueError(f"[state] {name} has no [state_from_tensors] twin: every budget term is derived twice")
        return self


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{path}: {e}") from None


def merge_manifest(base: dict, child: dict) -> dict:
    """``child`` (a manifest's TOML data) over ``base`` (a shared part's).

    ``params``, ``derived`` and ``keys``: the child's entries added, or replacing the base's of the same name;
    ``layers``, ``state``, ``state_from_tensors``: field by field; ``tensors``: a child entry with the
    role of a base entry replaces it in place, others are appended; ``choices``: by name, likewise;
    ``checks``: the union, base first; every other key: the child's.
    """
    out = {k: v for k, v in base.items()}
    for key, v in child.items():
        if key == "extends":
            continue
        if key in ("params", "derived", "keys", "layers", "state", "state_from_tensors"):
            out[key] = {**base.get(key, {}), **v}
        elif key in ("tensors", "choices"):
            ident = "role" if key == "tensors" else "name"
            items = list(base.get(key, []))
            pos = {it.get(ident): i for i, it in enumerate(items)}
            for it in v:
                if it.get(ident) in pos:
                    items[pos[it.get(ident)]] = it
                else:
                    pos[it.get(ident)] = len(items)
                    items.append(it)
            out[key] = items
        elif key == "checks":
            out[key] = list(base.get(key, [])) + [c for c in v if c not in base.get(key, [])]
        else:
            out[key] = v
    return out


def _resolve(data: dict, path: Path, seen: tuple[str, ...] = ()) -> dict:
    """``data`` with its ``extends`` chain merged in (bases first, in the order listed)."""
    ext = data.get("extends", [])
    ext = [ext] if isinstance(ext, str) else list(ext)
    merged: dict = {}
    for name in ext:
        if name in seen:
            raise ManifestError(f"{path}: extends {name!r} forms a cycle ({' -> '.join((*seen, name))})")
        bpath = BASES_DIR / f"{name}.toml"
        if not bpath.is_file():
            known = sorted(p.stem for p in BASES_DIR.glob("*.toml"))
            raise ManifestError(f"{path}: extends {name!r}, but there is no {bpath} (bases: {', '.join(known)})")
        merged = merge_manifest(merged, _resolve(_read_toml(bpath), bpath, (*seen, name)))
    return merge_manifest(merged, data)


@cache
def load_manifest(arch: str) -> Manifest:
    """Load ``manifests/<arch>.toml``, merge its ``extends`` bases and validate it.

    Raises:
        ManifestError: no manifest for ``arch`` (listing the known ones) or an invalid file.
    """
    path = MANIFEST_DIR / f"{arch}.toml"
    if not path.is_file():
        raise ManifestError(f"no geometry contract for architecture {arch!r}; known: {', '.join(known_archs())}")
    data = _resolve(_read_toml(path), path)
    try:
        m = Manifest.model_validate(data)
    except Exception as e:  # pydantic ValidationError: re-raise naming the file
        raise ManifestError(f"{path}: {e}") from None
    if m.arch != arch:
        raise ManifestError(f"{path}: arch is {m.arch!r}, expected {arch!r}")
    return m


def known_archs() -> list[str]:
    """Architectures with a manifest file: every ``*.toml`` in ``manifests/`` is an architecture contract
    (shared parts live in ``manifests/bases/``; other data files beside their readers: ``budget/cards.toml``,
    ``packer/real_models.toml``)."""
    return sorted(p.stem for p in MANIFEST_DIR.glob("*.toml"))


def derived_value(arch: str, name: str, values: dict[str, Any]) -> Any:
    """One ``[derived]`` number of ``arch``'s manifest from the params in ``values``, the derived numbers its
    expression reads evaluated first from their own: the one definition of a width (qwen3next's delta-net
    ``key_dim``, ``value_dim``, ``conv_dim``) for code that writes a geometry instead of reading one
    (:mod:`strata.testing`'s synthetic files); a resolved :class:`Geometry` holds every one already.

    Raises:
        ManifestError: ``name`` is not a derived number of ``arch`` (listing them), or a name its
            expression reads is neither in ``values`` nor derived.
    """
    derived = load_manifest(arch).derived
    if name not in derived:
        raise ManifestError(f"{arch}: no derived number {name!r}; known: {', '.join(derived)}")
    env = dict(values)
    for n in names_in(derived[name]):
        if n not in env and n in derived:
            env[n] = derived_value(arch, n, values)
    return evaluate(derived[name], env)


# ----------------------------------------------------------------------- geometry


class Geometry:
    """Resolved geometry of one model: params and derived numbers, and per-layer kinds.

    ``values`` maps names to ints/floats/strs/bools or lists (array params). Layer kinds
    are computed from the manifest's ``[layers] kind`` rule, never stored as a second list.
    """

    def __init__(self, manifest: Manifest, values: dict[str, Any], *, check: bool = True):
        self.manifest = manifest
        self.values = dict(values)
        env = dict(values)
        for name, expr in manifest.derived.items():
            try:
                env[name] = evaluate(expr, env)
            except (ZeroDivisionError, TypeError, IndexError) as e:
                raise ManifestError(f"{manifest.arch}: derived {name} = {expr}: {e}") from None
        self.env = env
        for expr in manifest.checks if check else ():
            try:
                ok = evaluate(expr, env)
            except (ZeroDivisionError, TypeError, IndexError) as e:
                raise ManifestError(f"{manifest.arch}: check {expr}: {e}") from None
            if not ok:
                names = [n for n in names_in(expr) if n in env]
                vals = ", ".join(f"{n} = {env[n]}" for n in names)
                raise ManifestError(f"{manifest.arch}: geometry violates {expr} ({vals})")
        n_layer = int(env["n_layer"])
        if not 1 <= n_layer <= MAX_LAYERS:
            raise ManifestError(f"{manifest.arch}: n_layer {n_layer} is outside 1..{MAX_LAYERS}")
        kinds = []
        for il in range(n_layer):
            try:
                k = evaluate(manifest.layers.kind, {**env, "il": il})
            except (ZeroDivisionError, TypeError, IndexError) as e:
                raise ManifestError(f"{manifest.arch}: layer {il} kind = {manifest.layers.kind}: {e}") from None
            if k not in manifest.layers.kinds:
                raise ManifestError(f"{manifest.arch}: layer {il} kind {k!r} not in {manifest.layers.kinds}")
            kinds.append(k)
        self.layer_kinds: list[str] = kinds

    @property
    def arch(self) -> str:
        return self.manifest.arch

    def __getitem__(self, name: str) -> Any:
        return self.env[name]

    def __contains__(self, name: str) -> bool:
        return name in self.env

    def get(self, name: str, default: Any = None) -> Any:
        return self.env.get(name, default)

    def layers_of(self, *kinds: str) -> list[int]:
        """Layer indices whose kind is one of ``kinds``."""
        return [il for il, k in enumerate(self.layer_kinds) if k in kinds]

    @property
    def draft_layers(self) -> list[int]:
        """The draft blocks (kinds in ``[layers] draft_kinds``: NextN / MTP heads, after the decoder layers)."""
        return self.layers_of(*self.manifest.layers.draft_kinds)

    @property
    def n_trunk(self) -> int:
        """Decoder layers the main pass runs: every layer that is not a draft block (they come last)."""
        return len(self.layer_kinds) - len(self.draft_layers)

    def layer_env(self, il: int) -> dict[str, Any]:
        return {**self.env, "il": il, "kind": self.layer_kinds[il]}

    def layer_window(self, il: int) -> int | None:
        """KV window of layer ``il`` in tokens from ``[layers] window`` (None: the whole context)."""
        if self.manifest.layers.window is None:
            return None
        w = evaluate(self.manifest.layers.window, self.layer_env(il))
        return None if w is None else int(w)

    def eval(self, expr: str | int, il: int | None = None) -> Any:
        """Evaluate an expression in this geometry (with ``il`` bound when given)."""
        return evaluate(expr, self.env if il is None else self.layer_env(il))

    def expected_tensors(self) -> list[tuple[str, TensorSpec, tuple[int, ...], int | None]]:
        """Every tensor this geometry may contain: ``(name, spec, ne, layer)``.

        ``ne`` is in ggml order without trailing padding. Includes optional tensors and all
        options of every choice; callers decide presence rules.
        """
        out = []
        for spec in self.manifest.tensors:
            layers = range(len(self.layer_kinds)) if spec.per_layer else [None]
            for il in layers:
                if il is not None and spec.kinds is not None and self.layer_kinds[il] not in spec.kinds:
                    continue
                env = self.env if il is None else self.layer_env(il)
                if spec.when is not None and not evaluate(spec.when, env):
                    continue
                ne = tuple(int(evaluate(d, env)) for d in spec.shape)
                out.append((spec.name_at(il), spec, ne, il))
        return out


def geometry_from_metadata(
    arch: str,
    kv: dict[str, Any],
    array_lengths: dict[str, int] | None = None,
    arrays: dict[str, list] | None = None,
    *,
    check: bool = True,
) -> Geometry:
    """Resolve an architecture's params from GGUF metadata through its manifest.

    Args:
        kv: GGUF key -> value: scalars; arrays as lists (metadata.txt's per-layer arrays) or placeholders.
        array_lengths: GGUF key -> element count, for params with ``array_len``.
        arrays: GGUF key -> list of values, for ``int_array`` / ``bool_array`` params.
        check: refuse impossible values and violated ``checks`` (always, except for a writer of test
            files that must be able to write them: strata.testing).

    Raises:
        ManifestError: a required key is missing (naming it and the manifest) or has the wrong kind.
        KeysRefusedError: a per-layer key (``[keys]`` ``per_layer``) given as an array whose values differ,
            or (with ``check``) a refused key whose rule names params only (the rest:
            :func:`strata.manifests.keys.check_metadata_keys` on the geometry).
    """
    m = load_manifest(arch)
    array_lengths = array_lengths or {}
    arrays = {**{k: v for k, v in kv.items() if isinstance(v, (list, tuple))}, **(arrays or {})}
    per_layer = {s.param: k for k, s in m.keys.items() if s.per_layer and s.param}
    values: dict[str, Any] = {}
    for name, p in m.params.items():
        key = p.key[1:] if p.key.startswith("/") else f"{arch}.{p.key}"
        if p.array_len:
            v = array_lengths.get(key)
        elif p.kind in ("int_array", "bool_array"):
            v = arrays.get(key)
            if v is None and key in kv and not hasattr(kv[key], "count"):
                v = kv[key]  # a scalar where an array is allowed (e.g. sliding_window_pattern as u32)
            elif v is not None:
                v = [bool(x) for x in v] if p.kind == "bool_array" else [int(x) for x in v]
        else:
            v = arrays.get(key, kv.get(key))
            if name in per_layer and v is not None:
                # llama.cpp get_key_or_arr: a scalar, or one value per layer (honoured when all are equal)
                v = collapse_per_layer(arch, per_layer[name], v, values.get("n_layer"), name, strict=check)
            elif v is not None and (isinstance(v, (list, tuple)) or (hasattr(v, "count") and hasattr(v, "elem_type"))):
                raise ManifestError(f"{arch}: metadata key {key} is an array, manifest param {name} expects {p.kind}")
        if v is None and p.default is not None:
            v = evaluate(p.default, values) if isinstance(p.default, str) else p.default
        if v is None:
            if p.optional:
                values[name] = None
                continue
            raise ManifestError(f"{arch}: metadata key {key} (param {name}) is missing and has no default")
        want = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}.get(p.kind)
        if want is not None and (not isinstance(v, want) or (p.kind != "bool" and isinstance(v, bool))):
            raise ManifestError(
                f"{arch}: metadata key {key} (param {name}) is {type(v).__name__} {v!r}, expected {p.kind}"
            )
        if p.kind == "float":
            v = float(v)
        if check:
            p.check(name, v, f"{arch} metadata", key)
        values[name] = v
    if check:  # a refused key by name before the layer kinds evaluate it (a recurrent_layers array too short)
        early = key_refusals(_Params(m, values), {**kv, **arrays}, params_only=True)
        if early:
            raise KeysRefusedError("; ".join(r.message for r in early), early)
    return Geometry(m, values, check=check)


class _Params:
    """A manifest and its resolved params, before :class:`Geometry` derives anything (for
    :func:`strata.manifests.keys.key_refusals` with ``params_only``)."""

    def __init__(self, manifest: Manifest, values: dict[str, Any]):
        self.manifest, self.env = manifest, values


def format_value(v: Any) -> str:
    """geometry.txt value syntax: ints as-is, floats by ``repr`` (round-trips exactly),
    bools ``true``/``false``, arrays comma-separated (bools as 0/1), None as ``none``."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return ",".join(str(int(x)) for x in v) if v else "-"
    s = str(v)
    if not s or any(c.isspace() for c in s):
        raise ManifestError(f"geometry value {v!r} is empty or contains whitespace")
    return s


def parse_value(kind: str, s: str) -> Any:
    """Inverse of :func:`format_value` for a param of ``kind``. Raises ValueError on bad text."""
    if s == "none":
        return None
    if kind == "int":
        return _strict_int(s)
    if kind == "float":
        v = float(s)
        if repr(v) != s and s not in ("inf", "-inf", "nan"):
            raise ValueError(f"{s!r} is not a float as strata writes it ({v!r})")
        return v
    if kind == "bool":
        if s not in ("true", "false"):
            raise ValueError(f"expected true/false, found {s!r}")
        return s == "true"
    if kind in ("int_array", "bool_array"):
        if "," not in s and s != "-" and kind == "int_array":
            return _strict_int(s)
        if s == "-":
            return []
        xs = [_strict_int(x) for x in s.split(",")]
        return [bool(x) for x in xs] if kind == "bool_array" else xs
    return s


def _strict_int(s: str) -> int:
    """Decimal integer exactly as strata writes it: optional '-', no '+', '_', leading zeros or non-ASCII digits."""
    body = s[1:] if s.startswith("-") else s
    if not body or not body.isascii() or not body.isdigit() or (len(body) > 1 and body[0] == "0"):
        raise ValueError(f"{s!r} is not a decimal integer")
    return int(s)


def geometry_params_text(g: Geometry) -> list[tuple[str, str]]:
    """The ``key value`` pairs of geometry.txt for ``g``: arch, then every param in manifest order."""
    rows = [("arch", g.arch)]
    for name in g.manifest.params:
        rows.append((name, format_value(g.values.get(name))))
    return rows


def geometry_from_params(arch: str, params: dict[str, str]) -> Geometry:
    """Rebuild a :class:`Geometry` from geometry.txt's params (strings), through the manifest.

    Raises:
        ManifestError: a param of the manifest is missing from ``params`` or does not parse.
    """
    m = load_manifest(arch)
    unknown = sorted(set(params) - set(m.params) - {"arch"})
    if unknown:
        raise ManifestError(f"geometry.txt: keys {unknown} are not params of {arch}'s manifest")
    values = {}
    for name, p in m.params.items():
        if name not in params:
            raise ManifestError(
                f"geometry.txt: param {name!r} of {arch} is missing (a pack built by an older strata? "
                f"rebuild it from its GGUF: strata-pack build GGUF -o PACK --force)"
            )
        try:
            values[name] = parse_value(p.kind, params[name])
        except ValueError as e:
            raise ManifestError(f"geometry.txt: param {name!r}: {e}") from None
        p.check(name, values[name], "geometry.txt")
    return Geometry(m, values)
