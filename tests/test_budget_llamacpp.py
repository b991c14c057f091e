"""strata's budget figures against llama.cpp's own, on the synthetic file of every architecture.

tests/fixtures/llamacpp_budget.json holds what llama.cpp (llama-cpp-python 0.3.36) allocated and
reported for each preset at a context of 4096 tokens with f16 K and V (recorded by
tools/make_budget_reference.py, which also proves llama.cpp runs each file: finite logits). Here
each file is rebuilt byte-identical from its recorded spec (sha256 checked), packed and audited, and

- weight bytes: strata's (every dense tensor in its source type + n_expert x the expert blob of every
  MoE layer) equal ``llama_model_size`` exactly, and the mapped range of the file (the first tensor's
  offset to the last tensor's end, from strata's own GGUF reader) equals ggml's and the printed
  ``CPU_Mapped model buffer size`` within its 2-decimal MiB rounding;
- expert blob per MoE layer: strata's (types x geometry) equals ggml's tensor sizes / n_expert;
- KV cache: strata's KV layers are the layers llama.cpp gives a KV cache (a hybrid model's recurrent
  layers have none), their K and V rows (the manifest's [state], checked twice by the audit) equal
  llama.cpp's printed ``n_embd_k_gqa`` / ``n_embd_v_gqa`` (V absent under MLA), and times llama.cpp's
  cells (:func:`strata.budget.formulas.llamacpp_kv_cells`, equal to the printed cell counts) they equal
  every printed ``llama_kv_cache: size`` line's K and V MiB within rounding, for ``swa_full`` true
  (llama.cpp's default) and false (the sliding-window layers' own cache);
- recurrent state (qwen3next's gated delta net): strata's recurrent layers are the layers of llama.cpp's
  ``llama_memory_recurrent``, each one's conv and SSM bytes per sequence (``4 x conv_state`` and
  ``4 x ssm_state``) equal llama.cpp's R and S row bytes exactly, so
  :func:`strata.budget.formulas.recurrent_state_bytes` equals llama.cpp's state to the byte, and its
  printed R, S, total and RS buffer MiB within rounding.

Every architecture with a contract (``manifests/*.toml``) is in the recording. The same comparison also
runs on a live measurement, which must also equal the recording (marker ``llama_cpp``: ``make test`` and
CI install llama-cpp-python; skipped without it on a developer machine, failed in CI).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from strata import testing as synth
from strata.budget import formulas as F
from strata.budget.audit import audit_pack
from strata.layout import kv as LK
from strata.manifests.contract import known_archs
from strata.packer import quants
from strata.packer.build import build_pack
from strata.packer.findings import trim_ne
from strata.packer.gguf_file import read_header
from strata.packer.pack import open_pack

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "llamacpp_budget.json"
REF = json.loads(FIXTURE.read_text())
MIB = 1 << 20
#: llama.cpp prints MiB with 2 decimals: a figure is within half a unit of the last place (0.375 MiB
#: prints 0.38: exactly half), plus one byte for the float arithmetic.
MIB_ROUNDING = 0.005 * MIB + 1
#: The issue's architectures: each must be in the recording (and every contract's, see the test below).
REQUIRED = {"llama", "llama_moe", "qwen3", "qwen2moe", "deepseek2", "gpt_oss", "qwen3next"}


def _tool():
    spec = importlib.util.spec_from_file_location("make_budget_reference", ROOT / "tools" / "make_budget_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (GGUF, pack) for every recorded model, the GGUF byte-identical to the measured one."""
    d = tmp_path_factory.mktemp("llamacpp")
    out = {}
    for name, m in REF["models"].items():
        [src] = synth.write_model(d / f"{name}.gguf", synth.ModelSpec.model_validate(m["spec"]))
        assert hashlib.sha256(src.read_bytes()).hexdigest() == m["sha256"], (
            f"{name}: the preset no longer writes the measured file (re-run tools/make_budget_reference.py)"
        )
        build_pack(src, d / name, progress=False)
        out[name] = (src, d / name)
    return out


