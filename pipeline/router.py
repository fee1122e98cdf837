"""Which source serves each prompt: a pure, deterministic function of the sample id and the config.

Sources sit in one Ray Data chain (render -> assign -> source 1 -> ... ->
validate -> write). ``assign_sources`` writes each prompt's source into its
``source`` column; each source stage serves only the rows addressed to it and
passes the rest on. Routing is weighted rendezvous hashing: every (sample id,
source) pair gets a hash score scaled by the source's weight and the prompt
goes to the best one, so shares follow the weights, and removing a source
moves only that source's prompts. The same order gives each prompt its
fallbacks: a source that cannot serve a row re-addresses it to the next one
(status ``reroute``); rows re-addressed to a source later in the chain are
served in the same pass, the rest come back to the driver, which re-feeds
them (``reroute_overrides``) until none is left.

Modes: ``shares`` uses the configured weights; ``overflow`` gives each local
source what its capacity (samples/s) serves within ``deadline_s`` and the
sources with role ``overflow`` (an API) the remainder. That split is only the
plan: with ``spill_late`` (default), a prompt still waiting for its local engine
when the deadline passes is spilled to an overflow source instead (status
``reroute``, reason ``<local>: past the overflow deadline``), so a local source
slower than its declared capacity cannot hold the run past the deadline. A
spilled prompt the overflow source cannot serve (budget spent, API down) goes
back to its local source, which then serves it late. Per dataset, the
``sources`` list limits who serves it, and ``tool_prompts`` decides who may
serve prompts that carry tools: ``exact_ids`` (local engines only),
``tools_sent`` (also APIs that send the tools), ``any``.

This module imports only pydantic and the standard library at the top, so
``pipeline.config`` can import ``RoutingConfig`` from here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ToolRule = Literal["any", "exact_ids", "tools_sent"]
API_KINDS = frozenset({"openrouter"})  # ids rebuilt from text; everything else returns engine ids


class SourceRoute(BaseModel):
    """How one source (by name) takes part in routing."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["primary", "overflow"] = "primary"
    weight: float = Field(1.0, ge=0)  # share among the sources of its role (mode shares)
    capacity: float | None = Field(None, gt=0)  # samples/s it sustains (mode overflow, primaries)


