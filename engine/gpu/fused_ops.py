"""The kernels of the fused decode step and how one launch of each is bound on CUDA (:class:`CudaOps`; their
NumPy stand-ins for the ``sim`` backend: :class:`strata.engine.gpu.fused_sim.SimOps`), and the records of what
a layer's launches read and write. :mod:`strata.engine.gpu.fused` builds the step's launch list from these
(:mod:`strata.engine.gpu.fused_launch`); the CUDA source is ``cuda/fused.cu`` (with the shared prelude).

Each ``ops.X(...)`` returns a closure that performs one launch (or copy) with arguments bound once,
so the list can be replayed eagerly or captured into a CUDA graph without rebuilding anything.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.layout import step as LS

from .. import layers

#: Threads per CTA of the attention kernel (one CTA per query head; warps split the positions).
ATTN_THREADS = 1024


FUSED_KERNEL_NAMES = (
    "resid_norm",
    "qk_prep",
    "attn",
    "act_mul",
    "logit_post",
    "moe_route",
    "moe_take_rows",
    "gate_mul",
    "gdn_conv",
    "gdn_step",
    "logit_top_part",
    "logit_top_final",
    "moe_stage",
    "moe_stage_copy",
)

#: The logits' summary (cuda/logit_top.cu; sizes from strata.layout.step, which counts its bytes): the best
#: TOP_K pairs, from TOP_PARTS CTAs of TOP_THREADS threads, into TOP_WORDS words.
TOP_K, TOP_PARTS, TOP_WORDS = LS.LOGIT_TOP_K, LS.LOGIT_TOP_PARTS, LS.LOGIT_TOP_WORDS
TOP_THREADS = 256
#: ``gdn_step``'s CTA (cuda/fused.cu ``GDN_THREADS``): one a v head, 16 warps sharing its rows.
GDN_THREADS = 512


def fused_source() -> str:
    """The CUDA source of the fused kernels: ``kernel_src/prelude.cuh`` + the q8 quantizers (``resid_norm`` quantizes
    the row it normalizes) + ``cuda/fused.cu`` + ``cuda/logit_top.cu`` + ``cuda/prefetch.cu``
    (compiled with :data:`strata.engine.gpu.kernels.NVRTC_OPTIONS`)."""
    from ..kernel_src import assembly as A
    from . import kernels as K

    top = f"#define TOPK {TOP_K}\n#define TOP_THREADS {TOP_THREADS}\n"
    return (
        A.source_file("prelude.cuh")
        + K.q8_quant_source()
        + K.cuda_file("fused.cu")
        + top
        + K.cuda_file("logit_top.cu")
        + K.cuda_file("prefetch.cu")
    )


@functools.lru_cache(maxsize=1)
def fused_kernels() -> dict:
    """Compile (once per process) and load the fused kernels (:func:`strata.engine.gpu.kernels.load_module`)."""
    from . import kernels as K

    return K.load_module(fused_source(), FUSED_KERNEL_NAMES)


#: Dynamic shared memory a CTA may take without opting in (CUDA's default per-CTA limit), bytes: ``moe_route``'s
#: bound (:func:`strata.engine.gpu.fused.fused_unsupported` refuses a model past it: ~4,000 experts).
ROUTE_SHMEM_MAX = 48 * 1024


def route_shared_bytes(n_expert: int) -> int:
    """``moe_route``'s dynamic shared memory, bytes: the ``n_expert`` probabilities (f32), then room for the
    candidates of its first step, an id (int32) and a probability (f32) for each of ``32 * ceil(n_expert / 32)``
    (cuda/fused.cu)."""
    return 4 * n_expert + 8 * 32 * -(-n_expert // 32)


def route_unsupported(n_expert: int) -> str | None:
    """Why ``moe_route`` cannot rank ``n_expert`` experts (None if it can): its shared memory
    (:func:`route_shared_bytes`) past :data:`ROUTE_SHMEM_MAX` - more than 4,096 experts."""
    need = route_shared_bytes(n_expert)
    if need <= ROUTE_SHMEM_MAX:
        return None
    return (
        f"n_expert {n_expert}: the fused routing kernel's shared memory ({need} B) exceeds the {ROUTE_SHMEM_MAX} B "
        "a CTA takes without opting in"
    )


def _threads(n: int, cap: int = 1024) -> int:
    """A multiple of 32 covering ``n`` items, at most ``cap``."""
    return max(32, min(cap, -(-int(n) // 32) * 32))


#: CTAs per staged expert of ``moe_stage_copy`` (256 threads each; cuda/probe.cu's read rate needs ~100 in flight).
STAGE_COPY_CTAS = 64

#: Most weights one ``matvec_group`` launch takes (its parameters carry 4 addresses).
MAX_GROUP = 4


@dataclass
class MoeIO:
    """Everything one layer's routed experts read and write (device arrays; :meth:`CudaOps.moe_route`).

    ``slot_of``: int32 ``[n_layer * n_expert]`` (>= 0: a device slot; <= -2: host-tier slot ``-2 - v``; -1: not
    resident anywhere the kernels read, the host computes it); ``storage_ptr`` / ``host_ptr``: one u64 each, the
    expert cache's device address and the host tier's mapped address (written when they exist, so a graph captured
    before reads them at replay); ``keep``: int32 ``[k + 1]``, of ``c`` selected experts in the host tier the first
    ``keep[c]`` stay there, the others go to the CPU (:func:`strata.engine.gpu.miss_split.keep_table`; ``keep[c] = c``:
    no split); ``offsets``: the layer's gate/up/down offsets inside a slot (bytes); ``info``:
    int32 ``[2 * k]``, the selected ids then their ``slot_of`` values (the layer's row of the step's routing record);
    ``stage``: the layer's prefetch staging set (:class:`strata.engine.gpu.prefetch.StageSet`), or None."""

    il: int
    logits: Any
    n_expert: int
    k: int
    norm: bool
    slot_of: Any
    storage_ptr: Any
    host_ptr: Any
    keep: Any
    slot_bytes: int
    offsets: tuple[int, int, int]
    probs: Any
    weights: Any
    bases: Any
    info: Any
    stage: Any = None


