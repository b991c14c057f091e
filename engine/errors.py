"""The engine's refusals that are not about the pack's files (those are ``LoadError``,
:mod:`strata.engine.loader`, and ``PackFormatError``, :mod:`strata.packer.packfmt`)."""

from __future__ import annotations


class GenerateError(ValueError):
    """A request the engine cannot serve (e.g. prompt + tokens beyond n_ctx, a KV cache larger than
    the memory it would live in), with the numbers."""


class StageTimesRefused(GenerateError):
    """Per-stage timing asked for where it cannot measure (inside a captured CUDA graph, or on a
    path without stage timers): refused instead of printing zeros."""


class StartupRefused(GenerateError):
    """A start-up that would leave the card's reserve eaten (the documents' incidents 1 and 3) or that
    ran out of device memory at a stage: refused with the stage and the numbers."""


__all__ = ["GenerateError", "StageTimesRefused", "StartupRefused"]
