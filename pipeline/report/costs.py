"""What each sample cost, summed per dataset and per source: the dollars an API billed for it, and the local
engine time it used (device-hours, priced by the source's optional ``gpu_hour_usd``).

Pure functions over sample rows (``cost``: the provider's own ``usage.cost``; ``engine_s``: the sample's share
of its engine's busy device-seconds, see ``pipeline.generate.sources.engines.base.busy_shares``). The report,
``status`` and the value curves of issue #27 all read spend from here, so they agree to the cent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

COST_COLUMNS = ["sample_id", "dataset", "source", "output_ids", "cost", "engine_s"]


def _num(value: Any) -> float:
    """A finite, non-negative number from a shard cell (None, NaN or a negative count as 0: nothing billed)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return 0.0
    return x if math.isfinite(x) and x > 0 else 0.0


def engine_prices(sources: Iterable[Any]) -> dict[str, float | None]:
    """Source name -> dollars per device-hour of its engine (None where unpriced, as for an HTTP source, whose
    samples carry their bill)."""
    return {s.name: s.device_hour_usd() for s in sources}


def sample_usd(row: Mapping[str, Any], prices: Mapping[str, float | None]) -> float:
    """One sample's dollars: what the API billed, plus its engine time at its source's price (0 if unpriced)."""
    price = prices.get(str(row.get("source") or "")) or 0.0
    return _num(row.get("cost")) + _num(row.get("engine_s")) / 3600.0 * price


def _empty() -> dict[str, Any]:
    return {"samples": 0, "output_tokens": 0, "billed_usd": 0.0, "device_hours": 0.0, "engine_usd": 0.0,
            "unpriced_device_hours": 0.0}


def _add(acc: dict[str, Any], row: Mapping[str, Any], price: float | None) -> None:
    out = row.get("output_ids")
    _add_sums(acc, 1, len(out) if out is not None else 0, _num(row.get("cost")), _num(row.get("engine_s")) / 3600.0,
              price)


def _add_sums(acc: dict[str, Any], samples: int, tokens: int, usd: float, hours: float, price: float | None) -> None:
    """Add one sample's figures (or a group's sums) to an accumulator; engine hours priced only where priced."""
    acc["samples"] += samples
    acc["output_tokens"] += tokens
    acc["billed_usd"] += usd
    acc["device_hours"] += hours
    if price is None:
        acc["unpriced_device_hours"] += hours
    else:
        acc["engine_usd"] += hours * price


def _close(acc: dict[str, Any]) -> dict[str, Any]:
    acc["usd"] = acc["billed_usd"] + acc["engine_usd"]
    acc["usd_per_sample"] = acc["usd"] / acc["samples"] if acc["samples"] else 0.0
    acc["usd_per_mtok"] = acc["usd"] / acc["output_tokens"] * 1e6 if acc["output_tokens"] else 0.0
    return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in acc.items()}


def cost_table(rows: Iterable[Mapping[str, Any]], prices: Mapping[str, float | None]) -> dict[str, Any]:
    """Spend per dataset and per source (and in all) over sample rows with COST_COLUMNS, one row per sample.

    ``unpriced_device_hours`` is engine time of sources without ``gpu_hour_usd``: counted in hours, not in
    dollars, so a report never prices a GPU the user did not."""
    by_dataset: dict[str, dict[str, Any]] = {}
    by_source: dict[str, dict[str, Any]] = {}
    total = _empty()
    for row in rows:
        source = str(row.get("source") or "")
        price = prices.get(source)
        _add(by_dataset.setdefault(str(row.get("dataset") or ""), _empty()), row, price)
        _add(by_source.setdefault(source, _empty()), row, price)
        _add(total, row, price)
    return {"total": _close(total), "by_dataset": {k: _close(v) for k, v in sorted(by_dataset.items())},
            "by_source": {k: _close(v) for k, v in sorted(by_source.items())}}


