"""Drafter training: a pure in-process `train_loop` and the Ray Train wrapper `train_drafter`.

Determinism: the data order of epoch e is a seeded shuffle of the worker's shard order (Ray Data
runs with `preserve_order`), packing is deterministic, and checkpoints record (step, epoch,
batch in epoch), so a resumed run replays exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline.base.layout import atomic_path, atomic_write
from training.checkpoint import (
    MODEL_FILE,
    LocalCheckpoints,
    LoopState,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from training.config import ARCHITECTURE_FLAGS, DraftTrainConfig, resolve_aux_layer_ids
from training.data import Batch, batches, shuffled, to_sample
from training.loss import TTTObjective, TTTOutput
from training.model import Eagle3Drafter, build_drafter
from training.target import TargetParts, as_target_parts, greedy_ids, read_target_config
from training.trackers import open_trackers
from training.vocab import VocabMapping, build_vocab_mapping

log = logging.getLogger(__name__)
RowsFn = Callable[[int], Iterable[dict]]  # epoch -> this worker's rows
CheckpointSink = Callable[[Path | None, dict], None]  # (checkpoint dir or None, metrics)
VOCAB_FILE = "vocab.safetensors"
METRICS_FILE = "metrics.jsonl"
RUN_NAME = "drafter"
# The DraftTrainConfig fields that define the drafter and how it is trained (aux_layer_ids resolved): a checkpoint
# made under other values is not resumed, since resuming would load the old architecture, vocabulary, optimizer and
# schedule whatever the config says. ``steps`` may grow (more steps continue a run). The other fields say where and
# how a run computes, logs, checkpoints and is measured, and may change between attempts.
TRAINING_SETTINGS = (
    "batch_tokens", "max_len", "lr", "warmup_steps", "weight_decay", "grad_clip", "ttt_steps", "step_decay",
    "teacher_temperature", "loss", "lk_eta", "acceptance_weighting", *ARCHITECTURE_FLAGS, "draft_vocab_size",
    "aux_layer_ids", "init_from_target", "num_workers", "seed", "shuffle_buffer", "steps",
)


@dataclass
class TrainResult:
    """Outcome of `train_drafter`. ``target``: the target's parts the export was built with, for a caller that
    measures the drafter next (held-out acceptance) without reading them again."""

    checkpoint_path: Path
    export_dir: Path
    metrics: dict = field(default_factory=dict)
    target: TargetParts | None = field(default=None, repr=False)


def cosine_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then cosine decay to 0 at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def save_vocab(mapping: VocabMapping, path: Path) -> None:
    """Written whole: a resume reuses a vocab file it finds when it is of the configured size (``reusable_vocab``)."""
    with atomic_path(path) as tmp:
        save_file({"d2t": mapping.d2t, "t2d": mapping.t2d}, str(tmp))


def load_vocab(path: Path) -> VocabMapping:
    t = load_file(str(path))
    return VocabMapping(d2t=t["d2t"], t2d=t["t2d"])


def reusable_vocab(path: Path, size: int) -> bool:
    """Whether the vocab file at ``path`` holds ``size`` draft ids. One that does not (another
    ``draft_vocab_size``, or damaged) is taken from the checkpoint a resume continues (``checkpoint_vocab``), else
    counted again: it is derived from the data."""
    try:
        return load_vocab(path).d2t.numel() == size
    except (OSError, KeyError, SafetensorError):  # absent, or not a vocab file
        return False


def checkpoint_vocab(out_dir: Path, size: int) -> VocabMapping | None:
    """The draft vocabulary of the newest checkpoint a ``train_drafter`` in ``out_dir`` would resume, when it holds
    ``size`` draft ids (None: no such checkpoint reads). A resume must keep it: its weights were trained on those
    ids, and a mapping counted again on other data would be refused (``checkpoint.load_checkpoint``)."""
    # Newest first: a step folder a kill left half-copied does not read, and every checkpoint of one training holds
    # the same mapping, so the next older one serves.
    for path in sorted((Path(out_dir) / "ray" / RUN_NAME).glob(f"step_*/{MODEL_FILE}"), reverse=True):
        try:
            mapping = load_vocab(path)
        except (OSError, KeyError, SafetensorError):
            continue
        return mapping if mapping.d2t.numel() == size else None
    return None


# ----------------------------------------------------------------------------- which checkpoints may resume


def training_settings(cfg: DraftTrainConfig, aux_layer_ids: list[int]) -> dict[str, Any]:
    """The ``TRAINING_SETTINGS`` of a run, its aux layer ids resolved: what a checkpoint must share to resume."""
    return {name: getattr(cfg, name) for name in TRAINING_SETTINGS} | {"aux_layer_ids": list(aux_layer_ids)}


def state_settings(state: Any) -> dict[str, Any] | None:
    """The ``training_settings`` a checkpoint's state.json records (None: not a state it could come from)."""
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        return None
    cfg = state["config"]
    return {k: cfg[k] for k in TRAINING_SETTINGS if k in cfg} | {"aux_layer_ids": state.get("aux_layer_ids")}


