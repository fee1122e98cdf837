"""The Ray Data wiring of the sources: one chain render -> assign -> source 1 -> ... -> source n.

``assign_sources`` writes each prompt's source (the router's choice) into its
``source`` column; each source stage serves only the rows addressed to it and
passes the rest on; ``close_unserved`` makes sure no ok row leaves the chain
without output. Rows a stage hands to a source that sits earlier in the chain
come back in status ``reroute``; the driver feeds them to one more pass with
``reroute_overrides``. Which class serves a kind, and how its actors take
resources, comes from the registry (pipeline.generate.sources.registry).

Scaling: each source is an actor pool of ``num_actors``..``max_actors``; Ray Data
adds actors while the stage's input queue is backed up and resources are free,
and each actor starts its engine once. Backpressure: an engine actor holds at
most two batches (the one generating and the next), so generation never outruns
validate/write by more than that; Ray Data's streaming executor bounds the rest
through ``DataContext.execution_options.resource_limits``. HTTP stages keep
``max_concurrent_batches`` batches in flight per actor instead.

GPU placement (layout ``engine``): one GPU per actor for tensor_parallel_size 1;
for TP > 1 the actor itself holds no GPU and gets a placement group of TP
bundles (``{"GPU": 1, "CPU": 1}``, STRICT_PACK: one node) whose bundles the
engine's Ray executor fills with its TP workers. Layout ``engine_forks`` (SGLang)
gives the actor all TP GPUs, since the engine forks its workers itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import pyarrow as pa

from pipeline.base.config import ExtractionConfig, SamplingConfig
from pipeline.base.flight import as_flight, marked, with_column
from pipeline.base.layout import RunLayout
from pipeline.generate.router import Router, has_tools
from pipeline.generate.sources.engines.config import EngineSourceConfig
from pipeline.generate.sources.registry import engine_actor_names, source_kind

# Actors of each routing stage (assign_sources, close_unserved). As Ray tasks of no CPU, Ray Data ran one per
# queued block and Ray started a worker process for each, then killed it when it idled past the worker pool's
# soft limit (one per CPU, which the stage actors already fill): measured at 50,000 prompts on 2 cores, 68 worker
# processes before the first answer, and ~4 started and killed every 10 s after it. An actor asks no CPU either
# and lives for the pass; each call is a column scan of its block, so one keeps up with any source.
ROUTE_ACTORS = 1
_PLACEMENT_GROUPS: list[Any] = []  # created in this (driver) process by placement_strategy

# An engine actor stops its engine itself when Ray Data retires it (EngineSource.__del__, run from the actor's
# __ray_shutdown__). Ray would otherwise SIGKILL the actor's child processes first: the engine's processes and
# Python's multiprocessing resource tracker, which then comes back mid-cleanup and prints a KeyError traceback
# per shared-memory segment. (An actor that dies abruptly is not affected: Ray kills nothing then either, and
# the engine's processes exit when their parent is gone.) Merged into the job's runtime env, not replacing it.
# vLLM's workers get 30 s rather than 5 to exit when the engine stops (see vllm_source.STOP_TIMEOUT_S).
ENGINE_ACTOR_ENV = {"env_vars": {"RAY_kill_child_processes_on_worker_exit": "false",
                                 "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30"}}

# How often a stage actor whose process died (a segfault, the OOM killer, a lost node) is brought back, and its
# batches re-run. Ray Data 2.60 defaults both to -1, without end (ActorPoolMapOperator._apply_default_remote_args
# fills them only when absent), so one batch that kills its process ran the job forever. Here an actor may come
# back 4 times over its life: past that it stays dead, its batch fails the dataset, and the run ends
# (``StageDied``, exit 3) with what it wrote kept and the rest left to do. A task's retries stay unbounded: while a
# lost node's actor is restarted elsewhere (or waits for a node), every try of its batch fails as "temporarily
# unavailable", and a bound there ended runs a lost node should only have slowed. Given to
# every ``map_batches`` of the chain and the run's stage pools as extra remote args, the only form Ray Data 2.60
# takes them in (it warns that form goes in 2.64, which names no successor yet: revisit on upgrading).
ACTOR_FAULTS: dict[str, int] = {"max_restarts": 4, "max_task_retries": -1}

UNROUTED = "route: no source may serve it"  # the reason's start for a prompt the routing gives no source
UNROUTED_CLASS = "config"  # its failure_class: the config's fault, left to do (Tally.unrouted reports it)

# The words the run's messages use for the stage actors that are not sources (Ray names an actor by its class).
STAGE_WORDS = {"RenderPrompts": "render", "ValidateSamples": "validate", "WriteShards": "writer",
               "AssignSources": "routing", "CloseUnserved": "routing"}


class StageDied(RuntimeError):
    """A stage actor's process died more often than ``ACTOR_FAULTS`` allows: the run stops, what it wrote stays
    written and every other prompt is left to do (exit 3), rather than re-running the batch forever."""


def actor_death(error: BaseException) -> BaseException | None:
    """The Ray actor failure (``RayActorError``: the process died or went unreachable) in ``error`` or the
    errors it wraps, or None: only such a failure means a stage process is gone, not a bug to show as one."""
    from ray.exceptions import RayActorError

    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RayActorError):
            return e
        cause = getattr(e, "cause", None)  # RayTaskError wraps the task's error here
        todo += [e.__cause__, e.__context__, cause if isinstance(cause, BaseException) else None]
    return None


def actor_class_of(message: str) -> str | None:
    """The stage class in a Ray actor error's text (``class_name: MapWorker(MapBatches(X))``), or None."""
    found = re.search(r"MapBatches\((\w+)\)", message)
    return found.group(1) if found else None


