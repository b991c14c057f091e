"""A pack's geometry resolved twice, from metadata.txt and from geometry.txt, and the two compared.

A pack carries its model's numbers twice: metadata.txt (the GGUF metadata as the source held it) and
geometry.txt (the manifest's params as the builder resolved them). The engine runs from geometry.txt;
``strata-budget check`` audits both. An edited geometry.txt (another rope base, another n_expert_used)
would otherwise make the engine generate other tokens with exit 0 while the budget refuses the same pack
(docs/DESIGN.md "Mismatches are refused at load"). So both tools take this one comparison:
:func:`pack_geometry` resolves metadata.txt through the architecture's manifest
(:func:`strata.manifests.contract.geometry_from_metadata`) and geometry.txt
(:func:`strata.manifests.contract.geometry_from_params`) and reports every param on which they differ,
each as a :class:`~strata.packer.findings.Finding` naming ``geometry.txt:<param>``, the value found
there and the value the metadata gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.manifests.contract import (
    Geometry,
    ManifestError,
    geometry_from_metadata,
    geometry_from_params,
    load_manifest,
)
from strata.manifests.keys import KeysRefusedError, Refusal, gguf_key, key_refusals

from .findings import Finding
from .pack import Pack
from .packfmt import GEOMETRY_FILE, METADATA_FILE, VOCAB_FILE, PackFormatError


@dataclass
class PackGeometry:
    """The two resolutions of a pack's geometry and what is wrong between them.

    Attributes:
        from_metadata: metadata.txt through the manifest; None when it does not resolve (a finding says why)
            or a key is refused (``refusals``).
        from_params: geometry.txt's params; None when they do not satisfy the manifest (a finding says why).
        refusals: every metadata key llama.cpp reads whose value strata does not implement
            (:func:`strata.manifests.keys.key_refusals`), each with its key, value and what strata implements.
        findings: the architecture named differently by the two files, metadata that does not resolve,
            unreadable params, and one finding per param on which the two disagree (file ``geometry.txt``,
            tensor ``geometry.txt:<param>``, found: geometry.txt's value, required: the metadata's). Floats
            are compared as float32 (the precision geometry.txt and the kernels hold).
    """

    from_metadata: Geometry | None
    from_params: Geometry | None
    refusals: list[Refusal] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def geometry(self) -> Geometry | None:
        """The metadata's resolution where there is one, else geometry.txt's (None: neither resolves)."""
        return self.from_metadata if self.from_metadata is not None else self.from_params


def vocab_rows(pack: Pack) -> int | None:
    """Rows of the pack's vocab.parquet (the length of ``tokenizer.ggml.tokens``, which metadata.txt does not
    hold); None without one.

    Raises:
        PackFormatError: vocab.parquet unreadable (its path and size: the tokenizer's words).
    """
    path = pack.path / VOCAB_FILE
    if not path.exists():
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with open(path, "rb") as f:  # a file object: pyarrow takes no path that is not UTF-8
            return pq.ParquetFile(f, pre_buffer=False).metadata.num_rows
    except (pa.ArrowException, OSError):
        raise PackFormatError(f"{path}: not a valid Parquet file ({path.stat().st_size} bytes)") from None


def pack_geometry(pack: Pack) -> PackGeometry:
    """Resolve ``pack``'s geometry from metadata.txt and from geometry.txt and compare them param by param.

    A param with ``array_len`` (the vocabulary size) takes its length from vocab.parquet. A per-layer array
    param (``int_array`` / ``bool_array``) missing from metadata.txt (a pack built before metadata.txt held
    the per-layer arrays) takes geometry.txt's list, so it is not reported as a disagreement of a file with
    itself.

    Raises:
        PackFormatError: vocab.parquet unreadable.
    """
    m = load_manifest(pack.arch)
    findings: list[Finding] = []
    arch = pack.metadata.get("general.architecture")
    if arch != pack.arch:
        findings.append(
            Finding(
                f"{METADATA_FILE}:general.architecture",
                str(arch),
                pack.arch,
                f"metadata.txt and geometry.txt name different architectures ({arch!r}, {pack.arch!r})",
                METADATA_FILE,
            )
        )
    lengths: dict[str, int] = {}
    arrays: dict[str, list] = {}
    for name, p in m.params.items():
        key = gguf_key(pack.arch, p.key)
        if p.array_len:
            n = vocab_rows(pack) if key == "tokenizer.ggml.tokens" else None
            if n is not None:
                lengths[key] = n
        elif p.kind in ("int_array", "bool_array") and key not in pack.metadata:
            v = pack.geometry_params.get(name, "none")
            if v != "none" and ("," in v or v == "-" or p.kind == "bool_array"):
                arrays[key] = [] if v == "-" else [int(x) for x in v.split(",")]
    refusals: list[Refusal] = []
    g: Geometry | None = None
    try:
        g = geometry_from_metadata(pack.arch, pack.metadata, lengths, arrays)
    except KeysRefusedError as e:
        refusals = e.refusals
    except ManifestError as e:
        findings.append(
            Finding(METADATA_FILE, "metadata that does not resolve", f"the {pack.arch} contract", str(e), METADATA_FILE)
        )
    gp: Geometry | None = None
    try:
        gp = geometry_from_params(pack.arch, pack.geometry_params)
    except ManifestError as e:
        findings.append(Finding(GEOMETRY_FILE, "unreadable params", f"the {pack.arch} contract", str(e), GEOMETRY_FILE))
    if g is not None or gp is not None:
        refusals = key_refusals(g or gp, pack.metadata)
    if g is not None and gp is not None:
        for name in m.params:
            a, b = g.values.get(name), gp.values.get(name)
            if a != b and not (isinstance(a, float) and isinstance(b, float) and np.float32(a) == np.float32(b)):
                findings.append(
                    Finding(
                        f"{GEOMETRY_FILE}:{name}",
                        str(b),
                        f"{a} (from metadata.txt through the manifest)",
                        f"geometry.txt param {name} disagrees with the metadata: geometry.txt holds {b}, metadata.txt "
                        f"gives {a} (the pack's two records of the model differ: edited or damaged; rebuild it "
                        f"with strata-pack build)",
                        GEOMETRY_FILE,
                    )
                )
    return PackGeometry(g, gp, refusals, findings)


__all__ = ["PackGeometry", "pack_geometry", "vocab_rows"]
