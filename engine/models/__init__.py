"""One file per architecture over the shared layers (``strata.engine.layers``).

Adding an architecture = a manifest (``manifests/<arch>.toml``) + a file here + a line in
:data:`ARCHS`.
"""

from __future__ import annotations

from .base import BaseModel, State, UnsupportedModel
from .gemma3 import Gemma3
from .qwen2 import Qwen2
from .qwen3moe import Qwen3MoE

#: GGUF ``general.architecture`` -> model class.
ARCHS: dict[str, type[BaseModel]] = {"qwen2": Qwen2, "gemma3": Gemma3, "qwen3moe": Qwen3MoE}


def model_class(arch: str) -> type[BaseModel]:
    """The model class of ``arch``. Raises UnsupportedModel naming the supported ones."""
    try:
        return ARCHS[arch]
    except KeyError:
        raise UnsupportedModel(f"architecture {arch!r} has no forward pass in strata's engine; "
                               f"supported: {', '.join(sorted(ARCHS))}") from None


__all__ = ["ARCHS", "BaseModel", "Gemma3", "Qwen2", "Qwen3MoE", "State", "UnsupportedModel", "model_class"]
