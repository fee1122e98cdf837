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

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.base.layout import RunLayout, last_json_line
from pipeline.base.records import count_values, read_rows, read_sample_table
from pipeline.prompts.read import current_ids
from pipeline.report.costs import cost_lines, cost_table_of, engine_prices
from pipeline.report.summary import Accounting, account, aside_line, heldout_breakdown_lines
from pipeline.run.config import RunConfig


def _read_json(path: Path) -> tuple[Any, str | None]:
    """``(content, None)``; ``(None, None)`` when the file is absent; ``(None, why)`` when it cannot be
    read or parsed (e.g. cut short by a full disk or written by hand): status reports it, never raises."""
    if not path.exists():
        return None, None
    try:
        return json.loads(path.read_bytes()), None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"{path.name} is unreadable ({type(e).__name__}: {e})"


def dataset_status(cfg: RunConfig, acc: Accounting) -> dict:
    """Per configured dataset: rows its file gives now, of those passed generation, of those quarantined at
    extraction (never trained on), quarantined (by stage; an id that also passed counts as passed) and to do (a
    re-run does exactly those), by id (``summary.account``)."""
    out = {}
    for d in cfg.datasets:
        q = acc.held.get(d.name, {})
        out[d.name] = {"rows": acc.rows[d.name], "passed": acc.passed.get(d.name, 0),
                       "quarantined_at_extraction": acc.extracted_out.get(d.name, 0), "quarantined": len(q),
                       "quarantined_by_stage": dict(Counter(q.values())), "to_do": acc.to_do[d.name]}
    return out


def spend_status(cfg: RunConfig, out: Path, samples: pa.Table) -> dict[str, Any]:
    from pipeline.base.config import UnreadableFile
    from pipeline.generate.ledger import read_journal_both
    from pipeline.generate.sources.http.totals import journal_totals
    from pipeline.generate.sources.registry import spending_sources

    spend = {}
    written: set[str] | None = None
    for src in spending_sources(cfg.sources):
        mine = samples.filter(pc.fill_null(pc.equal(samples.column("source"), src.name), False))
        tokens = pc.max_element_wise(pc.fill_null(mine.column("billed_completion_tokens"), 0), 0)
        per = pa.table({"dataset": mine.column("dataset"), "tokens": tokens}).group_by("dataset").aggregate(
            [("tokens", "sum")]).to_pylist()
        billed = Counter({g["dataset"]: g["tokens_sum"] for g in per})
        cost = float(pc.sum(pc.fill_null(mine.column("cost"), 0.0)).as_py() or 0.0)
        layout = RunLayout(out)
        ledger_error = None
        try:
            committed, committed_usd = read_journal_both(str(layout.ledger(src.name)))
        except UnreadableFile as e:  # said, with the rest of the folder's status (the next run refuses to start)
            committed, committed_usd, ledger_error = {}, {}, str(e)
        totals = journal_totals(layout.responses, src.name)  # one pass over the journal
        journaled = totals.billed
        if written is None:
            written = set(samples.column("sample_id").to_pylist())
        # paid for, not yet written (a killed attempt's): a re-run rebuilds these without paying again, or holds one
        # whose journal line does not read back (class journal)
        unwritten = Counter(dataset for sid, dataset in totals.responded.items() if sid not in written)
        datasets = sorted(set(billed) | set(committed) | set(committed_usd) | set(src.budgets)
                          | set(src.budgets_usd) | set(journaled))
        spend[src.name] = {
            "cost_usd_in_samples": round(cost, 6),
            **({"ledger_error": ledger_error} if ledger_error else {}),
            "journal_lines_naming_no_prompt": totals.nameless,
            "datasets": {d: {"budget": src.token_budget(d), "budget_usd": src.usd_budget(d),
                             "committed": None if ledger_error else committed.get(d, 0),  # None: unknown
                             "committed_usd": None if ledger_error else round(committed_usd.get(d, 0.0), 6),
                             "billed_in_samples": billed.get(d, 0), "billed_in_journal": journaled.get(d, 0),
                             "paid_responses_not_written": unwritten.get(d, 0),
                             "held_by_killed_requests": None if ledger_error else max(
                                 0, committed.get(d, 0) - max(billed.get(d, 0), journaled.get(d, 0)))}
                         for d in datasets},
        }
    return spend


def manifest_status(cfg: RunConfig, out: Path) -> dict[str, Any]:
    from pipeline.run.manifest import differences, run_manifest

    path = RunLayout(out).manifest
    if not path.exists():
        return {"present": False, "differences": []}
    if cfg.model.path and not Path(cfg.model.path).is_dir():
        return {"present": True, "differences": [], "skipped": f"model folder {cfg.model.path} is not on this machine"}
    old, error = _read_json(path)
    if error:
        return {"present": True, "differences": [], "skipped": error}
    return {"present": True, "differences": differences(old, run_manifest(cfg))}


