"""The run report: figures folded from the rows as they stream out, then summed over the folder.

``Tally`` counts this attempt's rows as they leave the chain (the console's
generation line reads its ``snapshot``); ``summarize`` adds what the output folder holds over every
attempt; ``format_report`` is what the console shows at the end.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.base.config import ChecksConfig, DatasetConfig
from pipeline.base.console import GenerateSnapshot
from pipeline.base.flight import output_len, replayed
from pipeline.base.layout import RunLayout
from pipeline.base.records import count_values, read_rows, read_sample_table
from pipeline.checks.audit import AuditAccumulator, summary_lines
from pipeline.checks.validate import Verdict
from pipeline.report.costs import cost_lines, cost_table_of
from pipeline.report.throughput import record as record_throughput


class Timings:
    """Seconds per phase, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, t0: float) -> None:
        self.seconds[name] = round(time.perf_counter() - t0, 2)


def audit_for(datasets: list[DatasetConfig]) -> AuditAccumulator:
    """An audit that judges each dataset's samples by that dataset's own checks."""
    first = datasets[0].checks
    same = all(d.checks == first for d in datasets)
    return AuditAccumulator(first if same else ChecksConfig(), dataset_checks={d.name: d.checks for d in datasets})


class Tally:
    """Folds per-sample summaries as they stream out of the pipeline: counts, audit figures, spend.

    A response an API source replayed from its journal (``flight.replayed``: paid for in an earlier attempt) is
    a done row like any other, but counted apart (``replayed``), not in what this attempt generated (``served``,
    ``tokens``, ``cost``): the attempt's throughput and dollars are its own work only.

    ``progress`` keeps ``snapshot``, the figures the console's generation line shows (pipeline.base.console; read
    from its ticker thread, so it is replaced whole, never changed in place).
    """

    def __init__(self, total: int, audit: AuditAccumulator, *, estimated: bool = False) -> None:
        self.total = total
        self.estimated = estimated  # ``total`` is an upper bound until ``counted``
        self.status: Counter = Counter()
        self.audit = audit
        self.tokens = 0
        self.cost = 0.0
        self.t0 = time.perf_counter()
        self.snapshot = GenerateSnapshot(0, total, 0, 0, 0, 0, 0.0, 0.0, estimated)
        self.start_errors: dict[str, str] = {}  # source -> why its engine did not start
        self.engine_errors: dict[str, str] = {}  # source -> why its engine left prompts to do (the first reason)
        self.journal_errors: dict[str, str] = {}  # source -> a journaled response it could not read (the first)
        self.served: Counter = Counter()  # source -> samples it generated (this attempt)
        self.replayed: Counter = Counter()  # source -> samples it replayed from its journal (paid for before)
        self.replayed_tokens = 0
        self.replayed_cost = 0.0
        self.spilled: Counter = Counter()  # local source -> its prompts an overflow source took past the deadline
        self.left: Counter = Counter()  # (source, why) -> prompts left not generated (a re-run does them)
        self.requests: Counter = Counter()  # source -> requests sent for the rows (HTTP sources; retries included)
        self.asked: Counter = Counter()  # source -> rows it sent at least one request for
        self.series: list[dict[str, Any]] = []  # throughput snapshots over time (pipeline.report.throughput)
        self.duplicates = 0  # rows the writer found already written (a re-executed batch): not counted again
        self.unrouted: Counter = Counter()  # reason -> prompts no source may serve (fix the routing, re-run)

    @property
    def done(self) -> int:
        return sum(self.status.values())

    def add(self, row: dict[str, Any]) -> None:
        self.status[row["status"]] += 1
        generated = output_len(row)
        again = replayed(row)
        if again:
            self.replayed[row.get("source") or ""] += 1
            self.replayed_tokens += generated or 0
            self.replayed_cost += row.get("cost") or 0.0
            generated = None
        elif generated is not None:
            self.served[row.get("source") or ""] += 1
        if row.get("spilled_from"):
            self.spilled[row["spilled_from"]] += 1
        if row.get("attempts"):
            self.requests[row.get("source") or ""] += row["attempts"]
            self.asked[row.get("source") or ""] += 1
        if row["status"] == "not_generated":
            self.left[(row.get("source") or "", row.get("failure_class") or "transient")] += 1
            if row.get("failure_class") == "engine":
                self.engine_errors.setdefault(row.get("source") or "", row.get("reason") or "")
            if row.get("failure_class") == "journal":
                self.journal_errors.setdefault(row.get("source") or "", row.get("reason") or "")
            if row.get("failure_class") == "config" and not row.get("source"):  # chain.assign_sources: no source
                self.unrouted[row.get("reason") or ""] += 1
        self.tokens += generated or 0
        self.cost += 0.0 if again else row.get("cost") or 0.0
        if row.get("checks_ran"):
            details = json.loads(row["check_details"] or "{}")
            verdict = Verdict(failed={k: details.get(k, "") for k in row["checks_failed"]},
                              flagged={k: details.get(k, "") for k in row["checks_flagged"]},
                              ran=list(row["checks_ran"]))
            self.audit.add(row, verdict)

    def note_start_error(self, row: dict[str, Any]) -> None:
        """Remember a source whose engine failed to start, from any row it handed on or quarantined."""
        if row.get("start_error_source"):
            self.start_errors.setdefault(row["start_error_source"], row.get("start_error") or "")

    def counted(self, total: int) -> None:
        """The index pass's to-do count replaces the estimate the run started with."""
        self.total, self.estimated = total, False

    def progress(self, final: bool = False) -> None:
        now = time.perf_counter()
        record_throughput(self.series, now - self.t0, self.done, self.tokens, self.served, final=final)
        self.snapshot = GenerateSnapshot(self.done, self.total, self.status["ok"], self.status["quarantine"],
                                         self.status["not_generated"], self.tokens, self.cost, now - self.t0,
                                         self.estimated)