@dataclass(frozen=True)
class Combine:
    """A layer's routed experts as the residual branch of the ``resid_norm`` after them (``moe_combine`` fused into
    that launch): ``y[i] = D[0, i] w[0] + D[1, i] w[1] + ...`` in selection order, plus ``S[i] * sigmoid(gdot[0])``
    with a shared expert. ``D``: f32 ``[k, n]`` (numpy order), the selected experts' down outputs; ``w``: f32 ``[k]``,
    their routing weights; ``S``: f32 ``[n]``, the shared expert's output, or None; ``gdot``: f32 ``[1]``, its gate
    logit (given whenever ``S`` is: the fused step runs gated shared experts only, qwen2moe / qwen3next)."""

    D: Any
    w: Any
    k: int
    n: int
    S: Any = None
    gdot: Any = None


@dataclass
class AttnIO:
    """Everything one layer's ``qk_prep`` and ``attn`` read and write (device arrays)."""

    il: int
    q: Any
    k: Any
    v: Any
    qb: Any
    kb: Any
    vb: Any
    qnw: Any
    knw: Any
    rope: layers.Rope
    cache: layers.KVCache
    n_head: int
    n_kv: int
    hd: int
    hd_v: int
    window: int | None
    eps: float
    scale: float
    scale_q: bool
    params: Any
    qo: Any
    ao: Any
    scores: Any
    q_stride: int = 0  # elements between query heads in ``q``: hd, or 2 hd with an output gate ([q | gate])

    @property
    def kq_scale(self) -> float:
        return 1.0 if self.scale_q else self.scale


@dataclass
class GdnIO:
    """One gated-delta-net layer's step (:mod:`strata.engine.deltanet`): inputs ``qkv``, ``z``, ``ba``
    (matvec outputs), state ``cs [d_conv - 1, conv_dim]`` and ``S [dt_rank, d_state, d_state]``,
    weights ``cw [conv_dim, d_conv]`` (an f32 copy), ``dt_bias``, ``ssm_a``, ``norm_w``; buffers ``h``
    (conv output) and ``o`` (the gated-normed output, input of ssm_out); ``params`` (pos at 0)."""

    il: int
    qkv: Any
    z: Any
    ba: Any
    cs: Any
    S: Any
    cw: Any
    dt_bias: Any
    ssm_a: Any
    norm_w: Any
    h: Any
    o: Any
    params: Any
    dims: Any


