"""Prompts read by Ray Data in the workers; the driver only counts (#26).

Every reader of a dataset file goes through ``datasets.iter_dataset``, whose ids depend on the dataset's
name, the row's index and its content only, so a worker assigns the ids the driver used to. Two passes, both
in Ray workers:

- the index pass (``start_index``, one task per dataset) quarantines the malformed rows and the prompts an
  API source wore out, and counts each file's rows and the prompts left to do; it keeps each file's ids in
  the run folder (``id_index``), so a resume of an unchanged file counts without parsing. A resume waits for
  it; a fresh run generates while it parses (``job.read_prompts``), its to-do count the files' row count
  until the pass ends;
- each generation pass (``PromptSet.dataset`` -> ``prompt_dataset``) streams the files again and yields the
  rows left to do (or, for a re-route pass, only the named ones) as blocks of ``block_rows`` rows.

The driver holds the finished ids (``read_finished_ids``, one columnar read per shard), puts them in the
object store once, and keeps counts; no prompt row is ever on it.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pyarrow as pa

from pipeline.base.layout import RunLayout, atomic_write_table
from pipeline.base.records import QUARANTINE_SCHEMA, quarantine_row, read_ids
from pipeline.prompts import id_index
from pipeline.prompts.datasets import check_dataset, count_rows, iter_dataset, warn_empty

if TYPE_CHECKING:
    import ray.data

    from pipeline.base.config import DatasetConfig
    from pipeline.run.config import RunConfig

# The columns and types ``ray.data.from_items`` gave the prompt dicts (the stages read them by name).
PROMPT_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("dataset", pa.string()),
    ("row_index", pa.int64()),
    ("messages", pa.string()),
    ("tools", pa.string()),
    ("thinking", pa.bool_()),
])
TO_DO = "to_do"  # the index pass's count of prompts left to do (summed; not one of the run's counts)
# An index task asks no CPU: it runs before check_placement's timed wait, and a head without CPUs (or a
# cluster whose workers have not joined yet) must not leave it pending without a word; the number of
# datasets bounds how many run at once.
INDEX_CPUS = 0
QUARANTINE_CHUNK = 10_000
# A read task's output is merged into blocks of ``DataContext.target_max_block_size`` before the fused repartition
# cuts them to ``block_rows``: at Ray Data's 128 MiB the first block waited for a whole file of prompts (4.9 s at
# 200,000 prompts, against 1.7 s at 1 MiB and 2.4 s at 8 MiB, measured from the read's start), so the first
# answer came later the more prompts there were. This bound holds that wait to a few MiB of prompts.
READ_BLOCK_BYTES = 4 * 2**20  # malformed or worn-out rows an index task holds before writing them as one shard


# ------------------------------------------------------------------ the driver: finished ids, file checks


def read_finished_ids(layout: RunLayout) -> set[str]:
    """Sample ids in samples/ and quarantine/: the ``sample_id`` column of each shard, read alone
    (``records.read_ids``; a shard that does not read fails with the ``UnreadableFile`` naming it)."""
    return read_ids(layout.samples) | read_ids(layout.quarantine)


def current_ids(d: DatasetConfig, layout: RunLayout) -> pa.Array:
    """The ids of the rows ``d``'s file gives now (within ``max_rows``, malformed rows too): the rows this config
    accounts for. A sample or quarantine row of another id (a repaired row's old id, a row past a lowered
    ``max_rows``) stays in the folder, set aside (``summary.account``). The file's id index when it holds for the
    file as it is (the index pass wrote it); else the file is parsed for its ids (no row held), not stored."""
    table = id_index.read_index(layout.prompt_index(d.name), id_index.index_key(d))
    if table is None:
        seen = id_index.Collector()
        for ok, row in iter_dataset(d, warn=False):
            seen.add(row["sample_id"], ok)
        table = seen.table()
    return table.column("sample_id").combine_chunks()


def check_prompt_files(cfg: RunConfig) -> None:
    """Each dataset file reads (``datasets.check_dataset``): its DatasetError now, before Ray starts."""
    for d in cfg.datasets:
        check_dataset(d)


# ------------------------------------------------------------------ the index pass


def _write_quarantine(rows: list[dict[str, Any]], folder: Path) -> None:
    """Rows that never reach generation, as one content-addressed shard (what read_prompts wrote)."""
    from pipeline.base.layout import shard_name

    if not rows:
        return
    folder.mkdir(parents=True, exist_ok=True)
    # quarantine_row keeps the offending line (``raw``) in the detail column
    q = [quarantine_row({k: v for k, v in b.items() if k not in ("stage", "reason")}, b["stage"], b["reason"])
         for b in rows]
    atomic_write_table(pa.Table.from_pylist(q, schema=QUARANTINE_SCHEMA), folder / shard_name([b["sample_id"]
                                                                                              for b in rows]))


def index_dataset(d: DatasetConfig, layout: RunLayout, skip: set[str], worn: dict[str, dict[str, str]], *,
                  keep_index: bool = True, token: str | None = None) -> Counter:
    """One dataset's index (an index task's body): its malformed rows and worn-out prompts not in ``skip``
    written to the run's quarantine; returns ``{name}.rows`` (every row, good or bad) and ``TO_DO``.
    ``token``: the run lock's (``layout.lock``); each write then commits only while the lock is still the run's
    (``run_lock.fence``), so a frozen driver's pass writes nothing into a folder another run took over.

    ``keep_index``: the file's ids are kept in ``layout.prompt_index`` (``id_index``). When that holds for the
    file as it is now and no row left to do needs writing to quarantine, the counts come from it and the file
    is not parsed; a full pass writes it anew."""
    index = layout.prompt_index(d.name) if keep_index else None
    key = id_index.index_key(d) if index is not None else None
    if index is not None and (table := id_index.read_index(index, key)) is not None:
        to_do = id_index.indexed_counts(table, skip, set(worn))
        if to_do is not None:
            return Counter({f"{d.name}.rows": table.num_rows, TO_DO: to_do})
    counts: Counter = Counter({f"{d.name}.rows": 0, TO_DO: 0})
    bad: list[dict[str, Any]] = []
    seen = id_index.Collector()
    for ok, row in iter_dataset(d, warn=False):  # the driver warns (its console shows the pipeline's warnings)
        counts[f"{d.name}.rows"] += 1
        sid = row["sample_id"]
        seen.add(sid, ok)
        if sid in skip:
            continue
        if not ok:
            bad.append(row)
        elif sid in worn:
            bad.append(dict(row, **worn[sid]))
        else:
            counts[TO_DO] += 1
        if len(bad) >= QUARANTINE_CHUNK:
            with _fenced(layout, token):
                _write_quarantine(bad, layout.quarantine)
            bad = []
    with _fenced(layout, token):
        _write_quarantine(bad, layout.quarantine)
    if index is not None and key is not None and id_index.index_key(d) == key:  # the file did not change meanwhile
        with _fenced(layout, token):
            id_index.write_index(index, key, seen.table())
    return counts


def _fenced(layout: RunLayout, token: str | None) -> contextlib.AbstractContextManager[None]:
    """The run lock's fence for one write when a token was handed over, else nothing to honour."""
    from pipeline.base.run_lock import fence

    return fence(layout.lock, token) if token is not None else contextlib.nullcontext()


