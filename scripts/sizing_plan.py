"""The sizing table of docs/sizing.md, computed from a run config and stated assumptions.

    .venv/bin/python scripts/sizing_plan.py                       # configs/kimi_k25.yaml, the doc's defaults
    .venv/bin/python scripts/sizing_plan.py --prompt-ratio 1.0    # any assumption can be changed

Read off the config: datasets, routing weights, OpenRouter budgets, extraction (aux ids, shard dtype,
rows_per_call, actors, TP), training (steps, batch_tokens, max_len, workers). Everything else is a flag
whose help says where its default comes from: a source, or an assumption to replace with a measurement
(the run's own `status` and `OUTPUT/extract_stats/` give the measured figures once a run has started).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.generate.sources.registry import source_kind  # noqa: E402
from pipeline.hidden.extract import bytes_per_token  # noqa: E402
from pipeline.run.config import load_config  # noqa: E402

TB, GB = 1e12, 1e9


def drafter_flops_per_token(hidden: int, heads: int, intermediate: int, target_vocab: int, draft_vocab: int,
                            ttt: int) -> float:
    """Training FLOPs per token of this project's EAGLE-3 drafter (training/model.py shapes): 6 x params
    per pass (forward + backward), fc once, the decoder layer and draft head once per TTT step, plus the
    teacher's forward logits over the full target vocabulary (2 x H x V). Attention scores are left out."""
    head_dim = hidden // heads
    fc = 3 * hidden * hidden
    layer = 3 * (2 * hidden) * (heads * head_dim) + heads * head_dim * hidden + 3 * hidden * intermediate
    head = hidden * draft_vocab
    return 6 * fc + ttt * 6 * (layer + head) + 2 * hidden * target_vocab


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=str(ROOT / "configs" / "kimi_k25.yaml"))
    p.add_argument("--completion-tokens", type=float, default=10e6, help="per dataset (the plan: 10M)")
    p.add_argument("--prompt-ratio", type=float, default=0.5,
                   help="ASSUMPTION: prompt tokens per completion token (prompts are extracted too)")
    p.add_argument("--hidden", type=int, default=7168, help="Kimi-K2 language model (Megatron-Bridge KimiK2Provider)")
    p.add_argument("--heads", type=int, default=64, help="idem")
    p.add_argument("--intermediate", type=int, default=18432, help="idem (ffn_hidden_size)")
    p.add_argument("--vocab", type=int, default=163840, help="Kimi vocab (first special id 163584 + 256)")
    p.add_argument("--active-params", type=float, default=32e9, help="Kimi K2: 32B activated per token")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense BF16 tensor TFLOPS of one H100/H200 SXM (NVIDIA datasheet)")
    p.add_argument("--extract-mfu", type=float, default=0.2,
                   help="ASSUMPTION: model FLOPs utilisation of the prefill-only extraction engine")
    p.add_argument("--gen-tok-s", type=float, default=4000.0,
                   help="ASSUMPTION: output tokens/s of one 8-GPU TP8 engine (see docs/sizing.md)")
    p.add_argument("--train-mfu", type=float, default=0.25, help="ASSUMPTION: drafter training MFU")
    p.add_argument("--fill", type=float, default=0.9, help="ASSUMPTION: packed-row fill (bench: 0.95 on 2k rows)")
    p.add_argument("--epochs", type=float, default=10.0, help="ASSUMPTION: epochs for the 'planned' column")
    p.add_argument("--price-in", type=float, default=0.60, help="ASSUMPTION: USD per 1M prompt tokens")
    p.add_argument("--price-out", type=float, default=3.00, help="ASSUMPTION: USD per 1M completion tokens")
    a = p.parse_args(argv)

    cfg = load_config(a.config, check_paths=False)
    ex, tr = cfg.extraction, cfg.training
    n_ds = len(cfg.datasets)
    completion = n_ds * a.completion_tokens
    tokens = completion * (1 + a.prompt_ratio)  # every token of prompt + response is extracted

    # API share: weighted rendezvous routing -> a dataset's prompts split by the weights of the sources
    # allowed to serve it (pipeline.generate.router); budgets cap it.
    weights = {n: r.weight for n, r in cfg.routing.sources.items()}
    api = [s for s in cfg.sources if source_kind(s).spends]
    api_completion = api_cap = 0.0
    for d in cfg.datasets:
        allowed = d.sources or [s.name for s in cfg.sources]
        total_w = sum(weights.get(n, 1.0) for n in allowed)
        for s in api:
            if s.name in allowed:
                budget = s.budgets.get(d.name, s.default_budget)
                share = a.completion_tokens * weights.get(s.name, 1.0) / total_w
                api_completion += min(share, budget if budget is not None else share)
                api_cap += budget if budget is not None else a.completion_tokens
    local_completion = completion - api_completion

    itemsize = 2 if ex.shard_dtype == "bfloat16" else 4
    aux = ex.aux_layer_ids or [2, 30, 58]
    bpt = bytes_per_token(a.hidden, len(aux), itemsize)
    bpt_rows = bpt + 9  # stream rows add input_ids int64 + loss_mask int8
    epoch_bytes = tokens * bpt_rows

    extract_flops = 2 * a.active_params
    node_tflops = 8 * a.peak_tflops * 1e12
    extract_tok_s_node = node_tflops * a.extract_mfu / extract_flops
    extract_gpu_h_epoch = tokens / extract_tok_s_node * 8 / 3600

    gen_gpu_h = local_completion / a.gen_tok_s * 8 / 3600

    train_flops = drafter_flops_per_token(a.hidden, a.heads, a.intermediate, a.vocab, tr.draft_vocab_size,
                                          tr.ttt_steps)
    train_tok_s_gpu = a.peak_tflops * 1e12 * a.train_mfu / train_flops
    slots_per_step = tr.num_workers * tr.batch_tokens
    steps_per_epoch = tokens / (slots_per_step * a.fill)
    cfg_epochs = tr.steps / steps_per_epoch
    planned_steps = math.ceil(a.epochs * steps_per_epoch)

    def train_gpu_h(steps: float) -> float:  # slots include padding: the GPU computes them too
        return steps * slots_per_step / train_tok_s_gpu / 3600

    in_flight_worst = ex.num_actors * 2 * ex.rows_per_call * ex.max_len * bpt_rows  # 2 tasks in flight per actor
    api_usd = (api_completion * a.prompt_ratio * a.price_in + api_completion * a.price_out) / 1e6
    api_cap_usd = (api_cap * a.prompt_ratio * a.price_in + api_cap * a.price_out) / 1e6

    rows = [
        ("datasets x completion tokens", f"{n_ds} x {a.completion_tokens / 1e6:g}M = {completion / 1e6:,.0f}M",
         "plan"),
        ("tokens extracted per epoch (prompt + completion)", f"{tokens / 1e6:,.0f}M",
         f"x (1 + {a.prompt_ratio:g}) [assumption: prompt ratio]"),
        ("hidden-state bytes per token", f"{bpt:,} B (+9 B ids/mask = {bpt_rows:,} B per row token)",
         f"({len(aux)} aux + 1 final) x {a.hidden} x {itemsize} B [{ex.shard_dtype}]"),
        ("states per epoch (materialized / shards)", f"{epoch_bytes / TB:,.2f} TB", "tokens x bytes per token"),
        ("object store in flight, streaming (worst case)", f"{in_flight_worst / GB:,.0f} GB",
         f"{ex.num_actors} actors x 2 calls x {ex.rows_per_call} rows x {ex.max_len} tokens x B"),
        ("completion tokens via API (expected / budget cap)",
         f"{api_completion / 1e6:,.1f}M / {api_cap / 1e6:,.0f}M", "routing weights; budgets"),
        ("API spend (expected / at the budget cap)", f"${api_usd:,.0f} / ${api_cap_usd:,.0f}",
         f"${a.price_in:g}/M in, ${a.price_out:g}/M out [assumption]"),
        ("completion tokens generated locally", f"{local_completion / 1e6:,.1f}M", "rest of the plan"),
        ("local generation", f"{gen_gpu_h:,.0f} H200 GPU-h",
         f"{a.gen_tok_s:,.0f} tok/s per 8-GPU engine [assumption]"),
        ("extraction rate", f"{extract_tok_s_node:,.0f} tok/s per 8-GPU engine",
         f"8 x {a.peak_tflops:g} TFLOPS x MFU {a.extract_mfu:g} / (2 x {a.active_params / 1e9:g}B) [estimate]"),
        ("extraction per epoch", f"{extract_gpu_h_epoch:,.1f} H200 GPU-h", "tokens / rate"),
        ("drafter training FLOPs per token", f"{train_flops / 1e9:,.1f} GFLOP",
         f"TTT {tr.ttt_steps}, draft vocab {tr.draft_vocab_size}"),
        ("drafter training rate", f"{train_tok_s_gpu:,.0f} tok/s per GPU",
         f"{a.peak_tflops:g} TFLOPS x MFU {a.train_mfu:g} [estimate]"),
        ("steps per epoch", f"{steps_per_epoch:,.0f}",
         f"tokens / ({tr.num_workers} workers x {tr.batch_tokens} x fill {a.fill:g})"),
        ("configured training (steps)", f"{tr.steps:,} steps = {cfg_epochs:,.0f} epochs = "
         f"{train_gpu_h(tr.steps):,.0f} GPU-h", "training.steps"),
        (f"planned training ({a.epochs:g} epochs)", f"{planned_steps:,} steps = {train_gpu_h(planned_steps):,.0f} "
         "GPU-h", "[assumption: epochs]"),
        (f"extraction if re-run every epoch (stream, {a.epochs:g} epochs)",
         f"{a.epochs * extract_gpu_h_epoch:,.0f} H200 GPU-h", "vs shards: one pass + disk"),
    ]
    print("| quantity | value | from |\n|---|---|---|")
    for name, value, src in rows:
        print(f"| {name} | {value} | {src} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
