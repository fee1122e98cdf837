"""Answer "is the data correct?" with figures: the run report, and `audit` over existing shards.

``AuditAccumulator`` folds (sample, verdict) pairs into a report with stable field names; the
live pipeline feeds it as samples are validated, and ``main`` feeds it from sample shards on
disk (re-running the same checks), so both say the same thing about the same data. Reports
from parallel workers combine with ``merge``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from pipeline.base.config import ChecksConfig
from pipeline.base.layout import atomic_write, atomic_write_json
from pipeline.base.records import QUARANTINE_SCHEMA, SAMPLE_SCHEMA
from pipeline.checks.validate import (
    CHECK_NAMES,
    Verdict,
    assert_conservation,
    billing_diff,
    billing_outlier,
    configured_mode,
    validate_sample,
)

__all__ = [
    "AuditAccumulator", "ShardError", "assert_conservation", "audit_samples", "gate", "main",
    "read_samples", "sample_shards", "summary_lines",
]

UNKNOWN = "(unknown)"
MAX_OUTLIER_IDS = 20


@dataclass
class _Billing:
    """Running sums for the billing cross-check; integer diffs kept as a histogram, not a list."""

    samples: int = 0
    billed_tokens: int = 0
    output_tokens: int = 0
    sum_diff: int = 0
    sum_abs_diff: int = 0
    max_abs_diff: int | None = None
    max_diff: int | None = None
    max_sample_id: str | None = None
    outliers: int = 0
    outlier_ids: list[str] = field(default_factory=list)
    histogram: Counter[int] = field(default_factory=Counter)

    def add(self, sample_id: str, diff: int, billed: int, outlier: bool) -> None:
        self.samples += 1
        self.billed_tokens += billed
        self.output_tokens += billed + diff
        self.sum_diff += diff
        self.sum_abs_diff += abs(diff)
        self.histogram[diff] += 1
        if self.max_abs_diff is None or abs(diff) > self.max_abs_diff:
            self.max_abs_diff, self.max_diff, self.max_sample_id = abs(diff), diff, sample_id
        if outlier:
            self.outliers += 1
            if len(self.outlier_ids) < MAX_OUTLIER_IDS:
                self.outlier_ids.append(sample_id)

    def merge(self, o: _Billing) -> None:
        for k in ("samples", "billed_tokens", "output_tokens", "sum_diff", "sum_abs_diff", "outliers"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        if o.max_abs_diff is not None and (self.max_abs_diff is None or o.max_abs_diff > self.max_abs_diff):
            self.max_abs_diff, self.max_diff, self.max_sample_id = o.max_abs_diff, o.max_diff, o.max_sample_id
        self.outlier_ids = (self.outlier_ids + o.outlier_ids)[:MAX_OUTLIER_IDS]
        self.histogram.update(o.histogram)

    def report(self) -> dict[str, Any]:
        n = self.samples
        return {
            "samples": n,
            "billed_tokens": self.billed_tokens,
            "output_tokens": self.output_tokens,
            "mean_diff": self.sum_diff / n if n else None,
            "mean_abs_diff": self.sum_abs_diff / n if n else None,
            # Token-weighted: total |diff| over total billed tokens (the "0.04%" of a run).
            "mean_rel_diff": self.sum_abs_diff / self.billed_tokens if self.billed_tokens else None,
            "max_abs_diff": self.max_abs_diff,
            "max_diff": self.max_diff,
            "max_sample_id": self.max_sample_id,
            "outliers": self.outliers,
            "outlier_ids": list(self.outlier_ids),
            "histogram": {str(d): c for d, c in sorted(self.histogram.items())},
        }


@dataclass
class _Block:
    """Counts for one slice of the samples (all of them, one provider, one dataset)."""

    samples: int = 0
    passed: int = 0
    quarantined: int = 0
    flagged: int = 0
    checked: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    flags: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    ids_from: Counter[str] = field(default_factory=Counter)
    canonical_checked: Counter[str] = field(default_factory=Counter)
    canonical_ok: Counter[str] = field(default_factory=Counter)
    billing: _Billing = field(default_factory=_Billing)

    def add(self, sample: dict[str, Any], verdict: Verdict, billing: tuple[int, int, bool] | None,
            max_examples: int) -> None:
        sid = str(sample.get("sample_id"))
        self.samples += 1
        self.passed += verdict.passed
        self.quarantined += not verdict.passed
        self.flagged += bool(verdict.flagged)
        origin = str(sample.get("ids_from") or UNKNOWN)
        self.ids_from[origin] += 1
        self.checked.update(verdict.ran)
        self.failed.update(verdict.failed.keys())
        self.flags.update(verdict.flagged.keys())
        for name, detail in {**verdict.flagged, **verdict.failed}.items():
            shown = self.examples.setdefault(name, [])
            if len(shown) < max_examples:
                shown.append({"sample_id": sid, "detail": detail})
        if "roundtrip" in verdict.ran:
            self.canonical_checked[origin] += 1
            self.canonical_ok[origin] += "roundtrip" not in verdict.failed and "roundtrip" not in verdict.flagged
        if billing is not None:
            self.billing.add(sid, *billing)

    def merge(self, o: _Block, max_examples: int) -> None:
        self.samples += o.samples
        self.passed += o.passed
        self.quarantined += o.quarantined
        self.flagged += o.flagged
        for mine, theirs in ((self.checked, o.checked), (self.failed, o.failed), (self.flags, o.flags),
                             (self.ids_from, o.ids_from), (self.canonical_checked, o.canonical_checked),
                             (self.canonical_ok, o.canonical_ok)):
            mine.update(theirs)
        for name, shown in o.examples.items():
            self.examples[name] = (self.examples.get(name, []) + shown)[:max_examples]
        self.billing.merge(o.billing)

    def report(self, cfg: ChecksConfig) -> dict[str, Any]:
        checks = {
            name: {
                "mode": _mode_label(name, cfg),
                "checked": self.checked[name],
                "failed": self.failed[name],
                "flagged": self.flags[name],
                "examples": list(self.examples.get(name, [])),
            }
            for name in CHECK_NAMES
        }
        total_checked = sum(self.canonical_checked.values())
        return {
            "samples": self.samples,
            "passed": self.passed,
            "quarantined": self.quarantined,
            "flagged": self.flagged,
            "ids_from": dict(sorted(self.ids_from.items())),
            "checks": checks,
            "billing": self.billing.report(),
            # Share of roundtrip-checked responses whose ids are the tokenizer's own encoding of their text.
            "canonical_share": sum(self.canonical_ok.values()) / total_checked if total_checked else None,
            "canonical": {
                origin: {"checked": n, "canonical": self.canonical_ok[origin], "share": self.canonical_ok[origin] / n}
                for origin, n in sorted(self.canonical_checked.items())
            },
        }


def _mode_label(name: str, cfg: ChecksConfig) -> str:
    if name == "roundtrip":
        return f"engine:{cfg.roundtrip} rebuilt:{cfg.roundtrip_rebuilt}"
    return str(configured_mode(name, cfg))


class AuditAccumulator:
    """Folds validated samples into a report. Pure: no I/O; one per worker, then ``merge``.

    Billing outliers follow the verdict where the billing check ran; where it was off the
    accumulator's own thresholds decide, so billing figures exist whatever the check's mode.
    """

    def __init__(self, cfg: ChecksConfig | None = None, max_examples: int = 5,
                 dataset_checks: Mapping[str, ChecksConfig] | None = None) -> None:
        self.cfg = cfg or ChecksConfig()
        # Per-dataset checks where datasets differ: their thresholds and modes apply to their own samples.
        self.dataset_checks = dict(dataset_checks or {})
        self.max_examples = max_examples
        self.total = _Block()
        self.by_provider: dict[str, _Block] = {}
        self.by_dataset: dict[str, _Block] = {}

    def add(self, sample: dict[str, Any], verdict: Verdict) -> None:
        diff = billing_diff(sample)
        billing = None
        if diff is not None:
            billed = int(sample["billed_completion_tokens"])
            if "billing" in verdict.ran:
                outlier = "billing" in verdict.failed or "billing" in verdict.flagged
            else:
                cfg = self.dataset_checks.get(str(sample.get("dataset")), self.cfg)
                outlier = billing_outlier(diff, billed, cfg)
            billing = (diff, billed, outlier)
        provider = str(sample.get("provider") or UNKNOWN)
        dataset = str(sample.get("dataset") or UNKNOWN)
        for block in (self.total, self.by_provider.setdefault(provider, _Block()),
                      self.by_dataset.setdefault(dataset, _Block())):
            block.add(sample, verdict, billing, self.max_examples)

    def merge(self, other: AuditAccumulator) -> AuditAccumulator:
        self.total.merge(other.total, self.max_examples)
        for mine, theirs in ((self.by_provider, other.by_provider), (self.by_dataset, other.by_dataset)):
            for key, block in theirs.items():
                mine.setdefault(key, _Block()).merge(block, self.max_examples)
        return self

    def report(self) -> dict[str, Any]:
        """The report dict: the totals at the top level, the same figures per provider and dataset."""
        out = self.total.report(self.cfg)
        out["by_provider"] = {k: b.report(self.cfg) for k, b in sorted(self.by_provider.items())}
        out["by_dataset"] = {k: b.report(self.dataset_checks.get(k, self.cfg))
                             for k, b in sorted(self.by_dataset.items())}
        out["thresholds"] = {
            "billing_abs_threshold": self.cfg.billing_abs_threshold,
            "billing_rel_threshold": self.cfg.billing_rel_threshold,
            "repetition_ngram": self.cfg.repetition_ngram,
            "repetition_max_repeats": self.cfg.repetition_max_repeats,
            "max_total_tokens": self.cfg.max_total_tokens,
            "max_failures": dict(self.cfg.max_failures),
        }
        return out


# -- gate ---------------------------------------------------------------------


def gate(report: dict[str, Any], cfg: ChecksConfig) -> dict[str, Any]:
    """Which checks exceed their allowed number of detections (the audit's exit status).

    A limit from ``cfg.max_failures`` counts failed + flagged; without one, quarantine-mode
    detections (``failed``) must be 0 and flag-mode ones are free.
    """
    checks: dict[str, dict[str, Any]] = {}
    violations = []
    for name in CHECK_NAMES:
        c = report["checks"][name]
        if name in cfg.max_failures:
            counts, count, limit = "failed+flagged", c["failed"] + c["flagged"], cfg.max_failures[name]
        else:
            counts, count, limit = "failed", c["failed"], 0
        checks[name] = {"counts": counts, "count": count, "max": limit, "ok": count <= limit}
        if count > limit:
            violations.append(f"{name}: {count} > {limit}")
    return {"ok": not violations, "violations": violations, "checks": checks}


# -- shards -------------------------------------------------------------------


class ShardError(ValueError):
    """A shard that is not a sample shard: the message names the file and the column."""


# Columns a check cannot do without; a null in any of them is a broken shard, not a bad sample.
REQUIRED_VALUES = ("sample_id", "output_ids", "thinking", "truncated", "billed_completion_tokens", "ids_from")


def _kind(t: pa.DataType) -> Any:
    """What a column holds once read into Python: int32 vs int64 or string vs large_string do not matter."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return ("list", _kind(t.value_type))
    for test, kind in ((pa.types.is_boolean, "bool"), (pa.types.is_integer, "int"),
                       (pa.types.is_floating, "float"), (pa.types.is_string, "str"),
                       (pa.types.is_large_string, "str")):
        if test(t):
            return kind
    return str(t)


def check_schema(path: Path) -> None:
    """Raise ShardError naming the first missing or wrongly typed SAMPLE_SCHEMA column."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ShardError(f"{path}: not a readable Parquet file: {e}") from None
    for f in SAMPLE_SCHEMA:
        if f.name not in schema.names:
            raise ShardError(f"{path}: missing column {f.name!r} (expected {f.type})")
        actual = schema.field(f.name).type
        if _kind(actual) != _kind(f.type):
            raise ShardError(f"{path}: column {f.name!r} has type {actual}, expected {f.type}")


def sample_shards(path: str | Path) -> tuple[list[Path], list[Path]]:
    """(sample shards, skipped quarantine shards) under a run folder, a shard folder, or one file."""
    path = Path(path)
    if path.is_file():
        return [path], []
    if not path.is_dir():
        raise ShardError(f"{path}: no such file or directory")
    shards, skipped = [], []
    for f in sorted(path.rglob("*.parquet")):
        try:
            names = set(pq.read_schema(f).names)
        except (pa.ArrowInvalid, OSError) as e:
            raise ShardError(f"{f}: not a readable Parquet file: {e}") from None
        (skipped if names == set(QUARANTINE_SCHEMA.names) else shards).append(f)
    if not shards:
        raise ShardError(f"{path}: no sample shards (*.parquet with the sample columns)")
    return shards, skipped


def read_samples(files: Iterable[Path], batch_size: int = 1024,
                 dropped: list[int] | None = None) -> Iterator[dict[str, Any]]:
    """Sample rows from shards, schema-checked first; streamed so a large run fits in memory. A sample id seen
    before is skipped (counted in ``dropped[0]``): a sample written twice is audited once."""
    files = list(files)
    for f in files:
        check_schema(f)
    seen: set[str] = set()
    for f in files:
        row_no = 0
        for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=SAMPLE_SCHEMA.names):
            for row in batch.to_pylist():
                for col in REQUIRED_VALUES:
                    if row[col] is None:
                        raise ShardError(f"{f}: row {row_no}: column {col!r} is null")
                row_no += 1
                if row["sample_id"] in seen:
                    if dropped is not None:
                        dropped[0] += 1
                    continue
                seen.add(row["sample_id"])
                yield row


def audit_samples(samples: Iterable[dict[str, Any]], profile: Any, cfg: ChecksConfig) -> dict[str, Any]:
    """Re-run every check over stored samples and report, with the gate's result."""
    acc = AuditAccumulator(cfg)
    for s in samples:
        acc.add(s, validate_sample(s, profile, cfg))
    report = acc.report()
    report["gate"] = gate(report, cfg)
    return report


# -- terminal summary ---------------------------------------------------------


def _billing_line(b: dict[str, Any]) -> str:
    if not b["samples"]:
        return "no billed (API) samples"
    line = (f"{b['samples']:,} billed: rebuilt token counts match billing within {b['mean_abs_diff']:.1f} token"
            f"{'' if b['mean_abs_diff'] == 1 else 's'} on average ({b['mean_rel_diff']:.2%}),"
            f" mean signed {b['mean_diff']:+.2f}")
    if b["max_abs_diff"]:
        line += f"; max {b['max_diff']:+d} (sample {b['max_sample_id']})"
    return line + f"; {b['outliers']} outlier{'' if b['outliers'] == 1 else 's'}"


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A few readable lines: counts, issues per check, billing figures overall and per provider."""
    lines = [f"{report['samples']:,} responses checked: {report['passed']:,} passed, "
             f"{report['quarantined']:,} quarantined, {report['flagged']:,} flagged"]
    issues = [f"{name} {c['failed']} failed/{c['flagged']} flagged" for name, c in report["checks"].items()
              if c["failed"] or c["flagged"]]
    lines.append("issues: " + (", ".join(issues) if issues else "none"))
    structural = report["checks"]["structure"]
    lines.append(f"structure: {structural['failed'] + structural['flagged']} structural issues "
                 f"in {structural['checked']:,} checked")
    if report["canonical_share"] is not None:
        parts = ", ".join(f"{k} {v['canonical']:,}/{v['checked']:,}" for k, v in report["canonical"].items())
        lines.append(f"canonical share: {report['canonical_share']:.2%} ({parts})")
    lines.append("billing: " + _billing_line(report["billing"]))
    for name, block in report.get("by_provider", {}).items():
        if block["billing"]["samples"]:
            lines.append(f"  {name}: " + _billing_line(block["billing"]))
    g = report.get("gate")
    if g is not None:
        lines.append("gate: ok" if g["ok"] else "gate: FAILED (" + "; ".join(g["violations"]) + ")")
    return lines


# -- CLI ----------------------------------------------------------------------


def _checks_config(path: str | None, limits: list[str]) -> ChecksConfig:
    raw: dict[str, Any] = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of ChecksConfig fields")
        raw = loaded
    gate_limits = dict(raw.get("max_failures") or {})
    for item in limits:
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"--max-failures expects CHECK=N, got {item!r}")
        gate_limits[name.strip()] = int(value)
    return ChecksConfig.model_validate({**raw, "max_failures": gate_limits})


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipeline audit",
                                 description="Audit sample shards with the pipeline's checks; exit 1 if a gate fails.")
    ap.add_argument("path", help="a sample shard, a folder of shards, or a run output folder")
    ap.add_argument("--json", dest="json_path", help="write the report as JSON here")
    ap.add_argument("--html", dest="html_path", help="write a self-contained HTML report here")
    ap.add_argument("--profile", default="deepseek", help="model profile the samples were made with")
    ap.add_argument("--model-dir", help="model folder whose tokenizer wins over the profile's")
    ap.add_argument("--checks", help="YAML/JSON mapping of ChecksConfig fields (modes, thresholds, max_failures)")
    ap.add_argument("--max-failures", action="append", default=[], metavar="CHECK=N",
                    help="allow up to N detections (failed + flagged) of CHECK; repeatable")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every gate holds, 1 when one fails, 2 when the input or options are unusable."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error; argparse already printed why
        return int(e.code or 0)
    from pipeline.profiles import check_model_folder, load_profile  # tokenizers load only when an audit runs

    if args.model_dir and (reason := check_model_folder(args.profile, args.model_dir)):
        print(f"audit: {reason}", file=sys.stderr)
        return 2
    try:
        cfg = _checks_config(args.checks, args.max_failures)
        profile = load_profile(args.profile, args.model_dir)
        shards, skipped = sample_shards(args.path)
        dropped = [0]
        report = audit_samples(read_samples(shards, dropped=dropped), profile, cfg)
    except (ShardError, ValueError, OSError, yaml.YAMLError) as e:
        print(f"audit: {e}", file=sys.stderr)
        return 2
    report["shards"] = [str(s) for s in shards]
    report["skipped_quarantine_shards"] = [str(s) for s in skipped]
    report["duplicates_dropped"] = dropped[0]
    lines = summary_lines(report)
    if dropped[0]:
        lines.append(f"duplicates: {dropped[0]} extra copies of sample ids skipped (each sample audited once)")
    print("\n".join(lines))
    if args.json_path:
        atomic_write_json(args.json_path, report, ensure_ascii=False)
    if args.html_path:
        from pipeline.checks.audit_html import render_html

        atomic_write(args.html_path, render_html(report, title=f"Audit of {args.path}", summary=lines))
    return 0 if report["gate"]["ok"] else 1
