"""The semantic audit of a pack: does every tensor mean what the kernels assume?

Why semantics and not totals (docs/DESIGN.md "Every budget term twice"): an error that makes a budget
term too big makes the budget tighter, and only errors that loosen a budget trip a total. So this audit
checks meaning, and collects every failure (never just the first):

1. Pool layout: offsets aligned, no overlaps or gaps, ranges inside pool.bin, sizes equal to
   type x shape, pool types consistent with source types.
2. Geometry: resolved from metadata.txt through the architecture's manifest, and compared
   param by param with geometry.txt; every metadata key llama.cpp reads honoured or refused (the
   manifest's ``[keys]``: each refused key an error naming key, value and what strata implements).
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
6. BF16: every BF16-source tensor is F32 in the pool with the low 16 bits of every value zero
   (:mod:`strata.budget.audit_bf16`).

Each error names the tensor, what was found and what is required.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from strata.layout import engine_form as LE
from strata.layout import experts as LX
from strata.layout import kv as LK
from strata.manifests.contract import (
    Geometry,
    ManifestError,
    StateSpec,
    evaluate,
)
from strata.manifests.keys import Refusal
from strata.manifests.names import is_per_layer, tensor_name
from strata.packer import quants
from strata.packer.conformance import check_conformance, expert_tensors
from strata.packer.findings import Finding, pad4, trim_ne
from strata.packer.gguf_file import GGUFError, GGUFHeader, TensorInfo, read_header
from strata.packer.pack import Pack, not_a_pack, pool_layout_findings, read_pack
from strata.packer.pack_geometry import pack_geometry
from strata.packer.packfmt import METADATA_FILE, POOL_FILE, NotAPackError

from .audit_bf16 import bf16_values
from .plan import DenseTensor, ExpertLayerFacts, ModelFacts

#: The [state] terms and the layer kinds they are evaluated on ("attention", "recurrent", "all").
STATE_TERMS: dict[str, str] = {
    "k_per_token": "attention",
    "v_per_token": "attention",
    "indexer_k_per_token": "attention",
    "conv_state": "recurrent",
    "ssm_state": "recurrent",
    "act_per_token": "all",
    "logits_per_token": "all",
}
assert set(STATE_TERMS) == set(StateSpec.model_fields), "every [state] term needs its layer kinds here"
_NE_ROLE = re.compile(r"""ne\(\s*['"]([^'"]+)['"]""")


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
    warnings: list[AuditError] = Field(
        default_factory=list
    )  # not semantic errors (e.g. types with no engine kernel yet)
    checks: list[TermCheck] = Field(default_factory=list)
    facts: ModelFacts | None = None
    dense_tensors: int = 0
    expert_layers: int = 0
    bf16_tensors: int = 0
    bf16_values_scanned: int = 0
    bf16_scan: bool = True
    seconds: dict[str, float] = Field(default_factory=dict)
    #: "pack" (a built pack), or "gguf header" (``strata-budget check FILE.gguf``: the tables the build would write,
    #: from the GGUF headers; no BF16 value scan, the pool is not copied)
    planned_from: str = "pack"

    @property
    def ok(self) -> bool:
        return not self.errors


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

    def findings(self, found: list[Finding]) -> None:
        """Add findings of the shared checks (pool layout, conformance) as errors."""
        for f in found:
            self.err(f.tensor, f.found, f.required, f.message)

    # ------------------------------------------------------------------ 2. geometry
    def geometry(self, pack: Pack) -> Geometry | None:
        """Both resolutions of the geometry compared (:func:`strata.packer.pack_geometry.pack_geometry`, the rule
        the engine's load applies): every finding and every refused key an error; the metadata's geometry."""
        pg = pack_geometry(pack)
        self.findings(pg.findings)
        self.refused(pg.refusals)
        return pg.geometry

    def refused(self, refusals: list[Refusal]) -> None:
        """One error per refused metadata key (:func:`strata.manifests.keys.key_refusals`)."""
        for r in refusals:
            self.err(f"{METADATA_FILE}:{r.key}", r.value, r.implements, r.message)

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
                self.err(
                    f"shard {k} {name}",
                    f"unreadable ({e})",
                    "the GGUF shard the experts live in",
                    f"cannot re-read expert shard {k} at {p}"
                    + (
                        f": {str(e).removeprefix(f'{p}: ')}"
                        if p.exists()
                        else " (--source-dir names the directory it is in now)"
                        if pack.source_dir_override is not None
                        else " (moved? pass --source-dir DIR)"
                    ),
                )
                headers.append(None)
                continue
            headers.append(h)
            tensors.update(expert_tensors(h, k))
        return headers, tensors

    def engine_types(self, expected, present: dict[str, tuple[tuple[int, ...], int]]) -> None:
        """Warn (not an error: the budget holds) about types strata's engine has no kernel for, on
        roles whose contract allows any type; the engine refuses them itself at load."""
        for name, (_ne, type_id) in present.items():
            spec = expected.get(name, (None,))[0]
            t = quants.QTYPES.get(type_id)
            if spec is None or t is None or spec.types is not None or t.engine_supported:
                continue
            self.warnings.append(
                AuditError(
                    tensor=name,
                    found=t.name,
                    required="a type strata's engine has a kernel for",
                    message=f"tensor {name}: type {t.name} has no strata engine kernel yet "
                    f"(the budget holds; strata's engine refuses the type at load)",
                )
            )

    # ------------------------------------------------------------------ 5. terms twice
    def terms(
        self, g: Geometry, present: dict[str, tuple[tuple[int, ...], int]], expected, shards_read: bool = True
    ) -> dict[str, list[int]]:
        """Evaluate every [state] term per layer both ways; returns the metadata values per layer. ``shards_read``
        False: an expert shard was unreadable (its own error says why), so a tensor that index.txt does not hold is
        not reported missing again for every term and layer (a dense tensor missing from index.txt is reported by the
        conformance check)."""
        m = g.manifest

        def at(role: str) -> str:
            return tensor_name(role, cur_il if is_per_layer(role) else None)

        def ne(role: str, d: int) -> int:
            name = at(role)
            if name not in present:
                raise _MissingTensor(name)
            shape = present[name][0]
            return int(shape[d]) if d < len(shape) else 1

        def has(role: str) -> bool:
            return at(role) in present

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
                    if not shards_read:
                        continue  # an expert tensor of an unreadable shard (said once, by shards()); a dense one
                        # missing from index.txt is the conformance check's error
                    self.err(
                        str(x),
                        "absent",
                        f"a tensor to derive {term} of layer {il} from",
                        f"{term} of layer {il} cannot be derived from the tensors: {x} is missing",
                    )
                    continue
                except (ManifestError, TypeError, ZeroDivisionError) as x:
                    self.err(
                        f"[state_from_tensors] {term}",
                        "an expression that does not evaluate",
                        "a number",
                        f"layer {il}: {x}",
                    )
                    continue
                names = [at(r) for r in _NE_ROLE.findall(e_tens)]
                names = [n for n in names if n in present]
                # name the tensor the disagreement comes from: one whose shape is not its role's
                names = [n for n in names if n in expected and pad4(present[n][0]) != pad4(expected[n][1])] + names
                names = names or [f"[state] {term}"]
                self.checks.append(
                    TermCheck(term=term, where=f"layer {il}", unit="elements", from_metadata=a, from_tensors=b)
                )
                if a != b:
                    self.err(
                        names[0],
                        f"{term} = {b} elements per layer {il} (from the tensor shapes: {e_tens})",
                        f"{term} = {a} (from the metadata: {e_meta})",
                        f"budget term {term} of layer {il} disagrees between the metadata and the tensors",
                    )
        return values

    # ------------------------------------------------------------------ 4. experts
    def expert_facts(self, pack: Pack, g: Geometry, blob_from_tensors: dict[int, int]) -> list[ExpertLayerFacts]:
        """Per MoE layer: one expert's bytes (source and engine form, slot) from its types and the
        geometry (the conformance check compared them with the row); the blob again from the shard
        strides where the shards were read (the second derivation of the term)."""
        out: list[ExpertLayerFacts] = []
        if pack.experts is None:
            return out
        n_embd, n_ff = int(g["n_embd"]), int(g.get("n_ff_exp", 0) or 0)
        for r in pack.experts.layers:
            try:
                blob = LX.expert_blob_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff)
                engine = LX.expert_blob_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff, engine=True)
                slot = LX.expert_slot_bytes(r.gate_type, r.up_type, r.down_type, n_embd, n_ff)
            except (quants.GGMLTypeError, quants.ShapeError):
                blob, engine, slot = r.blob_bytes, r.blob_bytes, None  # named by the conformance check
            if r.layer in blob_from_tensors:
                self.checks.append(
                    TermCheck(
                        term="expert blob",
                        where=f"layer {r.layer}",
                        unit="bytes",
                        from_metadata=r.blob_bytes,
                        from_tensors=blob_from_tensors[r.layer],
                    )
                )
                if blob_from_tensors[r.layer] != r.blob_bytes:
                    self.err(
                        tensor_name("ffn_down_exps.weight", r.layer),
                        f"blob {blob_from_tensors[r.layer]} B (from the shard strides)",
                        f"blob_bytes {r.blob_bytes} (native_experts.txt)",
                        f"layer {r.layer}: expert blob disagrees with the shard strides",
                    )
            out.append(
                ExpertLayerFacts(
                    layer=r.layer,
                    gate_type=r.gate_type,
                    up_type=r.up_type,
                    down_type=r.down_type,
                    blob_bytes=blob,
                    blob_engine_bytes=engine,
                    slot_bytes=slot,
                )
            )
        return out

    # ------------------------------------------------------------------ dense twice + widened + BF16
    def dense(self, pack: Pack, expected) -> list[DenseTensor]:
        meta_engine = tens_engine = meta_pack = 0
        wid_reg = wid_pack = bf_reg = bf_pack = 0
        out = []
        differ: list[str] = []  # tensors whose bytes differ between the two derivations
        for e in pack.index.entries:
            ne = trim_ne(e.ne)
            try:
                f = LE.engine_form(e.type, e.src_type, ne)
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
            TermCheck(
                term="dense weights, pack form",
                where="tensors in the contract",
                unit="bytes",
                from_metadata=meta_pack,
                from_tensors=sum(e.nbytes for e in known),
            ),
            TermCheck(
                term="dense weights, engine form",
                where="all dense tensors",
                unit="bytes",
                from_metadata=meta_engine
                + sum(
                    LE.engine_form(e.type, e.src_type, trim_ne(e.ne)).engine
                    for e in pack.index.entries
                    if e.name not in expected and e.type in quants.QTYPES
                ),
                from_tensors=tens_engine,
            ),
            TermCheck(
                term="widened scale bytes",
                where="all dense tensors",
                unit="bytes",
                from_metadata=wid_reg,
                from_tensors=wid_pack,
            ),
            TermCheck(
                term="bf16 saved bytes",
                where="all dense tensors",
                unit="bytes",
                from_metadata=bf_reg,
                from_tensors=bf_pack,
            ),
        ]
        for c in self.checks[-4:]:
            if not c.ok:
                more = (
                    f" (tensors that differ: {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''})"
                    if differ
                    else ""
                )
                self.err(
                    differ[0] if differ else f"[{c.term}]",
                    f"{c.from_tensors} B (from index.txt)",
                    f"{c.from_metadata} B (from the registry and the contract)",
                    f"budget term '{c.term}' disagrees between the contract and the pack{more}",
                )
        return out

    def bf16_values(self, pack: Pack) -> tuple[int, int]:
        """6. BF16, every failure an error (:func:`strata.budget.audit_bf16.bf16_values`)."""
        return bf16_values(self.path / POOL_FILE, pack.index.entries, self.bf16_scan, self.err)


class _MissingTensor(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def audit_pack(
    path: str | os.PathLike, *, bf16_scan: bool = True, source_dir: str | os.PathLike | None = None
) -> AuditResult:
    """Audit the pack directory ``path`` (see the module docstring for every check); ``source_dir``: where the
    source shards are now if they moved since the build (:meth:`strata.packer.pack.Pack.source_path`).

    Returns an :class:`AuditResult` whose ``errors`` lists every failure (empty: the pack means
    what the kernels assume) and whose ``facts`` feed :func:`strata.budget.plan.make_plan`.

    Raises:
        PackFormatError: a pack file that the strict readers refuse (not a pack, malformed lines).
        ManifestError: no contract for the pack's architecture.
    """
    t0 = time.perf_counter()
    path = Path(path)
    why = not_a_pack(path)
    if why:
        raise NotAPackError(why)
    a = _Auditor(path, bf16_scan)
    pack = read_pack(path, source_dir=source_dir)  # source_dir: where the source shards are now (strata-pack verify's)
    t = a.timed("read", t0)
    pool = path / POOL_FILE
    a.findings(pool_layout_findings(pack.index, pool.stat().st_size if pool.is_file() else None))
    t = a.timed("pool layout", t)
    g = a.geometry(pack)
    t = a.timed("geometry", t)
    res = AuditResult(pack=str(path), arch=pack.arch, bf16_scan=bf16_scan, dense_tensors=len(pack.index.entries))
    if g is None:
        res.errors, res.warnings, res.checks, res.seconds = a.errors, a.warnings, a.checks, a.seconds
        return res
    headers, shard_tensors = a.shards(pack)
    t = a.timed("shard headers", t)
    shards_ok = pack.experts is None or all(h is not None for h in headers)
    conf = check_conformance(g, pack.index.entries, pack.experts, shard_tensors if shards_ok else None)
    a.findings(conf.findings)
    expected = conf.expected
    present: dict[str, tuple[tuple[int, ...], int]] = {e.name: (trim_ne(e.ne), e.src_type) for e in pack.index.entries}
    present.update({name: (tuple(ti.ne), ti.type_id) for name, (_k, ti) in shard_tensors.items()})
    a.engine_types(expected, present)
    t = a.timed("shapes", t)
    values = a.terms(g, present, expected, shards_ok)
    t = a.timed("terms twice", t)
    expert_facts = a.expert_facts(pack, g, conf.expert_blob_from_tensors)
    t = a.timed("experts", t)
    dense = a.dense(pack, expected)
    t = a.timed("dense, widened", t)
    res.bf16_tensors, res.bf16_values_scanned = a.bf16_values(pack)
    t = a.timed("bf16 scan", t)
    m = g.manifest
    att, rec = set(m.layers.attention_kinds), set(m.layers.recurrent_kinds)
    names = {e.name for e in pack.index.entries}
    head = (
        "output.weight" if "output.weight" in names else ("token_embd.weight" if "token_embd.weight" in names else None)
    )
    res.facts = ModelFacts(
        arch=g.arch,
        n_ctx_train=int(g["n_ctx_train"]),
        n_vocab=int(g.get("n_vocab", 0) or 0),
        dense=dense,
        head=head,
        embeddings="token_embd.weight" if "token_embd.weight" in names else None,
        kv_layers=[
            LK.KVLayer(
                il,
                values["k_per_token"][il],
                values["v_per_token"][il],
                values["indexer_k_per_token"][il],
                g.layer_window(il),
            )
            for il, k in enumerate(g.layer_kinds)
            if k in att
        ],
        recurrent_layers=[
            LK.RecurrentLayer(il, values["conv_state"][il], values["ssm_state"][il])
            for il, k in enumerate(g.layer_kinds)
            if k in rec
        ],
        act_per_token=max(values["act_per_token"], default=0),
        logits_per_token=max(values["logits_per_token"], default=0),
        n_expert=int(g.get("n_expert", 0) or 0) if expert_facts else 0,
        expert_layers=expert_facts,
        head_dim=int(g.get("head_dim") or 0) if any(k in att for k in g.layer_kinds) else 0,
        head_dim_v=int(g.get("head_dim_v") or g.get("head_dim") or 0) if any(k in att for k in g.layer_kinds) else 0,
        n_embd=int(g["n_embd"]),
        n_ff_exp=int(g.get("n_ff_exp", 0) or 0) if expert_facts else 0,
        # rope tables: one per distinct (rope base, frequency scale) the layers use: rope_base with
        # rope_freq_scale, rope_base_swa with rope_freq_scale_swa (else rope_freq_scale), ...
        rope_dim=int(g.get("rope_dim") or g.get("head_dim") or 0) if any(k in att for k in g.layer_kinds) else 0,
        rope_tables=len(rope_tables(g)) if any(k in att for k in g.layer_kinds) else 0,
        n_layer=g.n_trunk,
        n_head=int(g.get("n_head") or 0),
        n_expert_used=int(g.get("n_expert_used") or 0),
        draft_layers=g.draft_layers,
    )
    res.expert_layers = len(expert_facts)
    res.errors, res.warnings, res.checks = a.errors, a.warnings, a.checks
    a.timed("facts", t)
    res.seconds = a.seconds
    return res


def rope_tables(g: Geometry) -> set[tuple[float, float]]:
    """The distinct ``(base, frequency scale)`` rope tables of ``g``: every ``rope_base<suffix>`` param
    with the ``rope_freq_scale<suffix>`` number of the same suffix (else ``rope_freq_scale``, else 1):
    the engine's tables (:meth:`strata.engine.decoder.Decoder.rope_keys`, keyed the same way by its
    recipe's ``rope_base`` / ``rope_scale`` params)."""
    out = set()
    for n in g.manifest.params:
        if n.startswith("rope_base") and g.get(n) is not None:
            suffix = n[len("rope_base") :]
            scale = g.get("rope_freq_scale" + suffix, g.get("rope_freq_scale", 1.0))
            out.add((float(g[n]), float(scale)))
    return out


__all__ = ["AuditError", "AuditResult", "STATE_TERMS", "TermCheck", "audit_pack", "rope_tables"]
