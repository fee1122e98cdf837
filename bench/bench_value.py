"""Does the plan's split of the next dollars buy more acceptance than an even split? Measured, not predicted.

One tiny target serves two domains (``mixed``: pipeline/demo/tiny_mixed.py): shop sums, whose ~30-token answers
a drafter learns from a few dozen samples, and multi-step word problems, whose 100-300 token traces keep paying
for more. A paid source (the stand-in OpenRouter server, tiny target behind it, billing ``usage.cost`` per
completion token) serves a base run with deliberately unequal budgets: many shop prompts, few reasoning ones.
Then, with the project's own commands:

1. ``value`` on the base run: short drafters on nested cuts of each dataset, curves of held-out mix acceptance
   against each dataset's dollars;
2. ``plan --budget-usd X --mix shop=1 reasoning=1``: the next X dollars per dataset, as a config fragment;
3. two follow-up runs, each a copy of the base folder resumed with more rows: one with the plan's fragment, one
   with an even split of the same X (the same keys, computed by the same code from the plan's even split);
4. for the base run and both follow-ups, full drafters trained on every passed sample at several seeds, the same
   steps each, measured on one fixed evaluation set (a separate run over fresh prompts of both domains,
   weighted 1:1 as the mix), with the simulated greedy acceptance at k=5 (exact for greedy targets).

The figures: each run's added dollars as the provider billed them (the server's own bill log), samples per
dataset, acceptance per dataset and on the mix (mean ± sd over seeds), and the plan's predicted gain beside the
measured one.

    python bench/bench_value.py [--work /tmp/bench_value] [--seeds 0,1,2] [--steps 150] [--budget-ratio 1]

``--value-steps N`` trains the value drafters N steps instead of the runs' ``--steps``.

The final drafters train ``--steps`` each by default; ``--final-steps N`` gives every run N steps, ``--final-epochs
E`` gives each run E passes over its own samples. ``--finals-only`` trains and measures them again on the runs an
earlier invocation left in ``--work`` (into ``final_s{N}/`` or ``final_e{E}/``), ``--final-runs`` picks the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIX = {"shop": 0.5, "reasoning": 0.5}
PRICE = 2e-6  # USD per completion token
# The unequal base: shop's dollars many times what its curve needs. At 160 shop rows (the 2026-12-04 record) the
# value drafters, on 111 of them, still gained on shop at every cut, so the base did not do what it was for.
BASE_ROWS = {"shop": 400, "reasoning": 24}
POOL_ROWS = 1000  # prompts per dataset file: room for any follow-up (an even split adds ~260 shop rows)
EVAL_ROWS = 48  # per dataset, fresh prompts: the one evaluation set every drafter is measured on
SEEDS = {"shop": 7101, "reasoning": 7102, "shop_eval": 7201, "reasoning_eval": 7202}


def log(msg: str) -> None:
    print(f"[bench] {time.strftime('%H:%M:%S')} {msg}", flush=True)


def write_prompts(work: Path) -> dict[str, Path]:
    from pipeline.demo import tiny_domain, tiny_reasoning

    out = {}
    for name, seed in SEEDS.items():
        gen = tiny_domain if name.startswith("shop") else tiny_reasoning
        path = work / "prompts" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = gen.prompt_rows(EVAL_ROWS if name.endswith("_eval") else POOL_ROWS, seed)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[name] = path
    return out


def start_server(target: Path, work: Path) -> tuple[subprocess.Popen, str, Path]:
    bills = work / "bills.jsonl"
    bills.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve-openrouter", "--port", "0", "--model-dir",
                             str(target), "--providers", "solo", "--delay-ms", "0", "--bill-log", str(bills),
                             "--seed", "0"], stdout=subprocess.PIPE, stderr=(work / "server.log").open("w"),
                            text=True)
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        raise SystemExit(f"the stand-in server did not start: {line!r} (see {work / 'server.log'})")
    return proc, line.split()[1], bills


def config(out: Path, target: Path, url: str, datasets: dict[str, tuple[Path, int]], steps: int,
           budgets_usd: dict[str, float], training: bool = True) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "output_dir": str(out),
        "model": {"profile": "deepseek", "path": str(target), "build_tiny": True, "tiny_variant": "mixed"},
        "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 384, "seed": 0},
        "datasets": [{"name": n, "path": str(p), "format": "messages", "max_rows": rows}
                     for n, (p, rows) in datasets.items()],
        "sources": [{"kind": "openrouter", "name": "api", "base_url": url, "model": "tiny/deepseek-tiny",
                     "api_key_required": False, "num_actors": 1, "batch_size": 8, "max_in_flight": 8,
                     "max_concurrent_batches": 1, "request_timeout_s": 300.0, "budgets_usd": budgets_usd,
                     "prices": {"prompt_usd_per_mtok": 0.0, "completion_usd_per_mtok": PRICE * 1e6}}],
        "extraction": {"mode": "shards", "batch_tokens": 4096, "max_len": 2048, "num_cpus": 0.5},
        "training": {"steps": steps, "batch_tokens": 4096, "max_len": 512, "ttt_steps": 5, "eval_k": 5,
                     "lr": 3.0e-3, "draft_vocab_size": 640, "checkpoint_every": steps, "log_every": 50,
                     "heldout_fraction": 0.3} if training else None,
    }
    return cfg


def cli(work: Path, name: str, *args: str, ok: tuple[int, ...] = (0,)) -> str:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    (work / f"{name}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode not in ok:
        raise SystemExit(f"`python -m pipeline {' '.join(args)}` exited {proc.returncode}: see {work / name}.log\n"
                         + proc.stderr[-2000:])
    log(f"{' '.join(args[:2])}: exit {proc.returncode}, {time.perf_counter() - t0:.0f}s")
    return proc.stdout


def write_yaml(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def billed(bills: Path) -> float:
    """Dollars the provider billed so far, from its own log."""
    if not bills.exists():
        return 0.0
    return sum(float(json.loads(ln)["cost"]) for ln in bills.read_text().splitlines() if ln.strip())


def passed(out: Path) -> dict[str, str]:
    """sample id -> dataset of every passed sample that has hidden states."""
    from pipeline.base.records import read_samples
    from pipeline.hidden.shards import completed_sample_ids

    have = completed_sample_ids(out / "hidden")
    rows, _ = read_samples(out / "samples", ["sample_id", "dataset"])
    return {r["sample_id"]: r["dataset"] for r in rows if r["sample_id"] in have}


def even_fragment(cfg_path: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """The config keys that spend the plan's even split, made by the same code that makes the plan's."""
    from pipeline.base.layout import RunLayout
    from pipeline.run.config import load_config
    from pipeline.run.plan import room, run_fragment

    cfg = load_config(str(cfg_path))
    layout = RunLayout(cfg.output_dir)
    rows = []
    for r in plan["datasets"]:
        add = plan["even_split"]["add_usd"][r["dataset"]]
        rows.append({**r, "add_usd": add, "add_samples": round(add / r["usd_per_sample"])})
    return run_fragment(cfg, layout, {**plan, "datasets": rows}, room(cfg, layout))


def apply(cfg: dict[str, Any], frag: dict[str, Any]) -> dict[str, Any]:
    cfg = json.loads(json.dumps(cfg))
    for d in cfg["datasets"]:
        d.update(frag["datasets"].get(d["name"], {}))
    for s in cfg["sources"]:
        for key, caps in (frag.get("sources", {}).get(s["name"]) or {}).items():
            s[key] = {**s.get(key, {}), **caps}
    return cfg


def run_tokens(out: Path, keep: Mapping[str, str]) -> int:
    """Prompt and answer tokens of the run's samples in ``keep`` (``passed``): what one epoch reads."""
    from pipeline.base.records import read_samples

    rows, _ = read_samples(out / "samples", ["sample_id", "prompt_ids", "output_ids"])
    return sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows if r["sample_id"] in keep)


