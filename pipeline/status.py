"""Where a run stands, read from its output folder: no Ray, no engine, safe while the job runs.

    python -m pipeline status CONFIG [--json]

For a job that is running, was killed, or finished: per dataset, how many prompts passed, were
quarantined (and at which stage) or are still to do (a re-run does exactly those); who generated
the samples; tokens committed against each API budget (from the ledger journal, which counts
requests in flight when the job died) and what was billed; whether the folder's manifest still
matches the config (a re-run would refuse otherwise); hidden-state shards; training progress and
the last report's held-out acceptance.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.datasets import load_dataset
from pipeline.records import read_rows


def _last_json_line(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:  # the job died mid-line: the line before is whole
        return json.loads(lines[-2]) if len(lines) > 1 else None


def dataset_status(cfg: RunConfig, samples: list[dict[str, Any]], quarantine: list[dict[str, Any]]) -> dict:
    passed: dict[str, set[str]] = {}
    for r in samples:
        passed.setdefault(r["dataset"], set()).add(r["sample_id"])
    held: dict[str, dict[str, str]] = {}  # dataset -> sample id -> stage (quarantined, never passed)
    for r in quarantine:
        if r["sample_id"] not in passed.get(r["dataset"], set()):
            held.setdefault(r["dataset"], {}).setdefault(r["sample_id"], r["stage"])
    out = {}
    for d in cfg.datasets:
        rows, bad = load_dataset(d)
        total = len(rows) + len(bad)
        p, q = len(passed.get(d.name, ())), held.get(d.name, {})
        out[d.name] = {"rows": total, "passed": p, "quarantined": len(q),
                       "quarantined_by_stage": dict(Counter(q.values())), "to_do": max(total - p - len(q), 0)}
    return out


def spend_status(cfg: RunConfig, out: Path, samples: list[dict[str, Any]]) -> dict[str, Any]:
    from pipeline.ledger import read_journal

    spend = {}
    for src in cfg.sources:
        if src.kind != "openrouter":
            continue
        billed: Counter = Counter()
        cost = 0.0
        for r in samples:
            if r["source"] == src.name:
                billed[r["dataset"]] += max(int(r["billed_completion_tokens"] or 0), 0)
                cost += float(r["cost"] or 0.0)
        committed = read_journal(str(out / f"ledger-{src.name}.json"))
        datasets = sorted(set(billed) | set(committed) | set(src.budgets))
        spend[src.name] = {
            "cost_usd_in_samples": round(cost, 6),
            "datasets": {d: {"budget": src.budgets.get(d, src.default_budget), "committed": committed.get(d, 0),
                             "billed_in_samples": billed.get(d, 0)} for d in datasets},
        }
    return spend


def manifest_status(cfg: RunConfig, out: Path) -> dict[str, Any]:
    from pipeline.manifest import MANIFEST_FILE, differences, run_manifest

    path = out / MANIFEST_FILE
    if not path.exists():
        return {"present": False, "differences": []}
    if cfg.model.path and not Path(cfg.model.path).is_dir():
        return {"present": True, "differences": [], "skipped": f"model folder {cfg.model.path} is not on this machine"}
    return {"present": True, "differences": differences(json.loads(path.read_text()), run_manifest(cfg))}


def training_status(cfg: RunConfig, out: Path) -> dict[str, Any]:
    last = _last_json_line(out / "drafter" / "metrics.jsonl")
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    res: dict[str, Any] = {
        "steps": cfg.training.steps if cfg.training else None,
        "step": last.get("step") if last else 0,
        "last": {k: v for k, v in (last or {}).items() if k in ("loss", "acc_0", "tokens_per_s", "epoch")},
        "exported": (out / "drafter" / "export" / "config.json").exists(),
        "heldout": (report.get("training") or {}).get("heldout"),
    }
    index = out / "hidden" / "index.json"
    if index.exists():
        shards = json.loads(index.read_text()).get("shards", [])
        res["hidden_shards"] = {"files": len(shards), "samples": sum(int(e.get("samples", 0)) for e in shards)}
    return res


def collect_status(cfg: RunConfig) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    samples = read_rows(out / "samples", ["sample_id", "dataset", "source", "billed_completion_tokens", "cost"])
    quarantine = read_rows(out / "quarantine", ["sample_id", "dataset", "stage"])
    datasets = dataset_status(cfg, samples, quarantine)
    return {
        "output_dir": str(out),
        "totals": {k: sum(d[k] for d in datasets.values()) for k in ("rows", "passed", "quarantined", "to_do")},
        "datasets": datasets,
        "samples_by_source": dict(Counter(r["source"] for r in samples)),
        "duplicates_in_shards": len(samples) - len({r["sample_id"] for r in samples}),
        "spend": spend_status(cfg, out, samples),
        "manifest": manifest_status(cfg, out),
        "training": training_status(cfg, out),
    }


def is_finished(s: dict[str, Any]) -> bool:
    """Nothing left to do: every prompt passed or quarantined and, with training on, the drafter exported."""
    tr = s["training"]
    return s["totals"]["to_do"] == 0 and (not tr["steps"] or (tr["exported"] and tr["step"] >= tr["steps"]))


def format_status(s: dict[str, Any]) -> str:
    t = s["totals"]
    lines = [f"{s['output_dir']}: {t['passed']} passed, {t['quarantined']} quarantined, {t['to_do']} to do "
             f"of {t['rows']} prompts" + ("" if t["to_do"] else " (generation complete)")]
    for name, d in s["datasets"].items():
        stages = f" {d['quarantined_by_stage']}" if d["quarantined_by_stage"] else ""
        lines.append(f"  {name:<16} {d['passed']:>7} passed {d['quarantined']:>6} quarantined{stages} "
                     f"{d['to_do']:>7} to do / {d['rows']}")
    if s["samples_by_source"]:
        lines.append(f"  samples by source: {s['samples_by_source']}")
    if s["duplicates_in_shards"]:
        lines.append(f"  WARNING: {s['duplicates_in_shards']} duplicate sample ids in samples/")
    for name, sp in s["spend"].items():
        lines.append(f"  spend {name}: ${sp['cost_usd_in_samples']:.4f} billed in samples")
        for d, v in sp["datasets"].items():
            budget = "no cap" if v["budget"] is None else f"budget {v['budget']}"
            lines.append(f"    {d:<16} {v['committed']} tokens committed, {v['billed_in_samples']} billed in "
                         f"samples, {budget}")
    m = s["manifest"]
    if m["differences"]:
        lines.append("  manifest differs from the config (a re-run would refuse):")
        lines += [f"    {d}" for d in m["differences"]]
    elif m.get("skipped"):
        lines.append(f"  manifest not checked: {m['skipped']}")
    elif m["present"]:
        lines.append("  manifest matches the config")
    tr = s["training"]
    if "hidden_shards" in tr:
        lines.append(f"  hidden shards: {tr['hidden_shards']['files']} files, {tr['hidden_shards']['samples']} "
                     "samples")
    if tr["steps"]:
        last = ", ".join(f"{k} {v:.4g}" for k, v in tr["last"].items())
        lines.append(f"  training: step {tr['step']} of {tr['steps']}" + (f" ({last})" if last else "")
                     + (", exported" if tr["exported"] else ""))
    h = tr.get("heldout") or {}
    if h.get("acceptance_length") is not None:
        lines.append(f"  held-out acceptance length {h['acceptance_length']:.3f} at k={h['k']} on {h['samples']} "
                     "samples (last report)")
    lines.append("  finished" if is_finished(s) else "  not finished: re-run the same config to continue")
    return "\n".join(lines)
