"""Acceptance length of this project's drafter against the public `speculators` reference, same budget.

The reference (../shared/docs/eagle3.md, measured on these 2-core CPU machines): speculators 0.9.0
trained a drafter for a 4-layer random tiny target (hidden 128, DeepSeek-V4 tokenizer) on 1,600
prompts x 128 greedy response tokens: 1,040 steps of 2,048 packed tokens in 28 min (~1,380 tokens/s),
3 TTT steps, draft vocab 8,192. vLLM (CPU build) then measured acceptance length 1.62 at k=3
(per position 0.39 / 0.14 / 0.09); an untrained drafter gives 1.00.

The reference's weights are not published. `--target hf-default` (the default) builds the same
shape the way a random HF model is usually made (`LlamaForCausalLM(config)`, init std 0.02, seeded):
its greedy continuations are bigram-like loops. `--target wild` / `well-formed` use the pipeline's
tiny targets, whose scaled weights make the next token depend on the whole context (a far harder
target to draft for: ~90% of its greedy tokens are distinct).

This script repeats the reference's budget with this project's code: 1,600 chat prompts x 128
greedy tokens (the target's own outputs), hidden states captured like the extraction stage,
`training.train.train_loop` for the same 1,040 x 2,048-token steps, then vLLM's `eagle3`
speculative decoding on held-out prompts for an untrained drafter (the baseline measured in the
same run) and the trained one. The pure-torch simulation is printed beside vLLM's figures.

    python bench/bench_acceptance.py [--target hf-default] [--steps 1040] [--lr 3e-3] [--teacher-temperature 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REFERENCE = {"acceptance_length": 1.62, "per_position": [0.39, 0.14, 0.09], "train_tokens_per_s": 1380.0,
             "train_minutes": 28.0}
AUX_IDS = [1, 2, 3]  # a 4-layer target: vLLM's default ids collide, so they are explicit


def chat_prompts(profile, n: int, seed: int) -> list[list[int]]:
    """Seeded single-turn chat prompts: user text decoded from random ordinary ids, thinking on or off."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        text = profile.decode(rng.integers(100, 100_000, size=int(rng.integers(6, 24))).tolist())
        thinking = bool(rng.random() < 0.5)
        out.append(profile.render_prompt([{"role": "user", "content": text}], None, thinking).ids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/bench_acceptance")
    ap.add_argument("--target", default="hf-default", choices=["hf-default", "wild", "well-formed"])
    ap.add_argument("--train-prompts", type=int, default=1600)
    ap.add_argument("--held-prompts", type=int, default=64)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1040)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--teacher-temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    from pipeline.demo.tiny_model import build_tiny_target
    from pipeline.profiles import load_profile
    from tests.helpers.training import (
        build_tiny_llama,
        greedy_continue,
        load_hf_target,
        rows_from_target,
        torch_threads,
    )
    from training.config import DraftTrainConfig
    from training.evaluate import measure_in_subprocess
    from training.export import export_draft
    from training.simulate import simulate_acceptance
    from training.target import load_target_parts
    from training.train import prepare_drafter, train_loop
    from training.vocab import build_vocab_mapping

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.target == "hf-default":
        target = work / "target-hf-default"
        if not (target / "model.safetensors").exists():
            build_tiny_llama(target, seed=0, vocab_size=129_280, intermediate_size=384)
    else:
        target = build_tiny_target(work / f"target-{args.target}", variant=args.target)
    profile = load_profile("deepseek")  # the DeepSeek-V4 tokenizer and chat format
    prompts = chat_prompts(profile, args.train_prompts + args.held_prompts, seed=0)
    held_prompts = prompts[args.train_prompts:]

    with torch_threads(args.threads):
        t0 = time.perf_counter()
        model = load_hf_target(target)
        responses = greedy_continue(model, prompts, args.response_tokens)
        rows = rows_from_target(target, [p + r for p, r in zip(prompts, responses, strict=True)],
                                [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses, strict=True)],
                                AUX_IDS, model=model)
        t_data = time.perf_counter() - t0
        train_rows, held_rows = rows[: args.train_prompts], rows[args.train_prompts:]
        print(f"data: {len(rows)} samples x {args.response_tokens} greedy tokens with hidden states "
              f"in {t_data:.0f}s", flush=True)

        # one packed row of batch_tokens per step, like the reference: rows of 256 would hold one ~160-token
        # sample each and train on ~1,200 real tokens per step
        cfg = DraftTrainConfig(steps=args.steps, batch_tokens=args.batch_tokens, max_len=args.batch_tokens,
                               draft_vocab_size=args.draft_vocab, aux_layer_ids=AUX_IDS, ttt_steps=args.ttt,
                               lr=args.lr, warmup_steps=args.warmup, teacher_temperature=args.teacher_temperature,
                               checkpoint_every=10**9, log_every=100)
        parts = load_target_parts(target)
        vocab = build_vocab_mapping(train_rows, parts.vocab_size, cfg.draft_vocab_size)
        untrained = prepare_drafter(cfg, parts, vocab)
        sim_untrained = simulate_acceptance(untrained, held_rows, parts.lm_head, k=args.k)
        untrained_dir = export_draft(untrained, work / "untrained", target_config=parts.config)

        t0 = time.perf_counter()
        drafter, metrics = train_loop(cfg, target, work / "run", lambda epoch: train_rows, vocab)
        t_train = time.perf_counter() - t0
        sim_trained = simulate_acceptance(drafter, held_rows, parts.lm_head, k=args.k)
        trained_dir = export_draft(drafter, work / "trained", target_config=parts.config)
    log = (work / "run" / "metrics.jsonl").read_text().splitlines()
    train_tokens = sum(json.loads(line)["tokens"] for line in log if line)  # real (unpadded) tokens
    print(f"training: {args.steps} steps, {train_tokens:,} real tokens in {t_train / 60:.1f} min "
          f"({train_tokens / t_train:,.0f} tokens/s); final metrics "
          f"{ {k: round(v, 3) for k, v in metrics.items() if k.startswith(('acc_', 'loss'))} }", flush=True)

    held = held_prompts
    measured = {}
    for name, draft in (("untrained", untrained_dir), ("trained", trained_dir)):
        rep = measure_in_subprocess(str(target), str(draft), held, args.k, args.response_tokens, 512, "float32")
        measured[name] = {"acceptance_length": rep["acceptance_length"],
                          "per_position": rep["per_position_acceptance"], "tokens_per_s": rep["tokens_per_s"]}
        print(f"vLLM {name}: acceptance length {rep['acceptance_length']:.3f} per position "
              f"{[round(x, 3) for x in rep['per_position_acceptance']]}", flush=True)

    result = {
        "args": vars(args),
        "data_seconds": t_data,
        "train_seconds": t_train,
        "train_tokens": train_tokens,
        "train_tokens_per_s": train_tokens / t_train,
        "vllm": measured,
        "simulated": {"untrained": sim_untrained.acceptance_length, "trained": sim_trained.acceptance_length,
                      "trained_per_position": sim_trained.per_position},
        "reference": REFERENCE,
    }
    t, u = measured["trained"], measured["untrained"]
    print()
    print(f"| drafter | acceptance length (vLLM, k={args.k}) | per position | simulated | train tokens/s |")
    print("|---|---|---|---|---|")
    print(f"| untrained (this run) | {u['acceptance_length']:.3f} | "
          f"{' / '.join(f'{x:.2f}' for x in u['per_position'])} | {sim_untrained.acceptance_length:.3f} | - |")
    print(f"| trained (this run) | {t['acceptance_length']:.3f} | "
          f"{' / '.join(f'{x:.2f}' for x in t['per_position'])} | {sim_trained.acceptance_length:.3f} | "
          f"{train_tokens / t_train:,.0f} |")
    print(f"| speculators 0.9.0 (reference) | {REFERENCE['acceptance_length']:.2f} | "
          f"{' / '.join(f'{x:.2f}' for x in REFERENCE['per_position'])} | - | {REFERENCE['train_tokens_per_s']:,.0f} |")
    gain = (t["acceptance_length"] - 1) / (REFERENCE["acceptance_length"] - 1)
    print(f"\ntrained / untrained acceptance length: {t['acceptance_length'] / u['acceptance_length']:.2f}x; "
          f"tokens accepted per draft vs the reference: {gain:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=float) + "\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
