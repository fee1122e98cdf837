"""``python -m pipeline value CONFIG``: what each dataset's samples bought, measured on held-out data.

It reads a finished (or paused) run's folder: its passed samples, their cost (pipeline.report.costs), and
their hidden states: the run's own shards in ``shards`` mode, else one extraction into ``value/hidden/``. It
then trains the value arms (pipeline.value.arms: the full drafter, and each dataset cut to nested fractions
with the others whole), each a Ray task with the training's resources, all on the same steps, and measures
each on the run's held-out samples per dataset. Per dataset it fits held-out acceptance on the serving mix
against the dollars (and tokens) of that dataset's training samples (pipeline.value.curves) and writes it all
to ``value/value.json``, which ``plan`` reads. Resumable: an arm with a result for the same settings is kept.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.base.config import ConfigError
from pipeline.base.console import Console, duration
from pipeline.base.layout import RunLayout, atomic_write_json
from pipeline.base.records import read_rows, read_samples
from pipeline.base.run_lock import RunLock
from pipeline.report.costs import COST_COLUMNS, engine_prices, sample_usd
from pipeline.report.html import refresh_report_html
from pipeline.run.config import RunConfig
from pipeline.value.arms import (
    DEFAULT_FRACTIONS,
    Arm,
    arm_settings,
    arm_spend,
    data_digest,
    read_result,
    value_arms,
)
from pipeline.value.curves import Curve
from pipeline.value.points import acceptance_ceiling, dataset_curves, dataset_points, heldout_mix, mix_figure

VALUE_FORMAT = 1
log = logging.getLogger("pipeline")


class ValueRefused(ConfigError):
    """The folder or the config cannot give value curves; the message says why."""


@dataclass(frozen=True)
class ValueOptions:
    """Which arms: the datasets cut (default: every one with samples), the fractions each is cut to, the seeds,
    and the steps of every arm."""

    datasets: tuple[str, ...] = ()
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    seeds: tuple[int, ...] = (0,)
    steps: int | None = None  # None: the training config's steps


def run_value(cfg: RunConfig, opts: ValueOptions, console: Console | None = None) -> dict[str, Any]:
    """Train and measure the arms, fit the curves, write ``value/value.json`` and return it. Holds the folder's
    run lock: a run still writing samples would change what the arms train on."""
    from pipeline.base.logs import adopt_transformers_logging
    from pipeline.run.job import lock_timing, run_logs

    layout = RunLayout(cfg.output_dir)
    console = console or Console()
    with RunLock.for_folder(layout.root, **lock_timing()), run_logs(layout, console):
        adopt_transformers_logging()  # every arm trains
        return _value(cfg, layout, opts, console)


def sample_costs(layout: RunLayout, cfg: RunConfig) -> list[dict[str, Any]]:
    """Every passed sample once: id, dataset, source, dollars (billed plus priced engine time), output tokens."""
    rows, _ = read_samples(layout.samples, COST_COLUMNS)
    prices = engine_prices(cfg.sources)
    return [{"sample_id": str(r["sample_id"]), "dataset": str(r["dataset"]), "source": str(r["source"]),
             "usd": sample_usd(r, prices), "tokens": len(r["output_ids"]) if r["output_ids"] is not None else 0}
            for r in rows]


def dataset_prices(row_usd: Mapping[tuple[str, str], float], counted_usd: Mapping[tuple[str, str], float],
                   usable: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """Per dataset, what a sample that reaches training costs: every dollar billed for the dataset over all
    attempts, quarantined rows included (``row_usd``: (source, dataset) -> dollars in its sample and quarantine
    rows; ``counted_usd``: the same as the source's ledger and response journals counted them, which also
    hold bills whose row was never written), over its samples that passed generation and were not quarantined
    at extraction (``usable``). Per (source, dataset) the larger count holds. A pass rate of 50% doubles the
    price: the plan buys the rows that fail with the ones that pass."""
    billed: dict[str, float] = {}
    for key in set(row_usd) | set(counted_usd):
        billed[key[1]] = billed.get(key[1], 0.0) + max(row_usd.get(key, 0.0), counted_usd.get(key, 0.0))
    return {d: {"billed_usd": round(billed.get(d, 0.0), 9), "usable_samples": int(usable.get(d, 0)),
                "usd_per_sample": billed.get(d, 0.0) / usable[d] if usable.get(d) else None}
            for d in sorted(set(billed) | set(usable))}


def dataset_bills(cfg: RunConfig, layout: RunLayout) -> dict[str, dict[str, Any]]:
    """``dataset_prices`` of the run's folder: the dollars in its sample rows and in its quarantine rows (the
    sample as far as it got, billed before validation failed it), what each API source's ledger journal and
    response journal counted, and per dataset its samples not quarantined at extraction."""
    from pipeline.generate.ledger import read_journal_both
    from pipeline.generate.sources.http.totals import cost_by_dataset
    from pipeline.generate.sources.registry import spending_sources

    prices = engine_prices(cfg.sources)
    row_usd: dict[tuple[str, str], float] = {}
    passed: dict[str, set[str]] = {}
    for s in (sample_costs(layout, cfg) if layout.samples.is_dir() else []):
        row_usd[s["source"], s["dataset"]] = row_usd.get((s["source"], s["dataset"]), 0.0) + s["usd"]
        passed.setdefault(s["dataset"], set()).add(s["sample_id"])
    cols = ["sample_id", "dataset", "stage", "source", "detail"]
    seen: set[str] = set()
    for r in (read_rows(layout.quarantine, cols) if layout.quarantine.is_dir() else []):
        sid, name = str(r["sample_id"]), str(r["dataset"])
        if sid in passed.get(name, set()):
            if r["stage"] == "extract":
                passed[name].discard(sid)  # its bill is in its sample row; it never trains
            continue
        if sid in seen:
            continue
        seen.add(sid)
        try:
            detail = json.loads(r["detail"] or "{}")
        except ValueError:
            detail = {}
        detail = detail if isinstance(detail, dict) else {}
        usd = sample_usd({"source": r["source"], "cost": detail.get("cost"), "engine_s": detail.get("engine_s")},
                         prices)
        if usd:
            row_usd[str(r["source"] or ""), name] = row_usd.get((str(r["source"] or ""), name), 0.0) + usd
    counted: dict[tuple[str, str], float] = {}
    for src in spending_sources(cfg.sources):
        _, ledger_usd = read_journal_both(str(layout.ledger(src.name)))
        journal = cost_by_dataset(layout.responses, src.name) if layout.responses.is_dir() else {}
        for name in set(ledger_usd) | set(journal):
            v = max(float(ledger_usd.get(name, 0.0)), float(journal.get(name, 0.0)))
            if math.isfinite(v):
                counted[src.name, name] = v
    return dataset_prices(row_usd, counted, {d: len(ids) for d, ids in passed.items()})


def _value(cfg: RunConfig, layout: RunLayout, opts: ValueOptions, console: Console) -> dict[str, Any]:
    from pipeline.hidden.handoff import HANDOFFS, Handoff, placement_groups_released
    from pipeline.hidden.shards import completed_sample_ids, load_index
    from pipeline.run.job import init_ray
    from training.config import DraftTrainConfig, resolve_aux_layer_ids
    from training.heldout import is_held_out
    from training.target import read_target_config

    t0 = time.perf_counter()
    tcfg = cfg.training or DraftTrainConfig()
    if not tcfg.heldout_fraction:
        raise ValueRefused("the value curves are measured on held-out samples: set training.heldout_fraction > 0")
    samples = sample_costs(layout, cfg) if layout.samples.is_dir() else []
    if not samples:
        raise ValueRefused(f"no passed samples in {layout.samples}: run the pipeline first")
    steps = opts.steps or tcfg.steps
    have = sorted({s["dataset"] for s in samples})
    names = list(opts.datasets) or have
    if missing := sorted(set(names) - set(have)):
        raise ValueRefused(f"no passed samples of {', '.join(missing)} (datasets with samples: {', '.join(have)})")
    init_ray(cfg, state_api=True)  # an extraction and trainings whatever the config's training says
    hidden = layout.hidden if HANDOFFS[cfg.extraction.mode].keeps_shards else layout.value_hidden
    target_cfg = read_target_config(cfg.model.path)
    aux_ids = ((load_index(hidden).get("meta") or {}).get("aux_layer_ids") or cfg.extraction.aux_layer_ids
               or resolve_aux_layer_ids(tcfg, target_cfg["num_hidden_layers"]))
    t_x = time.perf_counter()

    def extract_line(final: bool) -> str:
        if not final:
            return f"[value] hidden states of the samples into {hidden} (resumed where shards exist)"
        return (f"[value] hidden states of {len(completed_sample_ids(hidden))} samples in {hidden}, "
                f"{duration(time.perf_counter() - t_x)}")

    with placement_groups_released(), console.phase(extract_line):
        # its own extraction statistics: the run's report sums the ones in OUTPUT/extract_stats/
        Handoff(cfg, layout, aux_ids, tcfg.heldout_fraction).write_shards(hidden, stats_dir=layout.value_stats)
    in_shards = completed_sample_ids(hidden)
    samples = [s for s in samples if s["sample_id"] in in_shards]  # an extraction's quarantine trains nothing
    datasets = {s["sample_id"]: s["dataset"] for s in samples}
    training = [s for s in samples if not is_held_out(s["sample_id"], tcfg.heldout_fraction)]
    held = [s["sample_id"] for s in samples if is_held_out(s["sample_id"], tcfg.heldout_fraction)]
    if not held:
        raise ValueRefused(f"none of the {len(samples)} samples is held out at training.heldout_fraction "
                           f"{tcfg.heldout_fraction:g}: raise it so the drafters can be measured")
    train_cfg = tcfg.model_copy(update={"steps": steps, "aux_layer_ids": list(aux_ids)}).model_dump(mode="json")
    arms = value_arms(names, opts.fractions, opts.seeds)
    meta = load_index(hidden).get("meta") or {}
    results = train_arms(cfg, layout, arms, train_cfg, str(hidden), datasets, training, held, meta, console)
    out = value_report(results, training, steps, opts, tcfg.heldout_fraction, bills=dataset_bills(cfg, layout),
                       ceiling=float(tcfg.eval_k + 1))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write_json(layout.value_report, out)
    refresh_report_html(layout)
    for line in value_lines(out):
        console.line(line)
    return out


def train_arms(cfg: RunConfig, layout: RunLayout, arms: Sequence[Arm], train_cfg: dict[str, Any], hidden: str,
               datasets: Mapping[str, str], training: Sequence[Mapping[str, Any]], held: Sequence[str],
               meta: Mapping[str, Any], console: Console) -> list[dict[str, Any]]:
    """Each arm's result, in ``arms`` order: read back where one was made with the same settings and data, else
    trained as a Ray task (one drafter per task, the training's resources each). An arm that keeps no training
    sample is not trained: its result says so and gives no point. An arm whose task fails is an ``error``
    result (the others go on; a re-run trains it again from its checkpoints)."""
    import ray

    from pipeline.hidden.handoff import sample_labels
    from pipeline.value.arms import train_arm

    results: dict[str, dict[str, Any]] = {}
    todo = []
    for arm in arms:
        spend = arm_spend(arm, training)
        kept = sum(int(v["samples"]) for v in spend.values())
        digest = data_digest((str(s["sample_id"]) for s in training
                              if arm.keeps(str(s["sample_id"]), str(s["dataset"]))), held, meta)
        res = read_result(layout.value_arm(arm.name), arm_settings(arm, train_cfg, digest))
        if res is not None:
            results[arm.name] = res | {"spend": spend, "train_samples": kept}
        elif not kept:
            results[arm.name] = {"arm": arm.to_dict(), "heldout": None, "skipped": "no training samples",
                                 "spend": spend, "train_samples": 0}
        else:
            todo.append((arm, spend, kept, digest))
    if todo:
        labels = sample_labels(layout, list(datasets))
        refs = {"datasets": ray.put(dict(datasets)), "labels": ray.put(labels)}
        per_worker = dict(train_cfg["resources_per_worker"])
        cpus = float(per_worker.pop("CPU", 1.0))
        gpus = float(per_worker.pop("GPU", 1.0 if train_cfg["use_gpu"] else 0.0))
        task = ray.remote(train_arm).options(num_cpus=cpus, num_gpus=gpus, resources=per_worker or None)
        pending = {task.remote(arm, train_cfg=train_cfg, target_dir=cfg.model.path, hidden_dir=hidden,
                               arm_dir=str(layout.value_arm(arm.name)), datasets=refs["datasets"],
                               labels=refs["labels"], heldout_fraction=train_cfg["heldout_fraction"],
                               heldout_max=train_cfg["heldout_max_samples"], data=digest): (arm, spend, kept)
                   for arm, spend, kept, digest in todo}
        t0, done = time.perf_counter(), []

        def line(final: bool) -> str:
            last = f"; last {done[-1]}" if done else ""
            return (f"[value] {len(done)}/{len(todo)} drafters trained ({len(arms) - len(todo)} kept from before, "
                    f"{train_cfg['steps']} steps each){last}, {duration(time.perf_counter() - t0)}")

        with console.phase(line, announce=True):
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                arm, spend, kept = pending.pop(ready[0])
                try:
                    res = ray.get(ready[0])
                except (ray.exceptions.RayError, OSError, ValueError, RuntimeError) as e:
                    log.warning("value drafter %s failed", arm.name, exc_info=True)
                    res = {"arm": arm.to_dict(), "heldout": None,
                           "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e) else ''}"}
                results[arm.name] = res | {"spend": spend, "train_samples": kept}
                fig = (res.get("heldout") or {}).get("acceptance_length")
                done.append(f"{arm.name} {fig:.3f}" if isinstance(fig, int | float) else arm.name)
    return [results[a.name] for a in arms]


def value_report(results: Sequence[Mapping[str, Any]], training: Sequence[Mapping[str, Any]], steps: int,
                 opts: ValueOptions, heldout_fraction: float, mix: Mapping[str, float] | None = None,
                 bills: Mapping[str, Mapping[str, Any]] | None = None, ceiling: float | None = None
                 ) -> dict[str, Any]:
    """value.json: the arms' results, and per dataset its points and fitted curves on ``mix`` (default: the
    held-out mix), held under ``ceiling`` (k + 1; default: the arms' held-out k + 1), with what its samples
    cost. ``usd_per_sample`` is the plan's price (``bills``: ``dataset_prices``, every dollar billed for the
    dataset over its samples that reach training); ``usd_per_training_sample`` is the dollars the curve counts
    per training sample (its own row's bill). Without ``bills`` both are the latter."""
    measured = [r for r in results if (r.get("heldout") or {}).get("acceptance_length") is not None]
    mix = dict(mix) if mix else heldout_mix(measured)
    ceiling = ceiling if ceiling is not None else acceptance_ceiling(measured)
    per: dict[str, dict[str, Any]] = {}
    cut = {str(r["arm"]["dataset"]) for r in results if r["arm"]["dataset"] is not None}
    for name in sorted(cut):
        own = [s for s in training if s["dataset"] == name]
        usd = sum(float(s["usd"]) for s in own)
        points = dataset_points(measured, name, mix)
        curves = dataset_curves(points, ceiling)
        if not usd:  # every point at $0: the dollar curve is not a curve
            curves["usd"] = curves["own_usd"] = ("its samples have no price (an API's bill, or an engine source's "
                                                 "gpu_hour_usd)")
        per_trained = usd / len(own) if own else 0.0
        bill = (bills or {}).get(name) or {}
        price = bill.get("usd_per_sample")
        per[name] = {"train_samples": len(own), "spent_usd": usd,
                     "tokens": sum(int(s["tokens"]) for s in own),
                     "usd_per_sample": price if isinstance(price, int | float) and price > 0 else per_trained,
                     "usd_per_training_sample": per_trained, "billed_usd": bill.get("billed_usd"),
                     "usable_samples": bill.get("usable_samples"),
                     "points": points, "curves": curves, "fit_line": fit_line(curves["usd"], points)}
    full = [mix_figure(r["heldout"], mix) for r in measured if r["arm"]["dataset"] is None]
    full = [f for f in full if f is not None]
    return {"format": VALUE_FORMAT, "steps": steps, "datasets_cut": sorted(cut), "fractions": list(opts.fractions),
            "seeds": list(opts.seeds), "ceiling": ceiling,
            "heldout_fraction": heldout_fraction, "mix": mix,
            "full_acceptance": round(sum(f[0] for f in full) / len(full), 4) if full else None,
            "datasets": per, "arms": list(results),
            "failed": [r["arm"]["name"] for r in results if r.get("error")]}


def fit_line(curve: Mapping[str, Any] | str, points: Sequence[Mapping[str, Any]], n: int = 40) -> list[list[float]]:
    """The fitted curve drawn from no spend to the largest measured one (report.html draws it as it is)."""
    if not isinstance(curve, Mapping) or not points:
        return []
    c, top = Curve.from_dict(dict(curve)), max(float(p["usd"]) for p in points)
    return [[round(top * i / n, 10), round(c(top * i / n), 6)] for i in range(n + 1)]


def value_lines(report: Mapping[str, Any]) -> list[str]:
    """The console's summary: per dataset, what its samples cost and what the mix loses without them."""
    now = report.get("full_acceptance")
    mix = ", ".join(f"{k} {v:.0%}" for k, v in report["mix"].items())
    lines = [f"[value] {len(report['arms'])} drafters, {report['steps']} steps each; held-out acceptance on the "
             f"mix ({mix}) with every dataset: {now:.3f}" if now is not None else
             "[value] the full drafter has no held-out figure"]
    for name, d in report["datasets"].items():
        zero = next((p for p in d["points"] if p["fraction"] == 0.0), None)
        without = f", without them {zero['acceptance']:.3f}" if zero else ""
        curve = d["curves"]["usd"]
        if isinstance(curve, Mapping):
            c, s = Curve.from_dict(dict(curve)), d["spent_usd"]
            more = f"10% more of its samples {c(1.1 * s) - c(s):+.4f}"
            if c.measured:
                fit = f"; curve: {c.gain:+.3f} at most, half of it by ${c.half:.4g}; {more}"
            elif not c.saturated:
                fit = (f"; curve: its points still rise in a straight line, so the most its samples can add and the "
                       f"spend that buys half of it are unmeasured; {more}")
            else:
                fit = (f"; curve: held at the ceiling of {c.ceiling:g} (k + 1), so the most its samples can add and "
                       f"the spend that buys half of it are unmeasured; {more}")
        else:
            fit = f"; no curve: {curve}"
        lines.append(f"[value]   {name}: {d['train_samples']} training samples, ${d['spent_usd']:.4g}{without}{fit}")
    for r in report["arms"]:
        if r.get("error"):
            lines.append(f"[value] ! {r['arm']['name']} failed ({r['error']}); a re-run trains it again")
    return lines