def stage_label(class_name: str | None, sources: Sequence[Any]) -> str:
    """What a message calls the stage whose actor is of class ``class_name``: its source names (every source of
    that kind: Ray names the class, not the source) or the stage's word."""
    if class_name is None:
        return "a stage actor"
    names = [s.name for s in sources if source_kind(s).actor_class_name == class_name]
    if names:
        return f"source {', '.join(repr(n) for n in names)} ({class_name})"
    return f"stage {STAGE_WORDS.get(class_name, class_name)!r} ({class_name})"


def placement_strategy(bundles: int, bundle_resources: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Ray remote args putting one actor and its engine's TP workers in one placement group on one node.

    Ray Data calls this in the driver for every actor it starts; the group outlives its actor, so
    the driver removes them all with `release_placement_groups` when the dataset has run.
    ``bundle_resources``: custom resources added to every bundle (e.g. ``{"h200": 1}``)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.placement_group([{"GPU": 1, "CPU": 1, **(bundle_resources or {})}] * bundles,
                                  strategy="STRICT_PACK")
    _PLACEMENT_GROUPS.append(pg)
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)}


def release_placement_groups() -> int:
    """Remove the placement groups this process created for engine actors; returns how many."""
    from ray.util.placement_group import remove_placement_group

    n = 0
    while _PLACEMENT_GROUPS:
        remove_placement_group(_PLACEMENT_GROUPS.pop())
        n += 1
    return n


def wait_for_retired_engines(also: Iterable[str] = (), timeout_s: float = 30.0, poll_s: float = 0.5) -> int:
    """Wait until this job's engine actors (generators, extractors) have exited; return how many were still
    alive at the timeout.

    Ray Data retires an actor by dropping its handle; the actor then stops its engine in
    ``__ray_shutdown__`` (ENGINE_ACTOR_ENV), which takes seconds on a loaded machine. A driver that exits
    first takes a local Ray down with it and kills the engines mid-cleanup (resource-tracker tracebacks in
    the logs, shared memory left behind). Best effort: without the state API this returns at once.
    """
    import time

    import ray
    from ray.util.state import list_actors

    # The registry's engine actor classes (Ray Data names an actor ``MapWorker(MapBatches(<class>))``), and
    # ``also``: the extraction's, which a floor below hidden/ does not know.
    engines = engine_actor_names() | set(also)
    job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            alive = [a for a in list_actors(filters=[("state", "=", "ALIVE"), ("job_id", "=", job)], limit=10_000,
                                            raise_on_missing_output=False)
                     if any(f"({name})" in a.class_name for name in engines)]
        except Exception:
            return 0
        if not alive or time.monotonic() >= deadline:
            return len(alive)
        time.sleep(poll_s)


def engine_resources(cfg: EngineSourceConfig | ExtractionConfig, *, ray_tp: bool = True) -> dict[str, Any]:
    """``map_batches`` resource arguments for an engine actor (see the module doc for TP > 1); the
    extraction actor of an engine backend (pipeline.hidden.handoff) is placed the same way.

    ``ray_tp``: the engine spreads TP workers as Ray tasks (vLLM); False when it
    forks them itself on the actor's GPUs (SGLang), so the actor holds all TP GPUs.
    ``cfg.resources`` (custom resources) go to the actor, or split evenly over the TP bundles.
    """
    tp = cfg.tensor_parallel_size
    custom = {"resources": dict(cfg.resources)} if cfg.resources else {}
    if cfg.num_gpus <= 0:
        return {"num_cpus": cfg.num_cpus, **custom}
    if tp == 1 or not ray_tp:
        return {"num_cpus": cfg.num_cpus, "num_gpus": max(cfg.num_gpus, float(tp)), **custom}
    per_bundle = {k: v / tp for k, v in cfg.resources.items()}
    fn = partial(placement_strategy, tp, per_bundle) if per_bundle else partial(placement_strategy, tp)
    return {"num_cpus": 0, "num_gpus": 0, "ray_remote_args_fn": fn}


