"""Hidden-state extraction throughput versus a bare forward pass of the same batches, and bytes per token.

    .venv/bin/python bench/bench_extract.py [--models tiny,medium] [--samples 96] [--threads 1] [--vllm]
    .venv/bin/python bench/bench_extract.py --models "" --vllm      # the vLLM backend alone

"bare" runs only what cannot be skipped (the decoder, and the target's full-vocab
argmax at real positions from the final states: no hooks, no copies) over exactly
the groups the extractor forms; "extract" is the actor's whole call (``HiddenStateExtractor``
on a pyarrow batch of sample rows: hooks, NaN/shape checks, numpy rows, the
Arrow training table, stats file). Both count real (unpadded) tokens; after
one untimed round of each, runs alternate ``--repeats`` times; the ratio uses
each mode's fastest run (on a shared machine contention only adds time), the
median ratio is reported beside it. Bytes per token come
from shards actually written (float32 and bfloat16). ``--vllm`` also runs the
vLLM ``extract_hidden_states`` backend on the tiny target and reports its
largest difference from the transformers capture.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.base.layout import RunLayout  # noqa: E402
from pipeline.hidden.extract import HiddenStateExtractor, right_pad, token_batches  # noqa: E402
from pipeline.hidden.shards import shard_meta, write_shards  # noqa: E402
from training.target import greedy_ids  # noqa: E402

MODELS = {
    # name: build overrides for tests.helpers.training.build_tiny_llama (None = the pipeline's tiny target)
    "tiny": None,
    "medium": dict(vocab_size=32_000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
}


def sample_rows(n: int, vocab: int, seed: int, lo: int = 32, hi: int = 768) -> list[dict]:
    """Sample rows with a long-tailed length mix (log-uniform between lo and hi tokens)."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(int)
    rows = []
    for j, t in enumerate(lengths):
        ids = rng.integers(3, vocab, t).tolist()
        p = t // 3
        rows.append({"sample_id": f"b{j}", "dataset": "bench", "row_index": j, "source": "bench",
                     "prompt_ids": ids[:p], "prompt_assistant_mask": [0] * p, "output_ids": ids[p:]})
    return rows


def bare_forward(model, seqs: list[list[int]], groups: list[list[int]]) -> None:
    base, lm_head = model.model, model.lm_head.weight
    with torch.inference_mode():
        for g in groups:
            final = base(input_ids=torch.from_numpy(right_pad([seqs[i] for i in g])), use_cache=False).last_hidden_state
            real = torch.arange(final.shape[1])[None, :] < torch.tensor([len(seqs[i]) for i in g])[:, None]
            greedy_ids(final[real], lm_head)