@dataclass(frozen=True)
class Accounting:
    """The folder's rows as the current config reads them. A sample or quarantine row counts only when the
    current files give its id (within ``max_rows``): a repaired row's old id, a row past a lowered ``max_rows`` or
    a removed dataset's stays on disk, set aside, and counted in neither conservation nor ``status``."""

    rows: dict[str, int]  # dataset -> rows its file gives now
    passed: dict[str, int]  # dataset -> of those, passed
    held: dict[str, dict[str, str]]  # dataset -> id quarantined and never passed -> its first stage
    quarantine: list[dict[str, Any]]  # the quarantine rows of those ids (an extract row of a passed sample too)
    aside: dict[str, int]  # {"samples": n, "quarantined": m}: ids on disk the files no longer give
    # dataset -> its passed ids quarantined at extraction (counted in ``passed``, never trained on)
    extracted_out: dict[str, int] = dataclass_field(default_factory=dict)

    @property
    def to_do(self) -> dict[str, int]:
        """dataset -> its rows neither passed nor quarantined: what a re-run does."""
        return {d: max(n - self.passed.get(d, 0) - len(self.held.get(d, {})), 0) for d, n in self.rows.items()}


def in_files(ids: pa.Array | pa.ChunkedArray, current: Mapping[str, pa.Array]) -> pa.ChunkedArray | pa.Array:
    """Per id, whether the current files give it (``current``: dataset -> ids, ``read.current_ids``): one hash
    lookup an id, no Python row."""
    every = pa.chunked_array(list(current.values()), pa.string()).combine_chunks()
    return pc.is_in(ids, value_set=every)


def account(samples: pa.Table, quarantine: list[dict[str, Any]], current: Mapping[str, pa.Array]) -> Accounting:
    """``Accounting`` of ``samples`` (one row per id: ``read_sample_table``, with ``sample_id`` and ``dataset``)
    and the quarantine rows (``sample_id``, ``dataset``, ``stage``) against ``current``. An id both quarantined
    and passed (quarantined at extraction) counts as passed generation (conservation is over generation), and
    in ``extracted_out`` too: it is never trained on."""
    ids = samples.column("sample_id")
    mine = in_files(ids, current)
    q_ids = pa.array([r["sample_id"] for r in quarantine], pa.string())
    q_passed = pc.is_in(q_ids, value_set=ids.combine_chunks()).to_pylist()
    q_mine = in_files(q_ids, current).to_pylist()
    held: dict[str, dict[str, str]] = {}
    out: dict[str, set[str]] = {}
    kept, aside = [], set()
    for r, was_passed, is_mine in zip(quarantine, q_passed, q_mine, strict=True):
        if not is_mine:
            if not was_passed:
                aside.add(r["sample_id"])
            continue
        kept.append(r)
        if not was_passed:
            held.setdefault(r["dataset"], {}).setdefault(r["sample_id"], r["stage"])
        elif r["stage"] == "extract":
            out.setdefault(r["dataset"], set()).add(r["sample_id"])
    n_mine = int(pc.sum(mine).as_py() or 0)
    return Accounting(rows={d: len(a) for d, a in current.items()},
                      passed=count_values(samples.filter(mine).column("dataset")), held=held, quarantine=kept,
                      aside={"samples": samples.num_rows - n_mine, "quarantined": len(aside)},
                      extracted_out={d: len(v) for d, v in sorted(out.items())})


