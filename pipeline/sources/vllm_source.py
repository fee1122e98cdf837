"""Local engines as Ray Data actors; vLLM here, and the row plumbing every engine shares.

An engine source receives in-flight rows (see ``pipeline.stages``) and serves
only those addressed to it (``source`` is its name, or empty in a one-source
run); every other row passes through untouched, so several sources can sit in
one chain. The engine's own output ids are the ground truth: nothing is
re-tokenized. A failure never loses a row: an engine error on a batch is
isolated by retrying its rows one at a time, and a row that still fails is
handed to the next source the router names (status ``reroute``) or quarantined
at stage ``generate`` with the error. ``on_error: raise`` instead re-raises so
Ray retries the task (needs ``DataContext.actor_task_retry_on_errors``).

An engine that fails to start (bad model folder, CUDA OOM, package missing)
does not take the run down: the actor records the error (type and message,
tokens blanked), logs it once, and fails every row addressed to it with
reason ``engine failed to start: ...``, so those rows follow the same
re-route-or-quarantine path. With ``on_error: raise`` the start error is
raised as before.

GPU placement: ``engine_resources`` gives the ``map_batches`` resource
arguments. One GPU per actor for tensor_parallel_size 1; for TP > 1 the actor
itself holds no GPU and gets a placement group of TP bundles
(``{"GPU": 1, "CPU": 1}``, STRICT_PACK: one node) whose bundles vLLM's Ray
executor fills with its TP workers (``distributed_executor_backend="ray"``,
child tasks captured by the group).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa

from pipeline.profiles import load_profile
from pipeline.sources.http_wire import redact
from pipeline.stages import batch_to_rows, mark, rows_to_table

log = logging.getLogger(__name__)

SERVABLE = ("ok", "reroute")
START_FAILED = "engine failed to start"
TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENROUTER_API_KEY")  # blanked out of start errors


def request_seed(sample_id: str, seed: int) -> int:
    """A per-sample seed: a retried or resumed sample is generated identically."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:4], "little")


def fill_from_engine(row: dict[str, Any], profile: Any, ids: list[int], finish: str | None, seconds: float) -> None:
    """Fill a sample from engine output ids; text fields are split the way a server's parsers would."""
    finish = finish or "stop"
    comp = profile.split_ids(ids, bool(row["thinking"]))
    row.update(
        output_ids=ids, reasoning=comp.reasoning, content=comp.content,
        tool_calls=json.dumps(comp.tool_calls, ensure_ascii=False) if comp.tool_calls else "",
        finish_reason=finish, truncated=finish == "length", t_generate_s=seconds,
    )


def serves(row: dict[str, Any], source_name: str) -> bool:
    """Whether a source stage should generate this row: addressed to it (or unrouted) and not yet generated."""
    return (row.get("status") in SERVABLE and row.get("output_ids") is None
            and (row.get("source") or source_name) == source_name)


def fail_row(row: dict[str, Any], reason: str, source_name: str, router: Any | None) -> dict[str, Any]:
    """A row this source cannot serve: re-routed when the router names a next source, else quarantined."""
    nxt = router.next_source(row, source_name) if router is not None else None
    if nxt:
        row.update(status="reroute", stage="generate", reason=f"{source_name}: {reason}", source=nxt)
    else:
        mark(row, "quarantine", "generate", reason)
        row["source"] = source_name
    return row


def start_error_text(exc: BaseException, limit: int = 500) -> str:
    """``Type: message`` of a failed engine start: one line, capped, tokens blanked (it is copied into rows)."""
    text = redact(f"{type(exc).__name__}: {' '.join(str(exc).split())}", [os.environ.get(k) for k in TOKEN_ENV])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def start_failure(row: dict[str, Any]) -> tuple[str, str] | None:
    """(source, error) when a row's reason says its source failed to start (re-routed or quarantined), else None."""
    reason = row.get("reason") or ""
    marker = f"{START_FAILED}: "
    if reason.startswith(marker):  # quarantined: the row still names the failed source
        return str(row.get("source") or ""), reason[len(marker):]
    name, sep, error = reason.partition(f": {marker}")  # re-routed: "<source>: engine failed to start: ..."
    return (name, error) if sep and name else None


@dataclass
class EngineResult:
    """One engine answer: exact output ids, or the error that replaced them."""

    ids: list[int] | None
    finish: str | None
    seconds: float
    error: str | None = None