def recorded_settings(out_dir: str | Path) -> dict[str, Any] | None:
    """The settings of the newest checkpoint a ``train_drafter`` in ``out_dir`` would resume (None: none read)."""
    found = sorted((Path(out_dir) / "ray" / RUN_NAME).glob("step_*/state.json"))
    try:
        return state_settings(json.loads(found[-1].read_text())) if found else None
    except (OSError, ValueError):
        return None


def changed_settings(before: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """name -> (before, now) of the settings that forbid resuming a training made with ``before``: any that
    differs, ``steps`` only when it shrank. A name ``before`` lacks (recorded by an older version) passes."""
    changed = {}
    for name, value in now.items():
        if name not in before or before[name] == value:
            continue
        if name == "steps" and isinstance(before[name], int) and value > before[name]:
            continue
        changed[name] = (before[name], value)
    return changed


def describe_changes(changed: dict[str, tuple[Any, Any]]) -> str:
    """``lr 0.001 -> 0.0001, loss ce -> tv``: for the line that says why a training starts again."""
    return ", ".join(f"{name} {old} -> {new}" for name, (old, new) in changed.items())


def check_resumable(before: dict[str, Any] | None, now: dict[str, Any], where: Path) -> None:
    """Refuse, naming the settings, to resume a checkpoint in ``where`` made with other ``before`` settings."""
    changed = changed_settings(before or {}, now)
    if changed:
        raise ValueError(f"{where} holds a training made with other settings ({describe_changes(changed)}); it "
                         "cannot be resumed with these: move it away (or train in another folder) to start again")


def uses_bf16(precision: str, device: torch.device) -> bool:
    """Whether training on ``device`` autocasts to bf16 (``DraftTrainConfig.precision``). ``auto`` asks for
    native bf16 arithmetic: a CPU without it emulates bf16 and runs slower than fp32."""
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return device.type == "cuda"


def prepare_drafter(cfg: DraftTrainConfig, target: TargetParts, vocab: VocabMapping) -> Eagle3Drafter:
    """Seeded drafter with the target's embeddings, the vocab mapping and (optionally) the
    target's final norm and lm_head rows of the draft vocab as the initial head."""
    aux_ids = resolve_aux_layer_ids(cfg, target.num_layers)
    drafter = build_drafter(target.config, target.embed_tokens, vocab.d2t.numel(), aux_ids, seed=cfg.seed,
                            architecture=cfg.architecture())
    with torch.no_grad():
        drafter.d2t.copy_(vocab.d2t)
        drafter.t2d.copy_(vocab.t2d)
        if cfg.init_from_target:
            drafter.lm_head.weight.copy_(target.lm_head[vocab.draft_ids])
            if target.final_norm is not None:
                drafter.norm.weight.copy_(target.final_norm)
    return drafter


class TargetIdsCache:
    """Full-vocab target argmax for rows that lack the extraction's ``target_ids``: computed once per
    sample_id (rows repeat every epoch), on the training device, whose copy of the full ``lm_head`` is
    made only then."""

    def __init__(self, lm_head: torch.Tensor, device: torch.device) -> None:
        self.cpu_lm_head = lm_head
        self.device = device
        self.cache: dict[str, np.ndarray] = {}

    @functools.cached_property
    def lm_head(self) -> torch.Tensor:
        return self.cpu_lm_head.to(self.device)

    def sample(self, row: dict, max_len: int):
        key = row.get("sample_id")

        def compute(final: np.ndarray) -> np.ndarray:
            hit = self.cache.get(str(key)) if key is not None else None
            if hit is not None and hit.shape[0] == final.shape[0]:
                return hit
            final = np.require(final, requirements="W")  # Ray's arrays are read-only: copy only those
            ids = greedy_ids(torch.from_numpy(final).to(self.device), self.lm_head).cpu().numpy()
            if key is not None:
                self.cache[str(key)] = ids
            return ids

        return to_sample(row, max_len, compute)


def epoch_batches(
    rows_fn: RowsFn, epoch: int, cfg: DraftTrainConfig, targets: TargetIdsCache, rank: int
) -> Iterator[Batch]:
    """Deterministic packed batches of one epoch of this worker's shard."""
    seed = (cfg.seed * 1_000_003 + epoch) * 997 + rank
    rows = shuffled(rows_fn(epoch), cfg.shuffle_buffer, seed)
    return batches((targets.sample(r, cfg.max_len) for r in rows), cfg.batch_tokens, cfg.max_len)


def batch_stream(
    rows_fn: RowsFn, cfg: DraftTrainConfig, targets: TargetIdsCache, state: LoopState, rank: int,
    active_ranks: Callable[[bool], int] = int,
) -> Iterator[tuple[int, int, Batch, bool, int]]:
    """Endless (epoch, step in epoch, batch, has data, ranks with data) from the recorded data position.

    Ranks pack their shards into different numbers of batches, but an epoch may only start on all of them
    together (Ray Data's streaming split waits for every consumer, and DDP for every rank at each step).
    So each step, ``active_ranks`` (an all-reduce) counts the ranks that still have a batch: a rank whose
    epoch ran out yields its latest batch with ``has data`` False (to be weighted 0) and waits out the
    others' remaining steps; the next epoch starts once no rank has a batch. Steps in an epoch are counted
    alike on every rank, so resuming at step k of an epoch skips k batches on each (a rank that had fewer
    is simply done with that epoch, its last skipped batch standing in).
    """
    epoch, skip = state.epoch, state.batch_in_epoch
    latest: Batch | None = None
    empty_epochs = 0
    while True:
        it = epoch_batches(rows_fn, epoch, cfg, targets, rank)
        for _ in range(skip):
            skipped = next(it, None)
            latest = skipped if skipped is not None else latest
        k = skip
        while True:
            batch = next(it, None)
            latest = batch if batch is not None else latest
            n_active = active_ranks(batch is not None)
            if n_active == 0:
                break
            if latest is None:
                raise ValueError(f"rank {rank} got no training rows while other ranks did: fewer samples than "
                                 "training workers?")
            yield epoch, k, latest, batch is not None, n_active
            k += 1
        empty_epochs = empty_epochs + 1 if k == 0 else 0
        if empty_epochs >= 2:  # no rank had a single batch in two whole epochs
            raise ValueError("training data is empty")
        epoch, skip = epoch + 1, 0


def all_reduce_count(device: torch.device) -> Callable[[bool], int]:
    """How many DDP ranks say yes (one scalar all-reduce on the process group's device)."""
    import torch.distributed as dist

    def count(flag: bool) -> int:
        t = torch.tensor([int(flag)], device=device)
        dist.all_reduce(t)
        return int(t.item())

    return count


def _step_metrics(
    step: int, out: TTTOutput, lr: float, grad_norm: float, tokens: int, seconds: float, epoch: int
) -> dict:
    """One JSONL record: loss/acc per TTT step, lr, grad norm, real tokens and tokens/s of this
    worker (wall time of the step including fetching and packing its batch)."""
    m = {"step": step, "epoch": epoch, "loss": float(out.loss.detach()), "lr": lr,
         "grad_norm": grad_norm, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9)}
    for k, (lk, ak) in enumerate(zip(out.step_losses, out.step_accs, strict=True)):
        m[f"loss_{k}"] = lk
        m[f"acc_{k}"] = ak
    return m