def final_steps(out: Path, keep: Mapping[str, str], train: dict[str, Any], epochs: float | None) -> int:
    """The steps of a run's final drafters: the training config's, or ``epochs`` passes over its samples (batches
    of ``batch_tokens`` packed tokens), so a run with more samples trains longer."""
    if epochs is None:
        return int(train["steps"])
    return max(1, math.ceil(epochs * run_tokens(out, keep) / int(train["batch_tokens"])))


def final_drafters(runs: dict[str, Path], eval_out: Path, target: Path, train: dict[str, Any], seeds: list[int],
                   work: Path, epochs: float | None = None, folder: str = "final") -> dict[str, list[dict[str, Any]]]:
    """Per run, per seed: a full drafter on every passed sample, measured on the evaluation set; ``epochs``:
    steps in proportion to the run's tokens (``final_steps``) rather than the same steps for every run."""
    import ray

    from pipeline.base.layout import RunLayout
    from pipeline.hidden.handoff import sample_labels
    from pipeline.hidden.shards import load_index, read_hidden_shards
    from pipeline.value.arms import Arm, train_arm
    from pipeline.value.points import by_dataset, mix_figure
    from training.config import DraftTrainConfig
    from training.heldout import heldout_acceptance

    eval_rows = list(read_hidden_shards(eval_out / "hidden"))
    eval_labels = sample_labels(RunLayout(eval_out), [r["sample_id"] for r in eval_rows])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    task = ray.remote(train_arm).options(num_cpus=1)
    pending = {}
    for name, out in runs.items():
        aux = (load_index(out / "hidden").get("meta") or {})["aux_layer_ids"]
        datasets = passed(out)
        steps = final_steps(out, datasets, train, epochs)
        cfg = DraftTrainConfig.model_validate(train).model_copy(
            update={"aux_layer_ids": list(aux), "steps": steps, "checkpoint_every": steps})
        log(f"final drafters of {name}: {steps} steps each")
        for seed in seeds:
            arm = Arm(None, 1.0, seed)
            ref = task.remote(arm, train_cfg=cfg.model_dump(mode="json"), target_dir=str(target),
                              hidden_dir=str(out / "hidden"), arm_dir=str(work / folder / name / arm.name),
                              datasets=datasets, labels={}, heldout_fraction=0.0, heldout_max=1)
            pending[ref] = (name, seed, datasets, steps)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in runs}
    while pending:
        [ref], _ = ray.wait(list(pending), num_returns=1)
        name, seed, datasets, steps = pending.pop(ref)
        ray.get(ref)
        export = work / folder / name / Arm(None, 1.0, seed).name / "export"
        held = heldout_acceptance(export, target, eval_rows, 5, eval_labels)
        fig = mix_figure(held, MIX)
        per = {d: g["acceptance_length"] for d, g in by_dataset(held).items()}
        results[name].append({"seed": seed, "mix": fig[0] if fig else None, **per,
                              "train": {d: sum(1 for v in datasets.values() if v == d) for d in MIX},
                              "steps": steps})
        log(f"drafter {name} seed {seed}: mix {fig[0]:.3f} " + " ".join(f"{d} {v:.3f}" for d, v in per.items()))
    ray.shutdown()
    return results


