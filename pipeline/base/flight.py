"""The in-flight row contract every Ray Data stage of the generation chain speaks.

A row is a sample (``records.SAMPLE_SCHEMA``) plus where it stands: ``status``
(``ok``, ``reroute``, ``quarantine``, ``not_generated``), the ``stage`` and
``reason`` of a row that stopped, and the outcome columns the report needs as
facts rather than text to parse: ``spilled_from`` (the local source that handed
the prompt to an overflow source past the deadline), ``start_error_source`` and ``start_error``
(an engine that failed to start and why, set on the rows it could not serve),
``attempts`` (requests an HTTP source made for the row in this attempt: 0 for a
response it replayed from its journal, see ``replayed``) and ``failure_class``
(why a row is left to do or quarantined: ``transient``, ``sample``, ``account``,
``budget``, ``config``, ``engine``, ``journal``). A row never
disappears: a stage that cannot handle it marks it and passes it on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import pyarrow as pa

from pipeline.base.records import SAMPLE_SCHEMA

Status = Literal["ok", "reroute", "quarantine", "not_generated", "duplicate"]
SERVABLE = ("ok", "reroute")

FLIGHT_SCHEMA = pa.schema([
    *SAMPLE_SCHEMA,
    pa.field("status", pa.string()),
    pa.field("stage", pa.string()),   # where a non-ok row stopped
    pa.field("reason", pa.string()),
    pa.field("checks_ran", pa.list_(pa.string())),
    pa.field("spilled_from", pa.string()),
    pa.field("start_error_source", pa.string()),
    pa.field("start_error", pa.string()),
    pa.field("attempts", pa.int32()),
    # why not ok: transient | sample | account | budget | config | engine | journal
    pa.field("failure_class", pa.string()),
    # what the source's rebuild from text could not pin down ("" none; null: not rebuilt here, so the rebuild
    # check runs it again): carried so validation does not tokenize every answer a second time
    pa.field("rebuild_doubt", pa.string()),
])

# What the writer hands back to the driver per row: the small columns it tallies (counts, audit figures,
# spend), never the ids or texts. ``output_tokens`` is len(output_ids), null where nothing was generated.
TALLY_SCHEMA = pa.schema([
    *(FLIGHT_SCHEMA.field(name) for name in (
        "sample_id", "dataset", "source", "provider", "ids_from", "status", "stage", "reason", "failure_class",
        "spilled_from", "start_error_source", "start_error", "attempts", "billed_completion_tokens", "cost",
        "checks_ran", "checks_failed", "checks_flagged", "check_details")),
    pa.field("output_tokens", pa.int64()),
])


class NextSource(Protocol):
    """What a stage needs of the router to hand on a row it cannot serve."""

    def next_source(self, row: dict[str, Any], current: str) -> str | None: ...


def batch_to_rows(batch: pa.Table | dict[str, Any]) -> list[dict[str, Any]]:
    if isinstance(batch, pa.Table):
        return batch.to_pylist()
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    return [{k: _py(batch[k][i]) for k in keys} for i in range(n)]


def _py(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def rows_to_table(rows: list[dict[str, Any]], schema: pa.Schema = FLIGHT_SCHEMA) -> pa.Table:
    return pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema=schema)


def tally_of(batch: pa.Table) -> pa.Table:
    """The driver's view of finished rows (``TALLY_SCHEMA``) of a ``FLIGHT_SCHEMA`` table, column by column:
    ``output_tokens`` is the length of ``output_ids`` (null where nothing was generated)."""
    import pyarrow.compute as pc

    cols = [batch.column(f.name) for f in TALLY_SCHEMA if f.name != "output_tokens"]
    tokens = pc.list_value_length(batch.column("output_ids")).cast(pa.int64())
    return pa.Table.from_arrays([*cols, tokens], schema=TALLY_SCHEMA)


def as_flight(batch: pa.Table) -> pa.Table:
    """``batch`` in ``FLIGHT_SCHEMA``: a stage's own output already is; anything else is converted once."""
    return batch if batch.schema.equals(FLIGHT_SCHEMA) else rows_to_table(batch_to_rows(batch))


