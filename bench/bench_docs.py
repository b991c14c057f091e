"""The qwen3next reference model on emulated cards: the budget's prediction beside what the engine does
(``make bench-docs``).

Not a test: a benchmark for the GPU machine. For each card (``--cards 24G,16G,12G``), in a
fresh process each (a CUDA context of its own):

- ``strata-budget check PACK --card C --ctx N [--expert-profile P] --json``: the plan (every term,
  the automatic slots, the profile's expected hit rate);
- ``strata-engine measure PACK --card C --ctx N [--expert-profile P] -n T --json``: start-up time per
  checkpoint, every term predicted vs measured, the engine's slots, the reserve measured free after
  start-up, then T tokens: decode tok/s, CPU misses per position, the hit rate measured beside the
  profile's prediction.

``--variant NAME=PACK@CARD`` adds a row for another pack on one card (the draft head grown by
~150 MiB at 16G). Prints a table (last) and writes every number to ``--json``.

    python bench/bench_docs.py PACK [--cards 24G,16G,12G] [--ctx 4096] [--profile P] [-n 32]
                               [--variant big=PACK2@16G] [--json out.json] [--timeout 240]

The pack: the qwen3next reference model written by bench/device_docs.sh (strata.testing.write_reference_model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def _run_json(args: list[str], timeout: int) -> tuple[dict | None, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, "-m", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    out = p.stdout.strip()
    start = out.find("{")
    try:
        return (json.loads(out[start:]) if start >= 0 else None), p.stderr[-2000:], dt
    except json.JSONDecodeError:
        return None, (p.stderr or out)[-2000:], dt


def run_card(
    pack: str, card: str, ctx: int, profile: str | None, n_tokens: int, timeout: int, label: str = "", sim: bool = False
) -> dict:
    """One row: the plan and the measurement of ``pack`` on the emulated ``card`` (``sim``: the NumPy
    stand-in of the card, a dry run without a GPU)."""
    prof = ["--expert-profile", profile] if profile else []
    check, check_err, check_s = _run_json(
        ["strata.budget.cli", "check", pack, "--card", card, "--ctx", str(ctx), "--json", "--no-bf16-scan", *prof],
        timeout,
    )
    meas, meas_err, meas_s = _run_json(
        [
            "strata.engine.cli",
            "measure",
            pack,
            "--card",
            card,
            "--ctx",
            str(ctx),
            "-n",
            str(n_tokens),
            "--json",
            *prof,
            *(["--device", "sim"] if sim else []),
        ],
        timeout,
    )
    row: dict = {
        "label": label or card,
        "card": card,
        "pack": pack,
        "check_s": round(check_s, 1),
        "measure_s": round(meas_s, 1),
    }
    if check is None or check.get("verdict") == "error":
        row["check_error"] = (check or {}).get("verdict_line") or check_err
    else:
        row["check"] = {
            k: check[k] for k in ("verdict_line", "slots", "free_bytes", "used_bytes", "draft_bind_bytes") if k in check
        }
        row["check"]["terms"] = {t["name"]: t["bytes"] for t in check["terms"]}
        row["check"]["expected_hit_rate"] = (check.get("profile") or {}).get("expected_hit_rate")
    if meas is None or meas.get("ok") is False:
        row["measure_error"] = (meas or {}).get("error") or meas_err
    else:
        row["measure"] = meas
    return row


def table(rows: list[dict]) -> list[str]:
    """The compact table: per row the slots (check / engine), total diff, exact terms, reserve, hit rate
    (predicted / measured), decode tok/s and CPU misses per position, start-up seconds."""
    out = [
        f"{'row':10s} {'slots chk/eng':>14s} {'total diff':>12s} {'exact':>6s} {'reserve':>8s} "
        f"{'hit pred/meas':>15s} {'tok/s':>6s} {'miss/pos':>8s} {'start s':>8s}"
    ]
    for r in rows:
        m, c = r.get("measure"), r.get("check", {})
        if m is None:
            out.append(f"{r['label']:10s} error: {str(r.get('measure_error') or r.get('check_error'))[:100]}")
            continue
        g = m.get("generation") or {}
        pred = g.get("hit_rate_predicted_plan", c.get("expected_hit_rate"))
        hit = f"{pred:.1%}/" if pred is not None else "-/"
        hit += f"{g['hit_rate_measured']:.1%}" if g.get("hit_rate_measured") is not None else "-"
        out.append(
            f"{r['label']:10s} {str(c.get('slots', '-')) + '/' + str(m['slots']):>14s} "
            f"{m['total_diff_bytes'] / MIB:+10.1f}Mi {'ok' if m['exact_ok'] else 'DIFF':>6s} "
            f"{'free' if m['reserve_ok'] else 'EATEN':>8s} {hit:>15s} {g.get('decode_tok_s') or 0:6.2f} "
            f"{g.get('cpu_misses_per_token', 0):8.1f} {sum(m['checkpoints_s'].values()):8.1f}"
        )
    return out


def term_table(rows: list[dict]) -> list[str]:
    """Per row and term: predicted, measured, difference (bytes)."""
    out = []
    for r in rows:
        m = r.get("measure")
        if m is None:
            continue
        out.append(f"-- {r['label']} ({r['card']}): term, predicted, measured, diff (bytes)")
        for t in m["terms"]:
            d = t["measured_bytes"] - t["predicted_bytes"]
            out.append(
                f"   {t['term']:20s} {t['predicted_bytes']:>16,d} {t['measured_bytes']:>16,d} {d:>+14,d} "
                f"{'exact' if t['exact'] else 'estimate'}"
            )
        out.append(
            f"   {'total':20s} {m['predicted_total_bytes']:>16,d} {m['measured_total_bytes']:>16,d} "
            f"{m['total_diff_bytes']:>+14,d} (within 0.5% or 32 MiB: {'yes' if m['total_ok'] else 'NO'})"
        )
        out.append(
            "   start-up (s): "
            + ", ".join(f"{k} {v:.2f}" for k, v in m["checkpoints_s"].items())
            + f"; slots: check {r.get('check', {}).get('slots', '-')}, engine {m['slots']}; "
            f"free after start-up {m['free_after_bytes'] / MIB:.1f} MiB (reserve {m['reserve_bytes'] / MIB:.0f} MiB)"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack")
    ap.add_argument("--cards", default="24G,16G,12G")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--profile", default=None)
    ap.add_argument("-n", "--tokens", type=int, default=32)
    ap.add_argument("--variant", action="append", default=[], help="NAME=PACK@CARD: another pack on one card")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_docs.json"))
    ap.add_argument("--timeout", type=int, default=240, help="seconds per command")
    ap.add_argument("--sim", action="store_true", help="the NumPy stand-in of the cards (a dry run without a GPU)")
    a = ap.parse_args()
    rows: list[dict] = []
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    todo = [(a.pack, c, c) for c in a.cards.split(",") if c]
    for v in a.variant:
        name, rest = v.split("=", 1)
        pack, card = rest.rsplit("@", 1)
        todo.append((pack, card, name))
    for pack, card, label in todo:
        rows.append(run_card(pack, card, a.ctx, a.profile, a.tokens, a.timeout, label=label, sim=a.sim))
        print("\n".join(table(rows[-1:])[1:]), flush=True)
        # after every row: a run cut short still leaves the rows it finished
        Path(a.json).write_text(
            json.dumps({"ctx": a.ctx, "tokens": a.tokens, "profile": a.profile, "rows": rows}, indent=1)
        )
    print("\n".join(term_table(rows)))
    print("\n".join(table(rows)))
    return 0 if all("measure" in r and r["measure"]["exact_ok"] and r["measure"]["reserve_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
