"""The device under the GPU engine: CuPy on a CUDA GPU, or a NumPy simulation of it.

Everything the GPU engine does to memory goes through a :class:`Backend`: upload engine-form
bytes, run the kernels, read ``cudaMemGetInfo`` and the CuPy pool. :class:`CudaBackend` is the
real thing. :class:`SimBackend` runs the same engine logic on the host (buffers are NumPy arrays,
``matvec`` is :func:`strata.engine.gpu.reference.matvec` on exactly dequantized weights, memory
figures come from a simulated card) so start-up order, slot sizing, the profile fill and the
hit/miss split are tested in CI, which has no GPU. The kernels replicate bit for bit
(tests/test_gpu_kernels.py), so a sim run's expert outputs equal a CUDA run's.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.budget.cards import Card
from strata.engine import engine_form as EF
from strata.packer import quants

from ..errors import GenerateError
from . import reference as R


class GpuUnavailable(GenerateError):
    """``--device cuda`` without CuPy or a CUDA device (the reason is in the message)."""


def _engine_pool_src(type_id: int) -> tuple[int, int]:
    """(pool type, source type) that put a tensor of kernel type ``type_id`` in engine form."""
    return (quants.F32.id, quants.BF16.id) if type_id == quants.BF16.id else (type_id, type_id)


@dataclass
class MemInfo:
    """Device memory as the driver and the allocator see it (bytes). On an emulated card (``--card``)
    ``free`` and ``total`` are the card's (:mod:`strata.engine.gpu.card`) and ``physical_*`` the GPU's;
    otherwise ``physical_*`` are None."""

    free: int
    total: int
    pool_used: int
    pool_total: int
    physical_free: int | None = None
    physical_total: int | None = None


class Backend(abc.ABC):
    """Interface (see the module docstring); every abstract method is implemented by both backends (a backend
    lacking one is refused when it is made: ``TypeError`` naming it). Buffers are 1-D uint8 device arrays; views of them
    (``buf[a:b]``) are buffers too."""

    name = "abstract"
    xp: Any = None

    #: allocations made through this backend: count, bytes asked, bytes rounded to the pool's unit
    n_allocs = 0
    alloc_bytes = 0
    alloc_rounded_bytes = 0
    #: CuPy's pool rounds every allocation up to a multiple of this (cupy/cuda/memory.pyx)
    POOL_UNIT = 512

    def _account(self, nbytes: int) -> None:
        self.n_allocs += 1
        self.alloc_bytes += int(nbytes)
        self.alloc_rounded_bytes += -(-int(nbytes) // self.POOL_UNIT) * self.POOL_UNIT

    def prepare(self, type_ids, q8: bool = False) -> None:
        """Compile / load the kernels of ``type_ids`` (and the expert activation; with ``q8`` the q8 kernels of
        those types that have one and the activation quantizer) now, so their modules are loaded before the
        expert cache measures free memory."""
        return None

    def external(self, nbytes: int, what: str) -> None:
        """Device memory the engine allocated with the array module itself (KV cache, rope tables,
        recurrent state: ``xp.zeros``), not through this backend. CuPy's pool (and a card emulation's
        hook) sees those already; a simulated card counts them here."""
        return None

    def span_timer(self) -> Any:
        """An object with ``start()`` and ``stop() -> ms`` timing device work between them, or None."""
        return None

    @abc.abstractmethod
    def upload(self, host: np.ndarray) -> Any: ...
    @abc.abstractmethod
    def empty_bytes(self, n: int) -> Any: ...
    @abc.abstractmethod
    def empty_f32(self, n: int) -> Any: ...
    @abc.abstractmethod
    def copy_into(self, dst: Any, host: np.ndarray) -> None: ...
    @abc.abstractmethod
    def matvec(self, type_id: int, buf: Any, rows: int, ne0: int, x: Any, out: Any = None) -> Any: ...
    @abc.abstractmethod
    def matvec_q8(self, type_id: int, buf: Any, rows: int, ne0: int, x: Any, out: Any = None) -> Any: ...
    @abc.abstractmethod
    def silu_mul(self, g: Any, u: Any, out: Any = None) -> Any: ...
    @abc.abstractmethod
    def rows_product(self, type_id: int, buf: Any, rows: int, ne0: int, X: Any, tile: Any, tf32: bool) -> Any:
        """A prompt chunk's product ``X @ W.T`` (``X [T, ne0]`` f32, numpy order; ``W`` the engine-form weight
        ``[rows, ne0]``): f32 ``[T, rows]``, through the preallocated f32 ``tile`` (:mod:`strata.engine.gpu.gemm`)."""

    @abc.abstractmethod
    def grouped_product(self, type_id: int, bufs: list, rows: int, ne0: int, Xg: Any, tile: Any, tf32: bool) -> Any:
        """``out[g] = Xg[g] @ W_g.T`` for the engine-form weights ``bufs`` (one type and shape ``[rows, ne0]``) and
        ``Xg [G, M, ne0]`` f32: f32 ``[G, M, rows]`` (a chunk's routed experts, :mod:`strata.engine.gpu.chunk`)."""

    def addresses(self, parts: list[list[Any]]) -> Any:
        """Rows of weight buffers as what :meth:`grouped_product` takes: ``addresses(rows)[i][a:b]`` is row ``i``'s
        buffers ``a .. b-1`` (CUDA: one ``uint64 [rows, n]`` device array of their addresses, one copy; sim: the
        lists)."""
        return parts

    def ref(self, base: Any, offset: int, nbytes: int) -> Any:
        """``nbytes`` bytes at byte ``offset`` of ``base`` (a device buffer, or what :meth:`tier_base` gives) as what
        :meth:`addresses` takes: here the view ``base[offset : offset + nbytes]``; CUDA: the int device address (no
        array object made: a prompt chunk names every expert of every layer)."""
        return base[offset : offset + nbytes]

    def refs(self, base: Any, offsets: np.ndarray, nbytes: int) -> list:
        """:meth:`ref` of each of ``offsets`` (bytes, int64): a list here; CUDA: a uint64 numpy array of addresses."""
        return [self.ref(base, int(o), nbytes) for o in offsets]

    def address_table(self, rows: list) -> Any:
        """Rows of :meth:`refs` results (one per part) as what :meth:`expert_mm` takes: ``table[i][a:b]`` is row
        ``i``'s weights ``a .. b-1`` (CUDA: one ``uint64 [rows, n]`` device array, one copy; here the lists)."""
        return rows

    def copy_bytes(self, dst: Any, dst_off: int, src: Any, src_off: int, nbytes: int) -> None:
        """``nbytes`` bytes from byte ``src_off`` of ``src`` (a device buffer or :meth:`tier_base`) to byte ``dst_off``
        of the device buffer ``dst``, ordered after the work queued before it (CUDA: one asynchronous copy on the
        current stream)."""
        dst[dst_off : dst_off + nbytes] = src[src_off : src_off + nbytes]

    def side_copies(self, dst: Any, src: Any, copies: list[tuple[int, int]], nbytes: int, after: Any = None) -> Any:
        """``nbytes`` bytes from byte ``s`` of ``src`` (a device buffer or :meth:`tier_base`) to byte ``d`` of the
        device buffer ``dst`` for each ``(d, s)`` of ``copies``, on a side stream beside the compute stream, after the
        compute-stream point ``after`` (a :meth:`mark`, or None); returns a token for :meth:`wait`. Here: copied now,
        token None. CUDA: asynchronous copies on a non-blocking stream (pinned host memory: the copy engine, under the
        kernels), the token an event after them."""
        for d, s_ in copies:
            self.copy_bytes(dst, d, src, s_, nbytes)
        return None

    def mark(self) -> Any:
        """A point on the compute stream after the work queued so far (CUDA: an event), for :meth:`side_copies`'s
        ``after``; None here (nothing is queued)."""
        return None

    def wait(self, token: Any) -> None:
        """The compute stream's later work waits for ``token`` (:meth:`side_copies`'s; None: nothing to wait for)."""
        return None

    def tier_base(self, tier: Any) -> Any:
        """The base :meth:`ref` takes for a host tier (:class:`strata.engine.gpu.slots.HostTier`): its host bytes
        here, its device address on CUDA."""
        return tier.storage

    def mm_types(self, type_ids) -> bool:
        """Whether experts of ``type_ids`` take :meth:`expert_mm` (block types: :func:`strata.engine.gpu.moe_mm.
        supports`); on CUDA their modules are compiled now (before the expert cache measures free memory)."""
        from . import moe_mm

        return all(moe_mm.supports(int(t)) for t in type_ids)

    def index_array(self, host: np.ndarray) -> Any:
        """A chunk layer's int32 pair index (:class:`strata.engine.gpu.moe_mm.PairIndex`) on the device (one copy)."""
        return np.asarray(host, dtype=np.int32)

    @abc.abstractmethod
    def expert_mm(
        self, type_id: int, bufs: Any, rows: int, ne0: int, X: Any, index: Any, rnd, out: Any, src: bool, xscale=None
    ):
        """One round of a chunk's grouped expert product (:func:`strata.engine.gpu.moe_mm.grouped_mm`: f16 operands,
        f32 sums): ``bufs`` the round's experts' engine-form weights ``[rows, ne0]`` (a row of :meth:`address_table`),
        ``X [R, ne0]`` f32, ``index`` from :meth:`index_array` (a :class:`strata.engine.gpu.moe_mm.PairIndex`), ``rnd``
        its round, ``out [P, rows]`` f32 (numpy order). ``src``: pair ``p`` reads row ``src[p]`` of ``X`` (the
        chunk's rows, gate and up); False: row ``p`` (the pairs' own rows, down). ``xscale``: :meth:`row_scales` of
        ``X`` when the caller has them (gate and up share them)."""

    def row_scales(self, type_id: int, X: Any) -> Any:
        """:func:`strata.engine.gpu.moe_mm.row_f16_scales` of ``X`` for :meth:`expert_mm` (None here: the reference
        computes its own)."""
        return None

    @abc.abstractmethod
    def host_view(self, owner: Any, storage: np.ndarray, address: int, offset: int, nbytes: int) -> Any:
        """``nbytes`` bytes at ``offset`` of a host-tier allocation (``storage``: its bytes on the host;
        ``address``: its device address) as a buffer the device's kernels read."""

    @abc.abstractmethod
    def mem_info(self) -> MemInfo: ...
    @abc.abstractmethod
    def synchronize(self) -> None: ...
    @abc.abstractmethod
    def to_host(self, a: Any) -> np.ndarray: ...
    @abc.abstractmethod
    def device_name(self) -> str: ...


class CudaBackend(Backend):
    """CuPy on the current CUDA device; kernels from :mod:`strata.engine.gpu.kernels`."""

    name = "cuda"

    def __init__(self, card: Card | None = None):
        from strata.budget.cards import nvml_memory

        from . import kernels
        from .card import CardEmulation, primary_context_active

        # NVML before this process's CUDA context exists: the context's cost when a card is emulated
        before = nvml_memory(0) if card is not None and primary_context_active(0) is False else None
        ok, why = kernels.gpu_available()
        if not ok:
            hint = (
                " - install it with pip install -e '.[cuda]' (a CuPy wheel for your CUDA)"
                if "CuPy" in why and "importable" in why
                else ""
            )
            raise GpuUnavailable(f"--device cuda: {why}{hint}")
        import cupy as cp

        self.cp = cp
        self.xp = cp
        self.K = kernels
        self._why = why
        self._side = None  # side_copies' stream, made at first use
        self.emulation: CardEmulation | None = None
        if card is not None:
            self.emulation = CardEmulation.start(card, cp, before)
        else:
            CardEmulation.uninstall(cp)  # an earlier engine of this process may have emulated a card

    def upload(self, host):
        a = self.cp.asarray(np.ascontiguousarray(host, dtype=np.uint8))
        self._account(a.nbytes)
        return a

    def empty_bytes(self, n):
        self._account(int(n))
        return self.cp.empty(int(n), dtype=self.cp.uint8)

    def empty_f32(self, n):
        self._account(4 * int(n))
        return self.cp.zeros(int(n), dtype=self.cp.float32)

    def prepare(self, type_ids, q8: bool = False):
        for t in sorted(set(type_ids)):
            self.K.kernels_for(t)
            if q8 and t in self.K.Q8_GPU_TYPES:
                self.K.q8_kernels_for(t)
        if q8:
            self.K.quantize_kernel()
        self.K.silu_kernel()

    def span_timer(self):
        return _CudaSpan(self.cp)

    def copy_into(self, dst, host):
        dst.set(
            np.ascontiguousarray(host).reshape(dst.shape).view(dst.dtype)
            if host.dtype != dst.dtype
            else np.ascontiguousarray(host).reshape(dst.shape)
        )

    def matvec(self, type_id, buf, rows, ne0, x, out=None):
        return self.K.matvec(type_id, buf, rows, ne0, x, out=out)

    def matvec_q8(self, type_id, buf, rows, ne0, x, out=None):
        return self.K.matvec_q8(type_id, buf, rows, ne0, x, out=out)

    def silu_mul(self, g, u, out=None):
        return self.K.silu_mul(g, u, out=out)

    def rows_product(self, type_id, buf, rows, ne0, X, tile, tf32):
        from . import gemm

        return gemm.rows_product(type_id, buf, rows, ne0, X, tile, tf32=tf32)

    def grouped_product(self, type_id, bufs, rows, ne0, Xg, tile, tf32):
        from . import gemm

        return gemm.grouped_product(type_id, bufs, rows, ne0, Xg, tile, tf32=tf32)

    def addresses(self, parts):
        from . import gemm

        n = len(parts[0]) if parts else 0
        return gemm.addresses([b for row in parts for b in row]).reshape(len(parts), n)

    def ref(self, base, offset, nbytes):
        return (base if isinstance(base, int) else int(base.data.ptr)) + int(offset)

    def tier_base(self, tier):
        return int(tier.address)

    def refs(self, base, offsets, nbytes):
        b = base if isinstance(base, int) else int(base.data.ptr)
        return (np.asarray(offsets, dtype=np.int64) + b).astype(np.uint64)

    def copy_bytes(self, dst, dst_off, src, src_off, nbytes):
        cp = self.cp
        s = src if isinstance(src, int) else int(src.data.ptr)
        cp.cuda.runtime.memcpyAsync(
            int(dst.data.ptr) + int(dst_off), s + int(src_off), int(nbytes), cp.cuda.runtime.memcpyDefault,
            cp.cuda.get_current_stream().ptr,
        )  # fmt: skip

    def side_copies(self, dst, src, copies, nbytes, after=None):
        cp = self.cp
        if self._side is None:
            self._side = cp.cuda.Stream(non_blocking=True)
        side = self._side
        if after is not None:
            side.wait_event(after)
        d0, s0 = int(dst.data.ptr), src if isinstance(src, int) else int(src.data.ptr)
        for d, s_ in copies:
            cp.cuda.runtime.memcpyAsync(d0 + int(d), s0 + int(s_), int(nbytes), cp.cuda.runtime.memcpyDefault, side.ptr)
        return side.record()

    def mark(self):
        return self.cp.cuda.get_current_stream().record()

    def wait(self, token):
        if token is not None:
            self.cp.cuda.get_current_stream().wait_event(token)

    def mm_types(self, type_ids):
        from . import moe_mm

        if not super().mm_types(type_ids):
            return False
        for t in sorted({int(t) for t in type_ids}):
            moe_mm.kernels(t)
        return True

    def index_array(self, host):
        return self.upload_async(np.ascontiguousarray(host, dtype=np.int32))

    def address_table(self, rows):
        return self.upload_async(np.stack([np.asarray(r, dtype=np.uint64) for r in rows]))

    #: pinned host buffers :meth:`upload_async` cycles through (each reused once its copy has run)
    UPLOAD_RING = 8

    def upload_async(self, host: np.ndarray):
        """``host`` (a small array: a chunk layer's index or addresses) as a new device array, copied from a pinned
        buffer on the current stream without waiting for the kernels queued before it (a copy from pageable memory
        waits for them; the host then idles the device while it builds the next layer's launches)."""
        cp = self.cp
        host = np.ascontiguousarray(host)
        if host.nbytes == 0:
            return cp.empty(host.shape, dtype=host.dtype)
        if not hasattr(self, "_ring"):
            self._ring = [[None, 0, None] for _ in range(self.UPLOAD_RING)]
            self._ring_i = 0
        slot = self._ring[self._ring_i]
        self._ring_i = (self._ring_i + 1) % len(self._ring)
        if slot[2] is not None:
            slot[2].synchronize()  # its previous copy has run
        if slot[1] < host.nbytes:
            slot[0], slot[1] = cp.cuda.alloc_pinned_memory(host.nbytes), host.nbytes
        view = np.frombuffer(slot[0], np.uint8, host.nbytes).view(host.dtype).reshape(host.shape)
        view[...] = host
        dev = cp.empty(host.shape, dtype=host.dtype)
        stream = cp.cuda.get_current_stream()
        dev.set(view, stream=stream)
        slot[2] = stream.record()
        return dev

    def expert_mm(self, type_id, bufs, rows, ne0, X, index, rnd, out, src, xscale=None):
        from . import moe_mm

        return moe_mm.grouped_mm(type_id, bufs, rows, ne0, X, index, rnd, out, src=src, xscale=xscale)

    def row_scales(self, type_id, X):
        from . import moe_mm

        return moe_mm.row_f16_scales(type_id, X)

    def host_view(self, owner, storage, address, offset, nbytes):
        cp = self.cp
        mem = cp.cuda.UnownedMemory(int(address) + int(offset), int(nbytes), owner)
        return cp.ndarray((int(nbytes),), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))

    def mem_info(self):
        free, total = (int(x) for x in self.cp.cuda.runtime.memGetInfo())
        pool = self.cp.get_default_memory_pool()
        used, held = int(pool.used_bytes()), int(pool.total_bytes())
        emu = self.emulation
        if emu is None:
            return MemInfo(free, total, used, held)
        return MemInfo(emu.free(free), emu.card.total_bytes, used, held, physical_free=free, physical_total=total)

    def synchronize(self):
        self.cp.cuda.Device().synchronize()

    def to_host(self, a):
        from ..layers import to_host

        return to_host(a)

    def device_name(self):
        if self.emulation is not None:
            return f"{self.emulation.card.name} emulated on {self._why}"
        return self._why