class RoutingConfig(BaseModel):
    """The ``routing:`` block of a run config; sources not listed are primaries of weight 1."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["shares", "overflow"] = "shares"
    sources: dict[str, SourceRoute] = Field(default_factory=dict)
    deadline_s: float | None = Field(None, gt=0)  # mode overflow: what the local sources must finish in
    reroute: bool = True  # a prompt its source cannot serve goes to its next source instead of quarantine
    max_hops: int = Field(2, ge=0)  # further sources one prompt may try after its first
    spill_late: bool = True  # mode overflow: prompts a local engine has not started by the deadline go to overflow
    tool_prompts: ToolRule = "any"  # default for prompts that carry tools
    tool_prompts_by_dataset: dict[str, ToolRule] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _overflow_needs_capacity(self) -> RoutingConfig:
        if self.mode == "overflow":
            if self.deadline_s is None:
                raise ValueError("routing.mode overflow needs routing.deadline_s")
            if not any(r.role == "overflow" for r in self.sources.values()):
                raise ValueError("routing.mode overflow needs a source with role: overflow")
        return self


@dataclass(frozen=True)
class SourceInfo:
    """What routing needs to know about one configured source."""

    name: str
    kind: str
    exact_ids: bool
    sends_tools: bool
    role: str = "primary"
    weight: float = 1.0
    capacity: float | None = None


def source_infos(sources: Sequence[Any], routing: RoutingConfig) -> list[SourceInfo]:
    """SourceInfo for each source config (any object with ``name`` and ``kind``), in config order."""
    out = []
    for s in sources:
        route = routing.sources.get(s.name, SourceRoute())
        exact = s.kind not in API_KINDS
        out.append(SourceInfo(s.name, s.kind, exact, exact or bool(getattr(s, "send_tools", False)),
                              route.role, route.weight, route.capacity))
    return out


def check_routing(routing: RoutingConfig, source_names: Sequence[str], dataset_names: Sequence[str]) -> None:
    """Config-time cross checks (call from RunConfig's validator); errors name the offending key."""
    for name in routing.sources:
        if name not in source_names:
            raise ValueError(f"routing.sources names unknown source {name!r} (known: {list(source_names)})")
    for name in routing.tool_prompts_by_dataset:
        if name not in dataset_names:
            raise ValueError(f"routing.tool_prompts_by_dataset names unknown dataset {name!r}")
    if routing.mode == "overflow":
        for name in source_names:
            r = routing.sources.get(name, SourceRoute())
            if r.role == "primary" and r.capacity is None:
                raise ValueError(f"routing.mode overflow: source {name!r} needs a capacity (samples/s)")


# --------------------------------------------------------------------------- pure routing


def unit_hash(sample_id: str, source: str) -> float:
    """A uniform number in (0, 1) fixed by (sample id, source name)."""
    h = int.from_bytes(hashlib.sha256(f"{sample_id}\x1f{source}".encode()).digest()[:8], "big") >> 11
    return (h + 0.5) / 2.0**53


def rank_sources(sample_id: str, weights: Mapping[str, float]) -> list[str]:
    """Sources best first by weighted rendezvous score ``w / -ln(u)``; zero weights last (fallbacks only)."""
    def key(name: str) -> tuple[float, float]:
        u = unit_hash(sample_id, name)
        w = weights[name]
        return (w / -math.log(u) if w > 0 else 0.0, u)

    return sorted(weights, key=key, reverse=True)


def overflow_shares(n_prompts: int, sources: Sequence[SourceInfo], deadline_s: float) -> dict[str, float]:
    """Fraction of prompts per source: locals take capacity x deadline, overflow sources the rest."""
    locals_ = [s for s in sources if s.role == "primary"]
    spill = [s for s in sources if s.role == "overflow"]
    n = max(n_prompts, 1)
    quota = {s.name: (s.capacity or 0.0) * deadline_s for s in locals_}
    total = sum(quota.values())
    shares = dict.fromkeys((s.name for s in sources), 0.0)
    if total >= n or not spill:
        for name, q in quota.items():
            shares[name] = q / total if total > 0 else 1.0 / len(quota)
        return shares
    for name, q in quota.items():
        shares[name] = q / n
    rest = 1.0 - total / n
    spill_w = sum(s.weight for s in spill)
    for s in spill:
        shares[s.name] = rest * (s.weight / spill_w if spill_w > 0 else 1.0 / len(spill))
    return shares


def share_weights(sources: Sequence[SourceInfo], routing: RoutingConfig, n_prompts: int) -> dict[str, float]:
    """Rendezvous weights per source. Shares mode: overflow-role sources only catch re-routes."""
    if routing.mode == "overflow":
        assert routing.deadline_s is not None
        return overflow_shares(n_prompts, sources, routing.deadline_s)
    return {s.name: (s.weight if s.role == "primary" else 0.0) for s in sources}


SPILLED = "past the overflow deadline"


def spilled_from(row: Mapping[str, Any]) -> str | None:
    """The local source a row was spilled from (its reason says so), else None."""
    name, sep, _ = str(row.get("reason") or "").partition(f": {SPILLED}")
    return name if sep and name else None


def _has_tools(row: Mapping[str, Any]) -> bool:
    tools = row.get("tools")
    return bool(tools) and tools not in ("[]", "null")


@dataclass(frozen=True)
class Router:
    """The routing decision for one run (picklable: it travels to the source actors)."""

    sources: tuple[SourceInfo, ...]
    weights: Mapping[str, float]
    allowed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # dataset -> names; absent: all
    tool_rules: Mapping[str, ToolRule] = field(default_factory=dict)
    default_tool_rule: ToolRule = "any"
    reroute: bool = True
    max_hops: int = 2
    spill_at: float | None = None  # wall clock (time.time()) after which local sources spill waiting prompts

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def role(self, name: str) -> str:
        return next((s.role for s in self.sources if s.name == name), "primary")

    def eligible(self, dataset: str, has_tools: bool) -> list[str]:
        """Sources allowed to serve a prompt of this dataset (config order)."""
        allowed = self.allowed.get(dataset)
        out = [s for s in self.sources if allowed is None or s.name in allowed]
        if has_tools:
            rule = self.tool_rules.get(dataset, self.default_tool_rule)
            if rule == "exact_ids":
                out = [s for s in out if s.exact_ids]
            elif rule == "tools_sent":
                out = [s for s in out if s.sends_tools]
        return [s.name for s in out]

    def ranking(self, row: Mapping[str, Any]) -> list[str]:
        """The sources that may serve this prompt, in the order it tries them."""
        names = self.eligible(str(row["dataset"]), _has_tools(row))
        order = rank_sources(str(row["sample_id"]), {n: self.weights.get(n, 0.0) for n in names})
        return order[: 1 + self.max_hops] if self.reroute else order[:1]

    def route(self, row: Mapping[str, Any]) -> str | None:
        order = self.ranking(row)
        return order[0] if order else None

    def next_source(self, row: Mapping[str, Any], current: str) -> str | None:
        """The source after ``current`` in this prompt's order, or None (quarantine).

        A spilled prompt its overflow source cannot serve goes back to the local source it came from.
        """
        origin = spilled_from(row)
        if origin and origin != current:
            return origin
        order = self.ranking(row)
        if current not in order:
            return None
        i = order.index(current)
        return order[i + 1] if i + 1 < len(order) else None

    def spill_target(self, row: Mapping[str, Any], current: str, now: float) -> str | None:
        """The overflow source a prompt waiting at local source ``current`` spills to, or None (serve it).

        Only first-choice prompts (status ok) spill, and only to an overflow source allowed to serve them:
        re-routed prompts have no better place to go.
        """
        if self.spill_at is None or now < self.spill_at or row.get("status") != "ok":
            return None
        if self.role(current) != "primary":
            return None
        spill = [n for n in self.eligible(str(row["dataset"]), _has_tools(row)) if self.role(n) == "overflow"]
        if not spill:
            return None
        return rank_sources(str(row["sample_id"]), {n: max(self.weights.get(n, 0.0), 1e-9) for n in spill})[0]

    def spill(self, row: dict[str, Any], current: str, now: float) -> bool:
        """Spill ``row`` when it is due (see ``spill_target``); True when it was."""
        target = self.spill_target(row, current, now)
        if target is not None:
            row.update(status="reroute", stage="generate", reason=f"{current}: {SPILLED}", source=target)
        return target is not None

    def assign(self, rows: Iterable[Mapping[str, Any]]) -> tuple[dict[str, list[Mapping[str, Any]]],
                                                                 list[Mapping[str, Any]]]:
        """(prompts per source name, prompts no source may serve)."""
        by_source: dict[str, list[Mapping[str, Any]]] = {n: [] for n in self.names}
        unroutable = []
        for r in rows:
            name = self.route(r)
            (by_source[name] if name else unroutable).append(r)
        return by_source, unroutable


def build_router(sources: Sequence[Any], datasets: Sequence[Any], routing: RoutingConfig | None,
                 n_prompts: int, started_at: float | None = None) -> Router:
    """The run's Router from its source configs, dataset configs (``name``, ``sources``) and routing block.

    ``started_at`` (wall clock) starts the overflow deadline; without it nothing spills.
    """
    routing = routing or RoutingConfig()
    check_routing(routing, [s.name for s in sources], [d.name for d in datasets])
    infos = source_infos(sources, routing)
    allowed = {d.name: tuple(d.sources) for d in datasets if getattr(d, "sources", None)}
    spill_at = None
    if routing.mode == "overflow" and routing.spill_late and started_at is not None:
        assert routing.deadline_s is not None
        spill_at = started_at + routing.deadline_s
    return Router(tuple(infos), share_weights(infos, routing, n_prompts), allowed,
                  dict(routing.tool_prompts_by_dataset), routing.tool_prompts, routing.reroute, routing.max_hops,
                  spill_at)


# --------------------------------------------------------------------------- row adapters


def assign_sources(batch: Any, router: Router, overrides: Mapping[str, str] | None = None) -> Any:
    """Ray Data map: write each ok row's source (an override wins: a re-fed re-route); no source -> quarantine."""
    from pipeline.stages import batch_to_rows, mark, rows_to_table

    rows = batch_to_rows(batch)
    for r in rows:
        if r["status"] != "ok":
            continue
        name = (overrides or {}).get(r["sample_id"]) or router.route(r)
        if name is None:
            mark(r, "quarantine", "generate",
                 f"route: no source may serve dataset {r['dataset']!r}"
                 + (" prompts with tools" if _has_tools(r) else ""))
        else:
            r["source"] = name
    return rows_to_table(rows)


def close_unserved(batch: Any) -> Any:
    """Ray Data map at the end of the chain: an ok row no stage generated is quarantined, never written empty."""
    from pipeline.stages import batch_to_rows, mark, rows_to_table

    rows = batch_to_rows(batch)
    for r in rows:
        if r["status"] == "ok" and r.get("output_ids") is None:
            mark(r, "quarantine", "generate", f"route: no stage in the chain served source {r.get('source')!r}")
    return rows_to_table(rows)


def reroute_overrides(rows: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """sample id -> source for rows a pass left in status ``reroute`` (their target came earlier in the chain)."""
    return {str(r["sample_id"]): str(r["source"]) for r in rows if r.get("status") == "reroute"}


OUTCOME_OK = "ok"
OUTCOME_QUARANTINED = ("quarantined", "quarantine")
OUTCOME_NOT_GENERATED = "not_generated"


def merge_outcome(row: dict[str, Any], outcome: Mapping[str, Any], source_name: str,
                  router: Router | None) -> dict[str, Any]:
    """Fold one HTTP-source outcome row into the in-flight row it answered."""
    from pipeline.records import SAMPLE_COLUMNS
    from pipeline.sources.vllm_source import fail_row

    status = outcome["status"]
    error = str(outcome.get("error") or outcome.get("reason") or "")
    for k in ("source_kind", "provider", "model", "ids_from", "sampling"):
        if outcome.get(k) is not None:
            row[k] = outcome[k]
    if status == OUTCOME_OK:
        keep = ("prompt_ids", "prompt_assistant_mask", "sample_id", "dataset", "row_index")
        row.update({k: outcome[k] for k in SAMPLE_COLUMNS if k in outcome and k not in keep})
        row.update(source=source_name, status="ok", stage="",
                   reason=row["reason"] if row.get("status") == "reroute" else "")
    elif status in OUTCOME_QUARANTINED:
        fail_row(row, error or "quarantined by the HTTP source", source_name, router)
    elif status == OUTCOME_NOT_GENERATED:
        nxt = router.next_source(row, source_name) if router is not None else None
        if nxt:
            row.update(status="reroute", stage="generate", reason=f"{source_name}: {error}", source=nxt)
        else:
            row.update(status="not_generated", stage="generate", reason=error, source=source_name)
    else:
        raise ValueError(f"unknown outcome status {status!r} from source {source_name!r}")
    return row


class OpenRouterFlight:
    """The HTTP source in the in-flight row contract: serves its routed rows, passes the rest on."""

    def __init__(self, cfg: Any, profile: str, model_dir: str | None, ledger: Any, sampling: Any,
                 source_name: str, router: Router | None) -> None:
        from pipeline.sources.openrouter import OpenRouterGenerator

        self.name = source_name
        self.router = router
        self.inner = OpenRouterGenerator(cfg, profile, model_dir, ledger, sampling=sampling, source_name=source_name)

    async def __call__(self, batch: Any) -> Any:
        from pipeline.sources.vllm_source import serves
        from pipeline.stages import batch_to_rows, rows_to_table

        rows = batch_to_rows(batch)
        todo = [r for r in rows if serves(r, self.name)]
        if todo:
            outcomes = (await self.inner(todo)).to_pylist()
            for r, o in zip(todo, outcomes, strict=True):
                merge_outcome(r, o, self.name, self.router)
        return rows_to_table(rows)


# --------------------------------------------------------------------------- Ray Data wiring


def chain_batch_size(batch_size: int, share: float, cap: int = 8) -> int:
    """A stage sees every row but serves only its share: widen its batches so the engine still gets full ones."""
    if share <= 0:
        return batch_size
    return max(batch_size, min(batch_size * cap, math.ceil(batch_size / share)))


def map_source(ds: Any, src: Any, *, model_dir: str, profile: str, sampling: Mapping[str, Any], router: Router,
               ledger: Any | None = None) -> Any:
    """Append one source stage to the chain.

    Scaling: an actor pool of ``num_actors``..``max_actors``; Ray Data adds actors while the stage's input
    queue is backed up and resources are free, and each actor starts its engine once. Backpressure: an engine
    actor holds at most two batches (the one generating and the next), so generation never outruns
    validate/write by more than that; Ray Data's streaming executor bounds the rest through
    ``DataContext.execution_options.resource_limits`` (e.g. ``object_store_memory``). Engine batches should
    be large enough to fill continuous batching (about ``max_num_seqs`` on a GPU); HTTP stages keep
    ``max_concurrent_batches`` batches in flight per actor instead.
    """
    import ray.data

    from pipeline.sources.vllm_source import engine_resources

    total = sum(router.weights.values()) or 1.0
    share = router.weights.get(src.name, 0.0) / total
    batch = chain_batch_size(int(src.batch_size), share)
    cfg = src.model_dump()
    min_actors = int(getattr(src, "num_actors", 1))
    max_actors = max(int(getattr(src, "max_actors", None) or 0), min_actors)
    if src.kind == "openrouter":
        compute = ray.data.ActorPoolStrategy(min_size=min_actors, max_size=max_actors,
                                             max_concurrent_calls_per_actor=src.max_concurrent_batches)
        return ds.map_batches(OpenRouterFlight, fn_constructor_args=(src, profile, model_dir, ledger,
                                                                     dict(sampling), src.name, router),
                              batch_size=batch, batch_format="pyarrow", compute=compute, num_cpus=src.num_cpus)
    if src.kind == "vllm":
        from pipeline.sources.vllm_source import VLLMGenerator as cls
    elif src.kind == "sglang":
        from pipeline.sources.sglang_source import SGLangGenerator as cls
    elif src.kind == "transformers":
        from pipeline.sources.transformers_source import TransformersGenerator as cls
    else:
        raise ValueError(f"unknown source kind {src.kind!r}")
    # Two batches queued per actor: the next is ready when the engine finishes one, and no more (backpressure).
    compute = ray.data.ActorPoolStrategy(min_size=min_actors, max_size=max_actors, max_tasks_in_flight_per_actor=2)
    return ds.map_batches(cls, fn_constructor_args=(model_dir, profile, dict(sampling), cfg, src.name, router),
                          batch_size=batch, batch_format="pyarrow", compute=compute,
                          **engine_resources(cfg, ray_tp=src.kind == "vllm"))


def map_routed(ds: Any, sources: Sequence[Any], *, model_dir: str, profile: str, sampling: Mapping[str, Any],
               router: Router, ledgers: Mapping[str, Any] | None = None,
               overrides: Mapping[str, str] | None = None) -> Any:
    """Rendered rows in, generated rows out: assign each row its source, then every source stage in config order.

    HTTP sources without a ledger in ``ledgers`` get a fresh one. Rows a pass leaves in status ``reroute`` go
    to the next pass with ``overrides=reroute_overrides(rows)``.
    """
    ledgers = dict(ledgers or {})
    # Primaries first: prompts re-routed or spilled to an overflow source are then served in the same pass.
    sources = sorted(sources, key=lambda s: router.role(s.name) == "overflow")
    ds = ds.map_batches(assign_sources, fn_kwargs={"router": router, "overrides": dict(overrides or {})},
                        batch_format="pyarrow", num_cpus=0)
    for src in sources:
        ledger = None
        if src.kind in API_KINDS:
            if src.name not in ledgers:
                from pipeline.sources.openrouter import ledger_for

                ledgers[src.name] = ledger_for(src)
            ledger = ledgers[src.name]
        ds = map_source(ds, src, model_dir=model_dir, profile=profile, sampling=sampling, router=router,
                        ledger=ledger)
    return ds.map_batches(close_unserved, batch_format="pyarrow", num_cpus=0)
