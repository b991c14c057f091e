"""The one table of GGUF tensor names: roles -> names and back.

A *role* is a tensor's GGUF name without its layer prefix: ``"attn_q.weight"``, ``"attn_q.bias"``,
``"ssm_a"`` (llama.cpp creates it without a suffix), ``"token_embd.weight"``. Whether a role lives
once per layer (``blk.{il}.<role>``) or once per model comes from gguf-py's own table,
``gguf.constants.TENSOR_NAMES`` (the Python twin of llama.cpp's ``LLM_TENSOR_NAMES`` in
``src/llama-arch.cpp``), so strata cannot invent a name llama.cpp does not load: a role whose base
is not in that table is refused with :class:`TensorNameError`.

Every module asks this table instead of formatting names: manifests (``manifests/*.toml``) name
tensors by role, the builder and the budget audit find routed experts with :func:`expert_part`,
the engine's layers ask :func:`tensor_name`. Source: gguf-py 0.19.0 ``gguf/constants.py``
(``MODEL_TENSOR``, ``TENSOR_NAMES``); llama.cpp ``src/llama-arch.cpp`` ``LLM_TENSOR_NAMES``.
"""

from __future__ import annotations

import re
from functools import lru_cache

#: Suffixes a role may carry after its base name (llama.cpp ``tn(LLM_TENSOR_X, "weight", il)``).
SUFFIXES = ("weight", "bias")
#: The prefix of a per-layer tensor (gguf-py writes it ``blk.{bid}.``).
LAYER_PREFIX = "blk.{il}."

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

#: Routed-expert roles -> the part of one expert's blob they hold (fused gate+up is one tensor whose
#: rows 0..n_ff-1 are gate and n_ff..2n_ff-1 up: llama.cpp ``llama-graph.cpp`` build_moe_ffn).
EXPERT_ROLES: dict[str, str] = {
    "ffn_gate_exps.weight": "gate",
    "ffn_up_exps.weight": "up",
    "ffn_down_exps.weight": "down",
    "ffn_gate_up_exps.weight": "gate_up",
}


class TensorNameError(ValueError):
    """A role that gguf-py's tensor-name table does not know (named, with the closest known ones)."""


@lru_cache(maxsize=1)
def _bases() -> tuple[frozenset[str], frozenset[str]]:
    """(per-layer bases, global bases) of gguf.constants.TENSOR_NAMES (text-model names only)."""
    from gguf.constants import TENSOR_NAMES

    per_layer, glob = set(), set()
    for v in TENSOR_NAMES.values():
        if v.startswith("blk.{bid}."):
            per_layer.add(v[len("blk.{bid}.") :])
        elif "{" not in v:
            glob.add(v)
    return frozenset(per_layer), frozenset(glob)


def split_role(role: str) -> tuple[str, str]:
    """``"attn_q.weight"`` -> ``("attn_q", "weight")``; ``"ssm_a"`` -> ``("ssm_a", "")``."""
    for s in SUFFIXES:
        if role.endswith("." + s):
            return role[: -len(s) - 1], s
    return role, ""


@lru_cache(maxsize=4096)
def is_per_layer(role: str) -> bool:
    """True for a role that exists once per layer (``blk.{il}.<role>``), False for a model-level one.

    Raises:
        TensorNameError: the role's base is not a tensor name llama.cpp / gguf-py knows.
    """
    base, _ = split_role(role)
    per_layer, glob = _bases()
    if base in per_layer:
        return True
    if base in glob:
        return False
    near = sorted(b for b in per_layer | glob if b.split(".")[0] == base.split(".")[0] or b.startswith(base[:4]))[:6]
    raise TensorNameError(
        f"tensor role {role!r}: {base!r} is not a GGUF tensor name in gguf.constants.TENSOR_NAMES "
        f"(llama.cpp LLM_TENSOR_NAMES){'; similar: ' + ', '.join(near) if near else ''}"
    )


def tensor_name(role: str, il: int | None = None) -> str:
    """The GGUF name of ``role`` (in layer ``il`` for a per-layer role): ``("attn_q.weight", 3)`` ->
    ``"blk.3.attn_q.weight"``, ``("output.weight", None)`` -> ``"output.weight"``.

    Raises:
        TensorNameError: an unknown role, a per-layer role without ``il`` or a global role with one.
    """
    if is_per_layer(role):
        if il is None:
            raise TensorNameError(f"tensor role {role!r} exists once per layer: give the layer")
        return f"blk.{int(il)}.{role}"
    if il is not None:
        raise TensorNameError(f"tensor role {role!r} exists once per model, not in layer {il}")
    return role


def name_pattern(role: str) -> str:
    """``"blk.{il}.attn_q.weight"`` for a per-layer role, the role itself for a global one."""
    return (LAYER_PREFIX + role) if is_per_layer(role) else role


def parse_name(name: str) -> tuple[int | None, str]:
    """``"blk.3.attn_q.weight"`` -> ``(3, "attn_q.weight")``; ``"output.weight"`` -> ``(None, "output.weight")``.
    No check against the table (a pack may hold names strata does not know: callers report them)."""
    m = _LAYER_RE.match(name)
    if m:
        return int(m.group(1)), m.group(2)
    return None, name


def expert_part(name: str) -> tuple[int, str] | None:
    """``(layer, part)`` for a routed-expert tensor name (part: gate | up | down | gate_up), else None.
    Shared experts (``*_shexp``) are dense tensors and return None."""
    il, role = parse_name(name)
    part = EXPERT_ROLES.get(role)
    if il is None or part is None:
        return None
    return il, part


def expert_role(part: str) -> str:
    """The role of an expert ``part`` (gate | up | down | gate_up): ``"ffn_gate_exps.weight"`` ..."""
    for role, p in EXPERT_ROLES.items():
        if p == part:
            return role
    raise KeyError(f"expert part {part!r}: expected one of {', '.join(EXPERT_ROLES.values())}")


__all__ = [
    "EXPERT_ROLES",
    "LAYER_PREFIX",
    "TensorNameError",
    "SUFFIXES",
    "expert_part",
    "expert_role",
    "is_per_layer",
    "name_pattern",
    "parse_name",
    "split_role",
    "tensor_name",
]
