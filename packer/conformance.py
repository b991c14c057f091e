"""Does a pack hold what its architecture's contract requires? The one conformance check.

Two callers, one function (:func:`check_conformance`): the engine's load refuses the first
finding (:mod:`strata.engine.loader`, which adds its own rule: a kernel for every type), the budget
audit lists them all (:mod:`strata.budget.audit`, which adds its own: every budget term derived
twice and the BF16 scan). What is checked, against the geometry resolved through the contract
(``manifests/<arch>.toml``, :class:`strata.manifests.contract.Geometry`):

- dense tensors (``index.txt``): no tensor without a role; every role present (or optional, or one
  option of a ``[[choices]]`` group, exactly one option complete per layer), with exactly the
  required ``ne`` and an allowed type;
- routed experts (``native_experts.txt``): one row per MoE layer of the contract and no other, the
  expert count, per part (gate, up, down) bytes per expert equal to type x the one-expert shape
  (:func:`expert_part_ne`), ``blob_bytes`` the sum of the parts and equal to the types x geometry,
  strides holding a whole expert, ``arena_offset`` the running sum of ``n_expert x blob_bytes``, the
  header's ``total`` and ``max_blob``;
- when the shard headers were re-read (``shard_tensors``), the expert tensors themselves: shape and
  type as any tensor, and every row's types, shards, offsets, strides and bytes equal to the shard's
  tensor table (the expert blob from the strides is returned for the audit's second derivation).

Every finding names the tensor, what was found and what is required (:class:`Finding`); the
messages are the same for both callers. Shapes are ggml ``ne`` order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.manifests.contract import Geometry, TensorSpec
from strata.manifests.names import expert_role, tensor_name

from . import quants
from .findings import Finding, fmt_ne, pad4, trim_ne
from .packfmt import EXPERTS_FILE, INDEX_FILE, ExpertLayer, IndexEntry, NativeExperts

if TYPE_CHECKING:
    from .gguf_file import GGUFHeader, TensorInfo

PARTS = ("gate", "up", "down")


def expert_part_ne(part: str, n_embd: int, n_ff_exp: int) -> tuple[int, int]:
    """``ne`` of ONE expert's slice of a routed-expert tensor (ggml order): gate/up ``[n_embd, n_ff_exp]``,
    down ``[n_ff_exp, n_embd]`` (llama.cpp ``llama-model.cpp`` create_tensor of ffn_*_exps)."""
    return (n_ff_exp, n_embd) if part == "down" else (n_embd, n_ff_exp)


@dataclass(frozen=True)
class ExpertShapes:
    """Per-expert matrix shapes of one MoE layer (ggml ne order: ``(row length, rows)``)."""

    gate: tuple[int, int]
    up: tuple[int, int]
    down: tuple[int, int]


@dataclass
class Conformance:
    """What :func:`check_conformance` found.

    ``findings``: every problem (empty: the pack holds what the contract requires).
    ``dense``: tensor name -> index entry, for the tensors with a role. ``expected``: name ->
    ``(spec, ne, layer)`` of every tensor the contract may hold. ``experts``: MoE layer -> its row,
    ``expert_shapes``: MoE layer -> shapes (rows whose parts fit their types).
    ``expert_blob_from_tensors``: MoE layer -> one expert's bytes from the shard strides (only
    with shard tables).
    """

    findings: list[Finding] = field(default_factory=list)
    dense: dict[str, IndexEntry] = field(default_factory=dict)
    expected: dict[str, tuple[TensorSpec, tuple[int, ...], int | None]] = field(default_factory=dict)
    experts: dict[int, ExpertLayer] = field(default_factory=dict)
    expert_shapes: dict[int, ExpertShapes] = field(default_factory=dict)
    expert_blob_from_tensors: dict[int, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.findings


def _tname(t: int) -> str:
    q = quants.QTYPES.get(t)
    return q.name if q else f"type id {t}"


class _Checker:
    def __init__(self, geom: Geometry):
        self.g = geom
        self.arch = geom.arch
        self.out = Conformance()

    def add(self, tensor, found, required, message, file=INDEX_FILE) -> None:
        self.out.findings.append(Finding(str(tensor), str(found), str(required), message, file))

    # ---------------------------------------------------------------- tensors
    def tensors(self, present: dict[str, tuple[tuple[int, ...], int]], from_shards: set[str]) -> None:
        """Shapes, types, missing and unexpected tensors, choice groups. ``present``: name -> (ne, type);
        ``from_shards``: the names that come from re-read shard headers (routed experts)."""
        g, arch = self.g, self.arch
        expected = self.out.expected
        experts_known = bool(from_shards)
        for name, (ne, type_id) in present.items():
            file = "shard tensor table" if name in from_shards else INDEX_FILE
            if name not in expected:
                self.add(
                    name,
                    fmt_ne(trim_ne(ne)),
                    f"no such tensor in the {arch} contract",
                    f"tensor {name} is not in the {arch} contract (no role for it in manifests/{arch}.toml); "
                    f"refusing rather than ignoring it",
                    file,
                )
                continue
            spec, want, _il = expected[name]
            if pad4(ne) != pad4(want):
                found = fmt_ne(trim_ne(ne, len(want)))
                self.add(
                    name,
                    found,
                    fmt_ne(want),
                    f"tensor {name} has shape {found}, the {arch} contract requires "
                    f"{fmt_ne(want)} (ggml ne, from geometry.txt)",
                    file,
                )
            t = quants.QTYPES.get(type_id)
            if t is not None and spec.types is not None and t.name not in spec.types:
                self.add(
                    name,
                    t.name,
                    " or ".join(spec.types),
                    f"tensor {name} has type {t.name}, manifests/{arch}.toml allows only {', '.join(spec.types)}",
                    file,
                )
        in_choice = {n for ch in g.manifest.choices for opt in ch.options for n in opt}
        for name, (spec, want, _il) in expected.items():
            if name in present or spec.optional or spec.choice is not None or spec.role in in_choice:
                continue
            if spec.expert is not None:
                continue  # routed experts: the native_experts.txt rows below
            self.add(
                name,
                "absent",
                fmt_ne(want),
                f"tensor {name} is missing; the {arch} contract requires it with "
                f"shape {fmt_ne(want)} (ggml ne, from geometry.txt)",
            )
        for ch in g.manifest.choices:
            for il in range(len(g.layer_kinds)):
                opts = [[n for n in (_name_at(r, il) for r in opt) if n in expected] for opt in ch.options]
                if not any(opts):
                    continue
                if not experts_known and any(expected[n][0].expert for opt in opts for n in opt):
                    continue  # expert options: checked against native_experts.txt below
                complete = [i for i, o in enumerate(opts) if o and all(n in present for n in o)]
                touched = [i for i, o in enumerate(opts) if any(n in present for n in o)]
                if len(complete) == 1 and touched == complete:
                    continue
                show = " | ".join(" + ".join(o) for o in opts if o)
                present_names = [n for o in opts for n in o if n in present]
                found = "present: " + ", ".join(present_names) if present_names else "absent"
                if not complete:
                    best = max(range(len(opts)), key=lambda i: sum(n in present for n in opts[i]))
                    missing = next(n for n in opts[best] if n not in present)
                    self.add(
                        missing,
                        found,
                        f"exactly one complete option of: {show}",
                        f"tensor {missing} is missing: layer {il} needs exactly one complete '{ch.name}' option "
                        f"({show})",
                    )
                else:
                    self.add(
                        present_names[0],
                        found,
                        f"exactly one complete option of: {show}",
                        f"layer {il}: the {ch.name} tensors present are not exactly one option "
                        f"({', '.join(present_names)}; options: {show})",
                    )

    # ---------------------------------------------------------------- experts
    def experts(self, table: NativeExperts | None, shard_tensors: dict[str, tuple[int, TensorInfo]] | None) -> None:
        g, arch = self.g, self.arch
        moe = sorted({il for _n, (s, _ne, il) in self.out.expected.items() if s.expert and il is not None})
        F = EXPERTS_FILE
        if table is None:
            if moe:
                first = tensor_name(expert_role("gate"), moe[0])
                self.add(
                    F,
                    "absent",
                    f"rows for the MoE layers {moe[0]}..{moe[-1]}",
                    f"missing; the {arch} contract has routed experts ({first} ...)",
                    F,
                )
            return
        if not moe:
            if table.layers:
                self.add(
                    F,
                    f"{len(table.layers)} layers",
                    "none",
                    f"{len(table.layers)} routed-expert layers, but {arch} has no routed experts",
                    F,
                )
            return
        n_expert = int(g["n_expert"])
        if table.n_expert != n_expert:
            self.add(
                f"{F}:n_expert",
                table.n_expert,
                f"{n_expert} (expert_count)",
                f"n_expert {table.n_expert}, geometry.txt says n_expert {n_expert}",
                F,
            )
        rows = {r.layer: r for r in table.layers}
        for il in moe:
            if il not in rows:
                self.add(
                    tensor_name(expert_role("down"), il),
                    "no row in native_experts.txt",
                    "one row per MoE layer",
                    f"layer {il} has no row; the {arch} contract has routed experts there",
                    F,
                )
        for il in rows:
            if il not in moe:
                self.add(
                    f"{F}:layer {il}",
                    "a row",
                    "no row (not an MoE layer)",
                    f"layer {il} has routed experts, but the {arch} contract has none there",
                    F,
                )
        n_embd, n_ff = int(g["n_embd"]), int(g.get("n_ff_exp", 0) or 0)
        arena = total = max_blob = 0
        for r in table.layers:  # file order: the arena is laid out row after row
            blob = self._row(r, n_embd, n_ff, table.n_expert, arena)
            arena += table.n_expert * blob
            total += table.n_expert * blob
            max_blob = max(max_blob, blob)
            if shard_tensors is not None:
                self._row_vs_shards(r, shard_tensors, n_expert)
        if table.total != total:
            self.add(
                f"{F}:total",
                table.total,
                f"{total} (n_expert x sum of recomputed blobs)",
                f"header total {table.total} disagrees with n_expert x the rows' blobs ({total})",
                F,
            )
        if table.max_blob != max_blob:
            self.add(
                f"{F}:max_blob",
                table.max_blob,
                f"{max_blob} (largest recomputed blob)",
                f"header max_blob {table.max_blob} disagrees with the largest row blob ({max_blob})",
                F,
            )

    def _row(self, r: ExpertLayer, n_embd: int, n_ff: int, n_expert: int, arena: int) -> int:
        """Check one row; returns its blob in bytes as the contract computes it (the row's own if a
        part cannot be stored in its type at all: later rows are then judged on their own numbers)."""
        il, F = r.layer, EXPERTS_FILE
        where = f"{F}:layer {il}"
        shapes, need = {}, {}
        fits = True
        for p in PARTS:
            t = getattr(r, f"{p}_type")
            ne = expert_part_ne(p, n_embd, n_ff)
            tn = tensor_name(expert_role(p), il)
            try:
                need[p] = quants.tensor_nbytes(t, ne)
                shapes[p] = ne
            except quants.GGMLTypeError as x:
                self.add(tn, f"{p}_type {t} ({where})", "a ggml type id", f"layer {il}: {x}", F)
                fits = False
            except quants.ShapeError:
                q = quants.qtype(t)
                self.add(
                    tn,
                    f"one expert's {p} slice ne {fmt_ne(ne)} of {q.name}",
                    f"ne[0] a multiple of the {q.name} block of {q.block_elems}",
                    f"layer {il}: one expert's {p} slice {fmt_ne(ne)} (from n_embd {n_embd}, n_ff_exp {n_ff}) "
                    f"is not whole {q.name} blocks of {q.block_elems}: ne[0] = {ne[0]}",
                    F,
                )
                fits = False
        if not fits:
            if r.arena_offset != arena:
                self._arena(r, arena)
            return r.blob_bytes
        for p in PARTS:
            got = getattr(r, f"{p}_bytes")
            t = getattr(r, f"{p}_type")
            tn = tensor_name(expert_role(p), il)
            if got != need[p]:
                self.add(
                    tn,
                    f"{p}_bytes {got} ({where})",
                    f"{p}_bytes {need[p]}",
                    f"layer {il} {p} (column {p}_bytes): found {got} bytes per expert, required {_tname(t)} x "
                    f"{fmt_ne(shapes[p])} (ggml ne of one expert of {tn}, from geometry.txt) = {need[p]} bytes",
                    F,
                )
            stride = getattr(r, f"{p}_stride")
            if stride < need[p]:
                self.add(
                    tn,
                    f"{p}_stride {stride} ({where})",
                    f">= {need[p]} (one expert)",
                    f"layer {il} {p}: stride {stride} bytes is less than one expert ({need[p]} bytes)",
                    F,
                )
        parts = r.gate_bytes + r.up_bytes + r.down_bytes
        down = tensor_name(expert_role("down"), il)
        if r.blob_bytes != parts:
            self.add(
                down,
                f"blob_bytes {r.blob_bytes} ({where})",
                f"gate_bytes + up_bytes + down_bytes = {parts}",
                f"layer {il} column blob_bytes: found {r.blob_bytes}, required gate_bytes + up_bytes + down_bytes = "
                f"{r.gate_bytes} + {r.up_bytes} + {r.down_bytes} = {parts}",
                F,
            )
        blob = need["gate"] + need["up"] + need["down"]
        if r.blob_bytes != blob:
            types = "/".join(_tname(getattr(r, f"{p}_type")) for p in PARTS)
            self.add(
                down,
                f"blob_bytes {r.blob_bytes} ({where})",
                f"blob_bytes {blob} = gate {need['gate']} + up {need['up']} + down {need['down']} ({types} at "
                f"n_embd {n_embd}, n_ff_exp {n_ff})",
                f"layer {il}: per-expert blob_bytes {r.blob_bytes} disagrees with its types and the geometry "
                f"({blob} = {need['gate']} + {need['up']} + {need['down']})",
                F,
            )
        if r.arena_offset != arena:
            self._arena(r, arena)
        self.out.experts[il] = r
        self.out.expert_shapes[il] = ExpertShapes(shapes["gate"], shapes["up"], shapes["down"])
        return blob

    def _arena(self, r: ExpertLayer, arena: int) -> None:
        self.add(
            tensor_name(expert_role("gate"), r.layer),
            f"arena_offset {r.arena_offset} ({EXPERTS_FILE}:layer {r.layer})",
            f"arena_offset {arena} (running sum of n_expert x blob_bytes)",
            f"layer {r.layer} column arena_offset: found {r.arena_offset}, required {arena} (the running sum of "
            f"n_expert x blob_bytes over the rows before it)",
            EXPERTS_FILE,
        )

    def _row_vs_shards(self, r: ExpertLayer, shard_tensors, n_expert: int) -> None:
        """Types, shards, offsets, strides and bytes of one row against the shard tensor tables."""
        il = r.layer
        fused = tensor_name(expert_role("gate_up"), il)
        blob_t = 0
        for p in PARTS:
            name = tensor_name(expert_role(p), il)
            if p in ("gate", "up") and fused in shard_tensors and name not in shard_tensors:
                k, t = shard_tensors[fused]
                stride = t.nbytes // t.ne[2] if len(t.ne) == 3 and t.ne[2] else 0
                want_off, want_bytes, shown = t.abs_offset + (stride // 2 if p == "up" else 0), stride // 2, fused
            elif name in shard_tensors:
                k, t = shard_tensors[name]
                stride = t.nbytes // t.ne[2] if len(t.ne) == 3 and t.ne[2] else 0
                want_off, want_bytes, shown = t.abs_offset, stride, name
            else:
                continue  # named by the tensor check as missing
            for col, got, want in (
                (f"{p}_type", getattr(r, f"{p}_type"), t.type_id),
                (f"{p}_shard", getattr(r, f"{p}_shard"), k),
                (f"{p}_off", getattr(r, f"{p}_off"), want_off),
                (f"{p}_stride", getattr(r, f"{p}_stride"), stride),
                (f"{p}_bytes", getattr(r, f"{p}_bytes"), want_bytes),
            ):
                if got != want:
                    self.add(
                        shown,
                        f"{col} {got} (native_experts.txt layer {il})",
                        f"{col} {want} (shard tensor table)",
                        f"layer {il}: {col} {got} disagrees with the shard's tensor table ({want})",
                        EXPERTS_FILE,
                    )
            if len(t.ne) == 3 and t.ne[2] != n_expert:
                self.add(
                    shown,
                    f"{t.ne[2]} experts (ne[2])",
                    f"{n_expert}",
                    f"tensor {shown}: holds {t.ne[2]} experts, the geometry says {n_expert}",
                    EXPERTS_FILE,
                )
            blob_t += want_bytes
        self.out.expert_blob_from_tensors[il] = blob_t


def _name_at(role: str, il: int) -> str:
    from strata.manifests.names import is_per_layer

    return tensor_name(role, il if is_per_layer(role) else None)


def check_conformance(
    geom: Geometry,
    entries: list[IndexEntry],
    experts: NativeExperts | None,
    shard_tensors: dict[str, tuple[int, TensorInfo]] | None = None,
) -> Conformance:
    """Check a pack's dense tensors (``entries``, index.txt) and routed-expert table (``experts``,
    native_experts.txt; None when the pack has none) against ``geom`` (module docstring).

    ``shard_tensors``: routed-expert tensor name -> ``(shard index, TensorInfo)`` from the re-read
    shard headers, to check the expert tensors themselves and every row against them (None: the
    rows are checked against the geometry only).

    Returns every finding (never raises on a mismatch); unknown type ids and byte counts are the
    pool layout's (:func:`strata.packer.pack.pool_layout_findings`).
    """
    c = _Checker(geom)
    c.out.expected = {name: (spec, ne, il) for name, spec, ne, il in geom.expected_tensors()}
    present: dict[str, tuple[tuple[int, ...], int]] = {}
    for e in entries:
        present[e.name] = (trim_ne(e.ne), e.src_type)
        if e.name in c.out.expected:
            c.out.dense[e.name] = e
    if shard_tensors is not None:
        for name, (_k, ti) in shard_tensors.items():
            if name in present:
                c.add(
                    name,
                    "in index.txt and among the shard experts",
                    "one place",
                    f"tensor {name} is both dense and a routed expert",
                )
            present[name] = (tuple(ti.ne), ti.type_id)
    c.tensors(present, set(shard_tensors or ()))
    c.experts(experts, shard_tensors)
    return c.out


def expert_tensors(header: GGUFHeader, k: int) -> dict[str, tuple[int, TensorInfo]]:
    """The routed-expert tensors (``blk.N.ffn_{gate,up,down,gate_up}_exps.weight``) of shard ``k``'s
    re-read header, as ``name -> (k, TensorInfo)``: the ``shard_tensors`` argument of
    :func:`check_conformance` (used by the budget audit and the engine's load)."""
    from strata.manifests.names import expert_part

    return {t.name: (k, t) for t in header.tensors if expert_part(t.name) is not None}


__all__ = ["Conformance", "ExpertShapes", "PARTS", "check_conformance", "expert_part_ne", "expert_tensors"]
