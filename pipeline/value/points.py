"""From the arms' held-out figures to each dataset's curve points: acceptance on a serving mix (and on the
dataset's own held-out samples) against what that dataset's training samples cost in the arm.

A mix is a weight per dataset; acceptance on it is the weighted mean of the per-dataset held-out figures, its
standard error the same combination of theirs (the datasets' held-out samples are disjoint). The default mix is
the held-out one: each dataset weighted by its share of the full drafter's held-out drafts, so the mix figure
is the report's overall held-out acceptance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.value.curves import Curve, curve_draws, fit_curve


def by_dataset(heldout: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Dataset name -> its held-out group (acceptance_length, se, drafts) of one arm's measurement."""
    groups = heldout.get("by_dataset") if isinstance(heldout, Mapping) else None
    return {str(g["name"]): g for g in groups or [] if isinstance(g, Mapping) and "name" in g}


def heldout_mix(results: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The held-out mix: each dataset's share of the full arms' held-out drafts."""
    drafts: dict[str, float] = {}
    for res in results:
        if res["arm"]["dataset"] is None:
            for name, g in by_dataset(res["heldout"]).items():
                drafts[name] = drafts.get(name, 0.0) + float(g.get("drafts") or 0)
    total = sum(drafts.values())
    return {k: v / total for k, v in sorted(drafts.items())} if total else {}


def normalise_mix(mix: Mapping[str, float], known: Sequence[str]) -> dict[str, float] | str:
    """Weights that sum to 1 over datasets that have held-out figures, or why they cannot."""
    unknown = sorted(set(mix) - set(known))
    if unknown:
        return f"no held-out figures for {', '.join(unknown)} (held-out datasets: {', '.join(sorted(known))})"
    if any(not math.isfinite(w) or w < 0 for w in mix.values()):
        return "mix weights must be finite and not negative"
    total = sum(mix.values())
    if total <= 0:
        return "mix weights sum to 0"
    return {k: v / total for k, v in sorted(mix.items()) if v > 0}


def mix_figure(heldout: Mapping[str, Any], mix: Mapping[str, float]) -> tuple[float, float | None] | None:
    """(acceptance on the mix, its standard error) of one arm, or None when a weighted dataset has no figure."""
    if not mix:
        return None  # no dataset weighted: no figure (not 0)
    groups = by_dataset(heldout)
    acc, var, known_se = 0.0, 0.0, True
    for name, w in mix.items():
        g = groups.get(name)
        if g is None or g.get("acceptance_length") is None:
            return None
        acc += w * float(g["acceptance_length"])
        if g.get("se") is None:
            known_se = False
        else:
            var += (w * float(g["se"])) ** 2
    return acc, (math.sqrt(var) if known_se else None)


def dataset_points(results: Sequence[Mapping[str, Any]], dataset: str,
                   mix: Mapping[str, float]) -> list[dict[str, Any]]:
    """The points of ``dataset``'s curve: the full arms and the arms that cut this dataset, each with the spend
    of this dataset's samples it trained on, its mix acceptance and its acceptance on this dataset."""
    points = []
    for res in results:
        arm = res["arm"]
        if arm["dataset"] not in (None, dataset):
            continue
        fig = mix_figure(res["heldout"], mix)
        own = by_dataset(res["heldout"]).get(dataset, {})
        spend = res["spend"].get(dataset, {"usd": 0.0, "tokens": 0, "samples": 0})
        if fig is None:
            continue
        points.append({"fraction": 1.0 if arm["dataset"] is None else arm["fraction"], "seed": arm["seed"],
                       "usd": spend["usd"], "tokens": spend["tokens"], "samples": spend["samples"],
                       "acceptance": round(fig[0], 6), "se": None if fig[1] is None else round(fig[1], 6),
                       "own": own.get("acceptance_length"), "own_se": own.get("se")})
    return sorted(points, key=lambda p: (p["fraction"], p["seed"]))


def dataset_curves(points: Sequence[Mapping[str, Any]], ceiling: float | None = None) -> dict[str, Any]:
    """The fitted curves of one dataset's points: mix acceptance against dollars and against tokens, and its
    own held-out acceptance against dollars, each held under ``ceiling`` (k + 1) where known. A curve that
    cannot be fitted is its reason."""
    def fit(axis: str, y: str, se: str) -> dict[str, Any] | str:
        pts = [p for p in points if p.get(y) is not None]
        res = fit_curve([p[axis] for p in pts], [p[y] for p in pts], [p.get(se) for p in pts], ceiling)
        return res.to_dict() if isinstance(res, Curve) else res

    return {"usd": fit("usd", "acceptance", "se"), "tokens": fit("tokens", "acceptance", "se"),
            "own_usd": fit("usd", "own", "own_se")}


def mix_draws(points: Sequence[Mapping[str, Any]], n: int = 200, seed: int = 0,
              ceiling: float | None = None) -> list[Curve]:
    """Bootstrap curves of the mix acceptance against dollars (see ``curves.curve_draws``)."""
    return curve_draws([p["usd"] for p in points], [p["acceptance"] for p in points],
                       [p.get("se") for p in points], n=n, seed=seed, ceiling=ceiling)


def acceptance_ceiling(results: Sequence[Mapping[str, Any]]) -> float | None:
    """k + 1, the most tokens a target step can accept with k drafted, of the arms' held-out figures (their
    largest k), or None where none says its k."""
    ks = [h["k"] for r in results for h in (r.get("heldout"),)
          if isinstance(h, Mapping) and isinstance(h.get("k"), int) and not isinstance(h.get("k"), bool)
          and h["k"] > 0]
    return float(max(ks) + 1) if ks else None
