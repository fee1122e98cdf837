"""The main job, one phase per call: read -> generate -> write -> extract -> train -> report.

``run`` reads as that sentence. The prompts come from pipeline.prompts (read in the workers);
the Ray Data stages the phases wire together live in pipeline.generate (stages, sources); the
hand-off to training in pipeline.hidden.handoff; the report in pipeline.report; every path of the
output folder in pipeline.base.layout.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from pipeline.base.console import (
    Console,
    GenerateSnapshot,
    describe_source,
    describe_training,
    duration,
    generate_line,
    header_lines,
)
from pipeline.base.layout import RunLayout, atomic_write_json
from pipeline.base.records import read_rows, shard_tables
from pipeline.base.run_lock import RunLock, current_lock, on_lock_lost
from pipeline.checks.validate import assert_conservation
from pipeline.generate.ledger import halt, read_spend
from pipeline.generate.sources.registry import source_kind, spending_sources
from pipeline.generate.stages import RenderPrompts, ValidateSamples, WriteShards, pool_bounds
from pipeline.hidden.handoff import HANDOFFS, extract_and_train
from pipeline.prompts.read import (
    TO_DO,
    IndexPass,
    PromptSet,
    check_prompt_files,
    current_ids,
    pass_dataset,
    read_finished_ids,
    reroute_prompts,
    rows_upper_bound,
    start_index,
)
from pipeline.report.costs import engine_prices
from pipeline.report.publish import publish_report
from pipeline.report.summary import (
    Tally,
    Timings,
    audit_for,
    extraction_quarantine,
    format_report,
    ledger_report,
    source_report,
    summarize,
    throughput,
    with_extraction_quarantine,
)
from pipeline.run.config import RunConfig
from pipeline.run.manifest import check_or_write_manifest

log = logging.getLogger("pipeline")


def run(cfg: RunConfig, console: Console | None = None) -> dict[str, Any]:
    """Run the whole job and return its report (also written to OUTPUT/report.json).

    One writer per output folder: a second driver on the same folder stops here (``LockHeld``) before
    anything starts or is spent. ``console`` shows the header, each phase's progress and the report (default:
    plain lines on stdout); one made by ``Console.for_cli`` also sends every log to ``OUTPUT/logs/``.
    """
    layout = RunLayout(cfg.output_dir)
    prepare_output(layout)
    console = console or Console()
    with RunLock.for_folder(layout.root, **lock_timing()), run_logs(layout, console):
        return _run(cfg, layout, console)


def lock_timing() -> dict[str, float]:
    """The run lock's heartbeat and staleness: 10 s and 60 s, or ``PIPELINE_LOCK_HEARTBEAT_S`` and
    ``PIPELINE_LOCK_STALE_S`` (a filesystem slower to show writes needs a longer staleness; tests a shorter)."""
    from pipeline.base.config import ConfigError

    out = {"heartbeat_s": 10.0, "stale_after_s": 60.0}
    for key, var in (("heartbeat_s", "PIPELINE_LOCK_HEARTBEAT_S"), ("stale_after_s", "PIPELINE_LOCK_STALE_S")):
        if os.environ.get(var):
            try:
                out[key] = float(os.environ[var])
            except ValueError:
                raise ConfigError(f"{var}={os.environ[var]!r} is not a number of seconds") from None
    if not 0 < out["heartbeat_s"] < out["stale_after_s"]:
        raise ConfigError(f"the run lock needs 0 < PIPELINE_LOCK_HEARTBEAT_S < PIPELINE_LOCK_STALE_S, not {out}")
    return out


def run_logs(layout: RunLayout, console: Console) -> AbstractContextManager[Any]:
    """Logs to ``OUTPUT/logs/`` (pipeline.base.logs) for a console that asks for it (the CLI's), after the lock: a
    refused second driver must not write into the logs of the run that holds the folder."""
    from pipeline.base.logs import capture

    return capture(layout.logs, verbose=console.verbose, console=console) if console.capture else nullcontext()


def _run(cfg: RunConfig, layout: RunLayout, console: Console) -> dict[str, Any]:
    from pipeline.base.logs import adopt_transformers_logging
    from pipeline.generate.sources.chain import wait_for_retired_engines
    from pipeline.generate.sources.engines.deaths import clear_batch_notes
    from pipeline.hidden.extract import HiddenStateExtractor
    from pipeline.run.shared_paths import check_shared_paths

    timings = Timings()
    t_all = time.perf_counter()
    if cfg.model.build_tiny:
        from pipeline.demo.tiny_model import build_tiny_target, is_built

        variant = cfg.model.tiny_variant
        if not is_built(cfg.model.path, variant):  # minutes for a trained variant on 2 cores, before the header
            with console.phase(lambda final: f"[build] the tiny {variant} target in {cfg.model.path}"
                               + (": done" if final else ""), announce=True):
                build_tiny_target(cfg.model.path, variant=variant)
        adopt_transformers_logging()
    # before Ray starts: a folder written with other settings must fail in a second, not after start-up
    check_or_write_manifest(cfg, layout.root, has_samples=has_finished_rows(layout))
    check_api_keys(cfg)
    check_budget_journals(cfg, layout)
    check_prompt_files(cfg)  # a dataset file or a shard that cannot be read stops the run here, before Ray
    clear_batch_notes(layout)  # no engine of an earlier run is alive: its notes hold no death of a prompt
    done = finished_ids(layout)
    t0 = time.perf_counter()
    init_ray(cfg)
    timings.add("ray_init", t0)
    check_shared_paths(cfg, layout)  # several nodes: each sees the folder and files as the driver does
    t0 = time.perf_counter()
    prompts, index = read_prompts(cfg, layout, done)  # the index pass: Ray tasks read the files
    # A fresh run generates while its index pass parses (its time grows with the prompts); a resume counts first
    counts = rows_upper_bound(cfg) if prompts.estimated else index.counts()
    counts["resumed_done"] = len(done)
    timings.add("read", t0)
    console.line("\n".join(header_lines(
        console.title or str(layout.root), [(d.name, counts[f"{d.name}.rows"]) for d in cfg.datasets],
        [describe_source(s) for s in cfg.sources], layout.root, counts["resumed_done"], len(prompts),
        layout.logs if console.capture else None, describe_training(cfg.training, "training" in cfg.model_fields_set),
        estimated=prompts.estimated)))
    check_placement(cfg, len(prompts))
    t0 = time.perf_counter()
    ledgers, held = create_ledgers(cfg, layout)
    unsubscribe = on_lock_lost(lambda reason: [halt(led, f"run lock lost: {reason}") for led in ledgers.values()])
    try:
        # Each source actor reads the response journals itself (pipeline.generate.sources.http.replay) before sending.
        tally = generate(cfg, prompts, layout, ledgers, console=console, index=index)
    finally:
        unsubscribe()
    timings.add("generate", t0)
    counts = index.counts()  # waited for: its quarantine rows are on disk before the summary reads them
    counts.pop(TO_DO, None)
    counts["resumed_done"] = len(done)
    nameless = project_journals(cfg, layout)

    current = {d.name: current_ids(d, layout) for d in cfg.datasets}  # the summary's and the recount's rows
    report = run_summary(cfg, layout, tally, counts, current)
    report["spend"] = {name: ledger_report(ledger) | {"held_by_killed_requests": held[name],
                                                       "journal_lines_naming_no_prompt": nameless.get(name, 0)}
                       for name, ledger in ledgers.items()}
    report["sources"] = source_report(cfg.sources, tally)
    ensure_held()
    check_placement(cfg, 0)  # the extraction's nodes (an autoscaler may add them only now)
    report["training"] = extract_and_train(cfg, layout, timings, console)
    # the summary was made before the extraction: its count of passed samples it quarantined is read now
    report = with_extraction_quarantine(report, extraction_quarantine(layout, current))
    timings.add("total", t_all)
    report["seconds"] = timings.seconds
    ensure_held()
    gen_s = timings.seconds.get("generate") or 0.0
    report["throughput"] = throughput(tally, gen_s)
    atomic_write_json(layout.report, report)
    wait_for_retired_engines(also=[HiddenStateExtractor.__name__])  # engines stop before this driver exits
    publish_report(cfg, layout, report)  # report.html + the trackers' run summary; never raises
    console.line(format_report(report, layout.root))
    return report


def run_summary(cfg: RunConfig, layout: RunLayout, tally: Tally, counts: Counter,
                current: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report's figures over the folder (``summarize``), conservation checked over the rows the files give
    now (``current_ids``: their id indexes, just written by the index pass). A row edited, a lowered ``max_rows``
    or a removed dataset between attempts leaves rows of other ids on disk: set aside and reported, not counted,
    else every later resume of the folder failed here."""
    if current is None:
        current = {d.name: current_ids(d, layout) for d in cfg.datasets}
    report = summarize(tally, counts, layout, current, engine_prices(cfg.sources))
    assert_conservation(report["rows_in"], report["passed"], report["quarantined"], report["not_generated"])
    return report


def ensure_held() -> None:
    """Raise ``LockLost`` (exit 2) if another run took this folder's lock over; a no-op outside ``run``."""
    lock = current_lock()
    if lock is not None:
        lock.ensure_held()


def init_ray(cfg: RunConfig, *, state_api: bool | None = None) -> None:
    """Join the cluster named by config or RAY_ADDRESS; otherwise start a private local Ray, with its dashboard
    when ``state_api`` (default: ``needs_state_api``)."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    loopback = {"_node_ip_address": "127.0.0.1"}
    if address:
        # Inside `ray job submit` the job's runtime env (working dir, env vars) already applies.
        local_head = address.split("://")[-1].startswith(("127.0.0.1", "localhost"))
        ray.init(address=address, **(loopback if local_head else {}))
    else:
        # No runtime_env: a local Ray's workers inherit this process's environment, and any runtime_env costs
        # ~2 s before the first task (the workers Ray prestarts do not fit it). The engine actors set
        # VLLM_CPU_KVCACHE_SPACE themselves (from ``kv_cache_gib``); the pandas import the setup hook did is in
        # ``pipeline/__init__``.
        dashboard = needs_state_api(cfg) if state_api is None else state_api  # on the next free port past 8265
        ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=dashboard,
                 _system_config={"worker_niceness": cfg.ray.worker_niceness}, **loopback)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    from pipeline.base.logs import after_ray_init

    after_ray_init()  # a CLI run: Ray's loggers and the workers' output go to OUTPUT/logs/


def needs_state_api(cfg: RunConfig) -> bool:
    """Whether a local Ray needs its dashboard, which serves Ray's state API: Ray Train's placement-group
    cleaner polls it every second (without it: a warning a second, and no clean-up of a dead controller's
    bundles), and the driver asks it which engine actors are still stopping before it exits
    (``chain.wait_for_retired_engines``). A run that neither trains nor runs an engine (an API source, training
    off) starts Ray without it: ~1 s and over a core-second less before the first answer on 2 cores."""
    return (cfg.training is not None or HANDOFFS[cfg.extraction.mode].without_training
            or any(source_kind(s).holds_engine for s in cfg.sources))


def check_placement(cfg: RunConfig, to_do: int) -> None:
    """The sources' actor pools (with prompts ``to_do``), else the extraction's, fit some node (waiting
    ``ray.placement_timeout_s`` for one to join), else stop now: ``NoPlacement`` (exit 3, the prompts or the
    training left to do) instead of Ray Data's half-hour no-progress wait."""
    from pipeline.run.placement import NoPlacement, extraction_demands, source_demands, wait_for_placement

    demands = source_demands(cfg) if to_do else extraction_demands(cfg)
    try:
        wait_for_placement(demands, cfg.ray.placement_timeout_s)
    except NoPlacement as e:
        e.left = to_do  # type: ignore[attr-defined]
        raise


def prepare_output(layout: RunLayout) -> None:
    """Create the output folder, or say in one line why it cannot be (before anything starts)."""
    from pipeline.base.config import ConfigError

    root = layout.root
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        raise ConfigError(f"output_dir {root}: is a file, not a folder") from None
    except NotADirectoryError:
        raise ConfigError(f"output_dir {root}: a part of the path is a file, not a folder") from None
    except PermissionError:
        raise ConfigError(f"output_dir {root}: not writable by this user") from None
    except OSError as e:
        raise ConfigError(f"output_dir {root}: cannot be written ({e.strerror})") from None


def output_problem(root: Path) -> str | None:
    """Why ``prepare_output`` would refuse ``root``, found without creating or writing anything (``check``)."""
    if root.exists():
        if not root.is_dir():
            return f"output_dir {root}: is a file, not a folder"
        return None if os.access(root, os.W_OK | os.X_OK) else f"output_dir {root}: not writable by this user"
    parent = root.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"output_dir {root}: a part of the path is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"output_dir {root}: not writable by this user ({parent} is not)"
    return None


def check_budget_journals(cfg: RunConfig, layout: RunLayout) -> None:
    """Every spending source's budget journal reads (``UnreadableFile``: exit 2 naming it), before Ray starts."""
    from pipeline.generate.ledger import read_journal_both

    for src in spending_sources(cfg.sources):
        read_journal_both(str(layout.ledger(src.name)))


def check_api_keys(cfg: RunConfig) -> None:
    """A private local Ray inherits this process's environment: a missing API key is a config error now.

    On a cluster the key must be set where the source actors run, which the driver cannot see; there a
    missing key halts that source and leaves its prompts to do."""
    from pipeline.base.config import ConfigError

    if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        return
    for src in spending_sources(cfg.sources):
        env = src.key_env()  # None: this endpoint gets no key (see OpenRouterSourceConfig.key_env)
        if env and src.api_key_required and not os.environ.get(env):
            raise ConfigError(f"source {src.name!r}: environment variable {env} is not set "
                              "(set it to the API key, or api_key_required: false for a local server)")


def read_prompts(cfg: RunConfig, layout: RunLayout, done: set[str] | None = None) -> tuple[PromptSet, IndexPass]:
    """The prompts not yet finished (not in ``done``, default ``finished_ids``) as a ``PromptSet`` (how to read
    them, no row: Ray must be up), and the index pass, started. The index pass (pipeline.prompts.read, one Ray
    task per dataset) counts each file's rows and quarantines its malformed rows, and the prompts an API source
    gave up on after transient failures in ``transient_runs`` runs (they would only fail again).

    A fresh run (nothing finished, nothing worn out, no overflow routing, which shares by the count) does not
    wait for it: its to-do count is the files' row count (``rows_upper_bound``: no row parsed; the malformed
    rows, which the read skips, are the difference) until the pass ends, so generation starts whatever the
    number of prompts. Otherwise the pass is waited for here (a resume's is cheap: the files' id indexes)."""
    import ray

    done = finished_ids(layout) if done is None else done
    worn = worn_out(cfg, layout)
    lock = current_lock()  # the index tasks write into the folder too: only while the lock is still the run's
    index = start_index(cfg, layout, done, worn, lock.token if lock is not None else None)
    skip = ray.put(done | worn.keys())
    if not done and not worn and cfg.routing.mode != "overflow":
        return PromptSet(cfg, skip, rows_upper_bound(cfg)[TO_DO], estimated=True), index
    return PromptSet(cfg, skip, index.counts()[TO_DO]), index


def worn_out(cfg: RunConfig, layout: RunLayout) -> dict[str, dict[str, str]]:
    """Prompts a spending source gave up on (transient failures, retries spent) in ``transient_runs`` runs."""
    from pipeline.generate.sources.http.totals import gave_up_counts

    out = {}
    for src in spending_sources(cfg.sources):
        for sample_id, (runs, error) in gave_up_counts(layout.responses, src.name).items():
            if runs >= src.transient_runs:
                out[sample_id] = {"stage": "generate", "source": src.name,
                                  "reason": f"{src.name}: transient failures in {runs} runs (last: {error})"}
    return out


def project_journals(cfg: RunConfig, layout: RunLayout) -> dict[str, int]:
    """Bring each spending source's journal projection up to date (``totals``): the source actors store theirs
    only when idle, and Ray Data ends them with the stream, so without this the run's first ``status`` or
    resume would parse the whole journal (~2 s a 200,000 responses) instead of the run paying it once here.
    In a zero-CPU Ray task, not on the driver: its parse held ~100 MB more at 200,000 responses. Returns, per
    source, its journal lines that do not read and name no prompt (the report warns of them, as ``status`` does)."""
    import ray

    task = ray.remote(num_cpus=0)(_project_journal)
    names = [src.name for src in spending_sources(cfg.sources)]
    return dict(zip(names, ray.get([task.remote(str(layout.responses), n) for n in names]), strict=True))


def _project_journal(folder: str, source: str) -> int:
    from pipeline.generate.sources.http.totals import journal_totals

    return journal_totals(folder, source).nameless  # stores the projection; the rest of the totals stay here


def has_finished_rows(layout: RunLayout) -> bool:
    return any(any(folder.glob("*.parquet")) for folder in (layout.samples, layout.quarantine))


def finished_ids(layout: RunLayout) -> set[str]:
    """Sample ids already written as passed or quarantined (a resumed run skips them); a shard that does not
    read raises ``UnreadableFile`` as ``records.read_rows`` does."""
    return read_finished_ids(layout)


def max_prompt_tokens(cfg: RunConfig) -> dict[str, int]:
    """Per dataset whose ``max_length`` check quarantines: prompts this long are quarantined before generation."""
    return {d.name: d.checks.max_total_tokens for d in cfg.datasets if d.checks.max_length == "quarantine"}


def create_ledgers(cfg: RunConfig, layout: RunLayout) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    """One budget ledger per spending source, restored from what earlier attempts already spent (see
    ``restored_spend``); and per source, the budget still held by requests that were in flight when an earlier
    attempt was killed."""
    from pipeline.generate.ledger import ledger_for

    ledgers, held = {}, {}
    lock = current_lock()
    identities = source_identities(cfg, layout)
    for src in spending_sources(cfg.sources):
        spent, spent_usd, held[src.name] = restored_spend(cfg, layout, src, identities)
        ledgers[src.name] = ledger_for(src, spent=spent, spent_usd=spent_usd, journal=str(layout.ledger(src.name)),
                                       lock=(str(lock.path), lock.token) if lock is not None else None)
    return ledgers, held


def restored_spend(cfg: RunConfig, layout: RunLayout, src: Any, identities: dict[str, list[str]] | None = None
                   ) -> tuple[dict[str, int], dict[str, float], dict[str, int]]:
    """(tokens spent, dollars spent, tokens held by requests in flight at a kill) per dataset of one source.

    The largest of what written samples were billed, what the response journal says was billed, and what the
    ledger's journal had committed (spent + in flight) when the last attempt stopped: a request in flight at a
    kill may have been billed, so it stays spent. Spend follows the source's identity (model, endpoint, budget
    scope): what it spent under an earlier name counts too (``identities``: ``source_identities``, read once).
    """
    from pipeline.generate.ledger import read_journal_both
    from pipeline.generate.sources.http.totals import cost_by_dataset

    identity = src.identity()
    identities = source_identities(cfg, layout) if identities is None else identities
    names = [n for n, ids in identities.items() if identity in ids]
    billed, usd, committed, committed_usd = Counter(), Counter(), Counter(), Counter()
    for name in names:
        _max_into(billed, spent_by_dataset(layout, name))
        _max_into(usd, cost_by_dataset(layout.responses, name))
        tokens_c, usd_c = read_journal_both(str(layout.ledger(name)))
        _max_into(committed, tokens_c)
        _max_into(committed_usd, usd_c)
    held = {d: c - billed.get(d, 0) for d, c in committed.items() if c > billed.get(d, 0)}
    _max_into(billed, committed)
    _max_into(usd, committed_usd)
    return dict(billed), dict(usd), held


def source_identities(cfg: RunConfig, layout: RunLayout) -> dict[str, list[str]]:
    """name -> every identity a spending source of that name has had in this folder (``sources.json``), this
    run's added: spend restores from every name that ever had the source's identity."""
    path = layout.source_identities
    known: dict[str, list[str]] = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not an object")
            known = {str(k): [str(x) for x in (v if isinstance(v, list) else [v])] for k, v in data.items()}
        except (OSError, ValueError):
            from pipeline.base.config import ConfigError

            raise ConfigError(f"{path} is not readable JSON: restore it, or move it aside (spend is then restored "
                              "by source name only)") from None
    merged = {k: list(v) for k, v in known.items()}
    for src in spending_sources(cfg.sources):
        ids = merged.setdefault(src.name, [])
        if src.identity() not in ids:
            ids.append(src.identity())
    if merged != known:
        atomic_write_json(path, merged)
    return merged


def _max_into(acc: Counter, values: dict[str, Any]) -> None:
    for k, v in values.items():
        acc[k] = max(acc.get(k, 0), v)


def spent_by_dataset(layout: RunLayout, source: str) -> dict[str, int]:
    """Billed completion tokens of one source: in written and quarantined samples, or in the response journal
    (every billed attempt, written or not), whichever is larger."""
    from pipeline.generate.sources.http.totals import billed_by_dataset

    spent: Counter = Counter()
    for _, t in shard_tables(layout.samples, ["dataset", "source", "billed_completion_tokens"]):  # as columns
        tokens = t.column("billed_completion_tokens")
        mine = t.filter(pc.and_(pc.equal(t.column("source"), source), pc.greater(tokens, 0)))
        for g in mine.group_by("dataset").aggregate([("billed_completion_tokens", "sum")]).to_pylist():
            spent[g["dataset"]] += g["billed_completion_tokens_sum"]
    for r in read_rows(layout.quarantine, ["dataset", "source", "detail"]):
        if r["source"] == source:
            billed = json.loads(r["detail"] or "{}").get("billed_completion_tokens") or 0
            spent[r["dataset"]] += max(int(billed), 0)
    for dataset, tokens in billed_by_dataset(layout.responses, source).items():
        spent[dataset] = max(spent[dataset], tokens)
    return dict(spent)


def generate(cfg: RunConfig, prompts: list[dict[str, Any]] | PromptSet, layout: RunLayout, ledgers: dict[str, Any],
             replayed: dict[str, dict[str, str]] | None = None, console: Console | None = None,
             index: IndexPass | None = None) -> Tally:
    """Stream prompts through render -> routed sources -> validate -> shard writer, tallying what comes out.

    A prompt whose source fails it is handed to the next source the router names; when that source sits
    earlier in the chain the prompt comes back as ``reroute`` and is fed to one more pass. ``replayed``: fixed
    replay sets per source (tests); by default each source actor indexes the folder's response journals.
    ``index``: the index pass, when the to-do count is still an estimate (``PromptSet.estimated``): the tally's
    total becomes its count as soon as it ends.
    """
    estimated = isinstance(prompts, PromptSet) and prompts.estimated
    tally = Tally(len(prompts), audit_for(cfg.datasets), estimated=estimated)
    if not prompts:
        return tally
    with (console or Console()).phase(generate_progress(tally, cfg, layout), announce=True):
        _generate_passes(cfg, prompts, layout, ledgers, replayed, tally, index if estimated else None)
    return tally


def generate_progress(tally: Tally, cfg: RunConfig, layout: RunLayout) -> Callable[[bool], str]:
    """The generation phase's console line: the tally's figures and, per API source, tokens against budgets."""
    spenders = spending_sources(cfg.sources)

    def render(final: bool) -> str:
        snap: GenerateSnapshot = replace(tally.snapshot, elapsed_s=time.perf_counter() - tally.t0)
        if not snap.done and not final:
            waited = f" ({duration(snap.elapsed_s)})" if snap.elapsed_s >= 1 else ""
            total = f"~{snap.total}" if snap.estimated else snap.total
            return f"[generate] 0/{total} done, starting {', '.join(s.name for s in cfg.sources)}{waited}"
        return generate_line(snap, read_spend(layout, spenders) if spenders else None, final=final)

    return render


def _generate_passes(cfg: RunConfig, prompts: list[dict[str, Any]] | PromptSet, layout: RunLayout,
                     ledgers: dict[str, Any], replayed: dict[str, dict[str, str]] | None, tally: Tally,
                     index: IndexPass | None) -> None:
    import ray.data

    from pipeline.generate.router import build_router
    from pipeline.generate.sources.chain import (
        ACTOR_FAULTS,
        map_sources,
        release_placement_groups,
        reroute_overrides,
    )

    model = cfg.model
    # The overflow deadline runs from here (engine start-up counts: it is wall clock the user waits).
    router = build_router(cfg.sources, cfg.datasets, cfg.routing, len(prompts), started_at=time.time())
    checks = {d.name: d.checks.model_dump() for d in cfg.datasets}
    block_rows = min(s.batch_size for s in cfg.sources)
    todo, overrides = prompts, {}
    pools = stage_pools(cfg)
    for _ in range(cfg.routing.max_hops + 2):
        ds = pass_dataset(todo, block_rows)  # read in the workers (pipeline.prompts.read); a list in tests
        # render routes (assign_sources) and validate closes the chain (close_unserved): no actor of their own
        ds = ds.map_batches(RenderPrompts, fn_constructor_args=(model.profile, model.path, max_prompt_tokens(cfg),
                                                                router, overrides),
                            batch_format="pyarrow", **pools["render"])
        ds = map_sources(ds, cfg.sources, model_dir=model.path, profile=model.profile, sampling=cfg.sampling,
                         router=router, ledgers=ledgers, layout=layout, replays=replayed)
        ds = ds.map_batches(ValidateSamples, fn_constructor_args=(model.profile, model.path, checks, True),
                            batch_format="pyarrow", **pools["validate"])
        lock = current_lock()  # the shard writer checks it still owns the folder before every shard
        fence = {"token": lock.token} if lock is not None else {}  # the lock of layout.lock (RunLock.for_folder)
        ds = ds.map_batches(WriteShards, fn_constructor_args=(layout,), fn_constructor_kwargs=fence,
                            batch_size=block_rows, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1),
                            num_cpus=0.25, **ACTOR_FAULTS)
        rerouted = []
        try:
            for batch in stage_deaths_end(ds.iter_batches(batch_format="pyarrow", batch_size=None), cfg.sources):
                ensure_held()  # a run whose lock was taken over stops here (exit 2), its sources already halted
                for row in batch.to_pylist():  # the writer's tally rows (flight.TALLY_SCHEMA): small columns
                    tally.note_start_error(row)
                    if row["status"] == "reroute":
                        rerouted.append(row)
                    elif row["status"] == "duplicate":
                        tally.duplicates += 1  # written once already (a re-executed batch): never counted twice
                    else:
                        tally.add(row)
                if index is not None and index.ready():
                    tally.counted(index.counts()[TO_DO])
                    index = None
                tally.progress()
        finally:
            release_placement_groups()  # TP > 1 engine actors' GPU bundles outlive the actors
        overrides = reroute_overrides(rerouted)
        todo = reroute_prompts(prompts, overrides)
        router = replace(router, spill_at=None)  # later passes carry only re-routes: none spills
        if not todo:
            break
    if todo:
        raise RuntimeError(f"{len(todo)} prompts still re-routed after {cfg.routing.max_hops + 2} passes")
    if index is not None:  # the stream ended first (a small run): the final line has the count
        tally.counted(index.counts()[TO_DO])
    tally.progress(final=True)


