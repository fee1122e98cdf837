"""Helpers for tests and benchmarks: a tiny random Llama target and rows produced from it with HF.

Rows follow the extraction contract exactly (vLLM aux convention: HF `hidden_states[i]` is the
input of decoder layer i), so tests exercise the same code path as pipeline-produced rows.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from training.evaluate import random_prompts  # noqa: F401  (re-exported: the CLI's own prompts)

if TYPE_CHECKING:
    from training.config import DraftTrainConfig
    from training.model import Eagle3Drafter
    from training.simulate import AcceptanceStats

TINY_TARGET = dict(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
)
TINY_AUX_LAYER_IDS = [1, 2, 3]
AUX_IDS = [1, 2, 3]  # the pipeline's 4-layer tiny target: the default [2, 2, 1] collides
PROMPT_IDS = (10, 120_000)  # ordinary tokens of the tiny target's vocab


def small_cfg(**kw) -> DraftTrainConfig:
    """A few-step training config on the pipeline's tiny target."""
    from training.config import DraftTrainConfig

    base = dict(steps=8, batch_tokens=512, max_len=128, draft_vocab_size=1024, aux_layer_ids=AUX_IDS,
                ttt_steps=3, lr=2e-3, warmup_steps=2, checkpoint_every=3, log_every=4, shuffle_buffer=16)
    return DraftTrainConfig(**{**base, **kw})


def build_tiny_llama(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Save a seeded random LlamaForCausalLM (config.json + model.safetensors) to `out_dir`.

    HF's default init (std 0.02) gives a target whose greedy continuations fall into short
    loops; `initializer_range=0.1` gives context-dependent, much harder continuations."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    config = LlamaConfig(**{**TINY_TARGET, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    return out


def load_hf_target(model_dir: str | Path):
    """Load a saved target with HF in float32 eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Temporarily set torch's intra-op threads. On a shared 2-core box two OpenMP threads
    competing with another busy process run ~30x slower than one."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@torch.no_grad()
def greedy_continue(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 32
) -> list[list[int]]:
    """Greedy continuations (HF generate, left-padded batches, exactly max_new_tokens each)."""
    out: list[list[int]] = []
    for s in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[s : s + batch_size]]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        gen = model.generate(
            ids, attention_mask=attn, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
        out.extend(gen[:, width:].tolist())
    return out


@torch.no_grad()
def rows_from_target(
    model_dir: str | Path,
    token_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    aux_layer_ids: Sequence[int],
    model=None,
) -> list[dict]:
    """Rows of the extraction contract computed with an HF forward (output_hidden_states)."""
    model = model if model is not None else load_hf_target(model_dir)
    rows = []
    for i, (ids, mask) in enumerate(zip(token_ids, loss_masks, strict=True)):
        out = model(torch.tensor([list(ids)]), output_hidden_states=True)
        hs = out.hidden_states
        aux = torch.cat([hs[j][0] for j in aux_layer_ids], dim=-1)
        rows.append(
            dict(
                sample_id=f"s{i}",
                input_ids=np.asarray(ids, np.int64),
                loss_mask=np.asarray(mask, np.int8),
                aux_hidden=aux.numpy().astype(np.float32),
                final_hidden=hs[-1][0].numpy().astype(np.float32),  # post-norm in HF
            )
        )
    return rows


def generated_rows(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    aux_layer_ids: Sequence[int],
) -> list[dict]:
    """Prompt + the target's own greedy continuation, loss-masked on the continuation."""
    model = load_hf_target(model_dir)
    responses = greedy_continue(model, prompts, max_new_tokens)
    ids = [list(p) + r for p, r in zip(prompts, responses, strict=True)]
    masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses, strict=True)]
    return rows_from_target(model_dir, ids, masks, aux_layer_ids, model=model)