def _reraise(e: Exception) -> NoReturn:
    """A task's own exception (a DatasetError, a file not found) as itself, not wrapped in a RayTaskError:
    the CLI maps its class to the exit code and prints its message."""
    import ray.exceptions

    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, Exception):
        raise e.cause from None
    raise e


class IndexPass:
    """The index pass under way: one Ray task per dataset. ``counts()`` waits for them (and re-raises a task's
    own error as itself); ``ready()`` asks without waiting, so a fresh run can generate while it counts."""

    def __init__(self, cfg: RunConfig, refs: list[Any]) -> None:
        self.cfg, self.refs = cfg, refs
        self._counts: Counter | None = None

    def ready(self) -> bool:
        import ray

        if self._counts is not None:
            return True
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(done) == len(self.refs)

    def counts(self) -> Counter:
        """The summed counts (``{name}.rows``, ``TO_DO``); an empty file is warned about here, on the driver."""
        import ray

        if self._counts is not None:
            return Counter(self._counts)
        counts: Counter = Counter()
        try:
            for c in ray.get(self.refs):
                counts.update(c)
        except ray.exceptions.RayTaskError as e:
            # The other datasets' tasks are left to finish (each parses its file and stores its id index): Ray
            # 2.60 aborts the driver, with no message on the console, when it cancels a task whose reply is on its
            # way ("Tried to complete task that was not pending", task_manager.cc). Seen in CI on this very path.
            _reraise(e)
        for d in self.cfg.datasets:
            if not counts[f"{d.name}.rows"]:
                warn_empty(d)
        self._counts = counts
        return Counter(counts)


