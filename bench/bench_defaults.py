"""Training defaults measured on the trained tiny target: one knob at a time, several seeds, error bars.

    .venv/bin/python bench/bench_defaults.py prepare OUT TARGET_DIR     # prompts + OUT/run.yaml
    .venv/bin/python -m pipeline run OUT/run.yaml                       # greedy samples -> OUT/run/hidden
    .venv/bin/python bench/bench_defaults.py sweep OUT [--steps 116] [--seeds 0 1 2] [--only NAME ...]

``prepare`` writes 1,600 training prompts of the target's domain (``pipeline.demo.tiny_domain.prompt_rows``,
seed 1, the side-by-side bench's) and 200 held-out ones (seed 2, disjoint), as two datasets of one run
that generates greedy responses and extracts hidden states to shards without training. ``sweep``
reads those shards once, trains a drafter in this process for every variant and seed
(``training.train.train_loop``, one thread) and measures its simulated greedy acceptance at k=3 and
k=5 on the held-out rows (``training.simulate``, the run report's held-out measure: it ranks drafters; its
absolute figures can differ from vLLM's on fresh generations). Every variant is the base (the quick start's settings:
3 TTT steps, draft vocabulary 256, lr 1e-3 with 30 warmup steps then cosine, teacher T = 1) with one
setting changed. Results go to OUT/defaults.jsonl (one line per run; a rerun skips what is there)
and a table with mean ± sample standard deviation over seeds is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BASE = {"ttt_steps": 3, "draft_vocab_size": 256, "lr": 1e-3, "warmup_steps": 30, "teacher_temperature": 1.0,
        "batch_tokens": 2048, "max_len": 2048, "checkpoint_every": 100_000, "log_every": 100_000,
        "trackers": [], "heldout_fraction": 0.0}
VARIANTS: dict[str, dict] = {
    "base": {},
    "teacher_T=0.5": {"teacher_temperature": 0.5},
    "teacher_T=0.01": {"teacher_temperature": 0.01},
    "lr=3e-3": {"lr": 3e-3},
    "lr=1e-2": {"lr": 1e-2},
    "lr=3e-4": {"lr": 3e-4},
    "warmup=10": {"warmup_steps": 10},
    "ttt=5": {"ttt_steps": 5},
    "ttt=7": {"ttt_steps": 7},
    "vocab=64": {"draft_vocab_size": 64},
    "vocab=1024": {"draft_vocab_size": 1024},
    "precision=fp32": {"precision": "fp32"},
    "precision=bf16": {"precision": "bf16"},
}
TRAIN, HELD = "shop_train", "shop_held"


def prepare(out: Path, target: Path) -> None:
    from pipeline.demo.tiny_domain import prompt_rows

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    users = [[m for m in r["messages"] if m["role"] == "user"] for r in prompt_rows(1600, 1)]
    seen = {u[0]["content"] for u in users}
    held = []
    for r in prompt_rows(1000, 2):
        u = [m for m in r["messages"] if m["role"] == "user"]
        if u[0]["content"] not in seen and len(held) < 200:
            seen.add(u[0]["content"])
            held.append(u)
    for name, rows in ((TRAIN, users), (HELD, held)):
        with open(data / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"messages": m}) + "\n" for m in rows)
    (out / "run.yaml").write_text(f"""# written by bench/bench_defaults.py prepare
output_dir: {out}/run
model: {{profile: deepseek, path: {target}}}
sampling: {{temperature: 0.0, top_p: 1.0, max_tokens: 128, seed: 0}}
datasets:
  - {{name: {TRAIN}, path: {data}/{TRAIN}.jsonl, format: messages, thinking: false}}
  - {{name: {HELD}, path: {data}/{HELD}.jsonl, format: messages, thinking: false}}
sources:
  - {{kind: vllm, name: vllm-cpu, num_actors: 1, num_cpus: 1, batch_size: 32, dtype: float32, max_model_len: 2048}}
extraction: {{mode: shards, aux_layer_ids: [1, 2, 3], batch_tokens: 4096, max_len: 2048, num_cpus: 1}}
training: null
""")
    print(f"train={len(users)} held-out={len(held)} -> {out / 'run.yaml'}")


def sweep(out: Path, steps: int, seeds: list[int], only: list[str] | None) -> None:
    import torch

    from pipeline.hidden.shards import read_hidden_shards
    from training.config import DraftTrainConfig
    from training.simulate import simulate_acceptance
    from training.target import load_target_parts
    from training.train import train_loop
    from training.vocab import build_vocab_mapping

    torch.set_num_threads(1)
    target_dir = yaml.safe_load((out / "run.yaml").read_text())["model"]["path"]
    rows = list(read_hidden_shards(out / "run" / "hidden"))
    train = [r for r in rows if r["sample_id"].startswith(TRAIN + ":")]
    held = [r for r in rows if r["sample_id"].startswith(HELD + ":")]
    parts = load_target_parts(target_dir)
    print(f"{len(train)} train rows, {len(held)} held-out rows, {steps} steps, seeds {seeds}", flush=True)
    results_path = out / "defaults.jsonl"
    done = {(r["variant"], r["seed"], r["steps"]) for r in map(json.loads, results_path.open())} \
        if results_path.exists() else set()
    for name, change in VARIANTS.items():
        if only and name not in only:
            continue
        for seed in seeds:
            if (name, seed, steps) in done:
                continue
            cfg = DraftTrainConfig.model_validate({**BASE, **change, "steps": steps, "seed": seed})
            vocab = build_vocab_mapping(train, parts.vocab_size, cfg.draft_vocab_size)
            t0 = time.perf_counter()
            drafter, metrics = train_loop(cfg, target_dir, out / "scratch" / f"{name}-{seed}-{steps}",
                                          lambda epoch: train, vocab)
            train_s = time.perf_counter() - t0
            with torch.no_grad():
                k3 = simulate_acceptance(drafter, held, parts.lm_head, k=3)
                k5 = simulate_acceptance(drafter, held, parts.lm_head, k=5)
            rec = {"variant": name, "seed": seed, "steps": steps, "acceptance_k3": round(k3.acceptance_length, 4),
                   "acceptance_k5": round(k5.acceptance_length, 4), "train_s": round(train_s, 1),
                   "final_loss": round(metrics["loss"], 4)}
            print(json.dumps(rec), flush=True)
            with results_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
    table(results_path, steps)


def _mean_sd(recs: list[dict], key: str) -> str:
    xs = [r[key] for r in recs]
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def table(path: Path, steps: int) -> None:
    recs = [r for r in map(json.loads, path.open()) if r["steps"] == steps]
    print(f"\n| variant ({steps} steps) | seeds | acceptance k=3 | acceptance k=5 | train s |")
    print("|---|---|---|---|---|")
    for name in VARIANTS:
        mine = [r for r in recs if r["variant"] == name]
        if not mine:
            continue

        print(f"| {name} | {len(mine)} | {_mean_sd(mine, 'acceptance_k3')} | {_mean_sd(mine, 'acceptance_k5')} | "
              f"{statistics.mean(r['train_s'] for r in mine):.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out", type=Path)
    p.add_argument("target", type=Path)
    s = sub.add_parser("sweep")
    s.add_argument("out", type=Path)
    s.add_argument("--steps", type=int, default=116)
    s.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    s.add_argument("--only", nargs="*")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.out.resolve(), a.target.resolve())
    else:
        sweep(a.out.resolve(), a.steps, a.seeds, a.only)


if __name__ == "__main__":
    main()
