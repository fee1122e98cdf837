"""Single-GPU drafter training benchmark at Llama-3-8B shapes (torch + transformers only).

No Ray, vLLM or pydantic: it imports only `training.model`, `training.loss`, `training.data` and
`training.ttt_attention`. Synthetic target states (hidden 4096, vocab 128,256, draft vocab 32,000)
are packed like real data; the loop runs AdamW + grad clipping under bf16 autocast and reports
step time, tokens/s and peak memory for the TTT unroll and for a bare one-step baseline, then a
short training run (loss should fall). A few minutes on one H200.

    python bench/gpu_training.py [--ttt 7] [--batch-tokens 16384] [--row-len 2048] [--steps 40]
    python bench/gpu_training.py --small --device cpu     # smoke test of the script itself
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.data import batches, to_sample  # noqa: E402
from training.loss import TTTObjective  # noqa: E402
from training.model import Eagle3Drafter  # noqa: E402
from training.ttt_attention import StepKVCache, step0_mask  # noqa: E402

LLAMA8B = dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192},
               max_position_embeddings=131_072)
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=4096)


def synthetic_rows(n_tokens: int, shape: dict, draft_vocab: int, seed: int):
    """Rows whose next-token teacher is a fixed function of the current token, so the drafter can
    learn it: final_hidden[t] = E[token[t+1]] with a fixed random table E."""
    rng = np.random.default_rng(seed)
    h = shape["hidden_size"]
    table = rng.standard_normal((draft_vocab, h), dtype=np.float32)
    total = 0
    while total < n_tokens:
        n = int(rng.integers(256, 2049))
        ids = rng.integers(0, draft_vocab, n)
        ids[1:] = (ids[:-1] * 7 + 3) % draft_vocab  # deterministic successor
        final = np.zeros((n, h), np.float32)
        final[:-1] = table[ids[1:]]
        yield dict(input_ids=ids, loss_mask=(np.arange(n) >= n // 8),
                   aux_hidden=rng.standard_normal((n, 3 * h), dtype=np.float32) * 0.1,
                   final_hidden=final, target_ids=np.concatenate([ids[1:], ids[-1:]]))
        total += n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--batch-tokens", type=int, default=16_384)
    ap.add_argument("--row-len", type=int, default=2048)
    ap.add_argument("--draft-vocab", type=int, default=32_000)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    shape = SMALL if args.small else LLAMA8B
    if args.small:
        args.batch_tokens, args.row_len, args.draft_vocab = min(args.batch_tokens, 2048), min(args.row_len, 1024), 1024
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = LlamaConfig(**shape, num_hidden_layers=1)
    config.draft_vocab_size, config.target_hidden_size = args.draft_vocab, shape["hidden_size"]
    config.eagle_aux_hidden_state_layer_ids = [2, 16, 29]
    drafter = Eagle3Drafter(config)
    drafter.t2d[: args.draft_vocab] = True
    drafter = drafter.to(device)
    lm_head_draft = (torch.randn(args.draft_vocab, shape["hidden_size"]) * 0.02).to(device)
    objective = TTTObjective(drafter, lm_head_draft, args.ttt, 0.8)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95))
    rows = synthetic_rows(args.batch_tokens * (args.steps + 4), shape, args.draft_vocab, seed=0)
    data = batches((to_sample(r, args.row_len) for r in rows), args.batch_tokens, args.row_len)
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def peak_gib() -> float:
        return torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")

    def reset_peak() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

    # baseline: one draft step with plain CE, no unroll
    batch = next(data).to(device)
    reset_peak()
    times = []
    for _ in range(4):
        sync()
        t0 = time.perf_counter()
        with autocast:
            hidden = drafter.project(batch.aux_hidden)
            mask0 = step0_mask(batch.doc_ids)
            logits = drafter.logits(drafter.step(batch.input_ids, hidden, batch.position_ids, mask0, StepKVCache()))
            labels = batch.target_ids.flatten() % args.draft_vocab
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels)
        loss.backward()
        drafter.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    base_s, base_mem = min(times[1:]), peak_gib()
    print(f"device {device}  batch {tuple(batch.input_ids.shape)}  tokens {batch.num_tokens}  ttt {args.ttt}")
    print(f"baseline fwd+bwd (no TTT): {base_s * 1e3:.1f} ms  {batch.num_tokens / base_s:.0f} tok/s  "
          f"peak {base_mem:.1f} GiB")

    reset_peak()
    log = []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = next(data).to(device)
        sync()
        t0 = time.perf_counter()
        with autocast:
            out = objective(batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
        opt.step()
        sync()
        dt = time.perf_counter() - t0
        log.append({"step": step, "loss": out.loss.item(), "acc": out.step_accs, "ms": dt * 1e3,
                    "tok_s": batch.num_tokens / dt, "grad_norm": grad_norm})
        if step % 5 == 0 or step == 1:
            accs = " ".join(f"{a:.2f}" for a in out.step_accs)
            print(f"step {step:3d} loss {out.loss.item():.3f} acc [{accs}] {dt * 1e3:.0f} ms "
                  f"{batch.num_tokens / dt:.0f} tok/s", flush=True)
    steady = [r["ms"] for r in log[2:]] or [r["ms"] for r in log]
    step_ms = float(np.median(steady))
    result = {"device": str(device), "shape": "small" if args.small else "llama3-8b", "ttt": args.ttt,
              "batch_tokens": args.batch_tokens, "draft_vocab": args.draft_vocab,
              "baseline_ms": base_s * 1e3, "baseline_peak_gib": base_mem, "step_ms": step_ms,
              "tokens_per_s": float(np.median([r["tok_s"] for r in log[2:]] or [r["tok_s"] for r in log])),
              "ttt_peak_gib": peak_gib(), "time_ratio_vs_baseline": step_ms / (base_s * 1e3),
              "first_loss": log[0]["loss"], "last_loss": log[-1]["loss"], "last_acc": log[-1]["acc"],
              "wall_s": time.perf_counter() - t_start}
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": result, "log": log}, indent=1))


if __name__ == "__main__":
    main()
