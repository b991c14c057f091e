"""The pack planned from a GGUF source, before anything is written: what ``strata-pack build`` will
put in the pack and ``strata-pack verify`` recomputes to compare.

- :func:`resolve_geometry`: the geometry through the architecture's manifest, every metadata key
  honoured or refused (:func:`strata.manifests.keys.check_metadata_keys`);
- :func:`check_foreign_shards`, :func:`check_layer_count`: the shards and the ``blk.N`` tensors
  against that geometry;
- :func:`layout_pool`: the dense tensors' places in pool.bin (bytes, ``align``-multiple offsets;
  BF16 sources laid out as F32);
- :func:`tabulate_experts`: the routed experts' per-layer table (offsets and strides in the shards,
  bytes; the experts stay in the shards);
- :func:`metadata_items`: the rows of metadata.txt.

Every refusal is a :class:`BuildError` naming the file, the tensor and the numbers. The sources are
only read (:mod:`strata.packer.gguf_file`). Formats: docs/FORMAT.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf.constants import GGUFValueType

from strata.manifests.contract import MAX_LAYERS, Geometry, geometry_from_metadata
from strata.manifests.keys import KeysRefusedError, check_metadata_keys, key_type_refusals
from strata.manifests.names import expert_part

from . import quants
from .findings import fmt_ne, pad4
from .gguf_file import ArrayRef, GGUFModel, TensorInfo, read_array
from .packfmt import ExpertLayer, IndexEntry, NativeExperts, PackIndex

#: GGUF array element types metadata.txt holds (as ``int_array`` / ``float_array`` / ``bool_array``).
ARRAY_KINDS = {
    **{
        t: "int_array"
        for t in (
            GGUFValueType.UINT8,
            GGUFValueType.INT8,
            GGUFValueType.UINT16,
            GGUFValueType.INT16,
            GGUFValueType.UINT32,
            GGUFValueType.INT32,
            GGUFValueType.UINT64,
            GGUFValueType.INT64,
        )
    },
    GGUFValueType.FLOAT32: "float_array",
    GGUFValueType.FLOAT64: "float_array",
    GGUFValueType.BOOL: "bool_array",
}


class BuildError(ValueError):
    """The source cannot be packed; the message names the file, the tensor and the numbers."""


def is_router_tensor(name: str) -> bool:
    """A router weight (``ffn_gate_inp``, the shared expert's gate ``ffn_gate_inp_shexp`` too): what decides which
    experts a token selects, hence what identifies a model's routing (:func:`strata.budget.profile.model_identity`)."""
    return "ffn_gate_inp" in name


def is_expert_tensor(name: str) -> bool:
    """True for routed-expert tensors (``blk.N.ffn_{gate,up,down,gate_up}_exps.weight``);
    shared experts (``*_shexp``) are dense."""
    return expert_part(name) is not None


def metadata_values(model: GGUFModel) -> dict[str, Any]:
    """Shard 0's metadata as the manifests' rules read it: scalars as they are; the architecture's own
    arrays (``<arch>.*``, at most :data:`strata.manifests.contract.MAX_LAYERS` values: per-layer head
    counts, sliding-window patterns, classifier labels, ...) as lists, bool arrays as bools, strings
    decoded; any other array as its :class:`~strata.packer.gguf_file.ArrayRef` (a rule only asks whether
    it is there)."""
    h = model.shards[0]
    out: dict[str, Any] = {}
    for k, v in h.kv.items():
        if not (isinstance(v, ArrayRef) and k.startswith(f"{model.arch}.") and v.count <= MAX_LAYERS):
            out[k] = v
        elif v.elem_type == GGUFValueType.STRING:  # e.g. classifier.output_labels: shown in a refusal
            out[k] = [bytes(x).decode("utf-8", "replace") for x in read_array(h, k)]
        elif v.elem_type in ARRAY_KINDS:
            a = read_array(h, k).tolist()
            out[k] = [bool(x) for x in a] if v.elem_type == GGUFValueType.BOOL else a
        else:
            out[k] = v
    return out


def resolve_geometry(model: GGUFModel) -> Geometry:
    """Geometry of ``model`` from shard 0's metadata through the architecture's manifest, after every
    metadata key llama.cpp reads for the architecture was honoured or refused (the manifest's
    ``[keys]``, :func:`strata.manifests.keys.check_metadata_keys`: the rule the audit and the engine
    apply to ``metadata.txt``).

    Raises:
        KeysRefusedError: naming the file, each refused key, its value and what strata implements.
        ManifestError: metadata that does not satisfy the manifest.
    """
    h = model.shards[0]
    kv = metadata_values(model)
    lengths = {k: v.count for k, v in h.kv.items() if isinstance(v, ArrayRef)}
    typed = key_type_refusals(model.arch, kv, h.kv_types)
    if typed:  # llama.cpp refuses these files at load: so does strata, before reading a value through another type
        raise KeysRefusedError("; ".join(r.message for r in typed), typed).with_file(h.path)
    try:
        g = geometry_from_metadata(model.arch, kv, lengths)
        check_metadata_keys(g, kv)
    except KeysRefusedError as e:
        raise e.with_file(h.path) from None
    return g


def layout_pool(model: GGUFModel, align: int) -> PackIndex:
    """Dense tensors in shard and file order at ``align``-multiple pool offsets (bytes).
    BF16 sources are laid out as F32 (twice the bytes)."""
    if align <= 0 or align & (align - 1):
        raise BuildError(f"pack alignment {align} is not a power of two")
    entries = []
    off = 0
    for name, (k, t) in model.tensors.items():
        if is_expert_tensor(name):
            continue
        pool_type = quants.F32.id if t.type_id == quants.BF16.id else t.type_id
        nbytes = quants.tensor_nbytes(pool_type, t.ne, tensor=name)
        off = (off + align - 1) // align * align
        ne = t.ne4
        entries.append(IndexEntry(name, pool_type, t.type_id, off, nbytes, *ne, k, t.abs_offset))
        off += nbytes
    pool_bytes = (off + align - 1) // align * align
    return PackIndex([(s.path.name, s.file_size) for s in model.shards], align, pool_bytes, entries)


def tabulate_experts(model: GGUFModel, geom: Geometry) -> NativeExperts | None:
    """Per-layer routed-expert table from the shard tensor tables (None for dense models).

    Per layer: ``gate/up/down`` offsets are absolute in their shard; stride = ``nbytes /
    n_expert`` (ggml ``nb[2]``); a fused ``ffn_gate_up_exps`` is split into its halves (rows
    ``0..n_ff-1`` gate, ``n_ff..2n_ff-1`` up, llama.cpp ``llama-graph.cpp`` build_moe_ffn).

    Raises:
        BuildError: a layer with missing parts, an expert count that disagrees with the
            geometry, or a tensor whose bytes do not divide into experts.
    """
    by_layer: dict[int, dict[str, tuple[int, TensorInfo]]] = {}
    for name, (k, t) in model.tensors.items():
        ep = expert_part(name)
        if ep is not None:
            by_layer.setdefault(ep[0], {})[ep[1]] = (k, t)
    if not by_layer:
        return None
    n_expert = int(geom["n_expert"]) if "n_expert" in geom else None
    rows = []
    arena = 0

    def path(k: int) -> Path:
        return model.shards[k].path

    def split(parts: dict, E: int, part: str):
        k, t = parts[part]
        stride = t.nbytes // E
        if stride * E != t.nbytes:
            raise BuildError(f"{path(k)}: tensor {t.name}: {t.nbytes} bytes do not divide into {E} experts")
        return k, t, stride

    for il in sorted(by_layer):
        parts = by_layer[il]
        for _p, (k, t) in parts.items():
            if len(t.ne) != 3:
                raise BuildError(
                    f"{path(k)}: tensor {t.name} has shape {list(t.ne)}, expected 3 dims [ne0, n_ff, n_expert]"
                )
            if n_expert is not None and t.ne[2] != n_expert:
                raise BuildError(
                    f"{path(k)}: tensor {t.name} holds {t.ne[2]} experts (ne[2]) but the metadata says "
                    f"expert_count {n_expert}"
                )
        if "down" not in parts or not ("gate_up" in parts or ("gate" in parts and "up" in parts)):
            raise BuildError(
                f"layer {il}: routed experts incomplete, found only {sorted(parts)} (need gate+up or gate_up, and down)"
            )
        if "gate_up" in parts and ("gate" in parts or "up" in parts):
            raise BuildError(f"layer {il}: both fused ffn_gate_up_exps and separate gate/up expert tensors")
        E = parts["down"][1].ne[2]
        if "gate_up" in parts:
            k, t, stride = split(parts, E, "gate_up")
            if t.ne[1] % 2:
                raise BuildError(
                    f"{path(k)}: fused tensor {t.name} has odd ne[1]={t.ne[1]}, cannot split into gate and up"
                )
            half = stride // 2
            g = (k, t.type_id, t.abs_offset, stride, half)
            u = (k, t.type_id, t.abs_offset + half, stride, half)
        else:
            k, t, stride = split(parts, E, "gate")
            g = (k, t.type_id, t.abs_offset, stride, stride)
            k, t, stride = split(parts, E, "up")
            u = (k, t.type_id, t.abs_offset, stride, stride)
        k, t, stride = split(parts, E, "down")
        d = (k, t.type_id, t.abs_offset, stride, stride)
        blob = g[4] + u[4] + d[4]
        rows.append(
            ExpertLayer(
                layer=il,
                gate_type=g[1],
                up_type=u[1],
                down_type=d[1],
                blob_bytes=blob,
                arena_offset=arena,
                gate_shard=g[0],
                gate_off=g[2],
                gate_stride=g[3],
                up_shard=u[0],
                up_off=u[2],
                up_stride=u[3],
                down_shard=d[0],
                down_off=d[2],
                down_stride=d[3],
                gate_bytes=g[4],
                up_bytes=u[4],
                down_bytes=d[4],
            )
        )
        arena += E * blob
    counts = {by_layer[r.layer]["down"][1].ne[2] for r in rows}
    if len(counts) != 1:
        raise BuildError(f"expert tensors disagree on the expert count across layers: {sorted(counts)}")
    return NativeExperts(
        int(counts.pop()), arena, max(r.blob_bytes for r in rows), [s.path.name for s in model.shards], rows
    )


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def metadata_items(model: GGUFModel, src_dir: Path) -> list[tuple[str, str, object]]:
    """metadata.txt rows: every scalar key of shard 0 and the architecture's own numeric arrays
    (:func:`metadata_values`: the per-layer arrays the manifests' ``[keys]`` rules read; the tokenizer's
    arrays are in the tokenizer tables), then ``strata.source_dir`` (where the shards were when the pack
    was built). Keys that are not UTF-8 or hold blanks (llama.cpp loads them; nothing reads them) are left out;
    string VALUES that are not UTF-8 are kept (escaped in metadata.txt: ``general.name`` as llama.cpp shows it)."""
    h = model.shards[0]
    items: list[tuple[str, str, object]] = []
    for key, v in metadata_values(model).items():
        if not key.isprintable() or any(c.isspace() for c in key) or not _utf8(key):
            continue  # a key llama.cpp loads but no code of it reads (not UTF-8, blanks): not part of the format
        if isinstance(v, list):
            if h.kv[key].elem_type in ARRAY_KINDS:  # string arrays are not part of the format
                items.append((key, ARRAY_KINDS[h.kv[key].elem_type], v))
            continue
        if isinstance(v, ArrayRef):
            continue
        vt = h.kv_types[key]
        kind = (
            "str"
            if vt == GGUFValueType.STRING
            else "bool"
            if vt == GGUFValueType.BOOL
            else "float"
            if vt in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)
            else "int"
        )
        items.append((key, kind, v))
    items.append(("strata.source_dir", "str", str(src_dir)))
    return items


