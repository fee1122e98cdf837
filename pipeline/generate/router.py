"""Which source serves each prompt: a pure, deterministic function of the sample id and the config.

Sources sit in one Ray Data chain (render and assign -> source 1 -> ... ->
close and validate -> write). ``assign_sources`` writes each prompt's source into its
``source`` column (in the render actors); each source stage serves only the rows addressed to it and
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

This module is pure policy: no Ray, no I/O. The Ray Data chain that applies it
lives in pipeline.generate.sources.chain; the ``routing:`` schema in pipeline.base.config.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.base.config import RoutingConfig, SourceRoute, ToolRule, check_routing, may_serve
from pipeline.generate.sources.registry import source_kind


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
    """SourceInfo for each source config, in config order."""
    out = []
    for s in sources:
        route = routing.sources.get(s.name, SourceRoute())
        exact = source_kind(s).exact_ids
        out.append(SourceInfo(s.name, s.kind, exact, exact or s.tools_sent(),
                              route.role, route.weight, route.capacity))
    return out


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


def has_tools(row: Mapping[str, Any]) -> bool:
    tools = row.get("tools")
    return bool(tools) and tools not in ("[]", "null")


@dataclass(frozen=True)
class Router:
    """The routing decision for one run (picklable: it travels to the source actors)."""

    sources: tuple[SourceInfo, ...]
    weights: Mapping[str, float]
    # dataset -> the names its `sources:` lists; absent: every source (pipeline.base.config.may_serve)
    allowed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
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
        out = [s for s in self.sources if may_serve(allowed, s.name)]
        if has_tools:
            rule = self.tool_rules.get(dataset, self.default_tool_rule)
            if rule == "exact_ids":
                out = [s for s in out if s.exact_ids]
            elif rule == "tools_sent":
                out = [s for s in out if s.sends_tools]
        return [s.name for s in out]

    def ranking(self, row: Mapping[str, Any]) -> list[str]:
        """The sources that may serve this prompt, in the order it tries them."""
        names = self.eligible(str(row["dataset"]), has_tools(row))
        order = rank_sources(str(row["sample_id"]), {n: self.weights.get(n, 0.0) for n in names})
        return order[: 1 + self.max_hops] if self.reroute else order[:1]

    def route(self, row: Mapping[str, Any]) -> str | None:
        order = self.ranking(row)
        return order[0] if order else None

    def next_source(self, row: Mapping[str, Any], current: str) -> str | None:
        """The source after ``current`` in this prompt's order, or None (quarantine).

        A spilled prompt its overflow source cannot serve goes back to the local source it came from.
        """
        origin = row.get("spilled_from")
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
        spill = [n for n in self.eligible(str(row["dataset"]), has_tools(row)) if self.role(n) == "overflow"]
        if not spill:
            return None
        return rank_sources(str(row["sample_id"]), {n: max(self.weights.get(n, 0.0), 1e-9) for n in spill})[0]

    def spill(self, row: dict[str, Any], current: str, now: float) -> bool:
        """Spill ``row`` when it is due (see ``spill_target``); True when it was."""
        target = self.spill_target(row, current, now)
        if target is not None:
            row.update(status="reroute", stage="generate", reason=f"{current}: {SPILLED}", source=target,
                       spilled_from=current)
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
    # an empty list stays empty (no source), as the budget check reads it: never "any source"
    allowed = {d.name: tuple(d.sources) for d in datasets if getattr(d, "sources", None) is not None}
    spill_at = None
    if routing.mode == "overflow" and routing.spill_late and started_at is not None:
        assert routing.deadline_s is not None
        spill_at = started_at + routing.deadline_s
    return Router(tuple(infos), share_weights(infos, routing, n_prompts), allowed,
                  dict(routing.tool_prompts_by_dataset), routing.tool_prompts, routing.reroute, routing.max_hops,
                  spill_at)
