"""The source registry: every source kind, in one table.

A kind is a config schema (in pipeline.base.config), a Ray Data callable class that
serves in-flight rows (imported only where it runs, so a CPU machine never
imports SGLang), and the facts the rest of the pipeline asks about it:

- ``exact_ids``: the engine returns the target's own token ids; otherwise the ids
  are rebuilt from text (routing keeps tool prompts off such sources when asked).
- ``spends``: it bills per token, so it gets a budget ledger and a line in
  ``status``'s spend table; its actor class takes the keywords ``ledger`` (the
  shared ledger actor), ``output_dir`` (for its response journal) and ``replay``
  (responses an earlier attempt paid for).
- ``manifest``: the config fields that decide what its samples hold (its own model,
  provider preferences, reasoning, sampling, tools); recorded in the run manifest
  so a resume cannot mix distributions. Transport (URLs, timeouts) stays out.
- ``serves_drafter``: its engine can run the exported EAGLE-3 drafter through ``training.served`` (vLLM's
  ``LLM`` API), so a run measures the drafter's served acceptance on that source's resources.
- ``layout``: how its actors take resources: ``engine`` (CPUs/GPUs per actor; TP > 1
  in a placement group whose bundles the engine fills with Ray tasks),
  ``engine_forks`` (the actor holds all TP GPUs; the engine forks its own workers),
  ``async_http`` (a fraction of a CPU, many batches in flight per actor).

Nothing outside this module branches on a source's kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any, Literal

from pydantic import BaseModel

from pipeline.base.config import (
    OpenRouterSourceConfig,
    SGLangSourceConfig,
    TransformersSourceConfig,
    VLLMSourceConfig,
)

Layout = Literal["engine", "engine_forks", "async_http"]


@dataclass(frozen=True)
class SourceKind:
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


SOURCES: dict[str, SourceKind] = {
    "vllm": SourceKind(VLLMSourceConfig, "pipeline.generate.sources.engines.vllm_source:VLLMGenerator",
                       exact_ids=True, spends=False, layout="engine", serves_drafter=True),
    "sglang": SourceKind(SGLangSourceConfig, "pipeline.generate.sources.engines.sglang_source:SGLangGenerator",
                         exact_ids=True, spends=False, layout="engine_forks"),
    "transformers": SourceKind(TransformersSourceConfig,
                               "pipeline.generate.sources.engines.transformers_source:TransformersGenerator",
                               exact_ids=True, spends=False, layout="engine"),
    "openrouter": SourceKind(OpenRouterSourceConfig, "pipeline.generate.sources.http.openrouter:OpenRouterFlight",
                             exact_ids=False, spends=True, layout="async_http",
                             manifest=("model", "provider", "reasoning_style", "reasoning", "send_tools", "sampling")),
}


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