def sampling_record(sampling: dict[str, Any], sample_id: str) -> str:
    """The parameters a sample was generated with, including its own seed (JSON for the shard)."""
    return json.dumps({**sampling, "request_seed": request_seed(sample_id, int(sampling.get("seed", 0)))},
                      sort_keys=True)


class EngineSource:
    """Row plumbing shared by local engines; subclasses implement ``start`` and ``generate_rows``."""

    kind = "engine"

    def __init__(self, model_dir: str, profile: str, sampling: dict[str, Any], engine: dict[str, Any],
                 source_name: str, router: Any | None = None) -> None:
        self.sampling = dict(sampling)
        self.engine_cfg = dict(engine)
        self.source_name = source_name
        self.router = router
        self.max_model_len = int(engine.get("max_model_len") or 4096)
        self.model_name = os.path.basename(model_dir.rstrip("/"))
        self.on_error = engine.get("on_error", "quarantine")
        self.isolate_errors = bool(engine.get("isolate_errors", True))
        self.start_error: str | None = None
        try:
            self.preflight()
            self.profile = load_profile(profile, model_dir)
            self.start(model_dir)
        except Exception as e:  # a dead engine must cost its rows a re-route, not the whole run
            if self.on_error == "raise":
                raise
            self.start_error = start_error_text(e)
            log.error("source %r (%s): %s: %s; its rows go to their next source or quarantine\n%s",
                      source_name, self.kind, START_FAILED, self.start_error,
                      "".join(traceback.format_tb(e.__traceback__)).rstrip())

    def preflight(self) -> None:
        """Cheap checks (e.g. the engine package is installed) run first, so the root cause is what is reported."""

    def start(self, model_dir: str) -> None:
        """Start the engine once per actor; an exception here is recorded as ``start_error`` (see module doc)."""

    def generate_rows(self, rows: list[dict[str, Any]]) -> list[EngineResult]:
        raise NotImplementedError

    def max_new_tokens(self, prompt_len: int) -> int:
        return min(int(self.sampling["max_tokens"]), self.max_model_len - prompt_len)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch_to_rows(batch)
        todo = []
        for r in rows:
            if not serves(r, self.source_name):
                continue
            if self.router is not None and self.router.spill(r, self.source_name, time.time()):
                continue  # past the overflow deadline: an overflow source takes it
            if self.start_error is not None:
                fail_row(r, f"{START_FAILED}: {self.start_error}", self.source_name, self.router)
                continue
            if len(r["prompt_ids"]) >= self.max_model_len:
                fail_row(r, f"prompt of {len(r['prompt_ids'])} tokens does not fit max_model_len "
                            f"{self.max_model_len}", self.source_name, self.router)
                continue
            todo.append(r)
        if todo:
            self._serve(todo)
        return rows_to_table(rows)

    def _serve(self, rows: list[dict[str, Any]]) -> None:
        try:
            results = self.generate_rows(rows)
        except Exception as e:
            if self.on_error == "raise":
                raise
            if self.isolate_errors and len(rows) > 1:  # one bad prompt must not take its batch with it
                for r in rows:
                    self._serve([r])
                return
            for r in rows:
                fail_row(r, f"engine error: {type(e).__name__}: {e}", self.source_name, self.router)
            return
        for r, res in zip(rows, results, strict=True):
            self._provenance(r)
            if res.error is not None or res.ids is None:
                fail_row(r, f"engine error: {res.error or 'no output ids'}", self.source_name, self.router)
                continue
            fill_from_engine(r, self.profile, res.ids, res.finish, res.seconds)
            r.update(status="ok", stage="", reason=r["reason"] if r["status"] == "reroute" else "")

    def _provenance(self, row: dict[str, Any]) -> None:
        row.update(source=self.source_name, source_kind=self.kind, provider=self.kind, model=self.model_name,
                   ids_from="engine", sampling=sampling_record(self.sampling, row["sample_id"]))


_PLACEMENT_GROUPS: list[Any] = []  # created in this (driver) process by placement_strategy


