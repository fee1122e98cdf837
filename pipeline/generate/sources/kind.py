"""One source kind's registry entry: its schema, its actor class (by name, imported only where it runs) and
the facts the rest of the pipeline asks about it. Each kind declares its entries beside its schema
(``engines/config.py``, ``http/config.py``); ``registry`` collects them."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Literal

from pydantic import BaseModel

Layout = Literal["engine", "engine_forks", "async_http"]


@dataclass(frozen=True)
class SourceKind:
    """A source kind (the facts are described in ``pipeline.generate.sources.registry``)."""

    name: str  # the config's ``kind:``
    config: type[BaseModel]
    actor: str  # "module:Class"
    exact_ids: bool
    spends: bool
    layout: Layout
    manifest: tuple[str, ...] = ()
    serves_drafter: bool = False

    def actor_class(self) -> type:
        module, name = self.actor.split(":")
        return getattr(import_module(module), name)

    @property
    def actor_class_name(self) -> str:
        """The class name Ray reports for its actors (``MapWorker(MapBatches(<name>))`` under Ray Data)."""
        return self.actor.rsplit(":", 1)[1]

    @property
    def holds_engine(self) -> bool:
        """Its actors hold a model engine (GPUs, worker processes) that takes seconds to stop."""
        return self.layout != "async_http"
