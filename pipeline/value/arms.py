"""The value drafters: short drafters trained on nested fractions of one dataset's samples, the others whole.

One *arm* is one drafter: every dataset at fraction 1 (the full arm), or one dataset at 0 (left out), 25% or
50% and the rest whole. Fractions are nested by a salted hash of the sample id (a sample in the 25% arm is in
the 50% one), and every arm trains on the same number of steps, so an arm differs from the full one only in
what that dataset's samples taught. Each arm is measured on the run's own held-out samples, per dataset.

``train_arm`` runs one arm in one process (a Ray task in ``pipeline.run.value``): it streams the hidden-state
shards, keeps the arm's rows, counts its draft vocabulary, trains (resuming its own checkpoints), exports,
and writes ``result.json`` last, so a killed value run redoes only the arms without one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.base.layout import atomic_write_json, last_json_line

RESULT_FILE = "result.json"
SETTINGS_FILE = "train.json"  # the arm and training config its checkpoints were made with
DEFAULT_FRACTIONS = (0.0, 0.25, 0.5)


def value_score(sample_id: str) -> float:
    """A uniform number in [0, 1) fixed by the sample id, salted apart from the held-out split's hash."""
    digest = hashlib.sha256(f"value\x1f{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass(frozen=True)
class Arm:
    """One value drafter: ``dataset`` at ``fraction`` (None: the full arm, every dataset whole), one seed."""

    dataset: str | None
    fraction: float
    seed: int

    @property
    def name(self) -> str:
        what = "full" if self.dataset is None else f"{self.dataset}@{self.fraction:g}"
        return f"{what}.seed{self.seed}"

    def fraction_of(self, dataset: str) -> float:
        return self.fraction if dataset == self.dataset else 1.0

    def keeps(self, sample_id: str, dataset: str) -> bool:
        f = self.fraction_of(dataset)
        return f >= 1.0 or value_score(sample_id) < f

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dataset": self.dataset, "fraction": self.fraction, "seed": self.seed}


def value_arms(datasets: Sequence[str], fractions: Sequence[float] = DEFAULT_FRACTIONS,
               seeds: Sequence[int] = (0,)) -> list[Arm]:
    """The full arm and, per dataset, one arm per fraction below 1; each for every seed."""
    out = []
    for seed in dict.fromkeys(seeds):  # each once, in the order given
        out.append(Arm(None, 1.0, seed))
        out += [Arm(d, float(f), seed) for d in dict.fromkeys(datasets) for f in sorted(set(fractions)) if f < 1.0]
    return out


def arm_trains(arm: Arm, sample_id: str, datasets: Mapping[str, str], heldout_fraction: float) -> bool:
    """Whether the arm trains on this sample: a passed one (``datasets``: sample id -> dataset), not held out,
    and within the arm's fraction of its dataset."""
    from training.heldout import is_held_out

    return (sample_id in datasets and not is_held_out(sample_id, heldout_fraction)
            and arm.keeps(sample_id, datasets[sample_id]))


def arm_spend(arm: Arm, samples: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per dataset, the training samples the arm keeps and what they cost (``usd``, ``tokens``): the spend axis
    of the curves. ``samples``: the training samples (held-out ones excepted), each with ``sample_id``,
    ``dataset``, ``usd`` and ``tokens``."""
    out: dict[str, dict[str, float]] = {}
    for s in samples:
        acc = out.setdefault(str(s["dataset"]), {"samples": 0, "usd": 0.0, "tokens": 0})
        if arm.keeps(str(s["sample_id"]), str(s["dataset"])):
            acc["samples"] += 1
            acc["usd"] += float(s["usd"])
            acc["tokens"] += int(s["tokens"])
    return out


# Training fields that do not shape an arm's drafter or its measurement: changing them keeps its result.
NOT_SHAPING = frozenset({"num_workers", "use_gpu", "resources_per_worker", "checkpoint_every", "keep_checkpoints",
                         "max_failures", "log_every", "trackers", "wandb_project", "wandb_entity",
                         "mlflow_tracking_uri", "mlflow_experiment", "tracker_run_name", "materialize",
                         "served_eval"})


def arm_train_config(arm: Arm, train_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The training config an arm trains with: the run's, at the arm's seed, with no tracker (a value run
    must not add a W&B or MLflow run per arm under the real run's name); metrics.jsonl is always written."""
    from training.config import DraftTrainConfig

    cfg = DraftTrainConfig.model_validate(dict(train_cfg))
    return cfg.model_copy(update={"seed": arm.seed, "trackers": []}).model_dump(mode="json")


def data_digest(sample_ids: Iterable[str], heldout_ids: Iterable[str], shard_meta: Mapping[str, Any]) -> str:
    """A digest of what an arm learns from and is measured on: its training samples, the held-out samples,
    and the hidden states' layout. More samples since (a follow-up run) make a new digest: trained again."""
    h = hashlib.sha256(json.dumps(dict(shard_meta), sort_keys=True, default=str).encode())
    for part in (sorted(sample_ids), sorted(heldout_ids)):
        h.update(b"\x1e")
        for sid in part:
            h.update(sid.encode() + b"\x1f")
    return h.hexdigest()


def arm_settings(arm: Arm, train_cfg: Mapping[str, Any], data: str = "") -> dict[str, Any]:
    """What an arm's result depends on: the arm, the training fields that shape its drafter (at its seed), and
    the digest of its data (``data_digest``)."""
    train = {k: v for k, v in arm_train_config(arm, train_cfg).items() if k not in NOT_SHAPING}
    return {"arm": arm.to_dict(), "train": train, "data": data}


def read_result(arm_dir: Path, settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """An arm's finished result, if it was made with the same ``settings`` (else it is trained again)."""
    try:
        res = json.loads((arm_dir / RESULT_FILE).read_text())
        same = json.loads((arm_dir / SETTINGS_FILE).read_text()) == settings
    except (OSError, ValueError):
        return None
    if not same or not isinstance(res, dict) or res.get("arm") != settings.get("arm"):
        return None
    return res


def fresh_arm_dir(out: Path, settings: Mapping[str, Any]) -> None:
    """Keep ``out``'s checkpoints, vocabulary and metrics only if they were made with the same ``settings``
    (the arm and its training config): a changed budget or config starts that arm again from nothing."""
    import shutil

    path = out / SETTINGS_FILE
    try:
        same = json.loads(path.read_text()) == settings
    except (OSError, ValueError):
        same = False
    if not same:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    if not same:
        atomic_write_json(path, settings)


def last_metrics(path: Path) -> dict[str, Any]:
    """The last line of a metrics.jsonl (the step the training ended at), or {} when there is none."""
    return last_json_line(path) or {}


def _rows(hidden_dir: str, keep: Any) -> Iterator[dict[str, Any]]:
    from pipeline.hidden.shards import read_hidden_shards

    return (r for r in read_hidden_shards(hidden_dir) if keep(str(r["sample_id"])))


def train_arm(arm: Arm, *, train_cfg: dict[str, Any], target_dir: str, hidden_dir: str, arm_dir: str,
              datasets: Mapping[str, str], labels: Mapping[str, Mapping[str, Any]], heldout_fraction: float,
              heldout_max: int, data: str = "") -> dict[str, Any]:
    """Train, export and measure one arm; returns (and writes) its result. ``datasets``: sample id -> dataset
    of every passed sample; ``labels``: dataset and source of each, for the held-out groups; ``data``: the
    digest of the arm's data (``data_digest``), kept with its settings."""
    import time

    import torch

    from training.checkpoint import LocalCheckpoints
    from training.config import DraftTrainConfig
    from training.export import export_draft
    from training.heldout import heldout_acceptance, is_held_out
    from training.target import load_target_parts
    from training.train import load_vocab, save_vocab, train_loop
    from training.vocab import build_vocab_mapping

    t0 = time.perf_counter()
    settings = arm_settings(arm, train_cfg, data)
    cfg = DraftTrainConfig.model_validate(arm_train_config(arm, train_cfg))
    out = Path(arm_dir)
    fresh_arm_dir(out, settings)
    if not cfg.use_gpu:
        torch.set_num_threads(max(1, int(cfg.resources_per_worker.get("CPU", 1))))
    device = "cuda" if cfg.use_gpu and torch.cuda.is_available() else "cpu"

    def trains(sid: str) -> bool:
        return arm_trains(arm, sid, datasets, heldout_fraction)

    target = load_target_parts(target_dir)  # once for training, export and the held-out measure
    vocab_path = out / "vocab.safetensors"
    if vocab_path.exists():
        vocab = load_vocab(vocab_path)
    else:
        vocab = build_vocab_mapping(_rows(hidden_dir, trains), target.vocab_size, cfg.draft_vocab_size)
        save_vocab(vocab, vocab_path)
    latest = LocalCheckpoints(out / "checkpoints", cfg.keep_checkpoints).latest()
    drafter, _ = train_loop(cfg, target, out, lambda epoch: _rows(hidden_dir, trains), vocab,
                            resume_from=latest, device=device)
    export_dir = export_draft(drafter.cpu(), out / "export", target_config=target.config)
    held = []
    for r in _rows(hidden_dir, lambda sid: is_held_out(sid, heldout_fraction)):
        held.append(r)
        if len(held) >= heldout_max:
            break
    heldout = heldout_acceptance(export_dir, target, held, cfg.eval_k, labels)
    final = last_metrics(out / "metrics.jsonl")  # a resumed arm's train_loop saw only its own last steps
    result = {"arm": arm.to_dict(), "steps": cfg.steps, "heldout": heldout, "final_loss": final.get("loss"),
              "final_acc": {k: v for k, v in final.items() if k.startswith("acc_")},
              "seconds": round(time.perf_counter() - t0, 1)}
    atomic_write_json(out / RESULT_FILE, result)
    return result