def check_foreign_shards(model: GGUFModel, geom: Geometry) -> None:
    """Every tensor of the shards after the first against the geometry resolved from the first shard's
    metadata (the manifest's expected shapes, :meth:`Geometry.expected_tensors`, the shapes the
    conformance check and the engine's load use): a shard of another model with the same tensor
    names and ``split.*`` keys but other shapes is refused here, as llama.cpp refuses it at load
    (``llama_model_loader::check_tensor_dims``: "tensor has wrong shape"). Shard 0's own tensors are
    the audit's to judge (``strata-budget check`` lists every finding).

    Raises:
        BuildError: naming the shard file, the tensor, the shape found and the shape required.
    """
    if len(model.shards) < 2:
        return
    expected = {name: ne for name, _spec, ne, _il in geom.expected_tensors()}
    first = model.shards[0].path.name
    for name, (k, t) in model.tensors.items():
        want = expected.get(name)
        if k == 0 or want is None or pad4(t.ne) == pad4(want):
            continue
        raise BuildError(
            f"{model.shards[k].path}: tensor {name} has shape {fmt_ne(t.ne)}, but the geometry of the first shard "
            f"{first} ({geom.arch}) requires {fmt_ne(want)} (ggml ne): a shard of another model (foreign shard); "
            f"refusing to pack it"
        )