def bench_model(name: str, model_dir: str, args, work: Path) -> dict:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    aux = [1, cfg.num_hidden_layers // 2, cfg.num_hidden_layers - 1] if cfg.num_hidden_layers < 6 else \
        [2, cfg.num_hidden_layers // 2, cfg.num_hidden_layers - 3]
    rows = sample_rows(args.samples, min(cfg.vocab_size, 120_000), seed=0)
    batch = pa.Table.from_pylist(rows)
    actor = HiddenStateExtractor(model_dir, aux, 4096, "truncate", args.batch_tokens, RunLayout(work / name),
                                 stats_dir=str(work / name / "stats"))
    seqs = [r["prompt_ids"] + r["output_ids"] for r in rows]
    groups = token_batches([len(s) for s in seqs], args.batch_tokens)
    tokens = sum(map(len, seqs))
    bare_forward(actor.capture_fn.model, seqs, groups)  # untimed warm-up of both paths (allocator, kernels)
    actor(batch)
    bare_s, extract_s = [], []
    table = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        bare_forward(actor.capture_fn.model, seqs, groups)
        bare_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        table = actor(batch)
        extract_s.append(time.perf_counter() - t0)
    assert table.num_rows == len(rows)
    cols = {c: table.column(c).combine_chunks() for c in table.column_names}
    arrays = {c: (a.to_pylist() if c == "sample_id" else a.to_numpy()) for c, a in cols.items()}
    out_rows = [dict(zip(arrays, vals, strict=True)) for vals in zip(*arrays.values(), strict=True)]
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        index = write_shards(out_rows, work / name / f"shards-{dtype}", shard_meta(aux, cfg.hidden_size, dtype), 32)
        sizes[dtype] = index["bytes_per_token"]
    bare, extract = min(bare_s), min(extract_s)
    padded = sum(len(g) * max(len(seqs[i]) for i in g) for g in groups)
    return {
        "model": name, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "aux_layer_ids": aux,
        "samples": len(rows), "tokens": tokens, "padding_fraction": round(1 - tokens / padded, 4),
        "batch_tokens": args.batch_tokens, "groups": len(groups), "threads": torch.get_num_threads(),
        "bare_tokens_per_s": round(tokens / bare, 1), "extract_tokens_per_s": round(tokens / extract, 1),
        "ratio": round(bare / extract, 3),
        "ratio_median": round(statistics.median(bare_s) / statistics.median(extract_s), 3),
        "bytes_per_token_fp32": sizes["float32"],
        "bytes_per_token_bf16": sizes["bfloat16"], "peak_rss_mb": json.loads(
            next((work / name / "stats").glob("*.json")).read_text())["peak_rss_mb"],
        "runs_s": {"bare": [round(x, 3) for x in bare_s], "extract": [round(x, 3) for x in extract_s]},
    }


def bench_vllm(model_dir: str, args) -> dict:
    """The engine backend on the tiny target: agreement with transformers, and tokens/s after warm-up."""
    from pipeline.hidden.extract import VLLMStateCapture, capture, load_target

    aux = [1, 2, 3]
    rows = sample_rows(min(args.samples, 32), 120_000, seed=1, hi=512)
    seqs = [r["prompt_ids"] + r["output_ids"] for r in rows]
    t0 = time.perf_counter()
    engine = VLLMStateCapture(model_dir, aux, 2048, dtype="float32")
    start_s = time.perf_counter() - t0
    list(engine(seqs[:2], []))
    t0 = time.perf_counter()
    got = list(engine(seqs, []))
    run_s = time.perf_counter() - t0
    model = load_target(model_dir)[0]
    worst, same_ids = 0.0, 0
    for c in got:
        assert c.error is None, c.error
        (i,) = c.indices
        aux_ref, final_ref = capture(model, [seqs[i]], aux)[0]
        ref = np.concatenate([aux_ref, final_ref], axis=-1)
        worst = max(worst, float(np.abs(c.states[0].float().numpy() - ref).max() / np.abs(ref).max()))
        with torch.inference_mode():
            greedy = model(torch.tensor([seqs[i]])).logits[0].argmax(-1)
        same_ids += int((c.target_ids[0] == greedy).sum())
    tokens = sum(map(len, seqs))
    return {"backend": "vllm extract_hidden_states", "engine_start_s": round(start_s, 1), "samples": len(seqs),
            "tokens": tokens, "tokens_per_s": round(tokens / run_s, 1), "max_rel_diff_vs_transformers": worst,
            "target_ids_agree_with_transformers": round(same_ids / tokens, 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm", action="store_true", help="also run the vLLM backend on the tiny target")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pipeline.demo.tiny_model import build_tiny_target
    from tests.helpers.training import build_tiny_llama

    repo = Path(__file__).resolve().parents[1]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        work = Path(tmp)
        for name in filter(None, args.models.split(",")):
            overrides = MODELS[name]
            model_dir = build_tiny_target(repo / "artifacts" / "tiny-target") if overrides is None \
                else build_tiny_llama(work / name / "model", seed=0, **overrides)
            res = bench_model(name, str(model_dir), args, work)
            print(json.dumps(res), flush=True)
            results.append(res)
        if args.vllm:
            res = bench_vllm(str(build_tiny_target(repo / "artifacts" / "tiny-target")), args)
            print(json.dumps(res), flush=True)
            results.append(res)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    for r in results:
        if "ratio" in r:
            print(f"| {r['model']} (H={r['hidden']}, L={r['layers']}) | {r['tokens']} | {r['bare_tokens_per_s']} | "
                  f"{r['extract_tokens_per_s']} | **{r['ratio']}** | {r['bytes_per_token_fp32']} / "
                  f"{r['bytes_per_token_bf16']} | {r['peak_rss_mb']} |")


if __name__ == "__main__":
    main()
