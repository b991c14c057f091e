"""The decode speed a plan buys (strata.budget.speed): the model's arithmetic, its refusals, the figures its docstring
quotes against the H200 measurements, and the two commands that print it (``strata-budget check --step-ms
--pcie-gbs``, ``strata-engine measure -n N --step-ms --pcie-gbs`` on the sim card)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from strata import testing as synth
from strata.budget.cli import main as budget_main
from strata.budget.errors import PlanInputError
from strata.budget.speed import predict_decode
from strata.layout import experts as LX
from strata.packer import quants
from strata.packer.build import build_pack


def _type(name: str) -> int:
    return next(q.id for q in quants.QTYPES.values() if q.name == name)


def test_the_model_is_step_plus_the_misses_bytes_over_pcie():
    d = predict_decode(
        step_ms=4.0, pcie_gbs=50.0, hit_rate=0.75, hit_basis="x", n_expert_used=8, blob_bytes=[1_000_000, 3_000_000]
    )
    # misses a token: 0.25 x 8 x 2 layers = 4; bytes: 0.25 x 8 x 4,000,000 = 8,000,000 B -> 0.16 ms at 50 GB/s
    assert d.misses_per_token == 4.0 and d.miss_bytes_per_token == 8_000_000.0
    assert d.miss_ms == pytest.approx(0.16, abs=1e-12) and d.ms_per_token == pytest.approx(4.16, abs=1e-12)
    assert d.tok_s == pytest.approx(1000 / 4.16, rel=1e-12)
    full = predict_decode(step_ms=5.0, pcie_gbs=None, hit_rate=1.0, hit_basis="x", n_expert_used=8, blob_bytes=[9])
    assert (full.tok_s, full.miss_ms, full.misses_per_token) == (200.0, 0.0, 0.0)
    dense = predict_decode(step_ms=8.0, pcie_gbs=None, hit_rate=0.0, hit_basis="x", n_expert_used=0, blob_bytes=[])
    assert dense.tok_s == 125.0
    assert "decode (predicted): 240.4 tok/s = step 4.00 ms + 4.0 misses a token = 7.6 MiB over PCIe at 50 GB/s" in (
        d.text()
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(step_ms=0.0), "--step-ms 0: outside 0.001 to 1e+06 ms"),
        (dict(step_ms=float("nan")), "--step-ms nan: outside"),
        (dict(step_ms=float("inf")), "--step-ms inf: outside"),
        (dict(pcie_gbs=-1.0), "--pcie-gbs -1: outside 0.001 to 10000 GB/s"),
        (dict(hit_rate=1.5), "hit rate 1.5: outside [0, 1]"),
        (dict(pcie_gbs=None), "16.0 expert misses a token at a 50.0% hit rate cross PCIe: give --pcie-gbs"),
    ],
)
def test_refusals_name_the_option_and_the_number(kw, match):
    args = dict(step_ms=4.0, pcie_gbs=50.0, hit_rate=0.5, hit_basis="x", n_expert_used=8, blob_bytes=[10] * 4) | kw
    with pytest.raises(PlanInputError, match=re.escape(match)) as e:
        predict_decode(**args)
    assert e.value.tensor in ("--step-ms", "--pcie-gbs", "hit rate")  # --json's errors entry names the option


def test_the_documented_h200_figures():
    """The module docstring's check: the 30B-A3B geometry's every-resident step (230.83 tok/s) and PCIe 5.0's nominal
    50 GB/s give 213.5 / 88.4 / 35.9 tok/s at 98.5% / 70.3% / 0% hits (measured 202.55 / 86.41 / 33.14,
    bench/results/h200-2026-12-02f-equal_vram.log); the 80B-A3B pair at 24G: 106.8 against 107.72 measured."""
    q4, q6, iq2 = _type("Q4_K"), _type("Q6_K"), _type("IQ2_XS")
    parts, _ = LX.expert_slot_layout(q4, q4, q6, 2048, 768)
    blob30 = sum(p[1] for p in parts)
    assert blob30 == 3_059_712
    got = [
        round(
            predict_decode(
                step_ms=1000 / 230.83, pcie_gbs=50, hit_rate=h, hit_basis="m", n_expert_used=8, blob_bytes=[blob30] * 48
            ).tok_s,
            1,
        )
        for h in (0.985, 0.703, 0.0)
    ]
    assert got == [213.5, 88.4, 35.9]
    parts, _ = LX.expert_slot_layout(iq2, iq2, iq2, 2048, 512)
    blob80 = sum(p[1] for p in parts)
    assert blob80 == 909_312

    def at(h, step):
        return predict_decode(
            step_ms=step, pcie_gbs=50, hit_rate=h, hit_basis="m", n_expert_used=10, blob_bytes=[blob80] * 48
        )

    step = 1000 / 113.23 - at(0.9967, 1.0).miss_ms
    assert round(at(0.9356, step).tok_s, 1) == 106.8


@pytest.fixture(scope="module")
def moe_pack(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("speed")
    [src] = synth.write_model(d / "m.gguf", synth.qwen3moe_spec())
    build_pack(src, d / "pack", progress=False)
    return d / "pack"


def _blobs(pack) -> tuple[int, list[int]]:
    """(n_expert_used, each MoE layer's engine-form blob) from the audit: what the prediction charges a miss."""
    from strata.budget.audit import audit_pack

    facts = audit_pack(str(pack), bf16_scan=False).facts
    return facts.n_expert_used, [L.blob_engine_bytes for L in facts.trunk_experts]


def _check(*args):
    r = CliRunner().invoke(budget_main, ["check", *map(str, args)])
    return r.exit_code, r.output


def test_budget_check_predicts_from_the_resident_fraction(moe_pack):
    code, out = _check(moe_pack, "--card", "24G", "--ctx", 64, "--step-ms", 4, "--json")
    d = json.loads(out)
    assert code == 0 and d["slots"] == 24
    p = d["decode_prediction"]
    assert p["tok_s"] == 250.0 and p["hit_rate"] == 1.0 and p["hit_basis"] == "24 of 24 pairs resident, no profile"
    # 3 of 24 pairs resident (the fill): 1/8 hits; the misses a token and their bytes from the plan's layers and K
    args = ("--card", "24G", "--ctx", 64, "--expert-cache", 3, "--step-ms", 4, "--pcie-gbs", 25)
    code, out = _check(moe_pack, *args, "--cache-policy", "fill")
    assert code == 0
    k, blobs = _blobs(moe_pack)
    assert (k, len(blobs)) == (2, 3)  # the synthetic qwen3moe: 3 MoE layers of 8 experts, 2 a token
    want = predict_decode(step_ms=4, pcie_gbs=25, hit_rate=3 / 24, hit_basis="", n_expert_used=k, blob_bytes=blobs)
    assert want.misses_per_token == 5.25
    line = " ".join(out.split())
    assert f"decode (predicted): {want.tok_s:.1f} tok/s = step 4.00 ms + {want.misses_per_token:.1f} misses" in line
    assert "hit rate 12.5% (3 of 24 pairs resident, no profile)" in line
    # the default (auto, no profile: the cache learns) keeps a slot as its swap scratch: 2 experts held, a lower bound
    code, out = _check(moe_pack, *args)
    line = " ".join(out.split())
    assert code == 0 and "hit rate 8.3% (2 of 24 pairs resident, no profile (a lower bound: the cache learns" in line
    # with fewer than 2 slots the engine keeps the fill (no swap scratch: budget.cache_policy.class_refusal), so
    # nothing learns and the figure is no lower bound
    for n, held in ((0, 0), (1, 1)):
        code, out = _check(moe_pack, "--card", "24G", "--ctx", 64, "--expert-cache", n, *args[6:])
        line = " ".join(out.split())
        assert code == 0 and f"({held} of 24 pairs resident, no profile)" in line and "lower bound" not in line


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--pcie-gbs", 50], "--pcie-gbs 50 without --step-ms"),
        (["--expert-cache", 3, "--step-ms", 4], "misses a token at a 8.3% hit rate cross PCIe: give --pcie-gbs"),
        (
            ["--expert-cache", 3, "--step-ms", 4, "--pcie-gbs", 9, "--miss-tier", "cpu"],
            "--miss-tier cpu: 5.2 expert misses a token run on the CPU: give --cpu-expert-us",
        ),
        (["--cpu-expert-us", 50], "--cpu-expert-us 50 without --step-ms"),
        (["--step-ms", 4, "--cpu-expert-us", 0], "--cpu-expert-us 0: outside 0.01 to 1e+06 us"),
        (["--step-ms", 4, "--cpu-expert-us", "nan"], "--cpu-expert-us nan: outside"),
        (["--step-ms", -2], "--step-ms -2: outside 0.001 to 1e+06 ms"),
        (["--step-ms", "inf"], "--step-ms inf: outside 0.001 to 1e+06 ms"),
        (["--step-ms", "nan"], "--step-ms nan: outside"),
        (["--step-ms", 1e308], "--step-ms 1e+308: outside"),
        (["--step-ms", 5, "--pcie-gbs", "1e-300"], "--pcie-gbs 1e-300: outside 0.001 to 10000 GB/s"),
        (["--step-ms", 5, "--pcie-gbs", "inf"], "--pcie-gbs inf: outside"),
        (["--expert-cache", 3, "--step-ms", 4, "--pcie-gbs", 9, "--engine", "cpp"], "--engine cpp: the prediction"),
        # checked whatever the plan: a plan that does not fit still refuses a bad value (exit 2, not 1)
        (["--expert-cache", 1000, "--step-ms", -1], "--step-ms -1: outside"),
    ],
)
def test_budget_check_refuses_what_it_cannot_predict(moe_pack, args, msg):
    code, out = _check(moe_pack, "--card", "24G", "--ctx", 64, *args)
    assert code == 2 and msg in out, out