def aside_line(aside: Mapping[str, int]) -> str | None:
    """What is set aside, in a line (None when nothing is): nothing on disk leaves the user's view unsaid."""
    if not any(aside.values()):
        return None
    return (f"not in the current files: {aside['samples']} samples, {aside['quarantined']} quarantined (kept in "
            "the folder, not counted: a row since edited, past max_rows or of a removed dataset; the samples are "
            "still trained on)")


def summarize(tally: Tally, counts: Counter, layout: RunLayout, current: Mapping[str, pa.Array],
              prices: Mapping[str, float | None] | None = None) -> dict[str, Any]:
    """Figures over everything written for this run (including earlier, resumed attempts). ``current``: each
    dataset's ids as its file gives them now (``read.current_ids``): the rows in, passed and quarantined are
    those ids' (``account``; the others set aside, counted in ``not_in_current_files``). ``prices``: dollars
    per device-hour of each engine source (``pipeline.report.costs.engine_prices``) for the spend per dataset."""
    # one Arrow table: the token ids of 200,000 samples are counted, never turned into Python lists
    samples, dropped = read_sample_table(layout.samples, ["sample_id", "dataset", "output_ids", "checks_flagged",
                                                          "source", "cost", "engine_s"])
    acc = account(samples, read_rows(layout.quarantine, ["sample_id", "dataset", "stage", "reason"]), current)
    quarantine = acc.quarantine
    # Extraction may quarantine a sample already written as passed: it stays counted in ``passed`` (passed
    # generation: conservation is over generation) and is counted again in ``quarantined_at_extraction`` (never
    # trained on; refreshed after the extraction by ``with_extraction_quarantine``). Flags, tokens and costs are
    # of every sample written: what was spent, set-aside samples included.
    return with_extraction_quarantine({
        "rows_in": sum(acc.rows.values()),
        "passed": sum(acc.passed.values()),
        "quarantined": sum(len(q) for q in acc.held.values()),
        "not_generated": tally.status["not_generated"],
        "unrouted": dict(tally.unrouted),  # of those, prompts the routing gives no source: a config fix does them
        "not_in_current_files": acc.aside,
        "quarantine_by_stage": dict(Counter(r["stage"] for r in quarantine)),
        "quarantine_reasons": dict(Counter(_reason_key(r["reason"]) for r in quarantine).most_common(10)),
        "flagged": count_values(pc.list_flatten(samples.column("checks_flagged"))),
        "tokens_generated": int(pc.sum(pc.list_value_length(samples.column("output_ids"))).as_py() or 0),
        "duplicates_in_shards": dropped,  # extra copies in samples/, each counted (and trained on) once
        # rows this attempt wrote; its tokens and dollars are those it generated, the responses an earlier,
        # killed attempt paid for and this one replayed from the response journal counted apart
        "this_attempt": {"samples": tally.done, "generated": sum(tally.served.values()),
                         "resumed_done": counts["resumed_done"],
                         "duplicates_skipped": tally.duplicates,
                         "status": dict(tally.status), "tokens": tally.tokens, "cost_usd": round(tally.cost, 6),
                         "replayed": {"samples": sum(tally.replayed.values()), "tokens": tally.replayed_tokens,
                                      "cost_usd": round(tally.replayed_cost, 6)}},
        "audit": tally.audit.report(),
        "costs": cost_table_of(samples, prices or {}),  # every sample written, resumed attempts included
        "by_dataset": {d: {"rows": n, "passed": acc.passed.get(d, 0), "quarantined": len(acc.held.get(d, {}))}
                       for d, n in sorted(acc.rows.items())},
    }, acc.extracted_out)


