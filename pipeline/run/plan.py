"""``python -m pipeline plan CONFIG --budget-usd X [--mix dataset=weight ...]``: the next spend, per dataset.

It reads ``value/value.json`` (``python -m pipeline value``), refits each dataset's curve on the serving mix
when one is given (default: the held-out mix the value run used), and hands the curves, each dataset's price
per sample (every dollar billed for the dataset, quarantined rows included, over its samples that reach
training: ``value.dataset_bills``, read from the folder now) and the samples its files' rows left should give
to pipeline.value.plan. A plan's dollars so pay for the failed rows too, and the caps below cover the rows
``max_rows`` reads. It writes
``value/plan.json`` with a config fragment, by entry name: per dataset the ``max_rows`` that reads the planned
prompts more, and on each API source that served the dataset a ``budgets_usd`` cap of what its ledger counted
so far plus its share of the plan's dollars (and its token cap raised alike, where it has one).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import yaml

from pipeline.base.config import ConfigError
from pipeline.base.layout import RunLayout, atomic_write_json
from pipeline.base.records import read_rows, read_samples
from pipeline.prompts.datasets import count_rows
from pipeline.report.html import refresh_report_html
from pipeline.run.config import RunConfig
from pipeline.run.value import VALUE_FORMAT, ValueRefused, dataset_bills, sample_costs
from pipeline.value.curves import Curve
from pipeline.value.plan import Buyable, make_plan, plan_lines
from pipeline.value.points import by_dataset, dataset_curves, dataset_points, mix_draws, mix_figure, normalise_mix


def read_value(layout: RunLayout) -> dict[str, Any]:
    """value.json, or ``ValueRefused`` naming the command that makes it (the shape of its parts is checked
    where they are read: ``buyables``)."""
    again = "run `python -m pipeline value` on this config again"
    try:
        value = json.loads(layout.value_report.read_text())
    except OSError:
        raise ValueRefused(f"no value curves in {layout.value_report}: run `python -m pipeline value` on this "
                           "config first") from None
    except ValueError as e:
        raise ValueRefused(f"{layout.value_report} is not JSON ({e}): {again}") from None
    if not isinstance(value, dict) or value.get("format") != VALUE_FORMAT or \
            not isinstance(value.get("arms"), list) or not isinstance(value.get("datasets"), dict):
        raise ValueRefused(f"{layout.value_report} is not a value report of format {VALUE_FORMAT}: {again}")
    return value


def room(cfg: RunConfig, layout: RunLayout) -> dict[str, dict[str, int]]:
    """Per dataset: rows its file holds (``max_rows`` ignored), rows read so far (passed, or quarantined), how
    many passed (generation, and not quarantined at extraction: those never train, so a plan that counted them
    would read too few rows), and the passed samples the rows left should give at that pass rate. Only ids the
    file gives now count (``read.current_ids``): a repaired row's old quarantine row is not a row read."""
    from pipeline.prompts.read import current_ids

    every = {d.name: d.model_copy(update={"max_rows": None}) for d in cfg.datasets}
    current = {name: set(current_ids(d, layout).to_pylist()) for name, d in every.items()}
    passed: dict[str, set[str]] = {}
    for r in read_samples(layout.samples, ["sample_id", "dataset"])[0]:
        if r["sample_id"] in current.get(r["dataset"], ()):
            passed.setdefault(r["dataset"], set()).add(r["sample_id"])
    failed: dict[str, set[str]] = {}
    for r in read_rows(layout.quarantine, ["sample_id", "dataset", "stage"]):
        if r["sample_id"] not in current.get(r["dataset"], ()):
            continue
        if r["sample_id"] not in passed.get(r["dataset"], set()) or r["stage"] == "extract":
            failed.setdefault(r["dataset"], set()).add(r["sample_id"])
    for name, ids in failed.items():  # quarantined at extraction: read, not passed
        passed.get(name, set()).difference_update(ids)
    out = {}
    for d in cfg.datasets:
        rows = count_rows(d.model_copy(update={"max_rows": None}))
        p = len(passed.get(d.name, ()))
        read = min(p + len(failed.get(d.name, ())), rows)
        rate = p / read if read else 1.0
        out[d.name] = {"rows": rows, "read": read, "passed": p, "samples_left": math.floor((rows - read) * rate)}
    return out


