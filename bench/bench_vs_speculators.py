"""Side-by-side drafter bench with speculators 0.9.0 (issue #20): write the shared prompts and this
project's config, both from the trained tiny target's domain (pipeline.demo.tiny_domain).

usage: .venv/bin/python bench/bench_vs_speculators.py OUT_DIR TARGET_DIR [--train 1600] [--heldout 32]
         [--steps N] [--draft-vocab 256] [--domain shop|reasoning] [--ttt 3] [--max-tokens 128]
Writes under OUT_DIR/data:
  prompts_train.jsonl      {"id", "prompt"}  (speculators regenerate-responses, as mk_prompts.py writes)
  shop_train.jsonl         {"messages": [...]} (this project's `messages` dataset; the same prompts)
  prompts_heldout.txt      one prompt per line (vllm_accept.py --prompts), disjoint from the train set
and OUT_DIR/project.yaml (this project's run). Train prompts: prompt_rows(n, seed=1); held-out: seed=2.
Only the user message of each row is kept (vllm_accept.py and regenerate-responses send one user turn),
so the ~30% of rows with a system prompt lose it on both sides alike.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pipeline.demo import tiny_domain, tiny_reasoning  # noqa: E402

DOMAINS = {"shop": tiny_domain, "reasoning": tiny_reasoning}


def user_text(row: dict) -> str:
    return next(m["content"] for m in row["messages"] if m["role"] == "user")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("target")
    ap.add_argument("--train", type=int, default=1600)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--steps", type=int, default=0, help="training steps for this project (0: skip yaml)")
    ap.add_argument("--draft-vocab", type=int, default=256)
    ap.add_argument("--domain", choices=sorted(DOMAINS), default="shop", help="the target's domain (tiny_domain: "
                    "the trained target; tiny_reasoning: the reasoning target)")
    ap.add_argument("--ttt", type=int, default=3, help="TTT steps of this project's run")
    ap.add_argument("--max-tokens", type=int, default=128, help="response cap of this project's generation")
    a = ap.parse_args()
    prompt_rows = DOMAINS[a.domain].prompt_rows
    d = os.path.join(a.out, "data")
    os.makedirs(d, exist_ok=True)
    train = [user_text(r) for r in prompt_rows(a.train, 1)]
    seen = set(train)
    held: list[str] = []
    for r in prompt_rows(a.heldout * 4, 2):
        p = user_text(r)
        if p not in seen and len(held) < a.heldout:
            seen.add(p)
            held.append(p)
    with open(os.path.join(d, "prompts_train.jsonl"), "w") as f:
        for i, p in enumerate(train):
            f.write(json.dumps({"id": f"p{i:05d}", "prompt": p}) + "\n")
    with open(os.path.join(d, "shop_train.jsonl"), "w") as f:
        for p in train:
            f.write(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n")
    with open(os.path.join(d, "prompts_heldout.txt"), "w") as f:
        f.writelines(p + "\n" for p in held)
    print(f"train={len(train)} (distinct {len(set(train))}) heldout={len(held)} -> {d}")
    if a.steps:
        yaml = f"""# written by bench/bench_vs_speculators.py: like-for-like with speculators 0.9.0
output_dir: {a.out}/project_run
model:
  profile: deepseek
  path: {a.target}
sampling:
  temperature: 0.0
  top_p: 1.0
  max_tokens: {a.max_tokens}
  seed: 0
datasets:
  - {{name: shop_train, path: {d}/shop_train.jsonl, format: messages, thinking: false}}
sources:
  - kind: vllm
    name: vllm-cpu
    num_actors: 1
    num_cpus: 1
    batch_size: 32
    dtype: float32
    max_model_len: 2048
extraction:
  aux_layer_ids: [1, 2, 3]
  batch_tokens: 4096
  max_len: 2048
  num_cpus: 0.5
training:
  steps: {a.steps}
  batch_tokens: 2048
  max_len: 2048
  ttt_steps: {a.ttt}
  draft_vocab_size: {a.draft_vocab}
  checkpoint_every: {a.steps}
  log_every: 20
  heldout_fraction: 0.0
"""
        with open(os.path.join(a.out, "project.yaml"), "w") as f:
            f.write(yaml)
        print("wrote", os.path.join(a.out, "project.yaml"))


if __name__ == "__main__":
    main()