def _logged_step(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line that is not a whole record (a writer killed mid-line,
    the NUL-filled tail a crash can leave), which a resume drops rather than fail on."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _truncate_log(path: Path, last_step: int) -> None:
    """Drop log lines past the resumed step (they were produced after the last checkpoint), and torn ones."""
    if not path.exists():
        return
    lines = path.read_text(errors="replace").splitlines()
    keep = [ln for ln in lines if (step := _logged_step(ln)) is not None and step <= last_step]
    atomic_write(path, "".join(ln + "\n" for ln in keep))  # a kill here keeps the old log, never half of it


def train_loop(
    cfg: DraftTrainConfig,
    target_dir: str | Path | TargetParts,
    out_dir: str | Path,
    rows_fn: RowsFn,
    vocab: VocabMapping,
    *,
    resume_from: Path | None = None,
    checkpoint_sink: CheckpointSink | None = None,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    after_step: Callable[[int], None] | None = None,
) -> tuple[Eagle3Drafter, dict]:
    """Train in this process (one DDP rank when world_size > 1). Returns (drafter, last metrics).

    `target_dir`: the target's folder, or its parts already loaded. `rows_fn(epoch)` yields this rank's rows
    in a stable order. Checkpoints are written to a temp
    dir and handed to `checkpoint_sink` (default: `out_dir/checkpoints`); `after_step(step)` runs
    after each optimizer step and checkpoint (tests use it to interrupt a run)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    sink = checkpoint_sink or LocalCheckpoints(out_dir / "checkpoints", cfg.keep_checkpoints)
    target = as_target_parts(target_dir)
    drafter = prepare_drafter(cfg, target, vocab).to(device)
    lm_head_draft = target.lm_head[vocab.draft_ids].to(device)
    objective: torch.nn.Module = TTTObjective(drafter, lm_head_draft, cfg.ttt_steps, cfg.step_decay,
                                              cfg.teacher_temperature, cfg.loss, cfg.lk_eta, cfg.acceptance_weighting)
    if world_size > 1:
        ids = [device.index] if device.type == "cuda" else None
        objective = torch.nn.parallel.DistributedDataParallel(objective, device_ids=ids)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(cfg.warmup_steps, cfg.steps))
    state = LoopState()
    if resume_from is not None:
        settings = training_settings(cfg, drafter.config.eagle_aux_hidden_state_layer_ids)
        check_resumable(state_settings(read_state(Path(resume_from))), settings, Path(resume_from))
        state = load_checkpoint(Path(resume_from), drafter, optimizer, scheduler)
    log_path = out_dir / METRICS_FILE
    if rank == 0:
        _truncate_log(log_path, state.step)
    trackers = open_trackers(cfg, out_dir, rank=rank, start_step=state.step)  # rank 0 only: TensorBoard, W&B, MLflow
    extra = {"config": cfg.model_dump(), "aux_layer_ids": drafter.config.eagle_aux_hidden_state_layer_ids}
    targets = TargetIdsCache(target.lm_head, device)
    stream = batch_stream(rows_fn, cfg, targets, state, rank,
                          all_reduce_count(device) if world_size > 1 else int)
    bf16 = uses_bf16(cfg.precision, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    metrics: dict = {}
    objective.train()
    while state.step < cfg.steps:
        t_data = time.perf_counter()
        epoch, index, batch, has_data, n_active = next(stream)
        t0 = time.perf_counter()
        # DDP averages gradients over all ranks: make it the mean over the ranks with data; a waiting rank
        # re-runs its latest batch at weight 0 (every rank must take part in every step).
        weight = world_size / n_active if has_data else 0.0
        batch = batch.to(device)
        with autocast:
            out = objective(batch)
        optimizer.zero_grad(set_to_none=True)
        (out.loss * weight if weight != 1.0 else out.loss).backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        optimizer.step()
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        state = LoopState(step=state.step + 1, epoch=epoch, batch_in_epoch=index + 1)
        metrics = _step_metrics(state.step, out, scheduler.get_last_lr()[0], grad_norm,
                                batch.num_tokens if weight else 0, time.perf_counter() - t_data, epoch)
        metrics["data_s"] = t0 - t_data
        metrics["bf16"] = float(bf16)  # a number: every tracker takes scalars only
        if world_size > 1:
            metrics["active_ranks"] = n_active  # below world_size: the tail of an epoch on uneven shards
        # low fill: raise max_len so samples share rows
        metrics["fill"] = batch.num_tokens / batch.input_ids.numel() if weight else 0.0
        if rank == 0:
            with log_path.open("a") as fh:
                fh.write(json.dumps(metrics) + "\n")
            trackers.log_metrics(state.step, metrics)
            if state.step % cfg.log_every == 0 or state.step == cfg.steps:
                # a log record, not a print: in a Ray Train worker, print goes to Ray Train's logger and to stdout
                # (one line twice); the pipeline's console shows the steps from metrics.jsonl (pipeline.base.console)
                accs = " ".join(f"{metrics[f'acc_{k}']:.2f}" for k in range(cfg.ttt_steps))
                log.info("[drafter] step %d/%d loss %.3f acc [%s] %.0f tok/s lr %.2e", state.step, cfg.steps,
                         metrics["loss"], accs, metrics["tokens_per_s"], metrics["lr"])
        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps:
            with tempfile.TemporaryDirectory() as tmp:
                ckpt = save_checkpoint(Path(tmp), drafter, optimizer, scheduler, state, extra) if rank == 0 else None
                sink(ckpt, metrics)
        if after_step is not None:
            after_step(state.step)
    trackers.close()
    return drafter, metrics


# ----------------------------------------------------------------------------- Ray Train


def _ray_worker(config: dict) -> None:
    """Ray Train entry point: one DDP rank reading its dataset shard."""
    import ray.train
    import ray.train.torch

    cfg = DraftTrainConfig.model_validate(config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if not cfg.use_gpu:
        torch.set_num_threads(max(1, int(cfg.resources_per_worker.get("CPU", 1))))
    shard = ray.train.get_dataset_shard("train")

    def rows_fn(epoch: int) -> Iterable[dict]:
        return shard.iter_rows()

    def sink(ckpt_dir: Path | None, metrics: dict) -> None:
        checkpoint = ray.train.Checkpoint.from_directory(str(ckpt_dir)) if ckpt_dir else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"step_{metrics['step']:07d}")

    resumed = ray.train.get_checkpoint()
    common = dict(checkpoint_sink=sink, device=ray.train.torch.get_device(), rank=rank,
                  world_size=world, after_step=config.get("after_step"))
    vocab = load_vocab(Path(config["vocab_path"]))
    if resumed is None:
        train_loop(cfg, config["target_dir"], config["out_dir"], rows_fn, vocab, **common)
        return
    with tempfile.TemporaryDirectory(prefix="drafter_resume_") as local:
        with resumed.as_directory() as ckpt_dir:  # copy: don't hold Ray's lock for the whole run
            shutil.copytree(ckpt_dir, local, dirs_exist_ok=True)
        train_loop(cfg, config["target_dir"], config["out_dir"], rows_fn, vocab, resume_from=Path(local), **common)


def as_dataset(dataset_or_rows):
    """Ray Dataset from a Dataset, a list of row dicts, or a folder of parquet shards."""
    import ray.data

    if isinstance(dataset_or_rows, ray.data.Dataset):
        return dataset_or_rows
    if isinstance(dataset_or_rows, (str, Path)):
        return ray.data.read_parquet(str(dataset_or_rows))
    return ray.data.from_items(list(dataset_or_rows))


def vocab_from_dataset(ds, vocab_size: int, draft_vocab_size: int) -> VocabMapping:
    """Count loss-masked tokens over the dataset (only the two id columns are read)."""
    rows = ds.select_columns(["input_ids", "loss_mask"]).iter_rows()
    return build_vocab_mapping(rows, vocab_size, draft_vocab_size)


def train_drafter(
    dataset_or_rows,
    cfg: DraftTrainConfig,
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    vocab: VocabMapping | None = None,
    after_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train a drafter with Ray Train and export it to `out_dir/export`.

    `dataset_or_rows`: a Ray Dataset (streamed; materialized first when `cfg.materialize`), a
    list of row dicts, or a folder of parquet shards. The draft vocab is counted from the
    dataset's loss-masked tokens unless `vocab` is given (pass it when the dataset is a costly
    stream, e.g. `build_vocab_mapping` over the samples' ids, to avoid an extra pass); it is
    saved in `out_dir` and reused on resume when of the configured size. Re-running with the same
    `out_dir` resumes from the latest checkpoint (Ray Train restores the run `out_dir/ray/drafter`)
    when it was made with the same ``training_settings`` (more steps continue it); other settings
    raise ValueError, naming them, before Ray starts. Uses the running Ray or starts a local one.
    `after_step(step)` runs on every worker after each optimizer step (and
    after that step's checkpoint is reported), as in `train_loop`; it travels to the workers
    pickled, so pass a module-level function or a `functools.partial` of one."""
    import ray
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    from training.export import export_draft

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    target_config = read_target_config(target_dir)  # the workers load the parts; the driver once, after the fit
    aux_ids = resolve_aux_layer_ids(cfg, int(target_config["num_hidden_layers"]))
    # before Ray Train restores the run: its workers would fail on every retry, or resume the old settings silently
    check_resumable(recorded_settings(out_dir), training_settings(cfg, aux_ids), out_dir / "ray")
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False)
    ds = as_dataset(dataset_or_rows)
    if cfg.materialize:
        ds = ds.materialize()
    vocab_path = out_dir / VOCAB_FILE
    draft_size = min(cfg.draft_vocab_size, int(target_config["vocab_size"]))
    if not reusable_vocab(vocab_path, draft_size):
        vocab = (checkpoint_vocab(out_dir, draft_size) or vocab
                 or vocab_from_dataset(ds, int(target_config["vocab_size"]), cfg.draft_vocab_size))
        save_vocab(vocab, vocab_path)
    # Ray's default_ingest_options() as it is minus exclude_resources, which Ray deprecates (and warns about when
    # default_ingest_options passes it on); stable shard order -> exact resume
    current = ray.data.DataContext.get_current().execution_options
    options = ray.data.ExecutionOptions(resource_limits=current.resource_limits, preserve_order=True,
                                        verbose_progress=current.verbose_progress)
    data_config = ray.train.DataConfig(execution_options=options)
    trainer = TorchTrainer(
        _ray_worker,
        train_loop_config={
            "cfg": cfg.model_dump(), "target_dir": str(Path(target_dir).resolve()),
            "out_dir": str(out_dir), "vocab_path": str(vocab_path), "after_step": after_step,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker=cfg.resources_per_worker
        ),
        run_config=ray.train.RunConfig(
            name=RUN_NAME, storage_path=str(out_dir / "ray"),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
        ),
        datasets={"train": ds},
        dataset_config=data_config,
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"training produced no checkpoint: {result.error}")
    ckpt_path = Path(result.checkpoint.path)
    target = as_target_parts(target_dir)
    drafter = load_drafter_checkpoint(ckpt_path, target)
    export_dir = export_draft(drafter, out_dir / "export", target_config=target.config)
    return TrainResult(checkpoint_path=ckpt_path, export_dir=export_dir, metrics=dict(result.metrics or {}),
                       target=target)


def load_drafter_checkpoint(ckpt_dir: str | Path, target_dir: str | Path | TargetParts) -> Eagle3Drafter:
    """Rebuild the drafter of a training checkpoint (embeddings from the target's folder or loaded parts)."""
    from training.checkpoint import load_drafter_tensors, read_state

    state = read_state(Path(ckpt_dir))
    cfg = DraftTrainConfig.model_validate(state["config"])
    target = as_target_parts(target_dir)
    tensors = load_file(str(Path(ckpt_dir) / "model.safetensors"))
    vocab = VocabMapping(d2t=tensors["d2t"], t2d=tensors["t2d"])
    drafter = prepare_drafter(cfg.model_copy(update={"aux_layer_ids": state["aux_layer_ids"]}), target, vocab)
    load_drafter_tensors(Path(ckpt_dir), drafter)
    return drafter
