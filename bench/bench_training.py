"""CPU benchmark of one drafter training step on the tiny target's shapes.

Baseline (measured in the same run): a bare forward+backward of the same drafter without the TTT
unroll (one step, no optimizer). Reported for TTT lengths 1..K: full train-step time (forward,
backward, clip, AdamW), tokens/s, and activation memory = bytes autograd saves for backward
(device independent), each with its ratio to the baseline.

    python bench/bench_training.py [--ttt 7] [--batch-tokens 2048] [--draft-vocab 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.data import Batch, batches, to_sample  # noqa: E402
from training.loss import TTTObjective  # noqa: E402
from training.model import Eagle3Drafter  # noqa: E402
from training.ttt_attention import StepKVCache, step0_mask  # noqa: E402

TINY = dict(vocab_size=129_280, hidden_size=128, intermediate_size=384, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5)


def make_drafter(draft_vocab: int) -> Eagle3Drafter:
    config = LlamaConfig(**TINY, num_hidden_layers=1)
    config.draft_vocab_size, config.target_hidden_size = draft_vocab, TINY["hidden_size"]
    config.eagle_aux_hidden_state_layer_ids = [1, 2, 3]
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    model.t2d[: draft_vocab] = True  # draft vocab = the first ids (d2t = 0)
    return model


def make_batch(batch_tokens: int, row_len: int, draft_vocab: int) -> Batch:
    """Random rows of lengths 64..256 packed like real data; ~90% loss-masked."""
    rng = np.random.default_rng(0)
    h = TINY["hidden_size"]
    rows, total = [], 0
    while total < batch_tokens * 1.2:
        n = int(rng.integers(64, 257))
        rows.append(dict(input_ids=rng.integers(0, draft_vocab, n), loss_mask=(np.arange(n) >= n // 10),
                         aux_hidden=rng.standard_normal((n, 3 * h), dtype=np.float32),
                         final_hidden=rng.standard_normal((n, h), dtype=np.float32),
                         target_ids=rng.integers(0, draft_vocab, n)))
        total += n
    return next(batches((to_sample(r, row_len) for r in rows), batch_tokens, row_len))


def saved_bytes(fn) -> tuple[object, int]:
    """Run fn() and sum the bytes of tensors autograd keeps for backward."""
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def time_it(fn, repeats: int) -> tuple[float, float]:
    """Best (wall seconds, process CPU seconds) over `repeats` calls after a warm-up. On a shared
    box CPU time is the steadier figure (single-threaded, so CPU time ~ wall time when idle)."""
    fn()
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--row-len", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    drafter = make_drafter(args.draft_vocab)
    batch = make_batch(args.batch_tokens, args.row_len, args.draft_vocab)
    lm_head_draft = torch.randn(args.draft_vocab, TINY["hidden_size"]) * 0.45
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    tokens = batch.num_tokens

    def bare() -> None:  # one draft step, plain CE on the next token: no unroll, no teacher
        hidden = drafter.project(batch.aux_hidden)
        mask0 = step0_mask(batch.doc_ids)
        logits = drafter.logits(drafter.step(batch.input_ids, hidden, batch.position_ids, mask0, StepKVCache()))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.target_ids.flatten() % args.draft_vocab)
        loss.backward()

    def bare_with_mem() -> int:
        _, n = saved_bytes(bare)
        drafter.zero_grad(set_to_none=True)
        return n

    base_wall, base_s = time_it(bare, args.repeats)
    base_mem = bare_with_mem()
    print(f"batch: {tuple(batch.input_ids.shape)} rows x len, {tokens} real tokens, draft vocab {args.draft_vocab}, "
          f"threads {args.threads}; times are process CPU time (wall in brackets)")
    print(f"baseline (bare fwd+bwd, no TTT): {base_s * 1e3:8.1f} ms ({base_wall * 1e3:.0f})  "
          f"{tokens / base_s:8.0f} tok/s  saved {base_mem / 2**20:7.1f} MiB")
    print(f"{'ttt':>4} {'step ms':>9} {'(wall)':>8} {'tok/s':>8} {'x time':>7} {'saved MiB':>10} {'x mem':>6} "
          f"{'MiB/step':>9}")
    for k in range(1, args.ttt + 1):
        objective = TTTObjective(drafter, lm_head_draft, k, 0.8)

        def train_step(objective: TTTObjective = objective) -> None:
            out = objective(batch)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()

        step_wall, step_s = time_it(train_step, args.repeats)
        out, mem = saved_bytes(lambda: objective(batch))  # noqa: B023
        del out
        print(f"{k:>4} {step_s * 1e3:9.1f} {step_wall * 1e3:8.0f} {tokens / step_s:8.0f} {step_s / base_s:7.2f} "
              f"{mem / 2**20:10.1f} {mem / base_mem:6.2f} {mem / 2**20 / k:9.1f}")


if __name__ == "__main__":
    main()
