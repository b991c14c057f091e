#!/usr/bin/env python
"""Record what llama.cpp allocates for strata's synthetic models: the budget's reference figures.

For every preset of :data:`PRESETS` (one per architecture strata has a contract for), this script
writes the synthetic GGUF with :func:`strata.testing.write_model`, loads it with llama.cpp through
llama-cpp-python's C API (context of :data:`N_CTX` tokens, f16 K and V, weights memory-mapped on the
CPU with no repacked copies, so that one ``CPU_Mapped`` buffer holds every tensor), decodes a few
tokens (the logits must be finite: llama.cpp runs the file), and records

- ``model_size_bytes``: ``llama_model_size`` (exact: the sum of ``ggml_nbytes`` of every tensor);
- ``model_buffers_mib``: the ``load_tensors: <buffer> model buffer size = X MiB`` lines (2 decimals);
- ``mapped_range_bytes``: the byte range of the file that buffer maps, from ggml's own gguf reader
  (``gguf_get_tensor_offset`` / ``gguf_get_tensor_size``: llama-model-loader.cpp get_mapping_range
  takes the first tensor's offset to the end of the last tensor);
- ``expert_blob_bytes``: per MoE layer, ggml's sizes of the layer's ``ffn_*_exps.weight`` tensors
  divided by ``n_expert`` (one expert's gate + up + down bytes);
- ``hparams``: llama.cpp's ``print_info`` numbers the KV cache is sized from (``n_embd_k_gqa``,
  ``n_embd_v_gqa`` per layer, ``n_swa``, ``n_expert``);
- ``kv``: for ``swa_full`` true (llama.cpp's default) and false, every ``llama_kv_cache: size = ...``
  line (cells, layers, K and V MiB, 2 decimals) with the layers that cache holds (its
  ``llama_kv_cache: layer N: dev = ...`` lines; a hybrid model's recurrent layers print ``filtered``)
  and the cells of the non-SWA / SWA caches;
- ``recurrent`` (recurrent and hybrid models only, e.g. qwen3next): llama.cpp's ``llama_memory_recurrent``
  (llama-memory-recurrent.cpp: per recurrent layer an ``r`` (conv) and an ``s`` (SSM / delta-net)
  tensor of ``n_embd_r`` / ``n_embd_s`` f32 per sequence): its layers (``layer N: dev = ...``), the
  ``size = ...`` line (cells, seqs, R / S / P types and MiB) and the ``RS buffer size`` lines, the
  ``ssm_*`` numbers of ``print_info``, and the exact bytes: ``r_row_bytes`` / ``s_row_bytes`` per layer,
  llama.cpp's own ``ggml_row_size(type, n_embd_r / n_embd_s)`` as its sequence state carries them
  (``llama_state_seq_get_data_ext`` of sequence 0 with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: the
  recurrent part only, llama_memory_recurrent::state_write_data);
- ``unused_tensors``: tensors of the file llama.cpp did not create (must be none: the contract names
  exactly what llama.cpp loads);

beside the spec (``ModelSpec.model_dump``) and the file's sha256, so tests/test_budget_llamacpp.py
rebuilds the byte-identical file and compares strata's figures with these, and (marker ``llama_cpp``:
``make test`` and CI install llama-cpp-python) also calls :func:`measure` live and requires the same.

    python tools/make_budget_reference.py            # every preset (needs pip install -e '.[reference]')
    python tools/make_budget_reference.py deepseek2 gpt_oss

Fixture: ``tests/fixtures/llamacpp_budget.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import re
import struct
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "llamacpp_budget.json"

#: Context (tokens), KV cache type and physical batch every measurement uses (llama.cpp's default ubatch).
N_CTX = 4096
KV_TYPE = "f16"
N_UBATCH = 512
GGML_TYPE_F16 = 1

#: fixture name -> (preset function name in strata.testing, spec overrides)
PRESETS: dict[str, tuple[str, dict]] = {
    "llama": ("llama_spec", {}),
    "llama_moe": ("llama_moe_spec", {}),
    "qwen3": ("qwen3_spec", {}),
    "qwen2moe": ("qwen2moe_spec", {}),
    "deepseek2": ("deepseek2_spec", {}),
    # V2-Lite style: no q_lora_rank key, attn_q directly (llama.cpp reads the key only for other layer
    # counts: load_arch_hparams is_lite = 27 or 26 layers), 4 experts to keep the 27 layers small
    "deepseek2_lite": (
        "deepseek2_spec",
        {
            "n_layers": 27,
            "dims": {"q_lora_rank": None, "n_expert": 4},
            "expert_types": [None] + [("Q4_K", "Q8_0")] * 26,
        },
    ),
    # a legacy (pre-MLA) file: attn_kv_b, no *_mla keys, one K and V head per query head
    "deepseek2_mha": (
        "deepseek2_spec",
        {"params": {"n_head_kv": 4, "head_dim": 96, "head_dim_v": 64, "expert_gating_func": 1}},
    ),
    "gpt_oss": ("gpt_oss_spec", {}),
    # the contracts strata had before, measured the same way
    "qwen2": ("qwen2_spec", {}),
    "gemma3": ("gemma3_spec", {}),
    "qwen3moe": ("qwen3moe_spec", {}),
    # hybrid: 3 gated-delta-net layers (llama.cpp's recurrent memory) + 1 full-attention layer (its KV cache),
    # MoE with a shared expert; and the same with the fused ffn_gate_up_exps expert tensor
    "qwen3next": ("qwen3next_spec", {}),
    "qwen3next_fused": ("qwen3next_spec", {"fused_gate_up": True}),
}

_KV_LINE = re.compile(
    r"llama_kv_cache: size = *([\d.]+) MiB \( *(\d+) cells, *(\d+) layers, *(\d+)/(\d+) seqs\), "
    r"K \((\w+)\): *([\d.]+) MiB, V \((\w+)\): *([\d.]+) MiB"
)
_CELLS_LINE = re.compile(r"creating +(non-SWA|SWA) KV cache, size = (\d+) cells")
_BUF_LINE = re.compile(r"load_tensors: +(\S+) model buffer size = *([\d.]+) MiB")
_UNUSED = re.compile(r"model has unused tensor (\S+)")
_KV_LAYER = re.compile(r"llama_kv_cache: layer +(\d+): dev = ")
_RS_LAYER = re.compile(r"llama_memory_recurrent, layer +(\d+): dev = ")
_RS_LINE = re.compile(
    r"llama_memory_recurrent: size = *([\d.]+) MiB \( *(\d+) cells, *(\d+) layers, *(\d+) seqs +(\d+) rs_seq\), "
    r"R \((\w+)\): *([\d.]+) MiB, S \((\w+)\): *([\d.]+) MiB, P \((\w+)\): *([\d.]+) MiB"
)
_RS_BUF = re.compile(r"llama_memory_recurrent: +(\S+) RS buffer size = *([\d.]+) MiB")
_INFO = re.compile(r"print_info: (n_embd_k_gqa|n_embd_v_gqa|n_swa|n_expert|n_layer|n_head_kv|n_embd_head_k) += (.+)")
#: llama-context.cpp io_magic: the first 4 bytes of a sequence's state (then its seq_id).
_STATE_MAGIC = 0xAF143CD8
_SSM_INFO = re.compile(r"print_info: (ssm_d_conv|ssm_d_inner|ssm_d_state|ssm_dt_rank|ssm_n_group) += (\d+)")


def _ints(text: str, n_layer: int | None = None) -> list[int] | int:
    """``print_info``'s print_f: one number when every layer agrees, else ``[a, b, ...]``."""
    text = text.strip()
    if text.startswith("["):
        return [int(x) for x in text.strip("[]").split(",")]
    return [int(text)] * n_layer if n_layer else int(text)


