"""vLLM inside a Ray Data actor versus the same engine called directly: same prompts, same run.

Both sides run the pipeline's own stage class (``VLLMGenerator``) on the same
batches of pre-rendered prompts; only the Ray Data plumbing differs. The direct
engine is timed before and after the Ray Data pass (contention on a shared
machine drifts; Ray is shut down before the second timing), and the actor's generation window runs from its engine being
ready (after the same warm-up request) to its last batch, so engine start-up,
paid once per actor, is reported separately.

    .venv/bin/python bench/bench_vllm_actor.py --prompts 64 --max-tokens 64 --batch-size 16
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def flight_rows(model_dir: str, n: int) -> list[dict[str, Any]]:
    """n rendered prompts (the shipped prompt files, cycled), as the render stage would emit them."""
    import pyarrow as pa

    from pipeline.base.config import DatasetConfig
    from pipeline.generate.stages import RenderPrompts
    from pipeline.prompts.datasets import load_dataset

    prompts = []
    for name, fmt in (("chat", "messages"), ("code", "sharegpt"), ("math", "instruction"), ("tools", "messages")):
        prompts += load_dataset(DatasetConfig(name=name, path=str(REPO / "data/prompts" / f"{name}.jsonl"),
                                              format=fmt))[0]
    picked = [dict(p, sample_id=f"{p['sample_id']}#{i}") for i, p in zip(range(n), itertools.cycle(prompts))]
    rendered = RenderPrompts("deepseek", model_dir)(pa.Table.from_pylist(picked)).to_pylist()
    assert all(r["status"] == "ok" for r in rendered)
    return rendered


class TimedVLLM:
    """The pipeline's vLLM stage plus wall-clock stamps per batch (the bench's only addition)."""

    def __init__(self, *args: Any) -> None:
        from pipeline.generate.sources.engines.vllm_source import VLLMGenerator

        t0 = time.time()
        self.stage = VLLMGenerator(*args)
        warm_up(self.stage)
        self.t_ready, self.startup_s = time.time(), time.time() - t0

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        t0 = time.time()
        out = self.stage(batch)
        n = out.num_rows
        stamps = {"t_ready": [self.t_ready] * n, "startup_s": [self.startup_s] * n, "t_start": [t0] * n,
                  "t_end": [time.time()] * n}
        for k, v in stamps.items():
            out = out.append_column(k, pa.array(v, pa.float64()))
        return out


def warm_up(stage: Any) -> None:
    stage.llm.generate([{"prompt_token_ids": [0, 1, 2]}], use_tqdm=False)


def run_direct(stage: Any, rows: list[dict[str, Any]], batch_size: int) -> tuple[float, list[list[int]]]:
    from pipeline.base.flight import rows_to_table

    t0 = time.perf_counter()
    ids: list[list[int]] = []
    for i in range(0, len(rows), batch_size):
        out = stage(rows_to_table([dict(r) for r in rows[i:i + batch_size]])).to_pylist()
        ids += [r["output_ids"] for r in out]
    return time.perf_counter() - t0, ids


def run_ray(args: argparse.Namespace, rows: list[dict[str, Any]], engine: Any,
            sampling: dict[str, Any]) -> dict[str, Any]:
    import ray
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    t0 = time.time()
    ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows) // args.batch_size))
    ds = ds.map_batches(TimedVLLM, fn_constructor_args=(args.model_dir, "deepseek", sampling, engine),
                        batch_size=args.batch_size, batch_format="pyarrow", num_cpus=1,
                        compute=ray.data.ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=2))
    out = ds.take_all()
    wall = time.time() - t0
    window = max(r["t_end"] for r in out) - out[0]["t_ready"]
    busy = sum(e - s for s, e in {(r["t_start"], r["t_end"]) for r in out})
    return {"rows": out, "wall_s": wall, "window_s": window, "busy_s": busy, "startup_s": out[0]["startup_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--model-dir", default=str(REPO / "artifacts/tiny-target"))
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()

    import ray

    from pipeline.demo.tiny_model import build_tiny_target
    from pipeline.generate.sources.engines.vllm_source import VLLMGenerator

    build_tiny_target(args.model_dir)
    rows = flight_rows(args.model_dir, args.prompts)
    sampling = {"temperature": 0.0, "top_p": 1.0, "max_tokens": args.max_tokens, "seed": 0}
    from pipeline.generate.sources.engines.config import VLLMSourceConfig

    engine = VLLMSourceConfig(name="vllm-cpu", dtype="float32", max_model_len=2048, kv_cache_gib=1)
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}})

    t0 = time.perf_counter()
    direct = VLLMGenerator(args.model_dir, "deepseek", sampling, engine)
    warm_up(direct)
    direct_startup = time.perf_counter() - t0
    before, ids_direct = run_direct(direct, rows, args.batch_size)
    actor = run_ray(args, rows, engine, sampling)
    ray.shutdown()  # the actor's engine is gone before the direct engine is timed again
    time.sleep(5)
    after, _ = run_direct(direct, rows, args.batch_size)
    n = len(rows)
    by_id = {r["sample_id"]: r["output_ids"] for r in actor["rows"]}
    same = sum(by_id[r["sample_id"]] == ids for r, ids in zip(rows, ids_direct, strict=True))
    tokens = sum(len(i) for i in ids_direct)
    direct_rate = n / ((before + after) / 2)
    actor_rate = n / actor["window_s"]
    fig = {
        "prompts": n, "max_tokens": args.max_tokens, "batch_size": args.batch_size, "tokens": tokens,
        "direct_s": [round(before, 2), round(after, 2)], "direct_samples_per_s": round(direct_rate, 2),
        "actor_window_s": round(actor["window_s"], 2), "actor_samples_per_s": round(actor_rate, 2),
        "ratio": round(actor_rate / direct_rate, 3),
        "ratio_vs_fastest_direct": round(actor_rate / (n / min(before, after)), 3),
        "actor_busy_fraction": round(actor["busy_s"] / actor["window_s"], 3),
        "actor_end_to_end_s": round(actor["wall_s"], 2), "actor_engine_startup_s": round(actor["startup_s"], 1),
        "direct_engine_startup_s": round(direct_startup, 1), "identical_ids": f"{same}/{n}",
    }
    print(json.dumps(fig, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2) + "\n")


if __name__ == "__main__":
    main()