class CudaOps:
    """Launch closures over the compiled kernels, on ``stream``; arguments are built once."""

    def __init__(self, stream):
        import cupy as cp

        self.cp, self.stream = cp, stream
        self.k = fused_kernels()
        self.null = np.uint64(0)

    def _p(self, a):
        return self.null if a is None else a

    def _call(self, f, grid, block, args, shmem=0):
        s = self.stream
        return lambda: f(grid, block, args, shared_mem=shmem, stream=s)

    def quantize(self, x, xq, fmt, n, rows=1, x_stride=0, out_stride=0, silu=None):
        """``quantize_q8`` of ``rows`` rows of ``n`` values of ``x`` (``x_stride`` floats apart) into ``xq``
        (``out_stride`` bytes apart): the q8 kernels' input (:func:`strata.engine.gpu.kernels.quantize_q8`). ``silu``
        ``(g, u)`` (rows laid out as ``x``'s): ``x`` is made first in the same launch, ``silu(g) * u``
        (:meth:`silu_mul`'s bits)."""
        from . import kernels as K

        g, u = silu if silu is not None else (None, None)
        return self._call(
            K.quantize_kernel(),
            K.quantize_grid(n, fmt, rows),
            (256,),
            (x, np.int32(n), np.int64(x_stride or n), np.int32(fmt), xq, np.int64(out_stride), self._p(g), self._p(u)),
        )

    def matvec(self, type_id, buf, rows, ne0, x, out, xq=None):
        """``matvec`` (exact) of ``x``, or with ``xq`` (``x`` quantized by :meth:`quantize`) ``matvec_q8``."""
        from . import kernels as K

        if xq is not None:
            k8 = K.q8_kernels_for(type_id)
            gx, nt, shmem, split = K.q8_launch(k8, rows, ne0)
            return self._call(
                k8.matvec, (gx,), (nt,), (buf, np.int64(rows), np.int32(ne0), xq, out, np.int32(split)), shmem
            )
        k = K.kernels_for(type_id)
        K.check_matvec(k, rows, ne0)
        return self._call(
            k.matvec,
            (K.matvec_grid_x(type_id, rows),),
            (32 * K.WARPS_PER_CTA,),
            (buf, np.int64(rows), np.int32(ne0), x, out),
        )

    def matvec_group(self, type_id, parts, ne0, x, xq=None):
        """One launch of ``matvec_group`` (or with ``xq``, ``matvec_q8_group``) over ``parts`` = [(buf, rows,
        out)] (1 to 4) of one type and row length; addresses and row counts travel as kernel parameters."""
        from . import kernels as K

        k = K.kernels_for(type_id)
        n = len(parts)
        if not 1 <= n <= MAX_GROUP:
            raise ValueError(f"matvec_group takes 1..{MAX_GROUP} weights, got {n}")
        for _b, rows, _o in parts:
            K.check_matvec(k, rows, ne0)
        pad = [parts[0]] * (MAX_GROUP - n)
        full = list(parts) + pad
        bases = [np.uint64(b.data.ptr) for b, _r, _o in full]
        rows = [np.int64(r) for _b, r, _o in full]
        outs = [np.uint64(o.data.ptr) for _b, _r, o in full]
        max_rows = max(int(r) for _b, r, _o in parts)
        if xq is not None:
            k8 = K.q8_kernels_for(type_id)
            gx, nt, shmem, split = K.q8_launch(k8, max_rows, ne0)
            return self._call(
                k8.matvec_group, (gx, n), (nt,), (*bases, *rows, np.int32(ne0), xq, *outs, np.int32(split)), shmem
            )
        return self._call(
            k.matvec_group,
            (K.matvec_grid_x(type_id, max_rows), n),
            (32 * K.WARPS_PER_CTA,),
            (*bases, *rows, np.int32(ne0), x, *outs),
        )

    def resid_norm(self, x, a, ab, wa, w, xn, eps, scale, mode, xq=None, qfmt=0, w2=None, xn2=None):
        """``resid_norm``; with ``xq``/``qfmt`` it also writes ``xn`` quantized (q8 layout) for the q8 matvecs; with
        ``w2``/``xn2`` also ``xn2 = rms_norm(x) * w2`` (the prefetch's router input). ``a`` a :class:`Combine`: the
        branch is the routed experts' weighted sum, computed in the launch."""
        n = int(x.size)
        c = a if isinstance(a, Combine) else None
        return self._call(
            self.k["resid_norm"],
            (1,),
            (_threads(n),),
            (
                x,
                self._p(None if c else a),
                self._p(ab),
                self._p(wa),
                self._p(w),
                self._p(xn),
                np.int32(n),
                np.float32(eps),
                np.float32(scale),
                np.int32(mode),
                self._p(xq),
                np.int32(qfmt),
                self._p(c.D if c else None),
                self._p(c.w if c else None),
                np.int32(c.k if c else 0),
                self._p(c.S if c else None),
                self._p(c.gdot if c else None),
                self._p(w2),
                self._p(xn2),
            ),
        )

    def qk_prep(self, L: AttnIO):
        kc, vc = L.cache.k[L.il], L.cache.v[L.il]
        return self._call(
            self.k["qk_prep"],
            (L.n_head + L.n_kv,),
            (_threads(max(L.hd, L.hd_v)),),
            (
                L.q,
                L.k,
                L.v,
                self._p(L.qb),
                self._p(L.kb),
                self._p(L.vb),
                self._p(L.qnw),
                self._p(L.knw),
                L.rope.cos,
                L.rope.sin,
                L.params,
                L.qo,
                kc,
                vc,
                np.int32(L.n_head),
                np.int32(L.n_kv),
                np.int32(L.hd),
                np.int32(L.hd_v),
                np.int32(L.rope.n_rot),
                np.int32(L.cache.sizes[L.il]),
                np.float32(L.eps),
                np.float32(L.scale),
                np.int32(L.scale_q),
                np.int32(L.cache.kv == "f16"),
                np.int32(L.rope.mode == "norm"),
                np.int32(L.q_stride or L.hd),
            ),
            shmem=4 * L.hd,
        )

    def gate_mul(self, ao, qg, n_head, hd):
        n = n_head * hd
        return self._call(self.k["gate_mul"], ((n + 255) // 256,), (256,), (ao, qg, np.int32(n_head), np.int32(hd)))

    def gdn_conv(self, G: GdnIO):
        d = G.dims
        return self._call(
            self.k["gdn_conv"],
            ((d.conv_dim + 255) // 256,),
            (256,),
            (G.qkv, G.cs, G.cw, np.int32(d.conv_dim), np.int32(d.d_conv), G.params, G.h),
        )

    def gdn_step(self, G: GdnIO):
        d = G.dims
        return self._call(
            self.k["gdn_step"],
            (d.dt_rank,),
            (GDN_THREADS,),
            (
                G.h,
                G.z,
                G.ba,
                G.S,
                G.dt_bias,
                G.ssm_a,
                G.norm_w,
                G.params,
                np.int32(d.n_group),
                np.int32(d.dt_rank),
                np.int32(d.d_state),
                np.float32(d.eps),
                np.float32(1.0 / d.d_state**0.5),
                G.o,
            ),
            shmem=12 * d.d_state,  # q, k and o of the head (f32)
        )

    def attn(self, L: AttnIO):
        kc, vc = L.cache.k[L.il], L.cache.v[L.il]
        stride = int(L.scores.size) // L.n_head
        return self._call(
            self.k["attn"],
            (L.n_head,),
            (ATTN_THREADS,),
            (
                L.qo,
                kc,
                vc,
                L.params,
                L.scores,
                L.ao,
                np.int32(L.n_head),
                np.int32(L.n_kv),
                np.int32(L.hd),
                np.int32(L.hd_v),
                np.int32(L.cache.sizes[L.il]),
                np.int32(L.window or 0),
                np.float32(L.kq_scale),
                np.int32(L.cache.kv == "f16"),
                np.int32(stride),
            ),
            shmem=4 * ATTN_THREADS,
        )

    def act_mul(self, g, u, out, kind):
        n = int(out.size)
        return self._call(
            self.k["act_mul"],
            ((n + 255) // 256,),
            (256,),
            (
                g,
                u,
                out,
                np.int32(n),
                np.int32(1 if kind == "gelu" else 0),
                np.float32(layers.GELU_C),
                np.float32(0.044715),
            ),
        )

    def logit_post(self, y, bias, cap):
        n = int(y.size)
        inv = np.float32(1.0 / cap) if cap else np.float32(0)
        return self._call(
            self.k["logit_post"],
            ((n + 255) // 256,),
            (256,),
            (y, self._p(bias), np.int32(n), inv, np.float32(cap or 0), np.int32(bool(cap))),
        )

    def logit_top_part(self, y, part):
        return self._call(self.k["logit_top_part"], (TOP_PARTS,), (TOP_THREADS,), (y, np.int32(y.size), part))

    def logit_top_final(self, part, out, y=None):
        return self._call(self.k["logit_top_final"], (1,), (TOP_PARTS,), (part, out))

    def moe_route(self, M: MoeIO):
        st = M.stage
        return self._call(
            self.k["moe_route"],
            (1,),
            (_threads(min(M.n_expert, 1024)),),
            (
                M.logits,
                np.int32(M.n_expert),
                np.int32(M.k),
                np.int32(M.norm),
                M.slot_of,
                np.int32(M.il),
                M.storage_ptr,
                M.host_ptr,
                M.keep,
                np.int64(M.slot_bytes),
                np.int64(M.offsets[0]),
                np.int64(M.offsets[1]),
                np.int64(M.offsets[2]),
                M.probs,
                M.weights,
                M.bases,
                M.info,
                self._p(st.staged if st else None),
                np.uint64(st.base if st else 0),
                np.int32(st.n if st else 0),
                self._p(st.counts if st else None),
            ),
            route_shared_bytes(M.n_expert),
        )

    def moe_stage(self, logits, n_expert: int, k: int, slot_of, il: int, host_ptr, slot_bytes: int, st):
        """``moe_stage`` (cuda/prefetch.cu): layer ``il``'s staging plan from its predicted ``logits`` (f32
        ``[n_expert]``) into ``st`` (:class:`strata.engine.gpu.prefetch.StageSet`: ``staged``, ``src``, ``counts``)."""
        return self._call(
            self.k["moe_stage"],
            (1,),
            (_threads(min(n_expert, 1024)),),
            (
                logits,
                np.int32(n_expert),
                np.int32(k),
                slot_of,
                np.int32(il),
                np.int32(st.n),
                host_ptr,
                np.int64(slot_bytes),
                st.staged,
                st.src,
                st.counts,
            ),
            4 * n_expert,
        )

    def moe_stage_copy(self, st, slot_bytes: int, nbytes: int, read=None, dest=None):
        """``moe_stage_copy`` (cuda/prefetch.cu): the ``nbytes`` (a multiple of 16) of each entry of ``st`` with a
        source into its staging slot (``read`` / ``dest``: the sim's)."""
        return self._call(
            self.k["moe_stage_copy"],
            (STAGE_COPY_CTAS, st.n),
            (256,),
            (st.src, np.uint64(st.base), np.int64(slot_bytes), np.int64(nbytes // 16)),
        )

    def take_rows(self, D, host_ptr: int, info, k: int, n: int):
        """``moe_take_rows``: the CPU's rows (packed f32 rows of ``n`` at the mapped address ``host_ptr``) into the
        rows of ``D`` (f32 ``[k, n]``) whose slot in ``info`` (int32 ``[2k]``: ids, slots) is -1."""
        return self._call(
            self.k["moe_take_rows"],
            (max(1, min(8, -(-n // 1024))), k),
            (256,),
            (D, np.uint64(host_ptr), info, np.int32(k), np.int32(n)),
        )

    def matvec_batched(self, type_id, bases, rows, ne0, X, x_stride, out, storage=None, nbytes=0, xq=None, xq_stride=0):
        """The batched matvec over the addresses in ``bases`` (``storage``/``nbytes``: the sim's); with ``xq``
        (``X`` quantized by :meth:`quantize`, rows ``xq_stride`` bytes apart, 0 = one for all) ``matvec_q8_batched``."""
        from . import kernels as K

        k = K.kernels_for(type_id)
        K.check_matvec(k, rows, ne0)
        n = int(bases.size)
        if xq is not None:
            k8 = K.q8_kernels_for(type_id)
            gx, nt, shmem, split = K.q8_launch(k8, rows, ne0)
            return self._call(
                k8.matvec_batched,
                (gx, n),
                (nt,),
                (bases, np.int64(rows), np.int32(ne0), xq, np.int64(xq_stride), out, np.int32(split)),
                shmem,
            )
        return self._call(
            k.matvec_batched,
            (K.matvec_grid_x(type_id, rows), n),
            (32 * K.WARPS_PER_CTA,),
            (bases, np.int64(rows), np.int32(ne0), X, np.int64(x_stride), out),
        )

    def silu_mul(self, g, u, out):
        from . import kernels as K

        f, n = K.silu_kernel(), int(out.size)
        return self._call(f, ((n + 255) // 256,), (256,), (g, u, out, np.int64(n)))

    def h2d(self, dst, src_ptr: int, nbytes: int):
        rt, s = self.cp.cuda.runtime, self.stream
        return lambda: rt.memcpyAsync(dst.data.ptr, src_ptr, nbytes, rt.memcpyHostToDevice, s.ptr)

    def d2h(self, dst_ptr: int, src, nbytes: int):
        rt, s = self.cp.cuda.runtime, self.stream
        return lambda: rt.memcpyAsync(dst_ptr, src.data.ptr, nbytes, rt.memcpyDeviceToHost, s.ptr)


__all__ = [
    "ATTN_THREADS",
    "MAX_GROUP",
    "TOP_K",
    "TOP_PARTS",
    "TOP_THREADS",
    "TOP_WORDS",
    "AttnIO",
    "Combine",
    "CudaOps",
    "FUSED_KERNEL_NAMES",
    "GDN_THREADS",
    "ROUTE_SHMEM_MAX",
    "route_shared_bytes",
    "route_unsupported",
    "GdnIO",
    "MoeIO",
    "fused_kernels",
    "fused_source",
]