def check_contract_names(model: GGUFModel, geom: Geometry) -> None:
    """Every tensor of every shard must have a role in the architecture's contract (``manifests/<arch>.toml``,
    :meth:`Geometry.expected_tensors`): a tensor no role names - a routing bias the architecture does not have, a
    renamed norm - is refused here, as llama.cpp refuses a file with tensors its loader does not create
    (``llama_model_loader::done_getting_tensors``: "wrong number of tensors"), instead of packing it for the audit
    and the engine's load to refuse later. Shapes and types stay the audit's to judge (it lists every finding).

    Raises:
        BuildError: naming the shard file, the first unknown tensor, its shape, and how many there are.
    """
    expected = {name for name, _spec, _ne, _il in geom.expected_tensors()}
    unknown = [(name, k, t) for name, (k, t) in model.tensors.items() if name not in expected]
    if not unknown:
        return
    name, k, t = unknown[0]
    more = f" (and {len(unknown) - 1} more: {', '.join(n for n, _k, _t in unknown[1:4])}" + (
        ", ...)" if len(unknown) > 4 else ")"
    )
    raise BuildError(
        f"{model.shards[k].path}: tensor {name} {fmt_ne(t.ne)} is not in the {geom.arch} contract (no role for it in "
        f"manifests/{geom.arch}.toml){more if len(unknown) > 1 else ''}; llama.cpp refuses a file with tensors its "
        f"loader does not create; refusing to pack it"
    )


