"""One MoE layer's CPU experts as the hybrid decode step computes them: two C calls, nothing looked up per token.

:meth:`strata.engine.experts.ShardExperts.ffn_many` locates each expert, builds the address and input arrays and
allocates its outputs on every call: ~45-90 us of Python a layer call on the H200's host (2026-12-03, call f:
``ffn_many`` less its C calls, 2-8 experts), against 160-480 us of C. :class:`LayerMisses` does that work once per
layer - the gate / up / down addresses of every expert of the layer (uint64 ``[n_expert]`` each), the input's address
repeated, the outputs and the scratch - so a call is two fancy-indexings and the two C calls of ``ffn_many``'s fused
path (gate and up in one OpenMP region, then ``silu_mul`` and down in one: :func:`strata.engine.cpu.kernels.
call_many` / :func:`~strata.engine.cpu.kernels.call_many_silu`) with the same arguments, hence the same bits.

Layers that ``ffn_many`` would not run that way (gate and up of different types or shapes, a down type without a q8
kernel under the kernel asked) fall back to ``ffn_many`` itself (:attr:`LayerMisses.fast` False).
"""

from __future__ import annotations

import numpy as np

from strata.packer import quants

from . import kernels as CK


class LayerMisses:
    """Layer ``il`` of ``source`` (a :class:`~strata.engine.experts.ShardExperts`): :meth:`run` computes its experts
    ``ids`` on the f32 input ``x`` (numpy ``[n_embd]``, read where it lies at each call: e.g. the hybrid step's
    pinned copy of the layer's input) with ``kernel`` and ``threads``, and writes row ``m`` (``down_m @
    silu_mul(gate_m @ x, up_m @ x)``, f32 ``[n_embd]``) to ``out[m * n_embd : (m + 1) * n_embd]``, packed in the
    order of ``ids``.

    Bit-identical to ``source.ffn_many(il, ids, x, kernel=kernel, threads=threads, silu_mul=reference.silu_mul)``
    (the tests compare them). The activation is :func:`strata.engine.gpu.reference.silu_mul`'s (the GPU's
    ``silu_mul1``): a miss equals a hit.

    ``silu_mul``: the activation, passed in (engine.cpu does not import engine.gpu): with the GPU's
    (:func:`strata.engine.gpu.reference.silu_mul`) and a q8 down kernel the fast path makes it in C
    (:func:`strata.engine.experts.activation_in_c`, the rule ``ffn_many`` follows); any other goes to ``ffn_many``.
    ``max_ids``: the most experts one call takes (the buffers - gate / up outputs, down inputs, scratch - are sized
    for it: the step's ``n_expert_used``, not ``n_expert``). ``addresses``: ``(il, e) -> (gate, up, down)`` host
    addresses of the expert's native bytes (default ``source.addresses``, the mapped shards; the hybrid step passes
    its host tier's copy where the tier holds the pair in native form: the same bytes, no second copy kept hot).

    Raises:
        KeyError: ``il`` is not an MoE layer of ``source``. ValueError: an unknown ``kernel``; an expert whose
        bytes are not inside its shard (``source.addresses``); an ``x`` that is not C-contiguous f32.
    """

    def __init__(
        self,
        source,
        il: int,
        n_expert: int,
        x: np.ndarray,
        *,
        kernel: str,
        threads: int,
        max_ids: int,
        silu_mul,
        addresses=None,
    ):
        self.source, self.il, self.kernel, self.threads, self.silu_mul = source, il, kernel, threads, silu_mul
        self.max_ids = int(max_ids)  # the most ids a call takes (the step's n_expert_used): the buffers' size
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(f"blk.{il} CPU misses: x must be C-contiguous f32, got {x.dtype}")
        self.x = x
        (gt, ut, dt), shp = source.types(il), source.shapes[il]
        (ge0, gr), (ue0, ur), (de0, dr) = shp.gate, shp.up, shp.down
        self.types, self.rows, self.ne0 = (gt, ut, dt), (gr, dr), (ge0, de0)
        from ..experts import activation_in_c

        # ffn_many's fused path: gate and up in one call, the activation made in C with the down products
        self.fast = (gt, ge0, gr) == (ut, ue0, ur) and activation_in_c(silu_mul, dt, kernel) and de0 == gr
        if not self.fast:
            return
        where = addresses or source.addresses
        a = np.array([where(il, e) for e in range(n_expert)], dtype=np.uint64)  # [n_expert, 3]
        self.g, self.u, self.d = (np.ascontiguousarray(a[:, p]) for p in range(3))
        self.gu_bytes, self.d_bytes = quants.row_nbytes(gt, ge0), quants.row_nbytes(dt, de0)
        mx = self.max_ids
        self.xs = np.full(2 * mx, _ptr(x), dtype=np.uint64)  # gate and up read the same input
        self.gu = np.empty(2 * mx * gr, dtype=np.float32)  # gate rows then up rows of the experts asked
        self.h = np.empty(mx * de0, dtype=np.float32)  # their down inputs (written by the C call)
        self.gu_kernel = CK.entry_point(gt, kernel)
        sc = max(CK.scratch_bytes(gt, kernel, ge0, 2 * mx, threads), CK.scratch_bytes(dt, "q8", de0, mx, threads))
        self._scratch = np.zeros(sc + 64, dtype=np.uint8)
        p = self._scratch.__array_interface__["data"][0]
        self.sc = p + (-p % 64)
        self._silu = CK.library(dt).matvec_q8_many_silu

    def run(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Experts ``ids`` (int, numpy ``[m]``, m >= 1) into ``out`` (f32, at least ``m * n_embd`` values, packed in
        ``ids``' order); see the class docstring. ``out`` may be pinned host memory (the step's, read by the GPU).

        Raises:
            ValueError: more ids than ``max_ids``, or none."""
        m = int(ids.size)
        if not 0 < m <= self.max_ids:
            raise ValueError(f"blk.{self.il} CPU misses: {m} experts asked, 1..{self.max_ids} per call")
        if not self.fast:
            ys = self.source.ffn_many(
                self.il, [int(e) for e in ids], self.x, kernel=self.kernel, threads=self.threads, silu_mul=self.silu_mul
            )
            out[: ys.size] = ys.reshape(-1)
            return
        gr, dr = self.rows
        ge0, de0 = self.ne0
        bases = np.concatenate((self.g[ids], self.u[ids]))
        gu = self.gu
        self.gu_kernel(_ptr(bases), 2 * m, gr, ge0, self.gu_bytes, _ptr(self.xs), _ptr(gu), self.threads, self.sc)
        d = self.d[ids]
        self._silu(
            _ptr(d),
            m,
            dr,
            de0,
            self.d_bytes,
            _ptr(gu),
            _ptr(gu) + 4 * m * gr,
            _ptr(self.h),
            _ptr(out),
            self.threads,
            self.sc,
        )


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


__all__ = ["LayerMisses"]