def with_extraction_quarantine(report: dict[str, Any], extracted_out: Mapping[str, int]) -> dict[str, Any]:
    """``report`` with its count of samples that passed generation and were then quarantined at extraction
    (``Accounting.extracted_out``), in all and per dataset: they are in ``passed`` but never trained on."""
    by = {d: dict(x) | {"quarantined_at_extraction": int(extracted_out.get(d, 0))}
          for d, x in (report.get("by_dataset") or {}).items()}
    return report | {"quarantined_at_extraction": sum(int(v) for v in extracted_out.values()), "by_dataset": by}


def extraction_quarantine(layout: RunLayout, current: Mapping[str, pa.Array]) -> dict[str, int]:
    """Per dataset, its passed samples the extraction quarantined (read after the extraction ran: the summary
    is made before it)."""
    samples, _ = read_sample_table(layout.samples, ["sample_id", "dataset"])
    return account(samples, read_rows(layout.quarantine, ["sample_id", "dataset", "stage"]), current).extracted_out


def throughput(tally: Tally, gen_s: float) -> dict[str, Any]:
    """This attempt's rates over its generation time: rows generated (not the ``not_generated`` ones, which a
    spent budget or a halted source ends at once, thousands a second) and their tokens, with the snapshots
    report.html draws. Rows replayed from an earlier attempt's response journal are in neither (generated
    then, read back now in no time); ``this_attempt.replayed`` counts them."""
    return {"samples_per_s": round(sum(tally.served.values()) / gen_s, 2) if gen_s else None,
            "tokens_per_s": round(tally.tokens / gen_s, 1) if gen_s else None,
            "series": tally.series}


def source_report(sources: list[Any], tally: Tally) -> dict[str, dict[str, Any]]:
    """Per configured source, this attempt: samples it generated, prompts it spilled past the overflow
    deadline, prompts it left to do (by why), when its engine failed to start, why, and when its engine left
    prompts to do, the first reason; where there are any, samples it replayed from its journal and the first
    journaled response it could not read back."""
    out = {s.name: {"kind": s.kind, "served": tally.served[s.name], "spilled": tally.spilled[s.name],
                    "left_to_do": {why: n for (name, why), n in sorted(tally.left.items()) if name == s.name},
                    "start_error": tally.start_errors.get(s.name),
                    "engine_error": tally.engine_errors.get(s.name)} for s in sources}
    for name, n in tally.replayed.items():
        if name in out and n:
            out[name]["replayed"] = n
    for name, why in tally.journal_errors.items():
        if name in out:
            out[name]["journal_error"] = why
    for name, n in tally.requests.items():
        if name in out:  # requests per row, as the rows report them (the ledger counts sent/settled/released)
            out[name] |= {"requests": n, "retried": n - tally.asked[name]}
    return out


def ledger_report(ledger: Any) -> dict[str, Any]:
    import ray

    rep = ledger.report.remote() if hasattr(ledger.report, "remote") else ledger.report()
    return ray.get(rep) if isinstance(rep, ray.ObjectRef) else rep


def _reason_key(reason: str) -> str:
    """The reason's leading words (check name or error kind), for grouping."""
    return reason.split(":", 1)[0][:80]


def heldout_groups(h: Any, field: str) -> list[dict[str, Any]]:
    """The well-formed items of the held-out figure's ``by_<field>`` breakdown (report.json may be old or
    edited by hand: anything else is left out, never raised on)."""
    items = h.get(f"by_{field}") if isinstance(h, dict) else None
    return [g for g in items if isinstance(g, dict) and isinstance(g.get("acceptance_length"), int | float)
            and isinstance(g.get("drafts"), int)] if isinstance(items, list) else []


def heldout_group_text(g: dict[str, Any]) -> str:
    """``shop 2.81 ± 0.05 (120 drafts)``; a group with few drafts says so."""
    se = f" ± {g['se']:.2f}" if isinstance(g.get("se"), int | float) else ""
    few = ", few" if g.get("few") else ""
    return f"{g.get('name')} {g['acceptance_length']:.2f}{se} ({g['drafts']} draft{'s' * (g['drafts'] != 1)}{few})"