def check_source(model: GGUFModel, geom: Geometry) -> None:
    """The build's checks of a source against its geometry, in order: :func:`check_foreign_shards`,
    :func:`check_layer_count`, :func:`check_contract_names` (each raises BuildError)."""
    check_foreign_shards(model, geom)
    check_layer_count(model, geom)
    check_contract_names(model, geom)


def check_layer_count(model: GGUFModel, geom: Geometry) -> None:
    """The metadata's layer count must match the ``blk.N`` tensors present: every N in
    ``[0, n_layer)`` and no other (a huge ``block_count`` is refused here, before anything
    iterates over layers).

    Raises:
        BuildError: naming the metadata value and the layers found.
    """
    layers = set()
    for name in model.tensors:
        if name.startswith("blk."):
            part = name.split(".", 2)[1]
            if part.isdigit():
                layers.add(int(part))
    n_layer = int(geom["n_layer"])
    if layers and layers != set(range(n_layer)):
        lo, hi = min(layers), max(layers)
        raise BuildError(
            f"{model.shards[0].path}: metadata block_count is {n_layer} but the tensors hold layers "
            f"{lo}..{hi} ({len(layers)} distinct)"
        )


__all__ = [
    "ARRAY_KINDS",
    "BuildError",
    "check_contract_names",
    "check_foreign_shards",
    "check_layer_count",
    "check_source",
    "is_expert_tensor",
    "layout_pool",
    "metadata_items",
    "metadata_values",
    "resolve_geometry",
    "tabulate_experts",
]
