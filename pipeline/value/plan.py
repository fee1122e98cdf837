"""A plan for the next spend: per-dataset dollars that maximise the predicted acceptance on a serving mix.

Each dataset's curve (``pipeline.value.curves``) gives the mix acceptance against the dollars of that
dataset's training samples, the other datasets whole. The plan treats the gains as adding up (each curve is
measured with the others at their full spend, so cross-dataset transfer is in each curve's ``a0``, not in the
sum) and, because every curve is concave, spends the budget greedily in small steps on whichever dataset's
next step is predicted to gain most. New samples go to training at ``train_share`` (1 - the held-out
fraction). A sample's price is every dollar billed for its dataset over the samples that reached training
(the rows quarantined on the way included), and only the part of it in samples that pass moves a curve
(``advance``). A dataset stops taking money when its prompt files have no rows left, and the plan stops when no
dataset's next dollar is predicted to gain anything. Its uncertainty is the spread of the same allocation's
gain over the bootstrap curves; an even split is predicted beside it, with its own spread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.value.curves import Curve, mean_sd

STEPS = 400  # budget increments of the greedy allocation


class PlanRefused(ValueError):
    """The budget or the curves cannot make a plan; the message says why, in one line."""


@dataclass(frozen=True)
class Buyable:
    """One dataset the next run can buy samples of."""

    dataset: str
    usd_per_sample: float  # every dollar billed per sample that reached training so far (0: no price)
    spent_usd: float  # dollars of its training samples in the full drafter: where its curve stands now
    room: int | None  # samples its files' rows left should give at the pass rate so far (None: no limit)
    curve: Curve
    draws: Sequence[Curve] = field(default_factory=tuple)
    # the dollars the curve counts per such sample (its own row's bill; None: the price). Below the price by
    # what the rows that failed cost: those dollars teach the drafter nothing
    curve_usd_per_sample: float | None = None


def advance(b: Buyable, train_share: float) -> float:
    """Curve dollars one plan dollar on ``b`` adds: the share of samples that train, times the share of the
    price that lands in samples (at most all of it)."""
    if b.curve_usd_per_sample is None or b.usd_per_sample <= 0:
        return train_share
    return train_share * min(1.0, max(b.curve_usd_per_sample, 0.0) / b.usd_per_sample)


def gain(curve: Curve, spent: float, add_usd: float, train_share: float) -> float:
    """Predicted mix acceptance gained by spending ``add_usd`` more on a dataset now at ``spent``."""
    return curve(spent + add_usd * train_share) - curve(spent)


def allocate(buys: Sequence[Buyable], budget: float, train_share: float, steps: int = STEPS) -> dict[str, float]:
    """Dollars per dataset (whole samples' worth, within each one's room), greedily by the next step's gain."""
    alloc = {b.dataset: 0.0 for b in buys}
    cap = {b.dataset: math.inf if b.room is None else b.room * b.usd_per_sample for b in buys}
    step = budget / steps
    for _ in range(steps):
        best, best_gain = None, 0.0
        for b in buys:
            d = min(step, cap[b.dataset] - alloc[b.dataset])
            if d <= 0:
                continue
            share = advance(b, train_share)
            g = gain(b.curve, b.spent_usd + alloc[b.dataset] * share, d, share) / d * step
            if g > best_gain:
                best, best_gain = b, g
        if best is None:
            break
        alloc[best.dataset] += min(step, cap[best.dataset] - alloc[best.dataset])
    whole = {b.dataset: math.floor(alloc[b.dataset] / b.usd_per_sample + 1e-9) * b.usd_per_sample for b in buys}
    # the fractions of a sample cut off above, spent again in whole samples on the best next sample
    left = budget - sum(whole.values())
    while True:
        fits = [b for b in buys if b.usd_per_sample <= left + 1e-12
                and whole[b.dataset] + b.usd_per_sample <= cap[b.dataset] + 1e-12]
        gains = [(gain(b.curve, b.spent_usd + whole[b.dataset] * advance(b, train_share), b.usd_per_sample,
                       advance(b, train_share)), b) for b in fits]
        gains = [(g, b) for g, b in gains if g > 0]
        if not gains:
            return whole
        _, b = max(gains, key=lambda gb: gb[0])
        whole[b.dataset] += b.usd_per_sample
        left -= b.usd_per_sample


def even_split(buys: Sequence[Buyable], budget: float) -> dict[str, float]:
    """The same budget in equal dollars per dataset (whole samples, within each one's room)."""
    share = budget / len(buys)
    out = {}
    for b in buys:
        n = math.floor(share / b.usd_per_sample + 1e-9)
        out[b.dataset] = (n if b.room is None else min(n, b.room)) * b.usd_per_sample
    return out


def predicted(buys: Sequence[Buyable], alloc: Mapping[str, float], train_share: float) -> dict[str, Any]:
    """The allocation's predicted gain: from the fitted curves, and its mean and sd over the bootstrap ones."""
    point = sum(gain(b.curve, b.spent_usd, alloc[b.dataset], advance(b, train_share)) for b in buys)
    n = min((len(b.draws) for b in buys), default=0)
    draws = [sum(gain(b.draws[i], b.spent_usd, alloc[b.dataset], advance(b, train_share)) for b in buys)
             for i in range(n)]
    mean, sd = mean_sd(draws) if draws else (point, float("nan"))
    return {"gain": round(point, 4), "bootstrap_mean": round(mean, 4), "sd": None if math.isnan(sd) else round(sd, 4),
            "draws": n}


