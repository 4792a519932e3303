"""Repeats of an A/B over training seeds, and what they allow one to say (`compare --seeds`).

At the CPU budget one seed moves held-out tau as much as a recipe lever (docs/benchmarks.md:
1.079 vs 1.203 for the same recipe), so a variant is judged by its difference to the first
variant on the SAME seed (paired: same data order and initialisation draws), over seeds,
with a Student-t 95 % interval on the mean difference. A lever is a gain only when that
interval lies above zero.
"""
from __future__ import annotations

import math
from typing import Sequence

from dflash_train.errors import UserError

# two-sided 95 % Student-t quantiles by degrees of freedom (1..10); beyond that ~2
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def parse_seeds(text: str | None) -> list[int] | None:
    """`0,1,2` -> [0, 1, 2]; None -> None (one run per variant at the config's seed)."""
    if text is None:
        return None
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--seeds {text!r}: expected integers separated by commas, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {text!r}: give one or more distinct integers, e.g. 0,1,2")
    return seeds


def run_name(variant: str, seed: int | None) -> str:
    """The run dir (and compare.json key) of one variant at one seed."""
    return variant if seed is None else f"{variant}-seed{seed}"


def _mean_sd(xs: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
    return m, sd


def paired_summary(values: dict[str, dict[int, float]], seeds: Sequence[int]) -> dict[str, dict]:
    """values[variant][seed] -> per variant: its values, mean and sd over seeds, and the paired
    difference to the first variant (mean, 95 % half-width, verdict)."""
    names = list(values)
    ref = names[0]
    out: dict[str, dict] = {}
    for name in names:
        xs = [values[name][s] for s in seeds]
        mean, sd = _mean_sd(xs)
        row: dict = {"seeds": list(seeds), "values": xs, "mean": mean, "sd": sd, "vs": ref}
        if name != ref:
            d = [values[name][s] - values[ref][s] for s in seeds]
            dm, dsd = _mean_sd(d)
            half = None if dsd is None else T95.get(len(d) - 1, 2.0) * dsd / math.sqrt(len(d))
            if half is None:
                verdict = "one seed: no verdict"
            elif dm - half > 0:
                verdict = "gain"
            elif dm + half < 0:
                verdict = "loss"
            else:
                verdict = "within noise"
            row.update(delta=d, delta_mean=dm, delta_half95=half, verdict=verdict)
        out[name] = row
    return out


def print_seed_table(summary: dict[str, dict], what: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{what} over seeds; difference paired by seed against the first variant, 95 % interval")
    for c in ("variant", "per seed", "mean", "sd", "difference", "verdict"):
        t.add_column(c, justify="left" if c in ("variant", "verdict") else "right")
    for name, r in summary.items():
        diff = "-" if "delta_mean" not in r else (
            f"{r['delta_mean']:+.3f}" + ("" if r["delta_half95"] is None else f" ± {r['delta_half95']:.3f}"))
        t.add_row(name, " ".join(f"{x:.3f}" for x in r["values"]), f"{r['mean']:.3f}",
                  "-" if r["sd"] is None else f"{r['sd']:.3f}", diff, r.get("verdict", "(reference)"))
    Console(width=200).print(t)
