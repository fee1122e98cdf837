"""Training-state checkpoints: drafter tensors (safetensors), optimizer/scheduler, loop position."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.base.layout import temp_path
from training.model import EMBED_PARAM, Eagle3Drafter

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.pt"
STATE_FILE = "state.json"


@dataclass
class LoopState:
    """Where the loop stands: `step` optimizer steps done; the next batch is batch
    `batch_in_epoch` of `epoch` (both 0-based) in the deterministic data order."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


def save_checkpoint(
    path: Path,
    drafter: Eagle3Drafter,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: LoopState,
    extra: dict,
) -> Path:
    """Write a complete checkpoint into directory `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in drafter.trainable_state_dict().items()}
    save_file(tensors, str(path / MODEL_FILE))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path / OPTIM_FILE)
    (path / STATE_FILE).write_text(json.dumps({**asdict(state), **extra}, indent=1))
    return path


def load_drafter_tensors(path: Path, drafter: Eagle3Drafter, *, same_vocab: bool = False) -> None:
    """Load drafter tensors (all but the frozen embeddings) in place. ``same_vocab``: refuse a checkpoint whose
    d2t/t2d differ from the drafter's (the run's vocabulary): loading it would swap the drafter's mapping while the
    loop keeps distilling from the run's lm_head rows, a silently wrong teacher."""
    tensors = load_file(str(Path(path) / MODEL_FILE))
    if same_vocab and not all(n in tensors and torch.equal(tensors[n], getattr(drafter, n).cpu())
                              for n in ("d2t", "t2d")):
        raise ValueError(f"{path} was trained with another draft vocabulary than this run's (a vocab file counted "
                         "again on other data?); it cannot be resumed with it: move it away to start again")
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if [m for m in missing if m != EMBED_PARAM] or unexpected:
        raise KeyError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")


def load_checkpoint(
    path: Path,
    drafter: Eagle3Drafter,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> LoopState:
    """Restore drafter, optimizer and scheduler in place; return the loop position. The drafter must hold the
    checkpoint's vocabulary already (``load_drafter_tensors(same_vocab=True)``)."""
    path = Path(path)
    load_drafter_tensors(path, drafter, same_vocab=True)
    opt = torch.load(path / OPTIM_FILE, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    raw = json.loads((path / STATE_FILE).read_text())
    return LoopState(step=raw["step"], epoch=raw["epoch"], batch_in_epoch=raw["batch_in_epoch"])


def read_state(path: Path) -> dict:
    """The checkpoint's state.json."""
    return json.loads((Path(path) / STATE_FILE).read_text())


class LocalCheckpoints:
    """Keep the newest `keep` checkpoints as `root/step_NNNNNNN` (the in-process sink)."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root = Path(root)
        self.keep = keep

    def __call__(self, tmp_dir: Path | None, metrics: dict) -> None:
        if tmp_dir is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".step_*.tmp"):  # staging left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        dest = self.root / f"step_{metrics['step']:07d}"
        staging = temp_path(dest)  # hidden: `all()` never lists a half-copied checkpoint
        shutil.copytree(tmp_dir, staging)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
        for old in self.all()[: -self.keep]:
            shutil.rmtree(old)

    def all(self) -> list[Path]:
        return sorted(self.root.glob("step_*")) if self.root.exists() else []

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1] if found else None
