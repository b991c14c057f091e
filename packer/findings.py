"""One finding of a check of a pack against its format or its contract.

Every check in strata that compares what a file holds with what is required reports a
:class:`Finding`: the tensor (or ``file:field``) it concerns, what was found, what is required and
one sentence that says all of it. Checkers return *every* finding (never just the first); a caller
that must stop at the first one (the pack reader, the engine's load) raises with its message, a
caller that reports (the budget audit) lists them all. The wanted failure (docs/DESIGN.md "Mismatches
are refused at load"): the tensor name, the value found and the value required, before any weight is used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """What a check found wrong.

    Attributes:
        tensor: the tensor name, or ``file:field`` / ``file:layer N`` for a non-tensor number.
        found: the value found (shape, bytes, type name, ...), as text with its unit.
        required: the value required and where it comes from.
        message: one sentence naming all of the above (what a refusal prints after the file).
        file: the pack file the finding is about (``index.txt``, ``native_experts.txt``,
            ``geometry.txt``, ``metadata.txt``, ``pool.bin`` or a shard path).
    """

    tensor: str
    found: str
    required: str
    message: str
    file: str = ""


def fmt_ne(ne) -> str:
    """``[256, 128]``: a shape as text (ggml ne order)."""
    return "[" + ", ".join(str(int(x)) for x in ne) + "]"


def trim_ne(ne, min_dims: int = 1) -> tuple[int, ...]:
    """``ne`` without trailing 1s, keeping at least ``min_dims`` dims: ``(256, 1, 1, 1)`` -> ``(256,)``."""
    out = [int(x) for x in ne]
    while len(out) > max(min_dims, 1) and out[-1] == 1:
        out.pop()
    return tuple(out)


def pad4(ne) -> tuple[int, ...]:
    """``ne`` padded with 1s to 4 dims (ggml's ``ne[4]``)."""
    ne = tuple(int(x) for x in ne)
    return ne + (1,) * (4 - len(ne))


__all__ = ["Finding", "fmt_ne", "pad4", "trim_ne"]