def strata_figures(src: Path, pack: Path, n_ctx: int) -> dict:
    """What strata says about one file: weight bytes, mapped range, expert blobs, KV rows and caches."""
    res = audit_pack(pack)
    assert res.errors == [], [e.message for e in res.errors[:3]]
    p = open_pack(pack)
    facts = res.facts
    dense = sum(quants.tensor_nbytes(e.src_type, trim_ne(e.ne)) for e in p.index.entries)
    tensors = read_header(src).tensors
    full = [L for L in facts.kv_layers if L.window is None]
    swa = [L for L in facts.kv_layers if L.window is not None]
    kv = {}
    for key, swa_full in (("swa_full", True), ("swa_window", False)):
        caches = []
        for group in [full, swa] if swa else [full]:  # llama_kv_cache_iswa: the non-SWA cache first
            cells = {F.llamacpp_kv_cells(n_ctx, L.window, swa_full=swa_full) for L in group}
            assert len(cells) == 1
            [n] = cells
            caches.append(
                {
                    "layers": len(group),
                    "cells": n,
                    "layer_ids": [L.layer for L in group],
                    "k_bytes": sum(LK.kv_row_bytes(L.k, REF["kv_type"]) for L in group) * n,
                    "v_bytes": sum(LK.kv_row_bytes(L.v, REF["kv_type"]) for L in group) * n,
                    "total": F.llamacpp_kv_cache_bytes(group, n_ctx, REF["kv_type"], swa_full=swa_full),
                }
            )
        kv[key] = caches
    return {
        "weights": dense + (p.experts.total if p.experts else 0),
        "mapped": max(t.abs_offset + t.nbytes for t in tensors) - min(t.abs_offset for t in tensors),
        "blobs": {str(L.layer): L.blob_bytes for L in facts.expert_layers},
        "k_rows": {L.layer: L.k for L in facts.kv_layers},
        "v_rows": {L.layer: L.v for L in facts.kv_layers},
        "kv": kv,
        "recurrent": facts.recurrent_layers,
    }


def compare(name: str, s: dict, ref: dict) -> None:
    """Every strata figure against llama.cpp's (``ref``: one model of the recording, or a live measurement)."""
    assert ref["unused_tensors"] == [], f"{name}: llama.cpp did not load {ref['unused_tensors']}"
    assert s["weights"] == ref["model_size_bytes"], name
    assert s["mapped"] == ref["mapped_range_bytes"], name
    [mapped_mib] = ref["model_buffers_mib"].values()  # one CPU_Mapped buffer (no repacked copies)
    assert abs(s["mapped"] - mapped_mib * MIB) <= MIB_ROUNDING, name
    assert s["blobs"] == ref["expert_blob_bytes"], name
    hp = ref["hparams"]
    no_v = all(c["v_mib"] == 0 for c in ref["kv"]["swa_full"]["caches"])  # MLA: no V tensor at all
    # the layers llama.cpp gives a KV cache: every layer, except a hybrid model's recurrent ones
    kv_ids = sorted(il for c in ref["kv"]["swa_full"]["caches"] for il in c["layer_ids"])
    assert sorted(s["k_rows"]) == kv_ids, name
    for il in kv_ids:
        assert s["k_rows"][il] == hp["n_embd_k_gqa"][il], (name, il)
        assert s["v_rows"][il] == (0 if no_v else hp["n_embd_v_gqa"][il]), (name, il)
    for key in ("swa_full", "swa_window"):
        mine, theirs = s["kv"][key], ref["kv"][key]["caches"]
        assert len(mine) == len(theirs), (name, key)
        for a, b in zip(mine, theirs):
            assert (a["layers"], a["cells"], a["layer_ids"]) == (b["layers"], b["cells"], b["layer_ids"]), (name, key)
            assert b["k_type"] == b["v_type"] == REF["kv_type"]
            for mine_b, their_mib in (
                (a["k_bytes"], b["k_mib"]),
                (a["v_bytes"], b["v_mib"]),
                (a["total"], b["total_mib"]),
            ):
                assert abs(mine_b - their_mib * MIB) <= MIB_ROUNDING, (name, key, mine_b, their_mib)
            assert a["total"] == a["k_bytes"] + a["v_bytes"]
        printed = ref["kv"][key]["cells"]  # "creating non-SWA / SWA KV cache, size = N cells" (iswa only)
        if printed:
            assert [c["cells"] for c in mine] == [printed["non-SWA"], printed["SWA"]], (name, key)
    # the exact formula with llama.cpp's own integers: per cache, its cells x (n_embd_k_gqa + n_embd_v_gqa,
    # no V under MLA) of its layers x 2 B (f16) - strata's bytes equal it to the byte
    for key in ("swa_full", "swa_window"):
        for c in s["kv"][key]:
            rows = sum(hp["n_embd_k_gqa"][il] + (0 if no_v else hp["n_embd_v_gqa"][il]) for il in c["layer_ids"])
            assert c["total"] == c["cells"] * rows * 2, (name, key)
    compare_recurrent(name, s["recurrent"], ref.get("recurrent"))