def test_the_split_is_charged_as_the_engine_serves_it():
    """With the CPU's rate, misses are charged as the engine serves them (strata.budget.speed.split_misses, the rule
    of the engine's start-up): the 30B-A3B geometry with no expert resident (384 misses a token over 48 layers,
    3,059,712 B an expert), 50 GB/s and 60 us an expert on the CPU: t_pcie = 61.19 us, share round(60 / 121.19, 2) =
    0.5, 4 of a layer's 8 over PCIe: split = 48 x 50 + 48 x max(4 x 61.19, 4 x 60) us = 14.15 ms against 23.50 ms
    in one graph: taken;
    ``--miss-tier pcie`` keeps the one graph, ``cpu`` charges 48 x 50 + 384 x 60 us; 1% misses (3.8 a token, fewer
    than the 48 layers) stay in one graph whatever the rates."""
    from strata.budget.speed import HYBRID_LAYER_US, split_misses

    blob, kw = 3_059_712, dict(step_ms=4.0, pcie_gbs=50.0, hit_basis="x", n_expert_used=8)
    d = predict_decode(**kw, hit_rate=0.0, blob_bytes=[blob] * 48, cpu_expert_us=60.0)
    t_pcie = blob / 50e3
    assert d.share == 0.5 and HYBRID_LAYER_US == 50.0
    assert d.miss_ms == pytest.approx((48 * 50 + 48 * max(4 * t_pcie, 4 * 60)) / 1000, rel=1e-12)
    assert round(d.miss_ms, 2) == 14.15 and round(d.tok_s, 1) == 55.1
    assert (d.keep, d.per_layer, d.note) == (4, 8, "")
    assert (
        "384.0 misses a token = 1120.5 MiB, split 4 of 8 a layer over PCIe at 50 GB/s, 4 on the CPU at 60 us an expert "
        "(14.15 ms with 50 us a layer for the hybrid step)"
    ) in d.text()
    one = predict_decode(**kw, hit_rate=0.0, blob_bytes=[blob] * 48, cpu_expert_us=60.0, miss_tier="--miss-tier pcie")
    assert one.share == 1 and one.miss_ms == pytest.approx(384 * blob / 50e6, rel=1e-12)
    assert one.note == "--cpu-expert-us unused: --miss-tier pcie keeps every miss over PCIe" and one.note in one.text()
    cpu = predict_decode(**kw, hit_rate=0.0, blob_bytes=[blob] * 48, cpu_expert_us=60.0, miss_tier="cpu")
    assert cpu.share == 0 and cpu.miss_ms == pytest.approx(25.44, rel=1e-12) and " on the CPU at 60 us" in cpu.text()
    few = predict_decode(**kw, hit_rate=0.99, blob_bytes=[blob] * 48, cpu_expert_us=60.0)
    assert few.share == 1 and not split_misses(t_pcie, 60.0, few.misses_per_token, 48, 8).taken
    assert few.note.startswith("--cpu-expert-us unused: the split does not pay here")
    # two experts a token at 1 GB/s (3,059 us over PCIe) and 60 us on the CPU: the split keeps 0 of 2 on PCIe - the
    # charged share is 0, not the model's continuous 0.02
    two = predict_decode(**kw | {"pcie_gbs": 1.0, "n_expert_used": 2}, hit_rate=0.0, blob_bytes=[blob] * 48,
                         cpu_expert_us=60.0)  # fmt: skip
    assert (two.keep, two.per_layer, two.share) == (0, 2, 0.0) and "split 0 of 2 a layer over PCIe" in two.text()
    dense = predict_decode(**kw | {"n_expert_used": 0}, hit_rate=1.0, blob_bytes=[], cpu_expert_us=60.0)
    assert dense.note == "--cpu-expert-us unused: no routed experts" and dense.tok_s == 250.0
    slow = predict_decode(**kw | {"step_ms": 1e6}, hit_rate=1.0, blob_bytes=[blob])
    assert "decode (predicted): 0.001 tok/s" in slow.text()  # not "0.0 tok/s"