class _Ggml:
    """ggml's own gguf reader (libggml-base, shipped in llama-cpp-python): tensor offsets and sizes."""

    class _Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    def __init__(self, lib_dir: Path):
        lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
        lib.gguf_init_from_file.restype = ctypes.c_void_p
        lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, self._Params]
        for fn, res in (
            ("gguf_get_n_tensors", ctypes.c_int64),
            ("gguf_get_tensor_name", ctypes.c_char_p),
            ("gguf_get_tensor_offset", ctypes.c_size_t),
            ("gguf_get_tensor_size", ctypes.c_size_t),
            ("gguf_get_data_offset", ctypes.c_size_t),
        ):
            getattr(lib, fn).restype = res
        for fn in ("gguf_get_tensor_name", "gguf_get_tensor_offset", "gguf_get_tensor_size"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
        lib.gguf_get_data_offset.argtypes = [ctypes.c_void_p]
        lib.gguf_free.argtypes = [ctypes.c_void_p]
        self.lib = lib

    def tensors(self, path: Path) -> dict[str, tuple[int, int]]:
        """name -> (offset in the data section, ggml_nbytes)."""
        ctx = self.lib.gguf_init_from_file(str(path).encode(), self._Params(True, None))
        if not ctx:
            raise RuntimeError(f"ggml's gguf reader refused {path}")
        try:
            return {
                self.lib.gguf_get_tensor_name(ctx, i).decode(): (
                    int(self.lib.gguf_get_tensor_offset(ctx, i)),
                    int(self.lib.gguf_get_tensor_size(ctx, i)),
                )
                for i in range(self.lib.gguf_get_n_tensors(ctx))
            }
        finally:
            self.lib.gguf_free(ctx)


def _recurrent(C, ctx, text: str, model_text: str) -> dict:
    """llama.cpp's recurrent memory of the context ``ctx`` (one sequence, after a decode): the figures of
    the module docstring's ``recurrent``, from the context's log ``text``, the model's ``print_info``
    lines (``model_text``) and sequence 0's state.
    Raises RuntimeError when the state is not laid out as llama.cpp writes it: llama_context::
    state_seq_get_data's io_magic 0xaf143cd8 and seq_id, then llama_memory_recurrent::state_write's cell
    count, per cell pos + n_seq_id, s_trans, n_layer, per layer R type + row size + rows, then the same for S."""
    m = _RS_LINE.search(text)
    if not m:
        raise RuntimeError("no llama_memory_recurrent size line")
    layer_ids = [int(x) for x in _RS_LAYER.findall(text)]
    flags = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    n = C.llama_state_seq_get_size_ext(ctx, 0, flags)
    buf = (ctypes.c_uint8 * n)()
    if C.llama_state_seq_get_data_ext(ctx, buf, n, 0, flags) != n:
        raise RuntimeError("llama_state_seq_get_data_ext wrote another size than it announced")
    blob, off = bytes(buf), 0

    def take(fmt: str) -> tuple:
        nonlocal off
        vals = struct.unpack_from(fmt, blob, off)
        off += struct.calcsize(fmt)
        return vals

    magic, seq = take("<Ii")
    if (magic, seq) != (_STATE_MAGIC, 0):
        raise RuntimeError(f"sequence state starts {magic:#x} {seq}, not llama-context.cpp's io_magic and seq 0")
    (cells,) = take("<I")
    for _ in range(cells):
        _pos, n_seq_id = take("<iI")
        if n_seq_id:
            raise RuntimeError("a sequence's state lists sequence ids")
    s_trans, _n_layer = take("<II")
    rows: dict[str, dict[str, int]] = {"r": {}, "s": {}}
    for part in ("r", "s"):
        for il in layer_ids:
            _type, row = take("<iQ")
            rows[part][str(il)] = row
            off += cells * row
    if s_trans or off != n:
        raise RuntimeError(f"recurrent state of {n} B not parsed as llama_memory_recurrent writes it ({off} B)")
    return {
        "layer_ids": layer_ids,
        "cells": int(m.group(2)),
        "layers": int(m.group(3)),
        "seqs": int(m.group(4)),
        "rs_seq": int(m.group(5)),
        "r_type": m.group(6),
        "r_mib": float(m.group(7)),
        "s_type": m.group(8),
        "s_mib": float(m.group(9)),
        "p_mib": float(m.group(11)),
        "total_mib": float(m.group(1)),
        "buffers_mib": {b: float(x) for b, x in _RS_BUF.findall(text)},
        "hparams": {k: int(v) for k, v in _SSM_INFO.findall(model_text)},
        "state_cells": cells,
        "r_row_bytes": rows["r"],
        "s_row_bytes": rows["s"],
    }


def measure(path: str | os.PathLike, n_ctx: int = N_CTX, *, n_tokens: int = 8) -> dict:
    """Load ``path`` with llama.cpp (llama-cpp-python's C API) and return the figures of the module
    docstring. Raises RuntimeError when llama.cpp refuses the file or its logits are not finite."""
    import llama_cpp
    from llama_cpp import llama_cpp as C

    path = Path(path)
    lines: list[str] = []

    @C.llama_log_callback
    def _log(level, text, user):  # noqa: ARG001
        lines.append(text.decode("utf-8", errors="replace"))

    C.llama_backend_init()
    C.llama_log_set(_log, ctypes.c_void_p(0))
    try:
        mp = C.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = False  # no CPU_REPACK copies: every tensor stays in the one mapped buffer
        model = C.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise RuntimeError(f"llama.cpp refused {path}:\n{''.join(lines[-20:])}")
        out: dict = {"model_size_bytes": int(C.llama_model_size(model))}
        text = model_text = "".join(lines)
        out["model_buffers_mib"] = {m.group(1): float(m.group(2)) for m in _BUF_LINE.finditer(text)}
        out["unused_tensors"] = _UNUSED.findall(text)
        info = dict(_INFO.findall(text))
        n_layer = int(info["n_layer"])
        out["hparams"] = {
            "n_layer": n_layer,
            "n_swa": int(info["n_swa"]),
            "n_expert": int(info.get("n_expert", 0)),
            "n_embd_k_gqa": _ints(info["n_embd_k_gqa"], n_layer),
            "n_embd_v_gqa": _ints(info["n_embd_v_gqa"], n_layer),
        }
        out["kv"] = {}
        n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
        for swa_full in (True, False):
            start = len(lines)
            cp = C.llama_context_default_params()
            cp.n_ctx, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = n_ctx, N_UBATCH, 2, 2
            cp.type_k = cp.type_v = GGML_TYPE_F16
            cp.swa_full = swa_full
            ctx = C.llama_init_from_model(model, cp)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {path}:\n{''.join(lines[-20:])}")
            try:
                text = "".join(lines[start:])
                caches, seg = [], 0
                for m in _KV_LINE.finditer(text):  # a cache's layer lines come before its size line
                    caches.append(
                        dict(
                            total_mib=float(m.group(1)),
                            cells=int(m.group(2)),
                            layers=int(m.group(3)),
                            layer_ids=[int(x) for x in _KV_LAYER.findall(text, seg, m.start())],
                            k_type=m.group(6),
                            k_mib=float(m.group(7)),
                            v_type=m.group(8),
                            v_mib=float(m.group(9)),
                        )
                    )
                    seg = m.end()
                cells = {k: int(v) for k, v in _CELLS_LINE.findall(text)}
                toks = (ctypes.c_int32 * n_tokens)(*[(7 * i + 3) % n_vocab for i in range(n_tokens)])
                if C.llama_decode(ctx, C.llama_batch_get_one(toks, n_tokens)) != 0:
                    raise RuntimeError(f"llama_decode failed on {path}")
                logits = C.llama_get_logits_ith(ctx, -1)
                vals = [logits[i] for i in range(n_vocab)]
                if not all(math.isfinite(v) for v in vals) or max(vals) == min(vals):
                    raise RuntimeError(f"llama.cpp's logits on {path} are not finite and varied")
                if swa_full and (C.llama_model_is_recurrent(model) or C.llama_model_is_hybrid(model)):
                    out["recurrent"] = _recurrent(C, ctx, text, model_text)
                out["kv"]["swa_full" if swa_full else "swa_window"] = {"caches": caches, "cells": cells}
            finally:
                C.llama_free(ctx)
        C.llama_model_free(model)
    finally:
        C.llama_log_set(ctypes.cast(None, C.llama_log_callback), ctypes.c_void_p(0))
    out["eval"] = {"tokens": n_tokens, "logits_finite": True}
    tensors = _Ggml(Path(llama_cpp.__file__).parent / "lib").tensors(path)
    out["mapped_range_bytes"] = max(o + n for o, n in tensors.values()) - min(o for o, _ in tensors.values())
    blobs: dict[str, int] = {}
    n_expert = out["hparams"]["n_expert"]
    for name, (_o, n) in tensors.items():
        m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight", name)
        if m and n_expert:
            blobs[m.group(1)] = blobs.get(m.group(1), 0) + n // n_expert
    out["expert_blob_bytes"] = dict(sorted(blobs.items(), key=lambda kv: int(kv[0])))
    return out


def build_spec(name: str):
    """The :class:`~strata.testing.ModelSpec` recorded under ``name``."""
    from strata import testing as synth

    fn, over = PRESETS[name]
    return getattr(synth, fn)(**over)


def make_entry(name: str) -> dict:
    from strata import testing as synth

    spec = build_spec(name)
    with tempfile.TemporaryDirectory() as d:
        [path] = synth.write_model(Path(d) / f"{name}.gguf", spec)
        entry = {
            "preset": PRESETS[name][0],
            "spec": spec.model_dump(mode="json"),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "file_bytes": path.stat().st_size,
        }
        entry.update(measure(path))
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"presets to (re)measure (default: all of {', '.join(PRESETS)})")
    ap.add_argument("--out", type=Path, default=FIXTURE)
    a = ap.parse_args(argv)
    import llama_cpp

    data = json.loads(a.out.read_text()) if a.out.exists() else {}
    data.update(
        {
            "llama_cpp": f"llama-cpp-python {llama_cpp.__version__}",
            "n_ctx": N_CTX,
            "kv_type": KV_TYPE,
            "n_ubatch": N_UBATCH,
            "n_seq": 1,
        }
    )
    models = data.setdefault("models", {})
    for name in a.names or list(PRESETS):
        models[name] = make_entry(name)
        m = models[name]
        kv = "; ".join(
            f"{c['cells']} cells x {c['layers']} layers: {c['total_mib']} MiB" for c in m["kv"]["swa_full"]["caches"]
        )
        print(
            f"{name}: model {m['model_size_bytes']} B ({m['model_buffers_mib']}), KV {kv}, experts "
            f"{m['expert_blob_bytes']}"
            f"{', UNUSED ' + str(m['unused_tensors']) if m['unused_tensors'] else ''}",
            file=sys.stderr,
        )
    data["models"] = dict(sorted(models.items()))
    tmp = a.out.with_name(a.out.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