# A plan prices a dataset's next samples at its average so far; the samples it then buys may cost more (the
# bench's follow-ups overshot by ~0.1%, enough to leave the last row unreserved under a cap of exactly the
# plan). The caps get this headroom over the plan's share; ``max_rows`` is what bounds the rows bought.
CAP_HEADROOM = 1.2


def fragment(cfg: RunConfig, layout: RunLayout, plan: Mapping[str, Any], rooms: Mapping[str, Mapping[str, int]],
             costs: Mapping[tuple[str, str], float], tokens: Mapping[tuple[str, str], int] | None = None,
             asks: Mapping[tuple[str, str], float] | None = None) -> dict[str, Any]:
    """The config keys that spend the plan, by entry name: ``max_rows`` per dataset (the planned samples more,
    scaled up by the dataset's pass rate so far), and per API source that served the dataset a ``budgets_usd``
    cap: what its ledger has counted on it so far plus its share of the plan's dollars (shared by what each
    source's samples of it cost). A source that also caps the dataset in tokens gets its ``budgets`` raised
    the same way (its share in tokens at its own tokens per dollar so far), else that cap would stop the
    follow-up run first. Each cap holds the share with ``CAP_HEADROOM`` and one request's reservation
    (``asks``: its dollars, as the source reserves them ahead; ``max_tokens`` in tokens): a request is sent
    only while its worst case fits, so a cap of exactly the plan's dollars would leave the last planned rows to
    do; ``max_rows`` bounds the spend.
    ``costs``/``tokens``: (source, dataset) -> dollars / output tokens of its samples so far."""
    from pipeline.generate.ledger import read_journal_both
    from pipeline.generate.sources.registry import spending_sources

    tokens, asks = tokens or {}, asks or {}
    datasets: dict[str, dict[str, int]] = {}
    caps: dict[str, dict[str, dict[str, float | int]]] = {}
    api = spending_sources(cfg.sources)
    counted: dict[str, tuple[dict[str, int], dict[str, float]]] = {}
    for src in api:
        try:
            counted[src.name] = read_journal_both(str(layout.ledger(src.name)))
        except ConfigError:
            counted[src.name] = ({}, {})
    for row in plan["datasets"]:
        name, add = row["dataset"], int(row["add_samples"])
        r = rooms.get(name)
        if add <= 0 or r is None:
            continue
        rate = r["passed"] / r["read"] if r["read"] else 1.0
        datasets[name] = {"max_rows": min(r["rows"], r["read"] + math.ceil(add / max(rate, 1e-9)))}
        shares = {s.name: costs.get((s.name, name), 0.0) for s in api if (s.name, name) in costs}
        total = sum(shares.values())
        for src in (s for s in api if s.name in shares):
            part = row["add_usd"] * (shares[src.name] / total if total else 1 / len(shares))
            spent_tokens, spent_usd = counted[src.name]
            base = max(float(spent_usd.get(name, 0.0)), shares[src.name])
            ask = asks.get((src.name, name), 0.0)
            ask = ask if math.isfinite(ask) else 0.0
            room_usd = part * CAP_HEADROOM + ask
            caps.setdefault(src.name, {}).setdefault("budgets_usd", {})[name] = round(base + room_usd, 12)
            if src.token_budget(name) is not None:  # a finite token cap: raised by the same share, in tokens
                had = tokens.get((src.name, name), 0)
                per_usd = had / shares[src.name] if shares[src.name] > 0 else None
                more = part * per_usd if per_usd is not None else add * had / max(1, r["passed"])
                used = max(int(spent_tokens.get(name, 0)), had)
                reserve = (src.sampling or cfg.sampling).max_tokens
                caps[src.name].setdefault("budgets", {})[name] = max(int(src.token_budget(name)),
                                                                     used + math.ceil(more * CAP_HEADROOM) + reserve)
    out: dict[str, Any] = {"datasets": datasets}
    if caps:
        out["sources"] = {s: {k: c[k] for k in ("budgets_usd", "budgets") if k in c} for s, c in sorted(caps.items())}
    return out