class _CudaSpan:
    """Device time between two CUDA events on the current stream (created once, reused: the token
    path creates nothing). ``stop`` waits for the end event: the time it blocks counts as host wait."""

    def __init__(self, cp):
        self.cp = cp
        self.a, self.b = cp.cuda.Event(), cp.cuda.Event()

    def start(self) -> None:
        self.a.record()

    def stop(self) -> float:
        from ..layers import HostWait

        self.b.record()
        t0 = time.perf_counter()
        self.b.synchronize()
        HostWait.ms += (time.perf_counter() - t0) * 1000
        return float(self.cp.cuda.get_elapsed_time(self.a, self.b))


class SimBackend(Backend):
    """NumPy stand-in for a GPU of ``total_bytes`` with ``context_bytes`` already used (CUDA
    context). Memory figures count every buffer this backend handed out (engine-form weights,
    slots) and the session's arrays (:meth:`external`), like a CuPy pool with no caching; an
    allocation past ``total_bytes`` fails (:class:`strata.engine.gpu.card.CardOutOfMemory`), as on a
    card. ``name`` names the card in messages (``card_name``: e.g. a ``--card`` preset)."""

    name = "sim"
    xp = np

    def __init__(self, total_bytes: int = 24 << 30, context_bytes: int = 500 << 20, card_name: str | None = None):
        self.total = int(total_bytes)
        self.context = int(context_bytes)
        self.card_name = card_name
        self.allocated = 0
        self._deq: dict[tuple, np.ndarray] = {}

    def _check(self, nbytes: int, what: str) -> None:
        from .card import CardOutOfMemory

        held = self.context + self.allocated
        if held + int(nbytes) > self.total:
            raise CardOutOfMemory(
                f"out of memory on the simulated card {self.card_name or f'of {self.total} B'}: {what} of "
                f"{int(nbytes)} B "
                f"with {held} B held (CUDA context included) of the card's {self.total} B - the allocation fails as it "
                f"would on that card"
            )

    def _count(self, a: np.ndarray) -> np.ndarray:
        self.allocated += a.nbytes
        self._account(a.nbytes)
        return a

    def external(self, nbytes, what):
        self._check(nbytes, what)
        self.allocated += int(nbytes)

    def upload(self, host):
        self._check(np.asarray(host).nbytes, "an upload")
        return self._count(np.array(host, dtype=np.uint8, copy=True).reshape(-1))

    def empty_bytes(self, n):
        self._check(int(n), "an allocation")
        return self._count(np.zeros(int(n), dtype=np.uint8))

    def empty_f32(self, n):
        self._check(4 * int(n), "an allocation")
        return self._count(np.zeros(int(n), dtype=np.float32))

    def copy_into(self, dst, host):
        dst[...] = np.ascontiguousarray(host).reshape(dst.shape).view(dst.dtype) if host.dtype != dst.dtype else host

    def _weights(self, type_id, buf, rows, ne0):
        key = (buf.__array_interface__["data"][0], buf.nbytes, type_id, rows, ne0)
        w = self._deq.get(key)
        if w is None:
            pool_t, src_t = _engine_pool_src(type_id)
            w = EF.dequantize_engine_form(buf, pool_t, src_t, (ne0, rows)).reshape(rows, ne0)
            self._deq[key] = w
        return w

    def forget(self, buf) -> None:
        """Drop the dequantized copies of ``buf`` (a slot that is being overwritten)."""
        lo = buf.__array_interface__["data"][0]
        hi = lo + buf.nbytes
        for k in [k for k in self._deq if lo <= k[0] < hi]:
            del self._deq[k]

    def matvec(self, type_id, buf, rows, ne0, x, out=None):
        y = R.matvec(type_id, self._weights(type_id, buf, rows, ne0), x)
        if out is None:
            return y
        out[...] = y
        return out

    def matvec_q8(self, type_id, buf, rows, ne0, x, out=None):
        """The q8 product (llama.cpp's CPU numerics) by the CPU's ``"q8"`` kernel on the native blocks: what the
        device's ``matvec_q8`` gives bit for bit (tests/test_gpu_q8.py)."""
        from strata.engine.cpu import kernels as cpukernels

        key = (buf.__array_interface__["data"][0], buf.nbytes, type_id, rows, ne0, "native")
        raw = self._deq.get(key)
        if raw is None:
            pool_t, src_t = _engine_pool_src(type_id)
            raw = self._deq[key] = EF.from_engine_form(buf, pool_t, src_t, (ne0, rows)).reshape(-1)
        y = cpukernels.matvec(type_id, raw, rows, ne0, np.asarray(x, dtype=np.float32), kernel="q8", threads=1)
        if out is None:
            return y
        out[...] = y
        return out

    def silu_mul(self, g, u, out=None):
        y = R.silu_mul(g, u)
        if out is None:
            return y
        out[...] = y
        return out

    def rows_product(self, type_id, buf, rows, ne0, X, tile, tf32):
        """NumPy's f32 product on the exactly dequantized weight (the sim's tile is not used: no TF32 either)."""
        return np.asarray(X, dtype=np.float32) @ self._weights(type_id, buf, rows, ne0).T

    def grouped_product(self, type_id, bufs, rows, ne0, Xg, tile, tf32):
        """Each weight dequantized afresh (staging and slots are rewritten: nothing cached), one product each."""
        pool_t, src_t = _engine_pool_src(type_id)
        out = np.empty((len(bufs), Xg.shape[1], rows), dtype=np.float32)
        for g, b in enumerate(bufs):
            w = EF.dequantize_engine_form(np.asarray(b), pool_t, src_t, (ne0, rows)).reshape(rows, ne0)
            out[g] = Xg[g] @ w.T
        return out

    def expert_mm(self, type_id, bufs, rows, ne0, X, index, rnd, out, src, xscale=None):
        """:func:`strata.engine.gpu.moe_mm.grouped_mm_reference` on each weight dequantized afresh (staging and slots
        are rewritten: nothing cached)."""
        from . import moe_mm

        _t0, _nt, s0, G = rnd
        pool_t, src_t = _engine_pool_src(type_id)
        idx = np.asarray(index)
        counts = idx[s0 + G : s0 + 2 * G]
        ws = [
            EF.dequantize_engine_form(np.asarray(b), pool_t, src_t, (ne0, rows)).reshape(rows, ne0) if c else None
            for b, c in zip(bufs, counts)
        ]  # an expert without pairs is not read (a round of every expert id: ChunkPath.device_grouped)
        moe_mm.grouped_mm_reference(ws, X, idx if src else None, idx[s0 : s0 + G], counts, out)
        return out

    def host_view(self, owner, storage, address, offset, nbytes):
        return storage[offset : offset + nbytes]

    def mem_info(self):
        used = self.context + self.allocated
        return MemInfo(max(self.total - used, 0), self.total, self.allocated, self.allocated)

    def synchronize(self):
        pass

    def to_host(self, a):
        return np.asarray(a)

    def device_name(self):
        if self.card_name:
            return f"{self.card_name} simulated (NumPy)"
        return f"simulated GPU ({self.total >> 20} MiB, NumPy)"


def make_backend(device: str, card: Card | None = None, **kw) -> Backend:
    """``"cuda"`` -> :class:`CudaBackend` (emulating ``card`` when given), ``"sim"`` -> :class:`SimBackend`
    (kw: total_bytes, context_bytes; ``card``: a simulated card of the card's total and planned context)."""
    if device == "cuda":
        return CudaBackend(card)
    if device == "sim":
        if card is not None:
            return SimBackend(card.total_bytes, card.cuda_context_bytes, card_name=card.name)
        return SimBackend(**kw)
    raise ValueError(f"unknown GPU backend {device!r} (cuda | sim)")