def training_status(cfg: RunConfig, out: Path) -> dict[str, Any]:
    layout = RunLayout(out)
    last = last_json_line(layout.metrics) or {}
    report, report_error = _read_json(layout.report)
    if report is not None and not isinstance(report, dict):
        report, report_error = None, f"{layout.report.name} is unreadable (not a JSON object)"
    training = (report or {}).get("training")
    res: dict[str, Any] = {
        "steps": cfg.training.steps if cfg.training else None,
        "step": last.get("step") or 0,
        "last": {k: v for k, v in last.items()
                 if k in ("loss", "acc_0", "tokens_per_s", "epoch") and isinstance(v, int | float)},
        "exported": layout.export_config.exists(),
        "heldout": training.get("heldout") if isinstance(training, dict) else None,
    }
    if report_error:
        res["report_error"] = report_error
    if (shards := hidden_status(layout)) is not None:
        res["hidden_shards"] = shards
    return res


def _shards_on_disk(layout: RunLayout) -> dict[str, Any]:
    """The complete shards counted from the files, each sample once (only their id column is read)."""
    from pipeline.base.config import UnreadableFile
    from pipeline.hidden.shards import open_shard, shard_files

    files, ids = shard_files(layout.hidden), set()
    for f in files:
        try:
            ids.update(open_shard(f)[1].column("sample_id").to_pylist())
        except UnreadableFile as e:  # a shard cut short or not a shard: reported, never raised
            return {"error": str(e)}
    return {"files": len(files), "samples": len(ids)}


def hidden_status(layout: RunLayout) -> dict[str, Any] | None:
    """The hidden-state shards, each sample once: index.json's entries when they list exactly the complete shards
    on disk (a sample a killed extraction wrote twice is in a later shard's ``skip``), else the shards counted,
    since the index is rebuilt only when an extraction ends (a running or killed one's is stale or absent). Read
    only: ``shards.load_index`` would rewrite the index while the job runs."""
    from pipeline.hidden.shards import shard_files

    index, index_error = _read_json(layout.hidden_index)
    if index_error:
        return {"error": index_error}
    if not isinstance(index, dict):
        return _shards_on_disk(layout) if shard_files(layout.hidden) else None
    shards = index.get("shards")
    entries = [e for e in shards if isinstance(e, dict)] if isinstance(shards, list) else []
    counts = [e.get("samples") for e in entries]
    if shards is not None and (len(entries) != len(shards) or not all(type(c) is int and c >= 0 for c in counts)):
        return {"error": f"{layout.hidden_index.name} is unreadable (a shard entry without a sample count; the "
                         "next extraction rebuilds it from the shards)"}
    skips = [e.get("skip", []) for e in entries]
    listed = {(e.get("file"), e.get("bytes")) for e in entries
              if isinstance(e.get("file"), str) and type(e.get("bytes")) is int}  # other values: not a shard listed
    on_disk = {(f.name, f.stat().st_size) for f in shard_files(layout.hidden)}
    if len(listed) != len(entries) or listed != on_disk or not all(isinstance(s, list) for s in skips):
        return _shards_on_disk(layout)
    return {"files": len(entries), "samples": sum(c - len(s) for c, s in zip(counts, skips, strict=True))}


def collect_status(cfg: RunConfig) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    layout = RunLayout(out)
    # one Arrow table, not a Python row per sample: status of a 200,000-sample folder in a few seconds
    samples, dropped = read_sample_table(layout.samples, ["sample_id", "dataset", "source",
                                                          "billed_completion_tokens", "cost", "engine_s"])
    # each file's ids as it is now (its id index, else the file parsed): only their rows are counted
    current = {d.name: current_ids(d, layout) for d in cfg.datasets}
    acc = account(samples, read_rows(layout.quarantine, ["sample_id", "dataset", "stage"]), current)
    datasets = dataset_status(cfg, acc)
    return {
        "output_dir": str(out),
        "totals": {k: sum(d[k] for d in datasets.values()) for k in ("rows", "passed", "quarantined", "to_do")},
        # of ``passed`` (passed generation), those the extraction quarantined: never trained on (as in report.json)
        "quarantined_at_extraction": sum(d["quarantined_at_extraction"] for d in datasets.values()),
        "datasets": datasets,
        "not_in_current_files": acc.aside,
        "samples_by_source": count_values(samples.column("source")),
        "duplicates_in_shards": dropped,
        "spend": spend_status(cfg, out, samples),
        "costs": cost_table_of(samples, engine_prices(cfg.sources)),  # dollars and device-hours per dataset
        "manifest": manifest_status(cfg, out),
        "training": training_status(cfg, out),
    }


def is_finished(s: dict[str, Any]) -> bool:
    """Nothing left to do: every prompt passed or quarantined and, with training on, the drafter exported."""
    tr = s["training"]
    return s["totals"]["to_do"] == 0 and (not tr["steps"] or (tr["exported"] and tr["step"] >= tr["steps"]))


