"""The semantic audit of a pack: does every tensor mean what the kernels assume?

Why semantics and not totals (BRIEF.md "round 194"): a budget term 4x too big survived a round
because it made the budget tighter, and only errors that loosen a budget trip a total. So this
audit checks meaning, and collects every failure (never just the first):

1. Pool layout: offsets aligned, no overlaps or gaps, ranges inside pool.bin, sizes equal to
   type x shape, pool types consistent with source types.
2. Geometry: resolved from metadata.txt through the architecture's manifest, and compared
   param by param with geometry.txt.
3. Shapes: every tensor of index.txt and every routed-expert tensor of the shards (headers re-read
   with :mod:`strata.packer.gguf_file`) has the shape its role requires; missing and unexpected
   tensors are named; each ``[[choices]]`` group has exactly one option present; types allowed.
4. Experts: per layer, types, offsets and strides equal the shard tensor table; ``blob_bytes``
   recomputed from the types and the geometry; ``arena_offset``, ``total`` and ``max_blob``
   recomputed.
5. Every budget term derived twice: from the metadata through the manifest (``[state]``) and from
   the pack's tensor shapes (``[state_from_tensors]``); dense bytes from the manifest's shapes and
   from index.txt; widened-scale and BF16 bytes from the registry per element and from the pack's
   byte counts; expert blobs from types x geometry and from the shard strides. Any disagreement,
   in either direction, is an error.
6. BF16: every BF16-source tensor is F32 in the pool with the low 16 bits of every value zero.

Each error names the tensor, what was found and what is required.
"""

from __future__ import annotations

import mmap
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from strata.manifests.contract import (
    Geometry, ManifestError, StateSpec, TensorSpec, evaluate, geometry_from_metadata, geometry_from_params, load_manifest,
)
from strata.packer import quants
from strata.packer.build import EXPERT_RE
from strata.packer.gguf_file import GGUFError, GGUFHeader, TensorInfo, read_header
from strata.packer.packfmt import (
    EXPERTS_FILE, GEOMETRY_FILE, INDEX_FILE, METADATA_FILE, POOL_FILE, VOCAB_FILE, Pack, PackFormatError, read_experts,
    read_geometry_params, read_index, read_metadata,
)

from . import formulas as F
from .plan import DenseTensor, ExpertLayerFacts, ModelFacts

#: The [state] terms and the layer kinds they are evaluated on ("attention", "recurrent", "all").
STATE_TERMS: dict[str, str] = {
    "k_per_token": "attention", "v_per_token": "attention", "indexer_k_per_token": "attention",
    "conv_state": "recurrent", "ssm_state": "recurrent", "act_per_token": "all", "logits_per_token": "all",
}
assert set(STATE_TERMS) == set(StateSpec.model_fields), "every [state] term needs its layer kinds here"
_NE_NAME = re.compile(r"""ne\(\s*['"]([^'"]+)['"]""")
BF16_SCAN_CHUNK = 1 << 24  # values per numpy call: bounded memory on multi-GB tensors


class AuditError(BaseModel):
    """One failure: the tensor (or file:field) it concerns, what was found, what is required."""

    tensor: str
    found: str
    required: str
    message: str


class TermCheck(BaseModel):
    """One budget term derived twice (elements or bytes, ``unit`` says which)."""

    term: str
    where: str
    unit: str
    from_metadata: int
    from_tensors: int

    @property
    def ok(self) -> bool:
        return self.from_metadata == self.from_tensors


class AuditResult(BaseModel):
    """What the audit found. ``facts`` holds the metadata-path numbers the plan uses."""

    pack: str
    arch: str
    errors: list[AuditError] = Field(default_factory=list)
    warnings: list[AuditError] = Field(default_factory=list)  # not semantic errors (e.g. types with no engine kernel yet)
    checks: list[TermCheck] = Field(default_factory=list)
    facts: ModelFacts | None = None
    dense_tensors: int = 0
    expert_layers: int = 0
    bf16_tensors: int = 0
    bf16_values_scanned: int = 0
    bf16_scan: bool = True
    seconds: dict[str, float] = Field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors


def _fmt_ne(ne) -> str:
    return "[" + ", ".join(str(int(x)) for x in ne) + "]"


def _trim(ne) -> tuple[int, ...]:
    ne = [int(x) for x in ne]
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return tuple(ne)


def _pad4(ne) -> tuple[int, ...]:
    ne = tuple(int(x) for x in ne)
    return ne + (1,) * (4 - len(ne))


