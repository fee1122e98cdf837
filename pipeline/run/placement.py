"""No node, no wait: every actor pool the run will start must fit on some node, or the run says so and stops.

Ray Data waits for an actor it cannot place until its own no-progress timeout
(~30 minutes), holding every other node meanwhile. Before anything starts, the
driver compares what one actor of each pool needs (CPU, GPU, custom resources;
a TP > 1 engine needs its TP GPUs on one node) with what each alive node has in
all. A pool that fits nowhere is given ``placement_timeout_s`` for a node to
join (an autoscaler is asked for it meanwhile); after that the run stops with
exit 3 naming the missing resources, its prompts left to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.base.config import ExtractionConfig, engine_actor_resources

if TYPE_CHECKING:
    from pipeline.run.config import RunConfig

log = logging.getLogger(__name__)


class NoPlacement(RuntimeError):
    """An actor pool of the run fits on no node of the cluster; its prompts stay to do (exit 3)."""


@dataclass(frozen=True)
class Demand:
    """What one actor of a pool needs on one node."""

    stage: str
    resources: Mapping[str, float]

    def describe(self) -> str:
        need = ", ".join(f"{k} {v:g}" for k, v in sorted(self.resources.items()) if v)
        return f"{self.stage} needs {need or 'nothing'} on one node"


def engine_demand(stage: str, cfg: ExtractionConfig) -> Demand:
    """The extraction's engine actor: its GPUs, TP ones included, on one node."""
    return Demand(stage, engine_actor_resources(cfg.num_cpus, cfg.num_gpus, cfg.tensor_parallel_size, cfg.resources))


def source_demands(cfg: RunConfig) -> list[Demand]:
    """One demand per source's actor pool (what generation starts): each schema says what one actor needs."""
    return [Demand(f"source {src.name!r}", src.actor_resources()) for src in cfg.sources]


def extraction_demands(cfg: RunConfig) -> list[Demand]:
    """The extraction actor, checked when extraction starts: its GPU nodes may join only after generation."""
    return [engine_demand("extraction", cfg.extraction)] if cfg.training is not None else []


def fits(demand: Demand, node: Mapping[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in demand.resources.items() if v > 0)


def unplaceable(demands: Sequence[Demand], nodes: Sequence[Mapping[str, float]]) -> list[Demand]:
    """The demands no node can meet (pure: ``nodes`` are the alive nodes' total resources)."""
    return [d for d in demands if not any(fits(d, n) for n in nodes)]


def missing(demand: Demand, nodes: Sequence[Mapping[str, float]]) -> str:
    """What the closest node lacks, for the message: ``GPU 1 (most on a node: 0)``."""
    parts = []
    for k, v in sorted(demand.resources.items()):
        most = max((n.get(k, 0.0) for n in nodes), default=0.0)
        if v > 0 and most < v:
            parts.append(f"{k} {v:g} (most on one node: {most:g})")
    return ", ".join(parts) or "their combination on one node"


def alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]


def wait_for_placement(demands: Sequence[Demand], timeout_s: float, *, poll_s: float = 2.0,
                       nodes: Callable[[], list[dict[str, float]]] = alive_nodes,
                       ask: Callable[[Sequence[Demand]], None] | None = None) -> None:
    """Return once every demand fits some alive node; raise :class:`NoPlacement` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    asked = False
    while True:
        current = nodes()
        left = unplaceable(demands, current)
        if not left:
            if asked:
                (ask or _ask_autoscaler)([])  # the pools ask for themselves from here
            return
        if not asked:
            log.warning("no node fits %s yet; waiting up to %.0fs for one to join",
                        "; ".join(d.describe() for d in left), timeout_s)
            (ask or _ask_autoscaler)(left)
            asked = True
        if time.monotonic() >= deadline:
            (ask or _ask_autoscaler)([])
            lines = [f"{d.stage}: no node has {missing(d, current)}" for d in left]
            raise NoPlacement("cannot place " + "; ".join(lines) + f" (waited {timeout_s:g}s for a node; add one "
                              "with these resources, or lower the stage's resources in the config)")
        time.sleep(poll_s)


def _ask_autoscaler(demands: Sequence[Demand]) -> None:
    """Ask an autoscaler (if the cluster has one) for a node per missing demand (none: withdraw the request);
    a no-op without one."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[{k: v for k, v in d.resources.items() if v > 0} for d in demands])
    except Exception:  # noqa: BLE001 - no autoscaler (a local Ray): nothing to ask
        log.debug("no autoscaler to ask for resources", exc_info=True)