def heldout_breakdown_lines(h: Any) -> list[str]:
    """The held-out acceptance per dataset and per source, a line each where there are two groups or more."""
    lines = []
    for field in ("dataset", "source"):
        groups = heldout_groups(h, field)
        if len(groups) >= 2:
            lines.append(f"  held-out by {field}: " + " · ".join(heldout_group_text(g) for g in groups))
    return lines


def format_report(r: dict[str, Any], out: Path) -> str:
    lines = [
        "",
        "=" * 64,
        f"Run report ({out})",
        f"  rows in      {r['rows_in']}",
        f"  passed generation {r['passed']}",
        f"  quarantined at extraction (not trained on) {r.get('quarantined_at_extraction', 0)} of those passed",
        f"  quarantined  {r['quarantined']}  by stage {r['quarantine_by_stage']}",
        f"  not generated {r['not_generated']} (left to do: budget spent, source halted or API down; "
        "a re-run does them)",
        *([f"  {aside}"] if (aside := aside_line(r.get("not_in_current_files") or {})) else []),
        f"  flagged      {r['flagged']}",
        f"  tokens generated {r['tokens_generated']} (in passed samples, all attempts)",
        this_attempt_line(r.get("this_attempt") or {}),
        *ledger_total_lines(r.get("spend") or {}),
        *cost_lines(r.get("costs")),
        f"  throughput   { {k: v for k, v in r['throughput'].items() if k != 'series'} } (rows generated in this "
        "attempt over its generation time; those replayed from the journal are not)",
        f"  seconds      {r['seconds']}",
    ]
    if r["audit"]["samples"]:
        lines.append("  audit (this attempt):")
        lines += [f"    {line}" for line in summary_lines(r["audit"])]
    for name, src in (r.get("sources") or {}).items():
        spilled = f", {src['spilled']} spilled past the overflow deadline" if src.get("spilled") else ""
        again = f", {src['replayed']} replayed from the journal" if src.get("replayed") else ""
        lines.append(f"  source {name} ({src['kind']}) generated {src.get('served', 0)}{again}{spilled}")
        if src.get("start_error"):
            lines.append(f"  source {name} failed to start (its prompts handed on or left to do): "
                         f"{src['start_error'][:200]}")
    for name, spend in (r.get("spend") or {}).items():
        lines += spend_lines(name, spend)
        held = spend.get("held_by_killed_requests") or {}
        if held:
            lines.append(f"  spend {name}: {sum(held.values())} tokens of budget held by requests in flight when an "
                         f"earlier attempt was killed (they may have been billed) {held}")
    t = r.get("training") or {}
    x = t.get("extraction") or {}
    if x.get("samples") is not None:
        lines.append(f"  extraction   {x['samples']} samples, {x['tokens']} tokens, {x['tokens_per_s_per_actor']} "
                     f"tok/s/actor, {x['bytes_per_token']} bytes/token, peak RSS {x['peak_rss_mb']:.0f} MB")
    if x.get("unreadable_files"):
        lines.append(f"  extraction   {x['unreadable_files']} statistics files in extract_stats/ did not read (left "
                     "out of these figures)")
    m = t.get("metrics") or {}
    if m:
        accs = " ".join(_fixed(m[k], 2) for k in sorted(m) if k.startswith("acc_"))
        lines.append(f"  training     step {m.get('step')} loss {_fixed(m.get('loss'), 3)} "
                     f"acc/position [{accs}] {_fixed(m.get('tokens_per_s'), 0)} tok/s"
                     f"{', bf16 autocast' if m.get('bf16') else ''}"
                     + (f" (not finite, written as null: {m['non_finite']})" if m.get("non_finite") else ""))
    if t.get("export_dir"):
        lines.append(f"  drafter      {t['export_dir']}")
    h = t.get("heldout") or {}
    if h.get("acceptance_length") is not None:
        per = " ".join(f"{p:.2f}" for p in h["per_position"])
        lines.append(f"  held-out     acceptance length {h['acceptance_length']:.3f} at k={h['k']} (per position "
                     f"[{per}]) on {h['samples']} samples never trained on (simulated greedy verification)")
        lines += heldout_breakdown_lines(h)
    elif h:
        lines.append(f"  held-out     {h.get('skipped')}")
    s = t.get("served") or {}
    if s.get("acceptance_length") is not None:
        per = " ".join(f"{p:.2f}" for p in s["per_position"])
        agree = s.get("agreement")
        verdict = "" if agree is None else ("; agrees with the simulated figure per position" if agree["within"]
                                            else "; DIFFERS from the simulated figure beyond sampling noise")
        lines.append(f"  served       acceptance length {s['acceptance_length']:.3f} at k={s['k']} (per position "
                     f"[{per}]) in vLLM on the same {s['prompts']} prompts, {s['drafts']} drafts{verdict}")
    elif s:
        lines.append(f"  served       {s.get('skipped') or s.get('error')}")
    lines += attention_lines(r)
    lines.append("=" * 64)
    return "\n".join(lines)


