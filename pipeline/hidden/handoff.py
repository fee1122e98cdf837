"""From written samples to a trained drafter: hidden-state extraction handed to the Ray Train loop.

Two ways to hand the states over (``extraction.mode``), one flow: each is a
``Handoff`` in ``HANDOFFS`` and says what differs (``prepare``, ``hidden_rows``,
``draft_vocab``, ...); ``extract_and_train`` never asks which one it has.

- ``stream`` (default, ``StreamHandoff``): the extraction actors' Ray Dataset
  *is* the training input; nothing is written. Held-out evaluation re-runs a
  small extraction.
- ``shards`` (``ShardsHandoff``): extraction writes Arrow shards to ``hidden/``
  first (resumable); training and held-out evaluation read them back.

Either way a hash-chosen held-out slice of the samples (``heldout_fraction``)
never reaches training or the draft vocabulary, and the exported drafter's
acceptance on it ends the phase.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from pipeline.base.config import ExtractionConfig
from pipeline.base.console import Console, ExtractWatch, TrainWatch, heldout_line, served_line
from pipeline.base.layout import RunLayout, atomic_write_json
from pipeline.base.records import read_samples, read_samples_dataset
from pipeline.report.summary import Timings

if TYPE_CHECKING:
    from pipeline.run.config import RunConfig
    from training.vocab import VocabMapping

DATA_FILE = "data.json"  # in drafter/: which training samples its checkpoints were made from
SAMPLE_INPUT_COLUMNS = ["sample_id", "dataset", "row_index", "source", "prompt_ids", "prompt_assistant_mask",
                        "output_ids"]


@dataclass(frozen=True)
class Handoff:
    """What every step of the phase needs: the config, the folder, the layers to capture."""

    cfg: RunConfig
    layout: RunLayout
    aux_layer_ids: list[int]
    heldout: float  # fraction of samples held out of training

    def extractor_kwargs(self) -> dict[str, Any]:
        ex = self.cfg.extraction
        vllm = dict(ex.vllm)
        if ex.tensor_parallel_size > 1:  # workers as Ray tasks in the actor's placement group (extraction_resources)
            vllm |= {"tensor_parallel_size": ex.tensor_parallel_size, "distributed_executor_backend": "ray"}
        return {"backend": ex.backend, "dtype": ex.dtype, "device_map": ex.device_map, "vllm_options": vllm,
                "stats_dir": str(self.layout.extract_stats), "target_ids": ex.stores_target_ids}

    def resources(self) -> dict[str, Any]:
        return extraction_resources(self.cfg.extraction)

    def split(self, rows: Any, keep_heldout: bool) -> Any:
        """Only the held-out rows (at most ``heldout_max_samples``, for evaluation), or all the others."""
        from training.heldout import select_heldout

        if not self.heldout:
            return rows
        split = rows.map_batches(select_heldout, fn_kwargs={"fraction": self.heldout, "keep": keep_heldout},
                                 batch_format="pyarrow", num_cpus=0)
        return split.limit(self.cfg.training.heldout_max_samples) if keep_heldout else split

    # What differs between the modes (the stream's answers here; ShardsHandoff overrides them).
    keeps_shards = False  # the run's states stay in hidden/ (a value run reads them there)
    without_training = False  # extraction has a use with training off (``training: null``)
    train_timing = "extract+train"  # the report's name for the training step's time

    def prepare(self, console: Console, timings: Timings) -> None:
        """What runs before training reads ``hidden_rows``."""

    def draft_vocab(self, target_vocab: int) -> VocabMapping | None:
        """The draft vocabulary, when it must be counted here (None: training counts it from its rows)."""
        return None

    def feeding(self) -> ExtractWatch | None:
        """What the training line shows of the states still being extracted, if any."""
        return None

    def heldout_waiting(self, watch: ExtractWatch) -> str:
        """The held-out line while the held-out rows are being read."""
        return "[held-out] measuring the drafter"

    def hidden_rows(self, keep_heldout: bool) -> Any:
        """Extracted rows (hidden states + loss mask) as a Ray Dataset: the training rows or the held-out ones.
        Here the extraction actors over the (split) samples, nothing written; ``ShardsHandoff`` reads shards."""
        import ray.data

        from pipeline.hidden.extract import HiddenStateExtractor

        ex = self.cfg.extraction
        samples, _ = read_samples_dataset(self.layout.samples, SAMPLE_INPUT_COLUMNS)  # one row per sample id
        return self.split(samples, keep_heldout).map_batches(
            HiddenStateExtractor,
            fn_constructor_args=(self.cfg.model.path, self.aux_layer_ids, ex.max_len, ex.too_long, ex.batch_tokens,
                                 self.layout),
            fn_constructor_kwargs=self.extractor_kwargs() | {"out_dtype": ex.shard_dtype},
            batch_format="pyarrow", batch_size=ex.rows_per_call,
            compute=ray.data.ActorPoolStrategy(size=ex.num_actors), **self.resources(),
        )

    def write_shards(self, out_dir: Path | None = None, stats_dir: Path | None = None) -> None:
        """Extract every passed sample (held-out ones too) into shards in ``out_dir`` (default ``hidden/``, mode
        ``shards``), its statistics into ``stats_dir`` (default the run's); resumable."""
        from pipeline.hidden.shards import extract_to_shards

        ex, lay = self.cfg.extraction, self.layout
        kwargs = self.extractor_kwargs() | ({"stats_dir": str(stats_dir)} if stats_dir else {})
        extract_to_shards(lay.samples, out_dir or lay.hidden, model_dir=self.cfg.model.path,
                          aux_layer_ids=self.aux_layer_ids, max_len=ex.max_len, too_long=ex.too_long,
                          batch_tokens=ex.batch_tokens,
                          layout=lay, samples_per_shard=ex.samples_per_shard,
                          rows_per_call=ex.rows_per_call, dtype=ex.shard_dtype, num_actors=ex.num_actors,
                          num_cpus=ex.num_cpus, num_gpus=ex.num_gpus, extractor_kwargs=kwargs,
                          ray_resources=self.resources())


class StreamHandoff(Handoff):
    """The extraction actors' Dataset is the training input; held-out evaluation extracts its slice again."""

    def draft_vocab(self, target_vocab: int) -> VocabMapping | None:
        # counted from the samples, not the stream: counting the stream would run the extraction once more
        ex, tcfg = self.cfg.extraction, self.cfg.training
        return draft_vocab_from_samples(self.layout, target_vocab, tcfg.draft_vocab_size, ex.max_len, ex.too_long,
                                        self.heldout)

    def feeding(self) -> ExtractWatch | None:
        # a materialized stream is extracted whole before the first step; otherwise extraction runs alongside
        if not self.cfg.training.materialize:
            return None
        return ExtractWatch(self.layout.extract_stats, training_samples(self.layout, self.heldout))

    def heldout_waiting(self, watch: ExtractWatch) -> str:
        return watch.line()


class ShardsHandoff(Handoff):
    """Extraction writes shards to hidden/ once (resumable); training and held-out evaluation read them."""

    keeps_shards = True
    without_training = True  # the shards stay for a later training or a value run
    train_timing = "train"

    def prepare(self, console: Console, timings: Timings) -> None:
        t0 = time.perf_counter()
        with placement_groups_released(), console.phase(ExtractWatch(self.layout.extract_stats, None).line):
            self.write_shards()
        timings.add("extract", t0)

    def hidden_rows(self, keep_heldout: bool) -> Any:
        from pipeline.hidden.shards import hidden_shards_dataset

        return self.split(hidden_shards_dataset(self.layout.hidden), keep_heldout)


HANDOFFS: dict[str, type[Handoff]] = {"stream": StreamHandoff, "shards": ShardsHandoff}


def handoff_for(cfg: RunConfig, layout: RunLayout, aux_layer_ids: list[int], heldout: float) -> Handoff:
    """The hand-off of the run's ``extraction.mode``."""
    return HANDOFFS[cfg.extraction.mode](cfg, layout, aux_layer_ids, heldout)


def extraction_resources(ex: ExtractionConfig) -> dict[str, Any]:
    """``map_batches`` resources of an extraction actor. An engine backend with TP > 1 (validated: vllm on
    GPUs) is placed like a vLLM source's actor: no GPU itself, a placement group of TP one-GPU bundles on
    one node that the engine's Ray workers fill (pipeline.generate.sources.chain). Otherwise the actor holds
    ``num_cpus``/``num_gpus`` (a fraction of a GPU too) itself. A vLLM engine actor also gets the engine
    actors' runtime env, so it stops its engine itself when retired (see ENGINE_ACTOR_ENV)."""
    from pipeline.generate.sources.chain import ENGINE_ACTOR_ENV, engine_resources

    if ex.tensor_parallel_size > 1:
        resources = engine_resources(ex)
    else:
        resources = {"num_cpus": ex.num_cpus, "num_gpus": ex.num_gpus,
                     **({"resources": dict(ex.resources)} if ex.resources else {})}
    return resources | ({"runtime_env": ENGINE_ACTOR_ENV} if ex.backend_facts.holds_engine else {})


@contextmanager
def placement_groups_released() -> Iterator[None]:
    """The placement groups an extraction pass made outlive its actors: remove them when the pass ends, so
    the next pass (held-out evaluation) finds the GPUs free."""
    try:
        yield
    finally:
        from pipeline.generate.sources.chain import release_placement_groups

        release_placement_groups()


def skip_reason(cfg: RunConfig, layout: RunLayout) -> str | None:
    if not any(layout.samples.glob("*.parquet")):
        return "no passed samples to train on"
    if cfg.training is None and not HANDOFFS[cfg.extraction.mode].without_training:
        return "training is off and extraction streams into training: nothing to extract"
    return None


def extract_and_train(cfg: RunConfig, layout: RunLayout, timings: Timings,
                      console: Console | None = None) -> dict[str, Any]:
    """Extract hidden states, train the drafter on them, export it, and measure it on held-out samples; each
    step shows its progress on ``console``."""
    from pipeline.base.logs import adopt_transformers_logging
    from pipeline.hidden.extract import bytes_per_token, read_extract_stats
    from training.config import DraftTrainConfig, resolve_aux_layer_ids
    from training.target import read_target_config

    if reason := skip_reason(cfg, layout):
        return {"skipped": reason}
    adopt_transformers_logging()  # the driver's first use of transformers in a run with no tiny target to build
    console = console or Console()
    tcfg, ex = cfg.training, cfg.extraction
    target_cfg = read_target_config(cfg.model.path)  # the language model's, also for a multimodal checkpoint
    aux_ids = ex.aux_layer_ids or resolve_aux_layer_ids(tcfg or DraftTrainConfig(), target_cfg["num_hidden_layers"])
    h = handoff_for(cfg, layout, aux_ids, tcfg.heldout_fraction if tcfg is not None else 0.0)
    # The report's extraction figures are this attempt's: an earlier attempt's actors left their own files
    # (a resumed run summed both: 384 samples extracted for 192).
    for stale in layout.extract_stats.glob("extract-*.json"):
        stale.unlink(missing_ok=True)
    result: dict[str, Any] = {"aux_layer_ids": aux_ids, "extraction_mode": ex.mode,
                              "bytes_per_token": bytes_per_token(target_cfg["hidden_size"], len(aux_ids))}
    h.prepare(console, timings)
    rows = h.hidden_rows(keep_heldout=False)
    t0 = time.perf_counter()
    if tcfg is None:
        with placement_groups_released():
            result["extracted"] = rows.count()
        timings.add("read_shards", t0)
    else:
        from training.heldout import heldout_acceptance
        from training.train import train_drafter, training_settings

        train_cfg = tcfg.model_copy(update={"aux_layer_ids": aux_ids})
        fresh_drafter(layout, *training_data(layout, h.heldout), console, training_settings(train_cfg, aux_ids))
        vocab = h.draft_vocab(target_cfg["vocab_size"])
        with placement_groups_released(), console.phase(TrainWatch(layout.metrics, tcfg.steps, h.feeding()).lines):
            res = train_drafter(rows, train_cfg, cfg.model.path, layout.drafter, vocab=vocab)
        timings.add(h.train_timing, t0)
        result.update(checkpoint=str(res.checkpoint_path), export_dir=str(res.export_dir),
                      metrics={k: v for k, v in res.metrics.items() if isinstance(v, (int, float, str))})
        if h.heldout:
            t0 = time.perf_counter()
            watch = ExtractWatch(layout.extract_stats, None, label="held-out")

            def held_line(final: bool) -> str:
                if final and "heldout" in result:
                    return heldout_line(result["heldout"], time.perf_counter() - t0)
                return h.heldout_waiting(watch)

            with console.phase(held_line):
                # stream mode: a second, small extraction pass (one more engine start-up); shards: a re-read
                with placement_groups_released():
                    held = h.hidden_rows(keep_heldout=True).take_all()
                result["heldout"] = heldout_acceptance(res.export_dir, res.target or cfg.model.path, held, tcfg.eval_k,
                                                       sample_labels(layout, [r["sample_id"] for r in held]))
            timings.add("heldout_eval", t0)
            if tcfg.served_eval:
                result["served"] = served_phase(cfg, layout, console, str(res.export_dir), result["heldout"],
                                                [str(r["sample_id"]) for r in held], timings)
    result["extraction"] = read_extract_stats(layout.extract_stats) if layout.extract_stats.exists() else {}
    return result


def training_data(layout: RunLayout, heldout_fraction: float) -> tuple[str, int]:
    """(digest, count) of the passed samples that reach training: what a drafter's checkpoints were made from."""
    from training.heldout import is_held_out

    rows, _ = read_samples(layout.samples, ["sample_id"]) if layout.samples.is_dir() else ([], 0)
    ids = sorted(str(r["sample_id"]) for r in rows if not is_held_out(str(r["sample_id"]), heldout_fraction))
    h = hashlib.sha256()
    for sid in ids:
        h.update(sid.encode() + b"\x1f")
    return h.hexdigest(), len(ids)


def fresh_drafter(layout: RunLayout, digest: str, samples: int, console: Console,
                  settings: dict[str, Any] | None = None) -> None:
    """Keep ``drafter/`` for a resumed training only when its checkpoints were made from these samples with these
    training settings (``training.train.training_settings``; ``steps`` may grow, more steps continue a run).

    A re-run that added samples (a raised ``max_rows`` or budget, a plan's fragment) would otherwise resume the
    finished training at its last step and export the old drafter, the new samples never trained on; one that
    changed a setting (lr, loss, draft_vocab_size, an architecture flag) would resume the old optimizer, schedule
    and vocabulary, or fail on every retry on the old architecture. Such a folder moves to ``drafter.previous/``
    (one kept) and training starts from step 0, with a console line. A folder from before ``data.json`` existed is
    taken as made from these samples (its resume is kept); one whose ``data.json`` predates the settings is
    compared with the settings its newest checkpoint records."""
    d = layout.drafter
    meta = d / DATA_FILE
    settings = settings or {}
    if d.is_dir():
        before = _read_data_file(meta)
        reason = _stale_reason(before, digest, samples, settings, d)
        if reason:
            prev = d.with_name(d.name + ".previous")
            shutil.rmtree(prev, ignore_errors=True)
            d.rename(prev)
            console.line(f"[train] {reason}: training again from step 0; the previous drafter is in {prev}")
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(meta, {"samples": samples, "digest": digest, "settings": settings})


def _read_data_file(path: Path) -> dict[str, Any] | None:
    """``data.json``: None when absent, {} when it does not read as an object (taken as other samples)."""
    if not path.is_file():
        return None
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return before if isinstance(before, dict) else {}


def _stale_reason(before: dict[str, Any] | None, digest: str, samples: int, settings: dict[str, Any],
                  drafter: Path) -> str | None:
    """Why the drafter folder cannot be resumed (``before``: its ``data.json``), or None when it can."""
    from training.train import changed_settings, describe_changes, recorded_settings

    if before is not None and before.get("digest") != digest:
        return (f"the training samples changed since the drafter was trained ({before.get('samples')} then, "
                f"{samples} now)")
    recorded = before.get("settings") if before is not None else None
    if not isinstance(recorded, dict):
        recorded = recorded_settings(drafter) or {}
    changed = changed_settings(recorded, settings)
    if not changed:
        return None
    return f"the training settings changed since the drafter was trained ({describe_changes(changed)})"


def served_phase(cfg: RunConfig, layout: RunLayout, console: Console, export_dir: str, heldout: dict[str, Any],
                 sample_ids: list[str], timings: Timings) -> dict[str, Any]:
    """The export served by vLLM on the held-out prompts (pipeline.hidden.served_eval), with its console line."""
    from pipeline.hidden.served_eval import measure_served

    t0 = time.perf_counter()
    out: dict[str, Any] = {}

    def line(final: bool) -> str:
        return served_line(out, time.perf_counter() - t0) if final else "[served] measuring the export in vLLM"

    with console.phase(line), placement_groups_released():
        out.update(measure_served(cfg, export_dir, layout.samples, heldout, sample_ids))
    timings.add("served_eval", t0)
    return out


def sample_labels(layout: RunLayout, sample_ids: list[Any]) -> dict[str, dict[str, Any]]:
    """Dataset and source of these samples (hidden rows carry neither), from one columnar read of samples/."""
    want = {str(s) for s in sample_ids}
    rows, _ = read_samples(layout.samples, ["sample_id", "dataset", "source"])
    return {r["sample_id"]: r for r in rows if r["sample_id"] in want}


def training_samples(layout: RunLayout, heldout_fraction: float) -> int:
    """Passed samples that reach training (the held-out ones excepted): what a streamed extraction will do."""
    from training.heldout import is_held_out

    ids = {sid for f in sorted(layout.samples.glob("*.parquet"))
           for sid in pq.read_table(f, columns=["sample_id"]).column("sample_id").to_pylist()}
    return sum(not is_held_out(sid, heldout_fraction) for sid in ids)


def draft_vocab_from_samples(layout: RunLayout, vocab_size: int, draft_vocab_size: int, max_len: int,
                             too_long: str, heldout_fraction: float = 0.0) -> VocabMapping:
    """The draft vocabulary over the loss-masked tokens the extraction stage will emit for the training
    samples (held-out samples excluded)."""
    from pipeline.hidden.extract import prepare_sample
    from training.heldout import is_held_out
    from training.vocab import build_vocab_mapping

    def rows() -> Iterator[dict[str, Any]]:
        seen: set[str] = set()  # a sample written twice counts once
        for f in sorted(layout.samples.glob("*.parquet")):
            table = pq.read_table(f, columns=["sample_id", "prompt_ids", "prompt_assistant_mask", "output_ids"])
            for r in table.to_pylist():
                if is_held_out(r["sample_id"], heldout_fraction) or r["sample_id"] in seen:
                    continue
                seen.add(r["sample_id"])
                prepared = prepare_sample(r["prompt_ids"], r["prompt_assistant_mask"], r["output_ids"], max_len,
                                          too_long)
                if not isinstance(prepared, str):  # a reason: the extraction stage quarantines it
                    yield {"input_ids": prepared[0], "loss_mask": prepared[1]}

    return build_vocab_mapping(rows(), vocab_size, draft_vocab_size)