def chain_batch_size(batch_size: int, share: float, cap: int = 8) -> int:
    """A stage sees every row but serves only its share: widen its batches so the engine still gets full ones."""
    if share <= 0:
        return batch_size
    return max(batch_size, min(batch_size * cap, math.ceil(batch_size / share)))


# --------------------------------------------------------------------------- row maps


def assign_sources(batch: pa.Table, router: Router, overrides: Mapping[str, str] | None = None) -> pa.Table:
    """Write each ok row's source (an override wins: a re-fed re-route); a row no source may serve is left to
    do (``failure_class`` ``config``, the reason naming the routing key): the routing is at fault, not the
    prompt, so the re-run after the config is fixed generates it.

    Reads the four columns routing needs and replaces ``source`` (and the marks of an unroutable row): the
    prompts and answers in the block are never turned into Python objects."""
    batch = as_flight(batch)
    overrides = overrides or {}
    status, ids, datasets, tools, sources = (batch.column(c).to_pylist()
                                             for c in ("status", "sample_id", "dataset", "tools", "source"))
    lost: list[int] = []
    reasons: list[str] = []
    for i, st in enumerate(status):
        if st != "ok":
            continue
        row = {"sample_id": ids[i], "dataset": datasets[i], "tools": tools[i]}
        name = overrides.get(ids[i]) or router.route(row)
        if name is None:
            lost.append(i)
            reasons.append(unroutable_reason(router, str(datasets[i]), has_tools(row)))
        else:
            sources[i] = name
    batch = with_column(batch, "source", sources)
    if not lost:
        return batch
    classes = batch.column("failure_class").to_pylist()
    for i in lost:
        classes[i] = UNROUTED_CLASS
    return with_column(marked(batch, lost, "not_generated", "generate", reasons), "failure_class", classes)


def unroutable_reason(router: Router, dataset: str, tools: bool) -> str:
    """Why no source may serve a prompt of ``dataset``, naming the config key to change."""
    allowed = router.allowed.get(dataset)
    if allowed is not None and not router.eligible(dataset, False):
        return (f"{UNROUTED}: dataset {dataset!r}'s sources: ({', '.join(allowed) or 'an empty list'}) names no "
                "source of this run")
    if tools:
        key = (f"routing.tool_prompts_by_dataset[{dataset!r}]" if dataset in router.tool_rules
               else "routing.tool_prompts")
        rule = router.tool_rules.get(dataset, router.default_tool_rule)
        return f"{UNROUTED}: {key} is {rule!r}, and no source of dataset {dataset!r} qualifies for prompts with tools"
    return f"{UNROUTED}: no source may serve dataset {dataset!r}"


def close_unserved(batch: pa.Table) -> pa.Table:
    """The end of the chain: an ok row no stage generated is quarantined, never written empty.

    A column scan: the usual block, every ok row generated, passes through as it came."""
    import pyarrow.compute as pc

    batch = as_flight(batch)
    unserved = pc.fill_null(pc.and_(pc.equal(batch.column("status"), "ok"), pc.is_null(batch.column("output_ids"))),
                            False)
    if not pc.any(unserved).as_py():
        return batch
    rows = [i for i, u in enumerate(unserved.to_pylist()) if u]
    sources = batch.column("source").to_pylist()
    return marked(batch, rows, "quarantine", "generate",
                  [f"route: no stage in the chain served source {sources[i]!r}" for i in rows])


class AssignSources:
    """``assign_sources`` as a stage actor (the routing of one pass)."""

    def __init__(self, router: Router, overrides: Mapping[str, str]) -> None:
        self.router, self.overrides = router, dict(overrides)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return assign_sources(batch, self.router, self.overrides)