@dataclass
class EasyRun:
    """A trained drafter on `build_tiny_llama`'s target, shared by the test modules of a session."""

    target_dir: Path
    train_rows: list[dict]
    held_rows: list[dict]
    cfg: DraftTrainConfig
    drafter: Eagle3Drafter
    untrained: AcceptanceStats  # on held_rows
    trained: AcceptanceStats  # on held_rows
    metrics: dict


@functools.cache
def easy_run(steps: int = 60, k: int = 3) -> EasyRun:
    """Generate greedy data on the easy target, train in-process, simulate acceptance (cached per
    process, so a pytest session trains once however many test modules ask)."""
    from training.config import DraftTrainConfig
    from training.simulate import simulate_acceptance
    from training.target import load_target_parts
    from training.train import prepare_drafter, train_loop
    from training.vocab import build_vocab_mapping

    root = Path(tempfile.mkdtemp(prefix="easy_drafter_"))
    atexit.register(shutil.rmtree, root, True)
    with torch_threads(1):
        target = build_tiny_llama(root / "target")
        train_prompts = random_prompts(480, TINY_TARGET["vocab_size"], (8, 24), seed=11)
        held_prompts = random_prompts(24, TINY_TARGET["vocab_size"], (8, 24), seed=12)
        rows = generated_rows(target, train_prompts + held_prompts, 48, TINY_AUX_LAYER_IDS)
        train_rows, held = rows[: len(train_prompts)], rows[len(train_prompts):]
        cfg = DraftTrainConfig(steps=steps, batch_tokens=2048, max_len=256, draft_vocab_size=512,
                               aux_layer_ids=TINY_AUX_LAYER_IDS, ttt_steps=3, lr=3e-3, warmup_steps=5,
                               checkpoint_every=10_000, log_every=20)
        parts = load_target_parts(target)
        vocab = build_vocab_mapping(train_rows, parts.vocab_size, cfg.draft_vocab_size)
        untrained = simulate_acceptance(prepare_drafter(cfg, parts, vocab), held, parts.lm_head, k=k)
        drafter, metrics = train_loop(cfg, target, root / "run", lambda epoch: train_rows, vocab)
        trained = simulate_acceptance(drafter, held, parts.lm_head, k=k)
    return EasyRun(target, train_rows, held, cfg, drafter, untrained, trained, metrics)


# ----------------------------------------------------------------------------- killing a Ray Train worker


def kill_worker_at(step: int, out_dir: str | Path, checkpoint_every: int):
    """An `after_step` hook for `train_drafter` that kills every worker once, at `step`.

    Returned as a `functools.partial` of a module-level function, so it pickles to the Ray Train
    workers. Each rank leaves a marker under `out_dir` before it exits, so the restarted (or rerun)
    worker trains through `step` instead of dying again."""
    return functools.partial(_kill_at, step, str(Path(out_dir).resolve()), checkpoint_every)


def _kill_at(kill_step: int, out_dir: str, checkpoint_every: int, step: int) -> None:
    import os

    import ray.train

    from training.train import RUN_NAME

    if step != kill_step:
        return
    marker = Path(out_dir) / f".killed_at_step_{kill_step}_rank{ray.train.get_context().get_world_rank()}"
    if marker.exists():
        return
    # The controller registers reported checkpoints when it polls the workers (every ~2 s), so wait
    # for the last one to be committed: otherwise the restart could legitimately begin from an
    # earlier checkpoint.
    last = step - step % checkpoint_every
    if last:  # every rank: one exiting early would restart the group before the commit
        _wait_for_committed(Path(out_dir) / "ray" / RUN_NAME, f"step_{last:07d}")
    marker.touch()
    os._exit(1)


def _wait_for_committed(run_dir: Path, checkpoint_name: str, timeout_s: float = 120.0) -> None:
    """Block until Ray Train's checkpoint-manager snapshot lists `checkpoint_name`."""
    import time

    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if snapshot.exists() and checkpoint_name in snapshot.read_text():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{checkpoint_name} was not committed in {snapshot}")
