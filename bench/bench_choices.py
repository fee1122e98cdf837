"""Drafter defaults on the ``reasoning`` tiny target: EAGLE-3 vs EAGLE-3.1, loss ``ce`` vs ``lk_lambda``, by SERVED
acceptance (vLLM) over several seeds and two budgets.

    .venv/bin/python bench/bench_choices.py --target artifacts/tiny-reasoning --work /tmp/bench_choices \
        --steps 100 1000 --seeds 0 1 2 --jobs 2 --json /tmp/bench_choices/results.json

The short answers of the shop target (tiny_domain) let every drafter accept nearly everything; the reasoning
target's 100-300 token traces (pipeline.demo.tiny_reasoning) have real branch points, so the choices can differ.

Data (once, cached in --work): 1,600 training prompts (``tiny_reasoning.conversations(1600, seed=1)``, the
rows of ``prompt_rows``) and 32 held-out ones (from seed 2, user text not in the training set), each rendered
by the DeepSeek profile with the conversation's own thinking flag (85% on, as the domain draws it). The
target's greedy responses (up to 384 tokens, to the end of turn) come from one in-process vLLM engine; hidden
states (aux layers [1, 2, 3]) and the target's argmax ids from ``training.served.rows_for``.

Per (choice, steps, seed) one worker process (1 torch thread; --jobs of them at a time) trains with
``training.train.train_loop``, exports, simulates greedy acceptance at k=3/5/7 on the held-out rows, then, holding
a lock file so one vLLM engine runs at a time, measures served acceptance at k=5 on the held-out prompts
(``training.served.served_acceptance``). The held-out rows are the target's greedy outputs, so the simulation
should equal the served figure up to float near-ties; a gap above 0.02 is flagged. A rerun skips finished runs.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

AUX_IDS = [1, 2, 3]  # a 4-layer target: the default ids collide
MAX_TOKENS = 384
HELD = 32
EAGLE3 = {"fc_norm": False, "norm_output": False}  # explicit: the library default is EAGLE-3.1
EAGLE31 = {"fc_norm": True, "norm_output": True}
CHOICES: dict[str, dict[str, Any]] = {
    "eagle3+ce": {**EAGLE3, "loss": "ce"},
    "eagle3+lk_lambda": {**EAGLE3, "loss": "lk_lambda"},
    "eagle3.1+ce": {**EAGLE31, "loss": "ce"},
    "eagle3.1+lk_lambda": {**EAGLE31, "loss": "lk_lambda"},
}
SIM_KS = (3, 5, 7)
SERVED_K = 5
GAP_FLAG = 0.02


def user_text(messages: list[dict]) -> str:
    return next(m["content"] for m in messages if m["role"] == "user")


def prompt_sets() -> tuple[list[list[int]], list[list[int]]]:
    """Token-id prompts: the training set and the held-out set (disjoint by user text)."""
    from pipeline.demo.tiny_reasoning import conversations
    from pipeline.profiles import load_profile

    profile = load_profile("deepseek")
    train = conversations(1600, 1)
    seen = {user_text(c.messages) for c in train}
    held = []
    for c in conversations(128, 2):
        if user_text(c.messages) not in seen and len(held) < HELD:
            seen.add(user_text(c.messages))
            held.append(c)

    def render(cs: list) -> list[list[int]]:
        return [list(profile.render_prompt(c.messages, None, c.thinking).ids) for c in cs]

    return render(train), render(held)


def make_data(target: str, work: Path) -> dict[str, Any]:
    """Greedy responses by one vLLM engine, then rows with states and argmax ids; pickled to work/data."""
    data = work / "data"
    if (data / "held.pkl").exists():
        return json.loads((data / "data.json").read_text())
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
    import torch

    from training.evaluate import make_engine, run_prompts, shutdown_engine
    from training.served import rows_for
    from training.target import greedy_ids, load_target_parts

    data.mkdir(parents=True, exist_ok=True)
    train_prompts, held_prompts = prompt_sets()
    prompts = train_prompts + held_prompts
    t0 = time.perf_counter()
    llm = make_engine(target, None, 1, 2048, "float32")
    try:
        outputs, gen_s = run_prompts(llm, prompts, MAX_TOKENS, stop_at_eos=True)
    finally:
        shutdown_engine(llm)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = rows_for(target, prompts, outputs, AUX_IDS)
    lm_head = load_target_parts(target).lm_head
    with torch.no_grad():
        for r in rows:  # the extraction's argmax ids: training and simulation then skip the full-vocab head
            r["target_ids"] = greedy_ids(torch.from_numpy(r["final_hidden"]), lm_head).numpy()
    t_rows = time.perf_counter() - t0
    n = len(train_prompts)
    for name, part in (("train", rows[:n]), ("held", rows[n:])):
        with open(data / f"{name}.pkl.tmp", "wb") as f:
            pickle.dump(part, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(data / f"{name}.pkl.tmp", data / f"{name}.pkl")
    lens = [len(o) for o in outputs]
    info = {"train": n, "held": len(held_prompts), "response_tokens_mean": statistics.mean(lens),
            "response_tokens_min": min(lens), "response_tokens_max": max(lens),
            "ended": sum(len(o) < MAX_TOKENS for o in outputs), "generate_s": round(t_gen, 1),
            "generate_only_s": round(gen_s, 1), "rows_s": round(t_rows, 1),
            "held_prompts": held_prompts}
    (data / "data.json").write_text(json.dumps(info))
    return info


def run_name(choice: str, steps: int, seed: int) -> str:
    return f"{choice}-s{steps}-seed{seed}"


def worker(target: str, work: Path, choice: str, steps: int, seed: int) -> None:
    """Train one drafter, simulate, then serve it (under the lock); writes work/results/NAME.json."""
    import torch

    torch.set_num_threads(1)
    from training.config import DraftTrainConfig
    from training.export import export_draft
    from training.served import served_acceptance
    from training.simulate import simulate_acceptance
    from training.target import load_target_parts
    from training.train import train_loop
    from training.vocab import build_vocab_mapping

    t_start = time.perf_counter()
    name = run_name(choice, steps, seed)
    run_dir = work / "runs" / name
    with open(work / "data" / "train.pkl", "rb") as f:
        train_rows = pickle.load(f)
    with open(work / "data" / "held.pkl", "rb") as f:
        held_rows = pickle.load(f)
    held_prompts = json.loads((work / "data" / "data.json").read_text())["held_prompts"]
    cfg = DraftTrainConfig(steps=steps, batch_tokens=2048, max_len=2048, ttt_steps=5, draft_vocab_size=512,
                           aux_layer_ids=AUX_IDS, lr=3e-3, warmup_steps=min(30, steps // 5),
                           checkpoint_every=10**9, log_every=100, seed=seed, trackers=[], **CHOICES[choice])
    parts = load_target_parts(target)
    vocab = build_vocab_mapping(train_rows, parts.vocab_size, cfg.draft_vocab_size)
    t0 = time.perf_counter()
    drafter, metrics = train_loop(cfg, target, run_dir, lambda epoch: train_rows, vocab)
    train_s = time.perf_counter() - t0
    log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    tokens = sum(m["tokens"] for m in log)
    export = export_draft(drafter, run_dir / "export", target_config=parts.config)
    t0 = time.perf_counter()
    sim = {}
    with torch.no_grad():
        for k in SIM_KS:
            s = simulate_acceptance(drafter, held_rows, parts.lm_head, k=k)
            sim[k] = {"acceptance_length": s.acceptance_length, "per_position": s.per_position, "drafts": s.num_drafts}
    sim_s = time.perf_counter() - t0
    t_wait = time.perf_counter()
    with open(work / "serve.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one vLLM engine at a time
        t0 = time.perf_counter()
        served = served_acceptance(target, str(export), held_prompts, SERVED_K, MAX_TOKENS)
        serve_s = time.perf_counter() - t0
    outputs = served.pop("outputs")
    greedy = [r["input_ids"][len(p):].tolist() for r, p in zip(held_rows, held_prompts, strict=True)]
    result = {"choice": choice, "steps": steps, "seed": seed, "train_s": train_s, "train_tokens": tokens,
              "train_tokens_per_s": tokens / train_s, "final_loss": metrics.get("loss"),
              "simulated": sim, "served": served, "served_outputs_equal_greedy": sum(
                  a == b for a, b in zip(outputs, greedy, strict=True)), "sim_s": sim_s,
              "serve_wait_s": t0 - t_wait, "serve_s": serve_s, "wall_s": time.perf_counter() - t_start}
    out = work / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".tmp").write_text(json.dumps(result, default=float))
    os.replace(out.with_suffix(".tmp"), out)


def run_grid(args: argparse.Namespace, work: Path, t_begin: float) -> list[str]:
    """Launch the workers, --jobs at a time, until the grid is done or --stop-after minutes have passed."""
    todo = [(c, s, seed) for s in args.steps for c in args.choices for seed in args.seeds
            if not (work / "results" / f"{run_name(c, s, seed)}.json").exists()]
    running: list[tuple[subprocess.Popen, str, Any]] = []
    skipped: list[str] = []
    (work / "logs").mkdir(parents=True, exist_ok=True)
    while todo or running:
        while todo and len(running) < args.jobs:
            choice, steps, seed = todo.pop(0)
            name = run_name(choice, steps, seed)
            if (time.perf_counter() - t_begin) / 60 > args.stop_after:
                skipped.append(name)
                continue
            logf = open(work / "logs" / f"{name}.log", "w")  # noqa: SIM115 - closed when the worker ends
            cmd = [sys.executable, __file__, "--target", args.target, "--work", str(work),
                   "--worker", choice, str(steps), str(seed)]
            running.append((subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                             env={**os.environ, "OMP_NUM_THREADS": "1"}), name, logf))
            print(f"[{(time.perf_counter() - t_begin) / 60:5.1f} min] started {name}", flush=True)
        time.sleep(2)
        for item in list(running):
            proc, name, logf = item
            if proc.poll() is not None:
                logf.close()
                running.remove(item)
                print(f"[{(time.perf_counter() - t_begin) / 60:5.1f} min] {name} exited {proc.returncode}", flush=True)
    return skipped


def load_results(work: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((work / "results").glob("*.json"))]


def _ms(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def summarize(results: list[dict], choices: list[str], steps_list: list[int]) -> dict[str, Any]:
    """Per (steps, choice): mean and sd over seeds of the served and simulated figures."""
    out: dict[str, Any] = {}
    for steps in steps_list:
        for choice in choices:
            mine = [r for r in results if r["steps"] == steps and r["choice"] == choice]
            if not mine:
                continue
            served = [r["served"]["acceptance_length"] for r in mine]
            out[f"{steps}:{choice}"] = {
                "steps": steps, "choice": choice, "seeds": sorted(r["seed"] for r in mine),
                "served_k5": served, "served_k5_mean": statistics.mean(served),
                "served_k5_sd": statistics.stdev(served) if len(served) > 1 else None,
                "served_per_position_k5": [statistics.mean(p) for p in
                                           zip(*(r["served"]["per_position"] for r in mine), strict=True)],
                **{f"sim_k{k}_mean": statistics.mean(r["simulated"][str(k)]["acceptance_length"] for r in mine)
                   for k in SIM_KS},
                "sim_per_position_k5": [statistics.mean(p) for p in
                                        zip(*(r["simulated"]["5"]["per_position"] for r in mine), strict=True)],
                "gaps_k5": [r["served"]["acceptance_length"] - r["simulated"]["5"]["acceptance_length"] for r in mine],
                "train_tokens_per_s": statistics.mean(r["train_tokens_per_s"] for r in mine),
                "train_s": [r["train_s"] for r in mine], "wall_s": [r["wall_s"] for r in mine],
            }
    return out


def print_tables(summary: dict[str, Any], results: list[dict]) -> None:
    for steps in sorted({v["steps"] for v in summary.values()}):
        print(f"\n| {steps} steps | seeds | served k=5 (mean ± sd) | simulated k=3 | k=5 | k=7 | served per position "
              "k=5 | simulated per position k=5 | max abs gap k=5 | train tok/s | train s (per seed) | "
              "run wall s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for v in summary.values():
            if v["steps"] != steps:
                continue
            gap = max(abs(g) for g in v["gaps_k5"])
            print(f"| {v['choice']} | {len(v['seeds'])} | {_ms(v['served_k5'])} | {v['sim_k3_mean']:.3f} | "
                  f"{v['sim_k5_mean']:.3f} | {v['sim_k7_mean']:.3f} | "
                  f"{' / '.join(f'{p:.2f}' for p in v['served_per_position_k5'])} | "
                  f"{' / '.join(f'{p:.2f}' for p in v['sim_per_position_k5'])} | "
                  f"{gap:.3f}{' FLAG' if gap > GAP_FLAG else ''} | {v['train_tokens_per_s']:,.0f} | "
                  f"{' / '.join(f'{s:.0f}' for s in v['train_s'])} | {' / '.join(f'{s:.0f}' for s in v['wall_s'])} |")
    flagged = [r for r in results
               if abs(r["served"]["acceptance_length"] - r["simulated"]["5"]["acceptance_length"]) > GAP_FLAG]
    for r in flagged:
        print(f"FLAG {run_name(r['choice'], r['steps'], r['seed'])}: served {r['served']['acceptance_length']:.4f} "
              f"simulated {r['simulated']['5']['acceptance_length']:.4f} (drafts {r['served']['drafts']} vs "
              f"{r['simulated']['5']['drafts']}; served outputs equal to greedy: {r['served_outputs_equal_greedy']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="artifacts/tiny-reasoning")
    ap.add_argument("--work", default="/tmp/bench_choices")
    ap.add_argument("--steps", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--choices", nargs="+", default=list(CHOICES), choices=list(CHOICES))
    ap.add_argument("--jobs", type=int, default=2, help="training workers at a time")
    ap.add_argument("--stop-after", type=float, default=float("inf"), help="minutes: launch no run after this")
    ap.add_argument("--json", default=None, help="write the summary and every run's figures here")
    ap.add_argument("--worker", nargs=3, metavar=("CHOICE", "STEPS", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.target = str(Path(args.target).resolve())
    work = Path(args.work).resolve()
    if args.worker:
        choice, steps, seed = args.worker
        worker(args.target, work, choice, int(steps), int(seed))
        return
    t_begin = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    info = make_data(args.target, work)
    print(f"data: {info['train']} train + {info['held']} held-out prompts, responses "
          f"{info['response_tokens_mean']:.0f} tokens on average ({info['response_tokens_min']}-"
          f"{info['response_tokens_max']}, {info['ended']} ended), "
          f"generation {info['generate_s']} s, rows {info['rows_s']} s", flush=True)
    skipped = run_grid(args, work, t_begin)
    if skipped:
        print(f"not run (past --stop-after {args.stop_after} min): {', '.join(skipped)}")
    results = [r for r in load_results(work) if r["choice"] in args.choices and r["steps"] in args.steps
               and r["seed"] in args.seeds]
    summary = summarize(results, args.choices, args.steps)
    print_tables(summary, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"data": {k: v for k, v in info.items() if k != "held_prompts"},
                                               "summary": summary, "runs": results, "skipped": skipped},
                                              indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