def start_index(cfg: RunConfig, layout: RunLayout, skip: set[str] | Any,
                worn: dict[str, dict[str, str]] | Any, token: str | None = None) -> IndexPass:
    """Start the index pass, one Ray task per dataset. ``skip`` and ``worn`` (or object refs of them) go to the
    object store once, not into every task's arguments. ``token``: the run lock's, for ``index_dataset``."""
    import ray

    skip_ref = skip if isinstance(skip, ray.ObjectRef) else ray.put(skip)
    worn_ref = worn if isinstance(worn, ray.ObjectRef) else ray.put(worn)
    task = ray.remote(num_cpus=INDEX_CPUS, max_calls=1)(_index_task)
    return IndexPass(cfg, [task.remote(d, layout, skip_ref, worn_ref, token) for d in cfg.datasets])


def _index_task(d: DatasetConfig, layout: RunLayout, skip: set[str], worn: dict[str, dict[str, str]],
                token: str | None = None) -> Counter:
    """``index_dataset`` at the lowest CPU priority: a fresh run parses its files while the stage actors start
    and generate, and on a busy machine those come first (measured: the first answer ~4 s later at 200,000
    prompts with the pass at the workers' priority). ``max_calls=1``: the niced process is not reused."""
    with contextlib.suppress(OSError):
        os.nice(19)  # capped at 19
    return index_dataset(d, layout, skip, worn, token=token)


def index_prompts(cfg: RunConfig, layout: RunLayout, skip: set[str] | Any,
                  worn: dict[str, dict[str, str]] | Any) -> Counter:
    """Run the index pass and wait for it: the summed counts (``{name}.rows``, ``TO_DO``)."""
    return start_index(cfg, layout, skip, worn).counts()


def rows_upper_bound(cfg: RunConfig) -> Counter:
    """Each file's row count without parsing a row (``datasets.count_rows``: a Parquet footer, a line count)
    and ``TO_DO`` as their sum: what a fresh run has to do at most (malformed rows are the difference)."""
    counts: Counter = Counter()
    for d in cfg.datasets:
        counts[f"{d.name}.rows"] = count_rows(d, warn=False)
    counts[TO_DO] = sum(counts.values())
    return counts


# ------------------------------------------------------------------ the generation passes' read


def _dataset_of(sample_id: str) -> str:
    return sample_id.rsplit(":", 2)[0]


