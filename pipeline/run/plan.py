"""``python -m pipeline plan CONFIG --budget-usd X [--mix dataset=weight ...]``: the next spend, per dataset.

It reads ``value/value.json`` (``python -m pipeline value``), refits each dataset's curve on the serving mix
when one is given (default: the held-out mix the value run used), and hands the curves, each dataset's price
per sample and the prompts its files still hold to pipeline.value.plan. It writes ``value/plan.json`` with a
config fragment the user pastes over the same keys of CONFIG: per dataset the ``max_rows`` that reads the
planned prompts more, and on each API source that served the dataset a ``budgets_usd`` cap of what its samples
cost so far plus the plan's dollars (a cap that errs low: quarantined answers were billed too).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import yaml

from pipeline.base.config import RunConfig
from pipeline.base.layout import RunLayout, atomic_write_json
from pipeline.base.records import read_rows, read_samples
from pipeline.prompts.datasets import count_rows
from pipeline.report.html import refresh_report_html
from pipeline.run.value import ValueRefused, sample_costs
from pipeline.value.curves import Curve
from pipeline.value.plan import Buyable, make_plan, plan_lines
from pipeline.value.points import by_dataset, dataset_curves, dataset_points, mix_draws, mix_figure, normalise_mix


def read_value(layout: RunLayout) -> dict[str, Any]:
    """value.json, or ``ValueRefused`` naming the command that makes it."""
    try:
        value = json.loads(layout.value_report.read_text())
    except OSError:
        raise ValueRefused(f"no value curves in {layout.value_report}: run `python -m pipeline value` on this "
                           "config first") from None
    except ValueError as e:
        raise ValueRefused(f"{layout.value_report} is not JSON ({e}): run `python -m pipeline value` again") from None
    if not isinstance(value, dict) or not isinstance(value.get("arms"), list) or \
            not isinstance(value.get("datasets"), dict):
        raise ValueRefused(f"{layout.value_report} is not a value report: run `python -m pipeline value` again")
    return value


def room(cfg: RunConfig, layout: RunLayout) -> dict[str, dict[str, int]]:
    """Per dataset: rows its file holds (``max_rows`` ignored), rows read so far (passed or quarantined), and
    how many of those passed."""
    passed = Counter(r["dataset"] for r in read_samples(layout.samples, ["sample_id", "dataset"])[0])
    seen: dict[str, set[str]] = {}
    for r in read_rows(layout.quarantine, ["sample_id", "dataset"]):
        seen.setdefault(r["dataset"], set()).add(r["sample_id"])
    out = {}
    for d in cfg.datasets:
        rows = count_rows(d.model_copy(update={"max_rows": None}))
        read = passed.get(d.name, 0) + len(seen.get(d.name, ()))
        out[d.name] = {"rows": rows, "read": min(read, rows), "passed": passed.get(d.name, 0)}
    return out


def fragment(cfg: RunConfig, plan: Mapping[str, Any], rooms: Mapping[str, Mapping[str, int]],
             costs: Mapping[tuple[str, str], float]) -> dict[str, Any]:
    """The config keys that spend the plan: ``max_rows`` per dataset (the planned samples more, scaled up by
    the dataset's pass rate so far), ``budgets_usd`` per API source (``costs``: (source, dataset) -> dollars
    of its samples so far)."""
    from pipeline.generate.sources.registry import spending_sources

    datasets, budgets = [], {}
    for row in plan["datasets"]:
        name, add = row["dataset"], int(row["add_samples"])
        r = rooms.get(name)
        if add <= 0 or r is None:
            continue
        rate = r["passed"] / r["read"] if r["read"] else 1.0
        datasets.append({"name": name, "max_rows": min(r["rows"], r["read"] + math.ceil(add / max(rate, 1e-9)))})
        for src in spending_sources(cfg.sources):
            if (src.name, name) in costs:
                budgets.setdefault(src.name, {})[name] = round(costs[src.name, name] + row["add_usd"], 6)
    out: dict[str, Any] = {"datasets": datasets}
    if budgets:
        out["sources"] = [{"name": s, "budgets_usd": b} for s, b in sorted(budgets.items())]
    return out


def run_plan(cfg: RunConfig, budget_usd: float, mix: Mapping[str, float] | None = None) -> tuple[dict[str, Any],
                                                                                                  list[str]]:
    """The plan (also written to ``value/plan.json``) and its console lines. ``PlanRefused`` or
    ``ValueRefused`` when it cannot be made."""
    layout = RunLayout(cfg.output_dir)
    value = read_value(layout)
    measured = [r for r in value["arms"] if isinstance(r, dict) and r.get("heldout")]
    known = sorted({name for r in measured for name in by_dataset(r["heldout"])})
    chosen = value.get("mix") or {}
    if mix:
        chosen = normalise_mix(mix, known)
        if isinstance(chosen, str):
            raise ValueRefused(f"--mix: {chosen}")
    full = [f for f in (mix_figure(r["heldout"], chosen) for r in measured if r["arm"]["dataset"] is None) if f]
    if not full:
        raise ValueRefused("the full drafter has no held-out figure on this mix: run `python -m pipeline value` again")
    now = sum(f[0] for f in full) / len(full)
    rooms = room(cfg, layout)
    buys, no_curve = [], {}
    for name, d in sorted(value["datasets"].items()):
        points = dataset_points(measured, name, chosen) if mix else d["points"]
        curve = dataset_curves(points)["usd"] if mix else d["curves"]["usd"]
        if not isinstance(curve, dict):
            no_curve[name] = str(curve)
            continue
        r = rooms.get(name)
        buys.append(Buyable(name, float(d["usd_per_sample"]), float(d["spent_usd"]),
                            None if r is None else max(r["rows"] - r["read"], 0), Curve.from_dict(curve),
                            mix_draws(points)))
    if not buys:
        reasons = "; ".join(f"{k}: {v}" for k, v in no_curve.items())
        raise ValueRefused(f"no dataset has a fitted curve ({reasons})")
    plan = make_plan(buys, budget_usd, 1.0 - float(value["heldout_fraction"]), now)
    costs: Counter = Counter()
    for s in sample_costs(layout, cfg):
        costs[s["source"], s["dataset"]] += s["usd"]
    plan |= {"mix": chosen, "no_curve": no_curve, "fragment": fragment(cfg, plan, rooms, costs)}
    lines = plan_lines(plan) + [f"[plan]   no curve for {k}: {v}" for k, v in no_curve.items()]
    plan["lines"] = lines
    atomic_write_json(layout.plan, plan)
    refresh_report_html(layout)
    if plan["fragment"]["datasets"]:
        lines.append(f"[plan] written to {layout.plan}; paste over the same keys of the config:")
        lines += ["    " + ln for ln in yaml.safe_dump(plan["fragment"], sort_keys=False).splitlines()]
    return plan, lines