def placement_strategy(bundles: int) -> dict[str, Any]:
    """Ray remote args putting one actor and its engine's TP workers in one placement group on one node.

    Ray Data calls this in the driver for every actor it starts; the group outlives its actor, so
    the driver removes them all with `release_placement_groups` when the dataset has run."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.placement_group([{"GPU": 1, "CPU": 1}] * bundles, strategy="STRICT_PACK")
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


def engine_resources(engine: dict[str, Any], *, ray_tp: bool = True) -> dict[str, Any]:
    """``map_batches`` resource arguments for an engine actor (see the module doc for TP > 1).

    ``ray_tp``: the engine spreads TP workers as Ray tasks (vLLM); False when it
    forks them itself on the actor's GPUs (SGLang), so the actor holds all TP GPUs.
    """
    tp = int(engine.get("tensor_parallel_size") or engine.get("tp_size") or 1)
    num_cpus = float(engine.get("num_cpus", 1.0))
    gpus = float(engine.get("num_gpus", 0.0))
    if gpus <= 0:
        return {"num_cpus": num_cpus}
    if tp == 1 or not ray_tp:
        return {"num_cpus": num_cpus, "num_gpus": max(gpus, float(tp))}
    return {"num_cpus": 0, "num_gpus": 0, "ray_remote_args_fn": partial(placement_strategy, tp)}


class VLLMGenerator(EngineSource):
    """Generate with a vLLM engine started once per actor (or an existing ``llm`` handed in)."""

    kind = "vllm"

    def __init__(self, model_dir: str, profile: str, sampling: dict[str, Any], engine: dict[str, Any],
                 source_name: str, router: Any | None = None, llm: Any | None = None) -> None:
        self.llm = llm
        super().__init__(model_dir, profile, sampling, engine, source_name, router)

    def start(self, model_dir: str) -> None:
        if self.llm is None:
            self.llm = start_vllm(model_dir, self.engine_cfg, int(self.sampling.get("seed", 0)))

    def _params(self, sample_id: str, prompt_len: int) -> Any:
        from vllm import SamplingParams

        s = self.sampling
        return SamplingParams(
            temperature=s["temperature"], top_p=s["top_p"], max_tokens=self.max_new_tokens(prompt_len),
            seed=request_seed(sample_id, s["seed"]), skip_special_tokens=False,
            detokenize=False,  # ids are the product; the profile splits them, so engine-side text is wasted CPU
        )

    def generate_rows(self, rows: list[dict[str, Any]]) -> list[EngineResult]:
        results: list[EngineResult] = []
        for group in prefill_groups([len(r["prompt_ids"]) for r in rows], self._prefill_budget()):
            results += self._generate([rows[i] for i in group])
        return results

    def _prefill_budget(self) -> int | None:
        """On CPU, seeded requests must not have their prefill split across steps.

        vLLM rewinds a request's generator when its prefill is chunked, and the CPU
        generator cannot rewind ("CPU Generator does not use offset"): send at most one
        step's worth of prompt tokens per call there. GPUs have no such limit.
        """
        import torch

        if torch.cuda.is_available():
            return None
        try:
            return int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
        except AttributeError:
            return 2048

    def _generate(self, rows: list[dict[str, Any]]) -> list[EngineResult]:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in rows],
            [self._params(r["sample_id"], len(r["prompt_ids"])) for r in rows],
            use_tqdm=False,
        )
        per_sample = (time.perf_counter() - t0) / len(rows)
        results = []
        for o in outs:
            c = o.outputs[0]
            error = f"request finished with {c.finish_reason!r}" if c.finish_reason == "abort" else None
            results.append(EngineResult(list(c.token_ids), c.finish_reason, per_sample, error))
        return results


def prefill_groups(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Consecutive index groups whose prompt tokens (plus one decode slot each) fit one scheduler step."""
    if budget is None:
        return [list(range(len(lengths)))] if lengths else []
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if groups and used + n + len(groups[-1]) + 1 <= budget:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used = n
    return groups


def start_vllm(model_dir: str, engine: dict[str, Any], seed: int) -> Any:
    """The vLLM engine for one actor; TP > 1 on GPUs runs its workers through Ray (see module doc)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine.get("kv_cache_gib", 1)))
    from vllm import LLM

    tp = int(engine.get("tensor_parallel_size", 1))
    extra: dict[str, Any] = {}
    if tp > 1 and float(engine.get("num_gpus", 0)) > 0:
        extra["distributed_executor_backend"] = "ray"
    if engine.get("gpu_memory_utilization"):
        extra["gpu_memory_utilization"] = float(engine["gpu_memory_utilization"])
    return LLM(
        model=model_dir,
        dtype=engine.get("dtype", "auto"),
        max_model_len=int(engine.get("max_model_len", 4096)),
        tensor_parallel_size=tp,
        enforce_eager=engine.get("enforce_eager", True),
        seed=seed,
        **extra,
    )
