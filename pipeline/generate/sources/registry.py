"""The source registry: every source kind, in one table.

A kind is a config schema (a ``SourceConfigBase`` declared beside its adapter, with the kind's
``SourceKind`` entry: ``engines/config.py``, ``http/config.py``), a Ray Data callable class that serves
in-flight rows (imported only where it runs, so a CPU machine never imports SGLang), and the facts the
rest of the pipeline asks about it:

- ``exact_ids``: the engine returns the target's own token ids; otherwise the ids
  are rebuilt from text (routing keeps tool prompts off such sources when asked).
- ``spends``: it bills per token, so it gets a budget ledger and a line in
  ``status``'s spend table; its actor class takes the keywords ``ledger`` (the
  shared ledger actor), ``layout`` (the run folder's ``RunLayout``, for its response journal) and ``replay``
  (responses an earlier attempt paid for). Any other kind's actor class takes ``layout`` alone, for the notes
  that find a prompt killing its process (``engines/deaths.py``).
- ``manifest``: the config fields that decide what its samples hold (its own model,
  provider preferences, reasoning, sampling, tools); recorded in the run manifest
  so a resume cannot mix distributions. Transport (URLs, timeouts) stays out.
- ``serves_drafter``: its engine can run the exported EAGLE-3 drafter through ``training.served`` (vLLM's
  ``LLM`` API), so a run measures the drafter's served acceptance on that source's resources.
- ``layout``: how its actors take resources: ``engine`` (CPUs/GPUs per actor; TP > 1
  in a placement group whose bundles the engine fills with Ray tasks),
  ``engine_forks`` (the actor holds all TP GPUs; the engine forks its own workers),
  ``async_http`` (a fraction of a CPU, many batches in flight per actor).

A new kind adds its schema module to ``KIND_MODULES``; the run config's ``sources:`` union (``SourceConfig``) is
built from the table. Nothing outside this module branches on a source's kind: what differs per kind is a
fact here or a method of its schema (``describe``, ``actor_resources``, ``run_problem``, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Field

from pipeline.generate.sources.engines import config as engines
from pipeline.generate.sources.http import config as http
from pipeline.generate.sources.kind import Layout, SourceKind

__all__ = ["KIND_MODULES", "SOURCES", "Layout", "SourceConfig", "SourceKind", "drafter_server", "engine_actor_names",
           "source_kind", "spending_sources"]

# Each module declares ``KINDS``: its schemas' registry entries.
KIND_MODULES = (engines, http)

SOURCES: dict[str, SourceKind] = {k.name: k for m in KIND_MODULES for k in m.KINDS}

# The config's ``sources:`` items: one schema per kind, told apart by ``kind:``.
SourceConfig = Annotated[Union[tuple(k.config for k in SOURCES.values())], Field(discriminator="kind")]  # noqa: UP007


def source_kind(cfg: Any) -> SourceKind:
    """The registry entry of a source config."""
    try:
        return SOURCES[cfg.kind]
    except KeyError:
        raise ValueError(f"source {cfg.name!r}: unknown kind {cfg.kind!r} (known: {sorted(SOURCES)})") from None


def drafter_server(sources: list[Any]) -> Any | None:
    """The first source whose engine can serve the drafter (see ``serves_drafter``), or None."""
    return next((s for s in sources if source_kind(s).serves_drafter), None)


def spending_sources(sources: list[Any]) -> list[Any]:
    """The sources that bill per token (each gets a budget ledger)."""
    return [s for s in sources if source_kind(s).spends]


def engine_actor_names() -> set[str]:
    """The class names of the kinds' actors that hold an engine (see ``SourceKind.holds_engine``)."""
    return {k.actor_class_name for k in SOURCES.values() if k.holds_engine}