def test_budget_check_charges_the_split_with_the_cpu_rate(moe_pack):
    """strata-budget check --cpu-expert-us: no expert resident on the synthetic qwen3moe (2 a token x 3 layers = 6
    misses, one a layer or more) at 1 GB/s and 100 us on the CPU: 1 of 2 a layer over PCIe, the line says both; the same
    plan with --miss-tier pcie keeps every miss over PCIe, and so does a cache that learns (3 slots, the default
    policy)."""
    k, blobs = _blobs(moe_pack)
    args = ["--card", "24G", "--ctx", 64, "--expert-cache", 0, "--step-ms", 4, "--pcie-gbs", 1]
    args += ["--cpu-expert-us", 100]
    code, out = _check(moe_pack, *args, "--json")
    assert code == 0, out
    p = json.loads(out)["decode_prediction"]
    want = predict_decode(
        step_ms=4, pcie_gbs=1, hit_rate=0.0, hit_basis="", n_expert_used=k, blob_bytes=blobs, cpu_expert_us=100
    )
    assert (want.keep, want.per_layer) == (1, 2) and p["tok_s"] == want.tok_s and p["share"] == 0.5 == want.share
    code, out = _check(moe_pack, *args)
    assert code == 0 and "split 1 of 2 a layer over PCIe at 1 GB/s, 1 on the CPU at 100 us" in " ".join(out.split())
    code, out = _check(moe_pack, *args, "--miss-tier", "pcie", "--json")
    assert code == 0 and json.loads(out)["decode_prediction"]["share"] == 1.0
    # 3 slots: the default policy learns there (the engine never splits a learning cache); the fill kept: split
    shares = []
    for policy in ("auto", "fill"):
        code, out = _check(moe_pack, *args[:5], 3, *args[6:], "--cache-policy", policy, "--json")
        assert code == 0, out
        shares.append(json.loads(out)["decode_prediction"]["share"])
    assert shares[0] == 1.0 and 0 < shares[1] < 1


