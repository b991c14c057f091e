"""Load-time checks: every tensor the forward pass will read is asserted against the geometry
before the first weight byte is touched.

The pack files are read by the one strict reader (:func:`strata.packer.packfmt.open_pack`:
version lines, exact ``# columns``, any other line shape refused with file and line number,
pool size / alignment / ranges / overlaps checked against ``pool.bin``). This module adds what
only the engine knows - what its forward pass reads:

- every dense tensor of the manifest (``manifests/<arch>.toml``, shapes from ``geometry.txt``) is
  present (or optional, or one complete option of a ``[[choices]]`` group), has exactly the
  required ``ne``, an allowed and CPU-dequantizable type, and ``nbytes`` equal to what that type
  and shape occupy;
- no tensor in ``index.txt`` is left unread (llama.cpp refuses such files too: "wrong number of
  tensors");
- every MoE layer has one ``native_experts.txt`` row whose per-expert byte counts equal the
  required shapes in their types, and whose last expert ends inside its shard file (sizes from
  ``stat``, cross-checked with the sizes ``index.txt`` recorded at pack time).

The wanted failure (BRIEF.md, "round 194"): a mismatch reported with the tensor name, the shape
found and the shape required, at load time - not a wrong number inside a GEMV at token 4000.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from strata.manifests.contract import Geometry
from strata.packer import quants
from strata.packer.packfmt import EXPERTS_FILE, INDEX_FILE, ExpertLayer, IndexEntry, Pack

from . import dequant


class LoadError(ValueError):
    """A pack the engine refuses to run; the message names the file, the tensor and the numbers."""


@dataclass(frozen=True)
class ExpertShapes:
    """Per-expert matrix shapes of one MoE layer (ggml ne order: ``(row length, rows)``)."""

    gate: tuple[int, int]
    up: tuple[int, int]
    down: tuple[int, int]


@dataclass
class LoadPlan:
    """What the forward pass reads, after every check passed.

    ``dense``: tensor name -> index entry (exactly the tensors present that the manifest names);
    ``experts``: MoE layer -> its native_experts.txt row; ``expert_shapes``: MoE layer -> shapes;
    ``shard_sizes``: shard index -> file size in bytes.
    """

    dense: dict[str, IndexEntry]
    experts: dict[int, ExpertLayer] = field(default_factory=dict)
    expert_shapes: dict[int, ExpertShapes] = field(default_factory=dict)
    shard_paths: dict[int, Path] = field(default_factory=dict)


def _shape(ne: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in ne) + "]"


def _found_ne(e: IndexEntry, want_len: int) -> tuple[int, ...]:
    ne = e.ne
    n = max(want_len, max((i + 1 for i, d in enumerate(ne) if d != 1), default=1))
    return tuple(ne[:n])


def _type_name(t: int) -> str:
    q = quants.QTYPES.get(t)
    return q.name if q else f"type id {t}"


def check_pack(pack: Pack, geom: Geometry) -> LoadPlan:
    """Assert every tensor the ``geom.arch`` forward pass reads against ``geom``.

    Raises:
        LoadError: a missing tensor (named, with the shape required), a tensor whose shape
            differs (name, shape found, shape required), a type the manifest does not allow
            or the CPU cannot dequantize, a byte count that disagrees with type x shape, a
            tensor the forward pass would not read, an incomplete or ambiguous choice group,
            or an expert table that disagrees with the geometry or runs past its shard.
    """
    where = pack.path / INDEX_FILE
    arch = geom.arch
    entries = pack.index.by_name()
    want: dict[str, tuple] = {}
    expert_parts: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, spec, ne, il in geom.expected_tensors():
        if spec.expert is not None:
            expert_parts.setdefault(il, {})[spec.expert] = (name, ne)
        else:
            want[name] = (spec, ne, il)

    for name in entries:
        if name not in want:
            raise LoadError(f"{where}: tensor {name} is not read by the {arch} forward pass (no role for it in "
                            f"manifests/{arch}.toml); refusing rather than ignoring it")

    # choice groups: on every layer exactly one option complete, nothing of the other options
    for ch in geom.manifest.choices:
        per_layer = any("{il}" in n for opt in ch.options for n in opt)
        for il in (range(len(geom.layer_kinds)) if per_layer else [None]):
            opts = [[n.replace("{il}", str(il)) if il is not None else n for n in opt] for opt in ch.options]
            dense_opts = [[n for n in opt if n in want] for opt in opts]
            if not any(dense_opts):
                continue  # routed-expert options: checked against native_experts.txt below
            complete = [i for i, opt in enumerate(dense_opts) if opt and all(n in entries for n in opt)]
            touched = [i for i, opt in enumerate(dense_opts) if any(n in entries for n in opt)]
            if len(complete) == 1 and touched == complete:
                continue
            if not complete:
                best = max(range(len(dense_opts)), key=lambda i: sum(n in entries for n in dense_opts[i]))
                missing = [n for n in dense_opts[best] if n not in entries]
                raise LoadError(f"{where}: tensor {missing[0]} is missing (the {arch} forward pass reads "
                                f"{' + '.join(dense_opts[best])}, or {' / '.join(' + '.join(o) for i, o in enumerate(dense_opts) if i != best)})")
            present = [n for i in touched for n in dense_opts[i] if n in entries]
            raise LoadError(f"{where}: layer {il}: tensors of more than one '{ch.name}' option are present "
                            f"({', '.join(present)}); the forward pass needs exactly one")

    dense: dict[str, IndexEntry] = {}
    for name, (spec, ne, il) in want.items():
        e = entries.get(name)
        if e is None:
            if spec.optional or spec.choice is not None:
                continue
            raise LoadError(f"{where}: tensor {name} is missing; the {arch} forward pass reads it with shape "
                            f"{_shape(ne)} (ggml ne, from geometry.txt)")
        padded = tuple(ne) + (1,) * (4 - len(ne))
        if e.ne != padded:
            raise LoadError(f"{where}: tensor {name} has shape {_shape(_found_ne(e, len(ne)))}, the {arch} forward "
                            f"pass requires {_shape(ne)} (ggml ne, from geometry.txt)")
        if spec.types is not None and _type_name(e.src_type) not in spec.types:
            raise LoadError(f"{where}: tensor {name} has type {_type_name(e.src_type)}, manifests/{arch}.toml allows "
                            f"only {', '.join(spec.types)}")
        if not dequant.supported(e.type):
            raise LoadError(f"{where}: tensor {name} has type {_type_name(e.type)}, which the CPU engine cannot dequantize")
        if e.src_type != e.type and not (e.type == quants.F32.id and e.src_type == quants.BF16.id):
            raise LoadError(f"{where}: tensor {name} is stored as {_type_name(e.type)} but came from "
                            f"{_type_name(e.src_type)}; only BF16 -> F32 promotion is a pack form")
        try:
            need = quants.tensor_nbytes(e.type, ne, tensor=name)
        except quants.ShapeError as err:
            raise LoadError(f"{where}: {err}") from None
        if e.nbytes != need:
            raise LoadError(f"{where}: tensor {name} has {e.nbytes} bytes, {_type_name(e.type)} x {_shape(ne)} "
                            f"is {need} bytes")
        dense[name] = e

    plan = LoadPlan(dense)
    _check_experts(pack, geom, expert_parts, plan)
    return plan


def _check_experts(pack: Pack, geom: Geometry, parts: dict[int, dict], plan: LoadPlan) -> None:
    where = pack.path / EXPERTS_FILE
    arch = geom.arch
    if not parts:
        if pack.experts is not None and pack.experts.layers:
            raise LoadError(f"{where}: {len(pack.experts.layers)} routed-expert layers, but {arch} has no routed experts")
        return
    if pack.experts is None:
        first = next(iter(parts.values()))
        raise LoadError(f"{where}: missing; the {arch} forward pass reads routed experts "
                        f"({next(iter(first.values()))[0]} ...)")
    ne_tab = pack.experts
    n_expert = int(geom["n_expert"])
    if ne_tab.n_expert != n_expert:
        raise LoadError(f"{where}: n_expert {ne_tab.n_expert}, geometry.txt says n_expert {n_expert}")
    rows = {r.layer: r for r in ne_tab.layers}
    extra = sorted(set(rows) - set(parts))
    if extra:
        raise LoadError(f"{where}: layer {extra[0]} has routed experts, but the {arch} forward pass reads none there")

    recorded = dict(pack.index.sources)
    sizes: dict[int, int] = {}
    for k, name in enumerate(ne_tab.shards):
        p = pack.shard_path(k)
        if not p.is_file():
            raise LoadError(f"{where}: expert shard {k} {p} is missing (routed experts stay in the GGUF shards)")
        sizes[k] = p.stat().st_size
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise LoadError(f"{where}: expert shard {k} {p}: first 4 bytes are {magic!r}, a GGUF file starts with b'GGUF'")
        if name in recorded and recorded[name] != sizes[k]:
            raise LoadError(f"{where}: shard {p} is {sizes[k]} bytes, index.txt recorded {recorded[name]} at pack time")
        plan.shard_paths[k] = p

    arena = 0
    for row in ne_tab.layers:  # file order: the arena is laid out row after row
        if row.arena_offset != arena:
            raise LoadError(f"{where}: layer {row.layer} column arena_offset: found {row.arena_offset}, required {arena} "
                            f"(the running sum of n_expert x blob_bytes over the rows before it)")
        arena += n_expert * row.blob_bytes

    for il, part in sorted(parts.items()):
        row = rows.get(il)
        if row is None:
            names = sorted(n for n, _ in part.values())
            raise LoadError(f"{where}: layer {il} has no row; the {arch} forward pass reads {', '.join(names)}")
        if "gate" in part:
            gate = part["gate"][1][:2]
        else:
            g = part["gate_up"][1]
            gate = (g[0], g[1] // 2)
        up = part["up"][1][:2] if "up" in part else gate
        down = part["down"][1][:2]
        shapes = ExpertShapes(tuple(gate), tuple(up), tuple(down))
        for p, shp in (("gate", shapes.gate), ("up", shapes.up), ("down", shapes.down)):
            t = getattr(row, f"{p}_type")
            tname = f"blk.{il}.ffn_{p}_exps.weight"
            if not dequant.supported(t):
                raise LoadError(f"{where}: layer {il} {p} experts have type {_type_name(t)}, which the CPU engine cannot dequantize")
            try:
                need = quants.tensor_nbytes(t, shp, tensor=tname)
            except quants.ShapeError as err:
                raise LoadError(f"{where}: layer {il}: {err}") from None
            got = getattr(row, f"{p}_bytes")
            if got != need:
                raise LoadError(f"{where}: layer {il} {p} (column {p}_bytes): found {got} bytes per expert, required "
                                f"{_type_name(t)} x {_shape(shp)} (ggml ne of one expert of {tname}, from geometry.txt) "
                                f"= {need} bytes")
            stride = getattr(row, f"{p}_stride")
            if stride < need:
                raise LoadError(f"{where}: layer {il} {p}: stride {stride} bytes is less than one expert ({need} bytes)")
            k = getattr(row, f"{p}_shard")
            end = getattr(row, f"{p}_off") + (n_expert - 1) * stride + need
            if end > sizes[k]:
                raise LoadError(f"{where}: layer {il} {p}: expert {n_expert - 1} ends at byte {end}, past the end of "
                                f"shard {plan.shard_paths[k]} ({sizes[k]} bytes)")
        parts_sum = row.gate_bytes + row.up_bytes + row.down_bytes
        if row.blob_bytes != parts_sum:
            raise LoadError(f"{where}: layer {il} column blob_bytes: found {row.blob_bytes}, required gate_bytes + "
                            f"up_bytes + down_bytes = {row.gate_bytes} + {row.up_bytes} + {row.down_bytes} = {parts_sum}")
        plan.experts[il] = row
        plan.expert_shapes[il] = shapes