def todo_rows(d: DatasetConfig, skip: set[str], only: set[str] | None = None,
              index: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """One dataset's prompt rows not in ``skip`` (and in ``only``, when given), in file order; with ``only``
    the file is read until its last wanted row.

    ``index``: the file's id index (``id_index``); while it holds for the file, only the rows it says are left
    are parsed (a resume with a tenth left parses a tenth of the file). The rows read are checked as before."""
    wanted = None if only is None else {s for s in only if _dataset_of(s) == d.name}
    if wanted is not None and not wanted:
        return
    rows = None
    if index is not None and (table := id_index.read_index(Path(index), id_index.index_key(d))) is not None:
        rows = id_index.rows_left(table, skip, wanted)
        if not rows:
            return
    for ok, row in iter_dataset(d, warn=False, rows=rows):
        sid = row["sample_id"]
        if not ok or sid in skip:
            continue
        if wanted is None:
            yield row
        elif sid in wanted:
            yield row
            wanted.discard(sid)
            if not wanted:
                return


def row_blocks(rows: Iterable[dict[str, Any]], block_rows: int) -> Iterator[pa.Table]:
    """Tables of ``block_rows`` rows (the last one shorter) in ``PROMPT_SCHEMA``."""
    buf: list[dict[str, Any]] = []
    for row in rows:
        buf.append(row)
        if len(buf) == block_rows:
            yield pa.Table.from_pylist(buf, schema=PROMPT_SCHEMA)
            buf = []
    if buf:
        yield pa.Table.from_pylist(buf, schema=PROMPT_SCHEMA)


def _resolve(value: Any) -> Any:
    import ray

    return ray.get(value) if isinstance(value, ray.ObjectRef) else value


def _read_blocks(batch: pa.Table, datasets: list[DatasetConfig], layout: RunLayout, skip: Any, only: Any,
                 block_rows: int) -> Iterator[pa.Table]:
    """The read stage's UDF: each input row names one dataset, read here, in the worker."""
    skip, only = _resolve(skip), _resolve(only)
    for i in batch.column("index").to_pylist():
        d = datasets[i]
        yield from row_blocks(todo_rows(d, skip, only, layout.prompt_index(d.name)), block_rows)


def prompt_dataset(cfg: RunConfig, skip_ref: Any, only: set[str] | Any | None, block_rows: int) -> ray.data.Dataset:
    """The rows left to do as a Ray Data dataset, read in the workers: blocks of at most ``block_rows`` rows
    in ``PROMPT_SCHEMA``, each file's rows in file order.

    One input row per dataset and a generator ``map_batches`` UDF (``batch_size=1``) that streams that file
    (``todo_rows``), rather than a custom Datasource: a read task cannot know where a file's to-do rows
    start without reading it, so a file is one task either way, and a UDF is the smaller thing to own.
    Ray Data merges the tables a task yields into blocks of ``target_max_block_size`` (128 MiB); the
    streaming repartition after it, fused into the same task, cuts them back to ``block_rows`` rows, so the
    stages after it see the small blocks ``from_items`` gave them. The read asks no CPU (as chain.py's
    routing tasks): a read task stalled by backpressure must not hold a CPU an actor pool is waiting for.
    ``skip_ref`` and ``only`` may be object refs (a pass reads them in each task, not in its arguments).
    """
    import ray
    import ray.data

    wanted = None if only is None else {_dataset_of(s) for s in _resolve(only)}
    indices = [i for i, d in enumerate(cfg.datasets) if wanted is None or d.name in wanted]
    items = ray.data.from_items([{"index": i} for i in indices], override_num_blocks=max(1, len(indices)))
    ds = items.map_batches(_read_blocks, batch_size=1, batch_format="pyarrow", num_cpus=0,
                           fn_kwargs={"datasets": list(cfg.datasets), "layout": RunLayout(cfg.output_dir),
                                      "skip": skip_ref, "only": only, "block_rows": block_rows})
    ds = ds.repartition(target_num_rows_per_block=block_rows)
    # The pass's own context (from_items copied the driver's; every stage after the read shares it), so a block
    # of long answers past the bound is cut in the stages too: the writer takes batches of block_rows rows.
    ds.context.target_max_block_size = min(ds.context.target_max_block_size or READ_BLOCK_BYTES, READ_BLOCK_BYTES)
    # Fused into the read only with equal resource arguments; Dataset.repartition takes none, so its
    # operator's are set here (an internal field: without it the repartition runs unfused, at one CPU a task).
    args = getattr(ds._logical_plan.dag, "ray_remote_args", None)
    if isinstance(args, dict):
        args["num_cpus"] = 0
    return ds


@dataclass(frozen=True)
class PromptSet:
    """What the driver knows of the prompts left to do: their number and how to read them, never a row.

    ``len()`` is the to-do total (the header, placement, the router and the tally's total use it), the files'
    row count while ``estimated`` (a fresh run, its index pass still counting: ``job.read_prompts``);
    ``dataset(block_rows)`` is one generation pass's input; ``restrict(ids)`` the prompts a re-route pass
    feeds again. ``skip`` is an object ref of the ids never to read (finished or worn out)."""

    cfg: RunConfig
    skip: Any
    total: int
    only: Any = None
    estimated: bool = False  # ``total`` is the files' row count, the index pass still counting

    def __len__(self) -> int:
        return self.total

    def dataset(self, block_rows: int) -> ray.data.Dataset:
        return prompt_dataset(self.cfg, self.skip, self.only, block_rows)

    def restrict(self, ids: Iterable[str]) -> PromptSet:
        import ray

        ids = set(ids)
        return replace(self, total=len(ids), only=ray.put(ids), estimated=False)


def pass_dataset(todo: list[dict[str, Any]] | PromptSet, block_rows: int) -> ray.data.Dataset:
    """A generation pass's input: a PromptSet read in the workers, or (tests) a list of prompt dicts."""
    import ray.data

    if isinstance(todo, PromptSet):
        return todo.dataset(block_rows)
    return ray.data.from_items(todo, override_num_blocks=max(1, len(todo) // block_rows))


def reroute_prompts(prompts: list[dict[str, Any]] | PromptSet, ids: Iterable[str]) -> list[dict[str, Any]] | PromptSet:
    """The prompts among ``ids`` (a pass's re-routed sample ids), for the next pass."""
    if isinstance(prompts, PromptSet):
        return prompts.restrict(ids)
    keep = set(ids)
    return [p for p in prompts if p["sample_id"] in keep]