def compare_recurrent(name: str, layers: list[LK.RecurrentLayer], rec: dict | None) -> None:
    """strata's recurrent-state term against llama.cpp's ``llama_memory_recurrent`` (``rec``; None: llama.cpp
    made none, so strata has no recurrent layer either): layers, bytes per layer exactly, MiB in rounding."""
    if rec is None:
        assert layers == [], name
        return
    n_seq = REF["n_seq"]
    assert [L.layer for L in layers] == rec["layer_ids"], name
    assert (rec["seqs"], rec["cells"], rec["state_cells"], rec["rs_seq"]) == (n_seq, n_seq, 1, 0), name
    assert rec["r_type"] == rec["s_type"] == "f32" and rec["p_mib"] == 0, name
    # per layer and sequence, to the byte: conv tail = llama.cpp's R row, SSM / delta-net state = its S row
    assert {str(L.layer): F.F32_BYTES * L.conv for L in layers} == rec["r_row_bytes"], name
    assert {str(L.layer): F.F32_BYTES * L.ssm for L in layers} == rec["s_row_bytes"], name
    r_bytes = n_seq * sum(rec["r_row_bytes"].values())
    s_bytes = n_seq * sum(rec["s_row_bytes"].values())
    assert LK.recurrent_state_bytes(layers, n_seq) == r_bytes + s_bytes, name  # the budget's term, exact
    # llama.cpp's own integers (print_info's ssm_*) in llama-hparams.cpp n_embd_r / n_embd_s
    hp = rec["hparams"]
    n_embd_r = (hp["ssm_d_conv"] - 1) * (hp["ssm_d_inner"] + 2 * hp["ssm_n_group"] * hp["ssm_d_state"])
    assert set(rec["r_row_bytes"].values()) == {F.F32_BYTES * n_embd_r}, name
    assert set(rec["s_row_bytes"].values()) == {F.F32_BYTES * hp["ssm_d_state"] * hp["ssm_d_inner"]}, name
    [buffer_mib] = rec["buffers_mib"].values()  # one CPU RS buffer
    for mine_b, their_mib in (
        (r_bytes, rec["r_mib"]),
        (s_bytes, rec["s_mib"]),
        (r_bytes + s_bytes, rec["total_mib"]),
        (r_bytes + s_bytes, buffer_mib),
    ):
        assert abs(mine_b - their_mib * MIB) <= MIB_ROUNDING, (name, mine_b, their_mib)


def test_the_recording_covers_every_architecture():
    assert REQUIRED <= set(REF["models"])
    assert sorted({m["spec"]["arch"] for m in REF["models"].values()}) == known_archs()  # every contract
    assert "recurrent" in REF["models"]["qwen3next"]  # the hybrid's recurrent state was measured
    assert (REF["n_ctx"], REF["kv_type"], REF["n_ubatch"], REF["n_seq"]) == (4096, "f16", F.LLAMACPP_N_UBATCH, 1)
    for name, m in REF["models"].items():
        assert m["eval"]["logits_finite"], name  # llama.cpp ran the file


@pytest.mark.parametrize("name", sorted(REF["models"]))
def test_strata_equals_llama_cpp_recorded(name, built):
    src, pack = built[name]
    compare(name, strata_figures(src, pack, REF["n_ctx"]), REF["models"][name])


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", sorted(REF["models"]))
def test_strata_equals_llama_cpp_live(name, built, llama_cpp):
    src, pack = built[name]
    live = _tool().measure(src, REF["n_ctx"])
    compare(name, strata_figures(src, pack, REF["n_ctx"]), live)
    rec = REF["models"][name]
    for key in ("model_size_bytes", "mapped_range_bytes", "expert_blob_bytes", "hparams", "kv", "model_buffers_mib"):
        assert live[key] == rec[key], (name, key)
    assert live.get("recurrent") == rec.get("recurrent"), name


def test_llamacpp_kv_cells_rules():
    # llama-context.cpp: n_ctx padded to 256;
    # llama-kv-cache-iswa.cpp: SWA cache GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256)
    assert F.llamacpp_kv_cells(4096, None) == 4096 and F.llamacpp_kv_cells(4000, None) == 4096
    assert F.llamacpp_kv_cells(4096, 128) == 4096  # swa_full: llama.cpp's default
    assert F.llamacpp_kv_cells(4096, 128, swa_full=False) == 768  # 128 + 512 -> 768
    assert F.llamacpp_kv_cells(512, 128, swa_full=False) == 512  # never more than the context
    assert F.llamacpp_kv_cells(8192, 4096, swa_full=False, n_ubatch=512) == 4608
    # 2 sequences, not unified: n_ctx_seq = pad(4096 / 2) per stream
    assert F.llamacpp_kv_cells(4096, None, n_seq=2) == 2048
    L = LK.KVLayer(0, 160, 0)  # MLA: one K row of latent + rope, no V
    assert F.llamacpp_kv_cache_bytes([L], 4096, "f16") == 4096 * 160 * 2
