"""Samples of the routed experts' bytes, kept in the build record (``build.json``) and re-read by ``verify``.

The routed experts stay in the source shards (``native_experts.txt`` records where), so a shard edited in place
after the build - same size, new bytes - would otherwise decode to NaN or, worse, plausible logits. The build
records, per MoE layer, a sha256 of the first and last :data:`EXPERT_SAMPLE_BYTES` of every expert's weights;
``strata-pack verify`` recomputes it and refuses a layer that differs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .packfmt import NativeExperts

#: Bytes read at each end of every expert's gate, up and down weights for the build record's samples.
EXPERT_SAMPLE_BYTES = 256


def expert_sample_digests(paths: list[Path], experts: NativeExperts) -> dict[str, str]:
    """Per MoE layer, the sha256 (hex) of the first and last :data:`EXPERT_SAMPLE_BYTES` of every expert's gate,
    up and down weights, in expert then part order (``ExpertLayer.ranges``), read from the source shards
    (read-only). The routed experts stay in the shards, so the build record keeps these and ``verify`` re-reads
    them: an in-place edit of a shard that touches the start or end of any expert (its first block's scales
    among them) is refused with the layer named, instead of NaN or plausible logits at decode. Reads
    ``2 x 256 B x 3 x n_expert`` per layer (9.4 MiB for Qwen3-30B-A3B's 48 x 128 experts).

    Raises:
        OSError: a shard that cannot be read.
    """
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        out = {}
        for L in experts.layers:
            h = hashlib.sha256()
            for e in range(experts.n_expert):
                for _part, shard, off, nbytes in L.ranges(e):
                    k = min(EXPERT_SAMPLE_BYTES, nbytes)
                    h.update(os.pread(fds[shard], k, off))
                    h.update(os.pread(fds[shard], k, off + nbytes - k))
            out[str(L.layer)] = h.hexdigest()
        return out
    finally:
        for fd in fds:
            os.close(fd)