def stage_pools(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Ray Data arguments of the render and validate stages: autoscaling actor pools (``stages:`` in config)."""
    import ray
    import ray.data

    from pipeline.generate.sources.chain import ACTOR_FAULTS

    cpus = ray.cluster_resources().get("CPU")
    out = {}
    for name, pool in (("render", cfg.stages.render), ("validate", cfg.stages.validate_)):
        low, high = pool_bounds(pool, cfg.sources, cpus)
        out[name] = {"compute": ray.data.ActorPoolStrategy(min_size=low, max_size=high), "num_cpus": pool.num_cpus,
                     **ACTOR_FAULTS}
    return out


def stage_deaths_end(batches: Iterable[Any], sources: Sequence[Any]) -> Iterator[Any]:
    """``batches`` as they come; a stage actor that died past its bounded restarts (``chain.ACTOR_FAULTS``) ends
    the run as ``StageDied`` naming the stage (exit 3: what was written stays, the rest is left to do) instead of
    a Ray traceback."""
    from pipeline.generate.sources.chain import StageDied, actor_class_of, actor_death, stage_label

    try:
        yield from batches
    except Exception as e:
        death = actor_death(e)
        if death is None:
            raise
        label = stage_label(actor_class_of(str(death)) or dead_actor_class(death), sources)
        raise StageDied(f"{label}: its actor process died more often than its restarts allow (a crash, the OOM "
                        "killer or a lost node); what was written is kept") from e


def dead_actor_class(death: BaseException) -> str | None:
    """The stage class of the actor a Ray actor error names by id only (``ActorUnavailableError``), from the
    cluster's actor table; None when it cannot be asked (best effort: it only names the stage in a message)."""
    actor_id = getattr(death, "actor_id", None)
    if not actor_id:
        return None
    try:
        from ray._private.state import actors

        from pipeline.generate.sources.chain import actor_class_of

        return actor_class_of(str((actors(actor_id) or {}).get("ActorClassName") or ""))
    except Exception:  # noqa: BLE001 - the message then says "a stage actor"
        return None