def _fixed(v: Any, places: int) -> str:
    """A number with ``places`` decimals; "n/a" for what is not one (a diverged loss is written as null)."""
    return f"{v:.{places}f}" if isinstance(v, int | float) and not isinstance(v, bool) else "n/a"


def _usd(v: Any) -> str:
    """Dollars to the hundredth of a cent: beside a cap, $5.004 must not read as $5.00."""
    return f"${v:.4f}" if isinstance(v, int | float) else "$?"


def ledger_datasets(spend: Any) -> dict[str, dict[str, Any]]:
    """The well-formed per-dataset entries of one source's ledger report (report.json may be old or edited)."""
    d = spend.get("datasets") if isinstance(spend, dict) else None
    return {str(k): v for k, v in d.items() if isinstance(v, dict)} if isinstance(d, dict) else {}


def ledger_usd(x: Mapping[str, Any]) -> float:
    """The dollars a ledger counted on one dataset over all attempts: what its cap is held against (billed,
    plus reservations kept as spent: unpriced settles and requests in doubt); ``cost`` in reports without it."""
    v = x.get("spent_usd", x.get("cost"))
    return float(v) if isinstance(v, int | float) else 0.0


def this_attempt_line(t: Mapping[str, Any]) -> str:
    """This attempt's rows: how many it generated, their tokens and the dollars billed in them; then, apart,
    the responses an earlier, killed attempt paid for and this one replayed from the journal (a report from
    before they were counted apart says nothing of them)."""
    generated = f"{t['generated']} rows generated, " if "generated" in t else ""
    line = f"  this attempt {generated}{t.get('tokens', 0)} tokens, {_usd(t.get('cost_usd', 0.0))} billed in its rows"
    again = t.get("replayed")
    if isinstance(again, Mapping):
        n = again.get("samples") or 0
        line += f"; replayed from the journal: {n}"
        if n:
            line += (f" rows, {again.get('tokens', 0)} tokens, {_usd(again.get('cost_usd', 0.0))} (billed in an "
                     "earlier attempt)")
    return line


def ledger_total_lines(spend: Mapping[str, Any]) -> list[str]:
    """The API spend the ledgers counted over every attempt, in one line (none without a spending source)."""
    if not spend:
        return []
    total = sum(ledger_usd(x) for s in spend.values() for x in ledger_datasets(s).values())
    return [f"  API spend    {_usd(total)} (ledger total, all attempts)"]


def spend_lines(name: str, spend: Any) -> list[str]:
    """One line per dataset of a source's ledger: dollars and tokens against their caps (all attempts), what
    is in doubt or was billed beyond its reservation, and this attempt's requests."""
    datasets = ledger_datasets(spend)
    if not datasets:
        return [f"  spend {name}: {json.dumps(spend, default=str)}"]
    lines = []
    for d, x in datasets.items():
        cap = f" of a {_usd(x['budget_usd'])} cap" if x.get("budget_usd") is not None else " (no dollar cap)"
        tok = f", {x.get('spent', 0)} tokens" + (f" of a {x['budget']} cap" if x.get("budget") is not None else "")
        extra = "".join(f", {_usd(x[k])} {what}" for k, what in (
            ("in_doubt_usd", "in doubt (requests of a lost actor, counted as spent)"),
            ("overrun_usd", "billed beyond its reservations")) if x.get(k))
        sent = f", {x['sent']} requests this attempt" if x.get("sent") else ""
        lines.append(f"  spend {name} {d}: {_usd(ledger_usd(x))}{cap}{tok}{extra}{sent} (ledger total, all attempts)")
    return lines


