"""One file per architecture: its block recipe (:mod:`strata.engine.recipe`). The registry is the
files themselves - a module ``engine/models/<arch>.py`` defining ``ARCH`` and ``RECIPE`` is found
by :func:`recipes` - so adding an architecture is its manifest (``manifests/<arch>.toml``) plus
one file here (docs/ARCHITECTURE.md, "Adding an architecture").
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from ..recipe import Recipe


class UnsupportedModel(ValueError):
    """A geometry or metadata feature this engine does not implement (named), refused at load."""


@lru_cache(maxsize=1)
def recipes() -> dict[str, Recipe]:
    """GGUF ``general.architecture`` -> recipe, for every model file in this package."""
    out: dict[str, Recipe] = {}
    for info in pkgutil.iter_modules(__path__):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        arch, recipe = getattr(mod, "ARCH", None), getattr(mod, "RECIPE", None)
        if isinstance(arch, str) and isinstance(recipe, Recipe):
            out[arch] = recipe
    return out


def recipe_for(arch: str) -> Recipe:
    """The recipe of ``arch``. Raises UnsupportedModel naming the architectures the engine runs."""
    try:
        return recipes()[arch]
    except KeyError:
        raise UnsupportedModel(
            f"architecture {arch!r} has no forward pass in strata's engine; supported: {', '.join(sorted(recipes()))}"
        ) from None


__all__ = ["UnsupportedModel", "recipe_for", "recipes"]
