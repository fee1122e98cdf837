"""What each Ray worker of a run does once, at its start, before its first task."""

from __future__ import annotations

SETUP_HOOK = "pipeline.base.ray_worker.import_early"  # runtime_env's worker_process_setup_hook


def import_early() -> None:
    """Import pandas whole before any task can. Ray Data's batch check reads ``pd.core.frame`` and two threads
    importing pandas at once can leave one of them a half-initialised module (seen once in CI, a read task
    failing with "module 'pandas' has no attribute 'core'")."""
    import pandas.core.frame  # noqa: F401