def test_no_prediction_for_a_plan_that_does_not_fit(moe_pack):
    code, out = _check(moe_pack, "--card-mib", 700, "--ctx", 64, "--step-ms", 4, "--pcie-gbs", 50, "--json")
    d = json.loads(out)
    assert code == 1 and d["decode_prediction"] is None


def test_measure_sets_the_measured_rate_beside_the_prediction(moe_pack):
    from strata.engine.cli import main as engine_main

    base = ["measure", str(moe_pack), "--device", "sim", "--card-mib", 2048, "--expert-cache", 6, "-n", 3]
    r = CliRunner().invoke(engine_main, [*map(str, base), "--step-ms", "4", "--pcie-gbs", "50", "--json"])
    assert r.exit_code == 0, r.output
    g = json.loads(r.output)["generation"]
    rate = g["hit_rate_measured"]
    k, blobs = _blobs(moe_pack)
    want = predict_decode(step_ms=4, pcie_gbs=50, hit_rate=rate, hit_basis="", n_expert_used=k, blob_bytes=blobs)
    assert g["decode_tok_s_predicted_at_measured_hits"] == want.tok_s
    # 6 slots, the default policy learning: 5 experts held beside the swap scratch
    pred = predict_decode(step_ms=4, pcie_gbs=50, hit_rate=5 / 24, hit_basis="", n_expert_used=k, blob_bytes=blobs)
    assert g["decode_tok_s_predicted"] == pred.tok_s
    r = CliRunner().invoke(engine_main, [*map(str, base), "--step-ms", "4", "--pcie-gbs", "50"])
    assert "decode speed: measured" in r.output and f"predicted {pred.tok_s:.2f} tok/s at the predicted hit rate" in (
        r.output
    )
    r = CliRunner().invoke(engine_main, ["measure", str(moe_pack), "--device", "sim", "--step-ms", "4"])
    assert r.exit_code == 2 and "--step-ms needs -n N" in r.output
    # every miss on the CPU: charged at the CPU's rate given (the start-up's own figure where none is given)
    args = [*map(str, base), "--step-ms", "4", "--miss-tier", "cpu", "--cache-policy", "fill", "--json"]
    r = CliRunner().invoke(engine_main, [*args, "--cpu-expert-us", "100"])
    assert r.exit_code == 0, r.output
    g = json.loads(r.output)["generation"]
    want = predict_decode(
        step_ms=4, pcie_gbs=None, hit_rate=g["hit_rate_measured"], hit_basis="", n_expert_used=k, blob_bytes=blobs,
        cpu_expert_us=100, miss_tier="cpu",
    )  # fmt: skip
    assert g["decode_tok_s_predicted_at_measured_hits"] == want.tok_s and "cpu_expert_us_basis" not in g
    g = json.loads(CliRunner().invoke(engine_main, args).output)["generation"]
    assert re.fullmatch(r"measured at start-up: \d+ us an expert \(cpu experts\)", g["cpu_expert_us_basis"])
    assert g["decode_tok_s_predicted"] > 0
    r = CliRunner().invoke(engine_main, [*map(str, base), "--step-ms", "inf"])
    assert r.exit_code == 2 and "--step-ms inf: outside" in r.output