def cost_table_of(table: Any, prices: Mapping[str, float | None]) -> dict[str, Any]:
    """``cost_table`` of an Arrow table of samples (``dataset``, ``source``, ``cost``, ``engine_s``, and
    ``output_ids`` where present), summed per dataset and source by Arrow, one Python step per group: the
    same figures as the row loop (a cell that is null, NaN or negative counts as 0)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def positive(name: str) -> Any:
        if name not in table.column_names:
            return pa.nulls(table.num_rows, pa.float64()).fill_null(0.0)
        x = pc.cast(table.column(name), pa.float64())
        ok = pc.fill_null(pc.and_(pc.is_finite(x), pc.greater(x, 0.0)), False)
        return pc.if_else(ok, x, 0.0)

    tokens = (pc.fill_null(pc.list_value_length(table.column("output_ids")), 0).cast(pa.int64())
              if "output_ids" in table.column_names else pa.nulls(table.num_rows, pa.int64()).fill_null(0))
    parts = pa.table({"dataset": pc.fill_null(table.column("dataset"), ""),
                      "source": pc.fill_null(table.column("source"), ""),
                      "cost": positive("cost"), "hours": pc.divide(positive("engine_s"), 3600.0), "tokens": tokens})
    groups = parts.group_by(["dataset", "source"], use_threads=False).aggregate(
        [("cost", "sum"), ("hours", "sum"), ("tokens", "sum"), ("cost", "count")]).to_pylist()
    by_dataset: dict[str, dict[str, Any]] = {}
    by_source: dict[str, dict[str, Any]] = {}
    total = _empty()
    for g in groups:
        price = prices.get(g["source"])
        for acc in (by_dataset.setdefault(g["dataset"], _empty()), by_source.setdefault(g["source"], _empty()),
                    total):
            _add_sums(acc, g["cost_count"], g["tokens_sum"], g["cost_sum"], g["hours_sum"], price)
    return {"total": _close(total), "by_dataset": {k: _close(v) for k, v in sorted(by_dataset.items())},
            "by_source": {k: _close(v) for k, v in sorted(by_source.items())}}


def cost_line(name: str, c: Mapping[str, Any]) -> str:
    """``shop: $0.0123 billed + 0.012 device-h ($0.024) = $0.036, 120 samples ($0.30/1k)`` -- one text line."""
    parts = []
    if c.get("billed_usd"):
        parts.append(f"${c['billed_usd']:.4f} billed")
    if c.get("device_hours"):
        priced = c["device_hours"] - c.get("unpriced_device_hours", 0.0)
        money = f" (${c['engine_usd']:.4f})" if priced > 0 else ""
        parts.append(f"{c['device_hours']:.4f} device-h{money}")
    what = " + ".join(parts) or "nothing spent"
    per_k = f", ${c['usd_per_sample'] * 1000:.2f}/1k samples" if c.get("usd") else ""
    return f"{name}: {what} = ${c.get('usd', 0.0):.4f}, {c.get('samples', 0)} samples{per_k}"


def cost_groups(costs: Any, field: str) -> dict[str, dict[str, Any]]:
    """The well-formed entries of a cost table's ``by_<field>`` (a report.json may be old or edited by hand:
    anything else is left out, never raised on)."""
    groups = costs.get(f"by_{field}") if isinstance(costs, dict) else None
    return {str(k): v for k, v in groups.items() if isinstance(v, dict)} if isinstance(groups, dict) else {}


def cost_lines(costs: Any) -> list[str]:
    """What the samples cost, per dataset (and per source where there are several): billed dollars and engine
    device-hours, priced where the source has ``gpu_hour_usd``. Nothing for a report without the table."""
    lines = []
    for field in ("dataset", "source"):
        groups = cost_groups(costs, field)
        if groups and (field == "dataset" or len(groups) >= 2):
            lines.append(f"  cost by {field}: " + " · ".join(cost_line(k, v) for k, v in groups.items()))
    return lines
