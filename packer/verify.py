"""``strata-pack verify``: re-read a pack against its sources.

Every dense tensor's pool bytes are compared with its source bytes (BF16 sources after
promotion to F32), in bounded chunks; every expert layer's offsets, strides and types are
compared with the shard's own tensor table, re-read from the GGUF headers. The first
mismatch is reported with the tensor name and both numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import quants
from .build import CHUNK_BYTES, EXPERT_RE
from .gguf_file import open_model
from .packfmt import open_pack


class VerifyError(ValueError):
    """A pack that does not match its sources; names the tensor and both numbers."""


@dataclass
class VerifyResult:
    """What was compared: tensors and bytes (dense), layers (experts)."""

    pack: Path
    dense_tensors: int
    dense_bytes: int
    expert_layers: int


def _source_path(pack, k: int, name: str) -> Path:
    src_dir = pack.metadata.get("strata.source_dir")
    p = Path(src_dir) / name if isinstance(src_dir, str) else pack.path / name
    if not p.exists():
        raise VerifyError(f"{pack.path}: source shard {k} {name} not found at {p}")
    return p


def verify_pack(pack_dir: str | os.PathLike, progress: bool = False) -> VerifyResult:
    """Compare a pack with its source shards byte for byte (dense) and offset for offset (experts).

    Raises:
        VerifyError: first mismatch (tensor, pool offset, source offset, sizes).
        PackFormatError / GGUFError: unreadable pack or source.
    """
    from tqdm import tqdm

    pack = open_pack(pack_dir)
    paths = [_source_path(pack, k, name) for k, (name, _size) in enumerate(pack.index.sources)]
    for (name, size), p in zip(pack.index.sources, paths):
        if p.stat().st_size != size:
            raise VerifyError(f"{p}: source is {p.stat().st_size} bytes, the pack was built from {size} bytes")
    model = open_model(paths[0])
    if [s.path.name for s in model.shards] != [n for n, _ in pack.index.sources]:
        raise VerifyError(f"{pack.path}: shards {[s.path.name for s in model.shards]} differ from the pack's sources")
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    pfd = os.open(pack.pool_path, os.O_RDONLY)
    total = sum(e.nbytes for e in pack.index.entries)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress, leave=False) as bar:
            for e in pack.index.entries:
                if e.name not in model.tensors:
                    raise VerifyError(f"tensor {e.name}: in index.txt but not in the source")
                k, t = model.tensors[e.name]
                if (k, t.abs_offset, t.type_id, t.ne4) != (e.shard, e.src_offset, e.src_type, e.ne):
                    raise VerifyError(
                        f"tensor {e.name}: index says shard {e.shard} offset {e.src_offset} type {e.src_type} ne {list(e.ne)}, "
                        f"source has shard {k} offset {t.abs_offset} type {t.type_id} ne {list(t.ne4)}"
                    )
                bf16 = e.src_type == quants.BF16.id
                step = CHUNK_BYTES
                for rel in range(0, e.nbytes, step):
                    n = min(step, e.nbytes - rel)
                    got = os.pread(pfd, n, e.offset + rel)
                    if bf16:
                        want = quants.bf16_to_f32_bits(np.frombuffer(os.pread(fds[k], n // 2, e.src_offset + rel // 2), "<u2")).tobytes()
                    else:
                        want = os.pread(fds[k], n, e.src_offset + rel)
                    if got != want:
                        a = np.frombuffer(got, np.uint8)
                        b = np.frombuffer(want, np.uint8)
                        m = min(len(a), len(b))
                        i = int(np.argmax(a[:m] != b[:m])) if m and (a[:m] != b[:m]).any() else m
                        raise VerifyError(
                            f"tensor {e.name}: pool byte {e.offset + rel + i} is {a[i] if i < len(a) else 'EOF'}, "
                            f"source byte {(e.src_offset + (rel + i) // 2) if bf16 else e.src_offset + rel + i} gives "
                            f"{b[i] if i < len(b) else 'EOF'}"
                        )
                    bar.update(n)
        dense_names = {e.name for e in pack.index.entries}
        for name in model.tensors:
            if not EXPERT_RE.match(name) and name not in dense_names:
                raise VerifyError(f"tensor {name}: in the source but not in index.txt")
        n_layers = 0
        if pack.experts is not None:
            from .build import resolve_geometry, tabulate_experts

            want = tabulate_experts(model, resolve_geometry(model))
            got = pack.experts
            if want is None:
                raise VerifyError("native_experts.txt present but the source has no routed experts")
            for w, g in zip(want.layers, got.layers):
                if w != g:
                    diffs = [f"{f}: pack {getattr(g, f)} source {getattr(w, f)}" for f in w.__dataclass_fields__
                             if getattr(w, f) != getattr(g, f)]
                    raise VerifyError(f"experts of layer {w.layer}: " + "; ".join(diffs))
            if len(want.layers) != len(got.layers) or (want.total, want.max_blob, want.n_expert) != (got.total, got.max_blob, got.n_expert):
                raise VerifyError(
                    f"native_experts.txt: {len(got.layers)} layers total {got.total} max_blob {got.max_blob} n_expert {got.n_expert}; "
                    f"source gives {len(want.layers)} layers total {want.total} max_blob {want.max_blob} n_expert {want.n_expert}"
                )
            n_layers = len(got.layers)
        elif any(EXPERT_RE.match(n) for n in model.tensors):
            raise VerifyError("the source has routed experts but the pack has no native_experts.txt")
    finally:
        for fd in fds:
            os.close(fd)
        os.close(pfd)
    return VerifyResult(pack.path, len(pack.index.entries), total, n_layers)