def make_plan(buys: Sequence[Buyable], budget_usd: float, train_share: float, now: float) -> dict[str, Any]:
    """The plan for ``budget_usd`` more dollars; ``now``: the full drafter's acceptance on the mix.

    Raises ``PlanRefused`` for a budget that buys no sample, or no dataset with a price."""
    if not math.isfinite(budget_usd) or budget_usd <= 0:
        raise PlanRefused(f"the budget must be a positive number of dollars, not {budget_usd}")
    priced = [b for b in buys if b.usd_per_sample > 0]
    if not priced:
        raise PlanRefused("no dataset has a price per sample (API bills, or an engine source's gpu_hour_usd)")
    cheapest = min(priced, key=lambda b: b.usd_per_sample)
    if budget_usd < cheapest.usd_per_sample:
        raise PlanRefused(f"a budget of ${budget_usd:.4g} buys no sample: the cheapest dataset, {cheapest.dataset}, "
                          f"costs ${cheapest.usd_per_sample:.4g} a sample")
    alloc = allocate(priced, budget_usd, train_share)
    even = even_split(priced, budget_usd)
    spent = sum(alloc.values())
    rows = []
    for b in priced:
        x = alloc[b.dataset]
        new_train = b.spent_usd + x * advance(b, train_share)
        rows.append({"dataset": b.dataset, "add_usd": round(x, 12), "add_samples": round(x / b.usd_per_sample),
                     "usd_per_sample": b.usd_per_sample, "curve_usd_per_sample": b.curve_usd_per_sample,
                     "spent_usd": round(b.spent_usd, 12),
                     "slope_now": b.curve.slope(b.spent_usd),
                     "gain": round(gain(b.curve, b.spent_usd, x, advance(b, train_share)), 4),
                     "room": b.room, "full": b.room is not None and round(x / b.usd_per_sample) >= b.room,
                     # beyond twice the spend the curve was measured on, or on a curve whose points never bent
                     # (or that the k + 1 ceiling held)
                     "extrapolated": x > 0 and (new_train > 2 * max(b.spent_usd, 1e-12) or not b.curve.measured)})
    # the part of the gain that rests on curves carried past what they were measured on: in the value bench
    # (bench/RESULTS.md) the plans whose gain was mostly this lost to an even split or won by far less than the
    # spread they were predicted with
    extrapolated = sum(r["gain"] for r in rows if r["extrapolated"])
    return {"budget_usd": budget_usd, "planned_usd": round(spent, 12), "unspent_usd": round(budget_usd - spent, 12),
            "train_share": train_share, "now": round(now, 4), "datasets": rows,
            "extrapolated_gain": round(extrapolated, 4),
            "unpriced": sorted(b.dataset for b in buys if b.usd_per_sample <= 0),
            "predicted": predicted(priced, alloc, train_share),
            "even_split": {"add_usd": {k: round(v, 12) for k, v in even.items()},
                           "predicted": predicted(priced, even, train_share)}}


def plan_lines(plan: Mapping[str, Any]) -> list[str]:
    """The plan as the console shows it."""
    p, e = plan["predicted"], plan["even_split"]["predicted"]

    def pm(pred: Mapping[str, Any]) -> str:
        return f"{pred['gain']:+.3f}" + (f" ± {pred['sd']:.3f}" if pred.get("sd") is not None else "")

    lines = [f"[plan] ${plan['budget_usd']:.4g} more: predicted mix acceptance {plan['now']:.3f} -> "
             f"{plan['now'] + p['gain']:.3f} ({pm(p)}); an even split {pm(e)}"]
    for r in plan["datasets"]:
        notes = [w for w, on in (("no prompts left after it", r["full"]), ("extrapolated", r["extrapolated"])) if on]
        tail = f" ({', '.join(notes)})" if notes else ""
        lines.append(f"[plan]   {r['dataset']}: +${r['add_usd']:.4g} ({r['add_samples']} samples at "
                     f"${r['usd_per_sample']:.3g}), gain {r['gain']:+.3f}{tail}")
    share = plan.get("extrapolated_gain", 0.0) / p["gain"] if p["gain"] > 0 else 0.0
    if share >= 0.5:
        lines.append(f"[plan]   {share:.0%} of the predicted gain is extrapolated (a curve carried past twice the "
                     "spend it was measured at, or one whose points never bent or that the k + 1 ceiling held): a "
                     "guess, not a measurement")
    if plan["unspent_usd"] > 0 and plan["datasets"] and plan["unspent_usd"] >= min(
            r["usd_per_sample"] for r in plan["datasets"]):
        lines.append(f"[plan]   ${plan['unspent_usd']:.4g} left unspent: no dataset's next sample is predicted to "
                     "gain, or no prompts are left")
    if plan["unpriced"]:
        lines.append(f"[plan]   not planned (no price per sample): {', '.join(plan['unpriced'])}")
    return lines