def _caps(v: dict[str, Any]) -> str:
    """A dataset's caps as the ledger holds them: tokens, dollars (with the dollars committed), or "no cap"."""
    caps = []
    if v["budget"] is not None:
        caps.append(f"cap {v['budget']} tokens")
    if v.get("budget_usd") is not None:
        usd = v.get("committed_usd", 0.0)  # None: the ledger does not read
        caps.append(f"${'?' if usd is None else f'{usd:.4f}'} committed of a ${v['budget_usd']:.4f} cap")
    elif v.get("committed_usd"):
        caps.append(f"${v['committed_usd']:.4f} committed")
    return ", ".join(caps) or "no cap"


def format_status(s: dict[str, Any]) -> str:
    t = s["totals"]
    lines = [f"{s['output_dir']}: {t['passed']} passed generation ({s['quarantined_at_extraction']} of them "
             f"quarantined at extraction, not trained on), {t['quarantined']} quarantined, {t['to_do']} to do "
             f"of {t['rows']} prompts" + ("" if t["to_do"] else " (generation complete)")]
    for name, d in s["datasets"].items():
        stages = f" {d['quarantined_by_stage']}" if d["quarantined_by_stage"] else ""
        lines.append(f"  {name:<16} {d['passed']:>7} passed generation ({d['quarantined_at_extraction']} "
                     f"quarantined at extraction) {d['quarantined']:>6} quarantined{stages} "
                     f"{d['to_do']:>7} to do / {d['rows']}")
    if aside := aside_line(s["not_in_current_files"]):
        lines.append(f"  {aside}")
    if s["samples_by_source"]:
        lines.append(f"  samples by source: {s['samples_by_source']}")
    if s["duplicates_in_shards"]:
        lines.append(f"  WARNING: {s['duplicates_in_shards']} extra copies of sample ids in samples/ (each is "
                     "counted and trained on once)")
    for name, sp in s["spend"].items():
        lines.append(f"  spend {name}: ${sp['cost_usd_in_samples']:.4f} billed in samples")
        if sp.get("ledger_error"):
            lines.append(f"    WARNING: {sp['ledger_error']} (until then what it committed is unknown, and a run "
                         "refuses to start)")
        if sp.get("journal_lines_naming_no_prompt"):
            lines.append(f"    WARNING: {sp['journal_lines_naming_no_prompt']} lines of its response journal do not "
                         "read and name no prompt: if they were paid responses, a re-run asks (and pays for) those "
                         "prompts again (OUTPUT/logs/ names each file and byte)")
        for d, v in sp["datasets"].items():
            committed = "?" if v["committed"] is None else v["committed"]
            lines.append(f"    {d:<16} {committed} tokens committed, {v['billed_in_samples']} billed in "
                         f"samples, {v['billed_in_journal']} billed in the response journal, {_caps(v)}")
            if v["paid_responses_not_written"]:
                lines.append(f"    {'':<16} {v['paid_responses_not_written']} paid responses not yet written "
                             "(a re-run uses them without paying again; one whose journal line does not read "
                             "back is held, class journal, never paid twice)")
            if v["held_by_killed_requests"]:
                lines.append(f"    {'':<16} {v['held_by_killed_requests']} tokens held by requests in flight when "
                             "an attempt was killed (they may have been billed)")
    lines += cost_lines(s.get("costs"))
    m = s["manifest"]
    if m["differences"]:
        lines.append("  manifest differs from the config (a re-run would refuse):")
        lines += [f"    {d}" for d in m["differences"]]
    elif m.get("skipped"):
        lines.append(f"  manifest not checked: {m['skipped']}")
    elif m["present"]:
        lines.append("  manifest matches the config")
    tr = s["training"]
    hs = tr.get("hidden_shards")
    if hs and hs.get("error"):
        lines.append(f"  hidden shards: {hs['error']}")
    elif hs:
        lines.append(f"  hidden shards: {hs['files']} files, {hs['samples']} samples")
    if tr["steps"]:
        last = ", ".join(f"{k} {v:.4g}" for k, v in tr["last"].items())
        lines.append(f"  training: step {tr['step']} of {tr['steps']}" + (f" ({last})" if last else "")
                     + (", exported" if tr["exported"] else ""))
    if tr.get("report_error"):
        lines.append(f"  last report: {tr['report_error']}")
    h = tr.get("heldout") or {}
    if isinstance(h, dict) and isinstance(h.get("acceptance_length"), int | float):
        lines.append(f"  held-out acceptance length {h['acceptance_length']:.3f} at k={h.get('k')} on "
                     f"{h.get('samples')} samples (last report)")
        lines += heldout_breakdown_lines(h)
    lines.append("  finished" if is_finished(s) else "  not finished: re-run the same config to continue")
    return "\n".join(lines)
