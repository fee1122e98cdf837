"""One drafter training step, A/B: another checkout's training code against this one's, fp32 and bf16 autocast.

    .venv/bin/python bench/bench_train_step.py --base /tmp/base [--rounds 5] [--ttt 5] [--draft-vocab 640]

Settings of the side-by-side run on the reasoning target (bench/vs_speculators.sh): the tiny target's shapes
(H=128), draft vocabulary 640, 5 TTT steps, one packed row of 2,048 tokens of samples shaped like that
target's (a 50-90-token prompt, then a 100-230-token answer, the loss on the answer), EAGLE-3.1, `ce`, AdamW
and clipping: the step `training.train.train_loop` takes. Each variant runs in its own process (the code is
imported from its checkout, ``--base`` or this one); the rounds alternate the variants so that a change of
the machine's load falls on all of them. A round's figure is the process CPU time of the best of three steps
after a warm-up; the table gives the median over rounds and the ratio to the baseline (the base checkout at
fp32), both measured in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SHAPES = dict(vocab_size=129_280, hidden_size=128, intermediate_size=384, num_attention_heads=2,
              num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5)


def child(root: str, precision: str, ttt: int, draft_vocab: int, row_len: int) -> None:
    """One variant: the step's CPU seconds (best of three after a warm-up), as JSON on stdout."""
    sys.path.insert(0, root)
    import numpy as np
    import torch
    from transformers import LlamaConfig

    from training.data import batches, to_sample
    from training.loss import TTTObjective
    from training.model import Eagle3Drafter

    torch.set_num_threads(1)
    config = LlamaConfig(**SHAPES, num_hidden_layers=1)
    config.draft_vocab_size, config.target_hidden_size = draft_vocab, SHAPES["hidden_size"]
    config.eagle_aux_hidden_state_layer_ids = [1, 2, 3]
    config.fc_norm = config.norm_output = True
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    model.t2d[:draft_vocab] = True
    # a drafter's lm_head starts as the target's draft-vocab rows (row norm ~62 on the reasoning target), so its
    # logits spread like a real one's (row std ~60, half the vocab below exp's range): that decides which kernels
    # are slow. The teacher's rows alike.
    scale = 62 / SHAPES["hidden_size"] ** 0.5
    with torch.no_grad():
        model.lm_head.weight.normal_(0, scale)
    rng = np.random.default_rng(0)
    h, rows, total = SHAPES["hidden_size"], [], 0
    while total < row_len * 1.3:
        prompt, answer = int(rng.integers(50, 91)), int(rng.integers(100, 231))
        n = prompt + answer
        rows.append(dict(input_ids=rng.integers(0, draft_vocab, n), loss_mask=np.arange(n) >= prompt,
                         aux_hidden=rng.standard_normal((n, 3 * h), dtype=np.float32),
                         final_hidden=rng.standard_normal((n, h), dtype=np.float32),
                         target_ids=rng.integers(0, draft_vocab, n)))
        total += n
    batch = next(batches((to_sample(r, row_len) for r in rows), row_len, row_len))
    objective = TTTObjective(model, torch.randn(draft_vocab, h) * scale, ttt, 0.8)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = objective(batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()

    step()
    best = float("inf")
    for _ in range(3):
        c0 = time.process_time()
        step()
        best = min(best, time.process_time() - c0)
    print(json.dumps({"s": best, "tokens": batch.num_tokens}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="checkout whose training code is the baseline")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ttt", type=int, default=5)
    ap.add_argument("--draft-vocab", type=int, default=640)
    ap.add_argument("--row-len", type=int, default=2048)
    ap.add_argument("--child", nargs=2, metavar=("ROOT", "PRECISION"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.ttt, a.draft_vocab, a.row_len)
        return
    if not a.base:
        ap.error("--base is required")
    variants = [("base", a.base, "fp32"), ("base", a.base, "bf16"), ("this", str(HERE), "fp32"),
                ("this", str(HERE), "bf16")]
    times: dict[tuple[str, str], list[float]] = {(n, p): [] for n, _, p in variants}
    tokens = 0
    for r in range(a.rounds):
        for name, root, precision in variants:
            out = subprocess.run([sys.executable, __file__, "--child", root, precision, "--ttt", str(a.ttt),
                                  "--draft-vocab", str(a.draft_vocab), "--row-len", str(a.row_len)],
                                 capture_output=True, text=True, check=True)
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            times[(name, precision)].append(rec["s"])
            tokens = rec["tokens"]
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{n} {p} {times[(n, p)][-1] * 1e3:.0f} ms"
                                                       for n, _, p in variants), flush=True)
    base = statistics.median(times[("base", "fp32")])
    print(f"\none step: {tokens} real tokens in a row of {a.row_len}, {a.ttt} TTT steps, draft vocab "
          f"{a.draft_vocab}, one thread; median of {a.rounds} rounds (process CPU time)")
    print(f"{'code':>6} {'precision':>9} {'step ms':>9} {'tok/s':>8} {'x baseline speed':>17}")
    for name, _, precision in variants:
        med = statistics.median(times[(name, precision)])
        print(f"{name:>6} {precision:>9} {med * 1e3:9.1f} {tokens / med:8.0f} {base / med:17.2f}")


if __name__ == "__main__":
    main()
