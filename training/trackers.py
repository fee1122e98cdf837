"""Training metrics where ML engineers look: TensorBoard event files, Weights & Biases, MLflow.

``training.trackers`` (default ``[tensorboard]``) names the trackers; each is a ``Tracker``:
``log_metrics(step, metrics)``, ``log_summary(summary)``, ``close()``. Only rank 0 opens any.
A tracker whose package is missing or that is not configured (W&B: ``wandb_project`` or
``WANDB_PROJECT``; MLflow: ``mlflow_tracking_uri`` or ``MLFLOW_TRACKING_URI``) is skipped with one
warning line, and so is one that fails: a tracker never stops training. ``metrics.jsonl`` stays the
record; trackers are views of it.

Tags (the same in every tracker): ``loss/total``, ``loss/position_k``, ``acc/position_k``,
``acceptance_est/position_k`` (the product of the accuracies up to k: the chance that the first k+1
drafts are all right if positions were independent; the held-out figures are the measured ones),
``train/lr``, ``train/tokens_per_s``, ``train/grad_norm``, ``train/fill``, ... At the end of a
pipeline run, ``log_run_summary`` adds the data side from the run report (``data/...``,
``heldout/...``, ``throughput/...``, ``seconds/...``) at the last training step.

W&B and MLflow runs are resumed, not duplicated, by a restarted worker and by the summary: their
run ids are kept in ``OUT/trackers.json``. TensorBoard files go to ``OUT/tensorboard/``
(``tensorboard --logdir OUTPUT/drafter/tensorboard``); a resumed run purges the events a killed
attempt logged past its checkpoint, as ``metrics.jsonl`` is truncated.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from pipeline.base.layout import atomic_write_json

log = logging.getLogger("training.trackers")

TENSORBOARD_DIR = "tensorboard"
RUN_IDS_FILE = "trackers.json"
KNOWN = ("tensorboard", "wandb", "mlflow")
FLUSH_EVERY_S = 5.0  # TensorBoard events reach the disk at least this often (a killed worker loses no more)
_PER_POSITION = re.compile(r"^(loss|acc)_(\d+)$")
_TAG_CHARS = re.compile(r"[^A-Za-z0-9_\-./ :]")  # what MLflow accepts in a metric name
_TRAIN_RENAMES = {"loss": "loss/total"}


class Tracker(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_summary(self, summary: dict[str, float], step: int | None = None) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- tags


def tag(name: str) -> str:
    """A metric name every tracker accepts (MLflow is the strictest)."""
    return _TAG_CHARS.sub("_", name)[:250]


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """One ``metrics.jsonl`` record as tracker tags (``step`` is the x axis, not a scalar)."""
    out: dict[str, float] = {}
    accs: dict[int, float] = {}
    for key, value in metrics.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        m = _PER_POSITION.match(key)
        if m:
            out[f"{m[1]}/position_{m[2]}"] = float(value)
            if m[1] == "acc":
                accs[int(m[2])] = float(value)
        else:
            out[_TRAIN_RENAMES.get(key, f"train/{key}")] = float(value)
    chain = 1.0
    for k in sorted(accs):
        chain *= accs[k]
        out[f"acceptance_est/position_{k}"] = chain
    return out


def report_scalars(report: dict[str, Any]) -> dict[str, float]:
    """The data side of a run report as tracker tags: samples per source, spend, quarantine reasons,
    flagged checks, held-out acceptance per position, throughput and seconds per stage."""
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag(name)] = float(value)

    for k in ("rows_in", "passed", "quarantined", "not_generated", "tokens_generated"):
        put(f"data/{k}", report.get(k))
    for name, src in (report.get("sources") or {}).items():
        put(f"data/samples_per_source/{name}", src.get("served"))
        put(f"data/spilled_per_source/{name}", src.get("spilled"))
        put(f"data/left_to_do_per_source/{name}", sum((src.get("left_to_do") or {}).values()))
    for name, spend in (report.get("spend") or {}).items():
        datasets = spend.get("datasets") or {}
        put(f"data/spend_usd/{name}", sum(d.get("cost") or 0.0 for d in datasets.values()))
        put(f"data/spend_tokens/{name}", sum(d.get("spent") or 0 for d in datasets.values()))
    put("data/spend_usd_this_attempt", (report.get("this_attempt") or {}).get("cost_usd"))
    for reason, n in (report.get("quarantine_reasons") or {}).items():
        put(f"data/quarantine_reason/{reason}", n)
    for stage, n in (report.get("quarantine_by_stage") or {}).items():
        put(f"data/quarantine_stage/{stage}", n)
    for check, n in (report.get("flagged") or {}).items():
        put(f"data/flagged/{check}", n)
    billing = (report.get("audit") or {}).get("billing") or {}
    put("data/billing_mean_abs_diff", billing.get("mean_abs_diff"))
    for k, v in (report.get("throughput") or {}).items():
        put(f"throughput/{k}", v)
    for k, v in (report.get("seconds") or {}).items():
        put(f"seconds/{k}", v)
    held = (report.get("training") or {}).get("heldout") or {}
    put("heldout/acceptance_length", held.get("acceptance_length"))
    put("heldout/samples", held.get("samples"))
    for k, v in enumerate(held.get("per_position") or []):
        put(f"heldout/acceptance/position_{k}", v)
    for field in ("dataset", "source"):
        for g in held.get(f"by_{field}") or []:
            if isinstance(g, dict):
                put(f"heldout/by_{field}/{g.get('name')}/acceptance_length", g.get("acceptance_length"))
    costs = report.get("costs") if isinstance(report.get("costs"), dict) else {}
    for name, c in (costs.get("by_dataset") or {}).items():
        if isinstance(c, dict):
            put(f"data/cost_usd_per_dataset/{name}", c.get("usd"))
            put(f"data/device_hours_per_dataset/{name}", c.get("device_hours"))
    served = (report.get("training") or {}).get("served") or {}
    put("served/acceptance_length", served.get("acceptance_length"))
    for k, v in enumerate(served.get("per_position") or []):
        put(f"served/acceptance/position_{k}", v)
    return out


# ----------------------------------------------------------------------------- trackers


class TensorBoardTracker:
    """Event files in ``log_dir`` (one file per process that wrote; TensorBoard merges them)."""

    def __init__(self, log_dir: Path, start_step: int = 0, flush_every_s: float | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        # a resumed run: drop what a killed attempt logged after its last checkpoint
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)
        self.flush_every_s = FLUSH_EVERY_S if flush_every_s is None else flush_every_s
        self.flushed = time.monotonic()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        if time.monotonic() - self.flushed >= self.flush_every_s:
            self.writer.flush()
            self.flushed = time.monotonic()

    def log_summary(self, summary: dict[str, float], step: int | None = None) -> None:
        for name, value in summary.items():
            self.writer.add_scalar(name, value, step or 0)
        lines = ["| figure | value |", "|---|---|"] + [f"| {k} | {v:g} |" for k, v in sorted(summary.items())]
        self.writer.add_text("run_report", "\n".join(lines), step or 0)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_summary(self, summary: dict[str, float], step: int | None = None) -> None:
        self.run.summary.update(summary)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def _log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._log(metrics, step)

    def log_summary(self, summary: dict[str, float], step: int | None = None) -> None:
        self._log(summary, step or 0)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """All open trackers as one; a tracker that raises is closed, dropped and named once."""

    def __init__(self, trackers: dict[str, Tracker] | None = None) -> None:
        self.trackers = dict(trackers or {})

    @property
    def names(self) -> list[str]:
        return list(self.trackers)

    def _each(self, what: str, *args: Any) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                getattr(tracker, what)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                log.warning("tracker %s failed in %s and is dropped: %s", name, what, _one_line(e))
                self.trackers.pop(name, None)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if self.trackers:
            self._each("log_metrics", step, scalars(metrics))

    def log_summary(self, summary: dict[str, float], step: int | None = None) -> None:
        if self.trackers:
            self._each("log_summary", summary, step)

    def close(self) -> None:
        self._each("close")
        self.trackers.clear()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


def _skip(name: str, why: str) -> None:
    log.warning("tracker %s skipped: %s", name, why)


def _run_ids(out_dir: Path) -> dict[str, str]:
    try:
        return json.loads((out_dir / RUN_IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _save_run_id(out_dir: Path, name: str, run_id: str) -> None:
    ids = _run_ids(out_dir)
    if ids.get(name) != run_id:
        atomic_write_json(out_dir / RUN_IDS_FILE, ids | {name: run_id})


def _open_wandb(cfg: Any, out_dir: Path) -> Tracker | None:
    project = cfg.wandb_project or os.environ.get("WANDB_PROJECT")
    if not project:
        _skip("wandb", "not configured (set training.wandb_project or WANDB_PROJECT)")
        return None
    try:
        import wandb
    except ImportError:
        _skip("wandb", "the wandb package is not installed (pip install wandb)")
        return None
    run_id = _run_ids(out_dir).get("wandb")
    run = wandb.init(project=project, entity=cfg.wandb_entity, name=cfg.tracker_run_name, id=run_id,
                     resume="allow", dir=str(out_dir), config=cfg.model_dump())
    _save_run_id(out_dir, "wandb", run.id)
    return WandbTracker(run)


def _open_mlflow(cfg: Any, out_dir: Path) -> Tracker | None:
    uri = cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        _skip("mlflow", "not configured (set training.mlflow_tracking_uri or MLFLOW_TRACKING_URI)")
        return None
    try:
        from mlflow import MlflowClient
        from mlflow.entities import Param
    except ImportError:
        _skip("mlflow", "the mlflow package is not installed (pip install mlflow)")
        return None
    client = MlflowClient(tracking_uri=uri)
    run_id = _run_ids(out_dir).get("mlflow")
    if run_id is None:
        exp = client.get_experiment_by_name(cfg.mlflow_experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(cfg.mlflow_experiment)
        run_id = client.create_run(exp_id, run_name=cfg.tracker_run_name).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in cfg.model_dump().items()]
        client.log_batch(run_id, params=params)
        _save_run_id(out_dir, "mlflow", run_id)
    else:
        client.update_run(run_id, status="RUNNING")
    return MlflowTracker(client, run_id)


def open_trackers(cfg: Any, out_dir: str | Path, *, rank: int = 0, start_step: int = 0) -> Trackers:
    """The trackers ``cfg.trackers`` names, open (rank 0 only; other ranks get none).

    ``cfg`` is a ``DraftTrainConfig``; ``out_dir`` the drafter folder (``OUTPUT/drafter``);
    ``start_step`` the step a resumed run continues from."""
    if rank != 0:
        return Trackers()
    out_dir = Path(out_dir)
    opened: dict[str, Tracker] = {}
    for name in dict.fromkeys(getattr(cfg, "trackers", None) or []):
        try:
            if name == "tensorboard":
                try:
                    tracker: Tracker | None = TensorBoardTracker(out_dir / TENSORBOARD_DIR, start_step)
                except ImportError:
                    _skip(name, "the tensorboard package is not installed (pip install tensorboard)")
                    tracker = None
            elif name == "wandb":
                tracker = _open_wandb(cfg, out_dir)
            elif name == "mlflow":
                tracker = _open_mlflow(cfg, out_dir)
            else:
                _skip(name, f"unknown tracker (known: {', '.join(KNOWN)})")
                tracker = None
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            _skip(name, f"failed to start: {_one_line(e)}")
            tracker = None
        if tracker is not None:
            opened[name] = tracker
    return Trackers(opened)


def log_run_summary(cfg: Any, out_dir: str | Path, report: dict[str, Any]) -> list[str]:
    """Log the run report's data-side figures to the trackers (at the last training step) and close
    them; returns the names of the trackers written. For the pipeline's driver, after training."""
    step = int(((report.get("training") or {}).get("metrics") or {}).get("step") or 0)
    trackers = open_trackers(cfg, out_dir, start_step=0)
    try:
        trackers.log_summary(report_scalars(report), step)
        return trackers.names
    finally:
        trackers.close()