def mean_sd(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def pipeline_runs(args: argparse.Namespace, work: Path, target: Path, base_rows: dict[str, int]) -> dict[str, Any]:
    """The base run, `value`, `plan`, the two follow-ups and the evaluation run, through the project's CLI."""
    prompts = write_prompts(work)
    server, url, bills = start_server(target, work)
    try:
        for sub in ("base", "plan", "even", "eval", "final"):
            shutil.rmtree(work / sub, ignore_errors=True)
        open_caps = {"shop": 1.0, "reasoning": 1.0}  # far above what the rows cost: the rows bound the base run
        base = config(work / "base", target, url, {d: (prompts[d], base_rows[d]) for d in MIX}, args.steps,
                      open_caps)
        base_yaml = write_yaml(work / "base.yaml", base)
        cli(work, "base", "run", str(base_yaml))
        base_usd = billed(bills)
        log(f"base run: ${base_usd:.6f} billed")
        value_out = cli(work, "value", "value", str(base_yaml), "--datasets", "shop,reasoning", "--fractions",
                        "0,0.25,0.5", "--seeds", args.value_seeds, "--steps", str(args.value_steps))
        print(value_out, end="")
        budget = args.budget_ratio * base_usd
        plan_out = cli(work, "plan", "plan", str(base_yaml), "--budget-usd", f"{budget:.9f}", "--mix", "shop=1",
                       "reasoning=1")
        print(plan_out, end="")
        plan = json.loads((work / "base" / "value" / "plan.json").read_text())
        frags = {"plan": plan["fragment"], "even": even_fragment(base_yaml, plan)}
        spent = {}
        for name, frag in frags.items():
            shutil.copytree(work / "base", work / name, ignore=shutil.ignore_patterns("value"))
            cfg = apply(base, frag) | {"output_dir": str(work / name)}
            before = billed(bills)
            cli(work, name, "run", str(write_yaml(work / f"{name}.yaml", cfg)), ok=(0, 3))
            spent[name] = billed(bills) - before
            log(f"{name} run: +${spent[name]:.6f} billed ({json.dumps(frag)})")
        ev = config(work / "eval", target, url, {d: (prompts[f"{d}_eval"], EVAL_ROWS) for d in MIX}, args.steps,
                    {"shop": 1.0, "reasoning": 1.0}, training=False)
        cli(work, "eval", "run", str(write_yaml(work / "eval.yaml", ev)))
    finally:
        server.terminate()
        server.wait(30)
    return {"base": base, "plan": plan, "frags": frags, "spent": spent, "budget": budget, "base_usd": base_usd}


def earlier_runs(work: Path) -> dict[str, Any]:
    """What ``pipeline_runs`` returned in an earlier invocation: from its summary, or (a summary written before
    it kept them) from the files that invocation left."""
    summary = json.loads((work / "bench_value.json").read_text())
    if "runs" in summary:
        return summary["runs"]
    return {"base": yaml.safe_load((work / "base.yaml").read_text()),
            "plan": json.loads((work / "base" / "value" / "plan.json").read_text()),
            "frags": summary["fragments"], "spent": summary["spent_usd"], "budget": summary["budget_usd"],
            "base_usd": summary["base_usd"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_value"))
    ap.add_argument("--target", type=Path, default=Path("artifacts/tiny-mixed"))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--value-seeds", default="0,1", help="seeds of the value drafters (each repeats every arm)")
    ap.add_argument("--value-steps", type=int, default=None,
                    help="steps of every value drafter (default: --steps, the runs' training config)")
    ap.add_argument("--base-rows", default=",".join(f"{k}={v}" for k, v in BASE_ROWS.items()),
                    help="prompts of each dataset in the base run, e.g. shop=400,reasoning=24")
    ap.add_argument("--budget-ratio", type=float, default=1.0, help="the next budget, in base runs' spend")
    ap.add_argument("--final-epochs", type=float, default=None,
                    help="train each run's final drafters for this many passes over its samples (steps in "
                         "proportion to its tokens) instead of --steps")
    ap.add_argument("--final-steps", type=int, default=None,
                    help="train every run's final drafters for this many steps (default: --steps)")
    ap.add_argument("--final-runs", default="base,plan,even", help="the runs whose final drafters are trained")
    ap.add_argument("--finals-only", action="store_true",
                    help="reuse the runs an earlier invocation left in --work; train and measure the final drafters")
    args = ap.parse_args()
    args.value_steps = args.value_steps or args.steps
    seeds = [int(s) for s in args.seeds.split(",")]
    base_rows = {k: int(v) for k, v in (kv.split("=") for kv in args.base_rows.split(","))}
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    from pipeline.demo.tiny_model import build_tiny_target

    target = build_tiny_target(args.target.resolve(), variant="mixed")
    if args.finals_only:  # the runs of an earlier invocation in --work, their drafters trained again
        ran = earlier_runs(work)
    else:
        ran = pipeline_runs(args, work, target, base_rows)
        (work / "bench_value.json").write_text(json.dumps({"runs": ran}, indent=1))
    folder = ("final" if args.final_epochs is None and args.final_steps is None else
              f"final_e{args.final_epochs:g}" if args.final_epochs is not None else f"final_s{args.final_steps}")
    base, plan, frags, spent = ran["base"], ran["plan"], ran["frags"], ran["spent"]
    budget, base_usd = ran["budget"], ran["base_usd"]
    train = dict(base["training"]) | ({"steps": args.final_steps} if args.final_steps else {})
    runs = {name: work / name for name in args.final_runs.split(",")}
    results = final_drafters(runs, work / "eval", target, train, seeds, work, args.final_epochs, folder)
    base_mix = statistics.mean(r["mix"] for r in results["base"]) if "base" in results else None
    predicted = {"plan": plan["predicted"], "even": plan["even_split"]["predicted"]}
    summary = {"budget_usd": budget, "base_usd": base_usd, "spent_usd": spent, "plan": plan["datasets"],
               "fragments": frags, "results": results, "predicted": predicted, "steps": args.steps,
               "final_epochs": args.final_epochs, "value_steps": args.value_steps, "runs": ran,
               "seconds": round(time.perf_counter() - t_start)}
    (work / ("bench_value.json" if folder == "final" else f"bench_value_{folder}.json")).write_text(
        json.dumps(summary, indent=1))
    steps = ", ".join(f"{name} {res[0]['steps']}" for name, res in results.items())
    print(f"\nnext budget ${budget:.6f} (base run billed ${base_usd:.6f}); final drafters' steps: {steps}; "
          f"seeds {seeds}; mix {MIX}; evaluation set {EVAL_ROWS} prompts per dataset")
    for r in plan["datasets"]:
        print(f"  plan: {r['dataset']}: +${r['add_usd']:.6f} ({r['add_samples']} samples), slope now "
              f"{r['slope_now']:.4g} per $")
    print("| run | added $ (billed) | train samples shop / reasoning | shop | reasoning | mix | mix gain | predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in results.items():
        counts = res[0]["train"]
        mix = [r["mix"] for r in res]
        gain = statistics.mean(mix) - base_mix if base_mix is not None else None
        pred = predicted.get(name)
        pred_s = f"{pred['gain']:+.3f}" + (f" ± {pred['sd']:.3f}" if pred and pred.get("sd") is not None else "") \
            if pred else ""
        print(f"| {name} | {spent.get(name, base_usd):.6f} | {counts['shop']} / {counts['reasoning']} | "
              f"{mean_sd([r['shop'] for r in res])} | {mean_sd([r['reasoning'] for r in res])} | {mean_sd(mix)} | "
              f"{'' if gain is None or name == 'base' else f'{gain:+.3f}'} | {pred_s} |")
    by_seed = {name: {r["seed"]: r["mix"] for r in res} for name, res in results.items()}
    d = [by_seed["plan"][s] - by_seed["even"][s] for s in seeds]  # paired: the same seed, the same init
    print(f"plan - even on the mix, paired by seed: {mean_sd(d)} (min {min(d):+.3f})")
    print(f"total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