def breach_lines(name: str, spend: Any) -> list[str]:
    """A cap the ledger saw breached, per dataset, or its violations as it wrote them; and dollars in doubt."""
    out = []
    for d, x in ledger_datasets(spend).items():
        usd, cap = ledger_usd(x), x.get("budget_usd")
        overrun = f" (${x['overrun_usd']:.4f} billed beyond what its requests reserved)" if x.get("overrun_usd") else ""
        if isinstance(cap, int | float) and usd > cap + 1e-9:
            out.append(f"  ! source {name}: dataset {d} spent {_usd(usd)} > cap {_usd(cap)}{overrun}")
        elif overrun:
            out.append(f"  ! source {name}: dataset {d} spent {_usd(usd)}{overrun}")
        tokens, budget = x.get("spent"), x.get("budget")
        if isinstance(budget, int) and isinstance(tokens, int) and tokens > budget:
            out.append(f"  ! source {name}: dataset {d} spent {tokens} tokens > cap {budget} tokens")
        if x.get("in_doubt_usd"):
            out.append(f"  ! source {name}: dataset {d}: {_usd(x['in_doubt_usd'])} in doubt (requests of an actor "
                       "that was lost; counted as spent, the provider may have billed them)")
    if not out:  # a breach the final figures no longer show (or a report without them): the ledger's own words
        seen = list(dict.fromkeys(str(v) for v in (spend.get("violations") if isinstance(spend, dict) else None)
                                  or []))
        out += [f"  ! source {name}: budget exceeded: {v}" for v in seen[:5]]
    return out


def attention_lines(r: dict[str, Any]) -> list[str]:
    """What needs the user's action, one line each: a breached cap, a halted source, an API that was down, a
    spent budget."""
    out = [ln for name, spend in (r.get("spend") or {}).items() for ln in breach_lines(name, spend)]
    out += [f"  ! {n} prompts left to do: {why} — fix the routing (or add a source) and re-run to resume"
            for why, n in (r.get("unrouted") or {}).items()]
    for name, src in (r.get("sources") or {}).items():
        left = src.get("left_to_do") or {}
        halted = ((r.get("spend") or {}).get(name) or {}).get("halted")
        if halted or left.get("account") or left.get("config"):
            fix = "the source's config" if left.get("config") or (halted or "").startswith("config error") \
                else "the account"
            out.append(f"  ! source {name}: stopped: {halted or 'account error'} — {sum(left.values())} prompts "
                       f"left to do; fix {fix} and re-run to resume")
        elif left.get("engine"):
            why = src.get("start_error") and f"engine failed to start: {src['start_error']}" or src.get("engine_error")
            out.append(f"  ! source {name}: {(why or 'engine error')[:200]} — {left['engine']} prompts left to do; "
                       "fix the engine (model folder, memory, packages) and re-run to resume")
        elif left.get("transient"):
            out.append(f"  ! source {name}: API failing (network, timeouts or 5xx) — {left['transient']} prompts "
                       "left to do; re-run to resume")
        if left.get("budget"):
            out.append(f"  ! source {name}: budget spent or held — {left['budget']} prompts not generated; raise "
                       "the budget (or wait for in-flight requests) and re-run to do them")
        if left.get("journal"):
            out.append(f"  ! source {name}: {left['journal']} prompts left to do, the responses journaled (and paid "
                       f"for) for them unreadable — first: {(src.get('journal_error') or '?')[:500]}")
    for name, spend in (r.get("spend") or {}).items():
        if isinstance(spend, dict) and (n := spend.get("journal_lines_naming_no_prompt")):
            out.append(f"  ! source {name}: {n} lines of its response journal do not read and name no prompt: if "
                       "they were paid responses, a re-run asks (and pays for) those prompts again — OUTPUT/logs/ "
                       "names each file and byte; repair or delete the lines")
    return out