class CloseUnserved:
    """``close_unserved`` as a stage actor."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        return close_unserved(batch)


def reroute_overrides(rows: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """sample id -> source for rows a pass left in status ``reroute`` (their target came earlier in the chain)."""
    return {str(r["sample_id"]): str(r["source"]) for r in rows if r.get("status") == "reroute"}


# --------------------------------------------------------------------------- stages


def map_source(ds: Any, src: Any, *, model_dir: str, profile: str, sampling: SamplingConfig, router: Router,
               ledger: Any | None = None, layout: RunLayout | None = None,
               replay: Mapping[str, str] | None = None) -> Any:
    """Append one source stage (the registry's actor class for its kind) to the chain.

    A spending source's actors also get its budget ``ledger`` and the run folder: they journal their responses
    there and, before sending, read what any actor of the folder was billed for. ``replay`` (tests) replaces
    that with a fixed set (sample id -> record JSON).
    """
    import ray.data

    kind = source_kind(src)
    total = sum(router.weights.values()) or 1.0
    batch = chain_batch_size(src.batch_size, router.weights.get(src.name, 0.0) / total)
    min_actors = src.num_actors
    max_actors = max(src.max_actors or 0, min_actors)
    # A spending source journals into the run folder; an engine notes there the batch in its engine's hands.
    kwargs = {"ledger": ledger, "layout": layout, "replay": dict(replay) if replay else None} \
        if kind.spends else {"layout": layout}
    if kind.layout == "async_http":
        compute = ray.data.ActorPoolStrategy(min_size=min_actors, max_size=max_actors,
                                             max_concurrent_calls_per_actor=src.max_concurrent_batches)
        resources: dict[str, Any] = {"num_cpus": src.num_cpus}
        if src.resources:
            resources["resources"] = dict(src.resources)
    else:
        # Two batches queued per actor: the next is ready when the engine finishes one, and no more (backpressure).
        compute = ray.data.ActorPoolStrategy(min_size=min_actors, max_size=max_actors, max_tasks_in_flight_per_actor=2)
        resources = engine_resources(src, ray_tp=kind.layout == "engine") | {"runtime_env": ENGINE_ACTOR_ENV}
    return ds.map_batches(kind.actor_class(), fn_constructor_args=(model_dir, profile, sampling, src, router),
                          fn_constructor_kwargs=kwargs, batch_size=batch, batch_format="pyarrow", compute=compute,
                          **resources, **ACTOR_FAULTS)


def map_routed(ds: Any, sources: Sequence[Any], *, model_dir: str, profile: str, sampling: SamplingConfig,
               router: Router, ledgers: Mapping[str, Any] | None = None,
               overrides: Mapping[str, str] | None = None, layout: RunLayout | None = None,
               replays: Mapping[str, Mapping[str, str]] | None = None) -> Any:
    """Rendered rows in, generated rows out: assign each row its source, every source stage, then close the
    chain (``close_unserved``), each end as a zero-CPU actor of its own.

    Rows a pass leaves in status ``reroute`` go to the next pass with ``overrides=reroute_overrides(rows)``.
    The run itself routes in its render actors and closes in its validate actors (``RenderPrompts``,
    ``ValidateSamples``): two processes fewer to start before the first answer, two block hand-offs fewer.
    """
    import ray.data

    routing = {"batch_format": "pyarrow", "num_cpus": 0,
               "compute": ray.data.ActorPoolStrategy(size=ROUTE_ACTORS), **ACTOR_FAULTS}
    ds = ds.map_batches(AssignSources, fn_constructor_args=(router, dict(overrides or {})), **routing)
    ds = map_sources(ds, sources, model_dir=model_dir, profile=profile, sampling=sampling, router=router,
                     ledgers=ledgers, layout=layout, replays=replays)
    return ds.map_batches(CloseUnserved, **routing)


def map_sources(ds: Any, sources: Sequence[Any], *, model_dir: str, profile: str, sampling: SamplingConfig,
                router: Router, ledgers: Mapping[str, Any] | None = None, layout: RunLayout | None = None,
                replays: Mapping[str, Mapping[str, str]] | None = None) -> Any:
    """Routed rows in (``assign_sources`` wrote each one's source), every source stage appended, primaries
    first. Sources that spend and have no ledger in ``ledgers`` get a fresh one."""
    from pipeline.generate.ledger import ledger_for

    ledgers = dict(ledgers or {})
    # Primaries first: prompts re-routed or spilled to an overflow source are then served in the same pass.
    sources = sorted(sources, key=lambda s: router.role(s.name) == "overflow")
    for src in sources:
        ledger = None
        if source_kind(src).spends:
            if src.name not in ledgers:
                ledgers[src.name] = ledger_for(src)
            ledger = ledgers[src.name]
        ds = map_source(ds, src, model_dir=model_dir, profile=profile, sampling=sampling, router=router,
                        ledger=ledger, layout=layout, replay=(replays or {}).get(src.name))
    return ds