def with_column(batch: pa.Table, name: str, values: list[Any]) -> pa.Table:
    """A ``FLIGHT_SCHEMA`` table with column ``name`` replaced by ``values``."""
    field = FLIGHT_SCHEMA.field(name)
    return batch.set_column(batch.schema.get_field_index(name), field, pa.array(values, field.type))


def marked(batch: pa.Table, rows: Sequence[int], status: Status, stage: str, reason: str | Sequence[str]) -> pa.Table:
    """``batch`` with ``rows`` set to ``status`` at ``stage`` for ``reason`` (one for all, or one per row): ``mark``
    over columns, the other columns untouched."""
    reasons = [reason] * len(rows) if isinstance(reason, str) else list(reason)
    cols = {c: batch.column(c).to_pylist() for c in ("status", "stage", "reason")}
    for i, why in zip(rows, reasons, strict=True):
        cols["status"][i], cols["stage"][i], cols["reason"][i] = status, stage, why
    for name, values in cols.items():
        batch = with_column(batch, name, values)
    return batch


def output_len(row: dict[str, Any]) -> int | None:
    """Generated tokens of a sample row (``output_ids``) or of a tally row (``output_tokens``)."""
    if "output_ids" in row:
        return None if row["output_ids"] is None else len(row["output_ids"])
    return row.get("output_tokens")


def replayed(row: dict[str, Any]) -> bool:
    """Whether a sample or tally row holds a response an API source replayed from its journal (paid for in an
    earlier attempt) rather than generated now: ids rebuilt from an API's text, with no request sent for it
    in this attempt (``attempts`` 0; a generated one took one at least, a local engine's rows carry none)."""
    return row.get("ids_from") == "rebuilt" and row.get("attempts") == 0 and output_len(row) is not None


def mark(row: dict[str, Any], status: Status, stage: str, reason: str) -> dict[str, Any]:
    row.update(status=status, stage=stage, reason=reason)
    return row


def serves(row: dict[str, Any], source_name: str) -> bool:
    """Whether a source stage should generate this row: addressed to it (or unrouted) and not yet generated."""
    return (row.get("status") in SERVABLE and row.get("output_ids") is None
            and (row.get("source") or source_name) == source_name)


def served(row: dict[str, Any], source_name: str) -> dict[str, Any]:
    """Mark a row its source generated; a re-routed row keeps the reason it was handed on (the report counts it).
    A served row failed nothing: the class of an earlier source's failure must not stay on it."""
    row.update(source=source_name, status="ok", stage="", failure_class=None,
               reason=row["reason"] if row.get("status") == "reroute" else "")
    return row


def hand_on(row: dict[str, Any], reason: str, source_name: str, nxt: str) -> dict[str, Any]:
    """Re-address a row to source ``nxt``; a spilled row going back to its local source is no longer spilled.

    The outcome columns start afresh: the report credits a row's ``attempts`` and ``failure_class`` to the
    source it ends at, so the requests this source made must not be counted as ``nxt``'s."""
    row.update(status="reroute", stage="generate", reason=f"{source_name}: {reason}", source=nxt,
               attempts=None, failure_class=None)
    if row.get("spilled_from") == nxt:
        row["spilled_from"] = None
    return row


def fail_row(row: dict[str, Any], reason: str, source_name: str, router: NextSource | None, *,
             start_error: str | None = None) -> dict[str, Any]:
    """A row this source cannot serve: re-routed when the router names a next source, else quarantined."""
    if start_error is not None:
        row.update(start_error_source=source_name, start_error=start_error)
    nxt = router.next_source(row, source_name) if router is not None else None
    if nxt:
        hand_on(row, reason, source_name, nxt)
    else:
        mark(row, "quarantine", "generate", reason)
        row["source"] = source_name
    return row


def leave_to_do(row: dict[str, Any], reason: str, source_name: str, router: NextSource | None) -> dict[str, Any]:
    """A row this source could not serve now but may later (budget spent, API down): the next source takes it,
    or it stays not generated — never quarantined, so a re-run does it."""
    nxt = router.next_source(row, source_name) if router is not None else None
    if nxt:
        hand_on(row, reason, source_name, nxt)
    else:
        row.update(status="not_generated", stage="generate", reason=reason, source=source_name)
    return row
