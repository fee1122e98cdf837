"""What a run publishes once ``report.json`` is written: ``report.html`` and the trackers' run summary.

Neither may fail the run: each step logs its error and the next one runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pipeline.base.layout import RunLayout
from pipeline.report.html import write_report_html

if TYPE_CHECKING:
    from pipeline.run.config import RunConfig

log = logging.getLogger("pipeline")


def publish_report(cfg: RunConfig, layout: RunLayout, report: dict[str, Any]) -> None:
    """``OUTPUT/report.html``, then the report's data-side figures to the training trackers (TensorBoard,
    W&B, MLflow as ``training.trackers`` names them) at the drafter's last step."""
    write_report_html(layout, report)
    if cfg.training is None:
        return
    try:
        from training.trackers import log_run_summary

        log_run_summary(cfg.training, layout.drafter, report)
    except Exception:  # noqa: BLE001 - trackers never fail a run
        log.exception("run summary not logged to the trackers")
