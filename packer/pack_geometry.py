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
from typing import Any

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
            unreadable params, a missing vocab.parquet, and one finding per param on which the two disagree (file
            ``geometry.txt``, tensor ``geometry.txt:<param>``, found: geometry.txt's value, required: the
            metadata's). Floats are compared as float32 (:func:`same_value`).
    """

    from_metadata: Geometry | None
    from_params: Geometry | None
    refusals: list[Refusal] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def geometry(self) -> Geometry | None:
        """The metadata's resolution where there is one, else geometry.txt's (None: neither resolves)."""
        return self.from_metadata if self.from_metadata is not None else self.from_params


def same_value(a: Any, b: Any) -> bool:
    """``a == b``, or both floats equal once rounded to float32 (the precision the kernels compute in; metadata.txt
    and geometry.txt write a float's repr, which may carry a float64 the GGUF's float32 never held)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and bool(np.float32(a) == np.float32(b)))


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

    A param with ``array_len`` (the vocabulary size) takes its length from vocab.parquet (missing: a finding
    naming it, and geometry.txt's value to compare the rest). A per-layer array param (``int_array`` /
    ``bool_array``) whose key metadata.txt lacks (a pack built before metadata.txt held the per-layer arrays)
    takes geometry.txt's list, so it is not reported as a disagreement of a file with itself; any other param
    metadata.txt lacks takes the manifest's default, and a disagreement then says so (an older pack: rebuild it).
    Metadata whose defaults do not evaluate (a key they read is missing) is a finding, not an exception.

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
    gp: Geometry | None = None
    try:
        gp = geometry_from_params(pack.arch, pack.geometry_params)
    except ManifestError as e:
        findings.append(Finding(GEOMETRY_FILE, "unreadable params", f"the {pack.arch} contract", str(e), GEOMETRY_FILE))
    kv = dict(pack.metadata)
    lengths: dict[str, int] = {}
    for name, p in m.params.items():
        key = gguf_key(pack.arch, p.key)
        held = gp.values.get(name) if gp is not None else None
        if p.array_len:
            n = vocab_rows(pack) if key == "tokenizer.ggml.tokens" else None
            if n is not None:
                lengths[key] = n
            elif key == "tokenizer.ggml.tokens":
                findings.append(
                    Finding(
                        VOCAB_FILE,
                        "missing",
                        f"the vocabulary, whose row count is {name}",
                        f"missing: the pack has no tokenizer (its row count is the vocabulary size, {name})",
                        VOCAB_FILE,
                    )
                )
                if held is not None:
                    lengths[key] = int(held)  # to go on comparing the rest
        elif p.kind in ("int_array", "bool_array") and key not in kv:
            # a pack whose metadata.txt predates its per-layer arrays (they were left out then): geometry.txt's list
            v = pack.geometry_params.get(name, "none")
            if v != "none" and ("," in v or v == "-" or p.kind == "bool_array"):
                kv[key] = [] if v == "-" else [int(x) for x in v.split(",")]
    refusals: list[Refusal] = []
    g: Geometry | None = None
    try:
        g = geometry_from_metadata(pack.arch, kv, lengths)
    except KeysRefusedError as e:
        refusals = list(e.refusals)
    except (ManifestError, TypeError, ValueError, ZeroDivisionError) as e:  # a default over a missing key, say
        findings.append(
            Finding(
                METADATA_FILE,
                "metadata that does not resolve",
                f"the {pack.arch} contract",
                (
                    str(e)
                    if isinstance(e, ManifestError)
                    else f"a default of the {pack.arch} manifest does not evaluate "
                    f"(a key it reads is missing from metadata.txt): {e}"
                )
                + " (a pack built by an older strata, or metadata.txt edited? rebuild it with strata-pack build)",
                METADATA_FILE,
            )
        )
    if g is not None or gp is not None:  # every key llama.cpp reads, honoured or refused (the manifest's [keys])
        said = {r.key for r in refusals}
        refusals += [r for r in key_refusals(g or gp, pack.metadata) if r.key not in said]
    if g is not None and gp is not None:
        for name in m.params:
            a, b = g.values.get(name), gp.values.get(name)
            if not same_value(a, b):
                key = gguf_key(pack.arch, m.params[name].key)
                why = (
                    "the pack's two records of the model differ: edited or damaged"
                    if key in pack.metadata
                    else f"metadata.txt has no {key}, so that is its default: a pack built by an older strata, which "
                    "left per-layer arrays out of metadata.txt, or one edited"
                )
                findings.append(
                    Finding(
                        f"{GEOMETRY_FILE}:{name}",
                        str(b),
                        f"{a} (from metadata.txt through the manifest)",
                        f"geometry.txt param {name} disagrees with the metadata: geometry.txt holds {b}, metadata.txt "
                        f"gives {a} ({why}; rebuild it with strata-pack build)",
                        GEOMETRY_FILE,
                    )
                )
    return PackGeometry(g, gp, refusals, findings)


__all__ = ["PackGeometry", "pack_geometry", "same_value", "vocab_rows"]
