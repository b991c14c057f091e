"""The engine's refusals that are not about the pack's files (those are ``LoadError``,
:mod:`strata.engine.loader`, and ``PackFormatError``, :mod:`strata.packer.packfmt`)."""

from __future__ import annotations


class GenerateError(ValueError):
    """A request the engine cannot serve (e.g. prompt + tokens beyond n_ctx, a KV cache larger than
    the memory it would live in), with the numbers."""


class StageTimesRefused(GenerateError):
    """Per-stage timing asked for where it cannot measure (inside a captured CUDA graph, or on a
    path without stage timers): refused instead of printing zeros."""


class ExpertCacheError(GenerateError):
    """An expert cache that cannot be built as asked (both numbers in the message), or an ``--expert-cache``
    that is neither ``auto`` nor a slot count >= 0."""


class StartupRefused(GenerateError):
    """A start-up that would leave the card's reserve eaten (docs/DESIGN.md "The head before the cache",
    "The reserve and the prompt buffers") or that ran out of device memory at a stage: refused with the
    stage and the numbers."""


class MappedFileChanged(GenerateError):
    """A file the engine reads through a memory map (the pack's pool.bin, a GGUF shard) changed size while the
    engine runs: truncated or rewritten in place. Reading a page past a truncated end would kill the process with
    SIGBUS ("Bus error", exit 135) or, for a rewrite, read other bytes; :class:`strata.engine.mapped.MappedFile`
    checks before every step and refuses with the file and both sizes."""


class NonFiniteLogits(GenerateError):
    """A step produced NaN or infinite logits: refused at that position (a wrong byte offset or damaged
    weights decode to garbage; better a stop than tokens sampled from NaN). ``position``: the token
    position (0-based); ``row``: the f32 logits ``[n_vocab]``."""

    def __init__(self, position: int, row):
        import numpy as np

        from strata.packer.expert_samples import EXPERT_SAMPLE_BYTES

        bad = ~np.isfinite(row)
        self.position = position
        super().__init__(
            f"position {position}: {int(bad.sum())} of {row.size} logits are NaN or infinite (first at "
            f"token id {int(np.argmax(bad))}); the weights or the expert offsets this pack points at "
            f"are damaged - run strata-pack verify and strata-budget check on it (verify reads every dense byte "
            f"but only the first and last {EXPERT_SAMPLE_BYTES} B of each expert in the shards: if both pass, "
            f"compare the shards' sha256 with the model's published one, or build the pack again from intact files)"
        )


__all__ = [
    "ExpertCacheError",
    "GenerateError",
    "MappedFileChanged",
    "NonFiniteLogits",
    "StageTimesRefused",
    "StartupRefused",
]