def request_asks(cfg: RunConfig, layout: RunLayout) -> dict[tuple[str, str], float]:
    """(API source, dataset) -> the dollars one more request reserves ahead, reckoned as the source does
    (``usd_ask``: its configured prices, else the dearest price per token its samples were billed at) for the
    dataset's longest prompt so far."""
    from pipeline.generate.sources.http.engine import prompt_tokens, usd_ask
    from pipeline.generate.sources.registry import spending_sources

    api = {s.name: s for s in spending_sources(cfg.sources)}
    rows, _ = read_samples(layout.samples, ["sample_id", "dataset", "source", "cost", "billed_completion_tokens",
                                            "prompt_ids"]) if layout.samples.is_dir() else ([], 0)
    bounds: dict[str, list[float]] = {}
    longest: dict[tuple[str, str], int] = {}
    for r in rows:
        src = str(r.get("source") or "")
        if src not in api:
            continue
        n = len(r["prompt_ids"]) if r.get("prompt_ids") is not None else 0
        key = (src, str(r["dataset"]))
        longest[key] = max(longest.get(key, 0), prompt_tokens(r))  # as the source bounds it
        b = bounds.setdefault(src, [0.0, 0.0])
        cost, billed = float(r.get("cost") or 0.0), int(r.get("billed_completion_tokens") or 0)
        if math.isfinite(cost) and cost > 0:
            if n > 0:
                b[0] = max(b[0], cost / n)
            if billed > 0:
                b[1] = max(b[1], cost / billed)
    return {(src, ds): usd_ask(n, (api[src].sampling or cfg.sampling).max_tokens, api[src].prices,
                               bounds.get(src, [0.0, 0.0])) for (src, ds), n in longest.items()}


def buyables(value: Mapping[str, Any], mix: Mapping[str, float] | None,
             rooms: Mapping[str, Mapping[str, int]], bills: Mapping[str, Mapping[str, Any]] | None = None
             ) -> tuple[list[Buyable], dict[str, float], float, dict[str, str]]:
    """(what can be bought, the mix, the full drafter's acceptance on it, datasets without a curve and why)
    from value.json; ``ValueRefused`` for a report of another shape or nothing to plan on. A sample's price is
    ``bills``' (``value.dataset_bills`` of the folder now: every dollar billed for the dataset, quarantined rows
    included, over its samples that reach training) where it has one, else value.json's; the curves are held
    under value.json's ``ceiling`` (k + 1)."""
    again = "run `python -m pipeline value` on this config again"
    try:
        measured = [r for r in value["arms"] if isinstance(r, dict) and isinstance(r.get("heldout"), dict)
                    and r["heldout"].get("acceptance_length") is not None]
        known = sorted({name for r in measured for name in by_dataset(r["heldout"])})
        chosen = dict(value.get("mix") or {})
        if mix:
            normal = normalise_mix(mix, known)
            if isinstance(normal, str):
                raise ValueRefused(f"--mix: {normal}")
            chosen = normal
        full = [f for f in (mix_figure(r["heldout"], chosen) for r in measured if r["arm"]["dataset"] is None) if f]
        if not full:
            raise ValueRefused(f"the full drafter has no held-out figure on this mix: {again}")
        now = sum(f[0] for f in full) / len(full)
        ceiling = value.get("ceiling")
        ceiling = float(ceiling) if isinstance(ceiling, int | float) and math.isfinite(ceiling) else None
        buys, no_curve = [], {}
        for name, d in sorted(value["datasets"].items()):
            points = dataset_points(measured, name, chosen) if mix else list(d["points"])
            curve = dataset_curves(points, ceiling)["usd"] if mix else d["curves"]["usd"]
            if not isinstance(curve, dict):
                no_curve[name] = str(curve)
                continue
            billed = ((bills or {}).get(name) or {}).get("usd_per_sample")
            price = float(billed) if isinstance(billed, int | float) and billed > 0 else float(d["usd_per_sample"])
            spent = float(d["spent_usd"])
            per_trained = float(d.get("usd_per_training_sample", d["usd_per_sample"]))
            c = Curve.from_dict(curve)
            if c.ceiling is None and ceiling is not None:
                c = replace(c, ceiling=ceiling)
            if not all(math.isfinite(v) for v in (price, spent, per_trained, c.a0, c.gain, c.half)):
                raise ValueError(f"dataset {name}: a number that is not finite")
            r = rooms.get(name)
            buys.append(Buyable(name, price, spent, None if r is None else r["samples_left"], c,
                                mix_draws(points, ceiling=ceiling), per_trained))
    except ValueRefused:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueRefused(f"value.json does not have the shape this version reads ({type(e).__name__}: {e}): "
                           f"{again}") from None
    if not buys:
        reasons = "; ".join(f"{k}: {v}" for k, v in no_curve.items())
        raise ValueRefused(f"no dataset has a fitted curve ({reasons or 'no dataset was cut'})")
    return buys, chosen, now, no_curve