def test_class_policy_with_every_pair_resident_says_it_has_nothing_to_learn(moe_pack):
    """--cache-policy class where the slots hold every pair (24 of 24): no refusal, no swap scratch (24 slots, no host
    tier), and a warning that says so - the engine's start-up note, "nothing to learn"; with 3 slots no such warning."""
    code, out = _check(moe_pack, "--card", "24G", "--ctx", 64, "--cache-policy", "class", "--json")
    d = json.loads(out)
    assert code == 0 and d["slots"] == 24
    assert "--cache-policy class: nothing to learn (24 slots hold all 24 pairs)" in d["warnings"]
    code, out = _check(moe_pack, "--card", "24G", "--ctx", 64, "--cache-policy", "class", "--expert-cache", 3, "--json")
    assert code == 0 and not any("nothing to learn" in w for w in json.loads(out)["warnings"])


def test_class_policy_with_the_cpu_miss_tier_is_refused_as_the_engine_refuses_it(moe_pack):
    """--cache-policy class --miss-tier cpu: refused whatever the card (the engine's options refuse the pair before
    sizing anything: budget.cache_policy.option_refusal, one rule) - also where every pair fits, where the plan alone
    would only have said "nothing to learn"."""
    for card in ("24G", "6G"):
        code, out = _check(moe_pack, "--card", card, "--ctx", 64, "--cache-policy", "class", "--miss-tier", "cpu")
        assert code == 2, out
        assert "--cache-policy class swaps experts between the VRAM slots and the host tier: it needs" in out
    code, _out = _check(moe_pack, "--card", "24G", "--ctx", 64, "--cache-policy", "class", "--miss-tier", "cpu",
                        "--engine", "cpp")  # fmt: skip
    assert code == 0  # (another engine: the options are strata's, unused)


