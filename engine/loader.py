"""Load-time checks: every tensor the forward pass will read is asserted against the geometry
before the first weight byte is touched.

The pack files are read by the one strict reader (:func:`strata.packer.pack.open_pack`:
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

The wanted failure (docs/DESIGN.md "Mismatches are refused at load"): a mismatch reported with the tensor
name, the shape found and the shape required, at load time - not a wrong number inside a GEMV at token 4000.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from strata.manifests.contract import Geometry
from strata.manifests.names import expert_role, tensor_name
from strata.packer import quants
from strata.packer.conformance import ExpertShapes, check_conformance, expert_tensors
from strata.packer.findings import Finding
from strata.packer.gguf_file import GGUFError, read_header
from strata.packer.pack import Pack
from strata.packer.packfmt import EXPERTS_FILE, INDEX_FILE, ExpertLayer, IndexEntry

from . import dequant


class LoadError(ValueError):
    """A pack the engine refuses to run; the message names the file, the tensor and the numbers."""


@dataclass
class LoadPlan:
    """What the forward pass reads, after every check passed.

    ``dense``: tensor name -> index entry (exactly the tensors present that the manifest names, the
    draft blocks' excepted); ``experts``: MoE layer -> its native_experts.txt row; ``expert_shapes``: MoE
    layer -> shapes; ``shard_paths``: shard index -> path of the GGUF shard. ``draft``: the dense tensors
    of the NextN draft blocks (the drafter, loaded as one stage, never run by the main pass) and
    ``draft_experts``: their routed-expert rows (left in the shards: no cache slot serves them).
    """

    dense: dict[str, IndexEntry]
    experts: dict[int, ExpertLayer] = field(default_factory=dict)
    expert_shapes: dict[int, ExpertShapes] = field(default_factory=dict)
    shard_paths: dict[int, Path] = field(default_factory=dict)
    draft: dict[str, IndexEntry] = field(default_factory=dict)
    draft_experts: dict[int, ExpertLayer] = field(default_factory=dict)


def _type_name(t: int) -> str:
    q = quants.QTYPES.get(t)
    return q.name if q else f"type id {t}"


def _refuse(pack: Pack, f: Finding) -> LoadError:
    file = f.file if f.file in (INDEX_FILE, EXPERTS_FILE) else INDEX_FILE
    return LoadError(f"{pack.path / file}: {f.message}")


def check_pack(pack: Pack, geom: Geometry) -> LoadPlan:
    """Assert every tensor the ``geom.arch`` forward pass reads against ``geom``: the one conformance
    check (:func:`strata.packer.conformance.check_conformance`), refusing its first finding, then
    the engine's own rules: a CPU dequantizer (kernel) for every type, and every expert shard present,
    a GGUF file of the size index.txt recorded, holding every expert the table locates.

    Raises:
        LoadError: the first finding (a missing tensor named with the shape required, a tensor whose
            shape differs - name, shape found, shape required -, a type the manifest does not allow,
            a tensor without a role, an incomplete or ambiguous choice group, an expert table that
            disagrees with the geometry), a type the CPU cannot dequantize, or an expert range that
            runs past its shard.
    """
    conf = check_conformance(geom, pack.index.entries, pack.experts)
    if conf.findings:
        raise _refuse(pack, conf.findings[0])
    where = pack.path / INDEX_FILE
    for name, e in conf.dense.items():
        if not dequant.supported(e.type):
            raise LoadError(
                f"{where}: tensor {name} has type {_type_name(e.type)}, which the CPU engine cannot dequantize"
            )
    plan = LoadPlan(conf.dense, dict(conf.experts), dict(conf.expert_shapes))
    if conf.experts:
        _check_shards(pack, plan)
        # every row of native_experts.txt against the shards' own tensor tables (types, offsets, strides,
        # bytes): a wrong offset inside the shard would decode to plausible garbage, so it is refused here
        shard_tensors: dict = {}
        for k, p in sorted(plan.shard_paths.items()):
            try:
                shard_tensors.update(expert_tensors(read_header(p), k))
            except (OSError, GGUFError, quants.GGMLTypeError) as e:
                raise LoadError(
                    f"{pack.path / EXPERTS_FILE}: expert shard {k} {p}: cannot re-read its header ({e})"
                ) from None
        conf = check_conformance(geom, pack.index.entries, pack.experts, shard_tensors)
        if conf.findings:
            raise _refuse(pack, conf.findings[0])
    draft = geom.draft_layers
    if draft:  # the drafter: its own stage; its experts stay in the shards
        prefixes = tuple(tensor_name("attn_norm.weight", il).rsplit("attn_norm.weight", 1)[0] for il in draft)
        plan.draft = {n: e for n, e in plan.dense.items() if n.startswith(prefixes)}
        plan.dense = {n: e for n, e in plan.dense.items() if n not in plan.draft}
        plan.draft_experts = {il: plan.experts.pop(il) for il in draft if il in plan.experts}
        for il in draft:
            plan.expert_shapes.pop(il, None)
    return plan


def _check_shards(pack: Pack, plan: LoadPlan) -> None:
    """Kernel support of every expert type, and every shard present, a GGUF of its recorded size,
    long enough for the last expert of every part."""
    where = pack.path / EXPERTS_FILE
    table = pack.experts
    assert table is not None
    recorded = dict(pack.index.sources)
    sizes: dict[int, int] = {}
    for k, name in enumerate(table.shards):
        p = pack.shard_path(k)
        if not p.is_file():
            raise LoadError(
                f"{where}: expert shard {k} {p} is missing (routed experts stay in the GGUF shards; moved? "
                "pass --source-dir DIR)"
            )
        sizes[k] = p.stat().st_size
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise LoadError(
                f"{where}: expert shard {k} {p}: first 4 bytes are {magic!r}, a GGUF file starts with b'GGUF'"
            )
        if name in recorded and recorded[name] != sizes[k]:
            raise LoadError(
                f"{p}: expert shard {k} is {sizes[k]} bytes, the pack was built from {recorded[name]} (index.txt's "
                f"sources): the file was changed or truncated since; restore it or rebuild the pack (the experts are "
                f"read in place at the offsets of {where})"
            )
        plan.shard_paths[k] = p
    n_expert = table.n_expert
    for il, row in sorted(plan.experts.items()):
        for p in ("gate", "up", "down"):
            t = getattr(row, f"{p}_type")
            if not dequant.supported(t):
                raise LoadError(
                    f"{where}: layer {il} {p} experts ({tensor_name(expert_role(p), il)}) have type "
                    f"{_type_name(t)}, which the CPU engine cannot dequantize"
                )
            k = getattr(row, f"{p}_shard")
            end = getattr(row, f"{p}_off") + (n_expert - 1) * getattr(row, f"{p}_stride") + getattr(row, f"{p}_bytes")
            if end > sizes[k]:
                raise LoadError(
                    f"{where}: layer {il} {p}: expert {n_expert - 1} ends at byte {end}, past the end of "
                    f"shard {plan.shard_paths[k]} ({sizes[k]} bytes)"
                )
