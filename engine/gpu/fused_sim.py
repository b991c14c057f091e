"""NumPy stand-ins of the fused decode step's kernels for the ``sim`` backend
(:class:`strata.engine.gpu.backend.SimBackend`): each ``ops.X(...)`` returns a closure like
:class:`strata.engine.gpu.fused_ops.CudaOps`'s, so the same launch list runs without a GPU.
"""

from __future__ import annotations

import numpy as np

from .. import layers
from .fused_ops import TOP_K, AttnIO, Combine, GdnIO, MoeIO


class SimOps:
    """NumPy stand-ins of the fused kernels for the ``sim`` backend, written with the CPU path's own
    layer functions (so a sim run equals the CPU path except for the matvec replica's order)."""

    def __init__(self, backend):
        self.bk = backend

    def quantize(self, x, xq, fmt, n, rows=1, x_stride=0, out_stride=0, silu=None):
        """No quantization: the sim's q8 matvec quantizes its f32 input itself (the CPU kernel), as the device's
        equals; with ``silu`` ``(g, u)`` the input is made: ``x = silu(g) * u``."""
        if silu is None:
            return lambda: None
        return self.silu_mul(silu[0], silu[1], x)

    def matvec(self, type_id, buf, rows, ne0, x, out, xq=None):
        bk = self.bk
        if xq is not None:
            return lambda: bk.matvec_q8(type_id, buf, rows, ne0, x, out=out)
        return lambda: bk.matvec(type_id, buf, rows, ne0, x, out=out)

    def resid_norm(self, x, a, ab, wa, w, xn, eps, scale, mode, xq=None, qfmt=0, w2=None, xn2=None):
        def run():  # xq / qfmt: nothing to write (the sim's q8 matvec quantizes its f32 input itself)
            if isinstance(a, Combine):  # the routed experts' weighted sum, in selection order (CudaOps.resid_norm)
                v = a.D[: a.n] * a.w[0]
                for j in range(1, a.k):
                    v = v + a.D[j * a.n : (j + 1) * a.n] * a.w[j]
                if a.S is not None:
                    v = v + a.S * layers.sigmoid(np, a.gdot[0])
            else:
                v = a if ab is None else a + ab
            if mode == 0:
                x[...] = v * np.float32(scale)
            elif mode == 1:
                x[...] = x + v
            else:
                x[...] = x + layers.rms_norm(np, v, wa, eps)
            if w is not None:
                xn[...] = layers.rms_norm(np, x, w, eps)
            if w2 is not None:
                xn2[...] = layers.rms_norm(np, x, w2, eps)

        return run

    def qk_prep(self, L: AttnIO):
        def run():
            pos = int(L.params[0])
            q, k, v = L.q, L.k, L.v
            if L.qb is not None:
                q = q + L.qb
            if L.kb is not None:
                k = k + L.kb
            if L.vb is not None:
                v = v + L.vb
            q = q.reshape(L.n_head, L.q_stride or L.hd)[:, : L.hd]
            k = k.reshape(L.n_kv, L.hd)
            if L.qnw is not None:
                q = layers.rms_norm(np, q, L.qnw, L.eps)
                k = layers.rms_norm(np, k, L.knw, L.eps)
            q = L.rope(np, q, pos)
            k = L.rope(np, k, pos)
            L.cache.write(L.il, pos, k, v.reshape(L.n_kv, L.hd_v))
            if L.scale_q:
                q = q * np.float32(L.scale)
            L.qo[...] = q.reshape(-1)

        return run

    def attn(self, L: AttnIO):
        def run():
            pos = int(L.params[0])
            lo = 0 if L.window is None else max(0, pos + 1 - L.window)
            K, V = L.cache.read(L.il, lo, pos)
            L.ao[...] = layers.attend(np, L.qo.reshape(L.n_head, L.hd), K, V, L.kq_scale)

        return run

    def act_mul(self, g, u, out, kind):
        f = layers.gelu_tanh if kind == "gelu" else layers.silu
        return lambda: out.__setitem__(Ellipsis, f(np, g) * u)

    def logit_post(self, y, bias, cap):
        def run():
            if bias is not None:
                y[...] = y + bias
            if cap:
                y[...] = np.tanh(y * np.float32(1.0 / cap)) * np.float32(cap)

        return run

    def matvec_group(self, type_id, parts, ne0, x, xq=None):
        bk = self.bk
        mv = bk.matvec if xq is None else bk.matvec_q8

        def run():
            for buf, rows, out in parts:
                out[...] = mv(type_id, buf, rows, ne0, x)

        return run

    def gate_mul(self, ao, qg, n_head, hd):
        def run():
            g = qg.reshape(n_head, 2 * hd)[:, hd:].reshape(-1)
            ao[...] = ao * layers.sigmoid(np, g)

        return run

    def gdn_conv(self, G: GdnIO):
        from ..deltanet import conv_silu

        def run():
            if int(G.params[0]) == 0:
                G.cs[...] = 0
            G.h[...] = conv_silu(np, G.qkv, G.cs, G.cw.reshape(G.dims.conv_dim, G.dims.d_conv))

        return run

    def gdn_step(self, G: GdnIO):
        from ..deltanet import delta_rule

        def run():
            if int(G.params[0]) == 0:
                G.S[...] = 0
            G.o[...] = delta_rule(np, G.h, G.z, G.ba, G.S, G.dt_bias, G.ssm_a, G.norm_w, G.dims)

        return run

    def moe_route(self, M: MoeIO):
        def run():
            ids, w = layers.route_topk(np, M.logits, M.k, norm=M.norm)
            M.weights[...] = w
            base, host = int(M.storage_ptr[0]), int(M.host_ptr[0])
            row = [int(M.slot_of[M.il * M.n_expert + e]) for e in ids]
            tier = [k for k, s in enumerate(row) if s <= -2]  # the split: the first keep[c] of them stay in the tier
            for k in tier[int(M.keep[len(tier)]) :]:
                row[k] = -1
            st = M.stage
            staged = [int(t) for t in st.staged] if st is not None else []
            for k, e in enumerate(ids):
                slot = row[k]
                b = base + slot * M.slot_bytes if slot >= 0 else host + (-2 - slot) * M.slot_bytes if slot <= -2 else 0
                tag = M.il * M.n_expert + int(e)
                if slot <= -2 and tag in staged:  # copied ahead (cuda/prefetch.cu): its staging slot
                    b = st.base + staged.index(tag) * M.slot_bytes
                    st.counts[2 * M.il + 1] += 1
                for j in range(3):
                    M.bases[j * M.k + k] = b + M.offsets[j] if slot != -1 else 0
                M.info[k], M.info[M.k + k] = e, slot

        return run

    def matvec_batched(self, type_id, bases, rows, ne0, X, x_stride, out, storage=None, nbytes=0, xq=None, xq_stride=0):
        bk = self.bk
        mv = bk.matvec if xq is None else bk.matvec_q8

        def run():
            # sim addresses (storage(address, nbytes) reads them): 0 is a miss, skipped
            for item in range(int(bases.size)):
                b = int(bases[item])
                if b == 0:
                    continue
                x = X[item * x_stride : item * x_stride + ne0] if x_stride else X[:ne0]
                out[item * rows : (item + 1) * rows] = mv(type_id, storage(b, nbytes), rows, ne0, x)

        return run

    def moe_stage(self, logits, n_expert: int, k: int, slot_of, il: int, host_ptr, slot_bytes: int, st):
        """cuda/prefetch.cu ``moe_stage`` on host arrays: the ``k`` best of ``logits`` (higher first, lower id on
        ties, NaN last), of those in the host tier the first ``st.n`` staged."""

        def run():
            v = np.where(np.isnan(logits), -np.inf, logits)
            best = np.lexsort((np.arange(n_expert), -v))[:k]
            host, p = int(host_ptr[0]), 0
            for e in best:
                s = int(slot_of[il * n_expert + int(e)])
                if p < st.n and host and s <= -2:
                    st.staged[p], st.src[p] = il * n_expert + int(e), host + (-2 - s) * slot_bytes
                    p += 1
            st.counts[2 * il], st.counts[2 * il + 1] = p, 0  # this step's, of this layer
            st.staged[p:], st.src[p:] = -1, 0

        return run

    def moe_stage_copy(self, st, slot_bytes: int, nbytes: int, read=None, dest=None):
        """cuda/prefetch.cu ``moe_stage_copy``: ``read(src, nbytes)`` (the sim's memory) into ``dest`` = (array,
        its sim address) at the set's staging slots (the backend's dequantized copies of a slot forgotten)."""
        arr, base = dest

        def run():
            for p in range(st.n):
                if int(st.src[p]):
                    o = st.base - base + p * slot_bytes
                    arr[o : o + nbytes] = read(int(st.src[p]), nbytes)
                    self.bk.forget(arr[o : o + slot_bytes])

        return run

    def take_rows(self, D, host, info, k: int, n: int):
        """cuda/fused.cu ``moe_take_rows`` on host arrays (``host``: the packed rows, f32)."""

        def run():
            m = 0
            for j in range(k):
                if int(info[k + j]) == -1:
                    D[j * n : (j + 1) * n] = host[m * n : (m + 1) * n]
                    m += 1

        return run

    def silu_mul(self, g, u, out):
        bk = self.bk
        return lambda: out.__setitem__(Ellipsis, bk.silu_mul(g, u))

    def h2d(self, dst, src, nbytes: int):
        return lambda: dst.__setitem__(Ellipsis, src)

    def d2h(self, dst, src, nbytes: int):
        return lambda: dst.__setitem__(Ellipsis, src)

    def logit_top_part(self, y, part):
        return lambda: None  # the sim ranks in logit_top_final

    def logit_top_final(self, part, out, y=None):
        """``out`` (int32 [TOP_WORDS]) as cuda/logit_top.cu fills it, from ``y`` by top_k_pairs' definition."""
        from ..sampling import top_k_pairs

        def run():
            bad = int(np.count_nonzero(~np.isfinite(y)))
            out[...] = 0
            out[0] = bad
            if not bad:
                pairs = top_k_pairs(y, TOP_K)
                out[1 : 1 + len(pairs)] = [i for i, _ in pairs]
                out[8 : 8 + len(pairs)] = np.array([v for _, v in pairs], dtype=np.float32).view(np.int32)

        return run


__all__ = ["SimOps"]