def test_a_host_tier_the_ram_cannot_hold_is_charged_to_the_cpu_or_refused(moe_pack, monkeypatch):
    """Where the plan's host tier does not fit this machine's RAM less 4 GiB the engine builds none: under --miss-tier
    auto its misses run on the CPU, so the prediction charges them there (--cpu-expert-us, refused by name without
    it), and --miss-tier pcie - which the engine refuses then - is refused (exit 2), not predicted. (A new user's
    finding: it printed a split figure beside the warning that no tier would be built.)"""
    from strata.budget import cards
    from strata.budget import cli as budget_cli
    from strata.layout.experts import HOST_TIER_MARGIN_BYTES

    for mod in (cards, budget_cli):  # the prediction's rule and the warning's: no room for any tier
        monkeypatch.setattr(mod, "host_ram_bytes", lambda: HOST_TIER_MARGIN_BYTES + 1)
    k, blobs = _blobs(moe_pack)
    base = ["--card", "24G", "--ctx", 64, "--expert-cache", 0, "--step-ms", 4, "--pcie-gbs", 1]
    code, out = _check(moe_pack, *base, "--cpu-expert-us", 100, "--json")
    assert code == 0, out
    d = json.loads(out)
    want = predict_decode(
        step_ms=4, pcie_gbs=1, hit_rate=0.0, hit_basis="", n_expert_used=k, blob_bytes=blobs, cpu_expert_us=100,
        miss_tier="cpu",
    )  # fmt: skip
    assert d["decode_prediction"]["share"] == 0.0 and d["decode_prediction"]["tok_s"] == want.tok_s
    assert any(
        "computes the misses on the CPU (--miss-tier auto; it refuses --miss-tier pcie)" in w for w in d["warnings"]
    )
    code, out = _check(moe_pack, *base)
    assert code == 2 and "--miss-tier auto: the host tier (" in out and "give --cpu-expert-us" in out
    code, out = _check(moe_pack, *base, "--miss-tier", "pcie")
    assert code == 2 and "--miss-tier pcie: the host tier (" in out and "strata-engine refuses it" in out


def test_refused_numbers_are_shown_as_given():
    """A refused value is written in full where ``:g`` would round it into the range (1000000.5 ms is not "1e+06")."""
    for kw, text in (
        (dict(step_ms=1000000.5), "--step-ms 1000000.5: outside"),
        (dict(pcie_gbs=10000.01), "--pcie-gbs 10000.01: outside"),
        (dict(cpu_expert_us=1000001.0), "--cpu-expert-us 1000001: outside"),
    ):
        args = dict(step_ms=4.0, pcie_gbs=50.0, hit_rate=0.5, hit_basis="x", n_expert_used=8, blob_bytes=[10]) | kw
        with pytest.raises(PlanInputError, match=re.escape(text)):
            predict_decode(**args)


def test_measure_plans_the_default_policy_where_it_cannot_learn(moe_pack):
    """strata-engine measure with no expert resident and the default --cache-policy auto: the engine keeps the fill
    (the class rule needs 2 slots), and the plan beside it now resolves auto the same way (it was handed "class"
    and refused a 0-slot plan - a new user's finding)."""
    from strata.engine.cli import main as engine_main

    args = ["measure", str(moe_pack), "--device", "sim", "--card", "24G", "--expert-cache", "0", "--json"]
    r = CliRunner().invoke(engine_main, args)
    d = json.loads(r.output)
    assert r.exit_code == 0 and "error" not in d, r.output
    assert (d["slots"], d["scratch_slots"], d["exact_ok"]) == (0, 0, True)  # no swap scratch planned: the fill kept
