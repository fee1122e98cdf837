"""GPU smoke test of the SGLang source: a real ``sglang.Engine`` on one GPU, a few minutes.

Renders a handful of the shipped prompts for the target, runs them through the
pipeline's ``SGLangGenerator`` (no Ray needed) and checks the row contract:
every row comes back ok or with a reason, ids are exact engine ids that end in
the end-of-turn id unless cut at max_tokens, text fields are split by the
profile, per-sample seeds reproduce a sample regardless of its batch, and an
over-long prompt is failed without losing its batch. Greedy ids are compared
with transformers on the same GPU (reported, not asserted: kernels differ).

    python scripts/gpu_sglang_smoke.py --model-dir artifacts/tiny-target [--json $OUT/sglang_smoke.json]

Exit status 0: contract holds; 1: a check failed; 2: sglang or a GPU is missing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rendered_rows(model_dir: str, n: int) -> list[dict[str, Any]]:
    import pyarrow as pa

    from pipeline.base.config import DatasetConfig
    from pipeline.generate.stages import RenderPrompts
    from pipeline.prompts.datasets import load_dataset

    prompts = []
    for name in ("chat", "tools"):
        prompts += load_dataset(DatasetConfig(name=name, path=str(REPO / "data/prompts" / f"{name}.jsonl")))[0]
    picked = [p for _, p in zip(range(n), itertools.cycle(prompts))]
    return RenderPrompts("deepseek", model_dir)(pa.Table.from_pylist(picked)).to_pylist()


def run(stage: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from pipeline.base.flight import rows_to_table

    return stage(rows_to_table([dict(r) for r in rows])).to_pylist()


def hf_greedy(model_dir: str, rows: list[dict[str, Any]], max_tokens: int, stops: list[int]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    out = []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"]], device="cuda")
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=stops, pad_token_id=stops[0])
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(REPO / "artifacts/tiny-target"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default=None, help="e.g. triton, flashinfer, fa3")
    p.add_argument("--json", help="write the report here too")
    args = p.parse_args()

    from pipeline.generate.sources.engines.sglang_source import SGLangGenerator, sglang_available

    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not sglang_available() or not has_gpu:
        print(f"SKIP: needs sglang and a GPU (sglang installed: {sglang_available()}, GPU: {has_gpu})")
        return 2
    if not Path(args.model_dir, "config.json").is_file():
        from pipeline.demo.tiny_model import build_tiny_target

        build_tiny_target(args.model_dir)

    from pipeline.generate.sources.engines.config import SGLangSourceConfig

    engine = SGLangSourceConfig(name="sglang-gpu", dtype=args.dtype, max_model_len=2048, num_gpus=1,
                                mem_fraction_static=0.5, attention_backend=args.attention_backend)
    greedy = {"temperature": 0.0, "top_p": 1.0, "max_tokens": args.max_tokens, "seed": 0}
    sampled = {"temperature": 1.0, "top_p": 0.95, "max_tokens": args.max_tokens, "seed": 11}
    rows = rendered_rows(args.model_dir, args.prompts)
    failures: list[str] = []
    report: dict[str, Any] = {"model_dir": args.model_dir, "prompts": len(rows)}

    t0 = time.perf_counter()
    stage = SGLangGenerator(args.model_dir, "deepseek", greedy, engine)
    report["engine_start_s"] = round(time.perf_counter() - t0, 1)
    too_long = dict(rows[0], sample_id="chat:999:too-long", prompt_ids=rows[0]["prompt_ids"] * 200)
    t0 = time.perf_counter()
    out = run(stage, rows + [too_long])
    report["greedy_s"] = round(time.perf_counter() - t0, 2)
    by_id = {r["sample_id"]: r for r in out}
    if by_id["chat:999:too-long"]["status"] != "quarantine":
        failures.append(f"over-long prompt not failed: {by_id['chat:999:too-long']['status']}")
    eot = stage.profile.eot_id
    for r in out[:-1]:
        if r["status"] != "ok":
            failures.append(f"{r['sample_id']}: {r['status']} {r['reason']}")
            continue
        ids = r["output_ids"]
        if not ids or (r["finish_reason"] == "stop" and ids[-1] != eot):
            failures.append(f"{r['sample_id']}: finish {r['finish_reason']} but ids end {ids[-3:]}")
        if r["finish_reason"] == "length" and len(ids) != args.max_tokens:
            failures.append(f"{r['sample_id']}: length finish with {len(ids)} ids")
        if (r["source_kind"], r["ids_from"]) != ("sglang", "engine"):
            failures.append(f"{r['sample_id']}: provenance {r['source_kind']}/{r['ids_from']}")
    report["finish"] = {k: sum(r["finish_reason"] == k for r in out[:-1]) for k in ("stop", "length")}
    stage.shutdown()

    stage = SGLangGenerator(args.model_dir, "deepseek", sampled, engine)
    together = run(stage, rows)
    alone = run(stage, rows[3:4])
    report["seeded_sample_reproduced"] = alone[0]["output_ids"] == together[3]["output_ids"]
    if not report["seeded_sample_reproduced"]:
        failures.append("a seeded sample changed with its batch")
    if len({tuple(r["output_ids"] or []) for r in together}) < 2:
        failures.append("sampled outputs are all identical")
    stage.shutdown()

    hf = hf_greedy(args.model_dir, rows, args.max_tokens, sorted({eot}))
    same = sum(r["output_ids"] == h for r, h in zip(out[:-1], hf, strict=True))
    report["greedy_ids_equal_transformers"] = f"{same}/{len(rows)}"
    report["failures"] = failures
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
