"""Metadata keys: honoured or refused, never ignored.

Every GGUF metadata key that llama.cpp's loader reads for an architecture (``src/llama-model.cpp``
``llama_model_base::load_hparams``, the architecture's ``load_arch_hparams`` in
``src/models/<arch>.cpp`` and the helpers it calls, key names from ``src/llama-arch.cpp``
``LLM_KV_NAMES``; recorded by ``tools/make_llamacpp_keys.py`` in ``tests/fixtures/llamacpp_keys.json``)
is listed once, in the manifest's ``[keys]`` section (``manifests/<arch>.toml`` or the bases it
extends), with what strata does with it (:class:`KeySpec`):

- ``honour``: the key feeds a ``[params]`` entry (``param``) that the budget and the engine use;
- ``refuse``: strata implements only the values for which ``allow`` (an expression of ``value``, the
  key's value or None when absent, and the geometry's params and derived numbers) holds - typically
  the value that makes the key a no-op, e.g. ``rope.scaling.attn_factor`` absent or 1.0. Any other
  value is refused at ``strata-pack build``, ``strata-budget check`` and engine load, naming the key,
  the value and ``implements`` (what strata does instead). A refuse key may also feed a param
  (``rope.dimension_count`` of qwen2 feeds ``rope_dim`` and must equal the head dim);
- ``inert``: llama.cpp reads it, but nothing strata computes for this architecture depends on it
  (``doc`` says why, with the llama.cpp source: e.g. ``general.name``, only printed); it may still be
  recorded in a param (``param``: deepseek2's routing keys stay in geometry.txt).

``per_layer`` marks keys llama.cpp reads with ``llama_model_loader::get_key_or_arr`` (a scalar or one
value per layer): an array of ``n_layer`` equal values is honoured as that one value; a non-uniform
array (or one of another length) is refused by key and value (:func:`collapse_per_layer`).
``llamacpp = false`` marks a key llama.cpp does NOT read for this architecture that strata refuses
anyway, where a file carrying it was made for a computation llama.cpp (and strata) would silently skip
(gemma2's ``attn_logit_softcapping`` in a gemma3 file); the fixture test checks such a key exists in
``LLM_KV_NAMES``.

One function, :func:`key_refusals` (and :func:`check_metadata_keys`, which raises), is used by all
three tools: ``strata.packer.pack_plan.resolve_geometry`` (on the GGUF's metadata), the budget audit
(``strata.budget.audit``) and the engine's ``pack`` stage (``strata.engine.startup.open_checked``), both on
``metadata.txt``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from .expr import ManifestError, evaluate, names_in, parse

#: GGUF scalar kinds a refuse key may be given with (``kind``): a value of another type is refused.
KINDS = ("int", "float", "bool", "str", "array")


class KeySpec(BaseModel):
    """What strata does with one GGUF metadata key llama.cpp reads (see the module docstring).

    Attributes:
        status: ``honour`` | ``refuse`` | ``inert``.
        param: the ``[params]`` entry the key feeds (required for ``honour``; its ``key`` must be this key;
            for ``inert``, where the value is recorded).
        allow: ``refuse``: expression of ``value`` (None when the key is absent) and the geometry that
            holds for every value strata implements.
        implements: ``refuse``: what strata implements instead, in words (the refusal message says it).
        kind: ``refuse``: the GGUF type the value must have (int, float, bool, str, array); None: any.
        per_layer: llama.cpp reads it with ``get_key_or_arr`` (scalar or one value per layer).
        llamacpp: False for a key llama.cpp does not read for this architecture (refused anyway).
        source: the llama.cpp file and function that read the key and use its value.
        doc: ``inert``: why nothing strata computes depends on it; otherwise a note.
    """

    model_config = ConfigDict(extra="forbid")
    status: Literal["honour", "refuse", "inert"]
    param: str | None = None
    allow: str | None = None
    implements: str = ""
    kind: Literal["int", "float", "bool", "str", "array"] | None = None
    per_layer: bool = False
    llamacpp: bool = True
    source: str
    doc: str = ""

    @field_validator("allow")
    @classmethod
    def _allow_parses(cls, v: str | None) -> str | None:
        if v is not None:
            parse(v)
        return v

    def validate_for(self, key: str, params: Mapping[str, Any]) -> None:
        """Check this entry against the manifest's ``params`` (``ParamSpec`` by name).

        Raises:
            ValueError: an honour key without a param, a param of another key, a refuse key without
                ``allow`` / ``implements``, an inert key without ``doc`` or with ``allow``,
                ``llamacpp = false`` on a key that is not refused.
        """
        if self.status == "honour" and (self.param is None or self.allow is not None):
            raise ValueError(f"[keys] {key!r}: honour needs param (and no allow: that makes it refuse)")
        if self.status == "refuse" and (self.allow is None or not self.implements):
            raise ValueError(f"[keys] {key!r}: refuse needs allow and implements")
        if self.status == "inert" and (not self.doc or self.allow is not None):
            raise ValueError(f"[keys] {key!r}: inert needs doc (why nothing depends on it) and no allow")
        if not self.llamacpp and self.status != "refuse":
            raise ValueError(f"[keys] {key!r}: a key llama.cpp does not read (llamacpp = false) can only be refused")
        if self.param is not None:
            p = params.get(self.param)
            if p is None:
                raise ValueError(f"[keys] {key!r}: param {self.param!r} is not in [params]")
            if p.key != key:
                raise ValueError(f"[keys] {key!r}: param {self.param!r} reads {p.key!r}, not this key")


class Refusal(BaseModel):
    """One refused key: the full GGUF key, its value (as text), what strata implements, the message."""

    key: str
    value: str
    implements: str
    message: str


class KeysRefusedError(ManifestError):
    """Metadata keys whose values strata does not implement (``refusals``: every one, each named with
    its key, value and what strata implements)."""

    def __init__(self, message: str, refusals: list[Refusal] | None = None):
        super().__init__(message)
        self.refusals = list(refusals or [])

    def with_file(self, path: Any) -> KeysRefusedError:
        """The same refusals, the message prefixed with the file they come from."""
        return KeysRefusedError(f"{path}: {self}", self.refusals)


def gguf_key(arch: str, key: str) -> str:
    """The full GGUF key of a manifest key: ``rope.dimension_count`` -> ``<arch>.rope.dimension_count``,
    ``/general.name`` -> ``general.name`` (the ``[params]`` convention)."""
    return key[1:] if key.startswith("/") else f"{arch}.{key}"


def value_text(v: Any) -> str:
    """A metadata value as a refusal shows it: strings quoted, arrays as lists (an unread array - strings,
    or longer than :data:`strata.manifests.contract.MAX_LAYERS` - by its length), floats by repr."""
    if hasattr(v, "count") and hasattr(v, "elem_type"):  # strata.packer.gguf_file.ArrayRef, not read
        return f"<array of {v.count}>"
    return repr(list(v) if isinstance(v, tuple) else v)


def _is_array(v: Any) -> bool:
    return isinstance(v, (list, tuple)) or (hasattr(v, "count") and hasattr(v, "elem_type"))


def collapse_per_layer(
    arch: str, key: str, value: Any, n_layer: int | None, param: str | None = None, *, strict: bool = True
) -> Any:
    """A ``get_key_or_arr`` key's value as the one value strata implements: a scalar as is, an array of
    ``n_layer`` equal values as that value (llama.cpp ``llama_model_loader::get_key_or_arr`` fills
    every layer from a scalar, or copies the array after checking its length). ``strict=False`` (a writer
    of test files, :mod:`strata.testing`) takes the first value of any non-empty list instead of refusing.

    Raises:
        KeysRefusedError: an array whose values differ between layers (strata's geometry has one value
            for every layer), or whose length is not ``n_layer`` (llama.cpp: "key %s has wrong array
            length"), or an array it could not read; named by key and value.
    """
    if not _is_array(value):
        return value
    if not strict and isinstance(value, (list, tuple)) and value:
        return value[0]
    full = gguf_key(arch, key)
    what = f"one {param or key} for every layer" if param else "one value for every layer"
    if not isinstance(value, (list, tuple)):
        why = "an array strata could not read"
    elif n_layer is not None and len(value) != n_layer:
        why = f"an array of {len(value)} values for {n_layer} layers (llama.cpp get_key_or_arr: wrong array length)"
    elif len(set(value)) > 1:
        why = "a per-layer array whose values differ"
    elif not value:
        why = "an empty array"
    else:
        return value[0]
    r = Refusal(
        key=full,
        value=value_text(value),
        implements=what,
        message=f"metadata key {full} = {value_text(value)} is refused: {why}; strata implements {what}",
    )
    raise KeysRefusedError(r.message, [r])


def _kind_ok(kind: str | None, v: Any) -> bool:
    if kind is None or v is None:
        return True
    if kind == "array":
        return _is_array(v)
    if kind == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, {"bool": bool, "str": str}[kind])


def key_refusals(g: Any, kv: Mapping[str, Any], *, params_only: bool = False) -> list[Refusal]:
    """Every key of ``g.manifest.keys`` whose value in ``kv`` strata does not implement.

    Args:
        g: the model's :class:`~strata.manifests.contract.Geometry` (its ``env``: params and derived), or
            anything with ``manifest`` and ``env``.
        kv: full GGUF key -> value: scalars, and arrays as lists (metadata.txt holds the per-layer
            arrays; an array not read, e.g. of strings, may be an ``ArrayRef``).
        params_only: ``g.env`` holds the params only (before the derived numbers and the layer kinds are
            computed, which a refused value may break): rules naming anything else are skipped.

    Returns:
        One :class:`Refusal` per refused key, in manifest order: a ``refuse`` key whose ``allow`` is
        false for its value (or whose value has the wrong ``kind``), and a ``per_layer`` key whose
        array is not uniform (:func:`collapse_per_layer`).
    """
    out: list[Refusal] = []
    arch = g.manifest.arch
    n_layer = g.env.get("n_layer")
    for key, spec in g.manifest.keys.items():
        full = gguf_key(arch, key)
        v = kv.get(full)
        if spec.per_layer:
            try:
                v = collapse_per_layer(arch, key, v, n_layer, spec.param)
            except KeysRefusedError as e:
                out.extend(e.refusals)
                continue
        if spec.status != "refuse":
            continue
        if params_only and any(n != "value" and n not in g.env for n in names_in(spec.allow)):
            continue
        ok = _kind_ok(spec.kind, v)
        if ok:
            try:
                ok = bool(evaluate(spec.allow, {**g.env, "value": v}))
            except TypeError:  # a value of a type the rule cannot compare (an array where a number is meant)
                ok = False
        if not ok:
            shown = [f"{n} = {g.env[n]!r}" for n in names_in(spec.allow) if n != "value" and n in g.env]
            ctx = f" ({', '.join(shown)})" if shown else ""
            msg = (
                f"metadata key {full} = {value_text(v)} is refused: strata implements {spec.implements}{ctx} "
                f"[llama.cpp: {spec.source}]"
            )
            out.append(Refusal(key=full, value=value_text(v), implements=spec.implements, message=msg))
    return out


#: The GGUF value type llama.cpp requires of an architecture's scalar hyperparameters (src/llama-model.cpp
#: ``load_hparams`` reads them with ``ml.get_key``; src/llama-model-loader.cpp ``GKV::get_kv`` throws "key %s has
#: wrong type %s but expected type %s" on any other type: no conversion). Key suffixes after ``<arch>.``; a key
#: llama.cpp also takes as a per-layer array (``get_key_or_arr``: head counts, feed-forward length) is checked when
#: it is a scalar. GGUF type ids: u32 = 4, f32 = 6 (gguf-py ``GGUFValueType``).
LLAMA_CPP_SCALAR_TYPES: dict[str, int] = {
    **dict.fromkeys(
        (
            "context_length",
            "embedding_length",
            "block_count",
            "feed_forward_length",
            "expert_feed_forward_length",
            "expert_shared_feed_forward_length",
            "expert_count",
            "expert_used_count",
            "expert_shared_count",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "attention.value_length",
            "attention.sliding_window",
            "rope.dimension_count",
            "ssm.conv_kernel",
            "ssm.inner_size",
            "ssm.state_size",
            "ssm.time_step_rank",
            "ssm.group_count",
            "nextn_predict_layers",
        ),
        4,
    ),
    **dict.fromkeys(
        (
            "attention.layer_norm_rms_epsilon",
            "attention.layer_norm_epsilon",
            "rope.freq_base",
            "rope.scaling.factor",
            "final_logit_softcapping",
            "attn_logit_softcapping",
        ),
        6,
    ),
}

_GGUF_TYPE_NAMES = {
    0: "u8",
    1: "i8",
    2: "u16",
    3: "i16",
    4: "u32",
    5: "i32",
    6: "f32",
    7: "bool",
    8: "string",
    9: "array",
    10: "u64",
    11: "i64",
    12: "f64",
}


def key_type_refusals(arch: str, kv: Mapping[str, Any], kv_types: Mapping[str, int]) -> list[Refusal]:
    """The architecture's scalar hyperparameters whose GGUF value type is not the one llama.cpp requires
    (:data:`LLAMA_CPP_SCALAR_TYPES`): llama.cpp refuses such a file at load, so strata refuses it too instead of
    reading the value through another type. ``kv_types``: GGUF type id per key (the header's)."""
    out = []
    for suffix, want in LLAMA_CPP_SCALAR_TYPES.items():
        key = f"{arch}.{suffix}"
        got = kv_types.get(key)
        if got is None or got == want or got == 9:  # absent, right, or a per-layer array (checked by the manifest)
            continue
        gn, wn = _GGUF_TYPE_NAMES.get(got, str(got)), _GGUF_TYPE_NAMES[want]
        out.append(
            Refusal(
                key=key,
                value=value_text(kv.get(key)),
                implements=f"a {wn} value",
                message=(
                    f"{key} = {value_text(kv.get(key))} is a GGUF {gn}; llama.cpp reads it as {wn} and refuses the "
                    f"file ('key {key} has wrong type {gn} but expected type {wn}'), so strata does too - rewrite the "
                    f"key as {wn} (gguf-py: GGUFWriter.add_{'uint32' if want == 4 else 'float32'})"
                ),
            )
        )
    return out


def check_metadata_keys(g: Any, kv: Mapping[str, Any]) -> None:
    """Refuse the metadata ``kv`` of the model whose geometry is ``g`` when :func:`key_refusals` finds
    anything (the one rule of ``strata-pack build``, ``strata-budget check`` and engine load).

    Raises:
        KeysRefusedError: every refusal, one per line after the first.
    """
    refusals = key_refusals(g, kv)
    if refusals:
        raise KeysRefusedError("; ".join(r.message for r in refusals), refusals)


def key_counts(keys: Mapping[str, KeySpec]) -> dict[str, int]:
    """``{"honour": n, "refuse": n, "inert": n}`` of a manifest's ``[keys]``."""
    out = {"honour": 0, "refuse": 0, "inert": 0}
    for spec in keys.values():
        out[spec.status] += 1
    return out


__all__ = [
    "KINDS",
    "KeySpec",
    "KeysRefusedError",
    "Refusal",
    "LLAMA_CPP_SCALAR_TYPES",
    "check_metadata_keys",
    "collapse_per_layer",
    "key_type_refusals",
    "gguf_key",
    "key_counts",
    "key_refusals",
    "value_text",
]