def run_fragment(cfg: RunConfig, layout: RunLayout, plan: Mapping[str, Any],
                 rooms: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """``fragment`` for a plan over this run's folder: its samples' dollars and tokens per (source, dataset)
    and the reservation of one more request, read from the folder."""
    costs: Counter = Counter()
    tokens: Counter = Counter()
    for s in sample_costs(layout, cfg):
        costs[s["source"], s["dataset"]] += s["usd"]
        tokens[s["source"], s["dataset"]] += s["tokens"]
    return fragment(cfg, layout, plan, rooms, costs, tokens, request_asks(cfg, layout))


def steps_caution(value_steps: Any, training_steps: int | None) -> str | None:
    """Why the curves may misread this config's drafter, or None: value drafters trained for another number of
    steps than the drafter the plan buys samples for (in the value bench, 150-step value drafters pointed the
    plan the wrong way for 500-step drafters, and 500-step ones the right way)."""
    if training_steps is None or not isinstance(value_steps, int) or isinstance(value_steps, bool) \
            or value_steps == training_steps:
        return None
    return (f"the value drafters trained {value_steps} steps and this config's drafter trains {training_steps}: "
            "the curves measure what samples teach a drafter of another length. For curves of this drafter, run "
            f"`python -m pipeline value` again with --steps {training_steps}")


def run_plan(cfg: RunConfig, budget_usd: float, mix: Mapping[str, float] | None = None) -> tuple[dict[str, Any],
                                                                                                  list[str]]:
    """The plan (also written to ``value/plan.json``) and its console lines. ``PlanRefused`` or
    ``ValueRefused`` when it cannot be made."""
    layout = RunLayout(cfg.output_dir)
    value = read_value(layout)
    rooms = room(cfg, layout)
    buys, chosen, now, no_curve = buyables(value, mix, rooms, dataset_bills(cfg, layout))
    try:
        train_share = 1.0 - float(value["heldout_fraction"])
    except (KeyError, TypeError, ValueError):
        raise ValueRefused("value.json has no held-out fraction: run `python -m pipeline value` again") from None
    plan = make_plan(buys, budget_usd, train_share, now)
    caution = steps_caution(value.get("steps"), cfg.training.steps if cfg.training is not None else None)
    plan |= {"mix": chosen, "no_curve": no_curve, "fragment": run_fragment(cfg, layout, plan, rooms),
             "cautions": [caution] if caution else []}
    lines = plan_lines(plan) + [f"[plan]   no curve for {k}: {v}" for k, v in no_curve.items()]
    lines += [f"[plan] ! {c}" for c in plan["cautions"]]
    if plan["fragment"]["datasets"]:
        lines.append(f"[plan] written to {layout.plan}; set these keys on the config's entries of the same name:")
        lines += ["    " + ln for ln in yaml.safe_dump(plan["fragment"], sort_keys=False).splitlines()]
    plan["lines"] = lines
    atomic_write_json(layout.plan, plan)
    refresh_report_html(layout)
    return plan, lines