class _Auditor:
    def __init__(self, path: Path, bf16_scan: bool):
        self.path = path
        self.bf16_scan = bf16_scan
        self.errors: list[AuditError] = []
        self.warnings: list[AuditError] = []
        self.checks: list[TermCheck] = []
        self.seconds: dict[str, float] = {}

    def err(self, tensor: str, found: Any, required: Any, message: str) -> None:
        self.errors.append(AuditError(tensor=tensor, found=str(found), required=str(required), message=message))

    def timed(self, name: str, t0: float) -> float:
        t = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + t - t0
        return t

    # ------------------------------------------------------------------ 1. read + pool
    def read(self) -> Pack:
        index = read_index(self.path / INDEX_FILE)
        experts = read_experts(self.path / EXPERTS_FILE) if (self.path / EXPERTS_FILE).exists() else None
        params = read_geometry_params(self.path / GEOMETRY_FILE)
        metadata = read_metadata(self.path / METADATA_FILE)
        return Pack(self.path, index, experts, params, metadata)

    def pool_layout(self, pack: Pack) -> None:
        idx = pack.index
        pool = self.path / POOL_FILE
        if not pool.exists():
            self.err(POOL_FILE, "missing", f"{idx.pool_bytes} bytes", f"{pool}: missing")
            size = None
        else:
            size = pool.stat().st_size
            if size != idx.pool_bytes:
                self.err(POOL_FILE, f"{size} bytes", f"{idx.pool_bytes} bytes (index.txt header)",
                         f"pool.bin is {size} bytes, index.txt says pool {idx.pool_bytes}")
        prev = None
        end = 0
        for e in sorted(idx.entries, key=lambda e: (e.offset, e.name)):
            try:
                want = quants.tensor_nbytes(e.type, _trim(e.ne), tensor=e.name)
            except (quants.GGMLTypeError, quants.ShapeError) as x:
                self.err(e.name, f"type {e.type} ne {_fmt_ne(_trim(e.ne))}", "a ggml type that can hold ne", str(x))
                want = None
            if want is not None and want != e.nbytes:
                self.err(e.name, f"nbytes {e.nbytes}", f"nbytes {want} ({quants.qtype(e.type).name} x {_fmt_ne(_trim(e.ne))})",
                         f"tensor {e.name}: index.txt nbytes disagrees with its type and shape")
            ok_type = e.type == e.src_type or (e.src_type == quants.BF16.id and e.type == quants.F32.id)
            if not ok_type:
                self.err(e.name, f"pool type {e.type}", f"pool type {e.src_type} (the source type; F32 for BF16 sources)",
                         f"tensor {e.name}: pool type differs from its source type")
            if e.offset % idx.align:
                self.err(e.name, f"offset {e.offset}", f"a multiple of align {idx.align}",
                         f"tensor {e.name}: pool offset {e.offset} is not aligned to {idx.align}")
            if size is not None and e.offset + e.nbytes > size:
                self.err(e.name, f"[{e.offset}, {e.offset + e.nbytes})", f"inside pool.bin ({size} bytes)",
                         f"tensor {e.name} runs past the end of pool.bin")
            if prev is not None:
                pend = prev.offset + prev.nbytes
                if pend > e.offset:
                    self.err(e.name, f"offset {e.offset}", f">= {pend} (end of {prev.name})",
                             f"tensor {e.name} at {e.offset} overlaps {prev.name} [{prev.offset}, {pend})")
                elif e.offset - pend >= idx.align:
                    # the one writer (packer.build.layout_pool) packs tensors densely at align multiples
                    self.err(e.name, f"offset {e.offset}", f"offset {(pend + idx.align - 1) // idx.align * idx.align} "
                             f"(first aligned byte after {prev.name})",
                             f"tensor {e.name}: a {e.offset - pend}-byte gap after {prev.name}: offset shifted?")
            elif e.offset >= idx.align:
                self.err(e.name, f"offset {e.offset}", "offset 0 (first tensor of the pool)",
                         f"tensor {e.name}: the pool starts with a {e.offset}-byte gap: offset shifted?")
            prev = e
            end = max(end, e.offset + e.nbytes)
        want_pool = (end + idx.align - 1) // idx.align * idx.align
        if idx.entries and idx.pool_bytes != want_pool:
            self.err(INDEX_FILE, f"pool {idx.pool_bytes}", f"pool {want_pool} (last tensor end {end} padded to {idx.align})",
                     "index.txt pool size disagrees with its tensors")

    # ------------------------------------------------------------------ 2. geometry
    def geometry(self, pack: Pack) -> Geometry | None:
        arch = pack.metadata.get("general.architecture")
        if arch != pack.arch:
            self.err(f"{METADATA_FILE}:general.architecture", arch, pack.arch, "metadata.txt and geometry.txt name different architectures")
        m = load_manifest(pack.arch)
        arrays: dict[str, list] = {}
        lengths: dict[str, int] = {}
        for name, p in m.params.items():
            key = p.key[1:] if p.key.startswith("/") else f"{pack.arch}.{p.key}"
            if p.array_len:
                n = self._array_len(pack, key)
                if n is not None:
                    lengths[key] = n
            elif p.kind in ("int_array", "bool_array") and pack.geometry_params.get(name, "none") not in ("none",):
                # metadata.txt holds scalars only (pack format): arrays come from geometry.txt
                v = pack.geometry_params[name]
                if "," in v or v == "-" or p.kind == "bool_array":
                    arrays[key] = [] if v == "-" else [int(x) for x in v.split(",")]
        try:
            g = geometry_from_metadata(pack.arch, pack.metadata, lengths, arrays)
        except ManifestError as e:
            self.err(METADATA_FILE, "metadata that does not resolve", f"the {pack.arch} contract", str(e))
            g = None
        try:
            gp = geometry_from_params(pack.arch, pack.geometry_params)
        except ManifestError as e:
            self.err(GEOMETRY_FILE, "unreadable params", f"the {pack.arch} contract", str(e))
            return g
        if g is None:
            return gp
        for name in m.params:
            a, b = g.values.get(name), gp.values.get(name)
            if a != b and not (isinstance(a, float) and isinstance(b, float) and np.float32(a) == np.float32(b)):
                self.err(f"{GEOMETRY_FILE}:{name}", b, f"{a} (from metadata.txt through the manifest)",
                         f"geometry.txt param {name} disagrees with the metadata")
        return g

    def _array_len(self, pack: Pack, key: str) -> int | None:
        if key == "tokenizer.ggml.tokens" and (self.path / VOCAB_FILE).exists():
            import pyarrow.parquet as pq

            return pq.read_metadata(self.path / VOCAB_FILE).num_rows
        return None  # geometry_from_metadata then names the missing key

    # ------------------------------------------------------------------ shards
    def shards(self, pack: Pack) -> tuple[list[GGUFHeader | None], dict[str, tuple[int, TensorInfo]]]:
        headers: list[GGUFHeader | None] = []
        tensors: dict[str, tuple[int, TensorInfo]] = {}
        if pack.experts is None:
            return headers, tensors
        for k, name in enumerate(pack.experts.shards):
            p = pack.shard_path(k)
            try:
                h = read_header(p)
            except (OSError, GGUFError, quants.GGMLTypeError) as e:
                self.err(f"shard {k} {name}", f"unreadable ({e})", "the GGUF shard the experts live in",
                         f"cannot re-read expert shard {k} at {p}")
                headers.append(None)
                continue
            headers.append(h)
            for t in h.tensors:
                if EXPERT_RE.match(t.name):
                    tensors[t.name] = (k, t)
        return headers, tensors

    # ------------------------------------------------------------------ 3. shapes
    def shapes(self, pack: Pack, g: Geometry, present: dict[str, tuple[tuple[int, ...], int]],
               expert_seen: bool) -> dict[str, tuple[TensorSpec, tuple[int, ...], int | None]]:
        expected = {name: (spec, ne, il) for name, spec, ne, il in g.expected_tensors()}
        for name, (ne, type_id) in present.items():
            if name not in expected:
                self.err(name, _fmt_ne(_trim(ne)), f"no such tensor in the {g.arch} contract",
                         f"unexpected tensor {name}")
                continue
            spec, want, _il = expected[name]
            if _pad4(_trim(ne)) != _pad4(want):
                self.err(name, _fmt_ne(_trim(ne)), _fmt_ne(want),
                         f"tensor {name} has shape {_fmt_ne(_trim(ne))}, its role requires {_fmt_ne(want)} (ggml ne order)")
            t = quants.QTYPES.get(type_id)
            allowed = spec.types
            if t is None:
                self.err(name, f"type id {type_id}", "a ggml type", f"tensor {name}: unknown type id {type_id}")
            elif allowed is not None and t.name not in allowed:
                self.err(name, t.name, " or ".join(allowed), f"tensor {name}: type {t.name} is not allowed for its role")
            elif allowed is None and not t.engine_supported:
                # the shape and the bytes still mean what they should, so the budget stands; the
                # engine refuses the type itself at load time
                self.warnings.append(AuditError(tensor=name, found=t.name, required="a type strata's engine has a kernel for",
                                                message=f"tensor {name}: type {t.name} has no strata engine kernel yet "
                                                        f"(the budget holds; strata's engine refuses the type at load)"))
        in_choice = {}
        for ch in g.manifest.choices:
            for opt in ch.options:
                for pat in opt:
                    in_choice[pat] = ch.name
        for name, (spec, want, il) in expected.items():
            if name in present or spec.optional or spec.choice is not None or name in in_choice:
                continue
            if spec.expert is not None and not expert_seen:
                continue  # reported once as unreadable shards
            self.err(name, "absent", _fmt_ne(want), f"missing tensor {name}")
        for ch in g.manifest.choices:
            n_layer = len(g.layer_kinds)
            for il in range(n_layer):
                opts = [[p.replace("{il}", str(il)) for p in opt] for opt in ch.options]
                opts = [[n for n in opt if n in expected] for opt in opts]
                if not any(opts):
                    continue
                if any(n in expected and expected[n][0].expert for opt in opts for n in opt) and not expert_seen:
                    continue
                full = [opt for opt in opts if opt and all(n in present for n in opt)]
                partial = [n for opt in opts for n in opt if n in present]
                if len(full) == 1 and set(partial) <= set(full[0]):
                    continue
                show = " | ".join("+".join(o) for o in opts if o)
                if not partial:
                    self.err(opts[0][0] if opts[0] else ch.name, "absent", f"exactly one of: {show}",
                             f"layer {il}: none of the {ch.name} options is present")
                else:
                    self.err(partial[0], "present: " + ", ".join(partial), f"exactly one complete option of: {show}",
                             f"layer {il}: the {ch.name} tensors present are not exactly one option")
        return expected

    # ------------------------------------------------------------------ 5. terms twice
    def terms(self, g: Geometry, present: dict[str, tuple[tuple[int, ...], int]], expected) -> dict[str, list[int]]:
        """Evaluate every [state] term per layer both ways; returns the metadata values per layer."""
        m = g.manifest

        def ne(name: str, d: int) -> int:
            name = name.replace("{il}", str(cur_il))
            if name not in present:
                raise _MissingTensor(name)
            shape = present[name][0]
            return int(shape[d]) if d < len(shape) else 1

        def has(name: str) -> bool:
            return name.replace("{il}", str(cur_il)) in present

        att = set(m.layers.attention_kinds)
        rec = set(m.layers.recurrent_kinds)
        values: dict[str, list[int]] = {k: [0] * len(g.layer_kinds) for k in STATE_TERMS}
        for term, where in STATE_TERMS.items():
            e_meta = getattr(m.state, term)
            e_tens = getattr(m.state_from_tensors, term)
            if e_meta == "0" and e_tens == "0":
                continue
            for il, kind in enumerate(g.layer_kinds):
                if where == "attention" and kind not in att or where == "recurrent" and kind not in rec:
                    continue
                cur_il = il
                env = g.layer_env(il)
                try:
                    a = int(g.eval(e_meta, il))
                except (ManifestError, TypeError, ZeroDivisionError) as x:
                    self.err(f"[state] {term}", "an expression that does not evaluate", "a number", f"layer {il}: {x}")
                    continue
                values[term][il] = a
                try:
                    b = int(evaluate(e_tens, {**env, "ne": ne, "has": has}))
                except _MissingTensor as x:
                    self.err(str(x), "absent", f"a tensor to derive {term} of layer {il} from",
                             f"{term} of layer {il} cannot be derived from the tensors: {x} is missing")
                    continue
                except (ManifestError, TypeError, ZeroDivisionError) as x:
                    self.err(f"[state_from_tensors] {term}", "an expression that does not evaluate", "a number",
                             f"layer {il}: {x}")
                    continue
                names = [n.replace("{il}", str(il)) for n in _NE_NAME.findall(e_tens)]
                names = [n for n in names if n in present]
                # name the tensor the disagreement comes from: one whose shape is not its role's
                names = [n for n in names if n in expected and _pad4(present[n][0]) != _pad4(expected[n][1])] + names
                names = names or [f"[state] {term}"]
                self.checks.append(TermCheck(term=term, where=f"layer {il}", unit="elements", from_metadata=a, from_tensors=b))
                if a != b:
                    self.err(names[0], f"{term} = {b} elements per layer {il} (from the tensor shapes: {e_tens})",
                             f"{term} = {a} (from the metadata: {e_meta})",
                             f"budget term {term} of layer {il} disagrees between the metadata and the tensors")
        return values

    # ------------------------------------------------------------------ 4. experts
    def experts(self, pack: Pack, g: Geometry, expected, shard_tensors, headers) -> list[ExpertLayerFacts]:
        ne_tab = pack.experts
        out: list[ExpertLayerFacts] = []
        if ne_tab is None:
            moe = sorted({il for _n, (s, _ne, il) in expected.items() if s.expert and il is not None})
            if moe:
                self.err(EXPERTS_FILE, "absent", f"rows for the MoE layers {moe[0]}..{moe[-1]}",
                         "the contract has routed experts but the pack has no native_experts.txt")
            return out
        n_expert = int(g.get("n_expert", 0) or 0)
        if ne_tab.n_expert != n_expert:
            self.err(f"{EXPERTS_FILE}:n_expert", ne_tab.n_expert, f"{n_expert} (expert_count)", "expert count disagrees with the metadata")
        n_embd, n_ff = int(g["n_embd"]), int(g.get("n_ff_exp", 0) or 0)
        moe_layers = sorted({il for _n, (s, _ne, il) in expected.items() if s.expert and il is not None})
        rows = {r.layer: r for r in ne_tab.layers}
        for il in moe_layers:
            if il not in rows:
                self.err(f"blk.{il}.ffn_down_exps.weight", "no row in native_experts.txt", "one row per MoE layer",
                         f"layer {il} has routed experts in the contract but no native_experts.txt row")
        for il in rows:
            if il not in moe_layers:
                self.err(f"{EXPERTS_FILE}:layer {il}", "a row", "no row (not an MoE layer)", f"unexpected expert layer {il}")
        arena = 0
        total = 0
        max_blob = 0
        shards_ok = all(h is not None for h in headers)
        for r in ne_tab.layers:
            where = f"{EXPERTS_FILE}:layer {r.layer}"
            if not self._expert_parts_fit(r, n_embd, n_ff):
                # named above; keep the running sums on the file's own numbers so later layers are
                # judged on their own rows, not on this one's
                arena += ne_tab.n_expert * r.blob_bytes
                total += ne_tab.n_expert * r.blob_bytes
                max_blob = max(max_blob, r.blob_bytes)
                continue
            parts_src = {p: quants.tensor_nbytes(t, F.expert_part_ne(p, n_embd, n_ff))
                         for p, t in (("gate", r.gate_type), ("up", r.up_type), ("down", r.down_type))}
            blob_meta = F.expert_blob_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff)
            blob_engine = F.expert_blob_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff, engine=True)
            if r.blob_bytes != blob_meta:
                self.err(f"blk.{r.layer}.ffn_down_exps.weight", f"blob_bytes {r.blob_bytes} ({where})",
                         f"blob_bytes {blob_meta} = gate {parts_src['gate']} + up {parts_src['up']} + down {parts_src['down']} "
                         f"({quants.qtype(r.gate_type).name}/{quants.qtype(r.up_type).name}/{quants.qtype(r.down_type).name} "
                         f"at n_embd {n_embd}, n_ff_exp {n_ff})",
                         f"layer {r.layer}: per-expert blob_bytes disagrees with its types and the geometry")
            for p in ("gate", "up", "down"):
                got = getattr(r, f"{p}_bytes")
                if got != parts_src[p]:
                    self.err(f"blk.{r.layer}.ffn_{p}_exps.weight", f"{p}_bytes {got} ({where})", f"{p}_bytes {parts_src[p]}",
                             f"layer {r.layer}: {p} bytes per expert disagree with the type and the geometry")
            if r.gate_bytes + r.up_bytes + r.down_bytes != r.blob_bytes:
                self.err(f"blk.{r.layer}.ffn_down_exps.weight", f"blob_bytes {r.blob_bytes} ({where})",
                         f"gate_bytes + up_bytes + down_bytes = {r.gate_bytes + r.up_bytes + r.down_bytes}",
                         f"layer {r.layer}: blob_bytes is not the sum of its parts")
            if r.arena_offset != arena:
                self.err(f"blk.{r.layer}.ffn_gate_exps.weight", f"arena_offset {r.arena_offset} ({where})",
                         f"arena_offset {arena} (running sum of n_expert x blob_bytes)",
                         f"layer {r.layer}: arena offset disagrees with the blobs before it")
            arena += ne_tab.n_expert * blob_meta
            total += ne_tab.n_expert * blob_meta
            max_blob = max(max_blob, blob_meta)
            if shards_ok:
                self._expert_vs_shards(r, shard_tensors, ne_tab.n_expert)
            out.append(ExpertLayerFacts(layer=r.layer, gate_type=r.gate_type, up_type=r.up_type, down_type=r.down_type,
                                        blob_bytes=blob_meta, blob_engine_bytes=blob_engine,
                                        slot_bytes=F.expert_slot_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff)))
        if ne_tab.total != total:
            self.err(f"{EXPERTS_FILE}:total", ne_tab.total, f"{total} (n_expert x sum of recomputed blobs)", "expert total disagrees")
        if ne_tab.max_blob != max_blob:
            self.err(f"{EXPERTS_FILE}:max_blob", ne_tab.max_blob, f"{max_blob} (largest recomputed blob)", "max_blob disagrees")
        return out

    def _expert_parts_fit(self, r, n_embd: int, n_ff: int) -> bool:
        """Can one expert's gate, up and down slices (geometry n_embd x n_ff_exp) be stored in their
        types' blocks at all? Each part that cannot is an error naming the tensor, the slice's ne
        and the block size (a geometry that makes the byte formulas undefined, never a traceback)."""
        ok = True
        for p, t in (("gate", r.gate_type), ("up", r.up_type), ("down", r.down_type)):
            ne = F.expert_part_ne(p, n_embd, n_ff)
            try:
                quants.tensor_nbytes(t, ne)
            except quants.GGMLTypeError as x:
                self.err(f"blk.{r.layer}.ffn_{p}_exps.weight", f"{p}_type {t} (native_experts.txt layer {r.layer})",
                         "a ggml type id", f"layer {r.layer}: {x}")
                ok = False
            except quants.ShapeError:
                q = quants.qtype(t)
                self.err(f"blk.{r.layer}.ffn_{p}_exps.weight", f"one expert's {p} slice ne {_fmt_ne(ne)} of {q.name}",
                         f"ne[0] a multiple of the {q.name} block of {q.block_elems}",
                         f"layer {r.layer}: one expert's {p} slice {_fmt_ne(ne)} (from n_embd {n_embd}, n_ff_exp {n_ff}) "
                         f"is not whole {q.name} blocks of {q.block_elems}: ne[0] = {ne[0]}")
                ok = False
        return ok

    def _expert_vs_shards(self, r, shard_tensors, n_expert: int) -> None:
        """Types, offsets and strides of one native_experts.txt row against the shard tensor table;
        the blob again from the strides (the tensor-path derivation of the term)."""
        il = r.layer
        fused = f"blk.{il}.ffn_gate_up_exps.weight"
        blob_t = 0
        for p in ("gate", "up", "down"):
            name = f"blk.{il}.ffn_{p}_exps.weight"
            if p in ("gate", "up") and fused in shard_tensors and name not in shard_tensors:
                k, t = shard_tensors[fused]
                stride = t.nbytes // t.ne[2] if len(t.ne) == 3 and t.ne[2] else 0
                want_off = t.abs_offset + (stride // 2 if p == "up" else 0)
                want_bytes = stride // 2
                shown = fused
            elif name in shard_tensors:
                k, t = shard_tensors[name]
                stride = t.nbytes // t.ne[2] if len(t.ne) == 3 and t.ne[2] else 0
                want_off, want_bytes, shown = t.abs_offset, stride, name
            else:
                continue  # named by the shape check as missing
            for field, got, want in ((f"{p}_type", getattr(r, f"{p}_type"), t.type_id), (f"{p}_shard", getattr(r, f"{p}_shard"), k),
                                     (f"{p}_off", getattr(r, f"{p}_off"), want_off), (f"{p}_stride", getattr(r, f"{p}_stride"), stride),
                                     (f"{p}_bytes", getattr(r, f"{p}_bytes"), want_bytes)):
                if got != want:
                    self.err(shown, f"{field} {got} (native_experts.txt layer {il})", f"{field} {want} (shard tensor table)",
                             f"layer {il}: {field} disagrees with the shard's tensor table")
            if len(t.ne) == 3 and t.ne[2] != n_expert:
                self.err(shown, f"{t.ne[2]} experts (ne[2])", f"{n_expert}", f"tensor {shown}: expert count disagrees")
            blob_t += want_bytes
        self.checks.append(TermCheck(term="expert blob", where=f"layer {il}", unit="bytes", from_metadata=r.blob_bytes,
                                     from_tensors=blob_t))
        if blob_t != r.blob_bytes:
            self.err(f"blk.{il}.ffn_down_exps.weight", f"blob {blob_t} B (from the shard strides)",
                     f"blob_bytes {r.blob_bytes} (native_experts.txt)", f"layer {il}: expert blob disagrees with the shard strides")

    # ------------------------------------------------------------------ dense twice + widened + BF16
    def dense(self, pack: Pack, expected) -> list[DenseTensor]:
        meta_engine = tens_engine = meta_pack = 0
        wid_reg = wid_pack = bf_reg = bf_pack = 0
        out = []
        differ: list[str] = []  # tensors whose bytes differ between the two derivations
        for e in pack.index.entries:
            ne = _trim(e.ne)
            try:
                f = F.engine_form(e.type, e.src_type, ne)
            except (quants.GGMLTypeError, quants.ShapeError):
                continue  # named by the pool check
            out.append(DenseTensor(name=e.name, type=e.type, src_type=e.src_type, ne=ne))
            tens_engine += f.engine
            if e.name in expected:
                want = expected[e.name][1]
                try:
                    meta_pack += quants.tensor_nbytes(e.type, want)
                    meta_engine += quants.engine_nbytes(e.type, e.src_type, want)
                    if quants.tensor_nbytes(e.type, want) != e.nbytes:
                        differ.append(e.name)
                except quants.ShapeError:
                    differ.append(e.name)  # its shape error says why
            t = quants.QTYPES[e.type]
            wid_reg += f.widened_extra
            wid_pack += e.nbytes // t.block_bytes * t.widen_extra_bytes
            if e.src_type == quants.BF16.id:
                bf_reg += 2 * quants.n_elements(ne)
                bf_pack += e.nbytes // 2
        known = [e for e in pack.index.entries if e.name in expected]
        self.checks += [
            TermCheck(term="dense weights, pack form", where="tensors in the contract", unit="bytes",
                      from_metadata=meta_pack, from_tensors=sum(e.nbytes for e in known)),
            TermCheck(term="dense weights, engine form", where="all dense tensors", unit="bytes",
                      from_metadata=meta_engine + sum(F.engine_form(e.type, e.src_type, _trim(e.ne)).engine
                                                      for e in pack.index.entries if e.name not in expected
                                                      and e.type in quants.QTYPES),
                      from_tensors=tens_engine),
            TermCheck(term="widened scale bytes", where="all dense tensors", unit="bytes", from_metadata=wid_reg, from_tensors=wid_pack),
            TermCheck(term="bf16 saved bytes", where="all dense tensors", unit="bytes", from_metadata=bf_reg, from_tensors=bf_pack),
        ]
        for c in self.checks[-4:]:
            if not c.ok:
                more = f" (tensors that differ: {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''})" if differ else ""
                self.err(differ[0] if differ else f"[{c.term}]", f"{c.from_tensors} B (from index.txt)",
                         f"{c.from_metadata} B (from the registry and the contract)",
                         f"budget term '{c.term}' disagrees between the contract and the pack{more}")
        return out

    def bf16_values(self, pack: Pack) -> tuple[int, int]:
        pool = self.path / POOL_FILE
        bf = [e for e in pack.index.entries if e.src_type == quants.BF16.id]
        scanned = 0
        for e in bf:
            if e.type != quants.F32.id:
                self.err(e.name, f"pool type {quants.QTYPES.get(e.type, e.type)}", "F32 (BF16 promoted: bf16 << 16)",
                         f"tensor {e.name}: a BF16 source must be F32 in the pool")
        if not self.bf16_scan or not bf or not pool.exists():
            return len(bf), 0
        size = pool.stat().st_size
        with open(pool, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            for e in bf:
                if e.type != quants.F32.id or e.offset + e.nbytes > size or e.offset % 4:
                    continue  # named above or by the pool layout check
                n = e.nbytes // 4
                bad, first, first_v = _bf16_scan(mm, e.offset, n)
                scanned += n
                if bad:
                    self.err(e.name, f"{bad} of {n} values with nonzero low 16 bits (first: element {first} = 0x{first_v:08x})",
                             "every value bf16-exact (low 16 bits zero: the pool holds bf16 << 16)",
                             f"tensor {e.name}: BF16-source values are not bf16-exact, re-rounding to 16 bits would change them")
        finally:
            mm.close()
        return len(bf), scanned


_LOW16 = np.uint64(0x0000FFFF0000FFFF)


def _bf16_scan(mm: mmap.mmap, offset: int, n: int) -> tuple[int, int | None, int]:
    """Count the f32 values of ``[offset, offset + 4n)`` whose low 16 bits are not zero; returns
    ``(bad, first bad element, its bits)``. Two f32 per u64 masked at once, in bounded chunks (the
    common all-clean case reads each byte once); only a dirty chunk is looked at value by value.
    Every numpy view of ``mm`` dies with this frame, so the caller can close the map."""
    bad, first, first_v = 0, None, 0
    for s in range(0, n, BF16_SCAN_CHUNK):
        k = min(BF16_SCAN_CHUNK, n - s)
        pairs = np.frombuffer(mm, dtype="<u8", count=k // 2, offset=offset + 4 * s)
        dirty = bool(np.bitwise_and(pairs, _LOW16).any())
        if k % 2:
            dirty = dirty or bool(np.frombuffer(mm, dtype="<u4", count=1, offset=offset + 4 * (s + k - 1))[0] & 0xFFFF)
        if dirty:
            u32 = np.frombuffer(mm, dtype="<u4", count=k, offset=offset + 4 * s)
            nz = np.flatnonzero(u32 & 0xFFFF)
            bad += len(nz)
            if first is None:
                first, first_v = s + int(nz[0]), int(u32[nz[0]])
    return bad, first, first_v


class _MissingTensor(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def audit_pack(path: str | os.PathLike, *, bf16_scan: bool = True) -> AuditResult:
    """Audit the pack directory ``path`` (see the module docstring for every check).

    Returns an :class:`AuditResult` whose ``errors`` lists every failure (empty: the pack means
    what the kernels assume) and whose ``facts`` feed :func:`strata.budget.plan.make_plan`.

    Raises:
        PackFormatError: a pack file that the strict readers refuse (not a pack, malformed lines).
        ManifestError: no contract for the pack's architecture.
    """
    t0 = time.perf_counter()
    path = Path(path)
    if not path.is_dir():
        raise PackFormatError(f"{path}: not a pack directory")
    a = _Auditor(path, bf16_scan)
    pack = a.read()
    t = a.timed("read", t0)
    a.pool_layout(pack)
    t = a.timed("pool layout", t)
    g = a.geometry(pack)
    t = a.timed("geometry", t)
    res = AuditResult(pack=str(path), arch=pack.arch, bf16_scan=bf16_scan, dense_tensors=len(pack.index.entries))
    if g is None:
        res.errors, res.warnings, res.checks, res.seconds = a.errors, a.warnings, a.checks, a.seconds
        return res
    headers, shard_tensors = a.shards(pack)
    t = a.timed("shard headers", t)
    present: dict[str, tuple[tuple[int, ...], int]] = {e.name: (_trim(e.ne), e.src_type) for e in pack.index.entries}
    for name, (_k, ti) in shard_tensors.items():
        if name in present:
            a.err(name, "in index.txt and among the shard experts", "one place", f"tensor {name} is both dense and an expert")
        present[name] = (tuple(ti.ne), ti.type_id)
    expert_seen = pack.experts is None or all(h is not None for h in headers)
    expected = a.shapes(pack, g, present, expert_seen)
    t = a.timed("shapes", t)
    values = a.terms(g, present, expected)
    t = a.timed("terms twice", t)
    expert_facts = a.experts(pack, g, expected, shard_tensors, headers)
    t = a.timed("experts", t)
    dense = a.dense(pack, expected)
    t = a.timed("dense, widened", t)
    res.bf16_tensors, res.bf16_values_scanned = a.bf16_values(pack)
    t = a.timed("bf16 scan", t)
    m = g.manifest
    att, rec = set(m.layers.attention_kinds), set(m.layers.recurrent_kinds)
    names = {e.name for e in pack.index.entries}
    head = "output.weight" if "output.weight" in names else ("token_embd.weight" if "token_embd.weight" in names else None)
    res.facts = ModelFacts(
        arch=g.arch, n_ctx_train=int(g["n_ctx_train"]), n_vocab=int(g.get("n_vocab", 0) or 0), dense=dense, head=head,
        embeddings="token_embd.weight" if "token_embd.weight" in names else None,
        kv_layers=[F.KVLayer(il, values["k_per_token"][il], values["v_per_token"][il], values["indexer_k_per_token"][il],
                             g.layer_window(il)) for il, k in enumerate(g.layer_kinds) if k in att],
        recurrent_layers=[F.RecurrentLayer(il, values["conv_state"][il], values["ssm_state"][il])
                          for il, k in enumerate(g.layer_kinds) if k in rec],
        act_per_token=max(values["act_per_token"], default=0), logits_per_token=max(values["logits_per_token"], default=0),
        n_expert=int(g.get("n_expert", 0) or 0) if expert_facts else 0, expert_layers=expert_facts,
        head_dim=int(g.get("head_dim") or 0) if any(k in att for k in g.layer_kinds) else 0,
        head_dim_v=int(g.get("head_dim_v") or g.get("head_dim") or 0) if any(k in att for k in g.layer_kinds) else 0,
        n_embd=int(g["n_embd"]), n_ff_exp=int(g.get("n_ff_exp", 0) or 0) if expert_facts else 0,
        # rope tables: one per distinct rope base the layers use (rope_base, rope_base_swa, ...)
        rope_dim=int(g.get("rope_dim") or g.get("head_dim") or 0) if any(k in att for k in g.layer_kinds) else 0,
        rope_tables=len({float(g[n]) for n in m.params if n.startswith("rope_base") and g.get(n) is not None})
        if any(k in att for k in g.layer_kinds) else 0,
    )
    res.expert_layers = len(expert_facts)
    res.errors, res.warnings, res.checks = a.errors, a.warnings, a.checks
    a.timed("facts", t)
    res.seconds = a.seconds
    return res


__all__ = ["AuditError", "AuditResult", "STATE_TERMS", "TermCheck", "audit_pack"]
